"""The distributed stack beside the in-process reference decoder, same pair, same held-out prompts.

Starts the local stack (Redis, Ray + target, draft pools `small` and `ngram`, router) and
sends each prompt through the router with speculation off (plain decoding through the same
stack) and on, then runs the in-process reference decoder on the same prompts. Reports per class:
ms/token and speedup over plain *through the same path*, and the per-round overhead outside
model time (router wall time of a round minus the draft worker's and the target's own
reported compute: gRPC, serialisation, Redis commit) as p50/p99. Speedup and acceptance are
also given on the prompts whose plain greedy output is not degenerate (textquality).
Writes <out>/stack.json and <out>/stack_overhead.png.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from common import parser

from specserve.algorithm.sampling import SamplingParams
from specserve.drafters import HFDrafter, NgramDrafter
from specserve.models.loading import load_pair
from specserve.models.verifier import TargetModel
from specserve.tooling.modelbuild.build import find_pair, load_eval_prompts
from specserve.tooling.stack import PoolSpec, Stack, StackSpec
from specserve.tooling.textquality import is_degenerate
from specserve.worker.reference import GenerationParams, ReferenceDecoder

CLASSES = ("code", "chat", "extraction")


def via_router(stub, prompt: str, pool: str, k: int | None, max_tokens: int, banned: list[int], repeats: int,
               prediction: str = ""):
    """(best wall ms of `repeats`, the last response). `k` None: the router's choice."""
    from specserve.v1 import generation_pb2

    best, resp = float("inf"), None
    for _ in range(repeats):
        req = generation_pb2.GenerateRequest(prompt=prompt, max_tokens=max_tokens, draft_pool=pool,
                                             banned_token_ids=banned, prediction=prediction)
        if k is not None:
            req.num_draft_tokens = k
        t0 = time.perf_counter()
        resp = stub.Generate(req, timeout=900)
        best = min(best, (time.perf_counter() - t0) * 1e3)
    return best, resp


