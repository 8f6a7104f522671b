"""Sessions as the control plane sees them (ADR 0014): create one (or join the one a retried
`request_id` created) and place it on a target, whose engine drives its rounds and commits
them; readers follow Redis, never a target.

The driver holds a lease on each session it drives (the target's heartbeat renews it). A
target that dies is restarted by Ray and its new incarnation adopts its sessions from its
index. When the lease lapses anyway (the target is gone for good, or cannot be restarted),
a router re-places the session: a reader between blocks, or each router's reaper over the
`running` index. Claiming it is atomic (`store.claim`: one winner among the routers), and the
target that takes it bumps the epoch, so anything the old driver still sends is fenced out.
A target that already drives the session (a restarted one that adopted it) keeps it as it is.
The output is what the first driver would have made: randomness is keyed by (seed,
position, purpose)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass

from specserve.errors import SessionClosed, SessionNotFound, SpecserveError
from specserve.services.router.plan import SessionPlan
from specserve.services.router.targets import TargetDirectory
from specserve.serving.metrics import RouterMetrics
from specserve.state.store import REDIS_DOWN, SessionStore

log = logging.getLogger("specserve.router")


@dataclass(frozen=True)
class Ownership:
    reap_s: float = 2.0  # how often the reaper looks for sessions whose driver's lease lapsed
    claim_s: float = 10.0  # a router's claim to re-place a session holds this long (one winner)


@dataclass(frozen=True)
class Opened:
    session_id: str
    joined: bool  # the request_id named an existing session


class Sessions:
    def __init__(self, store: SessionStore, targets: TargetDirectory, owner: str, metrics: RouterMetrics,
                 ownership: Ownership = Ownership()) -> None:
        self.store = store
        self.targets = targets
        self.owner = owner
        self.metrics = metrics
        self.ownership = ownership
        self.tasks: set[asyncio.Task] = set()
        self.replacing: dict[str, asyncio.Task] = {}  # session -> the follow hook's re-placing
        # session -> when a reader on this router last waited on it: its re-placing is that
        # reader's (under the request's span, so the new run joins the request's trace); the
        # reaper leaves it alone while the reader is there
        self.followed: dict[str, float] = {}

    async def open(self, request_id: str | None, prompt_ids: list[int], plan: SessionPlan) -> Opened:
        """Create the session and start it on a target, or join the one `request_id` names
        (re-placing it at once if its driver's lease has lapsed)."""
        handle = await self.store.create_or_join(request_id, plan.encode(), prompt_ids, self.owner)
        if not handle.created:
            await self.follow_hook(handle.session_id)
            return Opened(handle.session_id, True)
        try:
            await self.targets.start(handle.session_id, plan.adapter)
        except SpecserveError as exc:  # no target took it: the session ends with the reason
            with contextlib.suppress(*REDIS_DOWN):
                await self.store.fail(handle.session_id, handle.epoch, str(exc))
            raise
        return Opened(handle.session_id, False)

    async def replace(self, session_id: str) -> bool:
        """Re-place the session iff it runs and its driver's lease has lapsed (one router
        wins the claim). True when this router placed it."""
        if not await self.store.claim(session_id, self.owner, self.ownership.claim_s):
            return False
        try:
            info = await self.store.get(session_id)
            await self.targets.start(session_id, str((info.params if info else {}).get("adapter") or ""))
        except (SessionNotFound, SessionClosed):
            return False
        log.info("re-placed session %s after its driver's lease lapsed", session_id)
        self.metrics.takeovers.inc()
        return True

    async def follow_hook(self, session_id: str) -> None:
        """What a reader does between blocks with nothing new: re-place a session whose
        driver went silent, in the background (placing may wait for a target to come back,
        and the reader must go on reading: its reads keep the session from being taken for
        abandoned)."""
        self.followed[session_id] = time.monotonic()
        if session_id in self.replacing:
            return

        async def replace() -> None:
            with contextlib.suppress(*REDIS_DOWN, SpecserveError):
                await self.replace(session_id)

        task = self.replacing[session_id] = asyncio.create_task(replace())
        self.tasks.add(task)

        def done(t: asyncio.Task) -> None:
            self.tasks.discard(t)
            self.replacing.pop(session_id, None)

        task.add_done_callback(done)

    async def reap_forever(self) -> None:
        """Re-place running sessions whose driver went away, so they finish even when no
        client follows them."""
        while True:
            await asyncio.sleep(self.ownership.reap_s)
            now = time.monotonic()
            recent = now - 2 * self.ownership.reap_s
            self.followed = {sid: t for sid, t in self.followed.items() if t >= recent}
            try:
                for session_id in await self.store.orphans():
                    if session_id in self.followed:  # a reader here re-places it, in its request's trace
                        continue
                    with contextlib.suppress(SpecserveError):
                        await self.replace(session_id)
            except REDIS_DOWN:
                pass  # Redis is down: the health check says so; try again next time
            except Exception:
                log.exception("reaper")

    async def cancel(self, session_id: str) -> bool:
        """A client's Cancel: close it in Redis (its driver's next commit is refused, which
        stops it), then tell the driver at once."""
        cancelled = await self.store.cancel(session_id)
        if cancelled:
            with contextlib.suppress(Exception):
                await self.targets.stop(session_id)
        return cancelled
