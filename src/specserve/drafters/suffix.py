"""Suffix decoding (ADR 0026): a model-free drafter that proposes the most frequent
continuation of the longest match of the context's end, looked up in two corpora:

- the session's own prompt and output (a `SuffixSession`, extended as tokens commit);
- its workload class's index of recent committed outputs (`drafters/suffix_index.py`), fed by
  every session of the class the target finished and by what the rest of the fleet served
  (through Redis: `state/suffix_share.py`).

In each corpus the drafter finds the longest m <= `max_match` such that the context's last m
tokens occur followed by at least one token (inside the session's own sequence, before its
last token). Those occurrences vote: the chain takes, at each depth, the token most of the
occurrences still agreeing with it hold (ties: the latest occurrence), and a token's
probability is the share of all the occurrences whose continuation starts with the chain up
to it. The chain stops below `min_prob`, at `spec_factor` x m tokens (a short match earns a
short guess), or at K. The corpus whose chain scores more (the sum of its tokens'
probabilities: the drafts it expects accepted) proposes. Within the session's own sequence a
continuation that reaches its end runs on periodically, as prompt lookup's does
(`drafters/ngram.py`). Where a token tree is asked for (`propose_tree`, ADR 0020), the first
position's likeliest continuations each start a branch.

Measured (python -m timeit on the 2-core EPYC, a 571-token session, the index of a class at
65 k tokens of extraction outputs): a proposal 40-60 us; ADR 0026 has the figures.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from specserve.drafters.base import DraftProposal, DraftTree, until_banned
from specserve.errors import InvalidRequest
from specserve.params import MAX_K, SamplingParams

if TYPE_CHECKING:
    from specserve.drafters.suffix_index import SuffixIndex

SEP = -1  # between sequences in a buffer, at its start, and over a sequence evicted in place
NARROW = 48  # candidates narrowed one column at a time down to this many, then compared at once
PY_ROWS = 16  # a continuation of at most this many occurrences is walked in Python
MAX_TOUCH = 16  # index entries marked used by one proposal (least recently used out)
MAX_MATCH = 64
SYNC_CHECK = 16  # a session's sequence is taken as the one it holds if these last tokens agree


@dataclass(frozen=True)
class SuffixSettings:
    """A class's suffix settings (its policy's `suffix_*` fields, ADR 0026)."""

    min_prob: float = 0.1  # a drafted token's estimated probability floor
    spec_factor: float = 1.0  # speculation length: this times the match length (then K)
    max_match: int = 32  # the longest context suffix looked up
    max_requests: int = 256  # the class index's outputs, least recently used out (0: no index)
    max_tokens: int = 65536  # and its tokens

    def __post_init__(self) -> None:
        if not (0.0 <= self.min_prob <= 1.0):
            raise InvalidRequest(f"suffix min_prob must be in [0, 1], got {self.min_prob}")
        if not (0.0 < self.spec_factor <= MAX_K):
            raise InvalidRequest(f"suffix spec_factor must be in (0, {MAX_K}], got {self.spec_factor}")
        if not (1 <= self.max_match <= MAX_MATCH):
            raise InvalidRequest(f"suffix max_match must be in [1, {MAX_MATCH}], got {self.max_match}")
        if self.max_requests < 0 or self.max_tokens < 0:
            raise InvalidRequest("suffix max_requests and max_tokens must be >= 0 (0: no index)")


@dataclass(frozen=True)
class Draft:
    """A corpus's proposal: tokens (a chain, or a tree's nodes depth-first with `parents`), each
    token's estimated probability, and the match it continues."""

    tokens: list[int]
    probs: list[float]
    match_len: int
    source: str  # "session" | "index"
    parents: list[int] | None = None
    touched: tuple[tuple[int, int], ...] = ()  # (part, position) of the occurrences it continued

    @property
    def score(self) -> float:
        """The drafts it expects accepted: the sum of its tokens' probabilities."""
        return float(sum(self.probs))


