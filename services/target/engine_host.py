"""The target worker's engine (ADR 0014): the engine loop on a thread of its own, with its
committer and draft pools on the worker's event loop, and the sessions this incarnation drives.

`start(session_id)` claims a session the router created. It bumps the epoch with this
incarnation as the owner, so any earlier driver is fenced out. Then it continues the
session after its committed tokens. The session joins this target's index in Redis
(`{p}:target:{name}:sessions`). After a restart, the new incarnation adopts every running
session in its index the same way (`adopt_mine`): a kill costs a re-prefill, never wrong
output, because randomness is keyed by (seed, position, purpose).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import uuid
from collections.abc import Callable, Mapping

from specserve.algorithm.stops import StopChecker
from specserve.engine.committer import RedisCommitter
from specserve.engine.drafting import DraftSource
from specserve.engine.loop import EngineLoop, ModelStep
from specserve.engine.scheduler import Budget
from specserve.engine.session import EnginePlan, EngineSession, Status
from specserve.errors import SessionClosed, SessionNotFound
from specserve.params import GenerationParams
from specserve.state.store import SessionStatus, SessionStore

log = logging.getLogger("specserve.target")


class SessionIndex:
    """This target's sessions in Redis: the set a restarted incarnation adopts from."""

    def __init__(self, store: SessionStore, name: str) -> None:
        self.redis = store.client
        self.key = f"{store.prefix}:target:{name}:sessions"
        self.ttl_s = store.ttl_s

    async def add(self, session_id: str) -> None:
        async with self.redis.pipeline(transaction=False) as pipe:
            await pipe.sadd(self.key, session_id).expire(self.key, self.ttl_s).execute()

    async def remove(self, session_id: str) -> None:
        await self.redis.srem(self.key, session_id)

    async def members(self) -> list[str]:
        return sorted(m if isinstance(m, str) else m.decode() for m in await self.redis.smembers(self.key))


class EngineHost:
    def __init__(self, model: ModelStep, stops_for: Callable[[GenerationParams], StopChecker], store: SessionStore,
                 name: str, sources: Mapping[str, DraftSource], loop: asyncio.AbstractEventLoop,
                 budget: Budget | None = None, block_wait_max_s: float = 0.005, redis_outage_s: float = 30.0,
                 simulated_step_ms: float = 0.0) -> None:
        self.store = store
        self.name = name
        self.incarnation = f"{name}:{uuid.uuid4().hex[:12]}"  # one life of this process
        self.index = SessionIndex(store, name)
        self.loop = loop
        self.committer = RedisCommitter(store, loop, self._refused, redis_outage_s)
        self.engine = EngineLoop(model, stops_for, sources, self.committer, observers=[self], budget=budget,
                                 block_wait_max_s=block_wait_max_s,
                                 simulated_step_ms=(lambda works: simulated_step_ms) if simulated_step_ms else None)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self.engine.run_forever, args=(self._stop,), name="engine",
                                        daemon=True)

    def start_loop(self) -> EngineHost:
        self.committer.start()
        self._thread.start()
        return self

    async def close(self) -> None:
        self._stop.set()
        self.engine.wake()
        await asyncio.to_thread(self._thread.join, 10)
        await self.committer.stop()

    async def start(self, session_id: str) -> tuple[int, int]:
        """Drive the session from its committed tokens: (epoch, committed generated tokens)."""
        info = await self.store.get(session_id)
        if info is None:
            raise SessionNotFound(f"session {session_id} does not exist or expired")
        if info.status is not SessionStatus.RUNNING:
            raise SessionClosed(f"session {session_id} is {info.status.value}: nothing to drive")
        plan = EnginePlan.from_stored(info.params)
        epoch = await self.store.take_over(session_id, self.incarnation)
        generated = await self.store.committed_tokens(session_id)
        await self.index.add(session_id)
        try:
            await asyncio.wrap_future(self.engine.add(session_id, info.prompt_ids, plan, generated, epoch))
        except BaseException:
            await self.index.remove(session_id)
            raise
        return epoch, len(generated)

    def stop(self, session_id: str) -> bool:
        driving = session_id in self.engine.sessions
        self.engine.cancel(session_id)
        return driving

    async def adopt_mine(self) -> list[str]:
        """After a restart: take every running session of this target's index again."""
        adopted = []
        for sid in await self.index.members():
            try:
                await self.start(sid)
                adopted.append(sid)
            except (SessionNotFound, SessionClosed):
                await self.index.remove(sid)  # ended or expired while nobody drove it
        if adopted:
            log.info("%s adopted %d sessions", self.incarnation, len(adopted))
        return adopted

    # ---- engine observer (loop thread) and committer callback (event loop) ----
    def round(self, session: EngineSession, stats) -> None:
        pass

    def finished(self, session: EngineSession) -> None:
        # Only an end of its own leaves the index: a session refused because another
        # incarnation claimed it stays there for that one (a stale entry is dropped by
        # adopt_mine, which finds it no longer running).
        if session.status in (Status.FINISHED, Status.FAILED):
            self.loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self.index.remove(session.id)))

    def _refused(self, session_id: str, why: str) -> None:
        self.engine.cancel(session_id, why)
