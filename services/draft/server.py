"""Draft servicer: Propose reconciles the session to the caller's committed prefix
(FAILED_PRECONDITION when it needs the full prefix), drafts k tokens, returns them with q.

While the target verifies, the worker drafts ahead for the prefixes the next round is likely
to start from (ADR 0010), in the device's idle time only: a Propose never waits behind more
than the one pre-draft step already running. A prepared block is kept per session and
pushed to the router on the stream; it is used only for exactly the prefix it assumed."""

from __future__ import annotations

import asyncio
import contextlib
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from specserve.algorithm.sampling import SamplingParams
from specserve.drafters.base import Drafter, DraftProposal, DraftSession
from specserve.errors import InvalidRequest
from specserve.serving.metrics import WorkerMetrics
from specserve.serving.server import run_timed
from specserve.serving.streams import Push, serve_calls
from specserve.serving.telemetry import tracer
from specserve.serving.wire import check_k, check_token_ids, sampling_from_proto
from specserve.state.prefix import CommittedPrefix, chain
from specserve.v1 import common_pb2, draft_pb2, draft_pb2_grpc
from specserve.worker.qcodec import q_to_proto
from specserve.worker.sessions import SessionLRU
from specserve.worker.speculation import BlockKey, SpeculationCache, likely_outcomes, likely_prefix

IDLE_POLL_S = 0.0005


@dataclass
class _Session:
    """One session on this worker: the committed prefix it holds, its KV cache, and the blocks
    drafted ahead for it."""

    prefix: CommittedPrefix
    draft: DraftSession
    cache: SpeculationCache = field(default_factory=SpeculationCache)
    ahead: asyncio.Task | None = None  # the pre-drafting task of its last round

    def release(self) -> None:
        if self.ahead is not None:
            self.ahead.cancel()
        self.cache.clear()
        self.draft.release()


