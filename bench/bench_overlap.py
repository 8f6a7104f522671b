"""Hiding the network (ADR 0010): the same stack with the overlap off and on, side by side.

One stack per setting, three router replicas on it, interleaved request by request:
  sequential  one unary call per worker per round, each round waits for its commit, no
              pre-drafting (the behaviour before ADR 0010)
  streams     per-round calls on one stream per (router, worker), still sequential
  overlap     streams + pipelined commits + pre-drafting (the default)
Two settings: the plain CPU stack (draft and target share 2 cores, so drafting ahead competes
with the target for CPU), and simulated device costs (the target pass and the draft token as
sleeps: separate devices, the deployment this system is for). The in-process engine, which
cannot overlap, runs the same prompts with the same simulated costs.

Per setting, router mode, class and pool: ms/token, speedup over plain through the same
router, stack speedup / in-process speedup, the critical-path overhead per round (round wall
time minus the worker compute on its critical path; a pushed pre-drafted block puts none
there), the pre-draft hit rate (pushed + cached) and what a miss costs. Plus bytes per round
on each hop (our 4,096-token vocabulary, and a simulated 152k vocabulary at K=8) and the
cost of a unary call vs a stream message.

  python bench/bench_overlap.py --models models --out bench/results
Writes <out>/overlap.json and <out>/overlap.png; prints markdown tables.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

CLASSES = ("code", "chat", "extraction")
MODES = {
    "sequential": {"SPECSERVE_ROUTER_WORKER_STREAMS": "false", "SPECSERVE_ROUTER_PIPELINE_COMMITS": "false",
                   "SPECSERVE_ROUTER_PREDRAFT_BRANCHES": "0"},
    "streams": {"SPECSERVE_ROUTER_PIPELINE_COMMITS": "false", "SPECSERVE_ROUTER_PREDRAFT_BRANCHES": "0"},
    "overlap": {},
}


def _pct(xs, q) -> float:
    return float(np.percentile(xs, q)) if xs else float("nan")


def stack_rows(pair: Path, prompts: dict, setting: str, pass_ms: float, token_ms: float, k: int, max_tokens: int,
               banned: list[int], repeats: int, branches: int, extra_ks: tuple[int, ...] = ()) -> list[dict]:
    import grpc

    from specserve.tooling.stack import PoolSpec, Stack, StackSpec
    from specserve.v1 import generation_pb2, generation_pb2_grpc

    draft_env = {"SPECSERVE_DRAFT_SIMULATED_TOKEN_MS": str(token_ms)} if token_ms else {}
    env = {"SPECSERVE_TARGET_SIMULATED_PASS_MS": str(pass_ms)} if pass_ms else {}
    rows = []
    with tempfile.TemporaryDirectory(prefix="specserve-overlap-") as run_dir:
        spec = StackSpec(pair_dir=str(pair), run_dir=run_dir, env=env, routers=len(MODES),
                         pools={"small": PoolSpec("draft", 1, env=draft_env), "ngram": PoolSpec("ngram", 1)},
                         router_env={"SPECSERVE_ROUTER_PREDRAFT_BRANCHES": str(branches)},
                         router_env_each=list(MODES.values()))
        with Stack(spec).running() as stack:
            channels = [grpc.insecure_channel(a) for a in stack.info.routers]
            stubs = dict(zip(MODES, (generation_pb2_grpc.GenerationStub(c) for c in channels), strict=True))

            def gen(mode: str, prompt: str, pool: str, n: int):
                req = generation_pb2.GenerateRequest(prompt=prompt, max_tokens=n, draft_pool=pool,
                                                     num_draft_tokens=k, banned_token_ids=banned)
                t0 = time.perf_counter()
                resp = stubs[mode].Generate(req, timeout=600)
                return (time.perf_counter() - t0) * 1e3, resp

            for mode in MODES:  # warm every path
                for pool in ("none", "small", "ngram"):
                    gen(mode, prompts["code"][0], pool, 8)
            for cls, ps in prompts.items():
                print(f"[bench] {setting} stack {cls}", file=sys.stderr, flush=True)
                acc: dict[tuple[str, str], dict] = {}
                for _ in range(repeats):
                    for p in ps:
                        for pool in ("none", "small", "ngram"):
                            for mode in MODES:  # interleaved: a slow spell hits every mode alike
                                ms, resp = gen(mode, p, pool, max_tokens)
                                a = acc.setdefault((mode, pool), {"ms": 0.0, "tokens": 0, "rounds": []})
                                a["ms"] += ms
                                a["tokens"] += len(resp.token_ids)
                                a["rounds"] += list(resp.stats.round)
                for (mode, pool), a in acc.items():
                    rounds = a["rounds"]
                    drafted = [r for r in rounds if r.k > 0]
                    hits = [r for r in drafted if r.predraft]
                    misses = [r for r in drafted if not r.predraft]
                    rows.append({
                        "setting": setting, "path": "stack", "mode": mode, "class": cls, "pool": pool,
                        "ms_per_token": a["ms"] / a["tokens"], "tokens": a["tokens"], "rounds": len(rounds),
                        "mean_accepted": statistics.mean(r.accepted for r in drafted) if drafted else None,
                        "overhead_ms_p50": _pct([r.overhead_ms for r in rounds], 50),
                        "overhead_ms_p99": _pct([r.overhead_ms for r in rounds], 99),
                        "round_ms_p50": _pct([r.draft_ms + r.verify_ms + r.overhead_ms for r in rounds], 50),
                        "hit_rate": len(hits) / len(drafted) if drafted else None,
                        "pushed_rate": sum(r.predraft == "pushed" for r in drafted) / len(drafted) if drafted else None,
                        "draft_wall_ms_hit_p50": _pct([r.draft_wall_ms for r in hits], 50),
                        "draft_wall_ms_miss_p50": _pct([r.draft_wall_ms for r in misses], 50),
                        "overhead_ms": [r.overhead_ms for r in rounds],
                    })
            for extra_k in extra_ks:  # the pre-draft hit rate at other K (overlap mode, model pool)
                for cls, ps in prompts.items():
                    drafted = []
                    for p in ps:
                        req = generation_pb2.GenerateRequest(prompt=p, max_tokens=max_tokens, draft_pool="small",
                                                             num_draft_tokens=extra_k, banned_token_ids=banned)
                        drafted += [r for r in stubs["overlap"].Generate(req, timeout=600).stats.round if r.k > 0]
                    rows.append({"setting": setting, "path": "stack-k", "mode": "overlap", "class": cls,
                                 "pool": "small", "k": extra_k, "rounds": len(drafted),
                                 "mean_accepted": statistics.mean(r.accepted for r in drafted) if drafted else None,
                                 "hit_rate": sum(bool(r.predraft) for r in drafted) / len(drafted) if drafted else None})
            for c in channels:
                c.close()
    return rows


class _Slow:
    """The in-process engine with the simulated device costs (sleeps), like the workers."""

    @staticmethod
    def target(model, pass_ms: float):
        from specserve.models.verifier import TargetModel, TargetSession

        class SlowSession(TargetSession):
            def verify(self, token_ids, draft_tokens):
                out = super().verify(token_ids, draft_tokens)
                time.sleep(pass_ms / 1e3)
                return out

        class SlowTarget(TargetModel):
            def start(self):
                return SlowSession(self)

        return SlowTarget(model)

    @staticmethod
    def drafter(drafter, token_ms: float):
        class SlowDraftSession:
            def __init__(self, inner):
                self.inner = inner

            def propose(self, token_ids, k, sampling, seed):
                out = self.inner.propose(token_ids, k, sampling, seed)
                time.sleep(token_ms * k / 1e3)
                return out

            def release(self):
                self.inner.release()

        class SlowDrafter:
            name, vocab_size = drafter.name, drafter.vocab_size

            def start(self):
                return SlowDraftSession(drafter.start())

        return SlowDrafter()


def in_process_rows(pair: Path, prompts: dict, setting: str, pass_ms: float, token_ms: float, k: int,
                    max_tokens: int, banned: list[int], repeats: int) -> list[dict]:
    import torch

    from specserve.algorithm.sampling import SamplingParams
    from specserve.drafters import HFDrafter, NgramDrafter
    from specserve.models.engine import GenerationParams, SpecEngine
    from specserve.models.loading import load_pair
    from specserve.models.verifier import TargetModel

    torch.set_num_threads(2)
    lp = load_pair(str(pair / "target"), str(pair / "draft"))
    tm = _Slow.target(lp.target, pass_ms) if pass_ms else TargetModel(lp.target)
    small = HFDrafter(lp.draft)
    engines = {"none": SpecEngine(tm, None, lp.tokenizer),
               "small": SpecEngine(tm, _Slow.drafter(small, token_ms) if token_ms else small, lp.tokenizer),
               "ngram": SpecEngine(tm, NgramDrafter(tm.vocab_size), lp.tokenizer)}
    rows = []
    for cls, ps in prompts.items():
        print(f"[bench] {setting} in-process {cls}", file=sys.stderr, flush=True)
        for pool, engine in engines.items():
            ms, toks = 0.0, 0
            for _ in range(repeats):
                for p in ps:
                    params = GenerationParams(max_tokens=max_tokens, num_draft_tokens=k if pool != "none" else 0,
                                              sampling=SamplingParams(banned_token_ids=tuple(banned)))
                    t0 = time.perf_counter()
                    res = engine.generate(p, params)
                    ms += (time.perf_counter() - t0) * 1e3
                    toks += len(res.token_ids)
            rows.append({"setting": setting, "path": "in-process", "mode": "in-process", "class": cls, "pool": pool,
                         "ms_per_token": ms / toks, "tokens": toks})
    return rows


def wire_bytes(pair: Path, k: int) -> dict:
    """Bytes per round on each hop for a typical round, measured on real messages, and the
    q of a 152k vocabulary at K=8 (dense vs the truncated sparse q) by construction."""
    import torch

    from specserve.algorithm.sampling import SamplingParams, logits_to_probs, truncate_mass
    from specserve.drafters.hf import Q_MASS, Q_MAX_ENTRIES, HFDrafter, _pack_q
    from specserve.models.loading import load_pair
    from specserve.serving.wire import prefix_to_proto, sampling_to_proto
    from specserve.state.prefix import CommittedPrefix
    from specserve.v1 import common_pb2, draft_pb2, generation_pb2, target_pb2
    from specserve.worker.qcodec import q_to_proto

    lp = load_pair(str(pair / "target"), str(pair / "draft"))
    ids = lp.tokenizer.encode("def parse(self, text):\n    for line in text.splitlines():\n")
    committed = CommittedPrefix(ids)
    out: dict = {"vocab": int(lp.draft.get_output_embeddings().weight.shape[0]), "k": k}
    for t in (0.0, 0.8):
        sp = SamplingParams(temperature=t)
        session = HFDrafter(lp.draft).start()
        prop = session.propose(ids, k, sp, 1)
        held = len(ids) - (k + 1)  # steady state: the worker holds all but the last round's tokens
        preq = draft_pb2.ProposeRequest(session_id="0" * 32, prefix=prefix_to_proto(committed, held), k=k,
                                        sampling=sampling_to_proto(sp), seed=1, predraft_branches=2)
        presp = draft_pb2.ProposeResponse(tokens=prop.tokens, q=q_to_proto(prop.q), draft_ms=1.0, drafter="small")
        vreq = target_pb2.VerifyRequest(session_id="0" * 32, prefix=prefix_to_proto(committed, held),
                                        draft_tokens=prop.tokens, q=presp.q, sampling=sampling_to_proto(sp), seed=1)
        vresp = target_pb2.VerifyResponse(tokens=prop.tokens[:2], num_accepted=1, rejected_position=1,
                                          p_draft=[0.5] * k, q_draft=[0.5] * k, verify_ms=10.0)
        chunk = generation_pb2.GenerateChunk(session_id="0" * 32, offset=40, token_ids=prop.tokens[:2], text="ab")
        out[f"T{t}"] = {"propose_request": preq.ByteSize(), "propose_response": presp.ByteSize(),
                        "verify_request": vreq.ByteSize(), "verify_response": vresp.ByteSize(),
                        "client_chunk": chunk.ByteSize()}
        if t > 0:
            dense = logits_to_probs(torch.randn(k, out["vocab"]), sp)
            out["T0.8"]["q_dense_bytes"] = common_pb2.DraftProbs(
                dense=common_pb2.DenseProbs(vocab_size=out["vocab"], probs=dense.numpy().tobytes())).ByteSize()
    # a 152k vocabulary at K=8: a draft whose q is as flat as a real model's tail
    vocab, k8 = 151_936, 8
    logits = torch.randn(k8, vocab) * 2.0
    logits[:, :50] += 8.0  # most of the mass on a few tokens
    q = logits_to_probs(logits, SamplingParams(temperature=0.8))
    trunc = truncate_mass(q, Q_MASS, Q_MAX_ENTRIES)
    out["vocab152k_k8"] = {
        "dense_q_bytes": int(q.numel() * 4),
        "sparse_q_bytes": q_to_proto(_pack_q(trunc)).ByteSize(),
        "mass_kept": float((q * (trunc > 0)).sum(-1).mean()),
        "q_mass": Q_MASS, "q_max_entries": Q_MAX_ENTRIES}
    return out


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = sorted({r["setting"] for r in rows})
    fig, axes = plt.subplots(1, len(settings), figsize=(6 * len(settings), 4), squeeze=False)
    for ax, setting in zip(axes[0], settings, strict=True):
        labels = [f"{c}\n{p}" for c in CLASSES for p in ("small", "ngram")]
        x = np.arange(len(labels))
        modes = [*MODES, "in-process"]
        for i, mode in enumerate(modes):
            ys = [next((r["speedup"] for r in rows if r["setting"] == setting and r["mode"] == mode
                        and r["class"] == c and r["pool"] == p), np.nan) for c in CLASSES for p in ("small", "ngram")]
            ax.bar(x + (i - 1.5) * 0.2, ys, 0.2, label=mode)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xticks(x, labels, fontsize=7)
        ax.set_title(setting)
        ax.set_ylabel("speedup vs plain (same path)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def run(pair: Path, out: Path, prompts_per_class: int, max_tokens: int, k: int, repeats: int, pass_ms: float,
        token_ms: float, branches: int, settings: list[str], extra_ks: tuple[int, ...] = (2, 5)) -> dict:
    from specserve.tooling.modelbuild.build import load_eval_prompts

    prompts = {c: [p["prompt"] for p in load_eval_prompts(pair) if p["workload_class"] == c][:prompts_per_class]
               for c in CLASSES}
    eos = json.loads((pair / "target" / "generation_config.json").read_text())["eos_token_id"]
    banned = [eos]  # every run emits exactly max_tokens
    rows: list[dict] = []
    costs = {"cpu": (0.0, 0.0), "simulated": (pass_ms, token_ms)}
    for setting in settings:
        p_ms, t_ms = costs[setting]
        rows += stack_rows(pair, prompts, setting, p_ms, t_ms, k, max_tokens, banned, repeats, branches, extra_ks)
        rows += in_process_rows(pair, prompts, setting, p_ms, t_ms, k, max_tokens, banned, repeats)
    ks_rows = [r for r in rows if r["path"] == "stack-k"]
    rows = [r for r in rows if r["path"] != "stack-k"]
    for r in rows:
        base = next(b for b in rows if b["setting"] == r["setting"] and b["mode"] == r["mode"]
                    and b["class"] == r["class"] and b["pool"] == "none")
        r["speedup"] = base["ms_per_token"] / r["ms_per_token"]
    for r in rows:
        if r["path"] == "stack":
            ip = next(b for b in rows if b["setting"] == r["setting"] and b["path"] == "in-process"
                      and b["class"] == r["class"] and b["pool"] == r["pool"])
            r["stack_over_in_process"] = r["speedup"] / ip["speedup"]
    summary = {}
    for setting in settings:
        for mode in MODES:
            over = [x for r in rows if r["setting"] == setting and r["mode"] == mode and r["pool"] != "none"
                    for x in r["overhead_ms"]]
            summary[f"{setting}/{mode}"] = {"overhead_ms_p50": _pct(over, 50), "overhead_ms_p99": _pct(over, 99),
                                            "rounds": len(over)}
    result = {"args": {"pair": str(pair), "prompts_per_class": prompts_per_class, "max_tokens": max_tokens, "k": k,
                       "repeats": repeats, "pass_ms": pass_ms, "token_ms": token_ms, "predraft_branches": branches},
              "summary": summary, "wire": wire_bytes(pair, k), "rows": rows,
              "hit_rate_by_k": [{**r, "k": k} for r in rows if r["mode"] == "overlap" and r["pool"] == "small"
                                and r["path"] == "stack"] + ks_rows}
    out.mkdir(parents=True, exist_ok=True)
    (out / "overlap.json").write_text(json.dumps(result, indent=1))
    _plot(rows, out / "overlap.png")
    _print(result)
    return result


def _f(x, spec=".2f") -> str:
    return "-" if x is None or (isinstance(x, float) and np.isnan(x)) else format(x, spec)


def _print(result: dict) -> None:
    print("| setting | mode | class | pool | ms/token | speedup vs plain | stack/in-process | critical-path overhead "
          "p50/p99 ms | pre-draft hits (pushed) | draft wall hit/miss p50 ms |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in result["rows"]:
        if r["pool"] == "none":
            continue
        hits = "-" if r.get("hit_rate") is None else f"{r['hit_rate']:.0%} ({r['pushed_rate']:.0%})"
        print(f"| {r['setting']} | {r['mode']} | {r['class']} | {r['pool']} | {r['ms_per_token']:.2f} | "
              f"{r['speedup']:.2f}x | {_f(r.get('stack_over_in_process'))} | "
              f"{_f(r.get('overhead_ms_p50'))} / {_f(r.get('overhead_ms_p99'))} | {hits} | "
              f"{_f(r.get('draft_wall_ms_hit_p50'))} / {_f(r.get('draft_wall_ms_miss_p50'))} |")
    print("\n| setting/mode | critical-path overhead p50 | p99 | rounds |\n|---|---|---|---|")
    for key, s in result["summary"].items():
        print(f"| {key} | {s['overhead_ms_p50']:.2f} ms | {s['overhead_ms_p99']:.2f} ms | {s['rounds']} |")
    print("\n| setting | class | K | pre-draft hit rate (overlap, pool small) | mean accepted |\n|---|---|---|---|---|")
    for r in sorted(result["hit_rate_by_k"], key=lambda r: (r["setting"], r["class"], r["k"])):
        print(f"| {r['setting']} | {r['class']} | {r['k']} | {_f(r['hit_rate'], '.0%')} | {_f(r['mean_accepted'])} |")
    print("\nbytes per round:", json.dumps(result["wire"], indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="models")
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--prompts-per-class", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--pass-ms", type=float, default=30.0, help="simulated target pass (ADR 0006)")
    ap.add_argument("--draft-token-ms", type=float, default=3.0, help="simulated draft cost per token")
    ap.add_argument("--predraft-branches", type=int, default=2)
    ap.add_argument("--settings", default="cpu,simulated")
    a = ap.parse_args()
    from specserve.tooling.modelbuild.build import find_pair

    pair = find_pair(a.models)
    run(pair, Path(a.out), a.prompts_per_class, a.max_tokens, a.k, a.repeats, a.pass_ms, a.draft_token_ms,
        a.predraft_branches, a.settings.split(","))


if __name__ == "__main__":
    main()
