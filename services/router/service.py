"""The Generation servicer: validate, plan, open (or join) the session, drive it or follow
its owner, and serve every reader from the session's committed stream in Redis."""

from __future__ import annotations

import asyncio
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
        opened = await self._open(self._parse(request), context)
        if opened.run is not None:
            run = opened.run
            reason = await self.sessions.drive(run)
            return generation_pb2.GenerateResponse(
                session_id=run.session_id, text=run.text.published, token_ids=run.generated,
                finish_reason=reason, stats=_stats(run, opened.joined))
        tokens: list[int] = []
        text: list[str] = []
        reason = ""
        async for chunk in self.store.read_chunks(opened.session_id, 0, STREAM_BLOCK_MS):
            tokens.extend(chunk.tokens)
            text.append(chunk.text)
            reason = chunk.finish_reason or reason
        info = await self.store.get(opened.session_id)
        return generation_pb2.GenerateResponse(session_id=opened.session_id, text="".join(text), token_ids=tokens,
                                               finish_reason=reason, stats=_joined_stats(info))

    async def GenerateStream(self, request, context):
        opened = await self._open(self._parse(request), context)
        run, session_id = opened.run, opened.session_id
        task = asyncio.create_task(self.sessions.drive(run)) if run is not None else None
        try:
            async for chunk in _until_failed(self.store.read_chunks(session_id, 0, STREAM_BLOCK_MS), task):
                msg = generation_pb2.GenerateChunk(session_id=session_id, offset=chunk.offset,
                                                   token_ids=chunk.tokens, text=chunk.text,
                                                   finish_reason=chunk.finish_reason or "")
                if chunk.finish_reason:
                    if task is not None and run is not None:
                        await task  # raises what the owner raised (the chunk says "error")
                        msg.stats.CopyFrom(_stats(run, opened.joined))
                    else:
                        msg.stats.CopyFrom(_joined_stats(await self.store.get(session_id)))
                yield msg
        finally:
            if task is not None and not task.done():
                task.cancel()

    async def Cancel(self, request, context) -> generation_pb2.CancelResponse:
        return generation_pb2.CancelResponse(cancelled=await self.store.cancel(request.session_id))

    async def Resume(self, request, context):
        async for chunk in self.store.read_chunks(request.session_id, request.from_offset, STREAM_BLOCK_MS):
            text = self.model.decode(chunk.tokens) if chunk.partial else chunk.text
            yield generation_pb2.GenerateChunk(session_id=request.session_id, offset=chunk.offset,
                                               token_ids=chunk.tokens, text=text,
                                               finish_reason=chunk.finish_reason or "")

    def _parse(self, request) -> ValidRequest:
        s = self.settings
        return parse(request, self.model, list(self.planner.pools), self.classifier, s.max_tokens_limit,
                     s.max_prompt_tokens)

    async def _open(self, req: ValidRequest, context) -> Opened:
        plan = await self.planner.plan(req)
        remaining = context.time_remaining() if context is not None else None
        deadline = asyncio.get_running_loop().time() + (remaining if remaining is not None else 3600.0)
        return await self.sessions.open(req.request_id, req.prompt_ids, plan, deadline)


async def _until_failed(chunks: AsyncIterator[Chunk], task: asyncio.Task | None) -> AsyncIterator[Chunk]:
    """The committed chunks, ended early by the failure of the task that drives the session
    (e.g. SessionLost: the session was taken over, so its final chunk may never come)."""
    if task is None:
        async for chunk in chunks:
            yield chunk
        return
    it = aiter(chunks)
    while True:
        nxt = asyncio.ensure_future(anext(it))
        await asyncio.wait({nxt, task}, return_when=asyncio.FIRST_COMPLETED)
        if not nxt.done() and task.done() and not task.cancelled() and task.exception() is not None:
            nxt.cancel()
            raise task.exception()  # type: ignore[misc]
        try:
            yield await nxt
        except StopAsyncIteration:
            return


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
        rejected_prediction_tokens=sum(r.k - r.accepted for r in run.rounds) if predicted else 0)


def _joined_stats(info: SessionInfo | None) -> generation_pb2.GenerationStats:
    p = info.params if info is not None else {}
    return generation_pb2.GenerationStats(seed=p.get("seed", 0), workload_class=p.get("workload_class", ""),
                                          draft_pool=p.get("pool") or "", joined=True)
