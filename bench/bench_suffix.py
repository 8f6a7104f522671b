"""Suffix decoding through the stack (ADR 0026), side by side in one run on the shipped pair:
the `suffix` pool (inside the target, `local:suffix`) against plain decoding, the n-gram pool
(`ngram`, inside the target) and the distilled draft model (`small`, 2 replicas), as `make
run` serves them, through the OpenAI API (bench_peer's streaming client), greedy.

Workloads (tooling/workloads.py): `agent`, a repeat-heavy class (the same orders extracted
again from other renderings: its outputs recur, its prompts do not), and `extraction` (the
pair's held-out records: their JSON keys and shapes recur, their values do not). Before any
cell, each class's `warm` requests run plain: the class index learns from them (every
finished session of the class feeds it). The measured prompts are never among them, and the
suffix arm runs first on each set (the other pinned arms never draft from the index, so the
outputs they add cannot flatter it); the controller's cells at 16 streams run on a set of
their own. The machine's load drifts (other work shares it): the 1-stream arms are paired
prompt by prompt, and the 16-stream cells run plain, controller, controller, plain. Cells:

  1 stream   agent, extraction: suffix (K 32: the drafter's own length rule within it),
             plain, ngram (K 4 and 8), small (K 4)
  16 streams agent, extraction, code, chat: the controller (each class's policy lets it choose
             among the three pools, K adaptive in [1, 32]) against plain

Then the target's index figures (its metrics) and, on a synthetic class index of 65 k tokens
of extraction outputs, the drafting time a round and the memory a token (python's timeit,
thread CPU time). Writes <out>/suffix.json and <out>/suffix.png; prints each target met or
missed.

    nice -n 10 python bench/bench_suffix.py [--max-tokens 64] [--controller-warm 16]
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from bench_peer import one_request, run_cell, served_model
from common import cell_summary, parser, warn_if_busy

from specserve.tooling.modelbuild.build import find_pair, load_eval_prompts
from specserve.tooling.stack import PoolSpec, Stack, StackSpec, local_target_threads
from specserve.tooling.workloads import agent_workload

POOLS = ("suffix", "ngram", "small")
POLICY = {"draft_pool": "suffix", "draft_pools": ["ngram", "small"], "adaptive_k": True, "k_min": 1, "k_max": 32}


def stack_spec(pair: Path, run_dir: Path, threads: int) -> StackSpec:
    policies = {cls: POLICY for cls in ("agent", "extraction", "code", "chat")}
    return StackSpec(pair_dir=str(pair), run_dir=str(run_dir), target_threads=threads,
                     pools={"small": PoolSpec("draft", 2), "ngram": PoolSpec("ngram", local=True),
                            "suffix": PoolSpec("suffix", local=True)},
                     router_env={"SPECSERVE_ROUTER_POLICIES": json.dumps(policies),
                                 "SPECSERVE_ROUTER_MAX_TOKENS_LIMIT": "512"})


def workloads(pair: Path) -> dict[str, dict[str, list[str]]]:
    """Per class: warm (the index learns from them, plain), one (the 1-stream cells), many
    (the 16-stream cells): disjoint sets of prompts, each measured prompt once a cell (a
    prompt run twice would find its own output in the index the second time)."""
    held = {c: [p["prompt"] for p in load_eval_prompts(pair) if p["workload_class"] == c]
            for c in ("extraction", "code", "chat")}
    a1, a16 = agent_workload(8, first=0), agent_workload(8, first=8)
    return {"agent": {"warm": a1.warm + a16.warm, "one": a1.held_out, "many": a16.held_out},
            "extraction": {"warm": held["extraction"][:6], "one": held["extraction"][6:14],
                           "many": held["extraction"][14:30]},
            "code": {"warm": held["code"][16:], "one": [], "many": held["code"][:16]},
            "chat": {"warm": held["chat"][16:], "one": [], "many": held["chat"][:16]}}


ONE_STREAM_ARMS = {  # in this order: the suffix arm first on each prompt
    "suffix": {"draft_pool": "suffix", "num_draft_tokens": 32},
    "plain": {"draft_pool": "none"},
    "ngram K4": {"draft_pool": "ngram", "num_draft_tokens": 4},
    "ngram K8": {"draft_pool": "ngram", "num_draft_tokens": 8},
    "small K4": {"draft_pool": "small", "num_draft_tokens": 4},
}


def one_stream(url: str, model: str, cls: str, prompts: list[str], max_tokens: int) -> list[dict]:
    """The 1-stream arms, paired prompt by prompt (each prompt through every arm in turn, the
    suffix arm first), so a load that drifts over the run weighs on every arm alike. Only the
    suffix arm's requests carry the class: the others' (the same greedy outputs) are counted
    under a class of their own, so the index holds the warm outputs and the suffix arm's own."""
    from openai import OpenAI

    client = OpenAI(base_url=url + "/v1", api_key="none", timeout=600, max_retries=0)
    done: dict[str, list[dict]] = {arm: [] for arm in ONE_STREAM_ARMS}
    walls = dict.fromkeys(ONE_STREAM_ARMS, 0.0)
    for prompt in prompts:
        for arm, extra in ONE_STREAM_ARMS.items():
            label = cls if arm == "suffix" else f"{cls}-ref"
            t = time.perf_counter()
            done[arm].append(one_request(client, model, prompt, max_tokens, {**extra, "workload_class": label}))
            walls[arm] += time.perf_counter() - t
    cells = []
    for arm, rs in done.items():
        cell = cell_summary(rs, 1, walls[arm], dict(enumerate(r["text"] for r in rs)))
        cell.update({"class": cls, "arm": arm, "tokens_per_pass": sum(r["tokens"] for r in rs)
                     / sum(r["rounds"] for r in rs), "accepted_per_round": sum(r["accepted"] or 0 for r in rs)
                     / sum(r["rounds"] for r in rs)})
        print(f"[suffix] {cls:10s} {arm:10s}  1 stream  {cell['tok_s']:7.1f} tok/s  "
              f"tok/pass {cell['tokens_per_pass']:.2f}", file=sys.stderr, flush=True)
        cells.append(cell)
    return cells


