"""The whole stack on a GPU (issue 52 item 5, ADR 0028): Redis, the target with `eagle-local` on
the device and a router on one node, TPOT and tok/s through the router at 1 / 16 / 64 streams,
beside the engine loop's own on the same device.

The GPU node has no Ray and can be given only a few MiB of wheels (Ray's is 79 MB), so the
target runs in a plain process (`services/target/plain.py`: the same worker, no Ray, nobody
restarts it); everything else is the stack as `tooling/stack.py` starts it: a local
redis-server (AOF on), the router's gRPC and OpenAI HTTP APIs. The target is the demo pair's,
with its EAGLE head (`eagle/`); on CUDA it runs the device step (graphs, the head's rounds in
the step, lookahead: ADR 0019, 0025), on the CPU the batched runner.

Arms: `plain` (`draft_pool: none`) and `eagle-local` (K `--k`), each at every `--streams` over
each of `--apis`, greedy on the pair's held-out prompts (token ids), `--tokens` tokens each.
Per cell (bench_capacity's clients and counters): tok/s delivered in the window, TPOT p50/p90,
TTFT p50, the engine's own time a round in the same run (its step and bookkeeping, from the
target's metrics), and every process's CPU a token. Then, with the stack down, the engine loop
in this process on the same device, model and head (no Redis, no router, no client over a
network): its tok/s and TPOT at the same loads, the reference the stack is compared with.

    bash bench/gpu_stack.sh                            # on the GPU node: the carried wheels, then this
    python bench/gpu_stack.py --device cuda [--streams 1,16,64] [--apis grpc,http]
    python bench/gpu_stack.py --smoke --device cpu --out /tmp/x   # the suite's run: seconds, on the CPU

Results: <out>/gpu_stack.json and .png. Exit 2 where `--device cuda` finds no GPU.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench_capacity import Roles, _pct, run_cell
from common import engine_running, parser, run_threads, warn_if_busy

from specserve.tooling.modelbuild.build import find_pair, load_eval_prompts
from specserve.tooling.stack import PoolSpec, Stack, StackSpec

ARMS = ("plain", "eagle-local")


def stack_spec(pair: Path, run_dir: str, device: str, max_batch: int) -> StackSpec:
    return StackSpec(
        pair_dir=str(pair), run_dir=run_dir, pools={"eagle-local": PoolSpec("eagle", local=True)},
        # the forward runs on the device: torch's CPU threads serve the host's few ops, at the
        # worker's own default (TargetSettings.torch_threads), what a deployment's target gets
        target_ray=False, target_threads=2,
        env={"SPECSERVE_TARGET_DEVICE": device, "SPECSERVE_TARGET_MAX_BATCH": str(max_batch),
             "SPECSERVE_TARGET_MAX_SESSIONS": str(2 * max_batch)},
        router_env={"SPECSERVE_ROUTER_HTTP_MAX_IN_FLIGHT": "4096", "SPECSERVE_ROUTER_MAX_CONCURRENT_RPCS": "8192"})


def prompts_of(pair: Path, n: int) -> list[list[int]]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(pair / "target" / "tokenizer.json"))
    return [tok.encode(p["prompt"]).ids for p in load_eval_prompts(pair)][:n]


def pool_k(arm: str, k: int) -> tuple[str, int]:
    return ("none", 0) if arm == "plain" else (arm, k)


def measure_stack(pair: Path, a, prompts, tmp: str) -> tuple[list[dict], int]:
    """Every cell through the stack; and the torch threads its target ran with."""
    stack = Stack(stack_spec(pair, tmp, a.device, max(a.loads)))
    cells = []
    with stack.running():
        roles = Roles.of(stack)
        for api in a.apis.split(","):
            for streams in a.loads:
                for arm in a.arms.split(","):
                    cell = run_cell(roles, stack, api, streams, a, *pool_k(arm, a.k), prompts=prompts)
                    cell.update(arm=arm, device=a.device)
                    print(f"[gpu-stack] {api:4s} {arm:11s} {streams:3d} streams: {cell['tok_s']:8.1f} tok/s  "
                          f"TPOT p50 {cell['tpot_ms_p50'] or 0:.2f} ms (engine {cell['engine_tpot_ms']:.2f})  "
                          f"router {cell['router_ms']:.3f} ms, Redis {cell['redis_ms']:.3f}, target host "
                          f"{cell['target_host_ms']:.3f} CPU a token", file=sys.stderr, flush=True)
                    cells.append(cell)
    return cells, stack.spec.target_threads


def _engine(pair: Path, device: str, max_batch: int):
    """The target's own build (`actor._build`) and its eagle-local source, as the worker makes them."""
    from specserve.config import LOCAL_EAGLE, TargetSettings
    from specserve.services.target.actor import _build, eagle_local

    s = TargetSettings(model=str(pair / "target"), device=device, max_batch=max_batch, max_sessions=2 * max_batch,
                       draft_pools={"eagle-local": [LOCAL_EAGLE]})
    target, engine = _build(s)
    return target, engine, {"eagle-local": eagle_local(s, engine, target)}


