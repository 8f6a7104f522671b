"""Draft servicer: Propose reconciles the session to the caller's committed prefix
(FAILED_PRECONDITION when it needs the full prefix), drafts k tokens, returns them with q."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from specserve.drafters.base import Drafter, DraftSession
from specserve.errors import InvalidRequest
from specserve.metrics import WorkerMetrics
from specserve.prefix import CommittedPrefix
from specserve.serving import run_timed
from specserve.sessions import SessionLRU
from specserve.v1 import common_pb2, draft_pb2, draft_pb2_grpc
from specserve.wire import check_k, check_token_ids, q_to_proto, sampling_from_proto


@dataclass
class _Session:
    """One session on this worker: the committed prefix it holds and its KV cache."""

    prefix: CommittedPrefix
    draft: DraftSession

    def release(self) -> None:
        self.draft.release()


class DraftServicer(draft_pb2_grpc.DraftServicer):
    def __init__(self, drafter: Drafter, max_sessions: int, metrics: WorkerMetrics | None = None,
                 simulated_token_ms: float = 0.0) -> None:
        self.simulated_token_ms = simulated_token_ms
        self.drafter = drafter
        self.metrics = metrics or WorkerMetrics("draft")
        self.sessions: SessionLRU[_Session] = SessionLRU(
            lambda: _Session(CommittedPrefix(), self.drafter.start()), max_sessions)
        # One thread runs the model: forwards are serialised (torch threads parallelise each),
        # and the event loop stays free for health checks and new calls.
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="draft")

    def _session(self, session_id: str) -> _Session:
        return self.sessions.get(session_id)

    async def Propose(self, request: draft_pb2.ProposeRequest, context) -> draft_pb2.ProposeResponse:
        k = check_k(request.k)
        sampling = sampling_from_proto(request.sampling)
        sampling.check_vocab(self.drafter.vocab_size)
        check_token_ids(request.prefix.tokens, self.drafter.vocab_size)
        sess = self._session(request.session_id)
        ids = sess.prefix.apply(request.prefix.base_len, request.prefix.base_hash, request.prefix.tokens)
        if not ids:
            raise InvalidRequest("the committed prefix is empty: send at least one token")
        proposal, elapsed = await run_timed(self.executor, sess.draft.propose, list(ids), k, sampling,
                                            int(request.seed))
        if self.simulated_token_ms:
            await asyncio.sleep(self.simulated_token_ms * k / 1e3)
            elapsed += self.simulated_token_ms * k / 1e3
        self.metrics.call_latency.labels("propose").observe(elapsed)
        self.metrics.sessions.set(len(self.sessions))
        self.metrics.rollback_tokens.inc(proposal.rollback_tokens)
        return draft_pb2.ProposeResponse(
            tokens=proposal.tokens, q=q_to_proto(proposal.q), rollback_tokens=proposal.rollback_tokens,
            draft_ms=elapsed * 1e3, drafter=self.drafter.name)

    async def Release(self, request: common_pb2.ReleaseRequest, context) -> common_pb2.ReleaseResponse:
        return common_pb2.ReleaseResponse(released=self.sessions.release(request.session_id))
