"""Shadow mode (ADR 0006): the speculative path runs beside a served plain run, commits
nothing, and whatever happens to it never reaches the served output. Once both finished,
agreement (temperature 0: identical tokens) and the would-be speedup are recorded on the
session and in the per (class, pool) totals."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from services.router.plan import Run
from specserve.algorithm.stops import IncrementalText, StopChecker
from specserve.control.controller import ShadowLog
from specserve.params import GenerationParams
from specserve.serving.metrics import RouterMetrics
from specserve.serving.telemetry import tracer
from specserve.state.prefix import CommittedPrefix
from specserve.state.store import SessionStore

log = logging.getLogger("specserve.router.shadow")


def shadow_of(run: Run, pool, stops_for: Callable[[GenerationParams], StopChecker], timeout_s: float) -> Run:
    """The shadow twin of a served plain run: same plan and prefix, the shadow pool."""
    return Run(session_id=f"{run.session_id}-shadow", epoch=run.epoch, plan=run.plan, prompt_len=run.prompt_len,
               committed=CommittedPrefix(list(run.committed.ids)), text=IncrementalText(stops_for(run.params)),
               deadline=asyncio.get_running_loop().time() + timeout_s, pool=pool, shadow=True)


async def run_shadow(shadow: Run, rounds: Callable[[Run], Awaitable[str]], timeout_s: float) -> str | None:
    """Drive the shadow run; None when it failed or timed out (never raised to the served run)."""
    try:
        with tracer().start_as_current_span("specserve.shadow") as span:
            span.set_attributes({"specserve.session_id": shadow.session_id,
                                 "specserve.workload_class": shadow.plan.workload_class,
                                 "specserve.draft_pool": shadow.labels[1],
                                 "specserve.k": shadow.params.num_draft_tokens})
            return await asyncio.wait_for(rounds(shadow), timeout_s)
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        log.warning("shadow run %s failed: %s", shadow.session_id, exc)
        return None


async def record_shadow(run: Run, shadow: Run, task: asyncio.Task, store: SessionStore, shadow_log: ShadowLog,
                        metrics: RouterMetrics) -> None:
    try:
        result = await task
    except asyncio.CancelledError:
        return
    pool = shadow.labels[1]
    greedy = run.params.sampling.temperature == 0
    served, spec = run.generated, shadow.generated
    if result is None or run.finished is None:
        outcome = "failed"
    elif greedy:
        outcome = "agree" if served == spec and run.finish_reason == shadow.finish_reason else "disagree"
    else:
        outcome = "sampled"
    divergence = next((i for i, (a, b) in enumerate(zip(served, spec, strict=False)) if a != b),
                      None if len(served) == len(spec) else min(len(served), len(spec)))
    plain_s = (run.finished - run.started) if run.finished else 0.0
    shadow_s = (shadow.finished - shadow.started) if shadow.finished else 0.0
    drafted, accepted = sum(r.k for r in shadow.rounds), sum(r.accepted for r in shadow.rounds)
    record: dict[str, Any] = {
        "outcome": outcome, "greedy": greedy, "pool": pool, "k": shadow.params.num_draft_tokens,
        "served_tokens": len(served), "shadow_tokens": len(spec), "first_divergence": divergence,
        "rounds": len(shadow.rounds), "drafted": drafted, "accepted": accepted,
        "acceptance_rate": accepted / max(drafted, 1), "plain_seconds": plain_s, "shadow_seconds": shadow_s,
        "would_be_speedup": plain_s / shadow_s if shadow_s > 0 and plain_s > 0 else 0.0}
    labels = (shadow.stats_labels[0], pool)
    metrics.shadow_requests.labels(*labels, outcome).inc()
    if record["would_be_speedup"]:
        metrics.shadow_speedup.labels(*labels).observe(record["would_be_speedup"])
    if outcome == "disagree":
        log.error("shadow run of %s disagrees with the served output at token %s", run.session_id, divergence)
    try:
        await store.annotate(run.session_id, {"shadow": json.dumps(record)})
        await shadow_log.add(*labels, {
            "requests": 1, {"agree": "agreed", "disagree": "disagreed"}.get(outcome, outcome): 1,
            "rounds": record["rounds"], "drafted": drafted, "accepted": accepted, "tokens": len(spec),
            "plain_seconds": plain_s, "shadow_seconds": shadow_s})
    except Exception as exc:
        log.warning("could not record shadow outcome of %s: %s", run.session_id, exc)
