"""The device step under tensor parallelism on the CPU (ADR 0030, ADR 0025): its fixed shapes
forced on (as on a GPU without the graphs), the lookahead on, TP 2 in two processes (gloo),
the target's own EAGLE head drafting inside every rank's round. A module of its own: its group
is not test_tensor_parallel.py's (one process group a process at a time)."""

from __future__ import annotations

import multiprocessing as mp

import torch
from test_tensor_parallel import SHIPPED, _free_port, _gap, _head_parts


def _device_batching(lookahead: bool):
    from specserve.worker.model_step import Batching

    return Batching(kv_budget_mb=64, max_sessions=6, max_len=256, prefill_chunk=16, device="cpu", dtype="fp32",
                    fixed_step=True, max_batch=6, lookahead=lookahead)


def test_tp2_drafts_on_the_targets_head_inside_the_device_step_chained(demo_pair, eval_prompts):
    """The device step forced on the CPU (its fixed shapes, as on a GPU without the graphs)
    with the lookahead on, TP 2 in two processes: the target's own EAGLE head enabled on
    every rank (its first draft's logits gathered from both LM-head slices), rounds of head
    chains and of trees of two first candidates chained on the device on both ranks. The
    tokens and each round's drafts and verdicts are the one-device target's (the same step,
    TP 1; a difference only at a near-tie), rounds were taken from the chain on rank 0, and
    the ranks' verdicts agree."""
    from test_chained_rounds import PROMPTS, _rounds

    from specserve.models.sharding import stop_group
    from specserve.models.verifier import TargetModel
    from specserve.tooling.hf_agreement import TOLERANCE
    from specserve.worker.model_step import BatchedTarget
    from specserve.worker.tp_step import RankSpec, leader, run_follower

    head, _ = _head_parts()
    prompts = [demo_pair.tokenizer.encode(p) for p in PROMPTS]
    spec = RankSpec(str(SHIPPED / "target"), _device_batching(True), 2, f"tcp://127.0.0.1:{_free_port()}",
                    check_s=-1)
    proc = mp.get_context("spawn").Process(target=run_follower, args=(spec, 1), daemon=True)
    proc.start()
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        lead = leader(spec)
        lead.enable_head(head)
        got = {w: _rounds(lead, prompts, 20, width=w) for w in (1, 2)}
        taken = lead.local.rounds.counts["taken"]
        states = lead.check()
        lead.stop()
        proc.join(60)
        assert proc.exitcode == 0
    finally:
        stop_group()
        torch.set_num_threads(before)
        if proc.is_alive():
            proc.kill()
    one = BatchedTarget(TargetModel(demo_pair.target), _device_batching(True))
    one.enable_head(head)
    want = {w: _rounds(one, prompts, 20, width=w) for w in (1, 2)}
    assert states[0].digest == states[1].digest and states[0].messages["step"] == states[1].messages["step"]
    assert taken >= 6  # rounds taken from the chain launched ahead, on every rank alike
    for w in (1, 2):
        (g_tokens, g_rounds), (w_tokens, w_rounds) = got[w], want[w]
        if g_tokens != w_tokens:  # only a near-tie may part them
            i, n = next((i, next(j for j, (a, b) in enumerate(zip(g, t, strict=True)) if a != b))
                        for i, (g, t) in enumerate(zip(g_tokens, w_tokens, strict=True)) if g != t)
            gap = _gap(demo_pair.target, prompts[i] + w_tokens[i][:n])
            assert gap <= TOLERANCE[torch.float32], (w, i, n, gap)
        else:
            assert g_rounds == w_rounds  # the same drafts and verdicts, round for round
        assert sum(a for d, a in g_rounds if d) >= 10  # the head's drafts were accepted
