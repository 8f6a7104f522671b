"""`specserve models`: build the offline model pair from its recipe."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from specserve.tooling.cli.app import app

models_app = typer.Typer(no_args_is_help=True, help="Build and inspect the offline model pair.")
app.add_typer(models_app, name="models")


@models_app.command("build")
def models_build(
    out: Path = typer.Option(Path(".cache/models"), help="Directory that holds built pairs."),
    preset: str = typer.Option("demo", help="demo (the shipped pair's recipe), default, tiny or micro."),
    force: bool = typer.Option(False, help="Rebuild even if a cached pair matches the config."),
    shipped: Path = typer.Option(Path("models") / "specserve-demo-v1", help="The committed pair to compare with."),
) -> None:
    """Build the tokenizer, target and distilled draft offline (cached by config hash). The
    demo preset is the recipe of the committed pair: the build says whether this machine
    reproduced its weights exactly (same sha256) or not (another CPU type rounds differently)."""
    from specserve.tooling.modelbuild.build import PRESETS, build_pair

    if preset not in PRESETS:
        raise typer.BadParameter(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    path = build_pair(PRESETS[preset], out, force=force, log=typer.echo)
    meta = json.loads((path / "build.json").read_text())
    typer.echo(f"pair ready: {path}")
    # equal digests mean identical weights and tokenizer: compare them before comparing benchmarks
    typer.echo(f"weights sha256: {meta['weights_sha256']}")
    card = shipped / "build.json"
    if preset == "demo" and card.exists():
        committed = json.loads(card.read_text())
        if committed["digest"] != meta["digest"]:
            typer.echo(f"the committed pair was built from another config ({committed['digest']}): not comparable")
        elif committed["weights_sha256"] == meta["weights_sha256"]:
            typer.echo(f"identical to the committed pair ({shipped}): this machine reproduces it exactly")
        else:
            typer.echo(f"differs from the committed pair ({committed['weights_sha256'][:12]}...): same recipe, "
                       "other rounding (bf16 autocast and thread splits differ by CPU type); every service "
                       f"keeps serving the committed {shipped}")


@models_app.command("eagle")
def models_eagle(
    target: Path = typer.Option(Path("models") / "specserve-demo-v1" / "target",
                                help="The target's Hugging Face directory (any Llama-family model)."),
    out: Path = typer.Option(Path(".cache/models/eagle"), help="Where the head goes (config, weights, build.json)."),
    steps: int = typer.Option(1400, help="Training steps (the shipped head's recipe: 1400, about 52 min on 2 cores)."),
    layers: str = typer.Option("", help="The target's layers whose outputs are the feature, e.g. 1,3,5 (EAGLE-3's "
                                        "low/mid/high); empty: its last layer."),
    prompts: Path = typer.Option(Path("models") / "specserve-demo-v1", help="A pair directory whose held-out "
                                 "prompts measure the head's acceptance (nothing when it has none)."),
) -> None:
    """Train an EAGLE-style draft head for a target (ADR 0020), offline, by the shipped head's
    deterministic recipe: the target's features on the project's own corpus, a head that
    predicts the next feature, its acceptance measured on held-out prompts."""
    from specserve.tooling.modelbuild.build import load_eval_prompts
    from specserve.tooling.modelbuild.eagle import HeadRecipe, build_head

    feature_layers = tuple(int(x) for x in layers.split(",")) if layers.strip() else None
    recipe = HeadRecipe(feature_layers=feature_layers, steps=steps)
    held = load_eval_prompts(prompts) if (prompts / "eval_prompts.json").exists() else None
    record = build_head(target, out, recipe, held, log=typer.echo)
    typer.echo(f"head ready: {out} ({record['params'] / 1e6:.2f} M parameters, {record['seconds'] / 60:.1f} min, "
               f"weights sha256 {record['weights_sha256'][:16]})")
    small = None
    if held and (prompts / "draft" / "config.json").exists():  # the pair's draft model, by the same measure
        import torch

        from specserve.models.loading import load_model, load_tokenizer
        from specserve.tooling.modelbuild.eagle import draft_model_acceptance

        small = draft_model_acceptance(load_model(str(prompts / "draft"), dtype=torch.float32).eval(),
                                       load_model(str(target), dtype=torch.float32).eval(),
                                       load_tokenizer(str(target)), held)
        typer.echo("the pair's draft model by the same measure: " + ", ".join(
            f"{c} {r['mean_accepted']:.2f}" for c, r in small.items()))
    from specserve.tooling.modelbuild.eagle import write_card

    layers_arg = f" --layers {layers}" if layers.strip() else ""
    write_card(out, record, small, f"specserve models eagle --steps {steps}{layers_arg}")


@models_app.command("adapter")
def models_adapter(
    pair: Path = typer.Option(Path("models") / "specserve-demo-v1", help="The pair (target/ and draft/) to adapt."),
    out: Path = typer.Option(Path(".cache/models/adapters/records-nested"),
                             help="Where the adapter goes: target/ and draft/ (PEFT), eval_prompts.json, build.json."),
    target_steps: int = typer.Option(300, help="Training steps of the target's LoRA (the shipped adapter's recipe)."),
    draft_steps: int = typer.Option(300, help="Distillation steps of the draft's LoRA."),
    threads: int = typer.Option(2, help="Training threads (fixed: a matmul's rounding follows its thread split)."),
) -> None:
    """Train the demo LoRA adapter for the pair's target (records in a nested JSON layout) and its
    draft-side adapter, offline, by the shipped adapter's deterministic recipe (ADR 0029)."""
    from specserve.tooling.modelbuild.adapter import AdapterRecipe, build_adapter, write_card

    recipe = AdapterRecipe(target_steps=target_steps, draft_steps=draft_steps, threads=threads)
    record = build_adapter(pair, out, recipe, log=typer.echo)
    h = record["heldout"]
    typer.echo(f"adapter ready: {out} ({record['train_seconds'] / 60:.1f} min of training); held-out: nested layout "
               f"{h['nested_share']['base']:.0%} of the base's answers, {h['nested_share']['adapter']:.0%} of the "
               f"adapter's; accepted drafts a round (K = 4): base draft {h['mean_accepted_k4']['base_draft']:.2f}, "
               f"the adapter's draft {h['mean_accepted_k4']['adapter_draft']:.2f} ({h['ratio']:.2f}x)")
    write_card(out, record, f"specserve models adapter --target-steps {target_steps} --draft-steps {draft_steps}")
