"""A workload class's index of recent committed outputs, for the suffix drafter (ADR 0026):
bounded in outputs and tokens, the least recently used (added, or drafted from) out.

Layout: outputs back to back in one buffer (SEP before, between and after them), with the
positions of every token that has one after it sorted by the 1, 2, 4 and 8 tokens ending
there (`LEVELS`; 1 and 2 exact, 4 and 8 hashed, a hit verified against the buffer), so a
lookup starts from the longest level the context's end hits and narrows from there. Outputs
added since the last merge sit in a small `recent` buffer that lookups scan; past
RECENT_TOKENS they are appended to the main buffer and their keys merged in (a memmove, not
a sort). An evicted output is overwritten with SEP where it lies, so it matches nothing at
once; when evicted tokens pass the live ones the main buffer is rebuilt (in insertion order,
so corpus order, and with it the drafter's ties, never changes).

Memory: 4 bytes a buffered token (at most twice the live ones, plus the recent part) and 48
bytes an indexed one (a key and a position per level); one thread mutates it (the target's
engine thread), others only read its counters.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from specserve.drafters.suffix import SEP, Occurrences, longest

LEVELS = (8, 4, 2, 1)  # context lengths with sorted keys, the longest tried first
RECENT_TOKENS = 512  # outputs added since the last merge are scanned, not indexed, up to this many
MUL = 0x100000001B3  # FNV's 64-bit prime: the 4- and 8-token keys' hash
MASK = (1 << 64) - 1


def context_keys(ctx_rev: np.ndarray) -> dict[int, int]:
    """Per level, the key of the context's last `level` tokens (`ctx_rev`: reversed), as
    `keys` computes it for a buffer position: exact for 1 and 2 tokens, hashed for more."""
    tokens = ctx_rev[: max(LEVELS)].tolist()
    out = {1: tokens[0]}
    if len(tokens) >= 2:
        out[2] = (tokens[1] << 32) | tokens[0]
    h = 0
    for j, t in enumerate(tokens):
        h = ((h ^ t) * MUL) & MASK
        if j + 1 in LEVELS and j + 1 > 2:
            out[j + 1] = h
    return out


def keys(buf: np.ndarray, lo: int, hi: int) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Per level, the sorted keys of the positions q in [lo, hi) whose token has one after it
    and `level` tokens ending at q (none of them SEP), with the position after each (q + 1)."""
    b = buf.astype(np.int64)
    q = np.arange(max(lo, 1), min(hi, b.size - 1))
    q = q[(b[q] >= 0) & (b[q + 1] >= 0)]
    out: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    h = np.zeros(q.size, dtype=np.uint64)
    ok = np.ones(q.size, dtype=bool)
    for j in range(max(LEVELS)):
        t = b[np.maximum(q - j, 0)]
        ok &= (t >= 0) & (q - j >= 1)
        h = (h ^ t.astype(np.uint64)) * np.uint64(MUL)
        level = j + 1
        if level in LEVELS:
            if level == 1:
                k = b[q].astype(np.uint64)
            elif level == 2:
                k = (b[q - 1].astype(np.uint64) << np.uint64(32)) | b[q].astype(np.uint64)
            else:
                k = h
            order = np.argsort(k[ok], kind="stable")
            out[level] = (k[ok][order], (q[ok][order] + 1).astype(np.int32))
    return out


@dataclass
class _Entry:
    part: int  # 0: the main buffer, 1: the recent one
    start: int  # its first token's position there
    length: int
    added: float  # wall time it was added (the index's age)


class _Buffer:
    """Sequences back to back, SEP before, between and after them, growing by doubling."""

    def __init__(self, capacity: int = 1024) -> None:
        self.buf = np.full(max(capacity, 2), SEP, dtype=np.int32)
        self.n = 1

    def append(self, tokens: np.ndarray) -> int:
        need = self.n + tokens.size + 1
        if need > self.buf.size:
            grown = np.full(max(2 * self.buf.size, need), SEP, dtype=np.int32)
            grown[: self.n] = self.buf[: self.n]
            self.buf = grown
        start = self.n
        self.buf[start : start + tokens.size] = tokens
        self.buf[start + tokens.size] = SEP
        self.n = start + tokens.size + 1
        return start


