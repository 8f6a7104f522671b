"""The target's account of its rounds and requests (the host's metrics, the controller's
statistics, the round spans): what `LoopHost` (services/target/loop_host.py) hands each round
and each finished request to, on the event loop. Nothing here changes a session."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from opentelemetry import trace

from specserve.algorithm.round import RoundStats
from specserve.control.controller import Controller
from specserve.drafters.prediction import PREDICTION_POOL
from specserve.engine.loop import NOT_PAYING, StepReport
from specserve.engine.session import EnginePlan, EngineSession
from specserve.serving.metrics import RoundMetrics, WorkerMetrics
from specserve.serving.telemetry import tracer


@dataclass
class Driven:
    """A session as the event loop side knows it."""

    epoch: int
    plan: EnginePlan
    span: Any  # the session's `specserve.engine.session` span
    started: float  # perf_counter at Start
    first_round: float | None = None
    resumed_after: int = 0  # committed tokens it continued after
    shadow_of: str | None = None  # a twin: the served session's id
    ended: EngineSession | None = None  # the engine's session, once it ended
    ended_at: float = 0.0


class RoundTelemetry:
    def __init__(self, metrics: RoundMetrics, controller: Controller | None, kv_bytes_per_token: int) -> None:
        self.metrics = metrics
        self.controller = controller
        self.kv_bytes_per_token = kv_bytes_per_token
        # (class, pool, adapter) -> the every-round series' children: `labels()` is a locked lookup
        # a call, and every round of every step paid four (ADR 0028)
        self._every: dict[tuple[str, str, str], tuple[Any, Any, Any, Any]] = {}

    def count(self, plan: EnginePlan, r: RoundStats) -> None:
        m, labels = self.metrics, plan.labels
        every = self._every.get(labels)
        if every is None:
            every = self._every[labels] = (m.target_passes.labels(*labels), m.output_tokens.labels(*labels),
                                           m.verify_latency.labels(*labels), m.round_overhead.labels(*labels))
        passes, tokens, verify, overhead = every
        passes.inc()
        tokens.inc(r.emitted)
        verify.observe(r.verify_ms / 1e3)
        overhead.observe(r.overhead_ms / 1e3)
        if r.fallback_reason:
            m.fallbacks.labels(*labels, r.fallback_reason).inc()
        if r.k == 0:
            return
        m.draft_latency.labels(*labels).observe(r.draft_ms / 1e3)
        m.accepted_drafts.labels(*labels).observe(r.accepted)
        m.tree_size.labels(*labels).observe(r.tree_size)
        if r.feature_bytes:
            m.feature_bytes.labels(*labels).inc(r.feature_bytes)
        if r.predraft:
            m.predraft_rounds.labels(*labels, r.predraft).inc()
        for i in range(r.k):
            m.proposed.labels(*labels, str(i)).inc()
            if i < r.accepted:
                m.accepted.labels(*labels, str(i)).inc()
        if r.rejected:
            m.rollback_tokens.labels(*labels).inc(r.rejected)
            m.rejected_kv_bytes.labels(*labels).inc(r.rejected * self.kv_bytes_per_token)

    def feed_controller(self, plan: EnginePlan, r: RoundStats) -> None:
        """What the round cost, for the controller's per (class, pool) statistics: the step
        it ran in (the batch cost at this load), its draft compute and the engine's own
        Python. A round that asked for drafts and got none counts with 0 accepted."""
        if self.controller is None or plan.pool == PREDICTION_POOL:
            return  # a request's own prediction says nothing about the class's pools
        if plan.pool and r.k_asked == 0:
            # held plain by the engine (counted against its pool: Estimate.realized), or the
            # budget's last token: nothing about the pool's drafts
            if r.fallback_reason == NOT_PAYING:
                self.controller.record_held(plan.stats_class or plan.workload_class, plan.pool)
            return
        drafted = bool(plan.pool) and not r.fallback_reason
        self.controller.record(plan.stats_class or plan.workload_class, plan.pool, r.k_asked if plan.pool else 0,
                               r.accepted if drafted else 0, r.draft_ms, r.verify_ms, r.overhead_ms, r.wait_ms)

    @staticmethod
    def round_span(d: Driven, session: EngineSession, r: RoundStats, at: float, prefix_len: int) -> None:
        if not d.span.is_recording():
            return
        end = time.time_ns() - int((time.perf_counter() - at) * 1e9)
        start = end - int((r.verify_ms + r.overhead_ms) * 1e6)
        span = tracer().start_span("specserve.round", context=trace.set_span_in_context(d.span), start_time=start)
        span.set_attributes({
            "specserve.workload_class": session.plan.workload_class, "specserve.draft_pool": session.plan.labels[1],
            "specserve.k": r.k, "specserve.num_accepted": r.accepted, "specserve.emitted": r.emitted,
            "specserve.rejected_position": -1 if r.rejected_position is None else r.rejected_position,
            "specserve.fallback_reason": r.fallback_reason, "specserve.draft_ms": r.draft_ms,
            "specserve.verify_ms": r.verify_ms, "specserve.predraft": r.predraft,
            "specserve.overhead_ms": r.overhead_ms, "specserve.prefix_len": prefix_len,
            # a token tree's shape (ADR 0020): its drafts and depth (k); 0 for a chain
            "specserve.tree_size": r.tree_size, "specserve.feature_bytes": r.feature_bytes,
            "specserve.probe": r.probe})
        span.end(end_time=end)

    def count_request(self, d: Driven, s: EngineSession) -> None:
        m, labels, n = self.metrics, s.plan.labels, s.n_generated
        m.requests.labels(*labels, s.finish_reason or "").inc()
        if d.first_round is not None:
            m.ttft.labels(*labels).observe(d.first_round - d.started)
            if n > 1:
                m.tpot.labels(*labels).observe((d.ended_at - d.first_round) / (n - 1))
        if n:
            m.passes_per_token.labels(*labels).observe(len(s.rounds) / n)


def worker_step(m: WorkerMetrics, report: StepReport, model: Any) -> None:
    """An engine step in the target worker's metrics: the device's busy time (the step's
    forward, padded to a simulated device's time; a lookahead step's own device time), the
    batch, the KV slots of a batched runner and its device step's counters."""
    m.busy.add(report.busy_ms / 1e3)
    m.batch_size.observe(report.rows)
    m.call_latency.labels("step").observe(report.forward_ms / 1e3)
    m.step_cpu.labels("forward").inc(report.forward_cpu_ms / 1e3)
    m.step_cpu.labels("engine").inc(report.bookkeeping_cpu_ms / 1e3)
    slots = getattr(model, "slots", None)  # the batched runner's KV (not the HF path)
    if slots is not None:
        used, free = slots
        m.kv_slots.labels("used").set(used)
        m.kv_slots.labels("free").set(free)
    m.device_step(getattr(getattr(model, "runner", None), "device_step", None))
