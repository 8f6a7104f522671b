"""Sessions as this router sees them: create one (or join the one a retried `request_id`
created), take over a session whose owner went silent, and drive the sessions it owns to
their end (rounds, shadow twin, worker release). Readers follow Redis, never this object."""

from __future__ import annotations

import asyncio
import logging
import time
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
from specserve.errors import SpecserveError
from specserve.params import GenerationParams
from specserve.serving.metrics import RouterMetrics
from specserve.serving.telemetry import API, tracer
from specserve.state.prefix import CommittedPrefix
from specserve.state.store import SessionStatus, SessionStore

log = logging.getLogger("specserve.router")

OWNER_LEASE_S = 15.0  # a running session not updated for this long has lost its router


@dataclass(frozen=True)
class Opened:
    session_id: str
    run: Run | None  # the run to drive, or None: follow the owner's committed stream
    joined: bool  # the request_id named an existing session


class Sessions:
    def __init__(self, store: SessionStore, rounds: RoundLoop, pools: dict[str, DraftPool],
                 targets: TargetDirectory, stops_for: Callable[[GenerationParams], StopChecker], owner: str,
                 shadow_log: ShadowLog, metrics: RouterMetrics, shadow_timeout_s: float) -> None:
        self.store = store
        self.rounds = rounds
        self.pools = pools
        self.targets = targets
        self.stops_for = stops_for
        self.owner = owner
        self.shadow_log = shadow_log
        self.metrics = metrics
        self.shadow_timeout_s = shadow_timeout_s
        self.tasks: set[asyncio.Task] = set()

    async def open(self, request_id: str | None, prompt_ids: list[int], plan: SessionPlan,
                   deadline: float) -> Opened:
        handle = await self.store.create_or_join(request_id, plan.encode(), prompt_ids, self.owner)
        if handle.created:
            return Opened(handle.session_id, self.run_for(handle.session_id, handle.epoch, prompt_ids, plan, [],
                                                          deadline), False)
        sess = await self.store.get(handle.session_id)
        if sess is not None and sess.status is SessionStatus.RUNNING and time.time() - sess.updated > OWNER_LEASE_S:
            epoch = await self.store.take_over(handle.session_id, self.owner)  # its router is gone
            generated = await self.store.committed_tokens(handle.session_id)
            run = self.run_for(handle.session_id, epoch, sess.prompt_ids, SessionPlan.decode(sess.params), generated,
                               deadline)
            return Opened(handle.session_id, run, True)
        return Opened(handle.session_id, None, True)

    def run_for(self, session_id: str, epoch: int, prompt_ids: list[int], plan: SessionPlan, generated: list[int],
                deadline: float) -> Run:
        text = IncrementalText(self.stops_for(plan.params))
        text.advance(list(generated), None)  # what earlier owners already published
        return Run(session_id=session_id, epoch=epoch, plan=plan, prompt_len=len(prompt_ids),
                   committed=CommittedPrefix([*prompt_ids, *generated]), text=text, deadline=deadline,
                   pool=self.pool_for(plan, len(prompt_ids)))

    def pool_for(self, plan: SessionPlan, prompt_len: int) -> DraftPool | PredictionPool | None:
        if plan.pool == PREDICTION_POOL:
            return PredictionPool(plan.prediction, prompt_len)
        return self.pools.get(plan.pool) if plan.pool else None

    async def drive(self, run: Run) -> str:
        """Rounds to the end under a `specserve.generate` span; a shadow twin beside a plain
        run whose plan says so. Errors close the session as failed (fenced by epoch)."""
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
            raise  # the client went away: the session stays running and can be taken over
        except Exception as exc:
            if not isinstance(exc, SpecserveError):
                log.exception("session %s failed", run.session_id)
            await self.store.fail(run.session_id, run.epoch,
                                  str(exc) if isinstance(exc, SpecserveError) else f"{type(exc).__name__}: {exc}")
            raise
        finally:
            if shadow_task is not None:
                shadow_task.cancel()
        self.release_workers(run)
        return reason

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
