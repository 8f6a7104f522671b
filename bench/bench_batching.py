"""Continuous batching through the stack (issue 10, ADR 0013): throughput and TPOT against
concurrency, plain and speculative, beside the in-process batched bound, in one run.

Starts the local stack (Redis, Ray + target, draft pool `small`, router) with batching on,
then for each concurrency C runs C client threads, each sending `--requests` greedy requests
of `--max-tokens` tokens, for every arm, the arms interleaved:
  plain       draft_pool "none"
  k<K>        pool small, fixed K (--k, and at --sweep-at every K in 1..8)
  controller  the class's policy: pool small, adaptive K in 1..8, the controller decides
Throughput = tokens / wall time of the cell; TPOT = a request's wall time / its tokens
(p50, p90, p99 over the cell's requests). The in-process bound is the plain batched forward
of the same target (models/runner.py): C rows decoding one token each per step.
Capacity at a latency objective: the largest C whose p90 TPOT stays within 2x the
single-stream plain TPOT (p50). With --compare-off, plain and fixed K are run again at those
concurrencies on a second stack with batching off (the per-session path, today's baseline).
Writes <out>/batching.json and <out>/batching.png.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
from common import parser, run_threads

from specserve.tooling.stack import local_target_threads

CLASS = "bench"  # the controller arm's workload class (its policy below)


ROLES = (("target", "ray::TargetWorker"), ("router", "specserve.services.router"),
         ("draft", "specserve.services.draft"),
         ("redis", "redis-server"), ("ray", "ray"), ("bench", "bench_batching"))


def cpu_by_role() -> dict[str, float]:
    """CPU seconds (user + system) so far of every process on the machine, by role (the first
    pattern its command line contains; "other" for the rest): where a cell's CPU went."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        role = next((r for r, pat in ROLES if pat in cmd), "other")
        out[role] = out.get(role, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def cell(stub, arm: str, k: int, prompts: list[str], conc: int, requests: int, max_tokens: int) -> dict:
    from specserve.v1 import generation_pb2

    log: list[tuple[float, int, int]] = []  # (wall s, tokens, rounds)
    errors: list[str] = []

    def client(i: int) -> None:
        for j in range(requests):
            prompt = prompts[(i * requests + j) % len(prompts)]
            kw = {"workload_class": CLASS} if arm == "controller" else \
                {"workload_class": f"{CLASS}-{arm}", "draft_pool": "none" if arm == "plain" else "small",
                 "num_draft_tokens": 0 if arm == "plain" else k}
            req = generation_pb2.GenerateRequest(prompt=prompt, max_tokens=max_tokens, **kw)
            t0 = time.perf_counter()
            try:
                resp = stub.Generate(req, timeout=600)
            except Exception as exc:  # noqa: BLE001 - reported in the results
                errors.append(str(exc)[:200])
                continue
            log.append((time.perf_counter() - t0, len(resp.token_ids), len(resp.stats.round)))

    cpu0 = cpu_by_role()
    wall = run_threads(client, conc)
    cpu1 = cpu_by_role()
    cpu_share = {r: round((cpu1.get(r, 0) - cpu0.get(r, 0)) / wall, 3) for r in cpu1}  # cores busy, by role
    tpot = np.array([w / max(n, 1) * 1e3 for w, n, _ in log]) if log else np.array([np.nan])
    tokens = sum(n for _, n, _ in log)
    return {"arm": arm, "k": k, "concurrency": conc, "tokens": tokens, "wall_s": wall, "tok_s": tokens / wall,
            "tpot_p50_ms": float(np.percentile(tpot, 50)), "tpot_p90_ms": float(np.percentile(tpot, 90)),
            "tpot_p99_ms": float(np.percentile(tpot, 99)), "requests": len(log), "errors": errors[:3],
            "rounds_per_token": sum(r for *_, r in log) / max(tokens, 1), "tpot_ms": tpot.tolist(),
            "cores_busy": cpu_share}


def merge(cells: list[dict]) -> dict:
    """Repeats of one cell: tokens / summed wall time, TPOT percentiles over every request."""
    tpot = np.array([t for c in cells for t in c.pop("tpot_ms")])
    r = dict(cells[0])
    r.update(tokens=sum(c["tokens"] for c in cells), wall_s=sum(c["wall_s"] for c in cells),
             requests=sum(c["requests"] for c in cells), errors=[e for c in cells for e in c["errors"]][:3],
             rounds_per_token=sum(c["rounds_per_token"] * c["tokens"] for c in cells)
             / max(sum(c["tokens"] for c in cells), 1), repeats=len(cells))
    r["tok_s"] = r["tokens"] / r["wall_s"]
    roles = {k for c in cells for k in c["cores_busy"]}
    r["cores_busy"] = {k: round(sum(c["cores_busy"].get(k, 0) * c["wall_s"] for c in cells) / r["wall_s"], 3)
                       for k in sorted(roles)}
    for q in (50, 90, 99):
        r[f"tpot_p{q}_ms"] = float(np.percentile(tpot, q))
    return r


def bound(pair: Path, prompts: list[str], concs: list[int], max_tokens: int, threads: int) -> dict[int, float]:
    """tok/s of the plain batched forward of the target, C rows one token per step."""
    import torch

    from specserve.models.loading import load_pair
    from specserve.models.runner import ModelRunner, Row

    torch.set_num_threads(threads)
    lp = load_pair(str(pair / "target"), str(pair / "draft"))
    runner = ModelRunner.from_hf(lp.target, max_sessions=max(concs), max_len=512)
    ids = [lp.tokenizer.encode(p)[:400] for p in prompts]
    out = {}
    for c in concs:
        sids = [f"b{c}-{i}" for i in range(c)]
        for i, s in enumerate(sids):
            runner.allocate(s)
            runner.forward([Row(s, ids[i % len(ids)], num_logits=1)])
        last = {s: 0 for s in sids}
        for _ in range(2):  # warm this batch size
            runner.forward([Row(s, [0], num_logits=1) for s in sids])
        t0 = time.perf_counter()
        for _ in range(max_tokens):
            logits = runner.forward([Row(s, [last[s]], num_logits=1) for s in sids])
            last = {s: int(lg[-1].argmax()) for s, lg in zip(sids, logits, strict=True)}
        out[c] = c * max_tokens / (time.perf_counter() - t0)
        for s in sids:
            runner.free(s)
    return out


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--concurrency", default="1,4,16,32")
    ap.add_argument("--requests", type=int, default=2, help="requests per client thread per cell")
    ap.add_argument("--repeats", type=int, default=2, help="cells per arm, the arms interleaved")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--k", type=int, default=4, help="the fixed-K arm")
    ap.add_argument("--sweep-at", type=int, default=16, help="concurrency of the K in 1..8 sweep (0 = none)")
    ap.add_argument("--controller-warm", type=int, default=2, help="controller requests per client before a cell")
    ap.add_argument("--compare-off", default="1,16",
                    help="concurrencies run again on a stack with batching off (today's path); empty = skip")
    ap.add_argument("--target-threads", type=int, default=local_target_threads(),
                    help="the target's and the bound's torch threads (default: all cores but one, at most 2)")
    args = ap.parse_args()
    from specserve.tooling.modelbuild.build import find_pair, load_eval_prompts

    pair = find_pair(args.models)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prompts = [p["prompt"] for p in load_eval_prompts(pair)]
    concs = [int(c) for c in args.concurrency.split(",")]
    load_before = _uptime()
    rows = run_stack(pair, args, prompts, concs, batching=True)
    if args.compare_off:  # today's per-session path, same run: the baseline batching must beat
        rows += run_stack(pair, args, prompts, [int(c) for c in args.compare_off.split(",")], batching=False)
    bound_tok_s = bound(pair, prompts, concs, args.max_tokens, args.target_threads)
    result = {"rows": rows, "bound_tok_s": bound_tok_s, "capacity": capacity(rows), "config": vars(args),
              "controller_vs_best": controller_vs_best(rows, args.sweep_at),
              "load_before": load_before, "load_after": _uptime()}
    path = out / "batching.json"
    path.write_text(json.dumps(result, indent=1))
    print_table(result)
    plot(result, out / "batching.png")
    print(f"wrote {path} and {out / 'batching.png'}")


def run_stack(pair: Path, args, prompts: list[str], concs: list[int], batching: bool) -> list[dict]:
    """One stack, every cell; with batching off only plain and fixed K (arms suffixed -off)."""
    import grpc

    from specserve.tooling.stack import PoolSpec, Stack, StackSpec
    from specserve.v1 import generation_pb2_grpc

    rows = []
    off = {} if batching else {"SPECSERVE_TARGET_BATCHING": "false", "SPECSERVE_DRAFT_BATCHING": "false"}
    with tempfile.TemporaryDirectory(prefix="specserve-bench-") as tmp:
        spec = StackSpec(
            pair_dir=str(pair), run_dir=str(Path(tmp) / "run"), target_threads=args.target_threads,
            pools={"small": PoolSpec("draft")}, env=off,
            router_env={"SPECSERVE_ROUTER_CONTROLLER_HALF_LIFE_S": "10",
                        "SPECSERVE_ROUTER_MAX_TOKENS_LIMIT": str(max(args.max_tokens, 64)),
                        "SPECSERVE_ROUTER_POLICIES": json.dumps({CLASS: {
                            "draft_pool": "small", "adaptive_k": True, "k_min": 1, "k_max": 8,
                            "safety_margin": 0.05, "probe_fraction": 0.05}})},
        )
        with Stack(spec).running() as stack:
            channel = grpc.insecure_channel(stack.info.router)
            stub = generation_pb2_grpc.GenerationStub(channel)
            cell(stub, "plain", 0, prompts, 2, 1, 8)  # warm every path once
            cell(stub, f"k{args.k}", args.k, prompts, 2, 1, 8)
            for c in concs:
                arms = [("plain", 0), (f"k{args.k}", args.k)]
                if batching:
                    arms.append(("controller", 0))
                    if c == args.sweep_at:
                        arms += [(f"k{k}", k) for k in range(1, 9) if k != args.k]
                    cell(stub, "controller", 0, prompts, c, args.controller_warm, args.max_tokens)  # learn this load
                cells: dict[str, list[dict]] = {}
                for _ in range(args.repeats):  # arms interleaved: the machine's noise hits them alike
                    for arm, k in arms:
                        cells.setdefault(arm, []).append(cell(stub, arm, k, prompts, c, args.requests,
                                                              args.max_tokens))
                for got in cells.values():
                    r = merge(got)
                    if not batching:
                        r["arm"] += "-off"
                    rows.append(r)
                    print(f"C={c:<3} {r['arm']:<11} {r['tok_s']:7.1f} tok/s  TPOT p50 {r['tpot_p50_ms']:6.1f} "
                          f"p99 {r['tpot_p99_ms']:6.1f} ms  errors {len(r['errors'])}", flush=True)
            channel.close()
    return rows


def controller_vs_best(rows: list[dict], conc: int) -> dict:
    """At the sweep's concurrency: the best fixed arm (plain or K in 1..8) and the controller's
    throughput over it (issue 10 part 5 asks >= 0.95)."""
    at = {r["arm"]: r["tok_s"] for r in rows if r["concurrency"] == conc and not r["arm"].endswith("-off")}
    fixed = {a: v for a, v in at.items() if a != "controller"}
    if "controller" not in at or not fixed:
        return {}
    best = max(fixed, key=fixed.get)
    return {"concurrency": conc, "best_fixed": best, "best_tok_s": fixed[best], "controller_tok_s": at["controller"],
            "ratio": at["controller"] / fixed[best]}


def capacity(rows: list[dict]) -> dict:
    """Per arm: the largest concurrency whose p90 TPOT <= 2x single-stream plain p50 TPOT."""
    base = [r for r in rows if r["arm"] == "plain" and r["concurrency"] == 1]
    if not base:
        return {}
    slo = 2 * base[0]["tpot_p50_ms"]
    out: dict = {"slo_ms": slo}
    for arm in sorted({r["arm"] for r in rows}):
        ok = [r["concurrency"] for r in rows if r["arm"] == arm and r["tpot_p90_ms"] <= slo]
        out[arm] = max(ok) if ok else 0
    return out


def print_table(r: dict) -> None:
    print(f"\n{'C':>3} {'arm':<11}{'tok/s':>8}{'TPOT p50':>10}{'p99':>8}{'/plain':>8}{'bound':>8}")
    plain = {x["concurrency"]: x["tok_s"] for x in r["rows"] if x["arm"] == "plain"}
    for x in r["rows"]:
        c = x["concurrency"]
        print(f"{c:>3} {x['arm']:<11}{x['tok_s']:8.1f}{x['tpot_p50_ms']:10.1f}{x['tpot_p99_ms']:8.1f}"
              f"{x['tok_s'] / plain.get(c, float('nan')):8.2f}{r['bound_tok_s'].get(c, float('nan')):8.1f}")
    print("cores busy by role (of the machine's", os.cpu_count(), "):")
    for x in r["rows"]:
        if x["arm"] in ("plain", f"k{r['config']['k']}", "plain-off"):
            busy = ", ".join(f"{k} {v:.2f}" for k, v in sorted(x["cores_busy"].items(), key=lambda kv: -kv[1])
                             if v >= 0.01)
            print(f"{x['concurrency']:>3} {x['arm']:<11} {busy}")
    print("capacity (largest C with p90 TPOT <= 2x single-stream plain):", r["capacity"])
    print("controller vs the best fixed arm:", r["controller_vs_best"])


def plot(r: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for arm in ("plain", f"k{r['config']['k']}", "controller"):
        xs = [x for x in r["rows"] if x["arm"] == arm]
        a.plot([x["concurrency"] for x in xs], [x["tok_s"] for x in xs], "o-", label=arm)
        b.plot([x["concurrency"] for x in xs], [x["tpot_p50_ms"] for x in xs], "o-", label=f"{arm} p50")
    cs = sorted(int(c) for c in r["bound_tok_s"])
    a.plot(cs, [r["bound_tok_s"][c] for c in cs], "k--", label="in-process batched bound (plain)")
    a.set(xlabel="concurrent streams", ylabel="tok/s", xscale="log", title="throughput")
    b.set(xlabel="concurrent streams", ylabel="ms per token", xscale="log", title="TPOT")
    if r["capacity"]:
        b.axhline(r["capacity"]["slo_ms"], color="grey", ls=":", label="objective: 2x 1-stream plain")
    a.legend(fontsize=8)
    b.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


if __name__ == "__main__":
    main()
