"""Target servicer: a thin layer over the worker skeleton (specserve.worker: session table,
scheduler, model runner). Verify = reconcile to the committed prefix, then a row in the next
batch (last committed token + drafts), rejection sampling on the batch, rollback of the
rejected positions. Prefill = the committed prompt fed ahead, chunk by chunk.

Each reply's verify_ms is what a batch of rows like this one takes at the current batch size
(worker/cost.py, ADR 0013): the round's cost at the current load, not the wait for the batch.
"""

from __future__ import annotations

from dataclasses import replace

from specserve.algorithm.sampling import SamplingParams
from specserve.errors import InvalidRequest, Unavailable
from specserve.models.verifier import TargetModel
from specserve.serving.metrics import WorkerMetrics
from specserve.serving.streams import serve_calls
from specserve.serving.wire import check_k, check_token_ids, sampling_from_proto
from specserve.v1 import common_pb2, target_pb2, target_pb2_grpc
from specserve.worker.core import WorkerCore
from specserve.worker.model_runner import Batching, VerifyJob, target_engine
from specserve.worker.qcodec import q_from_proto


class TargetServicer(target_pb2_grpc.TargetServicer):
    def __init__(self, target: TargetModel, max_sessions: int, metrics: WorkerMetrics | None = None,
                 simulated_pass_ms: float = 0.0, batching: Batching | None = None, max_batch: int = 32,
                 max_wait_ms: float = 0.0, evict_idle_s: float = 1.0, host=None) -> None:
        self.target = target
        self.host = host  # services.target.engine_host.EngineHost: the engine that drives rounds (ADR 0014)
        self.simulated_pass_ms = simulated_pass_ms
        self.metrics = metrics or WorkerMetrics("target")
        b = batching or Batching(enabled=False)
        b = replace(b, max_sessions=min(b.max_sessions, max_sessions))
        self.engine = target_engine(target, b)
        self.max_positions = self.engine.max_positions
        self.core = WorkerCore(self.engine, self.metrics, max_sessions, max_batch, max_wait_ms, evict_idle_s,
                               extra_s=lambda _: simulated_pass_ms / 1e3, name="target")
        self.sessions = self.core.sessions

    def _reconcile(self, request):
        check_token_ids(request.prefix.tokens, self.target.vocab_size)
        seq = self.core.session(request.session_id)
        return seq, seq.reconcile(request.prefix)

    async def Verify(self, request: target_pb2.VerifyRequest, context) -> target_pb2.VerifyResponse:
        sampling = sampling_from_proto(request.sampling)
        sampling.check_vocab(self.target.vocab_size)
        drafts = [int(t) for t in request.draft_tokens]
        k = check_k(len(drafts))
        check_token_ids(drafts, self.target.vocab_size, "draft token id")
        q = q_from_proto(request.q, k, self.target.vocab_size)
        seq, ids = self._reconcile(request)
        if len(ids) + k + 1 > self.max_positions:
            raise InvalidRequest(f"{len(ids)} committed + {k} draft tokens exceed the context length "
                                 f"of {self.max_positions}")
        done = await self.core.run(seq, VerifyJob(seq.handle, ids, drafts, q, sampling, int(request.seed)), k + 1)
        result, verdict = done.value, done.value.verdict
        self.metrics.call_latency.labels("verify").observe(done.cost_s)
        self.metrics.rollback_tokens.inc(result.rolled_back)
        return target_pb2.VerifyResponse(
            tokens=verdict.tokens, num_accepted=verdict.num_accepted,
            rejected_position=-1 if verdict.rejected_position is None else verdict.rejected_position,
            p_draft=verdict.p_draft, q_draft=verdict.q_draft, verify_ms=done.cost_s * 1e3,
            rollback_tokens=result.rolled_back)

    async def VerifyStream(self, request_iterator, context):
        async for reply in serve_calls(request_iterator, lambda r, push: self.Verify(r, context), target_pb2.VerifyReply,
                                       "specserve.v1.Target/Verify"):
            yield reply

    async def Prefill(self, request: target_pb2.PrefillRequest, context) -> target_pb2.PrefillResponse:
        seq, ids = self._reconcile(request)
        if len(ids) > self.max_positions:
            raise InvalidRequest(f"{len(ids)} committed tokens exceed the context length of {self.max_positions}")
        done = await self.core.run(seq, VerifyJob(seq.handle, ids, [], None, SamplingParams(), 0, prefill_only=True), len(ids))
        return target_pb2.PrefillResponse(cached_len=done.value.cached_len)

    async def warm_up(self) -> None:
        """One verify through the whole path (scheduler, engine), then forget the session."""
        req = target_pb2.VerifyRequest(session_id="\0warm-up", prefix=common_pb2.Prefix(tokens=[0, 1, 2]),
                                       draft_tokens=[3, 4])
        await self.Verify(req, None)
        self.sessions.release(req.session_id)

    async def Start(self, request: target_pb2.StartRequest, context) -> target_pb2.StartResponse:
        if self.host is None:
            raise Unavailable("this target does not drive sessions (no engine)")
        epoch, committed = await self.host.start(request.session_id)
        return target_pb2.StartResponse(epoch=epoch, committed=committed)

    async def Stop(self, request: target_pb2.StopRequest, context) -> target_pb2.StopResponse:
        return target_pb2.StopResponse(stopped=self.host is not None and self.host.stop(request.session_id))

    async def Release(self, request: common_pb2.ReleaseRequest, context) -> common_pb2.ReleaseResponse:
        return common_pb2.ReleaseResponse(released=self.sessions.release(request.session_id))
