"""Observers of the round loop (vLLM's SpecDecodingStats -> SpecDecodingProm): each round
leaves one `RoundStats`; Prometheus metrics, the controller's statistics and the round span's
attributes each consume it. The round itself knows none of them."""

from __future__ import annotations

import time
from typing import Protocol

from opentelemetry import trace

from services.router.plan import Run
from specserve.algorithm.round import RoundStats
from specserve.control.controller import Controller
from specserve.drafters.prediction import PREDICTION_POOL
from specserve.serving.metrics import RouterMetrics

# A call's cost outside the worker's compute, capped: beyond a few ms on one network the
# excess is queueing, which is load, not cost (ADR 0006).
TRANSPORT_CAP_MS = 5.0


class RoundObserver(Protocol):
    def started(self, run: Run) -> None: ...

    def round(self, run: Run, r: RoundStats) -> None: ...

    def finished(self, run: Run, reason: str) -> None: ...

    def stopped(self, run: Run) -> None: ...


class _Quiet:
    def started(self, run: Run) -> None:
        return None

    def finished(self, run: Run, reason: str) -> None:
        return None

    def stopped(self, run: Run) -> None:
        return None


class MetricsObserver:
    """DESIGN §6 metrics per (class, pool). A shadow run counts only as active."""

    def __init__(self, metrics: RouterMetrics, kv_bytes_per_token: int) -> None:
        self.m = metrics
        self.kv_bytes_per_token = kv_bytes_per_token

    def started(self, run: Run) -> None:
        (self.m.shadow_active if run.shadow else self.m.sessions_active).labels(*run.labels).inc()

    def stopped(self, run: Run) -> None:
        (self.m.shadow_active if run.shadow else self.m.sessions_active).labels(*run.labels).dec()

    def round(self, run: Run, r: RoundStats) -> None:
        if run.shadow:
            return
        m, labels = self.m, run.labels
        m.target_passes.labels(*labels).inc()
        m.output_tokens.labels(*labels).inc(r.emitted)
        m.verify_latency.labels(*labels).observe(r.verify_wall_ms / 1e3)
        m.round_overhead.labels(*labels).observe(r.overhead_ms / 1e3)
        if r.fallback_reason:
            m.fallbacks.labels(*labels, r.fallback_reason).inc()
        if r.k == 0:
            return
        m.draft_latency.labels(*labels).observe(r.draft_wall_ms / 1e3)
        m.acceptance_length.labels(*labels).observe(r.accepted)
        if r.predraft:
            m.predraft_rounds.labels(*labels, r.predraft).inc()
        for i in range(r.k):
            m.proposed.labels(*labels, str(i)).inc()
            if i < r.accepted:
                m.accepted.labels(*labels, str(i)).inc()
        if r.rejected:
            m.rollback_tokens.labels(*labels).inc(r.rejected)
            m.rejected_kv_bytes.labels(*labels).inc(r.rejected * self.kv_bytes_per_token)

    def finished(self, run: Run, reason: str) -> None:
        if run.shadow:
            return
        m, labels, n = self.m, run.labels, len(run.generated)
        m.requests.labels(*labels, reason).inc()
        if run.first_commit is not None:
            m.ttft.labels(*labels).observe(run.first_commit - run.started)
            if n > 1:
                m.tpot.labels(*labels).observe((time.perf_counter() - run.first_commit) / (n - 1))
        if n:
            m.passes_per_token.labels(*labels).observe(len(run.rounds) / n)


class ControllerFeed(_Quiet):
    """What each round cost, for the controller's per (class, pool) statistics: the workers'
    compute (their queues excluded: a busy node would make every arm look alike), plus the
    calls' capped transport and the commit. A failed Propose counts with 0 accepted and the
    time it wasted, so a pool that times out looks as bad as it is. Shadow runs feed too."""

    def __init__(self, controller: Controller) -> None:
        self.controller = controller

    def round(self, run: Run, r: RoundStats) -> None:
        if run.plan.pool == PREDICTION_POOL:
            return  # a request's own prediction says nothing about the class's pools
        if run.pool is not None and r.k_asked == 0:
            return  # the budget's last token: a plain step that says nothing about the pool
        drafted = run.pool is not None and not r.fallback_reason
        draft_cost = r.draft_ms if drafted else r.draft_wall_ms
        other = r.commit_ms + _transport(r.verify_wall_ms, r.verify_ms) \
            + (_transport(r.draft_wall_ms, r.draft_ms) if drafted else 0.0)
        stats_class, pool = run.stats_labels
        self.controller.record(stats_class, pool, r.k_asked if pool else 0, r.accepted if drafted else 0,
                               draft_cost, r.verify_ms, other)


class SpanObserver(_Quiet):
    """The round's attributes on the `specserve.round` span (the current span while the
    observers run)."""

    def round(self, run: Run, r: RoundStats) -> None:
        span = trace.get_current_span()
        if not span.is_recording():
            return
        span.set_attributes({
            "specserve.workload_class": run.plan.workload_class, "specserve.draft_pool": run.labels[1],
            "specserve.k": r.k, "specserve.num_accepted": r.accepted, "specserve.emitted": r.emitted,
            "specserve.rejected_position": -1 if r.rejected_position is None else r.rejected_position,
            "specserve.fallback_reason": r.fallback_reason, "specserve.draft_ms": r.draft_ms,
            "specserve.verify_ms": r.verify_ms, "specserve.predraft": r.predraft,
            "specserve.draft_wall_ms": r.draft_wall_ms, "specserve.verify_wall_ms": r.verify_wall_ms,
            "specserve.commit_wait_ms": r.commit_ms, "specserve.overhead_ms": r.overhead_ms,
        })


def _transport(wall_ms: float, compute_ms: float) -> float:
    return min(max(wall_ms - compute_ms, 0.0), TRANSPORT_CAP_MS)
