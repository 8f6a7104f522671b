"""Model-free prompt-lookup drafter: continue the most recent earlier occurrence of the
sequence's last n tokens (n from max_n down to min_n), periodically where the continuation
reaches the end of the sequence. Its q is one-hot (deterministic)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from specserve.drafters.base import DraftProposal, DraftTree, check_ngram_sizes, until_banned
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
    # its trees cost microseconds (no model step): a draft server computes them in place, on
    # its event loop, where a model's tree is a second block to schedule (services/draft/server.py)
    inline_tree = True

    def __init__(self, drafter: NgramDrafter) -> None:
        self.drafter = drafter

    def propose(
        self, token_ids: Sequence[int], k: int, sampling: SamplingParams, seed: int
    ) -> DraftProposal:
        tokens = lookup(token_ids, k, self.drafter.min_n, self.drafter.max_n)
        return DraftProposal(until_banned(tokens, set(sampling.banned_token_ids)), None)

    def propose_tree(self, token_ids: Sequence[int], k: int, sampling: SamplingParams, seed: int,
                     width: int, grammar: object = None) -> DraftTree | None:
        """A token tree (ADR 0020) where the longest suffix match has several continuations:
        the `width` latest matches with distinct next tokens, each continued for k tokens, as
        branches (depth-first); None where one continuation (or none) is found. Under a
        constraint (`grammar`) the branches are not masked here: the target prunes what the
        constraint forbids."""
        branches = lookup_branches(token_ids, k, self.drafter.min_n, self.drafter.max_n, width)
        banned = set(sampling.banned_token_ids)
        branches = [b for b in (until_banned(b, banned) for b in branches) if b]
        if len(branches) < 2:
            return None
        tokens: list[int] = []
        parents: list[int] = []
        for branch in branches:
            for j, t in enumerate(branch):
                parents.append(-1 if j == 0 else len(tokens) - 1)
                tokens.append(t)
        return DraftTree(tokens, parents)

    def guess_next(self, token_ids: Sequence[int], sampling: SamplingParams, seed: int) -> int | None:
        guess = lookup(token_ids, 1, self.drafter.min_n, self.drafter.max_n)
        return guess[0] if guess and guess[0] not in sampling.banned_token_ids else None

    def release(self) -> None:
        return None


def lookup_branches(token_ids: Sequence[int], k: int, min_n: int, max_n: int, width: int) -> list[list[int]]:
    """`lookup`'s continuations of up to `width` matches of the longest suffix match, the
    latest first, one per distinct next token."""
    length = len(token_ids)
    ends = _match_ends(token_ids, min_n, max_n)
    if k <= 0 or ends is None:
        return []
    seq = np.asarray(token_ids, dtype=np.int64)
    out: list[list[int]] = []
    seen: set[int] = set()
    for end in reversed(ends.tolist()):
        begin = int(end) + 1
        branch: list[int] = []
        for j in range(k):
            i = begin + j
            branch.append(int(seq[i]) if i < length else branch[i - length])
        if branch[0] not in seen:
            seen.add(branch[0])
            out.append(branch)
        if len(out) == width:
            break
    return out


def _match_ends(token_ids: Sequence[int], min_n: int, max_n: int) -> np.ndarray | None:
    """The positions ending the longest suffix matches (see `lookup`), or None."""
    length = len(token_ids)
    if length < 2 or max_n < min_n:
        return None
    seq = np.asarray(token_ids, dtype=np.int64)
    ends = np.flatnonzero(seq[: length - 1] == seq[-1])
    n = 1
    while ends.size and n < max_n:
        longer = ends[ends >= n]
        longer = longer[seq[longer - n] == seq[length - 1 - n]]
        if not longer.size:
            break
        ends, n = longer, n + 1
    return ends if ends.size and n >= min_n else None


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
