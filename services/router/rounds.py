"""One request's rounds over the wire (DESIGN §3): propose on a draft replica, verify on the
target, settle (stops and budget), commit to Redis fenced by expected length + epoch + round
id, then hand the round's one `RoundStats` record to the observers. Only committed tokens
are ever published; a failed draft degrades to a plain decode step. A round's commit runs
while the next round drafts and verifies (ADR 0010)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence

from opentelemetry.trace import SpanKind

from services.router.observers import RoundObserver
from services.router.plan import Run
from services.router.pools import Drafted, TargetDirectory
from specserve.algorithm.round import RoundStats, Settled, draft_budget, settle
from specserve.algorithm.stops import IncrementalText, StopChecker
from specserve.errors import SessionLost
from specserve.params import GenerationParams
from specserve.serving.telemetry import tracer
from specserve.serving.wire import sampling_to_proto
from specserve.state.store import CommitStatus, SessionStore, ride_out
from specserve.v1 import draft_pb2, target_pb2

DRAFT_UNAVAILABLE = "draft_unavailable"


class RoundLoop:
    def __init__(self, store: SessionStore, targets: TargetDirectory,
                 stops_for: Callable[[GenerationParams], StopChecker], observers: Sequence[RoundObserver],
                 pipeline_commits: bool = True, redis_outage_s: float = 30.0) -> None:
        self.pipeline_commits = pipeline_commits
        self.redis_outage_s = redis_outage_s
        self.store = store
        self.targets = targets
        self.stops_for = stops_for
        self.observers = list(observers)

    async def run(self, run: Run) -> str:
        """Rounds until a stop; returns the finish reason (eos|length|stop|cancelled).

        Commits are pipelined: round n+1 drafts and verifies while round n's commit is in
        flight, and waits for that acknowledgement only before sending its own commit, so a
        refused commit ends the run with nothing after it committed (ADR 0010)."""
        stops = self.stops_for(run.params)
        for o in self.observers:
            o.started(run)
        commit: asyncio.Future[str | None] | None = None
        try:
            reason = None
            while reason is None:
                with tracer().start_as_current_span("specserve.round"):
                    reason, commit = await self.step(run, stops, commit)
                    if not self.pipeline_commits:
                        reason = await commit or reason
            assert commit is not None
            reason = await commit or reason  # the last round's commit, acknowledged
            run.finished, run.finish_reason = time.perf_counter(), reason
            for o in self.observers:
                o.finished(run, reason)
            return reason
        except BaseException:
            if commit is not None and not commit.done():  # let an acknowledged round land first
                await asyncio.gather(commit, return_exceptions=True)
            raise
        finally:
            for o in self.observers:
                o.stopped(run)

    async def step(self, run: Run, stops: StopChecker,
                   previous: asyncio.Future[str | None] | None) -> tuple[str | None, asyncio.Future[str | None]]:
        """One round: propose -> verify -> settle -> (previous commit acknowledged) -> commit
        dispatched -> observe. Returns the round's finish reason and its commit in flight."""
        t0 = time.perf_counter()
        k = draft_budget(run.params.num_draft_tokens, len(run.generated), run.params.max_tokens) if run.pool else 0
        drafted = await self.propose(run, k) if k > 0 else None
        proposal = drafted.response if drafted else None
        t1 = time.perf_counter()
        verdict = await self.verify(run, proposal)
        t2 = time.perf_counter()
        settled = settle(run.generated, verdict.tokens, stops, run.params.max_tokens)
        if previous is not None and await previous == "cancelled":  # closed meanwhile: stop here
            return "cancelled", previous
        t3 = time.perf_counter()
        commit = self.commit(run, settled)
        draft_ms = proposal.draft_ms if proposal else 0.0
        fallback = "" if proposal else (DRAFT_UNAVAILABLE if k > 0 else "" if run.pool else run.plain_reason)
        stats = RoundStats(
            k=len(proposal.tokens) if proposal else 0, accepted=verdict.num_accepted, emitted=len(settled.tokens),
            rejected_position=None if verdict.rejected_position < 0 else verdict.rejected_position,
            draft_ms=draft_ms, verify_ms=verdict.verify_ms,
            overhead_ms=max((time.perf_counter() - t0) * 1e3 - draft_ms - verdict.verify_ms, 0.0),
            fallback_reason=fallback, rollback_tokens=proposal.rollback_tokens if proposal else 0,
            k_asked=k, draft_wall_ms=(t1 - t0) * 1e3, verify_wall_ms=(t2 - t1) * 1e3, commit_ms=(t3 - t2) * 1e3,
            predraft="pushed" if drafted and drafted.pushed else "cached" if proposal and proposal.predrafted else "")
        run.rounds.append(stats)
        for o in self.observers:
            o.round(run, stats)
        return settled.finish_reason, commit

    async def propose(self, run: Run, k: int) -> Drafted | None:
        assert run.pool is not None
        with tracer().start_as_current_span("specserve.draft.propose", kind=SpanKind.CLIENT) as span:
            span.set_attributes({"specserve.draft_pool": run.pool.name, "specserve.k": k})
            drafted = await run.pool.propose(run.session_id, run.committed, run.draft_held, k,
                                             sampling_to_proto(run.params.sampling), run.plan.seed)
            if drafted is None:
                span.set_attribute("specserve.fallback_reason", DRAFT_UNAVAILABLE)
            else:
                span.set_attribute("specserve.predraft", "pushed" if drafted.pushed else
                                   "cached" if drafted.response.predrafted else "")
            return drafted

    async def verify(self, run: Run, proposal: draft_pb2.ProposeResponse | None) -> target_pb2.VerifyResponse:
        with tracer().start_as_current_span("specserve.target.verify", kind=SpanKind.CLIENT) as span:
            verdict = await self.targets.verify(run.session_id, run.committed, run.target_held, proposal,
                                                sampling_to_proto(run.params.sampling), run.plan.seed, run.deadline)
            span.set_attribute("specserve.num_accepted", verdict.num_accepted)
            return verdict

    def commit(self, run: Run, settled: Settled) -> asyncio.Future[str | None]:
        """Dispatch the settled tokens' commit and take them as this run's prefix at once (the
        next round drafts after them). They become visible only when Redis has them: the
        commit appends iff the session is where this router thinks it is, fenced by
        expected length, epoch and round id. The future gives the finish reason ("cancelled"
        if the session was closed meanwhile) or raises SessionLost. A shadow run commits
        nothing."""
        expected = len(run.generated)
        text = run.text.advance([*run.generated, *settled.tokens], settled.finish_reason)
        run.committed.extend(settled.tokens)
        if run.shadow:
            done: asyncio.Future[str | None] = asyncio.get_running_loop().create_future()
            done.set_result(settled.finish_reason)
            return done
        return asyncio.ensure_future(self._commit(run, expected, settled, text))

    async def _commit(self, run: Run, expected: int, settled: Settled, text: str) -> str | None:
        with tracer().start_as_current_span("specserve.commit", kind=SpanKind.CLIENT) as span:
            # safe to repeat through an outage: the round id makes a commit that landed a DUPLICATE
            result = await ride_out(lambda: self.store.commit(
                run.session_id, expected, run.epoch, f"{run.epoch}:{expected}", settled.tokens, text,
                settled.finish_reason), self.redis_outage_s)
            span.set_attributes({"specserve.commit_status": result.status.value, "specserve.expected_len": expected})
        if result.status is CommitStatus.CLOSED:  # cancelled: only what Redis holds is this run's
            run.committed.crop(run.prompt_len + result.committed_len)
            run.text = IncrementalText(run.text.stops)
            run.text.advance(run.generated, None)
            return "cancelled"
        if not result.applied:
            raise SessionLost(f"session {run.session_id} was taken over or expired ({result.status.value}); "
                              "Resume it to read the rest")
        if run.first_commit is None:
            run.first_commit = time.perf_counter()
        return settled.finish_reason
