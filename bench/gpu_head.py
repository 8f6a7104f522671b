"""gpu_check's arms for drafters inside the target's round (ADR 0025): the target's own EAGLE
head, and the draft model on the target's device (issue 51 item 3), their rounds drafted,
verified and judged in one run of the device step, synchronous (`-sync` modes) or chained on
the device (the workers' default where the graphs are), at each load, beside the same mode's
plain decoding; token trees of the head against its chains; and greedy identity on the demo
pair for rounds drafted on its shipped head (chains and trees) against transformers.

The 1B-class target and its drafters are random, so their drafts would never be accepted. As
the host-driven draft arm does, acceptance is synthetic: after the drafter has drafted (its K
positions are paid in full, inside the round's graph), the drafts are replaced on the device
by the target's own greedy continuation (from a plain run), each kept with probability alpha
(counter-based uniforms keyed by position, drawn on the device: the replacement runs inside
the graph too), a wrong token at the first miss. A tree's second first candidate is the
target's token where the first is wrong with probability beta. So a round's cost is the real
one and its acceptance is alpha's.
"""

from __future__ import annotations

import time

import torch

from specserve.algorithm.rng import Purpose, uniform_on_device
from specserve.drafters.eagle import EagleConfig, EagleHead
from specserve.models.verifier import TargetModel
from specserve.params import SamplingParams
from specserve.step import Step, StepRow, head_tree
from specserve.worker.model_step import BatchedTarget, Batching

GREEDY = SamplingParams()


def expected_tokens(alpha: float, k: int, beta: float = 0.0) -> float:
    """Tokens a round emits under the synthetic drafts: a chain's sum of alpha^i (i <= K), and
    a tree's second first candidate, right with probability beta where the first is wrong, adds
    beta (1 - alpha^K) (its own chain then kept as the first's)."""
    chain = sum(alpha ** i for i in range(k + 1))
    return chain + beta * (1 - alpha ** k)