class DraftServicer(draft_pb2_grpc.DraftServicer):
    def __init__(self, drafter: Drafter, max_sessions: int, metrics: WorkerMetrics | None = None,
                 simulated_token_ms: float = 0.0, max_predraft_branches: int = 4) -> None:
        self.simulated_token_ms = simulated_token_ms
        self.drafter = drafter
        self.max_predraft_branches = max_predraft_branches
        self.metrics = metrics or WorkerMetrics("draft")
        self.sessions: SessionLRU[_Session] = SessionLRU(
            lambda: _Session(CommittedPrefix(), self.drafter.start()), max_sessions)
        # One thread runs the model: forwards are serialised (torch threads parallelise each),
        # and the event loop stays free for health checks and new calls. The device lock
        # covers compute and simulated device time; Propose calls waiting for it go first.
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="draft")
        self.device = asyncio.Lock()
        self.waiting = 0  # Propose calls waiting for the device

    async def Propose(self, request: draft_pb2.ProposeRequest, context,
                      push: Push | None = None) -> draft_pb2.ProposeResponse:
        k = check_k(request.k)
        sampling = sampling_from_proto(request.sampling)
        sampling.check_vocab(self.drafter.vocab_size)
        check_token_ids(request.prefix.tokens, self.drafter.vocab_size)
        sess = self.sessions.get(request.session_id)
        if sess.ahead is not None:  # drafting ahead for the previous round: this one is here
            sess.ahead.cancel()
        ids = list(sess.prefix.apply(request.prefix.base_len, request.prefix.base_hash, request.prefix.tokens))
        if not ids:
            raise InvalidRequest("the committed prefix is empty: send at least one token")
        seed = int(request.seed)
        key = BlockKey(len(ids), sess.prefix.hash_at(len(ids)), k, sampling, seed)
        prepared = sess.cache.take(key)
        if prepared is not None:
            proposal, ahead_s = prepared
            elapsed = 0.0
        else:
            self.waiting += 1
            try:
                async with self.device:
                    proposal, elapsed = await self._draft(sess.draft, ids, k, sampling, seed)
            finally:
                self.waiting -= 1
            ahead_s = 0.0
        self.metrics.call_latency.labels("propose").observe(elapsed)
        self.metrics.sessions.set(len(self.sessions))
        self.metrics.rollback_tokens.inc(proposal.rollback_tokens)
        branches = min(request.predraft_branches, self.max_predraft_branches)
        if branches and proposal.tokens:
            sess.ahead = asyncio.create_task(self._draft_ahead(request.session_id, sess, ids, proposal, k, sampling,
                                                               seed, branches, push))
        return self._response(proposal, elapsed, prepared is not None, ahead_s)

    def _response(self, proposal: DraftProposal, elapsed_s: float, predrafted: bool,
                  ahead_s: float) -> draft_pb2.ProposeResponse:
        return draft_pb2.ProposeResponse(
            tokens=proposal.tokens, q=q_to_proto(proposal.q), rollback_tokens=proposal.rollback_tokens,
            draft_ms=elapsed_s * 1e3, drafter=self.drafter.name, predrafted=predrafted, predraft_ms=ahead_s * 1e3)

    async def _draft(self, draft: DraftSession, ids: list[int], k: int, sampling: SamplingParams,
                     seed: int) -> tuple[DraftProposal, float]:
        """One block, with the device held by the caller: (proposal, seconds of device time)."""
        proposal, elapsed = await run_timed(self.executor, draft.propose, ids, k, sampling, seed)
        if self.simulated_token_ms:
            await asyncio.sleep(self.simulated_token_ms * k / 1e3)
            elapsed += self.simulated_token_ms * k / 1e3
        return proposal, elapsed

    @contextlib.asynccontextmanager
    async def _idle_device(self):
        """The device, taken only while no Propose waits for it."""
        while True:
            while self.waiting or self.device.locked():
                await asyncio.sleep(IDLE_POLL_S)
            await self.device.acquire()
            if not self.waiting:
                break
            self.device.release()
        try:
            yield
        finally:
            self.device.release()

    async def _draft_ahead(self, session_id: str, sess: _Session, ids: list[int], proposal: DraftProposal, k: int,
                           sampling: SamplingParams, seed: int, branches: int, push: Push | None) -> None:
        """Blocks for the likely next prefixes, likeliest first (likely_outcomes: all accepted
        + the bonus guess, or a rejection at j + the runner-up), each cached and pushed when
        ready. The bonus guess costs one draft forward, spent only when that branch comes."""
        loop = asyncio.get_running_loop()
        base = sess.prefix.hash_at(len(ids))
        prepared = 0
        # a child of the Propose's server span that outlives it: the waterfall draws it beside
        # the round's Verify, which it overlaps
        span = tracer().start_span("specserve.draft.ahead")
        try:
            for j in likely_outcomes(len(proposal.tokens), proposal.runner_up, proposal.confidence, branches):
                guess, guess_s = None, 0.0
                if j == len(proposal.tokens):
                    async with self._idle_device():
                        t0 = time.perf_counter()
                        guess = await loop.run_in_executor(self.executor, sess.draft.guess_next,
                                                           [*ids, *proposal.tokens], sampling, seed)
                        if self.simulated_token_ms:
                            await asyncio.sleep(self.simulated_token_ms / 1e3)
                        guess_s = time.perf_counter() - t0
                prefix = likely_prefix(ids, proposal.tokens, j, proposal.runner_up, guess)
                if prefix is None:
                    continue
                async with self._idle_device():
                    block, elapsed = await self._draft(sess.draft, prefix, k, sampling, seed)
                prefix_hash = chain(base, prefix[len(ids):])
                sess.cache.put(BlockKey(len(prefix), prefix_hash, k, sampling, seed), (block, elapsed + guess_s))
                self.metrics.predrafts.inc()
                if push is not None:
                    push(draft_pb2.ProposeReply(call_id=0, predraft=draft_pb2.Predraft(
                        session_id=session_id, prefix_len=len(prefix), prefix_hash=prefix_hash, k=k,
                        block=self._response(block, 0.0, True, elapsed + guess_s))))
                prepared += 1
        except asyncio.CancelledError:
            pass  # the next round arrived: what it needs was cached or is drafted afresh
        finally:
            span.set_attribute("specserve.predrafted_blocks", prepared)
            span.end()

    async def ProposeStream(self, request_iterator, context):
        async for reply in serve_calls(request_iterator, lambda r, push: self.Propose(r, context, push),
                                       draft_pb2.ProposeReply, "specserve.v1.Draft/Propose"):
            yield reply

    async def Release(self, request: common_pb2.ReleaseRequest, context) -> common_pb2.ReleaseResponse:
        return common_pb2.ReleaseResponse(released=self.sessions.release(request.session_id))
