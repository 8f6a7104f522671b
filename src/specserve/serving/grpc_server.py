"""What every specserve gRPC server shares: domain errors mapped to status codes in one
interceptor, grpc.health.v1 (NOT_SERVING until warm), server reflection, and a graceful
shutdown on SIGTERM that drains in-flight RPCs."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import Callable, Coroutine, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from specserve.errors import (
    IncompatiblePair,
    InvalidRequest,
    NeedsFullPrefix,
    ResourceExhausted,
    ServedTokensChanged,
    SessionClosed,
    SessionLost,
    SessionNotFound,
    SpecserveError,
    Unavailable,
)
from specserve.serving.handlers import rewrap

S = TypeVar("S")

log = logging.getLogger(__name__)

_CODES: list[tuple[type[Exception], grpc.StatusCode]] = [
    (InvalidRequest, grpc.StatusCode.INVALID_ARGUMENT),
    (NeedsFullPrefix, grpc.StatusCode.FAILED_PRECONDITION),
    (IncompatiblePair, grpc.StatusCode.FAILED_PRECONDITION),
    (SessionClosed, grpc.StatusCode.FAILED_PRECONDITION),
    (SessionNotFound, grpc.StatusCode.NOT_FOUND),
    (Unavailable, grpc.StatusCode.UNAVAILABLE),
    (SessionLost, grpc.StatusCode.ABORTED),
    (ServedTokensChanged, grpc.StatusCode.DATA_LOSS),
    (ResourceExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
]


def status_for(exc: Exception) -> grpc.StatusCode:
    for cls, code in _CODES:
        if isinstance(exc, cls):
            return code
    if _redis_down(exc):
        return grpc.StatusCode.UNAVAILABLE
    return grpc.StatusCode.INTERNAL


def _redis_down(exc: Exception) -> bool:
    try:
        from specserve.state.connection import REDIS_DOWN  # the workers may run without redis
    except ImportError:
        return False
    return isinstance(exc, REDIS_DOWN)


def message_for(exc: Exception) -> str:
    """What the caller reads: ours as written; Redis down as what to do; else the type and text."""
    if isinstance(exc, SpecserveError):
        return str(exc)
    if _redis_down(exc):
        return (f"the session store (Redis) is unreachable ({type(exc).__name__}: {exc}); committed tokens are "
                "kept there: retry the call with the same request_id, or Resume the session, when it is back")
    return f"{type(exc).__name__}: {exc}"


@dataclass(frozen=True)
class ServerLimits:
    max_message_bytes: int = 64 << 20  # a larger request is refused (RESOURCE_EXHAUSTED)
    max_concurrent_rpcs: int = 2048  # more in flight are refused (RESOURCE_EXHAUSTED)


class _Corrupt:
    """What the deserializer hands on for bytes that are not a valid request message."""

    def __init__(self, exc: Exception) -> None:
        self.exc = exc


def _lenient(deserializer):
    """Deserialize, or hand on `_Corrupt` so the handler answers INVALID_ARGUMENT (an exception
    in the deserializer would surface as UNKNOWN)."""
    if deserializer is None:
        return None

    def deserialize(data: bytes):
        try:
            return deserializer(data)
        except Exception as exc:
            return _Corrupt(exc)

    return deserialize


async def _refuse_corrupt(request, context) -> None:
    if isinstance(request, _Corrupt):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                            f"the request is not a valid protobuf message for this method ({request.exc})")


async def _checked(requests, context):
    async for request in requests:
        await _refuse_corrupt(request, context)
        yield request


class DomainErrorInterceptor(grpc.aio.ServerInterceptor):
    """SpecserveError -> its status code with the message; Redis unreachable -> UNAVAILABLE
    with what to do; anything else -> INTERNAL, logged. Corrupt request bytes ->
    INVALID_ARGUMENT. Servicers just raise."""

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None:
            return None
        method = details.method

        @contextlib.asynccontextmanager
        async def around(request, context):
            await _refuse_corrupt(request, context)
            try:
                yield
            except Exception as exc:
                await _abort(exc, context, method)

        return rewrap(handler, around, _lenient(handler.request_deserializer), _checked)


async def _abort(exc: Exception, context, method: str) -> None:
    """End the RPC with the status for `exc`; re-raise what is not an error of ours."""
    if isinstance(exc, grpc.aio.AbortError):
        raise exc
    code = status_for(exc)
    if code is grpc.StatusCode.INTERNAL:
        log.exception("%s failed", method)
    elif code is grpc.StatusCode.UNAVAILABLE:
        log.warning("%s: %s", method, message_for(exc))
    await context.abort(code, message_for(exc))


class GrpcServer:
    """A grpc.aio server with health and reflection. Call `start`, warm up, `set_serving`,
    then `wait_for_termination`; SIGTERM/SIGINT drain with `stop(grace_s)`."""

    def __init__(self, service_names: Iterable[str], host: str, port: int, grace_s: float,
                 add_servicers: Callable[[grpc.aio.Server], None],
                 interceptors: Iterable[grpc.aio.ServerInterceptor] = (),
                 limits: ServerLimits = ServerLimits(), credentials: grpc.ServerCredentials | None = None) -> None:
        self.service_names = list(service_names)
        self.grace_s = grace_s
        self.server = grpc.aio.server(
            interceptors=[*interceptors, DomainErrorInterceptor()],
            options=[("grpc.so_reuseport", 0), ("grpc.max_receive_message_length", limits.max_message_bytes)],
            maximum_concurrent_rpcs=limits.max_concurrent_rpcs)
        add_servicers(self.server)
        self.health = HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            [*self.service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
             reflection.SERVICE_NAME], self.server)
        self.port = (self.server.add_secure_port(f"{host}:{port}", credentials) if credentials is not None
                     else self.server.add_insecure_port(f"{host}:{port}"))
        if self.port == 0:
            raise RuntimeError(f"could not bind {host}:{port}")
        self._stopping: asyncio.Event | None = None
        self.stop_began = 0.0  # time.monotonic() when the drain began (stop)
        # called as the drain begins: each ends long-lived streams (a draft's Link) that would
        # otherwise hold the drain for its whole grace while their peers could move elsewhere
        self.on_drain: list[Callable[[], None]] = []

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

    async def set_not_serving(self) -> None:
        await self._set_all(health_pb2.HealthCheckResponse.NOT_SERVING)

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
        self.stop_began = time.monotonic()
        await self.health.enter_graceful_shutdown()  # NOT_SERVING: load balancers move away
        for end in self.on_drain:
            end()
        await self.server.stop(self.grace_s)  # in-flight RPCs get grace_s to finish


def configure_logging() -> None:
    """Every specserve process logs INFO lines with the time and the logger's name."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")


def run_main(main: Callable[[S], Coroutine[Any, Any, None]], settings: S) -> None:
    """A service's `python -m` entry point: configure logging, then run `main(settings)`."""
    configure_logging()
    asyncio.run(main(settings))
