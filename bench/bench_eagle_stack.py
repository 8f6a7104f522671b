"""Feature-level drafting through the stack (ADR 0020): the arms of bench_eagle.py served by the
router, the target and the draft replicas on loopback, driven by bench_peer's streaming
OpenAI client, per workload class, at 1, 4 and 16 streams, in one run.

Two stacks, one after the other, on the shipped pair (pools `small`: 1 replica, `ngram-local`
and `eagle-local`: inside the target, `eagle`: 1 replica of the head fed the target's
features over the Link):

  chains (tree_width 1)   plain, small, ngram-local, eagle-local, eagle (remote), controller
  trees (tree_width 2)    plain, eagle-local: the engine's cost model chooses a tree or the
                          chain each round (on this CPU it mostly chooses the chain)

The controller arm names no pool and no K: each class's policy lets the controller choose among
the four pools with adaptive K; `--controller-warm` requests per class go through it first,
not counted. In a stack every class's cells run load by load, the arms rotated each repeat
(bench_peer's `measure_interleaved`), so each ratio is measured side by side. Per cell: tok/s,
TPOT p50/p90, tokens per target pass of a session (completion tokens over its rounds: the
acceptance length, bonus included), drafts accepted per round, and whether each greedy text
equals plain's in the same stack (it must). Writes <out>/eagle_stack.json and
<out>/eagle_stack.png.

    python bench/bench_eagle_stack.py [--streams 1,4,16] [--requests 2] [--max-tokens 48]
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

from bench_peer import measure_interleaved, pooled, run_cell, served_model
from common import parser, warn_if_busy

from specserve.tooling.modelbuild.build import find_pair, load_eval_prompts
from specserve.tooling.stack import PoolSpec, Stack, StackSpec, local_target_threads

CLASSES = ("code", "chat", "extraction")
POOLS = ("small", "ngram-local", "eagle-local", "eagle")


def stack_spec(pair: Path, run_dir: Path, tree_width: int, threads: int) -> StackSpec:
    # the controller's choice: every pool open to every class, K adaptive
    policies = {cls: {"draft_pool": "eagle-local", "draft_pools": [p for p in POOLS if p != "eagle-local"],
                      "adaptive_k": True, "k_min": 1, "k_max": 8} for cls in CLASSES}
    return StackSpec(pair_dir=str(pair), run_dir=str(run_dir), target_threads=threads,
                     pools={"small": PoolSpec("draft", 1), "ngram-local": PoolSpec("ngram", local=True),
                            "eagle-local": PoolSpec("eagle", local=True), "eagle": PoolSpec("eagle", 1)},
                     env={"SPECSERVE_TARGET_TREE_WIDTH": str(tree_width)},
                     router_env={"SPECSERVE_ROUTER_POLICIES": json.dumps(policies)})


def run_stack(pair: Path, run_dir: Path, name: str, arms: dict[str, dict], prompts: dict[str, list[str]], loads,
              a, tree_width: int) -> list[dict]:
    rows: list[dict] = []
    with Stack(stack_spec(pair, run_dir, tree_width, a.target_threads)).running(timeout_s=600) as stack:
        url = stack.info.http
        for cls in CLASSES:
            by_class = {arm: {**extra, "workload_class": cls} for arm, extra in arms.items()}
            if "controller" in by_class and a.controller_warm > 0:
                run_cell(url, served_model(url), prompts[cls], 1, a.controller_warm, a.max_tokens,
                         by_class["controller"])
            for row in measure_interleaved(url, by_class, prompts[cls], loads, a):
                rows.append({**row, "class": cls, "stack": name})
    return rows


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--streams", default="1,4,16")
    ap.add_argument("--prompts", type=int, default=8, help="held-out prompts per class, cycled")
    ap.add_argument("--requests", type=int, default=2, help="requests per stream, one after another")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=1, help="each cell this many times, arms rotated, pooled")
    ap.add_argument("--controller-warm", type=int, default=6)
    ap.add_argument("--target-threads", type=int, default=local_target_threads())
    a = ap.parse_args()
    load = warn_if_busy()
    pair = find_pair(a.models).resolve()
    loads = [int(x) for x in a.streams.split(",")]
    held_out = load_eval_prompts(pair)
    prompts = {cls: [p["prompt"] for p in held_out if p["workload_class"] == cls][: a.prompts] for cls in CLASSES}
    fixed = {"plain": {"draft_pool": "none"}, **{p: {"draft_pool": p, "num_draft_tokens": a.k} for p in POOLS}}
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="bench-eagle-stack-") as tmp:
        rows += run_stack(pair, Path(tmp) / "chains", "chains", {**fixed, "controller": {}}, prompts, loads, a, 1)
        rows += run_stack(pair, Path(tmp) / "trees", "trees",
                          {"plain": fixed["plain"], "eagle-local": fixed["eagle-local"]}, prompts, loads, a, 2)
    cells = _cells(rows)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"pair": str(pair), "streams": loads, "k": a.k, "max_tokens": a.max_tokens, "requests": a.requests,
              "repeats": a.repeats, "target_threads": a.target_threads, "load_before": load,
              "load_after": os.getloadavg(), "cells": cells, "each_cell": rows}
    (out / "eagle_stack.json").write_text(json.dumps(result, indent=1))
    _plot(cells, loads, out / "eagle_stack.png")
    for c in cells:
        print(f"{c['class']:10} {c['stack']:6} {c['arm']:11} {c['streams']:3} streams {c['tok_s']:6.1f} tok/s "
              f"x{c['speedup']:.2f}  tok/pass {c.get('tokens_per_pass') or 0:.2f}  same={c['same_as_plain']}",
              file=sys.stderr)
    print(f"wrote {out / 'eagle_stack.json'} and {out / 'eagle_stack.png'}")


def _cells(rows: list[dict]) -> list[dict]:
    """Pooled per (stack, class, arm, load), with the speedup over plain in the same stack and
    class and load, and whether every greedy text equals plain's there."""
    out = []
    for (stack, cls) in dict.fromkeys((r["stack"], r["class"]) for r in rows):
        group = [r for r in rows if r["stack"] == stack and r["class"] == cls]
        pooled_cells = pooled(group)
        for c in pooled_cells:
            extra = [r for r in group if r["arm"] == c["arm"] and r["streams"] == c["streams"]]
            rounds_known = [r for r in extra if "tokens_per_pass" in r]
            if rounds_known:
                c["tokens_per_pass"] = sum(r["tokens_per_pass"] for r in rounds_known) / len(rounds_known)
                c["accepted_per_round"] = sum(r["accepted_per_round"] for r in rounds_known) / len(rounds_known)
        for c in pooled_cells:
            plain = next(p for p in pooled_cells if p["arm"] == "plain" and p["streams"] == c["streams"])
            c.update(stack=stack, **{"class": cls}, speedup=c["tok_s"] / plain["tok_s"],
                     same_as_plain=all(c["texts"][n] == plain["texts"][n] for n in c["texts"] if n in plain["texts"]))
            c.pop("all_texts", None)
            out.append(c)
    return out


def _plot(cells: list[dict], loads: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4), sharey=True)
    for ax, cls in zip(axes, CLASSES, strict=True):
        for stack, arm in dict.fromkeys((c["stack"], c["arm"]) for c in cells if c["class"] == cls):
            ys = [next((c["speedup"] for c in cells if c["class"] == cls and c["stack"] == stack and c["arm"] == arm
                        and c["streams"] == n), float("nan")) for n in loads]
            ax.plot(loads, ys, marker="o", label=f"{arm} ({stack})")
        ax.axhline(1.0, color="grey", lw=0.5)
        ax.set(xscale="log", title=cls, xlabel="streams")
    axes[0].set_ylabel("speedup over plain, through the stack (CPU)")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)


if __name__ == "__main__":
    main()
