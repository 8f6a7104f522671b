"""make gpu-check: what a GPU node checks that the CPU-only suite cannot (issue 21, ADR 0016).

1. Greedy identity on the device: the shipped demo target through the batched runner against
   transformers' own greedy generation on the same device and dtype, on the held-out
   prompts. A token may differ only where HF's top two logits are within the dtype's
   rounding tolerance (a near-tie); the check fails otherwise.
2. Speed with a realistic-size random-init pair, a 1B-class Llama target (TinyLlama's shape)
   and a 100M-class Llama draft, both in the run's dtype:
   - plain decoding through the target worker's batched step (BatchedTarget) at 1, 4 and 16
     sessions: TPOT and tok/s;
   - speculative decoding with a synthetic-acceptance drafter: it proposes the target's own
     greedy continuation with each token kept with probability alpha (a random other token
     otherwise), and pays the real draft model's K forwards per round through the draft
     worker's batched step (BatchedDraft); drafting and verifying run one after the other,
     as on one GPU (no overlap): tok/s and the speedup over plain at the same load;
   - transformers' generate, plain and assisted (assistant_model = the draft, K tokens), at
     one stream on the same device: the baseline a user would try first. A random draft is
     rarely accepted there; it measures the machinery, not acceptance.
Prints a table and writes <out>/gpu_check.json and <out>/gpu_check.png.

Without CUDA it stops with exit status 2 and says so. `--smoke --device cpu` runs every part
with tiny shapes (the suite does, so the script cannot rot where no GPU is).
"""

from __future__ import annotations

import json
import os
import platform
import random
import sys
import time
from pathlib import Path

if not sys.stdout.isatty():
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TQDM_DISABLE", "1")

import torch
from common import parser
from transformers import LlamaConfig, LlamaForCausalLM

from specserve.device import resolve_device, resolve_dtype
from specserve.drafters.hf import HFDrafter
from specserve.models.loading import load_model, load_tokenizer
from specserve.models.runner import ModelRunner
from specserve.models.verifier import TargetModel
from specserve.params import SamplingParams
from specserve.step import Step, StepRow
from specserve.tooling.hf_agreement import TOLERANCE, greedy_agreement
from specserve.tooling.modelbuild.build import load_eval_prompts
from specserve.worker.model_step import BatchedDraft, BatchedTarget, Batching

GREEDY = SamplingParams()
SHAPES = {
    # TinyLlama-1.1B's shape, and a 100M-class draft with its vocabulary
    "full": dict(target=dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                             num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=2048),
                 draft=dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=8,
                            num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=2048),
                 prompts=8, new_tokens=16, prompt_len=128, decode=64),
    "smoke": dict(target=dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256),
                  draft=dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256),
                  prompts=2, new_tokens=6, prompt_len=16, decode=8),
}


