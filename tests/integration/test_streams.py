"""The per-round stream (ADR 0010) on a real grpc.aio server on loopback: calls multiplexed
on one stream are answered in any order and matched by call id; a worker error comes back as
the status a unary call would have had; a broken stream fails its pending calls with
UNAVAILABLE and the next call opens a new stream."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from specserve.errors import InvalidRequest, NeedsFullPrefix
from specserve.serving.streams import StreamClient, serve_calls
from specserve.v1 import draft_pb2, draft_pb2_grpc


class SlowEcho(draft_pb2_grpc.DraftServicer):
    """Propose answers k tokens [k] after k * 20 ms; k = 0 and k = 31 raise domain errors."""

    def __init__(self) -> None:
        self.calls = 0

    async def Propose(self, request, context):
        self.calls += 1
        if request.k == 0:
            raise NeedsFullPrefix("resend the full prefix")
        if request.k == 31:
            raise InvalidRequest("k 31 is not welcome here")
        await asyncio.sleep(0.02 * request.k)
        return draft_pb2.ProposeResponse(tokens=[request.k] * request.k, drafter=request.session_id)

    async def ProposeStream(self, request_iterator, context):
        async for reply in serve_calls(request_iterator, lambda r, push: self.Propose(r, context), draft_pb2.ProposeReply,
                                       "test/Propose"):
            yield reply


async def _server(servicer) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    draft_pb2_grpc.add_DraftServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


def test_concurrent_calls_on_one_stream_are_matched_by_call_id(run):
    async def go():
        server, address = await _server(SlowEcho())
        async with grpc.aio.insecure_channel(address) as channel:
            call = StreamClient(draft_pb2_grpc.DraftStub(channel).ProposeStream, draft_pb2.ProposeCall)
            ks = [5, 1, 4, 2, 3]  # the slow ones were sent first: replies come back out of order
            replies = await asyncio.gather(*(call(draft_pb2.ProposeRequest(session_id=f"s{k}", k=k), 5.0)
                                             for k in ks))
            assert [(r.drafter, list(r.tokens)) for r in replies] == [(f"s{k}", [k] * k) for k in ks]
            for k, code, text in ((0, grpc.StatusCode.FAILED_PRECONDITION, "full prefix"),
                                  (31, grpc.StatusCode.INVALID_ARGUMENT, "not welcome")):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await call(draft_pb2.ProposeRequest(k=k), 5.0)
                assert err.value.code() == code and text in err.value.details()
            with pytest.raises(grpc.aio.AioRpcError) as err:  # a caller's own deadline
                await call(draft_pb2.ProposeRequest(k=10), 0.05)
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert len((await call(draft_pb2.ProposeRequest(k=2), 5.0)).tokens) == 2  # the stream goes on
            await call.close()
        await server.stop(0)

    run(go())


def test_a_broken_stream_fails_its_pending_calls_and_the_next_call_reconnects(run):
    async def go():
        servicer = SlowEcho()
        server, address = await _server(servicer)
        port = int(address.rsplit(":", 1)[1])
        async with grpc.aio.insecure_channel(address) as channel:
            call = StreamClient(draft_pb2_grpc.DraftStub(channel).ProposeStream, draft_pb2.ProposeCall)
            pending = asyncio.ensure_future(call(draft_pb2.ProposeRequest(k=20), 10.0))  # 0.4 s of work
            await asyncio.sleep(0.1)
            await server.stop(0)  # the worker dies mid-call
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await pending
            assert err.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
            server2 = grpc.aio.server()  # the worker comes back on the same port
            draft_pb2_grpc.add_DraftServicer_to_server(SlowEcho(), server2)
            server2.add_insecure_port(f"127.0.0.1:{port}")
            await server2.start()
            for _ in range(50):  # the channel reconnects with backoff
                try:
                    resp = await call(draft_pb2.ProposeRequest(k=1, session_id="again"), 2.0)
                    break
                except grpc.aio.AioRpcError:
                    await asyncio.sleep(0.1)
            assert resp.drafter == "again"
            await call.close()
            await server2.stop(0)

    run(go())
