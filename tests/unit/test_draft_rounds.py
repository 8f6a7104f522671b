"""A draft model inside the target's round (ADR 0025, issue 51 item 3; models/draft_step.py):
its K positions in the same run as the verify and the verdict, rounds chained on the device.

1. The draft model on the device drafts what it drafts on the host (HF's greedy continuation
   of the same prefix), round after round.
2. Exactness: rounds drafted on the device, host-driven (synchronous) and chained, give the
   target's own greedy tokens, and the same drafts and verdicts round for round (mixed K); at
   T > 0 (rejection sampling, and the coupled verdict of a seeded row) chained rounds equal the
   host-driven ones, and a seeded session's tokens are plain decoding's with its seed; through
   the engine loop, chained rounds equal host-driven ones while every way a round launched
   ahead is thrown away happens, counted.
3. The graph-safety audit on the fake CUDA device: three chained rounds (advance, the draft's
   K positions, verify, verdict, the draft fed the committed tokens) run the same ops on the
   same buffers, copy nothing from or to the host, read nothing made for one call.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from fakedevice import OpTrace, fake_cuda
from test_chained_rounds import PROMPTS, _fake_head_runner, _head_rows, _LateEveryOther, _plain, _rounds, audited_rounds
from test_device_audit import ARCHITECTURES, SHAPE
from transformers import LlamaConfig, LlamaForCausalLM

from specserve.algorithm.stops import StopChecker
from specserve.drafters.hf import HFDrafter
from specserve.engine.device_drafts import DeviceDraftModelDrafts
from specserve.engine.loop import EngineLoop
from specserve.engine.session import EnginePlan
from specserve.engine.speculation import SpeculationSettings
from specserve.models.draft_step import DeviceDraft
from specserve.models.verifier import TargetModel
from specserve.params import GenerationParams, SamplingParams
from specserve.step import Step, StepRow
from specserve.worker.model_step import BatchedTarget, Batching


def _target(demo_pair, lookahead: bool) -> BatchedTarget:
    t = BatchedTarget(TargetModel(demo_pair.target), Batching(kv_budget_mb=64, max_sessions=6, max_len=256,
                                                              prefill_chunk=16, device="cpu", dtype="fp32",
                                                              fixed_step=True, max_batch=6, lookahead=lookahead))
    t.enable_head(demo_pair.draft)  # the draft model inside the target's round
    assert isinstance(t.heads.device, DeviceDraft)
    return t


def _row(slot, ids: list[int], k: int) -> StepRow:
    row = StepRow.verify(slot, ids, [], None, SamplingParams(), 0)
    row.head, row.k = True, k
    return row


def test_the_draft_model_on_the_device_drafts_what_it_drafts_on_the_host(demo_pair, one_thread):
    t = _target(demo_pair, lookahead=False)
    ids, compared = demo_pair.tokenizer.encode(PROMPTS[0]), 0
    slot = t.open("s")
    for _ in range(9):
        res = t.step(Step([_row(slot, ids, 4)])).rows[0]
        if res.drafted:
            with torch.inference_mode():
                host = demo_pair.draft.generate(torch.tensor([ids]), max_new_tokens=4, do_sample=False)
            assert host[0, len(ids):].tolist() == res.drafted
            compared += 1
        ids = ids + res.verdict.tokens
    assert compared == 8  # every round after the prompt's (the draft is current from then on)


def test_rounds_drafted_by_the_draft_model_on_the_device_give_the_targets_greedy_tokens(demo_pair, one_thread):
    prompts = [demo_pair.tokenizer.encode(p) for p in PROMPTS]
    want = _plain(demo_pair, prompts, 24)
    sync, rounds = _rounds(_target(demo_pair, lookahead=False), prompts, 24, [4, 2, 3])
    chained_target = _target(demo_pair, lookahead=True)
    chained, rounds_chained = _rounds(chained_target, prompts, 24, [4, 2, 3])
    assert sync == want and chained == want
    assert rounds_chained == rounds  # the same drafts and verdicts, round for round
    assert sum(a for d, a in rounds if d) >= 15  # the draft model's drafts are accepted
    counts = chained_target.rounds.counts
    assert counts["taken"] >= 6, (counts, chained_target.rounds.thrown_by)


@pytest.mark.parametrize("seeded", [False, True], ids=["rejection", "coupled"])
def test_sampled_rounds_of_the_draft_model_chained_equal_host_driven_ones(demo_pair, seeded, one_thread):
    prompts = [demo_pair.tokenizer.encode(p) for p in PROMPTS]
    sampling = SamplingParams(temperature=0.7, top_k=50, coupled=seeded)
    sync, rounds = _rounds(_target(demo_pair, lookahead=False), prompts, 20, [4, 3, 2], sampling=sampling)
    chained, rounds_chained = _rounds(_target(demo_pair, lookahead=True), prompts, 20, [4, 3, 2], sampling=sampling)
    assert chained == sync and rounds_chained == rounds
    assert sum(a for d, a in rounds if d) >= 8
    if seeded:
        plain, _ = _rounds(_target(demo_pair, lookahead=False), prompts, 20, 0, sampling=sampling)
        assert sync == plain


def _engine_run(demo_pair, lookahead: bool, stop: str) -> tuple[dict, BatchedTarget]:
    """Sessions of mixed K on the draft model in the round: one ends by its budget inside a
    round, one on a stop string found inside one, one is cancelled, one plain rides along, a
    session of another pool whose blocks come late every other round joins, then a sampled
    and a seeded one (drafting on the device too) join."""
    t = _target(demo_pair, lookahead)
    tok = demo_pair.tokenizer
    steps: list = []
    loop = EngineLoop(t, lambda p: StopChecker(frozenset(), p.stop, tok.decode),
                      {"small": DeviceDraftModelDrafts(HFDrafter(demo_pair.draft)),
                       "late": _LateEveryOther(t.runner.vocab_size)},
                      speculation=SpeculationSettings(block_wait_max_s=0.0, gather=False), on_step=steps.append)

    def plan(n: int, k: int = 4, pool: str = "small", **kw) -> EnginePlan:
        return EnginePlan(GenerationParams(max_tokens=n, num_draft_tokens=k, seed=3, **kw), pool=pool)

    p = [tok.encode(x) for x in PROMPTS]
    loop.add("budget", p[0], plan(21))
    loop.add("stop", p[1], plan(40, stop=(stop,)))
    loop.add("cancel", p[2], plan(40, k=2))
    loop.add("plain", p[1], EnginePlan(GenerationParams(max_tokens=30, seed=3)))
    loop.add("long", p[2], plan(60, k=3))
    while loop._inbox or any(s.running for s in loop.sessions.values()):
        loop.step()
        if len(steps) == 8:
            loop.cancel("cancel")
        if len(steps) == 12:
            loop.add("late", p[0], plan(24, pool="late"))
        if len(steps) == 18:  # sampled sessions join (judged on the device, drafted there)
            loop.add("sampled", p[2], plan(12, sampling=SamplingParams(temperature=0.8)))
            loop.add("seeded", p[0], plan(12, sampling=SamplingParams(temperature=0.8, coupled=True)))
    return {sid: (s.generated, s.finish_reason) for sid, s in loop.ended.items()}, t


def test_chained_draft_model_rounds_through_the_engine_equal_host_driven_rounds(demo_pair, one_thread):
    tok = demo_pair.tokenizer
    plain = _plain(demo_pair, [tok.encode(PROMPTS[1])], 40)[0]
    stop = tok.decode(plain[14:17])
    sync, _ = _engine_run(demo_pair, False, stop)
    chained, t = _engine_run(demo_pair, True, stop)
    assert chained == sync
    assert len(sync["budget"][0]) == 21 and sync["stop"][1] == "stop" and sync["cancel"][1] == "cancelled"
    assert chained["long"] == (_plain(demo_pair, [tok.encode(PROMPTS[2])], 60)[0], "length")
    counts, why = t.rounds.counts, t.rounds.thrown_by
    assert why.get("ended", 0) + counts.get("parts", 0) >= 2, (counts, why)
    assert why.get("changed", 0) + why.get("joined", 0) >= 2, why
    assert counts["taken"] >= 5 and counts["thrown"] == sum(why.values()), counts


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_a_chained_round_of_the_draft_model_is_graph_safe_on_a_fake_cuda_device(arch, monkeypatch):
    """Three rows of the draft model in the round (K 4, 2 and 3; the third sampled)."""
    with fake_cuda() as (_, host_copies):
        runner, _ = _fake_head_runner(arch, monkeypatch)
        ds = runner.device_step
        draft = LlamaForCausalLM(LlamaConfig(**{**SHAPE, "hidden_size": 32, "intermediate_size": 48,
                                                "num_attention_heads": 2, "num_key_value_heads": 1})).eval()
        device = ds.enable_head(draft)
        rows = _head_rows(runner)
        rows[2] = replace(rows[2], sampling=SamplingParams(temperature=0.9), seed=4)
        starts = [runner.length(r.session) for r in rows]
        b = ds.bucket_for(rows, starts)
        ds.prepare(rows, [runner.kv.slot(r.session) for r in rows], starts, b)
        traces = audited_rounds(runner, device, b, 4, host_copies)
        with OpTrace() as verify:
            ds.run(b)
        # the draft's K positions (its 2 layers each) and its feed are inside the round
        assert len(traces[0].ops) > len(verify.ops) + 4 * 2 * 20
