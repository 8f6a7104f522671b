"""Shadow mode on the target (ADR 0006): a plain session whose plan names a shadow pool gets a
speculative twin that commits nothing; when both ended, their agreement is recorded here."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

from specserve.control.controller import ShadowLog
from specserve.engine.session import EngineSession, Status
from specserve.services.target.accounting import Driven
from specserve.serving.metrics import RoundMetrics, split_class
from specserve.state.store import SessionStore

log = logging.getLogger("specserve.target")

SHADOW_SUFFIX = "-shadow"  # a twin's session id: the served session's and this


def twins_ended(driving: dict[str, Driven], session: EngineSession,
                cancel: Callable[[str, str], None]) -> tuple[Driven, Driven] | None:
    """After `session` ended: (served, twin) once both of a shadow pair have ended (both then
    leave `driving`), else None. A session without a twin leaves `driving` at once; a served
    session that ended other than finished cancels its running twin (nothing left to compare)."""
    served_id = driving[session.id].shadow_of or session.id
    twin_id = served_id + SHADOW_SUFFIX
    served, twin = driving.get(served_id), driving.get(twin_id)
    if twin is None:
        driving.pop(session.id, None)
        return None
    if session.id == served_id and session.status is not Status.FINISHED and twin.ended is None:
        cancel(twin_id, "served_session_ended")
    if served is None or served.ended is None or twin.ended is None:
        return None  # the other one is still running
    driving.pop(served_id, None)
    driving.pop(twin_id, None)
    return served, twin


async def record_shadow(served: Driven, twin: Driven, metrics: RoundMetrics, store: SessionStore,
                        shadow_log: ShadowLog | None) -> None:
    """A served session and its shadow twin both ended: their agreement (greedy: the same
    tokens and finish), where they first diverged and the would-be speedup, to the metrics,
    the session's record in Redis and the controller's shadow log (ADR 0006)."""
    run, shadow = served.ended, twin.ended
    assert run is not None and shadow is not None
    greedy = run.plan.params.sampling.temperature == 0
    a, b = run.generated, shadow.generated
    if run.status is not Status.FINISHED or shadow.status is not Status.FINISHED:
        outcome = "failed"
    elif greedy:
        outcome = "agree" if a == b and run.finish_reason == shadow.finish_reason else "disagree"
    else:
        outcome = "sampled"
    divergence = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                      None if len(a) == len(b) else min(len(a), len(b)))
    plain_s, shadow_s = served.ended_at - served.started, twin.ended_at - twin.started
    drafted, accepted = sum(r.k for r in shadow.rounds), sum(r.accepted for r in shadow.rounds)
    record: dict[str, Any] = {
        "outcome": outcome, "greedy": greedy, "pool": shadow.plan.pool, "k": shadow.plan.k,
        "served_tokens": len(a), "shadow_tokens": len(b), "first_divergence": divergence,
        "rounds": len(shadow.rounds), "drafted": drafted, "accepted": accepted,
        "acceptance_rate": accepted / max(drafted, 1), "plain_seconds": plain_s, "shadow_seconds": shadow_s,
        "would_be_speedup": plain_s / shadow_s if shadow_s > 0 and plain_s > 0 else 0.0}
    labels = (shadow.plan.stats_class or shadow.plan.workload_class, shadow.plan.pool or "none")
    metric_labels = (split_class(labels[0])[0], labels[1], shadow.plan.adapter_label)  # (ADR 0029)
    metrics.shadow_requests.labels(*metric_labels, outcome).inc()
    if record["would_be_speedup"]:
        metrics.shadow_speedup.labels(*metric_labels).observe(record["would_be_speedup"])
    if outcome == "disagree":
        log.error("shadow twin of %s disagrees with the served output at token %s", run.id, divergence)
    try:
        await store.annotate(run.id, {"shadow": json.dumps(record)})
        if shadow_log is not None:
            await shadow_log.add(*labels, {
                "requests": 1, {"agree": "agreed", "disagree": "disagreed"}.get(outcome, outcome): 1,
                "rounds": record["rounds"], "drafted": drafted, "accepted": accepted, "tokens": len(b),
                "plain_seconds": plain_s, "shadow_seconds": shadow_s})
    except Exception as exc:
        log.warning("could not record the shadow outcome of %s: %s", run.id, exc)
