"""The shipped pair's model card (`MODEL_CARD.md`), written from its `build.json` and an
evaluation report (`evaluate.py --json`), so the card's figures are the files' own:

    python -m specserve.tooling.modelbuild.card models/specserve-demo-v1 --report eval.json \\
        [--acceptance acceptance.json] [--machine "..."]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _recipe(cfg: dict) -> list[str]:
    t, d = cfg["target"], cfg["draft"]
    return [
        f"- tokenizer: byte-level BPE, {cfg['vocab_size']} tokens (`<|endoftext|>` is EOS and BOS)",
        f"- target: Llama-style, {t['layers']} layers × {t['hidden']} ({t['heads']} heads, MLP {t['intermediate']}),"
        f" tied embeddings, {cfg['max_positions']} positions; {cfg['target_steps']} steps of {cfg['batch']} × "
        f"{cfg['seq_len']} tokens, AdamW lr {cfg['target_lr']} (warm-up, cosine to 10 %)",
        f"- draft: {d['layers']} layer × {d['hidden']} ({d['heads']} heads, MLP {d['intermediate']}), distilled from "
        f"the target (KL(p ‖ q) on its own distributions), {cfg['draft_steps']} steps, lr {cfg['draft_lr']}",
        f"- corpus (version {cfg.get('corpus_version', 1)}): the standard library's Python source (code, codec "
        "tables left out), the bundled pydoc topics and the library's docstrings (chat/prose), and seeded "
        f"generated records with their JSON (extraction); mixed {dict(cfg['weights'])}; 10 % of documents held "
        "out by a hash of their name",
        f"- seed {cfg['seed']}, {cfg['threads']} training threads, weights saved as {cfg.get('save_dtype', 'float32')}",
    ]


def card_text(pair: Path, report: dict, machine: str, acceptance: dict | None = None) -> str:
    meta = json.loads((pair / "build.json").read_text())
    cfg = meta["config"]
    lines = [
        f"# {pair.name}: the specserve demo pair",
        "",
        "A small target and a draft distilled from it, trained offline from what every Python "
        "installation has, so that specserve runs, and its speculation can be measured, with no model hub. "
        "It is a demo, not a language model to build on: expect rough text. Production deployments point "
        "specserve at any Hugging Face pair that shares a tokenizer.",
        "",
        "## Identity",
        f"- config digest: `{meta['digest']}` (preset `{cfg['name']}`, build recipe version in `build.json`)",
        f"- weights sha256 (both models' safetensors and the tokenizer): `{meta['weights_sha256']}`",
        f"- parameters: target {meta['target_params'] / 1e6:.1f} M, draft {meta['draft_params'] / 1e6:.2f} M",
        f"- trained in {meta['seconds'] / 60:.1f} min on {machine}, torch {meta['torch']}, Python {meta['python']}, "
        f"bf16 autocast {'on' if meta['bf16_autocast'] else 'off'}",
        f"- final training loss: target {meta['target_loss']:.3f} (cross-entropy), draft {meta['draft_kl']:.3f} (KL)",
        "",
        "## Recipe",
        *_recipe(cfg),
        "",
        "Rebuild it with `make models` (into `.cache/models`): the build prints its sha256 and whether it matches "
        "this card. The same config gives the same weights on the same CPU type; another CPU type (no AVX-512 "
        "BF16, so no bf16 autocast) trains in fp32 and gives other weights. Every machine serves these.",
        "",
        "## Held-out figures",
        f"{report.get('per_class', '?')} held-out prompts per class, 48-token greedy continuations; "
        "'degenerate' as in `textquality.py` (a loop or a single repeated line).",
        "",
        "| class | tokens/ppl | bits per byte | degenerate |",
        "|---|---|---|---|",
    ]
    for cls, r in report["classes"].items():
        n = sum(x["degenerate"] for x in r["all"])
        lines.append(f"| {cls} | {r['ppl']:.2f} | {r['bits_per_byte']:.3f} | {r['degenerate_fraction']:.0%} "
                     f"({n}/{r['prompts']}) |")
    m = report.get("extraction_match")
    if m:
        lines += ["", f"Extraction, {m['records']} held-out records: the continuation after `JSON:` parses on "
                      f"{m['parse_rate']:.0%} of them, and {m['field_match']:.0%} of all fields equal the source "
                      "record's (copied from the context, not invented)."]
    if acceptance:
        lines += ["", "## Speculation on the held-out prompts", "", acceptance["markdown"]]
    lines += ["", "## Three outputs per class (greedy, held-out prompts)"]
    for cls, r in report["classes"].items():
        for s in r["samples"][:3]:
            lines += ["", f"**{cls}**, prompt `…{s['prompt'][-80:]!r}`", "", "```", s["output"], "```"]
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description="write a pair's MODEL_CARD.md")
    ap.add_argument("pair", type=Path)
    ap.add_argument("--report", type=Path, required=True, help="evaluate.py --json output")
    ap.add_argument("--acceptance", type=Path, default=None, help='{"markdown": "..."}')
    ap.add_argument("--machine", default="a 2-core AMD EPYC (AVX-512 BF16)")
    a = ap.parse_args(argv)
    acceptance = json.loads(a.acceptance.read_text()) if a.acceptance else None
    text = card_text(a.pair, json.loads(a.report.read_text()), a.machine, acceptance)
    (a.pair / "MODEL_CARD.md").write_text(text)
    print(f"wrote {a.pair / 'MODEL_CARD.md'}")


if __name__ == "__main__":
    main()
