"""Tensor parallelism on this CPU (ADR 0030): the target's model step at TP 2 (two processes,
gloo) against TP 1, at 1 and 16 rows, and the collectives' share of a TP 2 step.

A step is the target's whole model step (`BatchedTarget.step`; at TP 2 `LeaderTarget.step`:
the step message to rank 1, both forwards with their all-reduces and the logits' gather, the
verdicts): R sessions of `--context` cached tokens, each a plain decode row (1 token) or a
verify row (the last token + K = 4 drafts). Each step feeds its row's last token anew (the ids
alternate in their last token, so the step reconciles and rolls back the one position on
every rank alike): every step sees the same lengths. Arms, interleaved step by step so the
machine's load falls on each alike: TP 1 with 1 thread, TP 1 with 2 threads, TP 2 with 1
thread a rank (the two ranks together use the 2 cores TP 1 with 2 threads has).

The collectives' share: rank 0's time inside all_reduce and all_gather over the step's time
(it includes waiting for rank 1 to reach the same collective: on a CPU shared by both ranks
that waiting is most of it). Writes <out>/tp/tp.json and tp.png; prints a markdown table.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import platform
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
from common import parser, warn_if_busy

from specserve.algorithm.sampling import SamplingParams
from specserve.models.loading import load_model
from specserve.models.verifier import TargetModel
from specserve.step import Step, StepRow
from specserve.worker.model_step import BatchedTarget, Batching
from specserve.worker.tp_step import RankSpec, leader, run_follower

ROWS = (1, 16)
DRAFTS = {"decode": 0, "verify K=4": 4}


def parse_args(argv=None):
    p = parser(__doc__)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--steps", type=int, default=30)
    return p.parse_args(argv)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Arm:
    """One model step and its sessions (opened and prefilled once)."""

    def __init__(self, name: str, model, threads: int, vocab: int, context: int) -> None:
        self.name, self.model, self.threads = name, model, threads
        g = torch.Generator().manual_seed(0)
        self.ctx = [torch.randint(5, vocab, (context,), generator=g).tolist() for _ in range(max(ROWS))]
        self.slots = [model.open(f"s{i}") for i in range(max(ROWS))]
        self.turn = 0
        with_threads(threads, lambda: self.step(max(ROWS), 0))  # the prefill (chunked: asked again)

    def step(self, rows: int, k: int) -> float:
        """One step of `rows` rows with k drafts each; its wall ms."""
        self.turn += 1
        sp = SamplingParams()
        batch = [StepRow.verify(s, c[:-1] + [3 + self.turn % 2], [7 + j for j in range(k)], None, sp, 0)
                 for s, c in zip(self.slots[:rows], self.ctx, strict=False)]
        t0 = time.perf_counter()
        while any(r.again for r in self.model.step(Step(batch)).rows):
            t0 = time.perf_counter()  # (a prompt's chunks: time the step after them)
        return (time.perf_counter() - t0) * 1e3


def with_threads(n: int, fn):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        return fn()
    finally:
        torch.set_num_threads(before)


def main(argv=None) -> None:
    a = parse_args(argv)
    load = warn_if_busy()
    target_dir = Path(a.models) / "specserve-demo-v1" / "target"
    b = Batching(kv_budget_mb=512, max_sessions=max(ROWS) + 1, max_len=a.context + 16, max_batch=max(ROWS))
    spec = RankSpec(str(target_dir), b, 2, f"tcp://127.0.0.1:{_port()}", check_s=-1)
    follower = mp.get_context("spawn").Process(target=run_follower, args=(spec, 1, 1), daemon=True)
    follower.start()
    tp2 = with_threads(1, lambda: leader(spec))
    one = BatchedTarget(TargetModel(load_model(str(target_dir))), b)
    vocab = one.runner.vocab_size
    arms = [Arm("TP 1, 1 thread", one, 1, vocab, a.context), Arm("TP 2, 1 thread a rank", tp2, 1, vocab, a.context)]
    two_threads = Arm("TP 1, 2 threads", BatchedTarget(TargetModel(load_model(str(target_dir))), b), 2, vocab,
                      a.context)
    arms.insert(1, two_threads)
    results = []
    for kind, k in DRAFTS.items():
        for rows in ROWS:
            times: dict[str, list[float]] = {arm.name: [] for arm in arms}
            coll = {"reduce": 0.0, "gather": 0.0}
            for arm in arms:
                with_threads(arm.threads, lambda arm=arm, rows=rows, k=k: arm.step(rows, k))  # warm the shapes
            before = dict(tp2.tp.seconds)
            for _ in range(a.steps):
                for arm in arms:
                    times[arm.name].append(with_threads(arm.threads, lambda arm=arm, rows=rows, k=k: arm.step(rows, k)))
            for op in coll:
                coll[op] = (tp2.tp.seconds[op] - before[op]) * 1e3 / a.steps
            med = {n: statistics.median(t) for n, t in times.items()}
            tp2_ms = med["TP 2, 1 thread a rank"]
            results.append({"rows": rows, "kind": kind, "tokens_per_row": k + 1, "median_ms": med,
                            "min_ms": {n: min(t) for n, t in times.items()},
                            "collectives_ms_per_step": coll,
                            "collective_share": (coll["reduce"] + coll["gather"]) / tp2_ms,
                            "tp2_over_tp1_1thread": tp2_ms / med["TP 1, 1 thread"],
                            "tp2_over_tp1_2threads": tp2_ms / med["TP 1, 2 threads"]})
    states = tp2.check()
    tp2.stop()
    follower.join(60)
    meta = {"torch": torch.__version__, "python": platform.python_version(), "cpus": os.cpu_count(),
            "load_before": load, "load_after": os.getloadavg(), "args": vars(a),
            "collective_calls": tp2.tp.calls, "ranks_agree": states[0].digest == states[1].digest,
            "step_messages": [s.messages.get("step", 0) for s in states], "message_bytes": tp2.channel.bytes}
    out = Path(a.out) / "tp"
    out.mkdir(parents=True, exist_ok=True)
    (out / "tp.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    _plot(results, out / "tp.png")
    print("| rows | row | TP 1, 1 thread | TP 1, 2 threads | TP 2 | TP 2 / TP 1 (1 t) | all-reduce + gather |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        m = r["median_ms"]
        print(f"| {r['rows']} | {r['kind']} | {m['TP 1, 1 thread']:.1f} ms | {m['TP 1, 2 threads']:.1f} ms | "
              f"{m['TP 2, 1 thread a rank']:.1f} ms | {r['tp2_over_tp1_1thread']:.2f} | "
              f"{sum(r['collectives_ms_per_step'].values()):.1f} ms ({100 * r['collective_share']:.0f} %) |")
    print(f"load before {load[0]:.2f}, after {os.getloadavg()[0]:.2f}; ranks agree: {meta['ranks_agree']}")


def _plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    labels = [f"{r['rows']} × {r['kind']}" for r in results]
    names = list(results[0]["median_ms"])
    width = 0.8 / len(names)
    for i, n in enumerate(names):
        ax.bar([x + i * width for x in range(len(results))], [r["median_ms"][n] for r in results], width, label=n)
    ax.bar([x + (len(names) - 1) * width for x in range(len(results))],
           [sum(r["collectives_ms_per_step"].values()) for r in results], width, fill=False, hatch="//",
           label="TP 2: in collectives")
    ax.set_xticks([x + width for x in range(len(results))], labels)
    ax.set_yscale("log")  # (TP 1 with 2 threads on a loaded 2-core machine is an order of magnitude above)
    ax.set_ylabel("ms a step (median, log scale)")
    ax.set_title("Target model step on this CPU: TP 2 (gloo, 2 processes) against TP 1")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
