"""Target servicer: Verify = reconcile to the committed prefix, one forward pass over the
last committed token + the drafts, rejection sampling, rollback of rejected positions."""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from specserve.errors import InvalidRequest
from specserve.prefix import CommittedPrefix
from specserve.rejection import QProbs, Verdict
from specserve.sampling import SamplingParams
from specserve.v1 import common_pb2, target_pb2, target_pb2_grpc
from specserve.verifier import TargetModel, TargetSession, judge
from specserve.wire import check_k, check_token_ids, q_from_proto, sampling_from_proto


@dataclass
class _Session:
    prefix: CommittedPrefix
    target: TargetSession


class TargetServicer(target_pb2_grpc.TargetServicer):
    def __init__(self, target: TargetModel, max_sessions: int) -> None:
        self.target = target
        self.max_sessions = max_sessions
        self.sessions: OrderedDict[str, _Session] = OrderedDict()
        # One model thread: plain and speculative sessions share the target in arrival order.
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="target")

    def _session(self, session_id: str) -> _Session:
        sess = self.sessions.get(session_id)
        if sess is None:
            sess = _Session(CommittedPrefix(), self.target.start())
            self.sessions[session_id] = sess
            while len(self.sessions) > self.max_sessions:
                _, old = self.sessions.popitem(last=False)
                old.target.release()
        self.sessions.move_to_end(session_id)
        return sess

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
        t0 = time.perf_counter()
        before = sess.target.rollback_tokens
        verdict = await asyncio.get_running_loop().run_in_executor(
            self.executor, _verify, sess.target, ids, drafts, q, sampling, int(request.seed))
        return target_pb2.VerifyResponse(
            tokens=verdict.tokens, num_accepted=verdict.num_accepted,
            rejected_position=-1 if verdict.rejected_position is None else verdict.rejected_position,
            p_draft=verdict.p_draft, q_draft=verdict.q_draft,
            verify_ms=(time.perf_counter() - t0) * 1e3,
            rollback_tokens=sess.target.rollback_tokens - before)

    async def Prefill(self, request: target_pb2.PrefillRequest, context) -> target_pb2.PrefillResponse:
        sess, ids = self._reconcile(request)
        await asyncio.get_running_loop().run_in_executor(self.executor, sess.target.verify, ids, [])
        return target_pb2.PrefillResponse(cached_len=sess.target.lm.length)

    async def Release(self, request: common_pb2.ReleaseRequest, context) -> common_pb2.ReleaseResponse:
        sess = self.sessions.pop(request.session_id, None)
        if sess is not None:
            sess.target.release()
        return common_pb2.ReleaseResponse(released=sess is not None)


def _verify(session: TargetSession, ids: list[int], drafts: list[int], q: QProbs,
            sampling: SamplingParams, seed: int) -> Verdict:
    logits = session.verify(ids, drafts)  # [k+1, V]
    verdict = judge(logits, drafts, q, sampling, seed, len(ids))
    session.rollback(len(ids) + verdict.num_accepted)  # rejected drafts leave the KV cache
    return verdict
