"""The generation service: validate, plan, open (or join) the session and place it on a
target (whose engine drives it), and serve every reader from the session's committed stream
in Redis.

`GenerationService` is the typed API (no gRPC context): the gRPC `GenerationServicer` and
the OpenAI HTTP API (openai_api.py) are both thin faces over it."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from specserve.config import RouterSettings
from specserve.drafters.prediction import prediction_usage
from specserve.errors import Internal, SpecserveError
from specserve.model_info import ModelInfo
from specserve.services.router.classifier import Classifier
from specserve.services.router.plan import SessionPlan
from specserve.services.router.planner import Planner
from specserve.services.router.sessions import Opened, Sessions
from specserve.services.router.validation import ValidRequest, parse
from specserve.serving.telemetry import API, tracer
from specserve.state.store import Chunk, SessionInfo, SessionStore
from specserve.v1 import generation_pb2, generation_pb2_grpc

STREAM_BLOCK_MS = 250


class GenerationService:
    def __init__(self, settings: RouterSettings, model: ModelInfo, classifier: Classifier, planner: Planner,
                 sessions: Sessions, store: SessionStore) -> None:
        self.settings = settings
        self.model = model
        self.classifier = classifier
        self.planner = planner
        self.sessions = sessions
        self.store = store

    async def generate(self, request: generation_pb2.GenerateRequest) -> generation_pb2.GenerateResponse:
        """The whole completion once the session ended. Domain errors (SpecserveError) are
        raised: INVALID_ARGUMENT for a bad request, RESOURCE_EXHAUSTED when saturated, ..."""
        req = self._parse(request)
        with tracer().start_as_current_span("specserve.generate") as span:
            opened, plan = await self._open(req, span)
            tokens: list[int] = []
            text: list[str] = []
            reason = ""
            async for chunk in self._observed(opened.session_id, plan):
                tokens.extend(chunk.tokens)
                text.append(self._text(chunk))
                reason = chunk.finish_reason or reason
            stats = await self._final_stats(opened, reason)
            span.set_attributes({"specserve.finish_reason": reason, "specserve.emitted": len(tokens),
                                 "specserve.rounds": stats.rounds, "specserve.num_accepted": stats.accepted_tokens})
        return generation_pb2.GenerateResponse(session_id=opened.session_id, text="".join(text), token_ids=tokens,
                                               finish_reason=reason, stats=stats)

    async def generate_stream(self, request: generation_pb2.GenerateRequest
                              ) -> AsyncIterator[generation_pb2.GenerateChunk]:
        """The committed chunks as they land; the last carries the finish reason and stats."""
        req = self._parse(request)
        with tracer().start_as_current_span("specserve.generate") as span:
            opened, plan = await self._open(req, span)
            async for chunk in self._observed(opened.session_id, plan):
                msg = generation_pb2.GenerateChunk(session_id=opened.session_id, offset=chunk.offset,
                                                   token_ids=chunk.tokens, text=self._text(chunk),
                                                   finish_reason=chunk.finish_reason or "")
                if chunk.finish_reason:
                    msg.stats.CopyFrom(await self._final_stats(opened, chunk.finish_reason))
                    span.set_attribute("specserve.finish_reason", chunk.finish_reason)
                yield msg

    async def cancel(self, session_id: str) -> bool:
        return await self.sessions.cancel(session_id)

    async def resume(self, session_id: str, from_offset: int) -> AsyncIterator[generation_pb2.GenerateChunk]:
        async for chunk in self._follow(session_id, from_offset):
            yield generation_pb2.GenerateChunk(session_id=session_id, offset=chunk.offset,
                                               token_ids=chunk.tokens, text=self._text(chunk),
                                               finish_reason=chunk.finish_reason or "")

    async def _observed(self, session_id: str, plan: SessionPlan) -> AsyncIterator[Chunk]:
        """A new request's chunks (`_follow`), and its outcome for the rollout guards (ADR 0022):
        its client's TPOT once the last chunk has been taken, or a failure (a SpecserveError).
        A client that goes away first counts as nothing."""
        timer = _Tpot()
        try:
            async for chunk in self._follow(session_id, 0):
                timer.chunk(chunk)
                yield chunk
        except SpecserveError:
            self.planner.outcome(plan, None, failed=True)
            raise
        self.planner.outcome(plan, timer.tpot_s, failed=False)

    def _follow(self, session_id: str, from_offset: int) -> AsyncIterator[Chunk]:
        """The session's committed chunks from Redis, whoever drives it. A reader that goes
        away stops only its reading (the session runs on, ADR 0011); while it waits, it
        re-places the session if its driver's lease lapses."""
        return self.store.read_chunks(session_id, from_offset, STREAM_BLOCK_MS,
                                      on_wait=lambda: self.sessions.follow_hook(session_id),
                                      outage_s=self.settings.redis_outage_s)

    def _text(self, chunk: Chunk) -> str:
        return self.model.decode(list(chunk.tokens)) if chunk.partial else chunk.text

    async def _final_stats(self, opened: Opened, reason: str) -> generation_pb2.GenerationStats:
        """The session's statistics as its driver stored them with its last commit (none
        for a cancelled session). A session that failed is this call's error."""
        info = await self.store.get(opened.session_id)
        if reason == "error":
            raise Internal(f"session {opened.session_id} failed: {info.error if info else 'unknown error'}")
        return stats_from(info, opened.joined)

    def _parse(self, request) -> ValidRequest:
        s = self.settings
        return parse(request, self.model, list(self.planner.pools), self.classifier, s.max_tokens_limit,
                     s.max_prompt_tokens)

    async def _open(self, req: ValidRequest, span) -> tuple[Opened, SessionPlan]:
        if req.adapter:  # NOT_FOUND before a session exists (ADR 0029)
            await self.sessions.targets.require_adapter(req.adapter)
        plan = await self.planner.plan(req)
        span.set_attributes({**plan.span_attributes(), "specserve.api": API.get()})
        opened = await self.sessions.open(req.request_id, req.prompt_ids, plan)
        span.set_attributes({"specserve.session_id": opened.session_id, "specserve.joined": opened.joined})
        return opened, plan


