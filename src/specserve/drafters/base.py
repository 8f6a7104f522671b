"""The drafter contract: a session proposes K tokens after the committed sequence. What a
round teaches (acceptance per position, cost) goes to the controller, not to the drafter:
the drafter stays a pure function of the committed prefix, so a retried round drafts the same."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from specserve.errors import InvalidRequest
from specserve.params import SamplingParams

if TYPE_CHECKING:  # torch-free at run time: the router imports the prediction drafter
    from specserve.algorithm.rejection import QProbs


# a token tree's first candidates branch only where the drafter's probability of its first token
# is under this (ADR 0020): where it is sure, a second candidate would rarely be the target's
SURE = 0.9


@dataclass
class DraftProposal:
    tokens: list[int]  # K' <= K draft tokens (a drafter may propose fewer, even none)
    q: QProbs  # their draft distributions; None = one-hot (deterministic drafter)
    dropped_on_reconcile: int = 0  # provisional positions dropped while reconciling
    # per position, the drafter's runner-up token: its guess of the recovered token should the
    # target reject that position (pre-drafting, ADR 0010); None where it has none
    runner_up: list[int | None] | None = None
    # per position, the drafter's probability of its drafted token and of the runner-up: how
    # likely each verdict is, so pre-drafting prepares the likeliest first; None = unknown
    confidence: list[tuple[float, float]] | None = None

    @property
    def k(self) -> int:
        return len(self.tokens)


@dataclass
class DraftTree:
    """A token tree (algorithm/tree.py, ADR 0020): its tokens, parents before children, each
    token's parent among them (-1: the last committed token)."""

    tokens: list[int]
    parents: list[int]
    # None: candidates chosen without draws (top-k, n-gram matches; judged one-hot at any T).
    # A sampled session's tree drawn from the drafter: each node's q row, siblings drawn without
    # replacement (algorithm/tree.py: draw_siblings)
    q: QProbs = None


class DraftSession(Protocol):
    """One sequence's drafting state (KV cache, n-gram index, ...)."""

    def propose(
        self, token_ids: Sequence[int], k: int, sampling: SamplingParams, seed: int
    ) -> DraftProposal:
        """Propose up to k tokens following `token_ids` (the committed sequence: prompt and
        generated). A sampled draw at a position is the Gumbel-max draw with that position's
        noise, keyed by (seed, absolute position): the noise the target draws its own token
        there with (ADR 0027)."""
        ...

    def guess_next(self, token_ids: Sequence[int], sampling: SamplingParams, seed: int) -> int | None:
        """The drafter's guess of the token the target emits after `token_ids` (the bonus
        token when a whole block is accepted), for pre-drafting; None = no guess."""
        ...

    def release(self) -> None:
        """Drop cached state."""
        ...


class Drafter(Protocol):
    name: str
    vocab_size: int

    def start(self) -> DraftSession: ...


def check_ngram_sizes(min_n: int, max_n: int) -> None:
    if not (1 <= min_n <= max_n):
        raise InvalidRequest(f"n-gram sizes need 1 <= min_n <= max_n, got {min_n}, {max_n}")


def until_banned(tokens: list[int], banned: Collection[int]) -> list[int]:
    """The block cut before its first banned token: a banned token can never be accepted."""
    if banned:
        for i, t in enumerate(tokens):
            if t in banned:
                return tokens[:i]
    return tokens
