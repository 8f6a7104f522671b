"""Every core the target's forward can use, on a machine its services share (issue 52 item 4,
ADR 0028): the target's torch threads, OpenMP's wait policy, and the other services niced or
pinned, through the stack a user starts (`specserve up`'s pools and policies), plain greedy
decoding over the OpenAI HTTP API (bench_peer's client), at 1, 4 and 16 streams.

Configurations (`--configs`), each a stack of its own (the target's threads and its OpenMP
environment are read when it starts):
- `t1`: the target at 1 torch thread (no team, so no wait): main's default on 2 cores;
- `tN`: the target at every core (N = os.cpu_count()), libgomp's default wait (spin 300,000
  times, then sleep: `GOMP_SPINCOUNT=300000` named, so that the stack's own choice stays out);
- `tN-passive`: every core, `OMP_WAIT_POLICY=passive` (a worker sleeps at once at the end of a
  parallel region: torch here ships GNU OpenMP, libgomp; Intel's `KMP_BLOCKTIME=0` is the same
  knob of libiomp5, which this torch does not load);
- `tN-spinX`: every core, libgomp spinning X times before it sleeps (`GOMP_SPINCOUNT`);
- `tN-swX`: every Python process of the stack with a GIL switch interval of X ms (Python's
  default is 5: a thread that waits for the GIL asks for it after that long);
- `default`: what `StackSpec()` gives now (whatever `local_target_threads` and the stack's
  placement decide), the configuration a user gets.
Placements (`--placements`), applied at run time to a running stack (every thread of every
process: Linux keeps niceness and affinity a thread), so each stack measures all of them
interleaved, load by load, in a rotated order:
- `shared`: as started;
- `niced`: every process of the stack but the target's actor (router, Redis, draft replicas, the
  launcher and its Ray head) at niceness +10 over the target's;
- `pinned`: those processes pinned to the last core, the target left on every core.
Each stack's cells are measured in rounds (`--rounds`), the configurations in a rotated order
each round, so a phase of the machine falls on all of them. Reported per cell: tok/s, TPOT p50,
the load average, and where a token's time went: the target's CPU a token (its forward's from
`specserve_target_step_cpu_seconds`), the engine's wall time a step, and the other processes'
CPU a token.

    python bench/bench_cores.py [--configs t1,t2,t2-passive,default] [--placements shared,niced,pinned]

Results: bench/results/cores.json and cores.png.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench_capacity import _cpu_s, _descendants, target_metrics
from bench_peer import run_cell, served_model
from common import parser, warn_if_busy

from specserve.tooling.modelbuild.build import find_pair, load_eval_prompts
from specserve.tooling.stack import Stack, StackSpec

PLAIN = {"draft_pool": "none"}


def config_spec(name: str, models: Path, run_dir: Path) -> StackSpec:
    """The stack `specserve up` starts, with the target's threads and OpenMP as `name` says."""
    from specserve.tooling.cli.stack import _stack_spec

    spec = _stack_spec(models, run_dir, http_port=0)
    if name == "default":
        return spec
    threads, *opts = name.removeprefix("t").split("-")
    spec.target_threads = int(threads)
    # libgomp's own default wait (spin 300,000 times, then sleep), unless the name says passive
    spec.env = {**spec.env, "GOMP_SPINCOUNT": "300000"}
    for opt in opts:
        if opt == "passive":
            spec.env = {k: v for k, v in spec.env.items() if k != "GOMP_SPINCOUNT"} | {"OMP_WAIT_POLICY": "PASSIVE"}
        elif opt.startswith("spin"):  # libgomp's spin count before a waiting thread sleeps
            spec.env = {**spec.env, "GOMP_SPINCOUNT": opt[4:]}
        elif opt.startswith("sw"):  # every service's GIL switch interval, in ms (Python's default: 5)
            spec.env = {**spec.env, "PYTHONPATH": str(_switch_dir(run_dir)), "BENCH_SWITCH_MS": opt[2:]}
    return spec


