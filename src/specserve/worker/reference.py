"""The in-process reference decoder: draft -> verify -> accept -> rollback, one session at a
time, in this process.

It is the reference the distributed system is checked against: the router runs the same
round through gRPC and Redis and must produce the same tokens. Its rounds go through the
same typed step as the workers' (specserve/step.py, ADR 0019): a DRAFT row through the
drafter's model step and a VERIFY row through the target's (worker/model_step.py: the
batched runner for the architectures it serves, the per-session HF path otherwise or with
`Batching(enabled=False)`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

from specserve.algorithm.rng import fresh_seed
from specserve.algorithm.round import RoundStats, draft_budget, settle
from specserve.algorithm.stops import StopChecker
from specserve.drafters.base import Drafter
from specserve.errors import InvalidRequest
from specserve.models.verifier import TargetModel
from specserve.params import GenerationParams, coupled_for
from specserve.step import ModelStep, RowResult, Step, StepRow


@dataclass
class GenerationResult:
    prompt_ids: list[int]
    token_ids: list[int]  # generated (committed) tokens, the stopping token included
    text: str
    finish_reason: str  # "eos" | "length" | "stop"
    seed: int
    rounds: list[RoundStats]

    @property
    def accepted_per_round(self) -> list[int]:
        return [r.accepted for r in self.rounds if r.k > 0]


class ReferenceDecoder:
    """generate(prompt, params) for one target and an optional drafter."""

    def __init__(self, target: TargetModel, drafter: Drafter | None, tokenizer, batching=None) -> None:
        """`batching`: worker/model_step.py's Batching for both model steps (default: the
        workers' defaults, two KV slots a model)."""
        self.target = target
        self.drafter = drafter
        self.tokenizer = tokenizer
        if drafter is not None and drafter.vocab_size != target.vocab_size:
            raise InvalidRequest(
                f"draft vocabulary size {drafter.vocab_size} != target {target.vocab_size}"
            )
        self.batching = batching
        self._steps: tuple[ModelStep, ModelStep | None] | None = None

    def model_steps(self) -> tuple[ModelStep, ModelStep | None]:
        """The target's and the drafter's model steps, made on first use (the batched ones
        copy the weights they need and allocate their KV slots)."""
        if self._steps is None:
            from specserve.worker.model_step import Batching, make_draft_step, make_target_step

            b = self.batching or Batching(max_sessions=2, max_batch=2)
            self._steps = (make_target_step(self.target, b),
                           make_draft_step(self.drafter, b) if self.drafter is not None else None)
        return self._steps

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def encode_prompt(self, prompt: str | Sequence[int]) -> list[int]:
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        if not ids:
            raise InvalidRequest("the prompt is empty: send at least one token")
        bad = [t for t in ids if not (0 <= t < self.target.vocab_size)]
        if bad:
            raise InvalidRequest(f"token id {bad[0]} is outside the vocabulary (size {self.target.vocab_size})")
        return ids

    def check_length(self, prompt_len: int, max_tokens: int) -> None:
        limit = self.target.max_positions
        if prompt_len + max_tokens > limit:
            raise InvalidRequest(
                f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds the model's "
                f"context length of {limit} tokens: shorten the prompt or lower max_tokens"
            )

    def generate(
        self,
        prompt: str | Sequence[int],
        params: GenerationParams,
        committed: Sequence[int] = (),
        coupled: bool | None = None,
    ) -> GenerationResult:
        """Generate after `prompt`. `committed` resumes a generation whose first tokens are
        already committed (same seed -> the same continuation). Sampled with a seed given,
        the rows use the coupled sampler (ADR 0027: the tokens are plain decoding's with the
        seed, whatever K and the drafter), as the engine's do; `coupled` overrides that (a
        benchmark's rejection-sampling arm at a fixed seed)."""
        prompt_ids = self.encode_prompt(prompt)
        self.check_length(len(prompt_ids), params.max_tokens)
        params.sampling.check_vocab(self.target.vocab_size)
        seeded = params.seed is not None if coupled is None else coupled
        params = replace(params, sampling=coupled_for(params.sampling, seeded))
        seed = fresh_seed() if params.seed is None else params.seed
        stops = StopChecker(self.target.eos_token_ids, params.stop, self._decode)
        resumed = settle([], [int(t) for t in committed], stops, params.max_tokens)  # already over?
        generated, finish = resumed.tokens, resumed.finish_reason
        rounds: list[RoundStats] = []
        target_step, draft_step = self.model_steps()
        if params.num_draft_tokens <= 0:
            draft_step = None
        target = target_step.open("\0reference")
        draft = draft_step.open("\0reference") if draft_step is not None else None
        try:
            while finish is None:
                finish = self._round(draft_step, draft, target_step, target, prompt_ids, generated, params, seed,
                                     stops, rounds)
        finally:
            target_step.close(target)
            if draft_step is not None:
                draft_step.close(draft)
        return GenerationResult(prompt_ids, generated, stops.visible_text(generated, finish), finish, seed, rounds)

    def _round(self, draft_step, draft, target_step, target, prompt_ids, generated, params, seed, stops,
               rounds) -> str | None:
        """A DRAFT row, a VERIFY row, settle: the same stages the router runs over the wire."""
        context = prompt_ids + generated
        k = draft_budget(params.num_draft_tokens, len(generated), params.max_tokens)
        t0 = time.perf_counter()
        proposal = None
        if draft_step is not None and k > 0:
            proposal = _run(draft_step, StepRow.draft(draft, context, k, params.sampling, seed)).proposal
        drafts = proposal.tokens if proposal else []
        t1 = time.perf_counter()
        verdict = _run(target_step, StepRow.verify(target, context, drafts, proposal.q if proposal else None,
                                                   params.sampling, seed)).verdict
        assert verdict is not None
        t2 = time.perf_counter()
        settled = settle(generated, verdict.tokens, stops, params.max_tokens)
        generated.extend(settled.tokens)
        rounds.append(RoundStats(
            k=len(drafts), accepted=verdict.num_accepted, emitted=len(settled.tokens),
            rejected_position=verdict.rejected_position, draft_ms=(t1 - t0) * 1e3, verify_ms=(t2 - t1) * 1e3))
        return settled.finish_reason


def _run(model: ModelStep, row: StepRow) -> RowResult:
    """One row through a model step, asked again while a long prompt goes in chunk by chunk."""
    while (res := model.step(Step([row])).rows[0]).again:
        pass
    if res.error is not None:
        raise res.error
    return res