def engine_alone(pair: Path, a, prompts, threads: int) -> dict[str, dict]:
    """The engine loop in this process on the same device, model and head, with the stack's
    target's torch threads, at each load and arm: tok/s over the wall and TPOT p50 (a session's
    rounds after its first, a token each)."""
    import torch

    from specserve.algorithm.stops import StopChecker
    from specserve.engine.loop import EngineLoop
    from specserve.engine.scheduler import Budget
    from specserve.engine.session import EnginePlan
    from specserve.params import GenerationParams, SamplingParams
    from specserve.worker.threads import ModelThread

    torch.set_num_threads(threads)
    model_thread = ModelThread("engine")
    target, model, sources = model_thread.submit(_engine, pair, a.device, max(a.loads)).result()
    ends: dict[str, tuple[threading.Event, list[tuple[float, int]]]] = {}

    class Watch:
        def round(self, session, stats) -> None:
            ends[session.id][1].append((time.perf_counter(), session.n_generated))

        def finished(self, session) -> None:
            ends[session.id][0].set()

    loop = EngineLoop(model, lambda p: StopChecker(frozenset(target.eos_token_ids), tuple(p.stop), str), sources,
                      None, observers=[Watch()], budget=Budget(max_batch=max(a.loads)))
    out = {}
    with engine_running(loop, model_thread):
        for arm in a.arms.split(","):
            pool, k = pool_k(arm, a.k)
            params = GenerationParams(max_tokens=a.tokens, num_draft_tokens=k, seed=0,
                                      sampling=SamplingParams(banned_token_ids=tuple(sorted(target.eos_token_ids))))
            plan = EnginePlan(params, pool=None if pool == "none" else pool)
            for streams in a.loads:
                out[f"{arm}/{streams}"] = _alone_cell(loop, ends, plan, prompts, streams, a.requests)
    return out


def _alone_cell(loop, ends, plan, prompts, streams: int, requests: int) -> dict:
    tpots: list[float] = []
    tokens = [0]

    def client(i: int) -> None:
        for j in range(requests):
            sid = f"alone-{plan.pool}-{streams}-{i}-{j}"
            ends[sid] = (threading.Event(), [])
            loop.add(sid, prompts[(i * requests + j) % len(prompts)], plan).result()
            ends[sid][0].wait(300)
            marks = ends[sid][1]
            tokens[0] += marks[-1][1] if marks else 0
            if len(marks) > 1 and marks[-1][1] > marks[0][1]:  # after the prefill's round and its first token
                tpots.append((marks[-1][0] - marks[0][0]) * 1e3 / (marks[-1][1] - marks[0][1]))

    wall = run_threads(client, streams)
    tpots.sort()
    return {"streams": streams, "tok_s": tokens[0] / wall, "tpot_ms_p50": _pct(tpots, 50),
            "tpot_ms_p90": _pct(tpots, 90), "requests": streams * requests}


def summary(cells: list[dict], alone: dict[str, dict]) -> list[dict]:
    """Each cell beside the engine alone at the same arm and load: the stack's share of its tok/s
    and the TPOT the stack adds."""
    rows = []
    for c in cells:
        ref = alone.get(f"{c['arm']}/{c['streams']}", {})
        rows.append({"api": c["api"], "arm": c["arm"], "streams": c["streams"], "tok_s": c["tok_s"],
                     "engine_alone_tok_s": ref.get("tok_s"),
                     "share_of_engine": c["tok_s"] / ref["tok_s"] if ref.get("tok_s") else None,
                     "tpot_ms_p50": c["tpot_ms_p50"], "engine_alone_tpot_ms_p50": ref.get("tpot_ms_p50"),
                     "tpot_added_ms": (c["tpot_ms_p50"] - ref["tpot_ms_p50"])
                     if c["tpot_ms_p50"] is not None and ref.get("tpot_ms_p50") is not None else None,
                     "engine_tpot_ms_in_stack": c["engine_tpot_ms"], "router_ms": c["router_ms"],
                     "redis_ms": c["redis_ms"], "target_host_ms": c["target_host_ms"]})
    return rows


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    keys = sorted({(r["api"], r["arm"]) for r in rows})
    for api, arm in keys:
        rs = sorted((r for r in rows if (r["api"], r["arm"]) == (api, arm)), key=lambda r: r["streams"])
        ax.plot([r["streams"] for r in rs], [r["tok_s"] for r in rs], marker="o", label=f"stack {api} {arm}")
    for arm in sorted({r["arm"] for r in rows}):
        rs = sorted({r["streams"]: r for r in rows if r["arm"] == arm}.values(), key=lambda r: r["streams"])
        ax.plot([r["streams"] for r in rs], [r["engine_alone_tok_s"] or 0 for r in rs], ls="--",
                label=f"engine alone {arm}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("streams")
    ax.set_ylabel("tok/s")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--streams", default="1,16,64")
    ap.add_argument("--apis", default="grpc,http")
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--warm", type=float, default=2.0)
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--requests", type=int, default=3, help="the engine alone: requests a stream")
    ap.add_argument("--smoke", action="store_true", help="seconds on the CPU: 2 streams, checks the script")
    a = ap.parse_args()
    if a.smoke:
        a.streams, a.tokens, a.warm, a.seconds, a.requests = "2", 12, 0.5, 1.5, 1
    a.loads = [int(s) for s in a.streams.split(",")]
    if a.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            print("gpu_stack.py --device cuda needs a CUDA device; `--smoke --device cpu` runs it on the CPU",
                  file=sys.stderr)
            sys.exit(2)
    pair = find_pair(a.models)
    prompts = prompts_of(pair, 8)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    load_before = warn_if_busy()
    with tempfile.TemporaryDirectory(prefix="specserve-gpu-stack-") as tmp:
        cells, threads = measure_stack(pair, a, prompts, tmp)
    alone = engine_alone(pair, a, prompts, threads)
    rows = summary(cells, alone)
    result = {"meta": {"args": {k: v for k, v in vars(a).items()}, "cpus": os.cpu_count(),
                       "load_before": load_before, "load_after": os.getloadavg(), "target_launcher": "plain (no Ray)",
                       "target_threads": threads},
              "cells": cells, "engine_alone": alone, "summary": rows}
    (out / "gpu_stack.json").write_text(json.dumps(result, indent=1))
    plot(rows, out / "gpu_stack.png")
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
