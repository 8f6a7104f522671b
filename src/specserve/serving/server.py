"""What every specserve gRPC server shares: domain errors mapped to status codes in one
interceptor, grpc.health.v1 (NOT_SERVING until warm), server reflection, and a graceful
shutdown on SIGTERM that drains in-flight RPCs."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import Callable, Iterable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from specserve.errors import (
    IncompatiblePair,
    InvalidRequest,
    NeedsFullPrefix,
    ResourceExhausted,
    SessionLost,
    SessionNotFound,
    SpecserveError,
    Unavailable,
)

log = logging.getLogger(__name__)

_CODES: list[tuple[type[Exception], grpc.StatusCode]] = [
    (InvalidRequest, grpc.StatusCode.INVALID_ARGUMENT),
    (NeedsFullPrefix, grpc.StatusCode.FAILED_PRECONDITION),
    (IncompatiblePair, grpc.StatusCode.FAILED_PRECONDITION),
    (SessionNotFound, grpc.StatusCode.NOT_FOUND),
    (Unavailable, grpc.StatusCode.UNAVAILABLE),
    (SessionLost, grpc.StatusCode.ABORTED),
    (ResourceExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
]


async def run_timed(executor, fn, *args):
    """Run `fn(*args)` on `executor`: (result, seconds it ran there), the queue excluded, so a
    worker reports what a call cost rather than how busy it was."""
    def timed():
        t0 = time.perf_counter()
        out = fn(*args)
        return out, time.perf_counter() - t0

    return await asyncio.get_running_loop().run_in_executor(executor, timed)


def status_for(exc: Exception) -> grpc.StatusCode:
    for cls, code in _CODES:
        if isinstance(exc, cls):
            return code
    return grpc.StatusCode.INTERNAL


class DomainErrorInterceptor(grpc.aio.ServerInterceptor):
    """SpecserveError -> its status code with the message; anything else -> INTERNAL, logged.
    Servicers just raise."""

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None:
            return None
        method = details.method
        if handler.unary_unary:
            inner_uu = handler.unary_unary

            async def unary_unary(request, context):
                try:
                    return await inner_uu(request, context)
                except Exception as exc:
                    await _abort(exc, context, method)

            return grpc.unary_unary_rpc_method_handler(
                unary_unary, handler.request_deserializer, handler.response_serializer)
        if handler.unary_stream:
            inner_us = handler.unary_stream

            async def unary_stream(request, context):
                try:
                    async for item in inner_us(request, context):
                        yield item
                except Exception as exc:
                    await _abort(exc, context, method)

            return grpc.unary_stream_rpc_method_handler(
                unary_stream, handler.request_deserializer, handler.response_serializer)
        return handler


async def _abort(exc: Exception, context, method: str) -> None:
    """End the RPC with the status for `exc`; re-raise what is not an error of ours."""
    if isinstance(exc, grpc.aio.AbortError):
        raise exc
    if isinstance(exc, SpecserveError):
        await context.abort(status_for(exc), str(exc))
    log.exception("%s failed", method)
    await context.abort(grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}")


class GrpcServer:
    """A grpc.aio server with health and reflection. Call `start`, warm up, `set_serving`,
    then `wait_for_termination`; SIGTERM/SIGINT drain with `stop(grace_s)`."""

    def __init__(self, service_names: Iterable[str], host: str, port: int, grace_s: float,
                 add_servicers: Callable[[grpc.aio.Server], None],
                 interceptors: Iterable[grpc.aio.ServerInterceptor] = ()) -> None:
        self.service_names = list(service_names)
        self.grace_s = grace_s
        self.server = grpc.aio.server(interceptors=[*interceptors, DomainErrorInterceptor()],
                                      options=[("grpc.so_reuseport", 0)])
        add_servicers(self.server)
        self.health = HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            [*self.service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
             reflection.SERVICE_NAME], self.server)
        self.port = self.server.add_insecure_port(f"{host}:{port}")
        if self.port == 0:
            raise RuntimeError(f"could not bind {host}:{port}")
        self._stopping: asyncio.Event | None = None

    async def start(self) -> None:
        await self._set_all(health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.server.start()
        self._stopping = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            # not available off the main thread (e.g. inside a Ray actor): the owner stops us
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, self._stopping.set)

    async def set_serving(self) -> None:
        await self._set_all(health_pb2.HealthCheckResponse.SERVING)

    async def _set_all(self, status) -> None:
        for name in ("", *self.service_names):
            await self.health.set(name, status)

    async def wait_for_termination(self) -> None:
        """Run until SIGTERM/SIGINT (or `request_stop`), then drain."""
        assert self._stopping is not None, "start() first"
        await self._stopping.wait()
        await self.stop()

    def request_stop(self) -> None:
        if self._stopping is not None:
            self._stopping.set()

    async def stop(self) -> None:
        await self.health.enter_graceful_shutdown()  # NOT_SERVING: load balancers move away
        await self.server.stop(self.grace_s)  # in-flight RPCs get grace_s to finish