def parse_args(argv=None):
    p = parser(__doc__)
    p.add_argument("--device", default="cuda", help="cuda, cuda:N (cpu only with --smoke)")
    p.add_argument("--dtype", default="auto", help="auto (bf16 on CUDA), bf16, fp16, fp32")
    p.add_argument("--streams", default="1,4,16")
    p.add_argument("--alphas", default="0.6,0.8")
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--smoke", action="store_true", help="tiny shapes: checks the script, measures nothing")
    p.add_argument("--exact-batching", choices=("invariant", "fast"), default="invariant",
                   help="the workers' runner mode (config.py: exact_batching)")
    p.add_argument("--profile", action="store_true",
                   help="also write <out>/gpu_check_profile.txt: torch.profiler's table of plain steps at each load")
    # or compile (auto with the whole run torch.compile'd) or pieces (a layer's two pieces compiled)
    p.add_argument("--graphs", default="auto,off",
                   help="the arms to measure, side by side (ADR 0019): auto replays the device step's graphs "
                        "uncompiled, pieces with a layer's two pieces compiled, layer with a whole layer compiled "
                        "(its KV scatter and attention in: the workers' default on CUDA, cuda_compile auto), a "
                        "-sync suffix without the target's lookahead steps, a +fused suffix with each layer's "
                        "program ending with the next layer's norm (issue 51 item 7), "
                        "compile with the whole run compiled, off is the eager forward of "
                        "before; the first is the one judged and measured in full, the others plain decoding")
    p.add_argument("--off-decode", type=int, default=32, help="tokens a session in the off (eager) arm: it is slow")
    p.add_argument("--no-head", action="store_true",
                   help="skip the arms of rounds drafted inside the target's round (ADR 0025: bench/gpu_head.py)")
    p.add_argument("--beta", type=float, default=0.6,
                   help="the head's tree: its second first candidate right with this probability where the first is "
                        "wrong (synthetic, as alpha)")
    p.add_argument("--capture-budget-s", type=float, default=5.0,
                   help="each worker's start-up capture (logged); what it leaves is captured when first met")
    a = p.parse_args(argv)
    a.streams = [int(x) for x in a.streams.split(",")]
    a.alphas = [float(x) for x in a.alphas.split(",")]
    a.graphs = a.graphs.split(",")
    return a


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def identity(models: Path, device: torch.device, dtype: torch.dtype, n_prompts: int, new_tokens: int,
             graphs: list[str], k: int = 0, dtype_setting: str = "auto", round_prompts: int = 0) -> dict:
    """Part 1: the runner's greedy tokens against HF's on the same device and dtype; and, with
    `k`, rounds of K drafted on the pair's own EAGLE head inside the target's round."""
    pair = next((d for d in (models, models / "specserve-demo-v1") if (d / "target" / "config.json").exists()), None)
    if pair is None:
        raise SystemExit(f"no demo pair under {models}")
    model = load_model(str(pair / "target"), dtype=dtype).to(device)
    tok = load_tokenizer(str(pair / "target"))
    prompts = [tok.encode(p["prompt"]) for p in load_eval_prompts(pair)[:n_prompts]]
    out = {}
    for mode in graphs:  # the eager forward, and the device step replayed from graphs (ADR 0019)
        runner = ModelRunner.from_hf(model, max_sessions=3, max_len=1024, device=device, dtype=dtype, fuse_upto=0)
        base = mode.removesuffix("-sync").removesuffix("+fused")
        if base != "off":
            how = {"compile": "whole", "pieces": "pieces", "layer": "layer"}.get(base, False)
            runner.enable_device_step(max_rows=4, graphs=True, compile=how, fuse="+fused" in mode)
        out[mode] = greedy_agreement(model, runner, prompts, new_tokens, TOLERANCE[dtype])
        if runner.device_step is not None:
            out[mode]["steps"] = {"replayed": runner.device_step.counts.replayed,
                                  "eager": runner.device_step.counts.eager}
    first = out[graphs[0]]
    res = {**first, "ok": all(o["ok"] for o in out.values()), "by_mode": out}
    if k:  # rounds drafted on the pair's own head inside the target's round, chains and trees (ADR 0025)
        from gpu_head import rounds_identity

        res["rounds"] = rounds_identity(pair, model, device, dtype_setting, prompts[:round_prompts or None],
                                        new_tokens, k, TOLERANCE[dtype])
        from gpu_local_draft import local_draft_identity  # the local:draft pool as a target builds it

        res["local_draft"] = local_draft_identity(pair, model, device, dtype_setting, prompts[:round_prompts or None],
                                                  new_tokens, k, TOLERANCE[dtype])
        res["ok"] = res["ok"] and res["rounds"]["ok"] and res["local_draft"]["ok"]
    return res


def random_pair(shape: dict, device: torch.device, dtype: torch.dtype) -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(0)
    with torch.device(device):
        target = LlamaForCausalLM(LlamaConfig(**shape["target"], tie_word_embeddings=False)).eval()
        draft = LlamaForCausalLM(LlamaConfig(**shape["draft"], tie_word_embeddings=False)).eval()
    _decisive(target)
    return target.to(dtype), draft.to(dtype)


def _decisive(model: torch.nn.Module) -> None:
    """A random-init model's logits are near-uniform: its greedy token is decided by margins
    below bf16's rounding, so a 1-token row and a 5-token verify row of the same prefix pick
    different tokens and every synthetic draft (the plain continuation) is rejected — the
    first GPU run measured 1.05 tokens a round at alpha 0.8, K = 4. Here the token embedding
    dominates the residual stream and the output head reads it back through a fixed
    permutation: the next greedy token is perm(current) with a margin of about sqrt(hidden)
    standard deviations, and every layer still runs at full cost."""
    emb = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    perm = torch.randperm(emb.shape[0], generator=torch.Generator().manual_seed(7)).to(emb.device)
    with torch.no_grad():
        emb.mul_(50.0)
        head.copy_(emb[torch.argsort(perm)] / 50.0)


def params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def _prompts(n: int, length: int, vocab: int, seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(n)]


def _prefill(engine: BatchedTarget, handles: list, prompts: list[list[int]]) -> list[list[int]]:
    """Every session's prompt through the target's steps; returns prompt + first token."""
    seqs = [list(p) for p in prompts]
    pending = set(range(len(prompts)))
    while pending:
        order = sorted(pending)
        batch = [StepRow.verify(handles[i], seqs[i], [], None, GREEDY, i) for i in order]
        for i, res in zip(order, engine.step(Step(batch)).rows, strict=True):
            if res.again:
                continue
            if res.error is not None:
                raise res.error
            seqs[i].extend(res.verdict.tokens)
            pending.discard(i)
    return seqs


