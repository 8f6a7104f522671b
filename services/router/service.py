"""The Generation servicer: validate, create or join the session in Redis, drive its rounds
(or follow the owner's), and serve every reader from the session's committed stream."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import uuid

from services.router.pools import DraftPool
from services.router.requests import ModelInfo, Spec, parse
from services.router.rounds import RoundLoop, Run
from specserve.config import RouterSettings
from specserve.errors import SpecserveError
from specserve.params import GenerationParams, SamplingParams
from specserve.prefix import CommittedPrefix
from specserve.rng import fresh_seed
from specserve.stops import IncrementalText, StopChecker
from specserve.store import SessionStatus, SessionStore
from specserve.telemetry import tracer
from specserve.v1 import generation_pb2, generation_pb2_grpc

log = logging.getLogger("specserve.router")

OWNER_LEASE_S = 15.0  # a running session not updated for this long has lost its router
STREAM_BLOCK_MS = 250


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    def __init__(self, settings: RouterSettings, model: ModelInfo, store: SessionStore,
                 pools: dict[str, DraftPool], loop: RoundLoop) -> None:
        self.settings = settings
        self.model = model
        self.store = store
        self.pools = pools
        self.loop = loop
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
        self.tasks: set[asyncio.Task] = set()

    def stops_for(self, params: GenerationParams) -> StopChecker:
        return StopChecker(self.model.eos_token_ids, params.stop, self.model.decode)

    # -- RPCs ------------------------------------------------------------------------------
    async def Generate(self, request, context) -> generation_pb2.GenerateResponse:
        spec = self._parse(request)
        run, joined, session_id = await self._open(spec, context)
        if run is not None:
            reason = await self._drive(run)
            return generation_pb2.GenerateResponse(
                session_id=run.session_id, text=run.text.published, token_ids=run.generated,
                finish_reason=reason, stats=self._stats(run, joined))
        tokens: list[int] = []
        text: list[str] = []
        reason = ""
        async for chunk in self.store.read_chunks(session_id, 0, STREAM_BLOCK_MS):
            tokens.extend(chunk.tokens)
            text.append(chunk.text)
            reason = chunk.finish_reason or reason
        info = await self.store.get(session_id)
        return generation_pb2.GenerateResponse(session_id=session_id, text="".join(text), token_ids=tokens,
                                               finish_reason=reason, stats=self._joined_stats(info))

    async def GenerateStream(self, request, context):
        spec = self._parse(request)
        run, joined, session_id = await self._open(spec, context)
        task = asyncio.create_task(self._drive(run)) if run is not None else None
        try:
            async for chunk in self.store.read_chunks(session_id, 0, STREAM_BLOCK_MS):
                msg = generation_pb2.GenerateChunk(session_id=session_id, offset=chunk.offset,
                                                   token_ids=chunk.tokens, text=chunk.text,
                                                   finish_reason=chunk.finish_reason or "")
                if chunk.finish_reason:
                    if task is not None:
                        await task  # raises what the owner raised (the chunk says "error")
                        msg.stats.CopyFrom(self._stats(run, joined))
                    else:
                        msg.stats.CopyFrom(self._joined_stats(await self.store.get(session_id)))
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

    # -- sessions --------------------------------------------------------------------------
    def _parse(self, request) -> Spec:
        s = self.settings
        return parse(request, self.model, list(self.pools), s.default_pool, s.default_k,
                     s.max_tokens_limit, s.max_prompt_tokens)

    async def _open(self, spec: Spec, context) -> tuple[Run | None, bool, str]:
        """(run to drive or None to follow, joined?, session id)."""
        seed = spec.params.seed if spec.params.seed is not None else fresh_seed()
        p = spec.params
        stored = {"max_tokens": p.max_tokens, "temperature": p.sampling.temperature, "top_k": p.sampling.top_k,
                  "top_p": p.sampling.top_p, "banned": list(p.sampling.banned_token_ids), "k": p.num_draft_tokens,
                  "stop": list(p.stop), "seed": seed, "workload_class": spec.workload_class,
                  "class_reason": spec.class_reason, "pool": spec.pool}
        handle = await self.store.create_or_join(spec.request_id, stored, spec.prompt_ids, self.owner)
        remaining = context.time_remaining() if context is not None else None
        deadline = asyncio.get_running_loop().time() + (remaining if remaining is not None else 3600.0)
        if handle.created:
            return self._run(handle.session_id, handle.epoch, spec.prompt_ids, stored, [], deadline), False, handle.session_id
        info = await self.store.get(handle.session_id)
        if info is not None and info.status is SessionStatus.RUNNING and time.time() - info.updated > OWNER_LEASE_S:
            epoch = await self.store.take_over(handle.session_id, self.owner)  # its router is gone
            generated = await self.store.committed_tokens(handle.session_id)
            run = self._run(handle.session_id, epoch, info.prompt_ids, info.params, generated, deadline)
            return run, True, handle.session_id
        return None, True, handle.session_id

    def _run(self, session_id: str, epoch: int, prompt_ids: list[int], stored: dict, generated: list[int],
             deadline: float) -> Run:
        params = GenerationParams(
            max_tokens=stored["max_tokens"], num_draft_tokens=stored["k"], stop=tuple(stored["stop"]),
            seed=stored["seed"], sampling=SamplingParams(stored["temperature"], stored["top_k"], stored["top_p"],
                                                          tuple(stored["banned"])))
        text = IncrementalText(self.stops_for(params))
        text.advance(list(generated), None)  # what earlier owners already published
        return Run(session_id=session_id, epoch=epoch, prompt_len=len(prompt_ids), params=params,
                   seed=stored["seed"], pool=self.pools.get(stored["pool"]) if stored["pool"] else None,
                   workload_class=stored["workload_class"], committed=CommittedPrefix([*prompt_ids, *generated]),
                   text=text, deadline=deadline)

    async def _drive(self, run: Run) -> str:
        try:
            with tracer().start_as_current_span("specserve.generate") as span:
                span.set_attributes({"specserve.session_id": run.session_id,
                                     "specserve.workload_class": run.workload_class,
                                     "specserve.draft_pool": run.pool.name if run.pool else "none",
                                     "specserve.k": run.params.num_draft_tokens, "specserve.seed": str(run.seed)})
                reason = await self.loop.run(run)
                span.set_attributes({"specserve.finish_reason": reason, "specserve.rounds": len(run.rounds),
                                     "specserve.num_accepted": sum(r.accepted for r in run.rounds),
                                     "specserve.emitted": len(run.generated)})
        except asyncio.CancelledError:
            raise  # the client went away: the session stays running and can be taken over
        except SpecserveError as exc:
            await self.store.fail(run.session_id, run.epoch, str(exc))
            raise
        except Exception as exc:
            log.exception("session %s failed", run.session_id)
            await self.store.fail(run.session_id, run.epoch, f"{type(exc).__name__}: {exc}")
            raise
        self._release_workers(run)
        return reason

    def _release_workers(self, run: Run) -> None:
        async def release() -> None:
            if run.pool is not None:
                for replica in list(run.draft_held):
                    await run.pool.release(run.session_id, replica)
            await self.loop.targets.release(run.session_id, list(run.target_held))

        task = asyncio.create_task(release())
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def _stats(self, run: Run, joined: bool) -> generation_pb2.GenerationStats:
        return generation_pb2.GenerationStats(
            seed=run.seed, workload_class=run.workload_class, draft_pool=run.pool.name if run.pool else "",
            rounds=len(run.rounds), draft_tokens=sum(r.k for r in run.rounds),
            accepted_tokens=sum(r.accepted for r in run.rounds), round=run.rounds, joined=joined)

    def _joined_stats(self, info) -> generation_pb2.GenerationStats:
        p = info.params if info is not None else {}
        return generation_pb2.GenerationStats(seed=p.get("seed", 0), workload_class=p.get("workload_class", ""),
                                              draft_pool=p.get("pool") or "", joined=True)