class _Tpot:
    """A request's time per output token as its client saw it: from the first token's chunk to
    the last, over the tokens after the first (what the rollout's TPOT guard compares)."""

    def __init__(self) -> None:
        self.first: float | None = None
        self.last = 0.0
        self.tokens = 0

    def chunk(self, chunk: Chunk) -> None:
        if chunk.tokens:
            now = time.monotonic()
            self.first = now if self.first is None else self.first
            self.last = now
            self.tokens += len(chunk.tokens)

    @property
    def tpot_s(self) -> float | None:
        if self.first is None or self.tokens < 2:
            return None
        return (self.last - self.first) / (self.tokens - 1)


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    """The gRPC face of the service (errors become statuses in serving/grpc_server.py)."""

    def __init__(self, service: GenerationService) -> None:
        self.service = service

    async def Generate(self, request, context) -> generation_pb2.GenerateResponse:
        return await self.service.generate(request)

    async def GenerateStream(self, request, context):
        async for chunk in self.service.generate_stream(request):
            yield chunk

    async def Cancel(self, request, context) -> generation_pb2.CancelResponse:
        return generation_pb2.CancelResponse(cancelled=await self.service.cancel(request.session_id))

    async def Resume(self, request, context):
        async for chunk in self.service.resume(request.session_id, request.from_offset):
            yield chunk


def stats_from(info: SessionInfo | None, joined: bool) -> generation_pb2.GenerationStats:
    """GenerationStats from the session's hash: its plan, and the rounds its driver ran."""
    p = info.params if info is not None else {}
    rounds = [generation_pb2.RoundStats(k=r[0], accepted=r[1], emitted=r[2], rejected_position=r[3], draft_ms=r[4],
                                        verify_ms=r[5], overhead_ms=r[6], fallback_reason=r[7], predraft=r[8],
                                        probe=bool(r[10]) if len(r) > 10 else False)
              for r in ((info.stats or {}).get("rounds", []) if info is not None else [])]
    drafted, accepted = sum(r.k for r in rounds), sum(r.accepted for r in rounds)
    accepted_prediction, rejected_prediction = prediction_usage(p.get("pool"), drafted, accepted)
    return generation_pb2.GenerationStats(
        seed=p.get("seed", 0), workload_class=p.get("workload_class", ""), draft_pool=p.get("pool") or "",
        rounds=len(rounds), draft_tokens=drafted, accepted_tokens=accepted, round=rounds, joined=joined,
        accepted_prediction_tokens=accepted_prediction, rejected_prediction_tokens=rejected_prediction,
        k=p.get("k", 0) if p.get("pool") else 0, decision=p.get("decision", ""),
        decision_reason=p.get("decision_reason", ""))
