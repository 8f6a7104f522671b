"""Sessions as this router sees them: create one (or join the one a retried `request_id`
created), drive the sessions it owns to their end whether or not a client still reads them,
and take over any session whose owner went silent (ADR 0011).

Ownership is a lease in Redis: the owner renews it every `heartbeat_s`; a router that follows
a session (a retried request_id, a joined stream, a Resume) adopts it as soon as the lease
lapses, and every router's reaper adopts orphaned running sessions from the `running` index.
Adopting bumps the epoch (the old owner's commits are fenced out) and continues from the
committed tokens with the same seed, so the output is what the first owner would have made.
Readers follow Redis, never this object."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass

from services.router.plan import Run, SessionPlan
from services.router.pools import DraftPool, TargetDirectory
from services.router.prediction import PredictionPool
from services.router.rounds import RoundLoop
from services.router.shadow import record_shadow, run_shadow, shadow_of
from specserve.algorithm.stops import IncrementalText, StopChecker
from specserve.control.controller import ShadowLog
from specserve.drafters.prediction import PREDICTION_POOL
from specserve.errors import SessionLost, SessionNotFound, SpecserveError
from specserve.params import GenerationParams
from specserve.serving.metrics import RouterMetrics
from specserve.serving.telemetry import API, tracer
from specserve.state.prefix import CommittedPrefix
from specserve.state.store import REDIS_DOWN, SessionStatus, SessionStore

log = logging.getLogger("specserve.router")


@dataclass(frozen=True)
class Ownership:
    heartbeat_s: float = 1.0  # the owner renews its lease this often (the lease is the store's)
    detached_idle_s: float = 60.0  # a session nobody has read for this long is cancelled
    run_limit_s: float = 3600.0  # how long a run may wait for a target before it fails
    reap_s: float = 2.0  # how often the reaper looks for orphaned running sessions


@dataclass(frozen=True)
class Opened:
    session_id: str
    run: Run | None  # the run this router drives (started already), or None: another router does
    joined: bool  # the request_id named an existing session
    task: asyncio.Task | None = None  # the driving task, when this call started one


class Sessions:
    def __init__(self, store: SessionStore, rounds: RoundLoop, pools: dict[str, DraftPool],
                 targets: TargetDirectory, stops_for: Callable[[GenerationParams], StopChecker], owner: str,
                 shadow_log: ShadowLog, metrics: RouterMetrics, shadow_timeout_s: float,
                 ownership: Ownership = Ownership()) -> None:
        self.store = store
        self.rounds = rounds
        self.pools = pools
        self.targets = targets
        self.stops_for = stops_for
        self.owner = owner
        self.shadow_log = shadow_log
        self.metrics = metrics
        self.shadow_timeout_s = shadow_timeout_s
        self.ownership = ownership
        self.tasks: set[asyncio.Task] = set()
        self.driving: dict[str, asyncio.Task] = {}  # session id -> the task driving it here

    async def open(self, request_id: str | None, prompt_ids: list[int], plan: SessionPlan) -> Opened:
        """Create (and start driving) the session, or join the one `request_id` names, taking
        it over at once if its owner's lease has already lapsed."""
        handle = await self.store.create_or_join(request_id, plan.encode(), prompt_ids, self.owner)
        if handle.created:
            run = self.run_for(handle.session_id, handle.epoch, prompt_ids, plan, [])
            return Opened(handle.session_id, run, False, self.start(run))
        adopted = await self.adopt(handle.session_id)
        return Opened(handle.session_id, adopted[0] if adopted else None, True, adopted[1] if adopted else None)

    async def adopt(self, session_id: str) -> tuple[Run, asyncio.Task] | None:
        """Take the session over iff it runs and its owner's lease has lapsed, and drive it
        from its committed tokens. None when it is not ours to take (or we drive it already)."""
        if session_id in self.driving:
            return None
        epoch = await self.store.adopt(session_id, self.owner)
        if epoch is None:
            return None
        sess = await self.store.get(session_id)
        if sess is None or sess.status is not SessionStatus.RUNNING:
            return None
        generated = await self.store.committed_tokens(session_id)
        log.info("adopted session %s at epoch %d after %d tokens", session_id, epoch, len(generated))
        self.metrics.takeovers.inc()
        run = self.run_for(session_id, epoch, sess.prompt_ids, SessionPlan.decode(sess.params), generated)
        return run, self.start(run)

    async def follow_hook(self, session_id: str) -> None:
        """What a reader does between blocks with nothing new: adopt a silent owner's session."""
        with contextlib.suppress(*REDIS_DOWN, SessionNotFound):
            await self.adopt(session_id)

    async def reap_forever(self) -> None:
        """Adopt running sessions whose owner went away (a crashed router), so they finish
        even when no client follows them."""
        while True:
            await asyncio.sleep(self.ownership.reap_s)
            try:
                for session_id in await self.store.orphans():
                    await self.adopt(session_id)
            except REDIS_DOWN:
                pass  # Redis is down: the health check says so; try again next time
            except Exception:
                log.exception("reaper")

    def start(self, run: Run) -> asyncio.Task:
        """Drive `run` in a task of its own: the client that asked for it may go away."""
        task = self.track(asyncio.create_task(self.drive(run)))
        self.driving[run.session_id] = task
        task.add_done_callback(lambda t: self.driving.pop(run.session_id, None)
                               if self.driving.get(run.session_id) is t else None)
        return task

    def run_for(self, session_id: str, epoch: int, prompt_ids: list[int], plan: SessionPlan, generated: list[int]) -> Run:
        text = IncrementalText(self.stops_for(plan.params))
        text.advance(list(generated), None)  # what earlier owners already published
        return Run(session_id=session_id, epoch=epoch, plan=plan, prompt_len=len(prompt_ids),
                   committed=CommittedPrefix([*prompt_ids, *generated]), text=text,
                   deadline=asyncio.get_running_loop().time() + self.ownership.run_limit_s,
                   pool=self.pool_for(plan, len(prompt_ids)))

    def pool_for(self, plan: SessionPlan, prompt_len: int) -> DraftPool | PredictionPool | None:
        if plan.pool == PREDICTION_POOL:
            return PredictionPool(plan.prediction, prompt_len)
        return self.pools.get(plan.pool) if plan.pool else None

    async def drive(self, run: Run) -> str:
        """The rounds to the end, with the lease renewed beside them. Ends early (reason
        "cancelled") when the heartbeat finds the session closed, taken over, or unread for
        `detached_idle_s`."""
        rounds = asyncio.ensure_future(self._drive(run))
        beat = asyncio.ensure_future(self._heartbeat(run, rounds))
        try:
            return await rounds
        except asyncio.CancelledError:
            if beat.done() and not beat.cancelled() and beat.result():
                return "cancelled"  # stopped by the heartbeat, not by our own shutdown
            raise
        finally:
            beat.cancel()
            if not rounds.done():
                rounds.cancel()

    async def _heartbeat(self, run: Run, rounds: asyncio.Future) -> bool:
        """Renew the lease until the rounds end; True when it stopped them."""
        idle = self.ownership.detached_idle_s
        while not rounds.done():
            await asyncio.sleep(self.ownership.heartbeat_s)
            try:
                status, unread = await self.store.heartbeat(run.session_id, run.epoch)
                if status == "ok" and unread > idle:
                    log.info("session %s unread for %.0f s: cancelled", run.session_id, unread)
                    await self.store.abandon(run.session_id, run.epoch, f"nobody read it for {idle:.0f} s")
                    status = "abandoned"
            except REDIS_DOWN:
                continue  # commits wait for Redis; the lease lapses if it stays away
            if status != "ok":
                rounds.cancel()
                return True
        return False

    async def _drive(self, run: Run) -> str:
        """Rounds under a `specserve.generate` span; a shadow twin beside a plain run whose plan
        says so. Errors close the session as failed (fenced by epoch)."""
        shadow_pool = self.pools.get(run.plan.shadow_pool or "")
        shadow_task = None
        try:
            with tracer().start_as_current_span("specserve.generate") as span:
                span.set_attributes({"specserve.session_id": run.session_id, **run.plan.span_attributes(),
                                     "specserve.draft_pool": run.labels[1], "specserve.api": API.get()})
                if shadow_pool is not None and not run.generated:  # not again after a take-over
                    shadow = shadow_of(run, shadow_pool, self.stops_for, self.shadow_timeout_s)
                    shadow_task = self.track(asyncio.create_task(self._shadow(shadow)))
                reason = await self.rounds.run(run)
                if shadow_task is not None:
                    self.track(asyncio.create_task(record_shadow(run, shadow, shadow_task, self.store,
                                                                 self.shadow_log, self.metrics)))
                    shadow_task = None
                span.set_attributes({"specserve.finish_reason": reason, "specserve.rounds": len(run.rounds),
                                     "specserve.num_accepted": sum(r.accepted for r in run.rounds),
                                     "specserve.emitted": len(run.generated)})
        except asyncio.CancelledError:
            raise  # our shutdown, or the heartbeat stopped it: the session can be taken over
        except SessionLost as exc:
            # Another router took it over (it drives it now), or Redis came back without our
            # last commits: then the session is still ours to continue from what Redis holds.
            log.info("session %s: %s", run.session_id, exc)
            return await self._continue_shorter(run)
        except Exception as exc:
            if isinstance(exc, REDIS_DOWN):
                raise  # nothing can be written; the lease lapses and the session is adopted later
            if not isinstance(exc, SpecserveError):
                log.exception("session %s failed", run.session_id)
            with contextlib.suppress(*REDIS_DOWN):
                await self.store.fail(run.session_id, run.epoch,
                                      str(exc) if isinstance(exc, SpecserveError) else f"{type(exc).__name__}: {exc}")
            raise
        finally:
            if shadow_task is not None:
                shadow_task.cancel()
            self.release_workers(run)
        return reason

    async def _continue_shorter(self, run: Run) -> str:
        """After a refused commit: if the session is still ours (same epoch, still running),
        Redis lost commits we made (a restart inside its fsync window): take it over again and
        drive it on from what Redis holds. Otherwise its new owner drives it: stop."""
        sess = await self.store.get(run.session_id)
        if sess is None or sess.status is not SessionStatus.RUNNING or sess.epoch != run.epoch:
            return "taken_over"
        epoch = await self.store.take_over(run.session_id, self.owner)
        generated = await self.store.committed_tokens(run.session_id)
        log.warning("session %s: Redis holds %d tokens, we had committed %d; continuing from Redis",
                    run.session_id, len(generated), len(run.generated))
        return await self._drive(self.run_for(run.session_id, epoch, sess.prompt_ids,
                                              SessionPlan.decode(sess.params), generated))

    async def _shadow(self, shadow: Run) -> str | None:
        try:
            return await run_shadow(shadow, self.rounds.run, self.shadow_timeout_s)
        finally:
            self.release_workers(shadow)

    def release_workers(self, run: Run) -> None:
        async def release() -> None:
            if run.pool is not None:
                for replica in list(run.draft_held):
                    await run.pool.release(run.session_id, replica)
            await self.targets.release(run.session_id, list(run.target_held))

        self.track(asyncio.create_task(release()))

    def track(self, task: asyncio.Task) -> asyncio.Task:
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task
