"""A bounded LRU of per-session worker state (KV caches): the least recently used session
is released when the bound is reached. Used by the draft and target workers."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar


class Releasable(Protocol):
    def release(self) -> None: ...


S = TypeVar("S", bound=Releasable)


class SessionLRU(Generic[S]):
    def __init__(self, factory: Callable[[], S], max_sessions: int) -> None:
        self.factory = factory
        self.max_sessions = max_sessions
        self.sessions: OrderedDict[str, S] = OrderedDict()

    def get(self, session_id: str) -> S:
        """The session's state, created on first use; marks it most recently used."""
        state = self.sessions.get(session_id)
        if state is None:
            state = self.factory()
            self.sessions[session_id] = state
            while len(self.sessions) > self.max_sessions:
                _, old = self.sessions.popitem(last=False)
                old.release()
        self.sessions.move_to_end(session_id)
        return state

    def release(self, session_id: str) -> bool:
        state = self.sessions.pop(session_id, None)
        if state is not None:
            state.release()
        return state is not None

    def __len__(self) -> int:
        return len(self.sessions)
