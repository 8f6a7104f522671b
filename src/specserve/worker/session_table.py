"""The worker's session table: per session, the committed prefix it holds (with its hash
chain, DESIGN §3 inv. 2) and a handle on its KV (a runner slot, or a per-session HF cache).

Admission: a new session needs KV room. When the backend has none (`KVBudgetExhausted`),
the table evicts the least recently used session that is idle (no call queued or running,
unused for `evict_idle_s`); its next call re-prefills through FAILED_PRECONDITION, as after
an LRU eviction. With nothing evictable the error stands: the servicer answers
RESOURCE_EXHAUSTED and the router queues the request (ADR 0013). Torch-free.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from specserve.errors import InvalidRequest, KVBudgetExhausted
from specserve.state.prefix import CommittedPrefix


@dataclass(eq=False)
class WorkerSession:
    id: str
    handle: Any  # the backend's per-session state
    prefix: CommittedPrefix = field(default_factory=CommittedPrefix)
    extra: Any = None  # the servicer's own per-session state (the draft's speculation cache)
    busy: int = 0  # items queued or running in the scheduler (raised per item, lowered as it leaves)
    last_used: float = field(default_factory=time.monotonic)
    # set when the session was released while busy: frees its KV once its last item has left
    on_idle: Callable[[], None] | None = field(default=None, repr=False)

    def leave(self) -> None:
        """One of its items left the scheduler (Work.release)."""
        self.busy -= 1
        if self.busy == 0 and self.on_idle is not None:
            free, self.on_idle = self.on_idle, None
            free()

    def reconcile(self, prefix) -> list[int]:
        """The committed sequence of a request's `prefix` (base_len, base_hash, tokens);
        NeedsFullPrefix when this worker does not hold the base it assumes."""
        ids = self.prefix.apply(prefix.base_len, prefix.base_hash, prefix.tokens)
        if not ids:
            raise InvalidRequest("the committed prefix is empty: send at least one token")
        return list(ids)


class SessionTable:
    """Sessions by id, least recently used first. `open(session_id)` makes a backend handle
    (raising KVBudgetExhausted when full), `close(handle)` frees it, never while an item of
    the session is queued or running: a session released then (its router finished, was
    cancelled or moved on while a Verify of it still waited for a batch) leaves the table at
    once and frees its KV when its last item leaves the scheduler."""

    def __init__(self, open: Callable[[str], Any], close: Callable[[Any], None], max_sessions: int,
                 evict_idle_s: float = 1.0, on_close: Callable[[WorkerSession], None] | None = None) -> None:
        self.open = open
        self.close = close
        self.max_sessions = max_sessions
        self.evict_idle_s = evict_idle_s
        self.on_close = on_close
        self.sessions: OrderedDict[str, WorkerSession] = OrderedDict()

    def get(self, session_id: str) -> WorkerSession:
        """The session, created on first use (evicting idle ones for room); marks it used."""
        seq = self.sessions.get(session_id)
        if seq is None:
            seq = WorkerSession(session_id, self._open(session_id))
            self.sessions[session_id] = seq
        self.sessions.move_to_end(session_id)
        seq.last_used = time.monotonic()
        return seq

    def _open(self, session_id: str) -> Any:
        """A handle for a new session: room is made by evicting idle sessions, else
        KVBudgetExhausted (max_sessions is a budget like the KV slots)."""
        while True:
            try:
                if len(self.sessions) >= self.max_sessions:
                    raise KVBudgetExhausted(f"all {self.max_sessions} sessions of this worker are in use")
                return self.open(session_id)
            except KVBudgetExhausted as exc:
                if not self._evict():
                    raise KVBudgetExhausted(
                        f"{exc} ({len(self.sessions)} sessions are running; none has been idle for "
                        f"{self.evict_idle_s:g} s)") from None

    def _evict(self) -> bool:
        """Drop the least recently used idle session (no call in flight, unused for
        evict_idle_s); False when none qualifies."""
        now = time.monotonic()
        for sid, seq in self.sessions.items():
            if seq.busy == 0 and now - seq.last_used >= self.evict_idle_s:
                self.release(sid)
                return True
        return False

    def release(self, session_id: str) -> bool:
        seq = self.sessions.pop(session_id, None)
        if seq is None:
            return False
        if self.on_close is not None:
            self.on_close(seq)
        if seq.busy > 0:
            seq.on_idle = lambda: self.close(seq.handle)
        else:
            self.close(seq.handle)
        return True

    def holds(self, seq: WorkerSession) -> bool:
        """Whether `seq` is still this table's entry for its id (not released or evicted)."""
        return self.sessions.get(seq.id) is seq

    def __len__(self) -> int:
        return len(self.sessions)