def plain(engine: BatchedTarget, prompts: list[list[int]], decode: int, device: torch.device) -> dict:
    """Plain decoding of `decode` tokens per session, all sessions in every step."""
    handles = [engine.open(f"p{i}") for i in range(len(prompts))]
    try:
        sync(device)
        t0 = time.perf_counter()
        seqs = _prefill(engine, handles, prompts)
        sync(device)
        prefill_ms = 1000 * (time.perf_counter() - t0)
        t0 = time.perf_counter()
        for _ in range(decode - 1):
            batch = [StepRow.verify(h, seqs[i], [], None, GREEDY, i) for i, h in enumerate(handles)]
            for i, res in enumerate(engine.step(Step(batch)).rows):
                seqs[i].extend(res.verdict.tokens)
        sync(device)
        wall = time.perf_counter() - t0
    finally:
        for h in handles:
            engine.close(h)
    steps = decode - 1
    return {"tpot_ms": 1000 * wall / steps, "tok_s": len(prompts) * steps / wall, "prefill_ms": prefill_ms,
            "continuations": [s[len(p):] for s, p in zip(seqs, prompts, strict=True)]}


def speculative(target: BatchedTarget, draft: BatchedDraft, prompts: list[list[int]], reference: list[list[int]],
                decode: int, k: int, alpha: float, device: torch.device) -> dict:
    """Rounds of (the draft's K batched forwards, then one verify step) with synthetic drafts:
    the reference greedy continuation, each token kept with probability alpha."""
    rng = random.Random(int(alpha * 1000) + k)
    vocab = target.runner.vocab_size
    th = [target.open(f"t{i}") for i in range(len(prompts))]
    dh = [draft.open(f"d{i}") for i in range(len(prompts))]
    rounds = emitted = 0
    try:
        seqs = _prefill(target, th, prompts)
        start = [len(s) for s in seqs]

        def drafting(live: list[int], upto: int = 0, kk: int = k) -> None:
            jobs = Step([StepRow.draft(dh[i], seqs[i][:len(seqs[i]) + upto], kk, GREEDY, i) for i in live])
            while any(r.again for r in draft.step(jobs).rows):  # (the prompt's chunks first)
                pass

        # the draft's prompt before the clock, as plain's prefill is (an earlier version timed
        # it inside the cell, ADR 0019, session 21): all but its last token, and one draft
        # position, which the first round drops; each round then feeds and drafts K in the cell
        drafting(list(range(len(prompts))), upto=-1, kk=1)
        sync(device)
        t0 = time.perf_counter()
        while any(len(s) - b < decode for s, b in zip(seqs, start, strict=True)):
            live = [i for i, s in enumerate(seqs) if len(s) - start[i] < decode]
            drafting(live)
            batch = []
            for i in live:
                done = len(seqs[i]) - len(prompts[i])
                drafts = []
                for t in reference[i][done:done + k]:
                    if rng.random() >= alpha:
                        drafts.append((t + 1 + rng.randrange(vocab - 1)) % vocab)  # another token: rejected
                        break
                    drafts.append(t)
                batch.append(StepRow.verify(th[i], seqs[i], drafts, None, GREEDY, i))
            for i, res in zip(live, target.step(Step(batch)).rows, strict=True):
                seqs[i].extend(res.verdict.tokens)
                emitted += len(res.verdict.tokens)
            rounds += 1
        sync(device)
        wall = time.perf_counter() - t0
    finally:
        for h in th:
            target.close(h)
        for h in dh:
            draft.close(h)
    return {"tok_s": emitted / wall, "tokens_per_round": emitted / max(1, rounds * len(prompts)),
            "rounds": rounds}