def _switch_dir(run_dir: Path) -> Path:
    """A sitecustomize that sets the GIL switch interval of every Python process started with it."""
    d = run_dir.parent / "switch"
    d.mkdir(parents=True, exist_ok=True)
    (d / "sitecustomize.py").write_text("import os, sys\n"
                                        "sys.setswitchinterval(float(os.environ['BENCH_SWITCH_MS']) / 1e3)\n")
    return d


class Placement:
    """Niceness and affinity of every thread of a stack's processes but the target's actor,
    changed and restored at run time."""

    def __init__(self, stack: Stack) -> None:
        self.target = int(stack.info.target["pid"])
        roots = [pid for pid in stack.info.pids.values()]
        self.others = sorted({p for r in roots for p in _descendants(r)} - {self.target})
        self.saved = {tid: (os.getpriority(os.PRIO_PROCESS, tid), os.sched_getaffinity(tid))
                      for tid in self._tids()}
        self.target_nice = os.getpriority(os.PRIO_PROCESS, self.target)

    def _tids(self) -> list[int]:
        out = []
        for pid in self.others:
            try:
                out += [int(t) for t in os.listdir(f"/proc/{pid}/task")]
            except OSError:
                continue
        return out

    def apply(self, name: str) -> None:
        cores = sorted(os.sched_getaffinity(0))
        for tid in self._tids():
            nice, mask = self.saved.get(tid, (self.target_nice, set(cores)))
            if name == "niced":
                nice = min(19, self.target_nice + 10)
            elif name == "pinned":
                mask = {cores[-1]}
            try:
                os.setpriority(os.PRIO_PROCESS, tid, nice)
                os.sched_setaffinity(tid, mask)
            except OSError:  # a thread that ended meanwhile
                continue


def _snapshot(stack: Stack, placement: Placement) -> dict:
    m = target_metrics(stack.info.metrics["target"])
    return {"target": _cpu_s(placement.target), "others": sum(_cpu_s(p) for p in placement.others),
            "client": sum(os.times()[:2]), **m}


def measure_cell(stack: Stack, placement: Placement, model: str, prompts, streams: int, a) -> dict:
    """One cell: the placement's tok/s and TPOT, and where a token's time went."""
    before, load = _snapshot(stack, placement), os.getloadavg()[0]
    cell = run_cell(stack.info.http, model, prompts, streams, a.requests, a.max_tokens, PLAIN)
    after = _snapshot(stack, placement)
    d = {k: after[k] - before[k] for k in before}
    tokens = cell["tokens"]
    cell.pop("texts", None)
    cell.pop("ran", None)
    cell.update(loadavg=round(load, 2), loadavg_after=round(os.getloadavg()[0], 2),
                target_cpu_ms=d["target"] * 1e3 / tokens, forward_cpu_ms=d["forward_cpu"] * 1e3 / tokens,
                others_cpu_ms=d["others"] * 1e3 / tokens, client_cpu_ms=d["client"] * 1e3 / tokens,
                step_ms=d["step_s"] * 1e3 / d["steps"] if d["steps"] else None,
                rows_per_step=d["rows"] / d["steps"] if d["steps"] else None)
    return cell


def measure_config(name: str, a, prompts, run_dir: Path, rnd: int) -> list[dict]:
    """One stack: every placement at every load, the placements rotated each load."""
    stack = Stack(config_spec(name, Path(a.models), run_dir))
    rows: list[dict] = []
    with stack.running():
        placement, model = Placement(stack), served_model(stack.info.http)
        run_cell(stack.info.http, model, prompts[:1], 1, 1, 8, PLAIN)  # warm-up
        names = a.placements.split(",")
        for i, streams in enumerate(int(x) for x in a.streams.split(",")):
            k = (i + rnd) % len(names)
            for pl in names[k:] + names[:k]:
                placement.apply(pl)
                cell = measure_cell(stack, placement, model, prompts, streams, a)
                cell.update(config=name, placement=pl, round=rnd, target_threads=stack.spec.target_threads)
                print(f"[cores] {name:11s} {pl:7s} {streams:3d} streams: {cell['tok_s']:7.1f} tok/s  TPOT p50 "
                      f"{cell['tpot_ms_p50']:5.1f} ms  target {cell['target_cpu_ms']:.2f} ms CPU a token "
                      f"(forward {cell['forward_cpu_ms']:.2f}), others {cell['others_cpu_ms']:.2f}, "
                      f"load {cell['loadavg']:.1f}", file=sys.stderr, flush=True)
                rows.append(cell)
            placement.apply("shared")
    return rows


