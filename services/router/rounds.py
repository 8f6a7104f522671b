"""One request's rounds over the wire (DESIGN §3): Propose on a draft replica, Verify on the
target, then commit the emitted tokens to Redis with expected length + epoch + round id.
Only committed tokens are ever published; a failed draft degrades to a plain decode step.

The stages are separate awaitables (`_propose`, `_verify`, `_commit`) so that a later step
can start the next Propose while a Verify is in flight.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import grpc
from opentelemetry.trace import SpanKind

from services.router.pools import DraftPool, TargetDirectory
from specserve.controller import Controller
from specserve.errors import InvalidRequest, SessionLost, Unavailable
from specserve.metrics import RouterMetrics
from specserve.params import GenerationParams
from specserve.prefix import CommittedPrefix
from specserve.stops import IncrementalText, StopChecker
from specserve.store import CommitStatus, SessionStore
from specserve.telemetry import outgoing_metadata, tracer
from specserve.v1 import common_pb2, draft_pb2, generation_pb2, target_pb2
from specserve.wire import prefix_to_proto, sampling_to_proto

log = logging.getLogger("specserve.router.rounds")


@dataclass
class Run:
    """A session as this router drives it."""

    session_id: str
    epoch: int
    prompt_len: int
    params: GenerationParams
    seed: int
    pool: DraftPool | None
    workload_class: str
    committed: CommittedPrefix  # prompt + committed generated tokens
    text: IncrementalText
    deadline: float  # loop time
    draft_held: dict[str, int] = field(default_factory=dict)  # replica -> committed len it holds
    target_held: dict[str, int] = field(default_factory=dict)
    rounds: list[generation_pb2.RoundStats] = field(default_factory=list)
    started: float = field(default_factory=time.perf_counter)
    first_commit: float | None = None
    stats_class: str = ""  # the class its statistics count under ("" = workload_class)
    shadow: bool = False  # a shadow run: speculates beside a plain run, commits nothing
    finished: float | None = None
    finish_reason: str = ""
    stored: dict = field(default_factory=dict)  # the session's stored params and policy choice
    plain_reason: str = ""  # why a run without a pool runs plain (the rounds' fallback_reason)

    @property
    def labels(self) -> tuple[str, str]:
        return self.workload_class, self.pool.name if self.pool else "none"

    @property
    def generated(self) -> list[int]:
        return self.committed.ids[self.prompt_len :]


class RoundLoop:
    def __init__(self, store: SessionStore, targets: TargetDirectory, stops_for, verify_timeout_s: float,
                 target_wait_s: float, metrics: RouterMetrics | None = None, kv_bytes_per_token: int = 0,
                 controller: Controller | None = None) -> None:
        self.store = store
        self.controller = controller
        self.metrics = metrics or RouterMetrics()
        self.kv_bytes_per_token = kv_bytes_per_token
        self.targets = targets
        self.stops_for = stops_for  # GenerationParams -> StopChecker
        self.verify_timeout_s = verify_timeout_s
        self.target_wait_s = target_wait_s
        self._lost: set[str] = set()

    async def run(self, run: Run) -> str:
        """Rounds until a stop; returns the finish reason (eos|length|stop|cancelled)."""
        stops = self.stops_for(run.params)
        m, labels = self.metrics, run.labels
        active = m.shadow_active if run.shadow else m.sessions_active
        active.labels(*labels).inc()
        try:
            while True:
                with tracer().start_as_current_span("specserve.round") as span:
                    reason = await self._round(run, stops)
                    _round_attributes(span, run)
                if reason is not None:
                    run.finished, run.finish_reason = time.perf_counter(), reason
                    if not run.shadow:
                        self._finish(run, reason)
                    return reason
        finally:
            active.labels(*labels).dec()

    async def _round(self, run: Run, stops: StopChecker) -> str | None:
        t0 = time.perf_counter()
        remaining = run.params.max_tokens - len(run.generated)
        k = min(run.params.num_draft_tokens, remaining - 1) if run.pool else 0
        proposal, fallback = None, "" if run.pool else (run.plain_reason or "speculation_off")
        if k > 0 and run.pool is not None:
            with tracer().start_as_current_span("specserve.draft.propose", kind=SpanKind.CLIENT) as span:
                span.set_attribute("specserve.draft_pool", run.pool.name)
                span.set_attribute("specserve.k", k)
                proposal, fallback = await self._propose(run, run.pool, k)
                if fallback:
                    span.set_attribute("specserve.fallback_reason", fallback)
        t1 = time.perf_counter()
        with tracer().start_as_current_span("specserve.target.verify", kind=SpanKind.CLIENT) as span:
            verdict = await self._verify(run, proposal)
            span.set_attribute("specserve.num_accepted", verdict.num_accepted)
        t2 = time.perf_counter()

        before = len(run.generated)
        candidate = run.generated + list(verdict.tokens)
        stop = stops.first_stop(candidate, before)
        reason = None
        if stop is not None:
            candidate, reason = candidate[: stop[0]], stop[1]
        elif len(candidate) >= run.params.max_tokens:
            candidate, reason = candidate[: run.params.max_tokens], "length"
        new_tokens = candidate[before:]
        text = run.text.advance(candidate, reason)
        if run.shadow:  # nothing of a shadow run is ever committed or shown
            status = CommitStatus.OK
        else:
            with tracer().start_as_current_span("specserve.commit", kind=SpanKind.CLIENT):
                status = await self._commit(run, new_tokens, text, reason)
        if status is CommitStatus.CLOSED:
            return "cancelled"
        run.committed.extend(new_tokens)
        if run.first_commit is None:
            run.first_commit = time.perf_counter()
        draft_ms = proposal.draft_ms if proposal else 0.0
        stats = generation_pb2.RoundStats(
            k=len(proposal.tokens) if proposal else 0, accepted=verdict.num_accepted,
            emitted=len(new_tokens), rejected_position=verdict.rejected_position,
            draft_ms=draft_ms, verify_ms=verdict.verify_ms,
            overhead_ms=max((time.perf_counter() - t0) * 1e3 - draft_ms - verdict.verify_ms, 0.0),
            fallback_reason=fallback)
        run.rounds.append(stats)
        if self.controller is not None and (k > 0 or run.pool is None):
            # What the round cost: the workers' compute (their queues excluded: a busy node
            # would otherwise make every arm look alike) plus the calls' transport and the
            # router's own work (commit). A failed Propose counts with 0 accepted and the
            # time it wasted, so a pool that times out looks as bad as it is.
            draft_wall, verify_wall = (t1 - t0) * 1e3, (t2 - t1) * 1e3
            draft_cost = proposal.draft_ms if proposal else draft_wall  # plain: no Propose, ~0
            other = (time.perf_counter() - t2) * 1e3 + _transport(draft_wall, proposal.draft_ms if proposal else None) \
                + _transport(verify_wall, verdict.verify_ms)
            self.controller.record(run.stats_class or run.workload_class, run.pool.name if run.pool else None,
                                   k if run.pool else 0, verdict.num_accepted if proposal else 0, draft_cost,
                                   verdict.verify_ms, other)
        if not run.shadow:
            self._observe(run, stats, t1 - t0 if proposal else None, t2 - t1)
        return reason

    def _observe(self, run: Run, r: generation_pb2.RoundStats, draft_s: float | None, verify_s: float) -> None:
        m, labels = self.metrics, run.labels
        m.target_passes.labels(*labels).inc()
        m.output_tokens.labels(*labels).inc(r.emitted)
        m.verify_latency.labels(*labels).observe(verify_s)
        m.round_overhead.labels(*labels).observe(r.overhead_ms / 1e3)
        if r.fallback_reason:
            m.fallbacks.labels(*labels, r.fallback_reason).inc()
        if draft_s is None or r.k == 0:
            return
        m.draft_latency.labels(*labels).observe(draft_s)
        m.acceptance_length.labels(*labels).observe(r.accepted)
        for i in range(r.k):
            m.proposed.labels(*labels, str(i)).inc()
            if i < r.accepted:
                m.accepted.labels(*labels, str(i)).inc()
        rejected = r.k - r.accepted
        if rejected:
            m.rollback_tokens.labels(*labels).inc(rejected)
            m.rejected_kv_bytes.labels(*labels).inc(rejected * self.kv_bytes_per_token)

    def _finish(self, run: Run, reason: str) -> None:
        m, labels = self.metrics, run.labels
        n = len(run.generated)
        m.requests.labels(*labels, reason).inc()
        if run.first_commit is not None:
            m.ttft.labels(*labels).observe(run.first_commit - run.started)
            if n > 1:
                m.tpot.labels(*labels).observe((time.perf_counter() - run.first_commit) / (n - 1))
        if n:
            m.passes_per_token.labels(*labels).observe(len(run.rounds) / n)

    async def _propose(self, run: Run, pool: DraftPool, k: int) -> tuple[draft_pb2.ProposeResponse | None, str]:
        sampling = sampling_to_proto(run.params.sampling)
        for replica in pool.candidates(run.session_id):
            base = run.draft_held.get(replica.address, 0)
            for _ in range(2):  # the second try resends the full prefix
                req = draft_pb2.ProposeRequest(session_id=run.session_id, prefix=prefix_to_proto(run.committed, base),
                                               k=k, sampling=sampling, seed=run.seed)
                try:
                    resp = await replica.stub.Propose(req, timeout=pool.timeout_s, metadata=outgoing_metadata())
                except grpc.aio.AioRpcError as err:
                    if err.code() == grpc.StatusCode.FAILED_PRECONDITION and base > 0:
                        base = 0
                        continue
                    if err.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                        replica.healthy = False
                    log.warning("draft %s/%s failed: %s", pool.name, replica.address, err.code())
                    run.draft_held.pop(replica.address, None)
                    break
                run.draft_held[replica.address] = len(run.committed)
                return resp, ""
        return None, "draft_unavailable"

    async def _verify(self, run: Run, proposal: draft_pb2.ProposeResponse | None) -> target_pb2.VerifyResponse:
        """Verify on the session's target; on a lost target, rediscover and resend the
        full prefix (re-prefill) until the request's deadline."""
        loop = asyncio.get_running_loop()
        while True:
            wait = max(min(self.target_wait_s, run.deadline - loop.time()), 0.0)
            picked = await self.targets.pick(run.session_id, wait)
            if picked is None:
                raise Unavailable("no target worker is registered; retry later")
            address, stub = picked
            base = run.target_held.get(address, 0)
            req = target_pb2.VerifyRequest(
                session_id=run.session_id, prefix=prefix_to_proto(run.committed, base),
                draft_tokens=proposal.tokens if proposal else [],
                q=proposal.q if proposal else common_pb2.DraftProbs(),
                sampling=sampling_to_proto(run.params.sampling), seed=run.seed)
            timeout = min(self.verify_timeout_s, max(run.deadline - loop.time(), 0.001))
            try:
                resp = await stub.Verify(req, timeout=timeout, metadata=outgoing_metadata())
            except grpc.aio.AioRpcError as err:
                code = err.code()
                if code == grpc.StatusCode.FAILED_PRECONDITION:
                    run.target_held.pop(address, None)
                    continue
                if code == grpc.StatusCode.INVALID_ARGUMENT:
                    raise InvalidRequest(err.details() or "the target refused the request") from err
                if loop.time() >= run.deadline:
                    raise Unavailable(f"target {address} did not answer before the deadline") from err
                # one warning per lost target, not one per retry while Ray restarts it
                (log.debug if address in self._lost else log.warning)(
                    "target %s failed (%s); rediscovering", address, code)
                self._lost.add(address)
                run.target_held.pop(address, None)
                self.targets.forget(address)
                await asyncio.sleep(0.1)
                continue
            run.target_held[address] = len(run.committed)
            return resp

    async def _commit(self, run: Run, tokens: list[int], text: str, reason: str | None) -> CommitStatus:
        expected = len(run.generated)
        result = await self.store.commit(run.session_id, expected, run.epoch, f"{run.epoch}:{expected}",
                                         tokens, text, reason)
        if result.status in (CommitStatus.OK, CommitStatus.DUPLICATE, CommitStatus.CLOSED):
            return result.status
        raise SessionLost(f"session {run.session_id} was taken over or expired ({result.status.value}); "
                          "Resume it to read the rest")


TRANSPORT_CAP_MS = 5.0


def _transport(wall_ms: float, compute_ms: float | None) -> float:
    """A call's cost outside the worker's compute (serialisation, network), capped: beyond a
    few ms on the same network the excess is queueing, which is load, not cost."""
    if compute_ms is None:
        return 0.0
    return min(max(wall_ms - compute_ms, 0.0), TRANSPORT_CAP_MS)


def _round_attributes(span, run: Run) -> None:
    if not run.rounds or not span.is_recording():
        return
    r = run.rounds[-1]
    span.set_attributes({
        "specserve.workload_class": run.workload_class,
        "specserve.draft_pool": run.pool.name if run.pool else "none",
        "specserve.k": r.k, "specserve.num_accepted": r.accepted, "specserve.emitted": r.emitted,
        "specserve.rejected_position": r.rejected_position,
        "specserve.fallback_reason": r.fallback_reason,
        "specserve.draft_ms": r.draft_ms, "specserve.verify_ms": r.verify_ms,
    })
