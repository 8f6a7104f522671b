"""The draft servicer batches its calls (ADR 0013) and a session's tokens do not depend on who
shares its batches: sessions run alone, then all at once through the same draft servicer and
target engine (each verify a row of the target's batched step, as the engine loop makes it),
give identical tokens at T = 0 and seeded at T > 0, with pre-drafting on. (The target's side
of batch invariance, many rows in one step, is tests/unit/test_engine_loop.py's.)

The models are randomly initialised small Llamas built here (no training, no download): their
near-uniform logits are full of near-ties, the hardest case for batch invariance. A model the
runner does not support falls back to the per-session HF path with one log line, and gives the
in-process reference decoder's tokens."""

from __future__ import annotations

import asyncio
import logging

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

from specserve.algorithm.round import draft_budget, settle
from specserve.algorithm.sampling import SamplingParams
from specserve.algorithm.stops import StopChecker
from specserve.drafters import HFDrafter
from specserve.models.verifier import TargetModel
from specserve.params import coupled_for
from specserve.services.draft.server import DraftServicer
from specserve.serving.wire import prefix_to_proto, sampling_to_proto
from specserve.state.prefix import CommittedPrefix
from specserve.step import RowResult, Step, StepRow
from specserve.v1 import draft_pb2
from specserve.worker.model_step import (
    BatchedDraft,
    BatchedTarget,
    Batching,
    SessionDraft,
    SessionTarget,
    make_target_step,
)
from specserve.worker.qcodec import q_from_proto
from specserve.worker.reference import GenerationParams, ReferenceDecoder

VOCAB = 96


def _llama(layers: int, hidden: int, seed: int, cls=LlamaForCausalLM, config=LlamaConfig):
    torch.manual_seed(seed)
    cfg = config(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, eos_token_id=None,
                 bos_token_id=None, pad_token_id=None)
    return cls(cfg).eval()


@pytest.fixture(scope="module")
def pair():
    return _llama(2, 64, 0), _llama(1, 32, 1)


BATCHING = Batching(kv_budget_mb=4, max_sessions=8, prefill_chunk=8)


class _Target:
    """The target's batched step, one row per call, as the engine loop feeds it (prefill
    chunks come back `again` until the prompt is in)."""

    def __init__(self, target, batching=BATCHING) -> None:
        self.model = make_target_step(TargetModel(target), batching)
        self.handles: dict[str, object] = {}
        self.steps = 0

    def verify(self, sid: str, ids: list[int], drafts: list[int], q, sampling: SamplingParams,
               seed: int) -> RowResult:
        handle = self.handles.get(sid) or self.handles.setdefault(sid, self.model.open(sid))
        while True:
            self.steps += 1
            [res] = self.model.step(Step([StepRow.verify(handle, ids, drafts, q, sampling, seed)])).rows
            if not res.again:
                break
        if res.error is not None:
            raise res.error
        return res

    def release(self, sid: str) -> None:
        self.model.close(self.handles.pop(sid))


def _workers(pair, batching=BATCHING):
    target, draft = pair
    return _Target(target, batching), DraftServicer(HFDrafter(draft), 8, batching=batching)


async def _generate(ts: _Target, ds: DraftServicer, sid: str, prompt: list[int], params: GenerationParams,
                    branches: int = 2) -> tuple[list[int], int]:
    """A session's rounds against the draft servicer and the target engine; (tokens,
    positions the target rolled back)."""
    committed = CommittedPrefix(prompt)
    stops = StopChecker(frozenset(), (), lambda ids: "")
    sampling = sampling_to_proto(params.sampling)
    generated: list[int] = []
    held_d = rolled = 0
    reason = None
    while reason is None:
        k = draft_budget(params.num_draft_tokens, len(generated), params.max_tokens)
        n = len(committed)
        block = None
        if k:
            block = await ds.propose(draft_pb2.ProposeRequest(
                session_id=sid, prefix=prefix_to_proto(committed, held_d), k=k, sampling=sampling,
                seed=params.seed, predraft_branches=branches))
            held_d = n
        drafts = list(block.tokens) if block else []
        q = q_from_proto(block.q, len(drafts), VOCAB) if block else None
        # judged as the engine judges the request's rows (a seed given: coupled, ADR 0027)
        result = ts.verify(sid, committed.ids, drafts, q, coupled_for(params.sampling, params.seed is not None),
                           params.seed)
        rolled += result.rolled_back
        settled = settle(generated, list(result.verdict.tokens), stops, params.max_tokens)
        generated += settled.tokens
        committed.extend(settled.tokens)
        reason = settled.finish_reason
    return generated, rolled


