"""Rollout guards (ADR 0022): how fast a class in stage `slice` on a draft pool that hurts goes
back to shadow by itself, and whether a slice on a pool that pays ever does.

One stack: the demo target (with --pass-ms simulated per forward pass), the distilled draft
(`small`) and an untrained copy of it (`poor`), two routers. Per trial a fresh class at a
50 % slice on `poor` gets one request at a time (a fresh request id each, held-out code
prompts, --max-tokens) until its policy reads shadow: the seconds and requests it took. The
control: as many fresh classes at the same slice on `small` (held-out extraction prompts),
each given as many requests as the slowest rollback took, counting the ones rolled back.
Writes <out>/rollout.json.

--healthy-minutes M instead runs one long control: a class at a 50 % slice on `small`, with the
TPOT (1.2x) and error-rate (0.02) guards on beside the speedup guard, given one request after
another for M minutes; each rollback is counted, timed and the slice set again. Writes
<out>/rollout-healthy.json.

    python bench/bench_rollout.py [--trials 10] [--max-tokens 24] [--pass-ms 30]
    python bench/bench_rollout.py --healthy-minutes 30
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
import uuid
from pathlib import Path

import grpc
from common import parser, warn_if_busy

from specserve.tooling.modelbuild.build import find_pair, load_eval_prompts, untrained_copy
from specserve.tooling.stack import PoolSpec, Stack, StackSpec
from specserve.v1 import generation_pb2, generation_pb2_grpc, policy_pb2, policy_pb2_grpc

TOKEN = "bench-token"
AUTH = [("authorization", f"Bearer {TOKEN}")]


def _slice(admin, cls: str, pool: str, **guards: float) -> None:
    admin.SetPolicy(policy_pb2.SetPolicyRequest(policy=policy_pb2.Policy(
        workload_class=cls, mode=policy_pb2.POLICY_MODE_SLICE, slice_percent=50.0, draft_pool=pool, k=4,
        safety_margin=0.1, probe_fraction=0.05, **guards)), metadata=AUTH, timeout=10)


def _mode(admin, cls: str) -> int:
    return admin.GetPolicy(policy_pb2.GetPolicyRequest(workload_class=cls), metadata=AUTH, timeout=10).mode


def trial(stubs, admin, prompts: list[str], pool: str, max_tokens: int, limit: int) -> tuple[bool, int, float]:
    """(rolled back, requests sent, seconds from the slice to the rollback or the last request)."""
    cls = f"{pool}-{uuid.uuid4().hex[:6]}"
    _slice(admin, cls, pool)
    t0 = time.monotonic()
    for i in range(limit):
        stubs[i % len(stubs)].Generate(generation_pb2.GenerateRequest(
            prompt=prompts[i % len(prompts)], max_tokens=max_tokens, workload_class=cls,
            request_id=f"{cls}-{i}"), timeout=300)
        if _mode(admin, cls) == policy_pb2.POLICY_MODE_SHADOW:
            return True, i + 1, time.monotonic() - t0
    return False, limit, time.monotonic() - t0


def healthy(stubs, admin, prompts: list[str], max_tokens: int, minutes: float) -> dict:
    """One class at a 50 % slice on the pool that pays, all guards on, for `minutes`: the rollbacks."""
    cls = f"healthy-{uuid.uuid4().hex[:6]}"
    guards = {"guard_max_tpot_ratio": 1.2, "guard_max_error_rate": 0.02}
    _slice(admin, cls, "small", **guards)
    t0 = time.monotonic()
    n, errors, rollbacks = 0, 0, []
    while time.monotonic() - t0 < minutes * 60:
        try:
            stubs[n % len(stubs)].Generate(generation_pb2.GenerateRequest(
                prompt=prompts[n % len(prompts)], max_tokens=max_tokens, workload_class=cls,
                request_id=f"{cls}-{n}"), timeout=300)
        except grpc.RpcError as exc:
            errors += 1
            print(f"request {n}: {exc.code()}", flush=True)
        n += 1
        if _mode(admin, cls) != policy_pb2.POLICY_MODE_SLICE:
            at = time.monotonic() - t0
            reason = admin.GetPolicy(policy_pb2.GetPolicyRequest(workload_class=cls), metadata=AUTH, timeout=10)
            rollbacks.append({"at_s": at, "after_requests": n, "mode": int(reason.mode)})
            print(f"ROLLED BACK at {at:.0f} s after {n} requests", flush=True)
            _slice(admin, cls, "small", **guards)
        if n % 200 == 0:
            print(f"{n} requests, {time.monotonic() - t0:.0f} s, {len(rollbacks)} rollbacks", flush=True)
    return {"minutes": minutes, "requests": n, "errors": errors, "false_rollbacks": len(rollbacks),
            "rollbacks": rollbacks, "guards": guards}


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--pass-ms", type=float, default=30.0, help="simulated target pass cost (0 = off)")
    ap.add_argument("--limit", type=int, default=60, help="requests a trial may take")
    ap.add_argument("--healthy-minutes", type=float, default=0.0,
                    help="run only the long healthy control, this many minutes")
    a = ap.parse_args()
    load = warn_if_busy()
    pair = find_pair(a.models)
    prompts = load_eval_prompts(pair)
    code = [p["prompt"] for p in prompts if p["workload_class"] == "code"]
    extraction = [p["prompt"] for p in prompts if p["workload_class"] == "extraction"]
    with tempfile.TemporaryDirectory() as tmp:
        poor = untrained_copy(pair / "draft", Path(tmp) / "poor-draft", seed=1)
        spec = StackSpec(
            pair_dir=str(pair), run_dir=str(Path(tmp) / "run"), routers=2, target_threads=1,
            pools={"small": PoolSpec("draft", env={"SPECSERVE_DRAFT_SIMULATED_TOKEN_MS": "5"}),
                   "poor": PoolSpec(str(poor))},
            router_env={"SPECSERVE_ROUTER_ADMIN_TOKENS": json.dumps({"ops": TOKEN}),
                        "SPECSERVE_ROUTER_CONTROLLER_HALF_LIFE_S": "60"},
            env={"SPECSERVE_TARGET_SIMULATED_PASS_MS": str(a.pass_ms),
                 "SPECSERVE_TARGET_CONTROLLER_HALF_LIFE_S": "60"})
        with Stack(spec).running(timeout_s=480) as stack:
            channels = [grpc.insecure_channel(r) for r in stack.info.routers]
            stubs = [generation_pb2_grpc.GenerationStub(c) for c in channels]
            admin = policy_pb2_grpc.PolicyAdminStub(channels[0])
            if a.healthy_minutes:
                result = healthy(stubs, admin, extraction, a.max_tokens, a.healthy_minutes)
                result.update(load_before=load, max_tokens=a.max_tokens, pass_ms=a.pass_ms)
                out = Path(a.out)
                out.mkdir(parents=True, exist_ok=True)
                (out / "rollout-healthy.json").write_text(json.dumps(result, indent=1))
                print(f"healthy slice: {result['false_rollbacks']} rollbacks over {result['requests']} requests "
                      f"in {a.healthy_minutes} min ({result['errors']} errors)")
                return
            rollbacks = []
            for t in range(a.trials):
                back, n, s = trial(stubs, admin, code, "poor", a.max_tokens, a.limit)
                rollbacks.append({"rolled_back": back, "requests": n, "seconds": s})
                print(f"poor slice {t + 1}: {'rolled back' if back else 'NOT rolled back'} after {n} requests, "
                      f"{s:.1f} s", flush=True)
            most = max(r["requests"] for r in rollbacks)
            controls = []
            for t in range(a.trials):
                back, n, s = trial(stubs, admin, extraction, "small", a.max_tokens, most)
                controls.append({"rolled_back": back, "requests": n, "seconds": s})
                print(f"small slice {t + 1}: {'ROLLED BACK' if back else 'stayed'} over {n} requests, {s:.1f} s",
                      flush=True)
            for c in channels:
                c.close()
    done = [r for r in rollbacks if r["rolled_back"]]
    summary = {
        "trials": a.trials, "load_before": load, "max_tokens": a.max_tokens, "pass_ms": a.pass_ms,
        "rolled_back": len(done),
        "seconds_p50": statistics.median(r["seconds"] for r in done) if done else None,
        "requests_p50": statistics.median(r["requests"] for r in done) if done else None,
        "false_rollbacks": sum(c["rolled_back"] for c in controls), "control_requests_each": most,
        "rollbacks": rollbacks, "controls": controls,
    }
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "rollout.json").write_text(json.dumps(summary, indent=1))
    print(f"rolled back {len(done)}/{a.trials}: p50 {summary['seconds_p50']} s, {summary['requests_p50']} requests; "
          f"false rollbacks {summary['false_rollbacks']}/{a.trials} over {most} requests each")


if __name__ == "__main__":
    main()