def profile(engine: BatchedTarget, loads: list[int], shape: dict, path: Path, device: torch.device) -> None:
    """torch.profiler over 8 plain steps at each load: where a step's host and device time go."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    path.parent.mkdir(parents=True, exist_ok=True)
    parts = []
    for n in loads:
        prompts = _prompts(n, shape["prompt_len"], shape["target"]["vocab_size"], seed=3)
        plain(engine, prompts, 4, device)  # this load's shapes warm
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with torch_profile(activities=activities) as prof:
            plain(engine, prompts, 9, device)
        key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
        parts.append(f"## {n} streams, 8 plain steps, by device time\n"
                     + prof.key_averages().table(sort_by=key, row_limit=25)
                     + f"\n## {n} streams, by host time\n"
                     + prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    path.write_text("\n".join(parts))


def copy_bandwidth(device: torch.device, mb: int = 1024) -> float:
    """Bytes per second of a large device-to-device copy (read + write counted): the
    memory-bound step's ceiling, measured in this run (METHOD: measure the ceilings once)."""
    if device.type != "cuda":
        return float("nan")
    x = torch.empty(mb << 20, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        y.copy_(x)
    end.record()
    torch.cuda.synchronize(device)
    return 2 * 10 * x.numel() / (start.elapsed_time(end) / 1e3)


def weight_bytes(model: torch.nn.Module) -> dict:
    """What a decode step must read: every weight but the input embedding (a step reads only
    its rows' entries of it)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    emb = model.get_input_embeddings().weight
    return {"total": total, "per_step": total - emb.numel() * emb.element_size()}


def step_counts(*engines) -> dict:
    """The device steps' replayed / eager / unbucketed counts summed over engines (ADR 0019)."""
    out = {"replayed": 0, "eager": 0, "unbucketed": 0, "captured": 0, "capture_s": 0.0}
    for e in engines:
        ds = e.runner.device_step
        if ds is not None:
            for k in out:
                out[k] += getattr(ds.counts, k)
    return out


def diff_counts(after: dict, before: dict) -> dict:
    return {k: after[k] - before[k] for k in after}


def phase_times(target: BatchedTarget, draft: BatchedDraft, prompt: list[int], reference: list[int], k: int,
                device: torch.device, rounds: int = 12) -> dict:
    """At one stream, each phase alone (synchronised around it): a plain step, a verify step
    of K drafts, and a draft step of K positions; all drafts accepted, so every round has
    the same shapes. The inputs of the speculative bound."""
    th, dh = target.open("phase-t"), draft.open("phase-d")
    out: dict[str, list[float]] = {"plain_ms": [], "verify_ms": [], "draft_ms": []}
    graphs: dict = {}
    try:
        seq = _prefill(target, [th], [prompt])[0]
        start = len(seq)

        def timed(model, step: Step):
            sync(device)
            t0 = time.perf_counter()
            r = model.step(step).rows
            sync(device)
            return r, 1e3 * (time.perf_counter() - t0)

        for _ in range(rounds):  # plain steps
            res, ms = timed(target, Step([StepRow.verify(th, seq, [], None, GREEDY, 0)]))
            seq.extend(res[0].verdict.tokens)
            out["plain_ms"].append(ms)
        graphs.update(replay_profile(target, "plain", device))
        while len(seq) - start < rounds * (k + 2):  # rounds with every draft accepted
            done = len(seq) - len(prompt)
            job = Step([StepRow.draft(dh, seq, k, GREEDY, 0)])
            while True:
                res, ms = timed(draft, job)
                if not res[0].again:
                    break
            out["draft_ms"].append(ms)
            if not graphs.get("draft_graph_ms"):
                graphs.update(replay_profile(draft, "draft", device))
            drafts = reference[done:done + k]
            if len(drafts) < k:
                break
            res, ms = timed(target, Step([StepRow.verify(th, seq, drafts, None, GREEDY, 0)]))
            seq.extend(res[0].verdict.tokens)
            out["verify_ms"].append(ms)
            if not graphs.get("verify_graph_ms"):
                graphs.update(replay_profile(target, "verify", device))
    finally:
        target.close(th)
        draft.close(dh)
    import statistics

    # the first draft step feeds the prompt (a prefill); the median of the rest
    res = {key: statistics.median(v[1:] if key == "draft_ms" and len(v) > 2 else v) for key, v in out.items()}
    res.update(graphs)
    return res


def replay_profile(engine, name: str, device: torch.device, reps: int = 20) -> dict:
    """The device's own time for the last step's graph (its replays timed with CUDA events: a
    replay computes the same step again, same KV values) and the kernels one replay runs."""
    ds = engine.runner.device_step
    if ds is None or device.type != "cuda" or ds.last not in ds.graphs:
        return {}
    graph = ds.graphs[ds.last]
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize(device)
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize(device)
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    by_name: dict[str, list[float]] = {}
    for e in events:  # where one replay's device time goes, by kernel (names cut short)
        by_name.setdefault(e.name[:60], []).append(e.device_time_total if hasattr(e, "device_time_total")
                                                   else e.cuda_time_total)
    top = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:12]
    return {f"{name}_graph_ms": start.elapsed_time(end) / reps, f"{name}_kernels": len(events),
            f"{name}_bucket": str(ds.last),
            f"{name}_top_kernels": [(k, len(v), round(sum(v), 1)) for k, v in top]}


def speculative_bound(alpha: float, k: int, phases: dict) -> float:
    """The most speculation can gain over plain at one stream with these step times: the
    expected tokens a round, (1 - a^(K+1)) / (1 - a) for the synthetic drafter, over the
    round's cost in plain steps, verify / plain + (K draft positions) / plain."""
    tokens = (1 - alpha ** (k + 1)) / (1 - alpha) if alpha < 1 else k + 1
    return tokens / (phases["verify_ms"] / phases["plain_ms"] + phases["draft_ms"] / phases["plain_ms"])


