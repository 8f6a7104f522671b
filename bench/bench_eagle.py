"""Feature-level drafting in process (issue 40, ADR 0020): the engine loop beside the demo target
on this CPU, per workload class, at 1, 4 and 16 streams, one run, the same held-out prompts:

  plain        the engine with no drafts
  small        the pair's distilled draft model (LocalDrafts: drafted on the engine's thread)
  ngram-local  prompt lookup on the engine's thread
  eagle-local  the pair's EAGLE head, chains
  eagle-tree   the EAGLE head, token trees of two first candidates (tree_width 2, always: the cost
               model would choose chains on this CPU)

Per cell: output tok/s, accepted drafts per speculative round, tokens per target pass, tree
drafts per round; per class the speedups over plain at each load, and whether greedy output
equals plain's (it must). Greedy, K = 4, EOS banned so every request emits --max-tokens.
Writes <out>/eagle.json and <out>/eagle.png.

    python bench/bench_eagle.py [--streams 1,4,16] [--max-tokens 48] [--prompts-per-class 4]
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from common import parser, warn_if_busy

from specserve.algorithm.stops import StopChecker
from specserve.drafters.eagle import TargetParts, load_head
from specserve.drafters.hf import HFDrafter
from specserve.drafters.ngram import NgramDrafter
from specserve.engine.drafting import LocalDrafts
from specserve.engine.eagle_local import EagleLocalDrafts
from specserve.engine.loop import EngineLoop
from specserve.engine.scheduler import Budget
from specserve.engine.session import EnginePlan
from specserve.engine.speculation import SpeculationSettings
from specserve.models.loading import load_pair
from specserve.models.verifier import TargetModel
from specserve.params import GenerationParams, SamplingParams
from specserve.tooling.modelbuild.build import find_pair, load_eval_prompts
from specserve.worker.model_step import Batching, make_target_step

ARMS = ("plain", "small", "ngram-local", "eagle-local", "eagle-tree")


def _source(arm: str, pair, head, parts):
    if arm == "small":
        return LocalDrafts(HFDrafter(pair.draft))
    if arm == "ngram-local":
        return LocalDrafts(NgramDrafter(pair.target.config.vocab_size))
    if arm in ("eagle-local", "eagle-tree"):
        return EagleLocalDrafts(head, parts)
    return None


def cell(model, pair, head, parts, arm: str, prompts: list[list[int]], max_tokens: int, k: int) -> dict:
    source = _source(arm, pair, head, parts)
    stops = lambda params: StopChecker(frozenset(), params.stop, lambda ids: "")  # noqa: E731
    loop = EngineLoop(model, stops, {"pool": source} if source else {}, budget=Budget(max_batch=64),
                      speculation=SpeculationSettings(tree_width=2 if arm == "eagle-tree" else 1, tree_always=True))
    eos = pair.target.generation_config.eos_token_id
    sampling = SamplingParams(banned_token_ids=(eos,) if eos is not None else ())
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        plan = EnginePlan(GenerationParams(max_tokens=max_tokens, num_draft_tokens=0 if source is None else k,
                                           sampling=sampling, seed=i), pool="pool" if source else None)
        loop.add(f"s{i}", p, plan)
    loop.run_until_idle()
    wall = time.perf_counter() - t0
    sessions = [loop.ended[f"s{i}"] for i in range(len(prompts))]
    rounds = [r for s in sessions for r in s.rounds]
    spec = [r for r in rounds if r.k > 0]
    out = sum(len(s.generated) for s in sessions)
    return {"arm": arm, "tok_s": out / wall, "wall_s": wall, "tokens": out,
            "accepted_per_round": sum(r.accepted for r in spec) / max(len(spec), 1),
            "tokens_per_pass": out / max(len(rounds), 1),
            "tree_drafts_per_round": sum(r.tree_size for r in spec) / max(len(spec), 1),
            "outputs": [s.generated for s in sessions]}


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--streams", default="1,4,16")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--prompts-per-class", type=int, default=4)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    load = warn_if_busy()
    torch.set_num_threads(a.threads)
    pair_dir = find_pair(a.models)
    pair = load_pair(str(pair_dir / "target"), str(pair_dir / "draft"))
    head = load_head(pair_dir / "eagle")
    parts = TargetParts(pair.target, head.cfg.feature_layers)
    model = make_target_step(TargetModel(pair.target), Batching(max_sessions=20, max_len=512, max_batch=16))
    model.keep_features(head.cfg.feature_layers)
    prompts = load_eval_prompts(pair_dir)
    streams = [int(x) for x in a.streams.split(",")]
    rows = []
    samples: dict[str, dict] = {}  # per class: three outputs (every arm's: greedy) and each pool's acceptance
    for cls in ("code", "chat", "extraction"):
        chosen = [pair.tokenizer.encode(p["prompt"]) for p in prompts if p["workload_class"] == cls]
        for n in streams:
            batch = [chosen[i % len(chosen)] for i in range(max(n, a.prompts_per_class if n == 1 else n))]
            # one stream: the prompts one after another; n streams: n at once
            groups = [[p] for p in batch[:a.prompts_per_class]] if n == 1 else [batch[:n]]
            cell(model, pair, head, parts, "plain", groups[0], 8, a.k)  # warm
            results = {}
            for arm in ARMS:
                parts_out = [cell(model, pair, head, parts, arm, g, a.max_tokens, a.k) for g in groups]
                tok = sum(r["tokens"] for r in parts_out)
                wall = sum(r["wall_s"] for r in parts_out)
                n_parts = len(parts_out)
                results[arm] = {
                    "tok_s": tok / wall,
                    "accepted_per_round": sum(r["accepted_per_round"] for r in parts_out) / n_parts,
                    "tokens_per_pass": sum(r["tokens_per_pass"] for r in parts_out) / n_parts,
                    "tree_drafts_per_round": sum(r["tree_drafts_per_round"] for r in parts_out) / n_parts,
                    "outputs": [o for r in parts_out for o in r["outputs"]],
                }
            plain = results["plain"]
            if cls not in samples:
                samples[cls] = {"prompts": [pair.tokenizer.decode(p) for p in batch[:3]],
                                "outputs": [pair.tokenizer.decode(o) for o in plain["outputs"][:3]],
                                "accepted_per_round": {arm: r["accepted_per_round"] for arm, r in results.items()}}
            for arm, r in results.items():
                row = {"class": cls, "streams": n, "arm": arm, **{k: v for k, v in r.items() if k != "outputs"},
                       "speedup": r["tok_s"] / plain["tok_s"], "greedy_equal_plain": r["outputs"] == plain["outputs"]}
                rows.append(row)
                print(f"{cls:10} {n:3} streams {arm:12} {row['tok_s']:7.1f} tok/s  x{row['speedup']:.2f}  "
                      f"acc/round {row['accepted_per_round']:.2f}  tok/pass {row['tokens_per_pass']:.2f}  "
                      f"tree {row['tree_drafts_per_round']:.1f}  same={row['greedy_equal_plain']}", flush=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "eagle.json").write_text(json.dumps({"load_before": load, "k": a.k, "max_tokens": a.max_tokens,
                                                "threads": a.threads, "rows": rows, "samples": samples}, indent=1))
    _plot(rows, out / "eagle.png", streams)
    print(f"wrote {out / 'eagle.json'} and {out / 'eagle.png'}")


def _plot(rows: list[dict], path: Path, streams: list[int]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 4), sharey=True)
    for ax, cls in zip(axes, ("code", "chat", "extraction"), strict=True):
        for arm in ARMS:
            ys = [next(r["speedup"] for r in rows if r["class"] == cls and r["arm"] == arm and r["streams"] == n)
                  for n in streams]
            ax.plot(streams, ys, marker="o", label=arm)
        ax.axhline(1.0, color="grey", lw=0.5)
        ax.set(xscale="log", title=cls, xlabel="streams")
    axes[0].set_ylabel("speedup over plain (in process, CPU)")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path)


if __name__ == "__main__":
    main()
