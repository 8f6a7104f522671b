"""What the session store hands out and takes in: statuses, commit results, a session's
hash and its committed chunks (state/store.py)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Protocol


class SessionStatus(StrEnum):
    RUNNING = "running"
    FINISHED = "finished"
    CANCELLED = "cancelled"
    FAILED = "failed"


class CommitStatus(StrEnum):
    OK = "ok"
    DUPLICATE = "duplicate"  # this round id was applied before: nothing written
    MISSING = "missing"  # no such session (never created, or expired)
    CLOSED = "closed"  # finished, cancelled or failed: no more tokens
    STALE_EPOCH = "stale_epoch"  # another router took the session over
    STALE_LEN = "stale_len"  # expected_len is not the committed length


class RoundCommit(Protocol):
    """One round's commit as `commit_batch` takes it (the engine's CommitRecord)."""

    @property
    def session_id(self) -> str: ...
    @property
    def epoch(self) -> int: ...
    @property
    def expected_len(self) -> int: ...
    @property
    def round_id(self) -> str: ...
    @property
    def tokens(self) -> Sequence[int]: ...
    @property
    def text(self) -> str: ...
    @property
    def finish_reason(self) -> str | None: ...
    @property
    def stats(self) -> str: ...


@dataclass(frozen=True)
class SessionHandle:
    session_id: str
    epoch: int
    created: bool  # False: the request_id was seen before and this call joined its session

    @property
    def joined(self) -> bool:
        return not self.created


@dataclass(frozen=True)
class CommitResult:
    status: CommitStatus
    committed_len: int  # the number of committed generated tokens after the call

    @property
    def applied(self) -> bool:
        """The round's tokens are committed, by this call or by an earlier retry."""
        return self.status in (CommitStatus.OK, CommitStatus.DUPLICATE)


@dataclass(frozen=True)
class SessionInfo:
    session_id: str
    status: SessionStatus
    params: dict[str, Any]
    prompt_ids: list[int]
    epoch: int
    owner: str
    created: float  # unix seconds, from the Redis clock
    updated: float
    finish_reason: str | None
    committed: int
    request_id: str | None
    error: str | None
    stats: dict[str, Any] | None = None  # the driver's statistics of its run, once it finished


@dataclass(frozen=True)
class Chunk:
    offset: int  # index of the first token among the generated tokens
    tokens: tuple[int, ...]
    text: str  # newly visible text; "" when partial (the caller re-detokenizes)
    finish_reason: str | None  # set on the last chunk of a session only
    partial: bool = False  # the tail of a stored chunk: a reader resumed inside it
    error: str | None = None  # why the session failed


# Shared by the scripts below. KEYS are the session's own keys; ARGV[1] = prefix, ARGV[2] = ttl.


def as_str(value: bytes | str | int) -> str:
    """A Redis reply value as text (the client may answer bytes)."""
    return value.decode() if isinstance(value, bytes) else str(value)