def hf_generate(target, draft, prompt: list[int], decode: int, k: int, device: torch.device) -> dict:
    """transformers' generate at one stream, plain and assisted."""
    ids = torch.tensor([prompt], device=device)
    mask = torch.ones_like(ids)
    out = {}
    for name, extra in (("plain", {}), ("assisted", {"assistant_model": draft})):
        if extra:
            draft.generation_config.num_assistant_tokens = k
            draft.generation_config.num_assistant_tokens_schedule = "constant"
        with torch.inference_mode():
            target.generate(ids, attention_mask=mask, max_new_tokens=4, min_new_tokens=4, do_sample=False, **extra)
            sync(device)
            t0 = time.perf_counter()
            gen = target.generate(ids, attention_mask=mask, max_new_tokens=decode, min_new_tokens=decode,
                                  do_sample=False, **extra)
            sync(device)
        out[f"{name}_tok_s"] = (gen.shape[1] - ids.shape[1]) / (time.perf_counter() - t0)
    return out


def batching(args, shape: dict, device: torch.device, mode: str, most: int) -> Batching:
    """The workers' settings of one arm: `mode` is a cuda_graphs setting (auto, pieces, layer,
    compile, off), "-sync" without the target's lookahead steps, "+fused" with each layer's
    program ending with the next one's norm (issue 51 item 7: models/step_fusion.py)."""
    base = mode.removesuffix("-sync").removesuffix("+fused")
    return Batching(device=str(device), dtype=args.dtype, max_sessions=most + 2,
                    max_len=min(1024, shape["target"]["max_position_embeddings"]), prefill_chunk=256,
                    kv_budget_mb=4096, fuse_upto=0, max_batch=max(most, 4),
                    cuda_graphs="off" if base == "off" else "auto",
                    fixed_step=True if (args.smoke and base != "off") else None,
                    compile_step={"compile": "whole", "pieces": "pieces", "layer": "layer"}.get(base, False),
                    tile=Batching.tile if args.exact_batching == "invariant" else None,
                    lookahead=False if "-sync" in mode else None, fuse_step="+fused" in mode,
                    # start-up capture of the rounds these arms run (K = args.k); the rest when first met
                    capture_k=args.k, capture_budget_s=args.capture_budget_s)


def measure(args, shape: dict, device: torch.device, dtype: torch.dtype, target_model, draft_model, mode: str,
            most: int) -> dict:
    """One arm: the workers built with it, every shape warmed up (graphs captured) unmeasured,
    then plain decoding at each load. The first arm (`--graphs`' first) also measures: the
    host-driven draft model's rounds, the rounds drafted inside the target's step (its own
    EAGLE head with its trees, the draft model), the phases at one stream and how the decode
    and verify steps ran (replayed / eager); the others plain decoding only, side by side."""
    full = mode == args.graphs[0]
    b = batching(args, shape, device, mode, most)
    target = BatchedTarget(TargetModel(target_model), b)
    draft = BatchedDraft(HFDrafter(draft_model), b) if full else None
    decode = shape["decode"] if full or mode.removesuffix("-sync") != "off" else min(shape["decode"], args.off_decode)
    t0 = time.perf_counter()
    for n in args.streams:  # warm-up, unmeasured: kernels loaded, GEMMs chosen, each bucket's graph captured
        warm = _prompts(n, shape["prompt_len"], shape["target"]["vocab_size"], seed=2)
        ref = plain(target, warm, 8, device)["continuations"]
        for alpha in (1.0, 0.5) if draft is not None else ():
            speculative(target, draft, warm, ref, 8, args.k, alpha, device)
    out: dict = {"mode": mode, "decode": decode, "warm_up_s": time.perf_counter() - t0, "speed": []}
    before = step_counts(target, *([draft] if draft else []))
    plain_runs = {}
    for n in args.streams:
        prompts = _prompts(n, shape["prompt_len"], shape["target"]["vocab_size"])
        base = plain(target, prompts, decode, device)
        plain_runs[n] = {**base, "prompts": prompts}
        row = {"streams": n, "plain": {k: v for k, v in base.items() if k != "continuations"}, "speculative": []}
        for a in args.alphas if draft is not None else ():
            sp = speculative(target, draft, prompts, base["continuations"], decode, args.k, a, device)
            sp.update(alpha=a, speedup=sp["tok_s"] / base["tok_s"])
            row["speculative"].append(sp)
        out["speed"].append(row)
        print(f"[gpu-check] {mode}, {n} streams: plain {base['tok_s']:.1f} tok/s (TPOT {base['tpot_ms']:.2f} ms; "
              f"prefill of {n} x {shape['prompt_len']} tokens {base['prefill_ms']:.1f} ms)" + "".join(
                  f"; draft model, host-driven, alpha {x['alpha']}: {x['tok_s']:.1f} ({x['speedup']:.2f}x)"
                  for x in row["speculative"]), flush=True)
    out["lookahead"] = {"on": target.lookahead, **target.ahead_counts}
    if draft is None:
        out["counts"] = diff_counts(step_counts(target), before)
        return out
    if not args.no_head and mode.removesuffix("-sync") != "off":
        out.update(round_arms(args, shape, b, device, target, target_model, draft_model, plain_runs, decode))
    out["counts"] = diff_counts(step_counts(target, draft), before)
    out["counts_total"] = step_counts(target, draft)
    prompt = _prompts(1, shape["prompt_len"], shape["target"]["vocab_size"], seed=5)
    ref = plain(target, prompt, 16 * (args.k + 2), device)["continuations"][0]
    out["phases"] = phase_times(target, draft, prompt[0], ref, args.k, device)
    out["spec_bound"] = speculative_bound(0.8, args.k, out["phases"])
    out["engines"] = (target, draft)
    return out