def in_process(engine: ReferenceDecoder, prompt: str, k: int, max_tokens: int, banned: tuple, repeats: int):
    best, res = float("inf"), None
    params = GenerationParams(max_tokens=max_tokens, num_draft_tokens=k,
                              sampling=SamplingParams(banned_token_ids=banned))
    for _ in range(repeats):
        t0 = time.perf_counter()
        res = engine.generate(prompt, params)
        best = min(best, (time.perf_counter() - t0) * 1e3)
    return best, res


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--prompts-per-class", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=2)
    a = ap.parse_args()
    pair = find_pair(a.models)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    prompts = {c: [p["prompt"] for p in load_eval_prompts(pair) if p["workload_class"] == c][: a.prompts_per_class]
               for c in CLASSES}
    eos = json.loads((pair / "target" / "generation_config.json").read_text())["eos_token_id"]
    banned = [eos]  # every run emits exactly max_tokens, so ms/token compares like with like

    import grpc

    from specserve.v1 import generation_pb2_grpc

    rows, overhead_all, degenerate = [], [], {}
    with tempfile.TemporaryDirectory(prefix="specserve-bench-") as run_dir:
        stack = Stack(StackSpec(pair_dir=str(pair), run_dir=run_dir,
                                pools={"small": PoolSpec("draft", 1), "ngram": PoolSpec("ngram", 1)}))
        t0 = time.perf_counter()
        with stack.running():
            print(f"[bench] stack up in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
            with grpc.insecure_channel(stack.info.router) as ch:
                stub = generation_pb2_grpc.GenerationStub(ch)
                via_router(stub, prompts["code"][0], "small", a.k, 8, banned, 1)  # warm-up
                for cls, ps in prompts.items():
                    print(f"[bench] stack {cls}", file=sys.stderr, flush=True)
                    for pool in ("none", "small", "ngram"):
                        ms, toks, rounds, over, per_prompt = 0.0, 0, [], [], []
                        for p in ps:
                            t, resp = via_router(stub, p, pool, a.k, a.max_tokens, banned, a.repeats)
                            ms += t
                            toks += len(resp.token_ids)
                            rounds += [(r.k, r.accepted) for r in resp.stats.round]
                            over += [r.overhead_ms for r in resp.stats.round]
                            per_prompt.append((t, len(resp.token_ids), [r.accepted for r in resp.stats.round if r.k]))
                            if pool == "none":  # greedy plain output decides which prompts loop
                                degenerate.setdefault(cls, []).append(is_degenerate(resp.token_ids))
                        overhead_all += over
                        rows.append({"path": "stack", "class": cls, "pool": pool, "ms_per_token": ms / toks,
                                     "rounds": len(rounds), "tokens": toks,
                                     "mean_accepted": float(np.mean([acc for k, acc in rounds if k]))
                                     if pool != "none" else None,
                                     "overhead_ms_p50": float(np.percentile(over, 50)),
                                     "overhead_ms_p99": float(np.percentile(over, 99)), "per_prompt": per_prompt})

    torch.set_num_threads(2)
    lp = load_pair(str(pair / "target"), str(pair / "draft"))
    tm = TargetModel(lp.target)
    engines = {"none": ReferenceDecoder(tm, None, lp.tokenizer),
               "small": ReferenceDecoder(tm, HFDrafter(lp.draft), lp.tokenizer),
               "ngram": ReferenceDecoder(tm, NgramDrafter(tm.vocab_size), lp.tokenizer)}
    in_process(engines["small"], prompts["code"][0], a.k, 8, tuple(banned), 1)
    for cls, ps in prompts.items():
        print(f"[bench] in-process {cls}", file=sys.stderr, flush=True)
        for pool, engine in engines.items():
            ms, toks, per_prompt = 0.0, 0, []
            for p in ps:
                t, res = in_process(engine, p, a.k if pool != "none" else 0, a.max_tokens, tuple(banned), a.repeats)
                ms += t
                toks += len(res.token_ids)
                per_prompt.append((t, len(res.token_ids), res.accepted_per_round))
            rows.append({"path": "in-process", "class": cls, "pool": pool, "ms_per_token": ms / toks, "tokens": toks,
                         "mean_accepted": float(np.mean(sum((x[2] for x in per_prompt), []) or [np.nan]))
                         if pool != "none" else None, "per_prompt": per_prompt})

    for r in rows:
        base = next(b for b in rows if b["path"] == r["path"] and b["class"] == r["class"] and b["pool"] == "none")
        r["speedup"] = base["ms_per_token"] / r["ms_per_token"]
        r["nondegenerate"] = _nondegenerate(r, base, [i for i, d in enumerate(degenerate[r["class"]]) if not d])
    summary = {"overhead_ms_p50": float(np.percentile(overhead_all, 50)),
               "overhead_ms_p99": float(np.percentile(overhead_all, 99)), "rounds": len(overhead_all)}
    (out / "stack.json").write_text(json.dumps({"args": vars(a), "pair": str(pair), "summary": summary, "rows": rows,
                                                "overhead_ms": overhead_all},
                                               indent=1))
    print("| path | class | speculation | ms/token | speedup vs plain (same path) | mean accepted "
          "| overhead p50/p99 ms "
          "| non-degenerate: prompts | speedup | mean accepted |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        acc, nd = _fmt(r.get("mean_accepted")), r["nondegenerate"]
        ov = f"{r['overhead_ms_p50']:.2f} / {r['overhead_ms_p99']:.2f}" if "overhead_ms_p50" in r else "-"
        print(f"| {r['path']} | {r['class']} | {r['pool']} | {r['ms_per_token']:.2f} | {r['speedup']:.2f}x "
              f"| {acc} | {ov} "
              f"| {nd['n_prompts']}/{len(r['per_prompt'])} | {_fmt(nd['speedup'])}x | {_fmt(nd['mean_accepted'])} |")
    print(f"\nper-round overhead outside model time (router + gRPC + Redis), all rounds: "
          f"p50 {summary['overhead_ms_p50']:.2f} ms, p99 {summary['overhead_ms_p99']:.2f} ms "
          f"({summary['rounds']} rounds)")
    _plot(rows, overhead_all, out / "stack_overhead.png")
    print(f"wrote {out / 'stack.json'} and {out / 'stack_overhead.png'}", file=sys.stderr)


def _nondegenerate(row: dict, base: dict, keep: list[int]) -> dict:
    """Speedup and acceptance on the prompts whose plain greedy output does not loop
    (textquality): looping text is easy to draft, so it must not flatter the figures unseen."""
    def ms_per_token(r):
        n = sum(r["per_prompt"][i][1] for i in keep)
        return sum(r["per_prompt"][i][0] for i in keep) / n if n else None

    acc = [x for i in keep for x in row["per_prompt"][i][2]]
    mine, theirs = ms_per_token(row), ms_per_token(base)
    return {"n_prompts": len(keep), "speedup": theirs / mine if mine and theirs else None,
            "mean_accepted": float(np.mean(acc)) if acc and row["pool"] != "none" else None}


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.2f}"


def _plot(rows, overhead, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    labels = [f"{r['class']}\n{r['pool']}" for r in rows if r["path"] == "stack"]
    x = np.arange(len(labels))
    for i, route in enumerate(("stack", "in-process")):  # not `path`: that is where the figure goes
        ax1.bar(x + (i - 0.5) * 0.4, [r["speedup"] for r in rows if r["path"] == route], 0.4, label=route)
    ax1.set_xticks(x, labels, fontsize=7)
    ax1.axhline(1.0, color="grey", lw=0.8)
    ax1.set_ylabel("speedup vs plain (same path)")
    ax1.legend()
    ax2.hist(overhead, bins=40)
    ax2.set_xlabel("per-round overhead outside model time (ms)")
    ax2.set_ylabel("rounds")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
