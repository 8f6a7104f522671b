"""Pre-drafting (ADR 0010): while the target verifies round n, the draft worker drafts round
n+1's block for the committed prefixes round n is likely to end with, and keeps the blocks in
a small per-session cache keyed by the exact prefix they assumed (length and chain hash), K,
sampling and seed. Round n+1 then asks with the real committed prefix: a hit returns the
prepared block at once, a miss drafts afresh.

Lossless by construction: a drafter's block is a pure function of (prefix, K, sampling, seed)
(its draws are uniform(seed, absolute position, DRAFT)), so a prepared block used only for the
exact prefix it assumed equals what drafting afresh would give. Torch-free.

The likely prefixes after a block d_1..d_K drafted after `ids` (in order of preparation):
  all accepted:         ids + d_1..d_K + [b]          b = the drafter's guess of the bonus token
  rejected at j:        ids + d_1..d_j + [r_j]        r_j = its runner-up at position j+1
Example: ids [5, 6], block [7, 8], bonus guess 9, runner-ups [4, 3] ->
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


def likely_prefixes(ids: Sequence[int], block: Sequence[int], bonus_guess: int | None,
                    runner_up: Sequence[int | None] | None, branches: int) -> list[list[int]]:
    """Up to `branches` committed prefixes round n+1 may start from, most useful first."""
    out: list[list[int]] = []
    if bonus_guess is not None:
        out.append([*ids, *block, bonus_guess])
    for j, alt in enumerate(runner_up or ()):
        if alt is not None:
            out.append([*ids, *block[:j], alt])
    return out[:branches]


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