def round_arms(args, shape: dict, b: Batching, device: torch.device, target: BatchedTarget, target_model,
               draft_model, plain_runs: dict, decode: int) -> dict:
    """The rounds drafted inside the target's step (ADR 0025, bench/gpu_head.py): on its own
    EAGLE head at each load (trees of two first candidates beside its chains at one stream),
    and on the draft model at one stream."""
    from gpu_head import drafter_arm

    def warm(n: int):
        warm_prompts = _prompts(n, shape["prompt_len"], shape["target"]["vocab_size"], seed=2)
        return warm_prompts, plain(target, warm_prompts, 16, device)["continuations"]

    head = drafter_arm(target_model, b, args.streams, plain_runs, args.alphas, args.k, decode, device,
                       lambda: sync(device), warm, "head", beta=args.beta)
    ones = [n for n in args.streams if n == 1] or args.streams[:1]
    draft = drafter_arm(target_model, b, ones, plain_runs, args.alphas, args.k, decode, device,
                        lambda: sync(device), warm, draft_model)
    return {"head": head, "draft_in_round": draft}


def fmt(d: dict) -> str:
    return ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in d.items())


def _goal(value: float | None, goal: str) -> tuple[float | None, str, bool]:
    """(value, goal, met) of a figure against a goal written ">= x" or "<= x"."""
    if value is None:
        return None, goal, False
    op, x = goal.split()
    return round(value, 3), goal, value >= float(x) if op == ">=" else value <= float(x)


def targets(res: dict, args) -> dict:
    """Issue 51's figures of the first arm, each beside its goal: (value, goal, met). The engine
    loop's (eagle-local, remote blocks, the controller) are bench_engine_loop's summary."""
    m = res["modes"][args.graphs[0]]
    speed = {r["streams"]: r for r in m["speed"]}
    alpha = 0.8 if 0.8 in args.alphas else args.alphas[-1]
    j = args.alphas.index(alpha)
    out: dict = {}
    if 1 in speed:
        tpot = speed[1]["plain"]["tpot_ms"]
        out["plain TPOT at 1 stream, ms"] = _goal(tpot, "<= 1.0")
        out["plain: share of the bandwidth bound at 1 stream"] = _goal(res["bound"]["plain_step_ms"] / tpot, ">= 0.5")
    head = {r["streams"]: r["rounds"][j] for r in m.get("head", {}).get("speed", [])}
    for n, goal in ((1, ">= 2.0"), (16, ">= 1.5")):  # the EAGLE head drafting inside the target's round
        if n in head:
            out[f"EAGLE head in the round / plain at {n} stream(s), alpha {alpha}, K {args.k}"] = \
                _goal(head[n]["speedup"], goal)
    h1 = head.get(1)
    if h1 is not None and h1.get("round_graph_ms") and m.get("phases", {}).get("plain_graph_ms"):
        from gpu_head import expected_tokens

        # the most these rounds can give: tokens a round over the round's graph in plain graphs
        bound = expected_tokens(alpha, args.k) * m["phases"]["plain_graph_ms"] / h1["round_graph_ms"]
        out[f"EAGLE head at 1 stream / its bound from the run's phases ({bound:.2f}x)"] = \
            _goal(h1["speedup"] / bound, ">= 0.85")
    if h1 is not None:
        out["EAGLE head's cost a position, ms"] = _goal(h1.get("position_ms"), "<= 0.1")
        tree = h1.get("tree")
        if tree:
            out[f"tree (2 first candidates, beta {tree['beta']}) / chain, tokens a pass at 1 stream "
                f"(its bound {tree['bound']:.2f})"] = _goal(tree["vs_chain"], ">= 1.2")
    dr = {r["streams"]: r["rounds"][j] for r in m.get("draft_in_round", {}).get("speed", [])}
    if 1 in dr:
        out[f"draft model in the round / plain at 1 stream, alpha {alpha}, K {args.k}"] = _goal(dr[1]["speedup"],
                                                                                               ">= 1.5")
    for n in (1, 16):
        if n in speed and speed[n]["speculative"]:
            out[f"draft model host-driven / plain at {n} stream(s) (before)"] = \
                (round(speed[n]["speculative"][j]["speedup"], 2), "(issue 39's arm)", True)
    rounds = m.get("head", {}).get("counts", {})
    done = rounds.get("replayed", 0) + rounds.get("eager", 0)
    out["speculative rounds replayed from graphs (the head's target)"] = _goal(
        rounds["replayed"] / done if done else None, ">= 0.95")
    ident = res["identity"].get("rounds")
    if ident is not None:
        out["greedy identity, eagle-local rounds (chains, trees) on the demo pair"] = \
            (sum(len(v["failures"]) for v in ident.values() if isinstance(v, dict)), "0 failures", ident["ok"])
    pool = res["identity"].get("local_draft")
    if pool is not None:  # the product pool: settings -> the target's build -> the engine loop
        out["greedy identity, the local:draft pool in the round on the demo pair"] = \
            (f"{len(pool['failures'])} failures, {len(pool['near_ties'])} near-ties, {pool['source']}, "
             f"rounds {pool['rounds']}", "0 failures", pool["ok"] and pool["source"] == "DeviceDraftModelDrafts")
    for mode, other in res["modes"].items():  # the other arms side by side (the fusions: issue 51 item 7)
        if mode != args.graphs[0]:
            for row, first in zip(other["speed"], m["speed"], strict=True):
                out[f"{mode} / {args.graphs[0]} plain tok/s at {row['streams']} stream(s)"] = \
                    (round(row["plain"]["tok_s"] / first["plain"]["tok_s"], 3), "(side by side)", True)
    return out


