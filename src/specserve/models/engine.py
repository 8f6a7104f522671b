"""The in-process speculative decoding loop: draft -> verify -> accept -> rollback.

It is the reference the distributed system is checked against: the router runs the same
round through gRPC and Redis and must produce the same tokens.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from specserve.algorithm.rng import fresh_seed
from specserve.algorithm.round import RoundStats, draft_budget, settle
from specserve.algorithm.stops import StopChecker
from specserve.drafters.base import Drafter
from specserve.errors import InvalidRequest
from specserve.models.verifier import TargetModel, verify_block
from specserve.params import GenerationParams


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


class SpecEngine:
    """generate(prompt, params) for one target and an optional drafter."""

    def __init__(self, target: TargetModel, drafter: Drafter | None, tokenizer) -> None:
        self.target = target
        self.drafter = drafter
        self.tokenizer = tokenizer
        if drafter is not None and drafter.vocab_size != target.vocab_size:
            raise InvalidRequest(
                f"draft vocabulary size {drafter.vocab_size} != target {target.vocab_size}"
            )

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
    ) -> GenerationResult:
        """Generate after `prompt`. `committed` resumes a generation whose first tokens are
        already committed (same seed -> the same continuation)."""
        prompt_ids = self.encode_prompt(prompt)
        self.check_length(len(prompt_ids), params.max_tokens)
        params.sampling.check_vocab(self.target.vocab_size)
        seed = fresh_seed() if params.seed is None else params.seed
        stops = StopChecker(self.target.eos_token_ids, params.stop, self._decode)
        resumed = settle([], [int(t) for t in committed], stops, params.max_tokens)  # already over?
        generated, finish = resumed.tokens, resumed.finish_reason
        rounds: list[RoundStats] = []
        draft = self.drafter.start() if (self.drafter and params.num_draft_tokens > 0) else None
        target = self.target.start()
        try:
            while finish is None:
                finish = self._round(draft, target, prompt_ids, generated, params, seed, stops, rounds)
        finally:
            target.release()
            if draft is not None:
                draft.release()
        return GenerationResult(prompt_ids, generated, stops.visible_text(generated, finish), finish, seed, rounds)

    def _round(self, draft, target, prompt_ids, generated, params, seed, stops, rounds) -> str | None:
        """draft -> verify_block -> settle, the same stages the router runs over the wire."""
        context = prompt_ids + generated
        k = draft_budget(params.num_draft_tokens, len(generated), params.max_tokens)
        t0 = time.perf_counter()
        proposal = draft.propose(context, k, params.sampling, seed) if (draft and k > 0) else None
        drafts = proposal.tokens if proposal else []
        t1 = time.perf_counter()
        verdict = verify_block(target, context, drafts, proposal.q if proposal else None, params.sampling, seed)
        t2 = time.perf_counter()
        settled = settle(generated, verdict.tokens, stops, params.max_tokens)
        generated.extend(settled.tokens)
        rounds.append(RoundStats(
            k=len(drafts), accepted=verdict.num_accepted, emitted=len(settled.tokens),
            rejected_position=verdict.rejected_position, draft_ms=(t1 - t0) * 1e3, verify_ms=(t2 - t1) * 1e3))
        return settled.finish_reason