def longest(buf: np.ndarray, cand: np.ndarray, ctx_rev: np.ndarray, matched: int) -> tuple[int, np.ndarray]:
    """(m, the candidates whose match is m): the longest match among `cand`, positions in
    `buf` of the token after an occurrence whose `matched` tokens before it equal the
    context's last ones; `ctx_rev` is the context's end, reversed, as far as it is looked up.
    buf[0] is SEP, which no token equals, so a match never runs off the buffer's start."""
    limit, m = len(ctx_rev), matched
    while m < limit and cand.size > NARROW:  # one column at a time while there are many
        longer = cand[buf[cand - 1 - m] == ctx_rev[m]]
        if not longer.size:
            return m, cand
        cand, m = longer, m + 1
    if m < limit and cand.size:  # the rest at once: the first mismatch of each candidate
        cols = np.arange(m, limit)
        eq = buf.take(cand[:, None] - 1 - cols[None, :], mode="clip") == ctx_rev[m:limit][None, :]
        ext = np.where(eq.all(axis=1), limit - m, eq.argmin(axis=1))
        best = int(ext.max())
        return m + best, cand[ext == best]
    return m, cand


class Occurrences:
    """A match's occurrences, in corpus order: per part (a buffer), the positions of the token
    after each; the session's own sequence is periodic past its end."""

    def __init__(self, parts: Sequence[tuple[np.ndarray, np.ndarray, int]] = ()) -> None:
        # (buffer, positions, periodic end: 0 = none); empty parts kept (a part's number names its buffer)
        self.parts = list(parts)
        self.n = sum(p[1].size for p in self.parts)

    def matrix(self, length: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The continuations: one row per occurrence, `length` columns (SEP where it ended);
        with each row's part and position."""
        rows, part_of, pos_of = [], [], []
        cols = np.arange(length)
        for i, (buf, pos, end) in enumerate(self.parts):
            if not pos.size:
                continue
            # the session's own sequence (end > 0): past its end, the continuation repeats
            idx = pos[:, None] + (cols[None, :] % (end - pos)[:, None] if end else cols[None, :])
            rows.append(buf.take(idx, mode="clip"))
            part_of.append(np.full(pos.size, i))
            pos_of.append(pos)
        if len(rows) == 1:
            return rows[0], part_of[0], pos_of[0]
        return np.concatenate(rows), np.concatenate(part_of), np.concatenate(pos_of)


def _pick(col: np.ndarray) -> tuple[int, np.ndarray]:
    """The token most rows hold in `col` and the rows holding it (ties: the latest row; SEP,
    an ended continuation, never wins); (-1, empty) when every row ended."""
    live = col[col >= 0]
    if not live.size:
        return -1, col[:0].astype(np.int64)
    vals, counts = np.unique(live, return_counts=True)
    top = vals[counts == counts.max()]
    best = int(top[0]) if top.size == 1 else max((int(t) for t in top), key=lambda t: np.flatnonzero(col == t)[-1])
    return best, np.flatnonzero(col == best)


def walk(g: np.ndarray, n: int, start: int, length: int, min_prob: float) -> tuple[list[int], list[float], np.ndarray]:
    """The most frequent continuation of the rows of `g` (an occurrence each) from column
    `start` to `length`: each token kept while its probability (rows agreeing with the chain
    so far / n, all the occurrences) is at least `min_prob`; and the rows that hold all of it.
    A few rows are walked in Python (a numpy call costs more than a short loop); many, in
    numpy, where runs the rows agree on are taken whole and only disagreements vote."""
    if g.shape[0] <= PY_ROWS:
        few, few_p, live = walk_rows(g.tolist(), n, start, length, min_prob)
        return few, few_p, np.array(live, dtype=np.int64)
    rows = np.arange(g.shape[0])
    tokens: list[int] = []
    probs: list[float] = []
    d = start
    while d < length and rows.size / n >= min_prob:
        sub = g[rows, d:length]
        agree = (sub == sub[0]).all(axis=0)
        run = sub[0, : int(agree.argmin()) if not agree.all() else sub.shape[1]]
        ended = run < 0
        if ended.any():  # every agreeing row's continuation ended there
            run = run[: int(ended.argmax())]
        tokens.extend(run.tolist())
        probs.extend([rows.size / n] * run.size)
        d += run.size
        if ended.any() or d >= length:
            break
        best, where = _pick(g[rows, d])
        if best < 0 or where.size / n < min_prob:
            break
        rows = rows[where]
        tokens.append(best)
        probs.append(rows.size / n)
        d += 1
    return tokens, probs, rows


def walk_rows(rows: list[list[int]], n: int, start: int, length: int,
              min_prob: float) -> tuple[list[int], list[float], list[int]]:
    """`walk` over a few rows as lists: the same votes, ties and floor."""
    live = list(range(len(rows)))
    tokens: list[int] = []
    probs: list[float] = []
    for d in range(start, length):
        if len(live) == 1:  # one occurrence left: its continuation, while 1 / n clears the floor
            if 1 / n >= min_prob:
                for t in rows[live[0]][d:length]:
                    if t < 0:
                        break
                    tokens.append(t)
                    probs.append(1 / n)
            break
        counts: dict[int, int] = {}
        last: dict[int, int] = {}
        for i in live:
            t = rows[i][d]
            if t >= 0:
                counts[t] = counts.get(t, 0) + 1
                last[t] = i
        if not counts:
            break
        best = max(counts, key=lambda t: (counts[t], last[t]))
        if counts[best] / n < min_prob:
            break
        tokens.append(best)
        probs.append(counts[best] / n)
        if counts[best] != len(live):
            live = [i for i in live if rows[i][d] == best]
    return tokens, probs, live


def propose_from(occ: Occurrences, m: int, length: int, min_prob: float, source: str,
                 width: int = 1) -> Draft | None:
    """A chain (width 1), or a tree of up to `width` first candidates each with its chain,
    from a match's occurrences; None when nothing clears the floor."""
    if length <= 0 or not occ.n:
        return None
    g, part_of, pos_of = occ.matrix(length)

    def touched(rows: np.ndarray) -> list[tuple[int, int]]:
        return list(zip(part_of[rows[:MAX_TOUCH]].tolist(), pos_of[rows[:MAX_TOUCH]].tolist(), strict=True))

    if width <= 1:
        tokens, probs, rows = walk(g, occ.n, 0, length, min_prob)
        return Draft(tokens, probs, m, source, touched=tuple(touched(rows))) if tokens else None
    tokens, probs, parents, used = [], [], [], []
    for t in ranked(g[:, 0], width):
        first = np.flatnonzero(g[:, 0] == t)
        if first.size / occ.n < min_prob:
            break
        rest, rest_p, rows = walk(g[first], occ.n, 1, length, min_prob)
        parents += [-1, *range(len(tokens), len(tokens) + len(rest))]
        tokens += [t, *rest]
        probs += [first.size / occ.n, *rest_p]
        used += touched(first[rows])
    return Draft(tokens, probs, m, source, parents=parents, touched=tuple(used)) if tokens else None


def ranked(col: np.ndarray, width: int) -> list[int]:
    """Up to `width` distinct tokens of `col` by count, then the latest (SEP left out)."""
    counts: dict[int, int] = {}
    last: dict[int, int] = {}
    for i, t in enumerate(col.tolist()):
        if t >= 0:
            counts[t] = counts.get(t, 0) + 1
            last[t] = i
    return sorted(counts, key=lambda t: (counts[t], last[t]), reverse=True)[:width]


class SuffixSession:
    """One session's drafting state: its own sequence (prompt and output) as a buffer, and its
    class's index (None: its own sequence only)."""

    # its trees cost microseconds: drafted in place, as an n-gram pool's (services/draft/server.py)
    inline_tree = True

    def __init__(self, drafter: SuffixDrafter, index: SuffixIndex | None = None,
                 settings: SuffixSettings | None = None) -> None:
        self.drafter = drafter
        self.index = index
        self.settings = settings or drafter.settings
        self.buf = np.full(256, SEP, dtype=np.int32)
        self.n = 1  # buf[0] is SEP; the sequence is buf[1:n]
        self.last_source = ""  # where the last proposal came from: "session", "index" or "" (none)

    def _sync(self, token_ids: Sequence[int]) -> None:
        """The buffer is the committed sequence: extended by what is new, rebuilt where the
        sequence is not the one it holds (shorter, or its last SYNC_CHECK tokens there differ;
        an engine's session only grows, and a draft is a proposal: a stale view costs
        acceptance, never output)."""
        have = self.n - 1
        check = min(have, SYNC_CHECK)
        if len(token_ids) < have or (check and list(token_ids[have - check:have])
                                     != self.buf[have - check + 1:have + 1].tolist()):
            self.n, have = 1, 0
        new = len(token_ids) - have
        if new <= 0:
            return
        if self.n + new > self.buf.size:
            grown = np.full(max(2 * self.buf.size, self.n + new), SEP, dtype=np.int32)
            grown[: self.n] = self.buf[: self.n]
            self.buf = grown
        self.buf[self.n : self.n + new] = np.asarray(token_ids[have:], dtype=np.int32)
        self.n += new

    def _own(self, ctx_rev: np.ndarray) -> tuple[int, Occurrences]:
        """The longest match in the session's own sequence, before its last token."""
        n, buf = self.n, self.buf
        if n < 3:
            return 0, Occurrences()
        cand = np.flatnonzero(buf[1 : n - 1] == ctx_rev[0]) + 2  # the token after each, at most n - 1
        if not cand.size:
            return 0, Occurrences()
        m, cand = longest(buf, cand, ctx_rev, 1)
        return m, Occurrences([(buf, cand, n)])

    def drafts(self, token_ids: Sequence[int], k: int, width: int = 1) -> Draft | None:
        """The better of the session's and the index's proposals (the higher score), or None."""
        s = self.settings
        self._sync(token_ids)
        if k <= 0 or self.n < 2:
            return None
        ctx_rev = self.buf[max(self.n - s.max_match, 1) : self.n][::-1]
        found = [(*self._own(ctx_rev), "session")]
        if self.index is not None and self.index.requests:
            found.append((*self.index.lookup(ctx_rev), "index"))
        best: Draft | None = None
        for m, occ, source in found:
            d = propose_from(occ, m, min(k, int(s.spec_factor * m)), s.min_prob, source, width)
            if d is not None and (best is None or d.score > best.score):
                best = d
        if best is not None and best.source == "index" and self.index is not None:
            self.index.touch(best.touched)
        self.last_source = best.source if best is not None else ""
        return best

    def propose(self, token_ids: Sequence[int], k: int, sampling: SamplingParams, seed: int) -> DraftProposal:
        d = self.drafts(token_ids, k)
        tokens = d.tokens if d is not None else []
        return DraftProposal(until_banned(tokens, set(sampling.banned_token_ids)), None)

    def propose_tree(self, token_ids: Sequence[int], k: int, sampling: SamplingParams, seed: int,
                     width: int, grammar: object = None) -> DraftTree | None:
        """A token tree (ADR 0020): the first position's `width` likeliest continuations, each
        with its chain, depth-first; None where fewer than two are found (the chain is drafted
        then). Under a constraint the branches are not masked here: the target prunes them."""
        d = self.drafts(token_ids, k, width)
        if d is None or d.parents is None:
            return None
        banned = set(sampling.banned_token_ids)
        tokens: list[int] = []
        parents: list[int] = []
        kept: dict[int, int] = {}  # node -> its index among those kept (a banned one: cut, with its subtree)
        for i, (t, p) in enumerate(zip(d.tokens, d.parents, strict=True)):
            if t in banned or (p >= 0 and p not in kept):
                continue
            kept[i] = len(tokens)
            parents.append(-1 if p < 0 else kept[p])
            tokens.append(t)
        if sum(1 for p in parents if p < 0) < 2:
            return None
        return DraftTree(tokens, parents)

    def guess_next(self, token_ids: Sequence[int], sampling: SamplingParams, seed: int) -> int | None:
        d = self.drafts(token_ids, 1)
        return d.tokens[0] if d is not None and d.tokens[0] not in sampling.banned_token_ids else None

    def release(self) -> None:
        self.buf = self.buf[:2].copy()
        self.n = 1


class SuffixDrafter:
    """The drafter: sessions of their own sequence, with a class's index where one is given."""

    def __init__(self, vocab_size: int, settings: SuffixSettings | None = None, name: str = "suffix") -> None:
        self.vocab_size = vocab_size
        self.settings = settings or SuffixSettings()
        self.name = name

    def start(self, index: SuffixIndex | None = None, settings: SuffixSettings | None = None) -> SuffixSession:
        return SuffixSession(self, index, settings)
