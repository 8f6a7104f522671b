"""The Generation servicer: validate, plan, open (or join) the session, drive it or follow
its owner, and serve every reader from the session's committed stream in Redis."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from services.router.classifier import Classifier
from services.router.model_info import ModelInfo
from services.router.plan import Run
from services.router.planner import Planner
from services.router.sessions import Opened, Sessions
from services.router.validation import ValidRequest, parse
from specserve.algorithm.round import RoundStats
from specserve.config import RouterSettings
from specserve.drafters.prediction import PREDICTION_POOL
from specserve.state.store import Chunk, SessionInfo, SessionStore
from specserve.v1 import generation_pb2, generation_pb2_grpc

STREAM_BLOCK_MS = 250
FINAL_WAIT_S = 2.0  # how long a finished stream waits for its run's statistics


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    def __init__(self, settings: RouterSettings, model: ModelInfo, classifier: Classifier, planner: Planner,
                 sessions: Sessions, store: SessionStore) -> None:
        self.settings = settings
        self.model = model
        self.classifier = classifier
        self.planner = planner
        self.sessions = sessions
        self.store = store

    async def Generate(self, request, context) -> generation_pb2.GenerateResponse:
        opened = await self._open(self._parse(request))
        tokens: list[int] = []
        text: list[str] = []
        reason = ""
        async for chunk in self._follow(opened.session_id, 0):
            tokens.extend(chunk.tokens)
            text.append(self._text(chunk))
            reason = chunk.finish_reason or reason
        return generation_pb2.GenerateResponse(session_id=opened.session_id, text="".join(text), token_ids=tokens,
                                               finish_reason=reason, stats=await self._final_stats(opened, reason))

    async def GenerateStream(self, request, context):
        opened = await self._open(self._parse(request))
        async for chunk in self._follow(opened.session_id, 0):
            msg = generation_pb2.GenerateChunk(session_id=opened.session_id, offset=chunk.offset,
                                               token_ids=chunk.tokens, text=self._text(chunk),
                                               finish_reason=chunk.finish_reason or "")
            if chunk.finish_reason:
                msg.stats.CopyFrom(await self._final_stats(opened, chunk.finish_reason))
            yield msg

    async def Cancel(self, request, context) -> generation_pb2.CancelResponse:
        return generation_pb2.CancelResponse(cancelled=await self.store.cancel(request.session_id))

    async def Resume(self, request, context):
        async for chunk in self._follow(request.session_id, request.from_offset):
            yield generation_pb2.GenerateChunk(session_id=request.session_id, offset=chunk.offset,
                                               token_ids=chunk.tokens, text=self._text(chunk),
                                               finish_reason=chunk.finish_reason or "")

    def _follow(self, session_id: str, from_offset: int) -> AsyncIterator[Chunk]:
        """The session's committed chunks from Redis, whoever drives it. A reader that goes
        away stops only its reading (the session runs on, ADR 0011); while it waits, it
        adopts the session if the owner's lease lapses."""
        return self.store.read_chunks(session_id, from_offset, STREAM_BLOCK_MS,
                                      on_wait=lambda: self.sessions.follow_hook(session_id),
                                      outage_s=self.settings.redis_outage_s)

    def _text(self, chunk: Chunk) -> str:
        return self.model.decode(list(chunk.tokens)) if chunk.partial else chunk.text

    async def _final_stats(self, opened: Opened, reason: str) -> generation_pb2.GenerationStats:
        """The driving run's statistics when this call started it and it is over; else (joined,
        taken over, or still winding down after a Cancel) what the session's hash says. An
        error the run ended with is this call's error."""
        task = opened.task
        if task is not None and opened.run is not None:
            with contextlib.suppress(TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(asyncio.shield(task), FINAL_WAIT_S)
            if task.done() and not task.cancelled():
                if task.exception() is not None and reason == "error":
                    raise task.exception()  # type: ignore[misc]
                if task.exception() is None:
                    return _stats(opened.run, opened.joined)
        return _joined_stats(await self.store.get(opened.session_id))

    def _parse(self, request) -> ValidRequest:
        s = self.settings
        return parse(request, self.model, list(self.planner.pools), self.classifier, s.max_tokens_limit,
                     s.max_prompt_tokens)

    async def _open(self, req: ValidRequest) -> Opened:
        plan = await self.planner.plan(req)
        return await self.sessions.open(req.request_id, req.prompt_ids, plan)


def round_to_proto(r: RoundStats) -> generation_pb2.RoundStats:
    return generation_pb2.RoundStats(
        k=r.k, accepted=r.accepted, emitted=r.emitted,
        rejected_position=-1 if r.rejected_position is None else r.rejected_position, draft_ms=r.draft_ms,
        verify_ms=r.verify_ms, overhead_ms=r.overhead_ms, fallback_reason=r.fallback_reason, predraft=r.predraft,
        draft_wall_ms=r.draft_wall_ms, verify_wall_ms=r.verify_wall_ms, commit_wait_ms=r.commit_ms)


def _stats(run: Run, joined: bool) -> generation_pb2.GenerationStats:
    predicted = run.plan.pool == PREDICTION_POOL
    return generation_pb2.GenerationStats(
        seed=run.plan.seed, workload_class=run.plan.workload_class, draft_pool=run.pool.name if run.pool else "",
        rounds=len(run.rounds), draft_tokens=sum(r.k for r in run.rounds),
        accepted_tokens=sum(r.accepted for r in run.rounds), round=[round_to_proto(r) for r in run.rounds],
        joined=joined, accepted_prediction_tokens=sum(r.accepted for r in run.rounds) if predicted else 0,
        rejected_prediction_tokens=sum(r.k - r.accepted for r in run.rounds) if predicted else 0,
        k=run.params.num_draft_tokens if run.pool else 0, decision=run.plan.choice.decision.value,
        decision_reason=run.plan.decision_reason)


def _joined_stats(info: SessionInfo | None) -> generation_pb2.GenerationStats:
    p = info.params if info is not None else {}
    return generation_pb2.GenerationStats(seed=p.get("seed", 0), workload_class=p.get("workload_class", ""),
                                          draft_pool=p.get("pool") or "", joined=True,
                                          k=p.get("k", 0) if p.get("pool") else 0, decision=p.get("decision", ""),
                                          decision_reason=p.get("decision_reason", ""))