def pooled(rows: list[dict]) -> list[dict]:
    """One row per (config, placement, load): tokens over wall time over the rounds, each
    round's tok/s beside it, and the medians of the rest."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["config"], r["placement"], r["streams"]), []).append(r)
    out = []
    for (config, pl, s), cells in groups.items():
        med = {k: statistics.median(c[k] for c in cells if c[k] is not None)
               for k in ("tpot_ms_p50", "ttft_ms_p50", "target_cpu_ms", "forward_cpu_ms", "others_cpu_ms",
                         "client_cpu_ms", "step_ms", "rows_per_step", "loadavg")
               if any(c[k] is not None for c in cells)}
        out.append({"config": config, "placement": pl, "streams": s, "target_threads": cells[0]["target_threads"],
                    "tok_s": sum(c["tokens"] for c in cells) / sum(c["wall_s"] for c in cells),
                    "tok_s_each": [round(c["tok_s"], 1) for c in cells], **med})
    return out


def table(cells: list[dict], loads: list[int]) -> str:
    lines = ["| config | placement | " + " | ".join(f"{s} streams tok/s (each round)" for s in loads) + " |",
             "|---|---|" + "---|" * len(loads)]
    for key in sorted({(c["config"], c["placement"]) for c in cells}):
        by = {c["streams"]: c for c in cells if (c["config"], c["placement"]) == key}
        lines.append(f"| {key[0]} | {key[1]} | " + " | ".join(
            f"{by[s]['tok_s']:.1f} ({', '.join(str(x) for x in by[s]['tok_s_each'])})" if s in by else ""
            for s in loads) + " |")
    return "\n".join(lines)


def plot(cells: list[dict], loads: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = sorted({(c["config"], c["placement"]) for c in cells})
    fig, axes = plt.subplots(1, len(loads), figsize=(4 * len(loads), 4))
    for ax, s in zip(axes if len(loads) > 1 else [axes], loads, strict=True):
        ys = [next((c["tok_s"] for c in cells if (c["config"], c["placement"], c["streams"]) == (*k, s)), 0.0)
              for k in series]
        ax.barh([f"{k[0]} {k[1]}" for k in series], ys)
        ax.set_title(f"{s} streams: tok/s")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    ap = parser(__doc__)
    cores = os.cpu_count() or 2
    ap.add_argument("--configs", default=f"t1,t{cores},t{cores}-passive,default")
    ap.add_argument("--placements", default="shared,niced,pinned")
    ap.add_argument("--streams", default="1,4,16")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--requests", type=int, default=4, help="requests per stream, one after another")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--label", default="")
    a = ap.parse_args()
    pair = find_pair(a.models)
    prompts = [p["prompt"] for p in load_eval_prompts(pair)][: a.prompts]
    load_before, configs, rows = warn_if_busy(), a.configs.split(","), []
    with tempfile.TemporaryDirectory(prefix="specserve-cores-") as tmp:
        for rnd in range(a.rounds):
            k = rnd % len(configs)
            for name in configs[k:] + configs[:k]:
                rows += measure_config(name, a, prompts, Path(tmp) / f"r{rnd}-{name}", rnd)
    loads = [int(x) for x in a.streams.split(",")]
    cells = pooled(rows)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "cores" + (f"-{a.label}" if a.label else "")
    (out / f"{stem}.json").write_text(json.dumps(
        {"cores": cores, "loadavg_before": load_before, "loadavg_after": os.getloadavg(), "configs": configs,
         "placements": a.placements.split(","), "streams": loads, "requests_per_stream": a.requests,
         "max_tokens": a.max_tokens, "rounds": a.rounds, "cells": cells, "each_cell": rows,
         "at": time.strftime("%Y-%m-%d %H:%M")}, indent=1))
    plot(cells, loads, out / f"{stem}.png")
    print(table(cells, loads))


if __name__ == "__main__":
    main()