def sixteen_streams(url: str, model: str, cls: str, prompts: list[str], max_tokens: int) -> list[dict]:
    """The controller against plain at 16 streams, in the order plain, controller, controller,
    plain (a drifting load weighs on both alike), pooled per arm; each prompt once a cell."""
    runs: dict[str, list[dict]] = {"controller": [], "plain": []}
    for arm in ("plain", "controller", "controller", "plain"):
        extra = {"workload_class": cls, **({"draft_pool": "none"} if arm == "plain" else {})}
        runs[arm].append(run_cell(url, model, prompts, 16, len(prompts) // 16, max_tokens, extra))
    cells = []
    for arm, rs in runs.items():
        tokens, wall = sum(c["tokens"] for c in rs), sum(c["wall_s"] for c in rs)
        cell = {"class": cls, "arm": arm, "streams": 16, "tok_s": tokens / wall, "tokens": tokens, "wall_s": wall,
                "tok_s_each": [round(c["tok_s"], 1) for c in rs], "texts": rs[-1]["texts"],
                "tokens_per_pass": sum(c.get("tokens_per_pass", 1.0) for c in rs) / len(rs),
                "ran": sorted({x for c in rs for r in (c["ran"] or []) for x in r})}
        print(f"[suffix] {cls:10s} {arm:10s} 16 streams {cell['tok_s']:7.1f} tok/s  each {cell['tok_s_each']}  "
              f"tok/pass {cell['tokens_per_pass']:.2f}  ran {cell['ran']}", file=sys.stderr, flush=True)
        cells.append(cell)
    return cells


def measure(url: str, loads: dict, a) -> list[dict]:
    model = served_model(url)
    for cls, sets in loads.items():  # the index learns each class's warm outputs first
        if sets["warm"] and cls in ("agent", "extraction"):
            run_cell(url, model, sets["warm"], 1, len(sets["warm"]), a.max_tokens,
                     {"draft_pool": "none", "workload_class": cls})
    cells = []
    for cls in ("agent", "extraction"):
        cells += one_stream(url, model, cls, loads[cls]["one"], a.max_tokens)
    for cls in ("agent", "extraction", "code", "chat"):
        if a.controller_warm:  # the controller's first requests learn the class's pools (not counted)
            run_cell(url, model, loads[cls]["warm"], 4, max(a.controller_warm // 4, 1), a.max_tokens,
                     {"workload_class": cls})
        cells += sixteen_streams(url, model, cls, loads[cls]["many"], a.max_tokens)
    return cells


def _scrape(address: str) -> dict[str, dict[str, float]]:
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=5).read().decode()
    out: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith(("specserve_suffix_", "specserve_draft_latency_seconds")):
                key = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                out.setdefault(s.name, {})[key] = s.value
    return out


def synthetic_index(pair: Path, tokens: int = 65_536) -> dict:
    """Drafting time a round (thread CPU, best of 5 x 500) and memory on a class index of
    `tokens` tokens of the pair's extraction outputs (their JSON, tokenized), with a session
    of a long prompt: the figure at a full default index, which the stack's short run never fills."""
    import json as js
    import random
    import timeit

    from tokenizers import Tokenizer

    from specserve.drafters.suffix import SuffixDrafter
    from specserve.drafters.suffix_index import SuffixIndex
    from specserve.tooling.modelbuild import corpus

    tok = Tokenizer.from_file(str(pair / "target" / "tokenizer.json"))
    rng = random.Random(1)
    index = SuffixIndex(max_requests=1 << 16, max_tokens=tokens)
    t0 = time.thread_time()
    added = 0
    while index.tokens < tokens - 200:
        index.add(tok.encode(" " + js.dumps(corpus._record(rng)[1])).ids)
        added += 1
    add_us = (time.thread_time() - t0) / added * 1e6
    src, rec = corpus._record(rng)
    prompt = tok.encode("x = 1\n" * 100 + f"Extract the record as JSON.\nText: {src}\nJSON:").ids
    out = tok.encode(" " + js.dumps(rec)).ids
    session = SuffixDrafter(tok.get_vocab_size()).start(index)
    per_position = []
    for i in range(1, len(out)):  # every position of an output, as its rounds reach them
        ctx = prompt + out[:i]
        session.drafts(ctx, 32)
        per_position.append(min(timeit.Timer(lambda c=ctx: session.drafts(c, 32), timer=time.thread_time)
                                .repeat(5, 50)) / 50 * 1e6)
    per_position.sort()
    return {"tokens": index.tokens, "outputs": index.requests, "bytes": index.nbytes,
            "bytes_per_token": index.nbytes / index.tokens, "session_tokens": len(prompt) + len(out),
            "draft_us_p50": per_position[len(per_position) // 2],
            "draft_us_p90": per_position[int(len(per_position) * 0.9)], "draft_us_max": per_position[-1],
            "add_us_per_output": add_us}


def verdicts(cells: list[dict]) -> list[dict]:
    def tok_s(cls: str, arm: str, streams: int) -> float:
        return next(c["tok_s"] for c in cells if c["class"] == cls and c["arm"] == arm and c["streams"] == streams)

    out = []

    def check(what: str, got: float, target: float) -> None:
        out.append({"target": what, "measured": round(got, 3), "needed": target, "met": got >= target})

    check("agent: suffix / plain at 1 stream", tok_s("agent", "suffix", 1) / tok_s("agent", "plain", 1), 2.0)
    ngram = max(tok_s("agent", "ngram K4", 1), tok_s("agent", "ngram K8", 1))
    check("agent: suffix / ngram (its better K) at 1 stream", tok_s("agent", "suffix", 1) / ngram, 1.5)
    check("extraction: suffix / small at 1 stream", tok_s("extraction", "suffix", 1)
          / tok_s("extraction", "small K4", 1), 1.0)
    for cls in ("agent", "extraction", "code", "chat"):
        check(f"{cls}: controller / plain at 16 streams", tok_s(cls, "controller", 16) / tok_s(cls, "plain", 16), 1.0)
    return out


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--controller-warm", type=int, default=16)
    ap.add_argument("--target-threads", type=int, default=local_target_threads())
    a = ap.parse_args()
    load = warn_if_busy()
    pair = find_pair(a.models).resolve()
    loads = workloads(pair)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench-suffix-") as tmp, \
            Stack(stack_spec(pair, Path(tmp), a.target_threads)).running(timeout_s=600) as stack:
        cells = measure(stack.info.http, loads, a)
        index = _scrape(stack.info.metrics["target"])
    synthetic = synthetic_index(pair)
    for c in cells:  # every greedy text the same as plain's on the same prompts
        plain = next(p for p in cells if p["class"] == c["class"] and p["arm"] == "plain"
                     and p["streams"] == c["streams"])
        c["same_as_plain"] = all(c["texts"][n] == plain["texts"][n] for n in c["texts"] if n in plain["texts"])
        c["speedup"] = c["tok_s"] / plain["tok_s"]
    result = {"pair": str(pair), "max_tokens": a.max_tokens, "load_before": load,
              "load_after": os.getloadavg(), "wall_s": time.monotonic() - t0, "target_threads": a.target_threads,
              "cells": [{k: v for k, v in c.items() if k != "texts"} for c in cells],
              "index_metrics": index, "synthetic_index": synthetic, "verdicts": verdicts(cells)}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "suffix.json").write_text(json.dumps(result, indent=1))
    _plot(result, out / "suffix.png")
    for v in result["verdicts"]:
        print(f"{'MET   ' if v['met'] else 'MISSED'} {v['target']}: {v['measured']:.2f} (>= {v['needed']})")
    print(f"index: {synthetic['tokens']} tokens, {synthetic['bytes_per_token']:.1f} B a token; drafting a round "
          f"p50 {synthetic['draft_us_p50']:.0f} us, p90 {synthetic['draft_us_p90']:.0f} us")
    print(f"wrote {out / 'suffix.json'} and {out / 'suffix.png'}")


def _plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = result["cells"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2), gridspec_kw={"width_ratios": [3, 2, 1.4]})
    one = [c for c in cells if c["streams"] == 1]
    arms = list(ONE_STREAM_ARMS)
    for i, cls in enumerate(("agent", "extraction")):
        ys = [next(c["speedup"] for c in one if c["class"] == cls and c["arm"] == arm) for arm in arms]
        axes[0].bar([x + i * 0.4 for x in range(len(arms))], ys, width=0.4, label=cls)
    axes[0].set_xticks([x + 0.2 for x in range(len(arms))], arms)
    axes[0].axhline(1.0, color="grey", lw=0.5)
    axes[0].set(title="1 stream: tok/s over plain (CPU, through the stack)", ylabel="speedup")
    axes[0].legend()
    many = [c for c in cells if c["streams"] == 16 and c["arm"] == "controller"]
    axes[1].bar([c["class"] for c in many], [c["speedup"] for c in many])
    axes[1].axhline(1.0, color="grey", lw=0.5)
    axes[1].set(title="16 streams: the controller (with suffix) over plain")
    s = result["synthetic_index"]
    axes[2].axis("off")
    axes[2].text(0, 0.9, f"class index, {s['tokens'] // 1024} k tokens:\n{s['bytes'] / 2**20:.1f} MiB "
                 f"({s['bytes_per_token']:.0f} B a token)\n\ndrafting a round (CPU time):\n"
                 f"p50 {s['draft_us_p50']:.0f} us, p90 {s['draft_us_p90']:.0f} us\n\nadding an output: "
                 f"{s['add_us_per_output']:.0f} us", va="top", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)


if __name__ == "__main__":
    main()