class SuffixIndex:
    """A workload class's recent committed outputs (the module docstring has the layout)."""

    def __init__(self, max_requests: int = 256, max_tokens: int = 65536,
                 clock: Callable[[], float] = time.time) -> None:
        self.max_requests, self.max_tokens = max_requests, max_tokens
        self.clock = clock
        self.entries: OrderedDict[int, _Entry] = OrderedDict()  # least recently used first
        self.tokens = 0
        self._next_id = 0
        self.main, self.recent = _Buffer(), _Buffer()
        self._keys = keys(self.main.buf, 0, 0)
        self._starts: dict[int, list[tuple[int, int]]] = {0: [], 1: []}  # (start, entry id), per buffer
        self._dead = 0  # evicted tokens still in the main buffer
        self.rebuilds = 0
        self.merges = 0

    @property
    def requests(self) -> int:
        return len(self.entries)

    def resize(self, max_requests: int, max_tokens: int) -> None:
        """New bounds (the class's policy changed): evicted down to them at once."""
        self.max_requests, self.max_tokens = max_requests, max_tokens
        self._evict()

    def add(self, tokens: Sequence[int], added: float | None = None) -> int | None:
        """An output, as the most recently used entry (its first `max_tokens` tokens); returns
        its id (None: nothing kept: an empty output, or an index bounded to nothing)."""
        arr = np.asarray(tokens, dtype=np.int32)[: self.max_tokens]
        if not arr.size or not self.max_requests or int(arr.min()) < 0:
            return None
        eid = self._next_id
        self._next_id += 1
        start = self.recent.append(arr)
        self._starts[1].append((start, eid))
        self.entries[eid] = _Entry(1, start, int(arr.size), self.clock() if added is None else added)
        self.tokens += int(arr.size)
        self._evict()
        if self.recent.n > RECENT_TOKENS:
            self._merge()
        return eid

    def _evict(self) -> None:
        while self.entries and (len(self.entries) > self.max_requests or self.tokens > self.max_tokens):
            _, e = self.entries.popitem(last=False)
            (self.main if e.part == 0 else self.recent).buf[e.start : e.start + e.length] = SEP
            self.tokens -= e.length
            if e.part == 0:
                self._dead += e.length
        if self._dead > max(self.tokens, 1):
            self._rebuild()

    def _merge(self) -> None:
        """The recent outputs appended to the main buffer, their keys merged into its own."""
        lo = self.main.n
        for start, eid in self._starts[1]:
            e = self.entries.get(eid)
            if e is not None:
                e.part, e.start = 0, self.main.append(self.recent.buf[start : start + e.length])
                self._starts[0].append((e.start, eid))
        new = keys(self.main.buf, lo, self.main.n)
        for level, (k_new, p_new) in new.items():
            k_old, p_old = self._keys[level]
            at = np.searchsorted(k_old, k_new, side="right")  # after equal keys: positions stay in order
            self._keys[level] = (np.insert(k_old, at, k_new), np.insert(p_old, at, p_new))
        self.recent, self._starts[1] = _Buffer(), []
        self.merges += 1

    def _rebuild(self) -> None:
        """Every live entry, in insertion order, into a fresh main buffer; recent emptied."""
        old = {0: self.main.buf, 1: self.recent.buf}
        live = sorted(self.entries.items())
        main = _Buffer(sum(e.length + 1 for _, e in live) + 1)
        for _, e in live:
            e.start, e.part = main.append(old[e.part][e.start : e.start + e.length]), 0
        self.main, self.recent, self._dead = main, _Buffer(), 0
        self._starts = {0: [(e.start, eid) for eid, e in live], 1: []}
        self._keys = keys(main.buf, 0, main.n)
        self.rebuilds += 1

    def touch(self, occurrences: Sequence[tuple[int, int]]) -> None:
        """The entries holding these occurrences ((part, position), a proposal's) were drafted
        from: they become the most recently used."""
        for part, pos in occurrences:
            starts = self._starts[part]
            i = _bisect(starts, pos) - 1
            if 0 <= i < len(starts) and starts[i][1] in self.entries:
                self.entries.move_to_end(starts[i][1])

    def lookup(self, ctx_rev: np.ndarray) -> tuple[int, Occurrences]:
        """The longest match of the context's end (reversed, `ctx_rev`) over the index, and
        its occurrences: in the main buffer, then in the recent one."""
        found = [self._indexed(ctx_rev), self._scanned(ctx_rev)]
        m = max(f[0] for f in found)
        if m == 0:
            return 0, Occurrences()
        return m, Occurrences([(buf, cand if fm == m else cand[:0], 0) for fm, buf, cand in found])

    def _indexed(self, ctx_rev: np.ndarray) -> tuple[int, np.ndarray, np.ndarray]:
        """The longest level the context's end hits, narrowed on from there. A hit is checked
        against the buffer at the end, on the few left: an evicted entry (SEP throughout)
        drops out at the first column past the level, so only where no column past it matched
        can it be among them; a hashed key that collided is checked there too, and should one
        have run on past the level, the match is taken again from the checked hits."""
        buf = self.main.buf
        for level, key in sorted(context_keys(ctx_rev).items(), reverse=True):
            k, nxt = self._keys[level]
            lo = int(k.searchsorted(np.uint64(key), side="left"))
            hi = int(k.searchsorted(np.uint64(key), side="right"))
            if lo == hi:
                continue
            m, occ = longest(buf, nxt[lo:hi], ctx_rev, level)
            ok = _verified(buf, occ, ctx_rev, level)  # few by now
            if ok.size == occ.size or (m == level and ok.size):
                return m, buf, ok
            if m > level:  # a hash collision ran on past the level: from the verified hits, then
                m, ok = longest(buf, _verified(buf, nxt[lo:hi], ctx_rev, level), ctx_rev, level)
                if ok.size:
                    return m, buf, ok
        return 0, buf, np.zeros(0, dtype=np.int64)

    def _scanned(self, ctx_rev: np.ndarray) -> tuple[int, np.ndarray, np.ndarray]:
        buf, n = self.recent.buf, self.recent.n
        if n < 3:
            return 0, buf, np.zeros(0, dtype=np.int64)
        q = np.flatnonzero(buf[1 : n - 1] == ctx_rev[0]) + 1
        cand = q[buf[q + 1] >= 0] + 1
        if not cand.size:
            return 0, buf, cand
        m, cand = longest(buf, cand, ctx_rev, 1)
        return m, buf, cand

    # ---- what the metrics read ----
    @property
    def nbytes(self) -> int:
        return int(self.main.buf.nbytes + self.recent.buf.nbytes
                   + sum(k.nbytes + p.nbytes for k, p in self._keys.values()))

    def age_s(self) -> float:
        """Since the oldest entry was added (0 when empty): how far back the index remembers."""
        if not self.entries:
            return 0.0
        return max(self.clock() - min(e.added for e in self.entries.values()), 0.0)


def _verified(buf: np.ndarray, cand: np.ndarray, ctx_rev: np.ndarray, level: int) -> np.ndarray:
    """The hits whose `level` tokens before them are the context's end."""
    if cand.size > 64:  # many: column by column, each narrowing the next
        for j in range(level):
            cand = cand[buf[cand - 1 - j] == ctx_rev[j]]
        return cand
    cols = np.arange(level)
    return cand[(buf.take(cand[:, None] - 1 - cols, mode="clip") == ctx_rev[:level]).all(axis=1)]


def _bisect(starts: list[tuple[int, int]], pos: int) -> int:
    """How many entries start at or before `pos`."""
    lo, hi = 0, len(starts)
    while lo < hi:
        mid = (lo + hi) // 2
        if starts[mid][0] <= pos:
            lo = mid + 1
        else:
            hi = mid
    return lo