def table(res: dict, alphas: list[float]) -> str:
    lines = ["| streams | plain tok/s | plain TPOT ms | " + " | ".join(
        f"spec a={a} tok/s (x plain)" for a in alphas) + " |",
        "|---|---|---|" + "---|" * len(alphas)]
    for row in res["speed"]:
        cells = [f"{s['tok_s']:.1f} ({s['speedup']:.2f}x)" for s in row["speculative"]]
        lines.append(f"| {row['streams']} | {row['plain']['tok_s']:.1f} | {row['plain']['tpot_ms']:.2f} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for mode, m in res["modes"].items():
        style = "-" if mode == "auto" else "--"
        streams = [r["streams"] for r in m["speed"]]
        ax.plot(streams, [r["plain"]["tok_s"] for r in m["speed"]], style, marker="o", label=f"plain (graphs {mode})")
        for j, a in enumerate(res["alphas"] if all(r["speculative"] for r in m["speed"]) else ()):
            ax.plot(streams, [r["speculative"][j]["tok_s"] for r in m["speed"]], style, marker="o",
                    label=f"K={res['k']}, alpha={a} (graphs {mode})")
        for arm in ("head", "draft_in_round"):  # rounds drafted inside the target's round (ADR 0025)
            rows = m.get(arm, {}).get("speed", [])
            if rows:
                ax.plot([r["streams"] for r in rows], [r["rounds"][0]["tok_s"] for r in rows], ":", marker="s",
                        label=f"{arm}, alpha={rows[0]['rounds'][0]['alpha']} (graphs {mode})")
    ax.set(xscale="log", xlabel="concurrent sessions", ylabel="tokens/s",
           title=f"gpu-check on {res['device_name']} ({res['dtype']})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def _save(res: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    modes = {m: {k: v for k, v in r.items() if k != "engines"} for m, r in res.get("modes", {}).items()}
    done = {**res, "modes": modes}
    (out / "gpu_check.json").write_text(json.dumps(done, indent=2, default=str))


def main(argv=None) -> int:
    args = parse_args(argv)
    device = resolve_device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(f"gpu-check needs a CUDA device, and torch {torch.__version__} sees none (built with CUDA: "
              f"{torch.version.cuda or 'no'}). Run it on a GPU node; `--smoke --device cpu` checks the script "
              "itself.", file=sys.stderr)
        return 2
    if device.type != "cuda" and not args.smoke:
        print("gpu-check measures a GPU: give --device cuda (or --smoke to check the script on the CPU)",
              file=sys.stderr)
        return 2
    dtype = resolve_dtype(args.dtype, device)
    shape = SHAPES["smoke" if args.smoke else "full"]
    res: dict = {"device": str(device), "dtype": str(dtype).removeprefix("torch."), "torch": torch.__version__,
                 "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
                 or "cpu", "smoke": args.smoke, "k": args.k, "alphas": args.alphas,
                 "exact_batching": args.exact_batching}
    print(f"[gpu-check] {res['device_name']}, {res['dtype']}: greedy identity against transformers", flush=True)
    # (the smoke mode checks the script: the first arm's identity, and rounds on one prompt)
    res["identity"] = identity(Path(args.models), device, dtype, shape["prompts"], shape["new_tokens"],
                               args.graphs[:1] if args.smoke else args.graphs, 0 if args.no_head else args.k,
                               args.dtype, shape["prompts"] // 2 if args.smoke else shape["prompts"])
    print(f"[gpu-check] identity: {res['identity']['tokens_compared']} tokens, largest logit difference "
          f"{res['identity']['largest_logit_difference']:.3f}, near-ties {len(res['identity']['near_ties'])}, "
          f"failures {len(res['identity']['failures'])}; by mode: " + "; ".join(
              f"{m}: {len(o['failures'])} failures of {o['tokens_compared']}, {o.get('steps', '')}"
              for m, o in res["identity"]["by_mode"].items()) + "".join(
              f"; rounds on the head ({name}): {o['tokens_compared']} tokens, near-ties {len(o['near_ties'])}, "
              f"failures {len(o['failures'])}" for name, o in res["identity"].get("rounds", {}).items()
              if isinstance(o, dict)), flush=True)

    target_model, draft_model = random_pair(shape, device, dtype)
    res["pair"] = {"target_params": params(target_model), "draft_params": params(draft_model),
                   "target_bytes": weight_bytes(target_model), "draft_bytes": weight_bytes(draft_model)}
    res["copy_bandwidth_gb_s"] = copy_bandwidth(device) / 1e9
    bound_ms = res["pair"]["target_bytes"]["per_step"] / (res["copy_bandwidth_gb_s"] * 1e9) * 1e3
    res["bound"] = {"plain_step_ms": bound_ms, "draft_token_ms": res["pair"]["draft_bytes"]["per_step"]
                    / (res["copy_bandwidth_gb_s"] * 1e9) * 1e3}
    print(f"[gpu-check] copy bandwidth {res['copy_bandwidth_gb_s']:.0f} GB/s; the target reads "
          f"{res['pair']['target_bytes']['per_step'] / 1e9:.2f} GB a step: bound {bound_ms:.3f} ms", flush=True)
    most = max(args.streams)
    res["modes"] = {}
    for mode in args.graphs:
        res["modes"][mode] = measure(args, shape, device, dtype, target_model, draft_model, mode, most)
        _save(res, Path(args.out))  # (after each arm: a run cut short by its time limit keeps what it measured)
    first = res["modes"][args.graphs[0]]
    res["speed"] = first["speed"]
    if args.profile:
        profile(first["engines"][0], args.streams, shape, Path(args.out) / "gpu_check_profile.txt", device)
    for m in res["modes"].values():
        m.pop("engines", None)
    res["hf"] = hf_generate(target_model, draft_model,
                            _prompts(1, shape["prompt_len"], shape["target"]["vocab_size"])[0],
                            shape["decode"], args.k, device)
    res["hf"]["specserve_plain_1_stream_tok_s"] = res["speed"][0]["plain"]["tok_s"] if args.streams[0] == 1 else None
    res["targets"] = targets(res, args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(res, indent=2, default=str))
    plot(res, out / "gpu_check.png")
    for mode, m in res["modes"].items():
        print(f"## cuda_graphs: {mode}\n" + table(m, args.alphas))
        if "phases" not in m:  # (an arm measured plain decoding only)
            print(f"steps: {m['counts']}; lookahead steps: {m['lookahead']}")
            continue
        tops = {k: m["phases"].pop(k) for k in [k for k in m["phases"] if k.endswith("_top_kernels")]}
        for k, top in tops.items():  # kernel, launches in one replay, device microseconds in all
            print(f"{k} (name, launches, us): " + "; ".join(f"{n} x{c} {us}" for n, c, us in top))
        m["phases"].update(tops)
        print(f"phases at 1 stream (ms): {fmt({k: v for k, v in m['phases'].items() if k not in tops})}; "
              f"speculative bound at alpha 0.8: "
              f"{m.get('spec_bound', float('nan')):.2f}x; steps: {m['counts']}; lookahead steps: {m['lookahead']}")
    print(f"transformers at 1 stream: plain {res['hf']['plain_tok_s']:.1f} tok/s, assisted (K={args.k}) "
          f"{res['hf']['assisted_tok_s']:.1f} tok/s")
    print("targets (issue 51):")
    for name, (value, goal, ok) in res["targets"].items():
        print(f"  {'met   ' if ok else 'MISSED'} {name}: {value} (goal {goal})")
    print(f"wrote {out / 'gpu_check.json'} and {out / 'gpu_check.png'}")
    return 0 if res["identity"]["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
