"""The target worker's engine (ADR 0014): the engine loop on a thread of its own, with its
committer and draft pools on the worker's event loop, and the sessions this incarnation drives.

`start(session_id)` claims a session the router created. It bumps the epoch with this
incarnation as the owner, so any earlier driver is fenced out. Then it continues the
session after its committed tokens. The session joins this target's index in Redis
(`{p}:target:{name}:sessions`). After a restart, the new incarnation adopts every running
session in its index the same way (`adopt_mine`): a kill costs a re-prefill, never wrong
output, because randomness is keyed by (seed, position, purpose).

Beside the loop, on the event loop:
- a heartbeat renews the driver's lease of every session it drives (one pipeline), so a
  router re-places a session whose target died for good; it stops a session that was
  closed or taken over, and cancels one nobody has read for `detached_idle_s`;
- each step's rounds feed the Prometheus metrics, the controller's statistics and one
  `specserve.round` span each (children of the session's `specserve.engine.session` span,
  itself a child of the router's Start call: one request is one trace);
- shadow mode: a plain session whose plan names a shadow pool gets a speculative twin that
  commits nothing; when both ended, their agreement is recorded (ADR 0006).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import Executor, Future
from dataclasses import replace
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace

from specserve.algorithm.round import RoundStats
from specserve.algorithm.stops import StopChecker
from specserve.control.controller import Controller, ShadowLog
from specserve.drafters.prediction import PREDICTION_POOL
from specserve.engine.committer import RedisCommitter
from specserve.engine.drafting import DraftSource, PredictionDrafts
from specserve.engine.loop import EngineLoop, StepReport
from specserve.engine.scheduler import Budget
from specserve.engine.session import EnginePlan, EngineSession, Status
from specserve.engine.speculation import SpeculationSettings
from specserve.errors import ResourceExhausted, SessionClosed, SessionNotFound
from specserve.params import GenerationParams
from specserve.services.target.accounting import Driven, RoundTelemetry, worker_step
from specserve.services.target.adapters import TargetAdapters
from specserve.services.target.shadow import SHADOW_SUFFIX, record_shadow, twins_ended
from specserve.serving.metrics import AdapterLabels, RoundMetrics, WorkerMetrics
from specserve.serving.telemetry import tracer
from specserve.state.store import REDIS_DOWN, CommitStatus, SessionStatus, SessionStore, ride_out
from specserve.step import ModelStep
from specserve.structured.constraint import Constraint
from specserve.worker import threads

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


def _retrieved(task: asyncio.Task) -> None:
    """A start's task is done: its error was the caller's (raised to it), or nobody's when the
    caller had given up; either way asyncio need not report it as never retrieved."""
    if not task.cancelled():
        task.exception()


class LoopHost:
    def __init__(self, model: ModelStep, stops_for: Callable[[GenerationParams], StopChecker], store: SessionStore,
                 name: str, sources: Mapping[str, DraftSource], loop: asyncio.AbstractEventLoop,
                 budget: Budget | None = None, speculation: SpeculationSettings | None = None,
                 redis_outage_s: float = 30.0,
                 simulated_step_ms: float = 0.0, simulated_row_ms: float = 0.0, metrics: RoundMetrics | None = None,
                 controller: Controller | None = None, shadow_log: ShadowLog | None = None,
                 kv_bytes_per_token: int = 0, heartbeat_s: float = 1.0, detached_idle_s: float = 60.0,
                 on_no_room: Callable[[], None] = lambda: None, worker_metrics: WorkerMetrics | None = None,
                 constrain: Callable[[Constraint], Any] | None = None, model_thread: Executor | None = None,
                 on_loop_failure: Callable[[BaseException], None] = lambda exc: None) -> None:
        self.store = store
        self.worker_metrics = worker_metrics  # the target worker's: engine steps (method "step") and their rows
        self.name = name
        self.incarnation = f"{name}:{uuid.uuid4().hex[:12]}"  # one life of this process
        self.index = SessionIndex(store, name)
        self.loop = loop
        self.metrics = metrics or RoundMetrics()
        self.telemetry = RoundTelemetry(self.metrics, controller, kv_bytes_per_token)
        self.shadow_log = shadow_log
        self.heartbeat_s = heartbeat_s
        self.detached_idle_s = detached_idle_s
        self.on_no_room = on_no_room  # a Start refused for want of KV room (the refused-sessions counter)
        # the engine loop failed: every session here stalls with it (the target worker exits,
        # so that Ray restarts it and the next incarnation adopts them)
        self.on_loop_failure = on_loop_failure
        self.committer = RedisCommitter(store, loop, self._refused, redis_outage_s)
        sources = {PREDICTION_POOL: PredictionDrafts(), **sources}
        self.carriers: dict[str, dict[str, str]] = {}  # session -> its span's context, for the draft links
        for source in sources.values():
            if hasattr(source, "carrier_for"):
                source.carrier_for = lambda sid: self.carriers.get(sid, {})
        self.engine = EngineLoop(model, stops_for, sources, self.committer, observers=[self], budget=budget,
                                 speculation=speculation,
                                 simulated_step_ms=_simulated(simulated_step_ms, simulated_row_ms),
                                 on_step=self._on_step, summarize=lambda s: run_summary(self.incarnation, s),
                                 constrain=constrain)
        self.committer.on_acked = self.engine.acked
        self.adapters, self.adapter_labels = TargetAdapters(self.engine, name), AdapterLabels()  # (ADR 0029)
        self.committer.on_wake = self._drain_rounds  # (one wake of the event loop a step, with the commits)
        self.driving: dict[str, Driven] = {}  # event-loop side: the sessions this incarnation drives
        self._starting: dict[str, asyncio.Lock] = {}
        self._rounds: deque[tuple[EngineSession, RoundStats, float, int]] = deque()  # loop thread -> event loop
        self._stop = threading.Event()
        # the engine loop runs on the thread that loaded and warmed the model (worker/threads.py)
        self.model_thread = model_thread or threads.ModelThread("engine")
        self._running: Future | None = None
        self._tasks: list[asyncio.Task] = []

    def start_loop(self) -> LoopHost:
        self.committer.start()
        self._running = self.model_thread.submit(self.engine.run_forever, self._stop)
        self._running.add_done_callback(self._loop_ended)
        self._tasks.append(self.loop.create_task(self._heartbeat_forever()))
        return self

    def _loop_ended(self, done: Future) -> None:
        """The engine loop's call on the model thread ended: log why if it failed (nothing else
        would: no one awaits it until `close`) and hand the failure on."""
        if not done.cancelled() and (exc := done.exception()) is not None:
            log.error("the engine loop stopped: %r", exc, exc_info=exc)
            self.on_loop_failure(exc)

    @property
    def started(self) -> bool:
        return self._running is not None and not self._running.done()

    @property
    def load(self) -> int:
        """Sessions driven here now (the registry publishes it: routers place by it)."""
        return sum(1 for d in self.driving.values() if d.ended is None and d.shadow_of is None)

    async def close(self) -> None:
        self._stop.set()
        self.engine.wake()
        for t in self._tasks:
            t.cancel()
        if self._running is not None:  # (an engine loop that failed was logged when it did)
            await asyncio.wait([asyncio.wrap_future(self._running)], timeout=10)
        await self.committer.stop()

    async def start(self, session_id: str) -> tuple[int, int]:
        """Drive the session from its committed tokens: (epoch, committed generated tokens).
        A session this incarnation drives already is left as it is.

        A caller that gives up (its Start RPC cancelled: the router calling it was killed)
        does not stop a start under way: the start runs in a task of its own to the end, and
        the session is driven as if the call had returned (the client's retry, through
        another router, finds it driven). Cut off half way, it would leave the engine
        opening a session nobody drives."""
        task = asyncio.get_running_loop().create_task(self._start_one(session_id))
        task.add_done_callback(_retrieved)
        return await asyncio.shield(task)

    async def _start_one(self, session_id: str) -> tuple[int, int]:
        lock = self._starting.setdefault(session_id, asyncio.Lock())
        try:
            async with lock:  # one start at a time per session (adopt_mine and a router's Start race)
                return await self._start(session_id)
        finally:
            if not lock.locked():
                self._starting.pop(session_id, None)

    async def _start(self, session_id: str) -> tuple[int, int]:
        if (d := self.driving.get(session_id)) is not None and d.ended is None:
            return d.epoch, d.resumed_after
        info = await self.store.get(session_id)
        if info is None:
            raise SessionNotFound(f"session {session_id} does not exist or expired")
        if info.status is not SessionStatus.RUNNING:
            raise SessionClosed(f"session {session_id} is {info.status.value}: nothing to drive")
        plan = EnginePlan.from_stored(info.params)
        plan = replace(plan, adapter_label=self.adapter_labels.label(plan.adapter))  # (ADR 0029: bounded)
        if plan.constraint is not None and self.engine.constrain is not None:
            # compile the constraint here, on a thread of its own: the engine thread (every
            # session's steps) and this event loop (the draft links, the commits) would stall
            # for it; the engine's own call then finds it in the compiler's cache
            await asyncio.to_thread(self.engine.constrain, plan.constraint)
        epoch = await self.store.take_over(session_id, self.incarnation)
        generated = await self.store.committed_tokens(session_id)
        await self.index.add(session_id)
        span = tracer().start_span("specserve.engine.session", context=otel_context.get_current())
        span.set_attributes({"specserve.session_id": session_id, "specserve.target": self.incarnation,
                             "specserve.workload_class": plan.workload_class,
                             "specserve.draft_pool": plan.labels[1], "specserve.epoch": epoch,
                             "specserve.resumed_after": len(generated)})
        self.driving[session_id] = Driven(epoch, plan, span, time.perf_counter(), resumed_after=len(generated))
        self.carriers[session_id] = _carrier_of(span)
        try:
            with trace.use_span(span, end_on_exit=False):  # the draft links' opens join this trace
                await asyncio.wrap_future(self.engine.add(session_id, info.prompt_ids, plan, generated, epoch))
        except BaseException as exc:
            self.driving.pop(session_id, None)
            self.carriers.pop(session_id, None)
            span.record_exception(exc)
            span.end()
            await self.index.remove(session_id)
            if isinstance(exc, ResourceExhausted):
                self.on_no_room()
            raise
        self.metrics.sessions_active.labels(*plan.labels).inc()
        if plan.shadow_pool and not generated:  # the twin, once: not again after an adoption
            await self._start_shadow(session_id, info.prompt_ids, plan, epoch, span)
        return epoch, len(generated)

    async def _start_shadow(self, session_id: str, prompt_ids: list[int], plan: EnginePlan, epoch: int,
                            parent: Any) -> None:
        twin_id = session_id + SHADOW_SUFFIX
        # (a twin commits nothing: its drafts never outrank a served session's, ADR 0021)
        twin = replace(plan, pool=plan.shadow_pool, shadow=True, shadow_pool=None, draft_priority=0)
        span = tracer().start_span("specserve.shadow", context=trace.set_span_in_context(parent))
        span.set_attributes({"specserve.session_id": twin_id, "specserve.workload_class": plan.workload_class,
                             "specserve.draft_pool": twin.labels[1], "specserve.k": twin.k})
        self.driving[twin_id] = Driven(epoch, twin, span, time.perf_counter(), shadow_of=session_id)
        self.carriers[twin_id] = _carrier_of(span)
        try:
            with trace.use_span(span, end_on_exit=False):
                await asyncio.wrap_future(self.engine.add(twin_id, prompt_ids, twin, (), epoch))
        except Exception as exc:  # never the served session's problem
            log.warning("shadow twin of %s did not start: %s", session_id, exc)
            self.driving.pop(twin_id, None)
            span.end()
            return
        self.metrics.shadow_active.labels(*twin.labels).inc()

    def stop(self, session_id: str) -> bool:
        driving = session_id in self.driving
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

    # ---- the loop thread: observer, step hook, summary, and the committer's refusals ----
    def round(self, session: EngineSession, stats: RoundStats) -> None:
        self._rounds.append((session, stats, time.perf_counter(), len(session.committed) - stats.emitted))

    def finished(self, session: EngineSession) -> None:
        self.loop.call_soon_threadsafe(self._ended, session, time.perf_counter())

    def _on_step(self, report: StepReport) -> None:
        if self.worker_metrics is not None:
            if report.rows:
                worker_step(self.worker_metrics, report, self.engine.model)
            self.worker_metrics.queue_depth.set(report.unseated)  # the sessions waiting for a seat (ADR 0021)
        self.committer.kick()  # -> _drain_rounds on the event loop, with the step's commits

    def _refused(self, session_id: str, why: str) -> None:
        self.engine.cancel(session_id, why)

    # ---- the event loop ----
    def _drain_rounds(self) -> None:
        for (cls, pool), estimates in list(self.engine.speculation.estimates.items()):  # written by the engine thread
            c, adapter = self.adapter_labels.of_class(cls)
            for k, s in list(estimates.items()):
                self.metrics.arm_estimate.labels(c, pool or "none", adapter, str(k)).set(s)
        while self._rounds:
            session, stats, at, prefix_len = self._rounds.popleft()
            d = self.driving.get(session.id)
            if d is None:
                continue
            if d.first_round is None:
                d.first_round = at
            if not session.plan.shadow:
                self.telemetry.count(session.plan, stats)
            self.telemetry.feed_controller(session.plan, stats)
            self.telemetry.round_span(d, session, stats, at, prefix_len)

    def _ended(self, session: EngineSession, at: float) -> None:
        self._drain_rounds()  # its last rounds first
        d = self.driving.get(session.id)
        if d is None or d.ended is not None or d.epoch != session.epoch:
            return  # not this run's (a run superseded by a newer start of the session)
        d.ended, d.ended_at = session, at
        self.carriers.pop(session.id, None)
        plan = session.plan
        d.span.set_attributes({"specserve.finish_reason": session.finish_reason or "",
                               "specserve.rounds": len(session.rounds),
                               "specserve.num_accepted": sum(r.accepted for r in session.rounds),
                               "specserve.emitted": session.n_generated})
        if session.error:
            d.span.set_status(trace.Status(trace.StatusCode.ERROR, session.error))
        d.span.end()
        if plan.shadow:
            self.metrics.shadow_active.labels(*plan.labels).dec()
        else:
            self.metrics.sessions_active.labels(*plan.labels).dec()
            if session.status is Status.FINISHED:
                self.telemetry.count_request(d, session)
            if session.status is Status.FAILED:
                asyncio.ensure_future(self._fail(session.id, d.epoch, session.error))
        # Only an end of its own leaves the index: a session refused because another
        # incarnation claimed it stays there for that one (a stale entry is dropped by
        # adopt_mine, which finds it no longer running).
        if session.status in (Status.FINISHED, Status.FAILED) and not plan.shadow:
            asyncio.ensure_future(self._unindex(session.id))
        if session.finish_reason == CommitStatus.STALE_LEN.value and not plan.shadow:
            asyncio.ensure_future(self._redrive(session.id))
        if (pair := twins_ended(self.driving, session, self.engine.cancel)) is not None:
            asyncio.ensure_future(record_shadow(*pair, self.metrics, self.store, self.shadow_log))

    async def _redrive(self, session_id: str) -> None:
        """Redis came back shorter than this driver's commits (a restart's lost second, or a
        failover's unreplicated tail): still this driver's (a commit refused as STALE_LEN passed
        the epoch fence), so it takes the session again at once and drives on from what Redis
        holds (ADR 0011, 0023), rather than leaving it to a reaper once its lease lapses."""
        try:
            await ride_out(lambda: self.start(session_id), self.committer.outage_s)
            log.info("session %s driven again from the commits Redis holds", session_id)
        except (SessionNotFound, SessionClosed):
            pass
        except Exception:
            log.exception("driving session %s again after a shorter Redis", session_id)

    async def _fail(self, session_id: str, epoch: int, error: str) -> None:
        with contextlib.suppress(*REDIS_DOWN):
            await self.store.fail(session_id, epoch, error or "the engine failed")

    async def _unindex(self, session_id: str) -> None:
        with contextlib.suppress(*REDIS_DOWN):
            await self.index.remove(session_id)

    async def _heartbeat_forever(self) -> None:
        """Renew the lease of every session driven here; stop those closed or taken over,
        cancel those nobody has read for `detached_idle_s`."""
        while True:
            await asyncio.sleep(self.heartbeat_s)
            try:
                await self._heartbeat()
            except REDIS_DOWN:
                continue  # commits ride the outage; the lease lapses if it stays away
            except Exception:
                log.exception("engine heartbeat")

    async def _heartbeat(self) -> None:
        live = [(sid, d.epoch) for sid, d in self.driving.items() if d.ended is None and d.shadow_of is None]
        if not live:
            return
        replies = await self.store.heartbeats(live)
        for (sid, epoch), (status, unread) in zip(live, replies, strict=True):
            if status == "ok" and unread > self.detached_idle_s:
                log.info("session %s unread for %.0f s: cancelled", sid, unread)
                await self.store.abandon(sid, epoch, f"nobody read it for {self.detached_idle_s:.0f} s")
                status = "abandoned"
            if status != "ok":
                self.engine.cancel(sid, status)
                self.engine.cancel(sid + SHADOW_SUFFIX, status)


def _simulated(pass_ms: float, row_ms: float) -> Callable[[Any, Any], float] | None:
    """A simulated device's step time (benchmarks, tests): a pass, and more a row; None: off."""
    if not pass_ms and not row_ms:
        return None
    return lambda step, out: pass_ms + row_ms * len(step.rows)


def _carrier_of(span: Any) -> dict[str, str]:
    from opentelemetry import propagate

    out: dict[str, str] = {}
    propagate.inject(out, context=trace.set_span_in_context(span))
    return out


def run_summary(incarnation: str, session: EngineSession) -> str:
    """The run's statistics, stored with its last commit (the router's GenerationStats)."""
    return json.dumps({"target": incarnation, "rounds": [
        [r.k, r.accepted, r.emitted, -1 if r.rejected_position is None else r.rejected_position,
         round(r.draft_ms, 3), round(r.verify_ms, 3), round(r.overhead_ms, 3), r.fallback_reason, r.predraft,
         r.k_asked, int(r.probe)] for r in session.rounds]}, separators=(",", ":"))
