"""The engine's commits to Redis, off the critical path (ADR 0014).

The loop thread hands each step's commits to `submit`, which never blocks. On the event
loop, one task sends everything queued since its last round trip as **one pipeline**, each
round fenced by the store's commit script (expected length, epoch, round id). The epoch is
the driver's: a target that claims a session bumps it, so a zombie incarnation's commits are
refused (`stale_epoch`).

Through a Redis outage the batch is retried for up to `outage_s`. A retry is safe: a round
that landed answers `duplicate`. Batches stay in order, so a session's rounds land one after
the other. A refused round (closed, taken over, or Redis gone for longer than `outage_s`)
is reported to `on_refused`: the engine stops that session, with nothing after what it
committed. Every answered round (applied, duplicate or refused) is reported to `on_acked`, one
session id per round: the engine holds a session whose unanswered rounds reach
`max_commit_lag` (its back-pressure), so a long outage cannot grow provisional work.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence

from specserve.engine.session import CommitRecord
from specserve.state.store import REDIS_DOWN, CommitStatus, SessionStore, ride_out

log = logging.getLogger("specserve.engine")
REDIS_GONE = "redis_unavailable"


class RedisCommitter:
    def __init__(self, store: SessionStore, loop: asyncio.AbstractEventLoop,
                 on_refused: Callable[[str, str], None], outage_s: float = 30.0,
                 observe: Callable[[int, float], None] | None = None,
                 on_acked: Callable[[list[str]], None] | None = None) -> None:
        self.store = store
        self.loop = loop
        self.on_refused = on_refused  # (session_id, why), called on the event loop
        self.outage_s = outage_s
        self.observe = observe  # (rounds in the pipeline, seconds)
        self.on_acked = on_acked  # (one session id per answered round), on the event loop
        self.pipelines = 0
        # what the loop thread hands over, and whether a wake of the event loop is on its way:
        # one wake takes everything handed over since the last, and runs `on_wake` too (the
        # target's step accounting), so a step costs the event loop one wake, not one a caller
        self.on_wake: Callable[[], None] | None = None
        self._handed: deque[list[CommitRecord]] = deque()
        self._waking = False
        self._queue: asyncio.Queue[list[CommitRecord]] = asyncio.Queue()
        self._idle = asyncio.Event()
        self._idle.set()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> RedisCommitter:
        """Start the sending task (call on the event loop)."""
        self._task = self.loop.create_task(self._run())
        return self

    def submit(self, records: Sequence[CommitRecord]) -> None:
        """One step's commits, from any thread."""
        self._handed.append(list(records))
        self.kick()

    def kick(self) -> None:
        """Wake the event loop for what was handed over (and `on_wake`), unless a wake is on its
        way already (from any thread)."""
        if not self._waking:
            self._waking = True
            self.loop.call_soon_threadsafe(self._woken)

    def _woken(self) -> None:
        self._waking = False  # (before taking: what is handed over after this wakes it again)
        while self._handed:
            self._idle.clear()
            self._queue.put_nowait(self._handed.popleft())
        if self.on_wake is not None:
            self.on_wake()

    async def flush(self) -> None:
        """Wait until everything submitted so far has been answered by Redis."""
        await asyncio.sleep(0)  # let call_soon_threadsafe callbacks already scheduled run
        if self._handed:  # (handed over from this thread, its wake not run yet)
            self._woken()
        await self._idle.wait()

    async def stop(self) -> None:
        await self.flush()
        if self._task is not None:
            self._task.cancel()

    async def _run(self) -> None:
        while True:
            batch = await self._queue.get()
            while not self._queue.empty():  # what queued during the last round trip: same pipeline
                batch += self._queue.get_nowait()
            await self._send(batch)
            if self._queue.empty():
                self._idle.set()

    async def _send(self, batch: list[CommitRecord]) -> None:
        try:
            await self._send_batch(batch)
        finally:
            if self.on_acked is not None:
                self.on_acked([r.session_id for r in batch])

    async def _send_batch(self, batch: list[CommitRecord]) -> None:
        t = time.perf_counter()
        try:
            results = await ride_out(lambda: self.store.commit_batch(batch), self.outage_s)
        except REDIS_DOWN:
            log.warning("Redis down for over %.0f s: %d rounds not committed", self.outage_s, len(batch))
            for sid in dict.fromkeys(r.session_id for r in batch):
                self.on_refused(sid, REDIS_GONE)
            return
        self.pipelines += 1
        if self.observe is not None:
            self.observe(len(batch), time.perf_counter() - t)
        refused: dict[str, str] = {}
        for record, result in zip(batch, results, strict=True):
            if not result.applied and record.session_id not in refused:
                refused[record.session_id] = result.status.value
        for sid, why in refused.items():
            if why != CommitStatus.CLOSED.value:
                log.info("session %s: commit refused (%s); the engine stops it", sid, why)
            self.on_refused(sid, why)
