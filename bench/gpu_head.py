"""gpu_check's arm for the target's own EAGLE head (ADR 0025): rounds drafted inside the
target's device step, synchronous (`-sync` modes) or chained on the device (the workers'
default where the graphs are), at each load, beside the same mode's plain decoding.

The head is random (the 1B-class target is random too), so its drafts would never be
accepted. As the draft arm does with the draft model, acceptance is synthetic: after the
head has drafted (its K positions are paid in full, inside the round's graph), the drafts are
replaced on the device by the target's own greedy continuation (from a plain run), each kept
with probability alpha (counter-based uniforms keyed by position, drawn on the device: the
replacement runs inside the graph too), a wrong token at the first miss. So the round's cost
is the real one and its acceptance is alpha's.
"""

from __future__ import annotations

import time

import torch

from specserve.algorithm.rng import Purpose, uniform_on_device
from specserve.drafters.eagle import EagleConfig, EagleHead
from specserve.models.verifier import TargetModel
from specserve.params import SamplingParams
from specserve.step import Step, StepRow
from specserve.worker.model_step import BatchedTarget, Batching

GREEDY = SamplingParams()


def synthetic_acceptance(target: BatchedTarget, seed: int = 11) -> tuple[torch.Tensor, torch.Tensor]:
    """Wrap the head's chain so that its drafts become the reference continuation kept with
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
        chain(b, k)  # the head's own drafts: their cost is the round's
        r, w = b.rows, b.width
        if w < 2:
            return
        rslot, start, hdraft = ds.field("rslot", r), ds.field("start", r), ds.field("hdraft", r)
        pos = (start.view(r, 1) + 1 + head.lanes[:w - 1].view(1, w - 1)).clamp(max=kv.max_len - 1)
        ref = table.index_select(0, rslot).gather(1, pos)
        keep = (uniform_on_device(seed_t, pos, Purpose.DRAFT) < alpha).long().cumprod(1).bool()
        drafts = torch.where(keep, ref, (ref + 1) % target.runner.vocab_size)
        ids = ds.field("ids", b.tokens).view(r, w)
        take = head.lanes[1:w].view(1, w - 1) <= hdraft.view(r, 1)
        ids[:, 1:].copy_(torch.where(take, drafts, ids[:, 1:]))

    head.chain = synthetic  # type: ignore[method-assign]
    return table, alpha


def headed_target(target_model, b: Batching) -> BatchedTarget:
    """A second target step over the same model with a random head for it."""
    torch.manual_seed(3)
    cfg = EagleConfig.for_target(target_model.config)
    head = EagleHead(cfg).eval()
    t = BatchedTarget(TargetModel(target_model), b)
    t.enable_head(head)
    return t


def rounds(target: BatchedTarget, table: torch.Tensor, prompts: list[list[int]], reference: list[list[int]],
           decode: int, k: int, sync) -> dict:
    """Every session decodes `decode` tokens in rounds drafted on the head (K each)."""
    handles = [target.open(f"h{i}") for i in range(len(prompts))]
    kv = target.runner.kv
    seqs = [list(p) for p in prompts]
    for h, p, ref in zip(handles, prompts, reference, strict=True):
        row = torch.tensor(ref[:kv.max_len - len(p)], dtype=torch.long)
        table[kv.slot(h), len(p):len(p) + row.shape[0]] = row.to(table.device)
    n_rounds = emitted = 0
    device_ms = 0.0
    try:
        pending = set(range(len(prompts)))  # the prompts, plain (the head fed their features)
        while pending:
            order = sorted(pending)
            rows = [_row(handles[i], seqs[i], 0) for i in order]
            for i, res in zip(order, target.step(Step(rows)).rows, strict=True):
                if not res.again:
                    seqs[i].extend(res.verdict.tokens)
                    pending.discard(i)
        start = [len(s) for s in seqs]
        sync()
        t0 = time.perf_counter()
        while live := [i for i, s in enumerate(seqs) if len(s) - start[i] < decode]:
            out = target.step(Step([_row(handles[i], seqs[i], k) for i in live]))
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
            "busy": device_ms / (1e3 * wall) if device_ms else None}


def _row(handle, ids: list[int], k: int) -> StepRow:
    row = StepRow.verify(handle, ids, [], None, GREEDY, 0)
    row.head, row.k = True, k
    return row


def round_graph_ms(target: BatchedTarget, device: torch.device, reps: int = 20) -> float | None:
    """The device's time for one chained round of the last bucket (its graph replayed)."""
    ds = target.runner.device_step
    if ds is None or device.type != "cuda" or ds.last is None:
        return None
    graph = next((g for (variant, b), g in ds.step_graphs.variant_graphs.items()
                  if b == ds.last and variant[0] == "chained"), None)
    if graph is None:
        return None
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize(device)
    return float(start.elapsed_time(end)) / reps


def head_arm(target_model, b: Batching, streams: list[int], plain_runs: dict, alphas: list[float], k: int,
             decode: int, device: torch.device, sync, warm_prompts) -> dict:
    """Rounds drafted on the target's own head at each load and alpha, beside plain
    (`plain_runs[n]`: its tok/s and continuations, prompts), with every shape warmed first."""
    target = headed_target(target_model, b)
    table, alpha_t = synthetic_acceptance(target)
    for n in streams:  # warm-up, unmeasured: each bucket's round graphs captured
        prompts, ref = warm_prompts(n)
        alpha_t.fill_(1.0)
        rounds(target, table, prompts, ref, 8, k, sync)
    out: dict = {"speed": [], "chained": target.rounds is not None}
    for n in streams:
        base = plain_runs[n]
        row: dict = {"streams": n, "plain_tok_s": base["tok_s"], "rounds": []}
        for a in alphas:
            alpha_t.fill_(a)
            r = rounds(target, table, base["prompts"], base["continuations"], decode, k, sync)
            r.update(alpha=a, speedup=r["tok_s"] / base["tok_s"])
            if n == 1:
                r["round_graph_ms"] = round_graph_ms(target, device)
            row["rounds"].append(r)
        out["speed"].append(row)
        print(f"[gpu-check] the target's own head ({'chained' if out['chained'] else 'synchronous'}), {n} streams: "
              + ", ".join(f"alpha {r['alpha']}: {r['tok_s']:.1f} tok/s ({r['speedup']:.2f}x plain, "
                          f"{r['tokens_per_round']:.2f} a round, {r['round_ms']:.2f} ms a round, busy {r['busy']})"
                          for r in row["rounds"]), flush=True)
    if target.rounds is not None:
        out["rounds_taken"] = dict(target.rounds.counts)
        out["thrown_by"] = dict(target.rounds.thrown_by)
    ds = target.runner.device_step
    out["counts"] = {"replayed": ds.counts.replayed, "eager": ds.counts.eager} if ds is not None else {}
    return out