def _reference(table: torch.Tensor, rslot: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    return table.index_select(0, rslot).gather(1, pos.clamp(max=table.shape[1] - 1))


def synthetic_acceptance(target: BatchedTarget, seed: int = 11) -> tuple[torch.Tensor, torch.Tensor]:
    """Wrap the drafter's chain so that its drafts become the reference continuation kept with
    probability alpha; returns the reference table [slots, max_len] to fill (the token at each
    absolute position of each slot) and alpha, a device scalar to set."""
    head = target.heads.device  # type: ignore[union-attr]
    ds = head.ds
    kv = target.runner.kv
    table = torch.zeros(kv.num_slots, kv.max_len, dtype=torch.long, device=ds.device)
    alpha = torch.zeros((), dtype=torch.float64, device=ds.device)
    seed_t = torch.tensor(seed, dtype=torch.long, device=ds.device)
    chain = head.chain

    def synthetic(b, k: int) -> None:
        chain(b, k)  # the drafter's own drafts: their cost is the round's
        r, w = b.rows, b.width
        if w < 2:
            return
        rslot, start, hdraft = ds.field("rslot", r), ds.field("start", r), ds.field("hdraft", r)
        pos = start.view(r, 1) + 1 + head.lanes[:w - 1].view(1, w - 1)
        ref = _reference(table, rslot, pos)
        keep = (uniform_on_device(seed_t, pos, Purpose.DRAFT) < alpha).long().cumprod(1).bool()
        drafts = torch.where(keep, ref, (ref + 1) % target.runner.vocab_size)
        ids = ds.field("ids", b.tokens).view(r, w)
        take = head.lanes[1:w].view(1, w - 1) <= hdraft.view(r, 1)
        ids[:, 1:].copy_(torch.where(take, drafts, ids[:, 1:]))

    head.chain = synthetic  # type: ignore[method-assign]
    return table, alpha


def synthetic_trees(target: BatchedTarget, table: torch.Tensor, alpha: torch.Tensor, beta: float,
                    seed: int = 13) -> None:
    """The head's trees of two first candidates (models/head_trees.py) made synthetic: the
    first branch is a chain's synthetic drafts, the second's first token the target's where
    the first's is wrong (probability beta), then its chain kept with probability alpha."""
    import specserve.models.head_trees as trees

    head = target.heads.device  # type: ignore[union-attr]
    ds, vocab = head.ds, target.runner.vocab_size
    seeds = [torch.tensor(seed + i, dtype=torch.long, device=ds.device) for i in range(3)]
    drafted = trees.tree_chain

    def synthetic(h, b, k: int, w: int) -> None:
        drafted(h, b, k, w)
        r, width = b.rows, b.width
        rslot, start = ds.field("rslot", r), ds.field("start", r)
        pos = start.view(r, 1) + 1 + head.lanes[:k].view(1, k)
        ref = _reference(table, rslot, pos)
        u0 = uniform_on_device(seeds[0], pos, Purpose.DRAFT)
        first = torch.where((u0 < alpha).long().cumprod(1).bool(), ref, (ref + 1) % vocab)
        # the second first candidate: right where the first is wrong, with probability beta; then
        # its own chain, each kept with probability alpha (depth 1 always, if it is right)
        right = (u0[:, :1] >= alpha) & (uniform_on_device(seeds[1], pos[:, :1], Purpose.DRAFT) < beta)
        kept = (uniform_on_device(seeds[2], pos, Purpose.DRAFT) < alpha) | (head.lanes[:k].view(1, k) == 0)
        second = torch.where(right & kept.long().cumprod(1).bool(), ref, (ref + 2) % vocab)
        nodes = torch.nn.functional.pad(torch.cat([first, second], 1), (0, max(width - 1 - 2 * k, 0)))[:, :width - 1]
        ids = ds.field("ids", b.tokens).view(r, width)
        take = head.lanes[1:width].view(1, width - 1) <= (ds.field("hdraft", r) * ds.field("hwidth", r)).view(r, 1)
        ids[:, 1:].copy_(torch.where(take, nodes, ids[:, 1:]))

    trees.tree_chain = synthetic  # type: ignore[assignment]


def drafting_target(target_model, b: Batching, drafter) -> BatchedTarget:
    """A second target step over the same model whose rounds draft on `drafter`: "head" (a
    random EAGLE head for it) or a draft model (an HF causal LM with its vocabulary)."""
    torch.manual_seed(3)
    t = BatchedTarget(TargetModel(target_model), b)
    t.enable_head(EagleHead(EagleConfig.for_target(target_model.config)).eval() if drafter == "head" else drafter)
    return t


def rounds(target: BatchedTarget, table: torch.Tensor, prompts: list[list[int]], reference: list[list[int]],
           decode: int, k: int, sync, width: int = 1) -> dict:
    """Every session decodes `decode` tokens in rounds drafted in the target's round (K each;
    a tree of `width` first candidates where > 1)."""
    handles = [target.open(f"h{i}") for i in range(len(prompts))]
    kv = target.runner.kv
    seqs = [list(p) for p in prompts]
    for h, p, ref in zip(handles, prompts, reference, strict=True):
        row = torch.tensor(ref[:kv.max_len - len(p)], dtype=torch.long)
        table[kv.slot(h), len(p):len(p) + row.shape[0]] = row.to(table.device)
    n_rounds = emitted = 0
    device_ms = 0.0
    try:
        pending = set(range(len(prompts)))  # the prompts, plain (the drafter fed them)
        while pending:
            order = sorted(pending)
            for i, res in zip(order, target.step(Step([_row(handles[i], seqs[i], 0) for i in order])).rows,
                              strict=True):
                if not res.again:
                    seqs[i].extend(res.verdict.tokens)
                    pending.discard(i)
        start = [len(s) for s in seqs]
        sync()
        t0 = time.perf_counter()
        while live := [i for i, s in enumerate(seqs) if len(s) - start[i] < decode]:
            out = target.step(Step([_row(handles[i], seqs[i], k, width) for i in live]))
            for i, res in zip(live, out.rows, strict=True):
                seqs[i].extend(res.verdict.tokens)
                emitted += len(res.verdict.tokens)
            n_rounds += 1
            device_ms += out.device_ms or 0.0
        sync()
        wall = time.perf_counter() - t0
    finally:
        for h in handles:
            target.close(h)
    return {"tok_s": emitted / wall, "tokens_per_round": emitted / max(1, n_rounds * len(prompts)),
            "rounds": n_rounds, "round_ms": 1e3 * wall / max(n_rounds, 1),
            "busy": device_ms / (1e3 * wall) if device_ms else None,
            "continuations": [s[len(p):] for s, p in zip(seqs, prompts, strict=True)]}  # (from the prompt's end)


def _row(handle, ids: list[int], k: int, width: int = 1) -> StepRow:
    row = StepRow.verify(handle, ids, [], None, GREEDY, 0)
    row.head, row.k = True, k
    if width > 1 and k:
        row.parents = head_tree(width, k)
    return row


def _same(continuations: list[list[int]], base: dict, decode: int) -> bool:
    """Whether the rounds' tokens are plain decoding's (the target's greedy tokens), as far as both go."""
    return all(c[:decode] == b[:decode] for c, b in zip(continuations, base["continuations"], strict=True))


def variant_ms(target: BatchedTarget, device: torch.device, kind: str, k: int, reps: int = 20) -> float | None:
    """The device's time for one replay of the last bucket's round graph (`kind`: "chained" or
    "round"; k its drafts, 0 a round that only feeds the drafter)."""
    ds = target.runner.device_step
    if ds is None or device.type != "cuda" or ds.last is None or ds.head is None:
        return None
    b, head = ds.last, ds.head
    if ((kind, k, 1), b) not in ds.step_graphs.variant_graphs:  # (captured now: its replay below is timed)
        ds.step_graphs.launch_variant((kind, k, 1), b, lambda: head.run_chained(b, k) if kind == "chained"
                                      else head.run_round(b, k))
    graph = ds.step_graphs.variant_graphs.get(((kind, k, 1), b))
    if graph is None:
        return None
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize(device)
    return float(start.elapsed_time(end)) / reps


def drafter_arm(target_model, b: Batching, streams: list[int], plain_runs: dict, alphas: list[float], k: int,
                decode: int, device: torch.device, sync, warm_prompts, drafter="head",
                beta: float | None = None) -> dict:
    """Rounds drafted on `drafter` (drafting_target) at each load and alpha, beside plain
    (`plain_runs[n]`: its tok/s and continuations, prompts), every shape warmed first; at one
    stream its rounds' graph time and the drafter's cost a position, and where `beta` is given
    the head's trees of two first candidates beside its chains."""
    target = drafting_target(target_model, b, drafter)
    table, alpha_t = synthetic_acceptance(target)
    if beta is not None:
        synthetic_trees(target, table, alpha_t, beta)
    for n in streams:  # warm-up, unmeasured: each bucket's round graphs captured
        prompts, ref = warm_prompts(n)
        alpha_t.fill_(1.0)
        rounds(target, table, prompts, ref, 8, k, sync)
        if beta is not None and n == 1:
            rounds(target, table, prompts, ref, 8, k, sync, width=2)
    out: dict = {"speed": [], "chained": target.rounds is not None, "drafter": "head" if drafter == "head" else "draft"}
    for n in streams:
        base = plain_runs[n]
        row: dict = {"streams": n, "plain_tok_s": base["tok_s"], "rounds": []}
        for a in alphas:
            alpha_t.fill_(a)
            r = rounds(target, table, base["prompts"], base["continuations"], decode, k, sync)
            r.update(alpha=a, speedup=r["tok_s"] / base["tok_s"], exact=_same(r.pop("continuations"), base, decode))
            if n == 1:
                r["round_graph_ms"] = variant_ms(target, device, "chained", k)
                fed = variant_ms(target, device, "round", 0)
                r["position_ms"] = (r["round_graph_ms"] - fed) / k if r["round_graph_ms"] and fed else None
                if beta is not None:
                    tree = rounds(target, table, base["prompts"], base["continuations"], decode, k, sync, width=2)
                    r["tree"] = {"tokens_per_round": tree["tokens_per_round"], "tok_s": tree["tok_s"], "beta": beta,
                                 "vs_chain": tree["tokens_per_round"] / r["tokens_per_round"],
                                 "bound": expected_tokens(a, k, beta) / expected_tokens(a, k),
                                 "exact": _same(tree["continuations"], base, decode)}
            row["rounds"].append(r)
        out["speed"].append(row)
        print(f"[gpu-check] {out['drafter']} in the round ({'chained' if out['chained'] else 'synchronous'}), "
              f"{n} streams: " + ", ".join(
                  f"alpha {r['alpha']}: {r['tok_s']:.1f} tok/s ({r['speedup']:.2f}x plain, {r['tokens_per_round']:.2f} "
                  f"a round, {r['round_ms']:.2f} ms a round, busy {r['busy']}, exact {r['exact']})"
                  for r in row["rounds"]), flush=True)
    if target.rounds is not None:
        out["rounds_taken"] = dict(target.rounds.counts)
        out["thrown_by"] = dict(target.rounds.thrown_by)
    ds = target.runner.device_step
    out["counts"] = {"replayed": ds.counts.replayed, "eager": ds.counts.eager,
                     "captured": ds.counts.captured} if ds is not None else {}
    return out


def rounds_identity(pair, model, device: torch.device, dtype_setting: str, prompts: list[list[int]],
                    new_tokens: int, k: int, tolerance: float) -> dict:
    """Greedy identity on the device for rounds drafted on the demo pair's own head inside the
    round (chains of K and trees of two first candidates, chained), against transformers'
    greedy generation of its target `model` on the same device and dtype: a token may differ
    only at a near-tie of HF's top two logits (within `tolerance`)."""
    from specserve.drafters.eagle import load_head

    refs = hf_greedy(model, device, prompts, new_tokens)  # (once for both shapes)
    out: dict = {}
    for width in (1, 2):
        t = BatchedTarget(TargetModel(model), Batching(device=str(device), dtype=dtype_setting, max_sessions=4,
                                                       max_len=512, fixed_step=True, max_batch=4, capture_budget_s=5.0,
                                                       capture_k=k, capture_tree_width=width))
        t.enable_head(load_head(pair / "eagle"))
        got = [_decode_rounds(t, ids, new_tokens, k, width) for ids in prompts]
        ds = t.runner.device_step
        out["trees" if width > 1 else "chains"] = {
            **agreement(got, refs, tolerance),
            "replayed": ds.counts.replayed if ds is not None else 0, "eager": ds.counts.eager if ds is not None else 0}
    out["ok"] = all(v["ok"] for v in out.values())
    return out


def hf_greedy(model, device: torch.device, prompts: list[list[int]], new_tokens: int) -> list[tuple[list[int], list]]:
    """transformers' greedy tokens of each prompt and the logits of each step."""
    refs = []
    for ids in prompts:
        with torch.inference_mode():
            gen = model.generate(torch.tensor([ids], device=device), max_new_tokens=new_tokens, do_sample=False,
                                 output_logits=True, return_dict_in_generate=True,
                                 attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=device))
        refs.append((gen.sequences[0, len(ids):].tolist(), [lg[0].float() for lg in gen.logits]))
    return refs


