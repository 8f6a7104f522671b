"""Pre-drafting (ADR 0010): while the target verifies round n, the draft worker drafts round
n+1's block for the committed prefixes round n is likely to end with, and keeps the blocks in
a small per-session cache keyed by the exact prefix they assumed (length and chain hash), K,
sampling and seed. Round n+1 then asks with the real committed prefix: a hit returns the
prepared block at once, a miss drafts afresh.

Lossless by construction: a drafter's block is a pure function of (prefix, K, sampling, seed)
(its draws use the noise of (seed, absolute position), ADR 0027), so a prepared block used only for the
exact prefix it assumed equals what drafting afresh would give. Torch-free.

The likely prefixes after a block d_1..d_K drafted after `ids`:
  all accepted (j = K): ids + d_1..d_K + [b]          b = the drafter's guess of the bonus token
  rejected at j < K:    ids + d_1..d_j + [r_j]        r_j = its runner-up at position j+1
prepared likeliest first, by the drafter's own probabilities a_i of its tokens and c_j of its
runner-ups (its stand-in for the target's): P(j = K) ~ a_1..a_K * mean(a), P(j) ~ a_1..a_j * c_j.
Example: ids [5, 6], block [7, 8], bonus guess 9, runner-ups [4, 3], confidence
[(0.5, 0.3), (0.9, 0.05)] -> P(all) = 0.45 * 0.7 = 0.315, P(0) = 0.3, P(1) = 0.025 ->
  [5, 6, 7, 8, 9], [5, 6, 4], [5, 6, 7, 3]
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from specserve.params import SamplingParams


@dataclass(frozen=True)
class BlockKey:
    length: int  # committed length (prompt included) the block follows
    prefix_hash: int  # chain hash of that committed prefix (specserve.state.prefix)
    k: int
    sampling: SamplingParams
    seed: int
    constrained: bool = False  # drafted from the masked q (a constrained session's blocks only)


def likely_outcomes(k: int, runner_up: Sequence[int | None] | None,
                    confidence: Sequence[tuple[float, float]] | None, branches: int) -> list[int]:
    """Up to `branches` positions j at which round n is likely to end, likeliest first: j = k
    all accepted (then the bonus guess), j < k rejected at j (then the runner-up). Without
    the drafter's probabilities: all accepted first, then j = 0, 1, ..."""
    alts = list(runner_up or [None] * k)
    candidates = [k, *(j for j in range(k) if alts[j] is not None)]
    if confidence and len(confidence) == k:
        accept = [a for a, _ in confidence]
        reach = [1.0]
        for a in accept:
            reach.append(reach[-1] * a)  # reach[j]: P(the first j are accepted)
        score = {j: reach[j] * (confidence[j][1] if j < k else sum(accept) / k) for j in candidates}
        candidates.sort(key=lambda j: -score[j])  # stable: ties keep all-accepted first
    return candidates[:branches]


def likely_prefix(ids: Sequence[int], block: Sequence[int], j: int, runner_up: Sequence[int | None] | None,
                  bonus_guess: int | None) -> list[int] | None:
    """The committed prefix round n+1 starts from when round n ends at j (likely_outcomes)."""
    if j == len(block):
        return None if bonus_guess is None else [*ids, *block, bonus_guess]
    alt = runner_up[j] if runner_up else None
    return None if alt is None else [*ids, *block[:j], alt]


class SpeculationCache:
    """Prepared blocks of one session, at most `capacity` (oldest dropped first)."""

    def __init__(self, capacity: int = 8) -> None:
        self.capacity = capacity
        self.blocks: OrderedDict[BlockKey, Any] = OrderedDict()

    def put(self, key: BlockKey, block: Any) -> None:
        self.blocks[key] = block
        self.blocks.move_to_end(key)
        while len(self.blocks) > self.capacity:
            self.blocks.popitem(last=False)

    def take(self, key: BlockKey) -> Any | None:
        """The block prepared for exactly this key, or None; a hit also drops every block
        prepared for an earlier or equal length (those prefixes can no longer come)."""
        block = self.blocks.pop(key, None)
        if block is not None:
            for stale in [k for k in self.blocks if k.length <= key.length]:
                del self.blocks[stale]
        return block

    def clear(self) -> None:
        self.blocks.clear()
