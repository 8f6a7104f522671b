"""Model-free prompt-lookup drafter: continue the most recent earlier occurrence of the
sequence's last n tokens (n from max_n down to min_n), periodically where the continuation
reaches the end of the sequence. Its q is one-hot (deterministic)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from specserve.drafters.base import DraftProposal, check_ngram_sizes, until_banned
from specserve.params import SamplingParams


class NgramDrafter:
    def __init__(self, vocab_size: int, min_n: int = 1, max_n: int = 4, name: str = "ngram") -> None:
        check_ngram_sizes(min_n, max_n)
        self.vocab_size = vocab_size
        self.min_n = min_n
        self.max_n = max_n
        self.name = name

    def start(self) -> NgramSession:
        return NgramSession(self)


class NgramSession:
    def __init__(self, drafter: NgramDrafter) -> None:
        self.drafter = drafter

    def propose(
        self, token_ids: Sequence[int], k: int, sampling: SamplingParams, seed: int
    ) -> DraftProposal:
        tokens = lookup(token_ids, k, self.drafter.min_n, self.drafter.max_n)
        return DraftProposal(until_banned(tokens, set(sampling.banned_token_ids)), None)

    def guess_next(self, token_ids: Sequence[int], sampling: SamplingParams, seed: int) -> int | None:
        guess = lookup(token_ids, 1, self.drafter.min_n, self.drafter.max_n)
        return guess[0] if guess and guess[0] not in sampling.banned_token_ids else None

    def release(self) -> None:
        return None


def lookup(token_ids: Sequence[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to k tokens that followed the most recent earlier match of the last n tokens, for the
    largest n in [min_n, max_n] that has a match.

    One pass per n at most: every earlier position j holding the last token ends a candidate
    match; its length grows backwards while the tokens agree (at most max_n). The longest
    length n found wins, and among the matches at least that long, the latest j. (A sliding
    window scan per n costs 4 scans of the whole sequence when nothing matches; this one
    narrows the candidates at each step. It runs on the target's engine thread for a
    `local:ngram` pool, once per session per step.)
    """
    length = len(token_ids)
    if k <= 0 or length < 2 or max_n < min_n:
        return []
    seq = np.asarray(token_ids, dtype=np.int64)
    ends = np.flatnonzero(seq[: length - 1] == seq[-1])  # j < length - 1 ends a match of n = 1
    n = 1
    while ends.size and n < max_n:  # can the matches grow to n + 1?
        longer = ends[ends >= n]  # a match ending at j starts at j - n >= 0
        longer = longer[seq[longer - n] == seq[length - 1 - n]]
        if not longer.size:
            break
        ends, n = longer, n + 1
    if not ends.size or n < min_n:
        return []
    # The most recent match in periodic text sits right before the end, so its continuation
    # runs into the proposal itself: extend it with the period.
    begin = int(ends[-1]) + 1
    out: list[int] = []
    for j in range(k):
        i = begin + j
        out.append(int(seq[i]) if i < length else out[i - length])
    return out