def agreement(got: list[list[int]], refs: list[tuple[list[int], list]], tolerance: float) -> dict:
    """Each prompt's tokens against transformers' (`hf_greedy`): up to the first difference,
    which is a near-tie where HF's top two logits there are within `tolerance`, else a failure."""
    compared, near, failures = 0, [], []
    for i, (tokens, (want, logits)) in enumerate(zip(got, refs, strict=True)):
        j = next((j for j, (a, b) in enumerate(zip(tokens, want, strict=False)) if a != b), None)
        compared += len(want) if j is None else j + 1
        if j is not None:
            top2 = logits[j].topk(2).values
            gap = float(top2[0] - top2[1])
            (near if gap <= tolerance else failures).append({"prompt": i, "token": j, "gap": gap})
    return {"tokens_compared": compared, "near_ties": near, "failures": failures, "ok": not failures}


def _decode_rounds(t: BatchedTarget, ids: list[int], n: int, k: int, width: int) -> list[int]:
    h, seq = t.open("identity"), list(ids)
    try:
        while len(seq) - len(ids) < n:
            res = t.step(Step([_row(h, seq, k, width)])).rows[0]
            if res.error is not None:
                raise res.error
            seq += [] if res.again else res.verdict.tokens
    finally:
        t.close(h)
    return seq[len(ids):len(ids) + n]
