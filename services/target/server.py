"""Target servicer: Verify = reconcile to the committed prefix, one forward pass over the
last committed token + the drafts, rejection sampling, rollback of rejected positions."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from specserve.errors import InvalidRequest
from specserve.models.verifier import TargetModel, TargetSession, verify_block
from specserve.serving.metrics import WorkerMetrics
from specserve.serving.server import run_timed
from specserve.serving.streams import serve_calls
from specserve.serving.wire import check_k, check_token_ids, sampling_from_proto
from specserve.state.prefix import CommittedPrefix
from specserve.v1 import common_pb2, target_pb2, target_pb2_grpc
from specserve.worker.qcodec import q_from_proto
from specserve.worker.sessions import SessionLRU


@dataclass
class _Session:
    """One session on this worker: the committed prefix it holds and its KV cache."""

    prefix: CommittedPrefix
    target: TargetSession

    def release(self) -> None:
        self.target.release()


class TargetServicer(target_pb2_grpc.TargetServicer):
    def __init__(self, target: TargetModel, max_sessions: int, metrics: WorkerMetrics | None = None,
                 simulated_pass_ms: float = 0.0) -> None:
        self.simulated_pass_ms = simulated_pass_ms
        self.target = target
        self.metrics = metrics or WorkerMetrics("target")
        self.sessions: SessionLRU[_Session] = SessionLRU(
            lambda: _Session(CommittedPrefix(), self.target.start()), max_sessions)
        # One model thread: plain and speculative sessions share the target in arrival order.
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="target")

    def _session(self, session_id: str) -> _Session:
        return self.sessions.get(session_id)

    def _reconcile(self, request) -> tuple[_Session, list[int]]:
        check_token_ids(request.prefix.tokens, self.target.vocab_size)
        sess = self._session(request.session_id)
        ids = sess.prefix.apply(request.prefix.base_len, request.prefix.base_hash, request.prefix.tokens)
        if not ids:
            raise InvalidRequest("the committed prefix is empty: send at least one token")
        return sess, list(ids)

    async def Verify(self, request: target_pb2.VerifyRequest, context) -> target_pb2.VerifyResponse:
        sampling = sampling_from_proto(request.sampling)
        sampling.check_vocab(self.target.vocab_size)
        drafts = [int(t) for t in request.draft_tokens]
        k = check_k(len(drafts))
        check_token_ids(drafts, self.target.vocab_size, "draft token id")
        q = q_from_proto(request.q, k, self.target.vocab_size)
        sess, ids = self._reconcile(request)
        if len(ids) + k + 1 > self.target.max_positions:
            raise InvalidRequest(f"{len(ids)} committed + {k} draft tokens exceed the context length "
                                 f"of {self.target.max_positions}")
        before = sess.target.rollback_tokens
        # verify_ms is this call's compute (plus the simulated device time), not the wait for
        # the executor: the controller prices rounds by cost, not by how busy the node is
        verdict, elapsed = await run_timed(self.executor, verify_block, sess.target, ids, drafts, q, sampling,
                                           int(request.seed))
        if self.simulated_pass_ms:
            await asyncio.sleep(self.simulated_pass_ms / 1e3)
            elapsed += self.simulated_pass_ms / 1e3
        rolled_back = sess.target.rollback_tokens - before
        self.metrics.call_latency.labels("verify").observe(elapsed)
        self.metrics.sessions.set(len(self.sessions))
        self.metrics.rollback_tokens.inc(rolled_back)
        return target_pb2.VerifyResponse(
            tokens=verdict.tokens, num_accepted=verdict.num_accepted,
            rejected_position=-1 if verdict.rejected_position is None else verdict.rejected_position,
            p_draft=verdict.p_draft, q_draft=verdict.q_draft, verify_ms=elapsed * 1e3,
            rollback_tokens=rolled_back)

    async def VerifyStream(self, request_iterator, context):
        async for reply in serve_calls(request_iterator, lambda r, push: self.Verify(r, context), target_pb2.VerifyReply,
                                       "specserve.v1.Target/Verify"):
            yield reply

    async def Prefill(self, request: target_pb2.PrefillRequest, context) -> target_pb2.PrefillResponse:
        sess, ids = self._reconcile(request)
        await asyncio.get_running_loop().run_in_executor(self.executor, sess.target.verify, ids, [])
        return target_pb2.PrefillResponse(cached_len=sess.target.lm.length)

    async def Release(self, request: common_pb2.ReleaseRequest, context) -> common_pb2.ReleaseResponse:
        return common_pb2.ReleaseResponse(released=self.sessions.release(request.session_id))

