"""One way to wrap a gRPC method handler, for the server interceptors (domain errors in
`grpc_server.py`, tracing in `telemetry.py`): each says what runs around a call, this module
rebuilds the handler around it."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager

import grpc

Around = Callable[[object, grpc.aio.ServicerContext], AbstractAsyncContextManager]
Requests = Callable[[AsyncIterator, grpc.aio.ServicerContext], AsyncIterator]


def rewrap(handler: grpc.RpcMethodHandler, around: Around, deserializer: Callable | None = None,
           requests: Requests | None = None) -> grpc.RpcMethodHandler:
    """`handler` with each unary-request call (unary-unary, unary-stream) run inside
    `around(request, context)`; a stream-stream call's request iterator passed through
    `requests(iterator, context)` when given (else that handler is kept as it is).
    `deserializer` replaces the handler's request deserializer when given."""
    deserialize = deserializer or handler.request_deserializer
    if handler.unary_unary:
        inner_uu = handler.unary_unary

        async def unary_unary(request, context):
            async with around(request, context):
                return await inner_uu(request, context)

        return grpc.unary_unary_rpc_method_handler(unary_unary, deserialize, handler.response_serializer)
    if handler.unary_stream:
        inner_us = handler.unary_stream

        async def unary_stream(request, context):
            async with around(request, context):
                async for item in inner_us(request, context):
                    yield item

        return grpc.unary_stream_rpc_method_handler(unary_stream, deserialize, handler.response_serializer)
    if handler.stream_stream and requests is not None:
        inner_ss = handler.stream_stream

        async def stream_stream(request_iterator, context):
            async for reply in inner_ss(requests(request_iterator, context), context):
                yield reply

        return grpc.stream_stream_rpc_method_handler(stream_stream, deserialize, handler.response_serializer)
    return handler
