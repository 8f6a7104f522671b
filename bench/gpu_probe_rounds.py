"""Where a speculative round's time goes on a device (ADR 0019): the gpu-check's speculative
cell at one load, with each draft and verify step timed alone (synchronised around it), the
steps counted, and the cell profiled by cProfile (host) and torch.profiler (device), so a
round's wall can be split into draft steps, verify steps and the rest.

    python bench/gpu_probe_rounds.py --streams 16 --out bench/results/gpu   (on a GPU node)
    python bench/gpu_probe_rounds.py --smoke --device cpu                     (checks the script)
"""

from __future__ import annotations

import cProfile
import io
import json
import pstats
import sys
import time
from pathlib import Path

import gpu_check as g
import torch

from specserve.device import resolve_device, resolve_dtype
from specserve.drafters.hf import HFDrafter
from specserve.models.verifier import TargetModel
from specserve.worker.model_step import BatchedDraft, BatchedTarget, Batching


class Timed:
    """A model step wrapper: each call's wall (synchronised before and after) and count."""

    def __init__(self, engine, device: torch.device) -> None:
        self.engine, self.device, self.ms, self.calls = engine, device, 0.0, 0
        self.runner = engine.runner

    def step(self, step):
        g.sync(self.device)
        t0 = time.perf_counter()
        out = self.engine.step(step)
        g.sync(self.device)
        self.ms += 1e3 * (time.perf_counter() - t0)
        self.calls += 1
        return out

    def __getattr__(self, name):
        return getattr(self.engine, name)


def main(argv=None) -> int:
    p = g.parser(__doc__)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--alpha", type=float, default=0.8)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--capture-budget", type=float, default=20.0)
    a = p.parse_args(argv)
    device = resolve_device(a.device)
    dtype = resolve_dtype(a.dtype, device)
    shape = g.SHAPES["smoke" if a.smoke else "full"]
    target_model, draft_model = g.random_pair(shape, device, dtype)
    n = a.streams
    max_len = min(1024, shape["target"]["max_position_embeddings"])
    b = Batching(device=str(device), dtype=a.dtype, max_sessions=n + 2, max_len=max_len, prefill_chunk=256,
                 kv_budget_mb=4096, fuse_upto=0, max_batch=max(n, 4), cuda_graphs="auto",
                 fixed_step=True if a.smoke else None, capture_budget_s=a.capture_budget)
    t0 = time.perf_counter()
    target, draft = BatchedTarget(TargetModel(target_model), b), BatchedDraft(HFDrafter(draft_model), b)
    out: dict = {"device": str(device), "streams": n, "alpha": a.alpha, "k": a.k, "build_s": time.perf_counter() - t0}
    warm = g._prompts(n, shape["prompt_len"], shape["target"]["vocab_size"], seed=2)
    ref = g.plain(target, warm, 8, device)["continuations"]
    for alpha in (1.0, 0.5):
        g.speculative(target, draft, warm, ref, 8, a.k, alpha, device)
    prompts = g._prompts(n, shape["prompt_len"], shape["target"]["vocab_size"])
    base = g.plain(target, prompts, shape["decode"], device)
    out["plain"] = {k: v for k, v in base.items() if k != "continuations"}
    before = g.step_counts(target, draft)
    td, tt = Timed(draft, device), Timed(target, device)
    t0 = time.perf_counter()
    spec = g.speculative(tt, td, prompts, base["continuations"], shape["decode"], a.k, a.alpha, device)
    wall = 1e3 * (time.perf_counter() - t0)
    out["timed"] = {"wall_ms": wall, "draft_ms": td.ms, "draft_steps": td.calls, "verify_ms": tt.ms,
                    "verify_steps": tt.calls, **spec, "counts": g.diff_counts(g.step_counts(target, draft), before)}
    print("[probe] " + json.dumps(out, default=str), flush=True)
    prof = cProfile.Profile()
    prof.enable()
    g.speculative(target, draft, prompts, base["continuations"], shape["decode"], a.k, a.alpha, device)
    prof.disable()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(30)
    print(s.getvalue())
    if device.type == "cuda":
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as tp:
            g.speculative(target, draft, prompts, base["continuations"], 16, a.k, a.alpha, device)
        print(tp.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
        print(tp.key_averages().table(sort_by="self_cuda_time_total", row_limit=15))
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "gpu_probe_rounds.json").write_text(json.dumps(out, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