PROMPTS = [[(7 * i + j * 3) % VOCAB for j in range(3 + 5 * i)] for i in range(6)]  # 3..28 tokens


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_tokens_are_identical_alone_and_batched_through_the_draft_servicer(pair, temperature):
    sp = SamplingParams(temperature=temperature, top_p=0.95 if temperature else 1.0)
    params = [GenerationParams(max_tokens=12, sampling=sp, num_draft_tokens=1 + i % 4, seed=100 + i)
              for i in range(len(PROMPTS))]

    async def go():
        ts, ds = _workers(pair)
        assert isinstance(ts.model, BatchedTarget) and isinstance(ds.model, BatchedDraft)
        sizes: list[int] = []  # the draft scheduler's batch sizes, as its metrics hook sees them
        observe = ds.core.scheduler.on_batch
        ds.core.scheduler.on_batch = lambda n, s: (sizes.append(n), observe and observe(n, s))
        alone = [await _generate(ts, ds, f"alone-{i}", p, params[i]) for i, p in enumerate(PROMPTS)]
        for i in range(len(PROMPTS)):
            ts.release(f"alone-{i}"), ds.sessions.release(f"alone-{i}")
        before, sizes[:] = max(sizes), []
        together = await asyncio.gather(*(_generate(ts, ds, f"b-{i}", p, params[i]) for i, p in enumerate(PROMPTS)))
        return alone, together, before, max(sizes), ds

    alone, together, before, draft_max, ds = asyncio.run(go())
    assert [t for t, _ in alone] == [t for t, _ in together]
    assert before == 1 and draft_max >= 2  # really batched the second time
    assert sum(r for _, r in alone) > 0  # rejected drafts were rolled back along the way
    assert ds.metrics.predrafts._value.get() > 0  # drafting ahead ran on the batched draft


def test_greedy_tokens_do_not_change_with_predrafting_or_prefill_chunking(pair):
    params = GenerationParams(max_tokens=10, sampling=SamplingParams(), num_draft_tokens=3, seed=1)
    prompt = list(range(40))  # 5 chunks of 8

    async def go():
        ts, ds = _workers(pair)
        with_ahead = await _generate(ts, ds, "a", prompt, params, branches=2)
        ts2, ds2 = _workers(pair, Batching(kv_budget_mb=4, max_sessions=8, prefill_chunk=64))
        without = await _generate(ts2, ds2, "b", prompt, params, branches=0)
        return with_ahead, without, ts.steps, ts2.steps

    (a, _), (b, _), chunked, whole = asyncio.run(go())
    assert a == b
    assert chunked - whole == 4  # 5 chunks of 8 against the whole 40-token prompt in one step


def test_an_unsupported_architecture_falls_back_to_the_per_session_path(pair, caplog):
    target = _llama(2, 64, 2, MistralForCausalLM, MistralConfig)
    _, draft = pair
    caplog.set_level(logging.WARNING)
    ts = _Target(target)
    assert isinstance(ts.model, SessionTarget)
    assert [r.message for r in caplog.records if "MistralForCausalLM" in r.message
            and "per-session HF path" in r.message]
    ds = DraftServicer(HFDrafter(draft), 8, batching=Batching(enabled=False))
    assert isinstance(ds.model, SessionDraft)
    sp = SamplingParams(temperature=0.8)
    params = GenerationParams(max_tokens=10, sampling=sp, num_draft_tokens=3, seed=5)
    engine = ReferenceDecoder(TargetModel(target), HFDrafter(draft), _NoTokenizer())
    expected = engine.generate(PROMPTS[2], params).token_ids
    got, _ = asyncio.run(_generate(ts, ds, "s", PROMPTS[2], params))
    assert got == expected


class _NoTokenizer:
    def encode(self, text):
        raise AssertionError("token ids only")

    def decode(self, ids, skip_special_tokens=True):
        return ""
