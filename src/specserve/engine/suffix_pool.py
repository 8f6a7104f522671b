"""The `suffix` draft pool (ADR 0026): suffix decoding beside the target, on the engine's
thread as the n-gram pool is (a pool whose only address is `local:suffix`): no replica, no
hop, no late block. Each session drafts from its own prompt and output and from its class's
index of recent committed outputs (drafters/suffix.py, drafters/suffix_index.py).

The indexes learn from every session of their class that this engine finishes, whichever
pool it ran on (`served`: the engine's draft pools tell every source that learns from
outputs), and from what the rest of the fleet served (`receive`, from the event loop's
follower of the Redis streams, state/suffix_share.py): a target started later, or
restarted, drafts from what the others served. A finished output goes back to the fleet
through `share` (the target posts it to Redis, off this thread).

Everything here runs on the engine's thread but `receive` (any thread: a bounded queue the
engine drains before it drafts) and `snapshot` (the metrics' collector, under a lock).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from specserve.drafters.suffix import SuffixDrafter, SuffixSession, SuffixSettings
from specserve.drafters.suffix_index import SuffixIndex
from specserve.engine.drafting import LocalDrafts, _Local
from specserve.engine.session import EnginePlan, EngineSession, Status

SUFFIX_POOL = "suffix"
MAX_PENDING = 8192  # fleet outputs waiting for the engine thread (an idle engine drains none)
SOURCES = ("index", "session", "none")  # where a proposal came from: the class's index, the session's own, nothing

Share = Callable[[str, list[int], SuffixSettings], None]


def settings_of(plan: EnginePlan) -> SuffixSettings:
    """The class's suffix settings its plan carries (the policy's suffix_* fields)."""
    d = plan.suffix or {}
    base = SuffixSettings()
    return SuffixSettings(min_prob=float(d.get("min_prob", base.min_prob)),
                          spec_factor=float(d.get("spec_factor", base.spec_factor)),
                          max_requests=int(d.get("max_requests", base.max_requests)),
                          max_tokens=int(d.get("max_tokens", base.max_tokens)))


def conf_of(s: SuffixSettings) -> dict[str, Any] | None:
    """The settings as a shared output carries them (None: the defaults)."""
    d = {"max_requests": s.max_requests, "max_tokens": s.max_tokens, "min_prob": s.min_prob,
         "spec_factor": s.spec_factor}
    base = SuffixSettings()
    return None if d == {"max_requests": base.max_requests, "max_tokens": base.max_tokens,
                         "min_prob": base.min_prob, "spec_factor": base.spec_factor} else d


@dataclass(frozen=True)
class ClassIndexStats:
    """A class index as the metrics read it."""

    outputs: int
    tokens: int
    nbytes: int
    oldest: float  # when its oldest output was added (unix seconds; 0: empty)
    added: dict[str, int]  # outputs added, by origin (local | fleet)
    proposals: dict[str, int]  # rounds drafted, by where the block came from (SOURCES)


class SuffixDrafts(LocalDrafts):
    learns_from_outputs = True  # told of every finished session (engine/drafting.py DraftPools.close)

    def __init__(self, vocab_size: int, share: Share | None = None, clock: Callable[[], float] = time.time) -> None:
        self.suffix = SuffixDrafter(vocab_size)
        super().__init__(self.suffix)
        self.share = share
        self.clock = clock
        self.indexes: dict[str, SuffixIndex] = {}
        self.settings: dict[str, SuffixSettings] = {}
        self._pending: deque[tuple[str, list[int], float, SuffixSettings | None]] = deque(maxlen=MAX_PENDING)
        self._lock = threading.Lock()  # the counters below, read by the metrics' collector
        self._added: dict[tuple[str, str], int] = {}
        self._proposals: dict[tuple[str, str], int] = {}
        self._stats: dict[str, tuple[int, int, int, float]] = {}
        self._class_of: dict[str, str] = {}  # session -> the class whose index it drafts from

    # ---- the indexes ----
    def index_for(self, cls: str, settings: SuffixSettings) -> SuffixIndex | None:
        """The class's index, made or resized to `settings` (None where they keep none)."""
        if not settings.max_requests or not settings.max_tokens:
            self.indexes.pop(cls, None)
            return None
        index = self.indexes.get(cls)
        if index is None:
            index = self.indexes[cls] = SuffixIndex(settings.max_requests, settings.max_tokens, clock=self.clock)
        elif (index.max_requests, index.max_tokens) != (settings.max_requests, settings.max_tokens):
            index.resize(settings.max_requests, settings.max_tokens)
        self.settings[cls] = settings
        return index

    def receive(self, cls: str, tokens: list[int], added: float, settings: SuffixSettings | None = None) -> None:
        """Another target's output of the class (any thread): indexed before the next draft."""
        self._pending.append((cls, tokens, added, settings))

    def drain(self) -> None:
        """The fleet's outputs received since the last call, into their classes' indexes."""
        touched: set[str] = set()
        while self._pending:
            cls, tokens, added, settings = self._pending.popleft()
            index = self.index_for(cls, settings or self.settings.get(cls) or SuffixSettings())
            if index is not None and index.add(tokens, added) is not None:
                self._count(self._added, cls, "fleet")
                touched.add(cls)
        for cls in touched:
            self._snapshot(cls)

    def served(self, session: EngineSession) -> None:
        """A session this engine finished (any pool): its output into its class's index, and
        to the fleet. A shadow twin's is its served session's again; an output cut short
        (cancelled, failed) is not what the class produces."""
        self.drain()  # (a target whose sessions run other pools indexes the fleet's outputs too)
        plan = session.plan
        if plan.shadow or session.status is not Status.FINISHED or not session.generated:
            return
        cls = plan.index_class or "default"
        settings = settings_of(plan)
        index = self.index_for(cls, settings)
        if index is None:
            return
        tokens = list(session.generated)
        index.add(tokens)
        self._count(self._added, cls, "local")
        self._snapshot(cls)
        if self.share is not None:
            self.share(cls, tokens, settings)

    # ---- drafting ----
    def open(self, session: EngineSession) -> None:
        self.drain()
        cls = self._class_of[session.id] = session.plan.index_class or "default"
        settings = settings_of(session.plan)
        draft = self.suffix.start(self.index_for(cls, settings), settings)
        local = self.sessions[session.id] = _Local(session, draft, self._grammar(session))
        self._propose(session.id, local, session.k_next)

    def outcome(self, outcome: Any) -> None:
        self.drain()
        super().outcome(outcome)

    def close(self, session_id: str) -> None:
        super().close(session_id)
        self._class_of.pop(session_id, None)

    def _propose(self, session_id: str, local: _Local, k: int, width: int = 1) -> None:
        super()._propose(session_id, local, k, width)
        if k > 0 and isinstance(local.draft, SuffixSession):
            self._count(self._proposals, self._class_of.get(session_id, "default"), local.draft.last_source or "none")

    # ---- what the metrics read ----
    def _count(self, table: dict[tuple[str, str], int], cls: str, what: str) -> None:
        with self._lock:
            table[(cls, what)] = table.get((cls, what), 0) + 1

    def _snapshot(self, cls: str) -> None:
        index = self.indexes.get(cls)
        if index is None:
            return
        oldest = min((e.added for e in index.entries.values()), default=0.0)
        with self._lock:
            self._stats[cls] = (index.requests, index.tokens, index.nbytes, oldest)

    def snapshot(self) -> dict[str, ClassIndexStats]:
        """Every class index's figures, as of the engine's last change to it (any thread)."""
        with self._lock:
            stats, added, proposals = dict(self._stats), dict(self._added), dict(self._proposals)
        classes = set(stats) | {c for c, _ in added} | {c for c, _ in proposals}
        return {c: ClassIndexStats(*stats.get(c, (0, 0, 0, 0.0)),
                                   added={o: added.get((c, o), 0) for o in ("local", "fleet")},
                                   proposals={s: proposals.get((c, s), 0) for s in SOURCES})
                for c in classes}
