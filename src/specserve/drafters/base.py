"""The drafter contract: a two-method session (propose, then observe the outcome)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from specserve.rejection import QProbs
from specserve.sampling import SamplingParams


@dataclass
class DraftProposal:
    tokens: list[int]  # K' <= K draft tokens (a drafter may propose fewer, even none)
    q: QProbs  # their draft distributions; None = one-hot (deterministic drafter)
    rollback_tokens: int = 0  # provisional positions dropped while reconciling

    @property
    def k(self) -> int:
        return len(self.tokens)


class DraftSession(Protocol):
    """One sequence's drafting state (KV cache, n-gram index, ...)."""

    def propose(
        self, token_ids: Sequence[int], k: int, sampling: SamplingParams, seed: int
    ) -> DraftProposal:
        """Propose up to k tokens following `token_ids` (the committed sequence: prompt and
        generated). Draft randomness is uniform(seed, absolute position, DRAFT)."""
        ...

    def observe(self, proposal: DraftProposal, num_accepted: int) -> None:
        """Learn from the verdict (adaptive K and statistics plug in here)."""
        ...

    def release(self) -> None:
        """Drop cached state."""
        ...


class Drafter(Protocol):
    name: str
    vocab_size: int

    def start(self) -> DraftSession: ...
