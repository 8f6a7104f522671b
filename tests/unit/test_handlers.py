"""The domain-error interceptor through the shared handler wrapper (`serving/handlers.py`), on
a real grpc.aio server on loopback: each kind of handler maps our errors to their status,
anything else to INTERNAL, and corrupt request bytes to INVALID_ARGUMENT."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from specserve.errors import InvalidRequest
from specserve.serving.grpc_server import DomainErrorInterceptor


def _decode(data: bytes) -> str:
    return data.decode("utf-8")  # b"\xff" is not UTF-8: the "corrupt message" of this service


def _encode(text: str | bytes) -> bytes:
    return text if isinstance(text, bytes) else text.encode()  # (grpc.aio may hand it bytes already)


async def _echo(request: str, context) -> str:
    if request == "bad":
        raise InvalidRequest("bad is not a word here")
    if request == "boom":
        raise RuntimeError("a bug")
    return request.upper()


async def _count(request: str, context):
    yield "one"
    yield "two"
    raise InvalidRequest(f"no three for {request}")


async def _chat(requests, context):
    async for r in requests:
        yield r.upper()


def _service() -> grpc.GenericRpcHandler:
    return grpc.method_handlers_generic_handler("t.T", {
        "Echo": grpc.unary_unary_rpc_method_handler(_echo, _decode, _encode),
        "Count": grpc.unary_stream_rpc_method_handler(_count, _decode, _encode),
        "Chat": grpc.stream_stream_rpc_method_handler(_chat, _decode, _encode),
    })


async def _run() -> dict[str, object]:
    server = grpc.aio.server(interceptors=[DomainErrorInterceptor()])
    server.add_generic_rpc_handlers((_service(),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    out: dict[str, object] = {}
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            echo = ch.unary_unary("/t.T/Echo")
            out["ok"] = await echo(b"hi")
            for name, payload in (("bad", b"bad"), ("boom", b"boom"), ("corrupt", b"\xff")):
                try:
                    await echo(payload)
                except grpc.aio.AioRpcError as e:
                    out[name] = (e.code(), e.details())
            got = []
            try:
                async for item in ch.unary_stream("/t.T/Count")(b"x"):
                    got.append(item)
            except grpc.aio.AioRpcError as e:
                out["count"] = (got, e.code(), e.details())
            try:
                async for item in ch.unary_stream("/t.T/Count")(b"\xff"):
                    got.append(item)
            except grpc.aio.AioRpcError as e:
                out["count corrupt"] = e.code()
            replies = []
            try:
                async for r in ch.stream_stream("/t.T/Chat")(iter([b"a", b"b", b"\xff", b"c"])):
                    replies.append(r)
            except grpc.aio.AioRpcError as e:
                out["chat"] = (replies, e.code())
    finally:
        await server.stop(None)
    return out


def test_each_handler_kind_maps_errors_to_their_status():
    out = asyncio.run(_run())
    assert out["ok"] == b"HI"
    assert out["bad"] == (grpc.StatusCode.INVALID_ARGUMENT, "bad is not a word here")
    assert out["boom"] == (grpc.StatusCode.INTERNAL, "RuntimeError: a bug")
    code, details = out["corrupt"]
    assert code is grpc.StatusCode.INVALID_ARGUMENT and "not a valid protobuf message" in details
    assert out["count"] == ([b"one", b"two"], grpc.StatusCode.INVALID_ARGUMENT, "no three for x")
    assert out["count corrupt"] is grpc.StatusCode.INVALID_ARGUMENT
    assert out["chat"] == ([b"A", b"B"], grpc.StatusCode.INVALID_ARGUMENT)


if __name__ == "__main__":
    pytest.main([__file__])
