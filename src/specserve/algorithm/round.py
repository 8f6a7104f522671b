"""The rules of one round that do not touch a model, shared by the in-process reference decoder and the
router: how many drafts a round may ask for, where its emitted tokens stop (`settle`), and the
one record a round leaves (`RoundStats`), which metrics, the controller and tracing observe.
Torch-free: the router imports it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from specserve.algorithm.stops import StopChecker


def draft_budget(k: int, generated: int, max_tokens: int) -> int:
    """K for this round. A round emits at most K + 1 tokens, so it never drafts more than the
    token budget left minus one.

    Example: K=4 with 2 of 5 tokens left -> 1 draft (the round emits at most 2).
    """
    return max(min(k, max_tokens - generated - 1), 0)


@dataclass(frozen=True)
class Settled:
    tokens: list[int]  # what this round commits: the emitted tokens, cut at a stop or the budget
    finish_reason: str | None  # eos | stop | length; None = the session goes on


def settle(generated: Sequence[int], emitted: Sequence[int], stops: StopChecker, max_tokens: int) -> Settled:
    """Cut a round's emitted tokens at the first stop (the stopping token kept) or at the token
    budget.

    Example: generated [5], emitted [7, 0, 9] with EOS 0 -> Settled([7, 0], "eos").
    """
    before = len(generated)
    candidate = [*generated, *emitted]
    stop = stops.first_stop(candidate, before)
    if stop is not None:
        return Settled(candidate[before : stop[0]], stop[1])
    if len(candidate) >= max_tokens:
        return Settled(candidate[before:max_tokens], "length")
    return Settled(list(emitted), None)


@dataclass(frozen=True)
class RoundStats:
    """What one round did and cost: the single record per round."""

    k: int  # draft tokens proposed (0: a plain decode step)
    accepted: int
    emitted: int  # tokens committed from this round (after stops)
    rejected_position: int | None  # index in the block of the first rejection; None = all accepted
    draft_ms: float  # the draft worker's compute (its queue excluded)
    verify_ms: float  # the target's compute (its queue excluded)
    overhead_ms: float = 0.0  # round wall time outside draft_ms + verify_ms: network, queues, commit
    fallback_reason: str = ""  # why the round ran without drafts ("" when it had them)
    k_asked: int = 0  # K the round asked for (a drafter may propose fewer, or fail)
    predraft: str = ""  # the block was drafted ahead: "pushed" (no call) or "cached" (worker hit)
    # the engine: the session's time since its previous round ended, outside this round's step
    # (waiting for its block, held, or left out of steps); the controller prices pools with it
    wait_ms: float = 0.0
    tree_size: int = 0  # a token tree's drafts (k is then its depth); 0: a chain
    feature_bytes: int = 0  # the target's features handed to the session's pool this round (ADR 0020)
    probe: bool = False  # held plain, the round asked for a block to keep learning and waited for none

    @property
    def rejected(self) -> int:
        return self.k - self.accepted
