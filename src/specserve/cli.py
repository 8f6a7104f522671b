"""The `specserve` command line."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import typer

if not sys.stdout.isatty():  # CI has no terminal: no progress bars from libraries either
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TQDM_DISABLE", "1")

app = typer.Typer(no_args_is_help=True, add_completion=False, help="specserve: distributed, lossless speculative decoding")
models_app = typer.Typer(no_args_is_help=True, help="Build and inspect the offline model pair.")
app.add_typer(models_app, name="models")


@models_app.command("build")
def models_build(
    out: Path = typer.Option(Path("models"), help="Directory that holds built pairs."),
    preset: str = typer.Option("default", help="default (make run / bench) or tiny (tests)."),
    force: bool = typer.Option(False, help="Rebuild even if a cached pair matches the config."),
) -> None:
    """Build the tokenizer, target and distilled draft offline (cached by config hash)."""
    from specserve.modelbuild.build import PRESETS, build_pair

    if preset not in PRESETS:
        raise typer.BadParameter(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    path = build_pair(PRESETS[preset], out, force=force, log=typer.echo)
    typer.echo(f"pair ready: {path}")


@app.command("demo")
def demo(
    models: Path = typer.Option(Path("models"), help="Directory that holds built pairs."),
    preset: str = typer.Option("default", help="Which built pair to use."),
    max_tokens: int = typer.Option(48, help="Tokens per request."),
    k: int = typer.Option(4, "--k", help="Draft tokens per round (K)."),
) -> None:
    """The in-process engine on one held-out prompt per workload class: speculation off
    (plain target decoding) vs on (model drafter and n-gram drafter)."""
    import time

    import torch
    from rich.console import Console
    from rich.table import Table

    from specserve.drafters import HFDrafter, NgramDrafter
    from specserve.engine import GenerationParams, SpecEngine
    from specserve.loading import load_pair
    from specserve.modelbuild.build import PRESETS, build_pair, load_eval_prompts
    from specserve.verifier import TargetModel

    torch.set_num_threads(2)
    pair_path = build_pair(PRESETS[preset], models, log=typer.echo)
    pair = load_pair(str(pair_path / "target"), str(pair_path / "draft"))
    target = TargetModel(pair.target)
    if pair.draft is None:
        raise typer.BadParameter(f"{pair_path} has no draft model")
    engines = {
        "off (plain)": SpecEngine(target, None, pair.tokenizer),
        "model draft": SpecEngine(target, HFDrafter(pair.draft), pair.tokenizer),
        "n-gram draft": SpecEngine(target, NgramDrafter(target.vocab_size), pair.tokenizer),
    }
    console = Console(force_terminal=False) if not sys.stdout.isatty() else Console()
    prompts = load_eval_prompts(pair_path)
    table = Table(title=f"specserve in-process engine, greedy, K={k}, {max_tokens} tokens")
    for col in ("class", "speculation", "ms/token", "speedup", "mean accepted", "same text as plain"):
        table.add_column(col)
    for cls in ("code", "chat", "extraction"):
        prompt = next(p["prompt"] for p in prompts if p["workload_class"] == cls)
        results = {}
        for name, engine in engines.items():
            params = GenerationParams(max_tokens=max_tokens, num_draft_tokens=0 if "off" in name else k)
            engine.generate(prompt, GenerationParams(max_tokens=4, num_draft_tokens=params.num_draft_tokens))
            t = time.perf_counter()
            res = engine.generate(prompt, params)
            results[name] = (res, (time.perf_counter() - t) * 1e3 / max(len(res.token_ids), 1))
        plain, base_ms = results["off (plain)"]
        console.rule(f"[bold]{cls}[/bold]")
        console.print(f"[dim]prompt:[/dim] {prompt[-160:]!r}")
        console.print(f"[dim]output:[/dim] {plain.text!r}")
        for name, (res, ms) in results.items():
            acc = res.acceptance_lengths
            table.add_row(cls, name, f"{ms:.1f}", f"{base_ms / ms:.2f}x",
                          f"{sum(acc) / len(acc):.2f}" if acc else "-", str(res.token_ids == plain.token_ids))
    console.print(table)


if __name__ == "__main__":
    app()
