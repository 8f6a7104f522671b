"""Draft capacity under overload (ADR 0021): plain requests' TPOT beside a draft pool far
over its capacity, with the replica's admission and shedding on and off, against the same
load with no speculation at all.

One stack per arm: the demo target at --pass-ms a simulated forward pass with a batch of
--max-batch rows; one `small` replica on a slow simulated device (--draft-token-ms a drafted
token), its queue bounded by --max-queue (the `shed` arms) or unbounded (`unbounded`); in `shed-nice`
the replica runs at --draft-nice (a replica sharing the target's host yields it the cores). The
load is 2 x max_batch streaming clients: half plain (draft_pool "none"), half speculative on
`small`, each sending requests back to back for --seconds. The `no-draft` arm runs every
client plain. Reported per arm: plain requests' TPOT p50 / p90 (from the stream's chunk
times), their time to the first token and end to end (what TPOT leaves out: a wait for a
seat, ADR 0021), speculative requests' TPOT, the sessions the replica refused or shed, and whether
every output equalled the target's alone (greedy). Writes <out>/overload.json.

    python bench/bench_overload.py [--seconds 40] [--max-batch 4] [--pass-ms 30] [--draft-token-ms 40]
        [--arms no-draft,unbounded,shed,shed-nice] [--draft-nice 10]
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import grpc
from common import parser, warn_if_busy
from prometheus_client.parser import text_string_to_metric_families

from specserve.tooling.modelbuild.build import find_pair, load_eval_prompts
from specserve.tooling.stack import PoolSpec, Stack, StackSpec
from specserve.v1 import generation_pb2, generation_pb2_grpc


def _client(stub, prompts: list[str], speculative: bool, max_tokens: int, until: float, out: list) -> None:
    i = 0
    while time.monotonic() < until:
        prompt = prompts[i % len(prompts)]
        i += 1
        req = generation_pb2.GenerateRequest(prompt=prompt, max_tokens=max_tokens, workload_class="code",
                                             draft_pool="small" if speculative else "none")
        times, tokens = [], []
        sent = time.monotonic()
        for chunk in stub.GenerateStream(req, timeout=300):
            if chunk.token_ids:
                times.append(time.monotonic())
                tokens.extend(chunk.token_ids)
        if len(tokens) > 1:
            out.append({"speculative": speculative, "prompt": prompt, "tokens": tokens,
                        "tpot_ms": (times[-1] - times[0]) * 1e3 / (len(tokens) - 1),
                        "ttft_ms": (times[0] - sent) * 1e3, "e2e_ms": (times[-1] - sent) * 1e3})


def _shed(stack) -> dict[str, float]:
    got: dict[str, float] = {}
    for name, address in stack.info.metrics.items():
        if name.startswith("draft"):
            text = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
            for fam in text_string_to_metric_families(text):
                for s in fam.samples:
                    if s.name == "specserve_draft_shed_sessions_total":
                        got[s.labels["reason"]] = got.get(s.labels["reason"], 0.0) + s.value
    return got


def arm(pair: Path, name: str, prompts: list[str], a) -> dict:
    clients = 2 * a.max_batch
    with tempfile.TemporaryDirectory() as tmp:
        spec = StackSpec(
            pair_dir=str(pair), run_dir=str(Path(tmp) / "run"), routers=1, target_threads=1,
            pools={"small": PoolSpec("draft", env={"SPECSERVE_DRAFT_SIMULATED_TOKEN_MS": str(a.draft_token_ms),
                                                   "SPECSERVE_DRAFT_MAX_QUEUE": str(
                                                       a.max_queue if name.startswith("shed") else 0),
                                                   "SPECSERVE_DRAFT_MAX_BATCH": "1"})},
            env={"SPECSERVE_TARGET_SIMULATED_PASS_MS": str(a.pass_ms), "SPECSERVE_TARGET_MAX_BATCH": str(a.max_batch)})
        with Stack(spec).running(timeout_s=480) as stack:
            if name.endswith("-nice"):  # the replica yields the host's cores to the target (a shared host)
                for proc_name, proc in stack.procs.items():
                    if proc_name.startswith("draft"):
                        os.setpriority(os.PRIO_PROCESS, proc.pid, a.draft_nice)
            channel = grpc.insecure_channel(stack.info.routers[0])
            stub = generation_pb2_grpc.GenerationStub(channel)
            results: list[dict] = []
            until = time.monotonic() + a.seconds
            threads = [threading.Thread(target=_client, args=(stub, prompts[c % len(prompts):] + prompts,
                                                              name != "no-draft" and c % 2 == 1, a.max_tokens,
                                                              until, results)) for c in range(clients)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            shed = _shed(stack)
            channel.close()
    plain = sorted(r["tpot_ms"] for r in results if not r["speculative"])
    spec_ = sorted(r["tpot_ms"] for r in results if r["speculative"])
    # what TPOT leaves out: the wait for a seat (before the first token) and the whole request
    ttft = sorted(r["ttft_ms"] for r in results if not r["speculative"])
    e2e = sorted(r["e2e_ms"] for r in results if not r["speculative"])

    def p90(xs: list[float]) -> float | None:
        return xs[int(0.9 * (len(xs) - 1))] if xs else None

    return {"arm": name, "plain_requests": len(plain), "speculative_requests": len(spec_),
            "plain_ttft_ms_p50": statistics.median(ttft) if ttft else None, "plain_ttft_ms_p90": p90(ttft),
            "plain_e2e_ms_p50": statistics.median(e2e) if e2e else None, "plain_e2e_ms_p90": p90(e2e),
            "plain_tpot_ms_p50": statistics.median(plain) if plain else None, "plain_tpot_ms_p90": p90(plain),
            "speculative_tpot_ms_p50": statistics.median(spec_) if spec_ else None,
            "speculative_tpot_ms_p90": p90(spec_), "shed": shed, "outputs": results}


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--seconds", type=float, default=40.0)
    ap.add_argument("--max-batch", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--pass-ms", type=float, default=30.0)
    ap.add_argument("--draft-token-ms", type=float, default=40.0, help="the replica's simulated device: slow")
    ap.add_argument("--max-queue", type=int, default=1)
    ap.add_argument("--draft-nice", type=int, default=10,
                    help="the draft replicas' niceness in an arm named ...-nice (the target's stays 0)")
    ap.add_argument("--arms", default="no-draft,unbounded,shed,shed-nice")
    a = ap.parse_args()
    load = warn_if_busy()
    pair = find_pair(a.models)
    prompts = [p["prompt"] for p in load_eval_prompts(pair) if p["workload_class"] == "code"]
    rows = []
    for name in a.arms.split(","):
        r = arm(pair, name, prompts, a)
        rows.append(r)
        print(f"{name:10} plain TTFT p90 {r['plain_ttft_ms_p90']} ms, end to end p50 {r['plain_e2e_ms_p50']} "
              f"p90 {r['plain_e2e_ms_p90']} ms; plain TPOT p50 {r['plain_tpot_ms_p50']} "
              f"p90 {r['plain_tpot_ms_p90']} ms "
              f"({r['plain_requests']} requests); speculative p50 {r['speculative_tpot_ms_p50']} p90 "
              f"{r['speculative_tpot_ms_p90']} ms ({r['speculative_requests']}); shed {r['shed']}", flush=True)
    # greedy: every output is the target's alone, whatever arm and load it ran in
    by_prompt: dict[str, set] = {}
    for r in rows:
        for o in r["outputs"]:
            by_prompt.setdefault(o["prompt"], set()).add(tuple(o["tokens"]))
    same = all(len(v) == 1 for v in by_prompt.values())
    base = rows[0]["plain_tpot_ms_p90"]
    summary = {"load_before": load, "args": vars(a), "same_outputs": same,
               "rows": [{k: v for k, v in r.items() if k != "outputs"} for r in rows],
               "plain_p90_vs_no_draft": {r["arm"]: (r["plain_tpot_ms_p90"] / base if base and r["plain_tpot_ms_p90"]
                                                    else None) for r in rows},
               "plain_e2e_p50_vs_no_draft": {r["arm"]: (r["plain_e2e_ms_p50"] / rows[0]["plain_e2e_ms_p50"]
                                                        if rows[0]["plain_e2e_ms_p50"] and r["plain_e2e_ms_p50"]
                                                        else None) for r in rows}}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "overload.json").write_text(json.dumps(summary, indent=1))
    print(f"plain TPOT p90 against no-draft: {summary['plain_p90_vs_no_draft']}; plain end to end p50: "
          f"{summary['plain_e2e_p50_vs_no_draft']}; same outputs: {same}")


if __name__ == "__main__":
    main()
