"""Tracing and metrics setup shared by every service (DESIGN §6).

Tracing is off by default. `SPECSERVE_TRACING=console` prints spans; `otlp` exports with the
OTLP gRPC exporter, configured by the standard variables (OTEL_EXPORTER_OTLP_ENDPOINT,
OTEL_TRACES_SAMPLER / OTEL_TRACES_SAMPLER_ARG for the sampling ratio, OTEL_SERVICE_NAME...).
Spans are exported by a BatchSpanProcessor on its own thread, so export never blocks a round.

Context crosses process boundaries in gRPC metadata (W3C traceparent): `outgoing_metadata()`
on the client side, `TracingServerInterceptor` on the server side, which opens a SERVER span
per RPC as the child of the caller's CLIENT span.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Sequence
from contextvars import ContextVar

import grpc
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from specserve.serving.handlers import rewrap

log = logging.getLogger(__name__)

TRACER_NAME = "specserve"
# Which API a request came in by ("grpc" | "http"): the `specserve.api` span attribute
API: ContextVar[str] = ContextVar("specserve_api", default="grpc")
_enabled = False  # set by setup_tracing: with tracing off, interceptors add nothing


def setup_tracing(service_name: str) -> str:
    """Install the tracer provider for this process; returns the mode in effect."""
    mode = os.environ.get("SPECSERVE_TRACING", "off").lower()
    if mode in ("", "off", "none"):
        return "off"
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter

    resource = Resource.create({SERVICE_NAME: os.environ.get("OTEL_SERVICE_NAME", service_name)})
    provider = TracerProvider(resource=resource)  # sampler from OTEL_TRACES_SAMPLER(_ARG)
    exporter: SpanExporter
    if mode == "console":
        exporter = ConsoleSpanExporter()
    elif mode == "otlp":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter()  # endpoint from OTEL_EXPORTER_OTLP(_TRACES)_ENDPOINT
    else:
        raise ValueError(f"SPECSERVE_TRACING must be off, console or otlp, got {mode!r}")
    provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=500))
    trace.set_tracer_provider(provider)
    global _enabled
    _enabled = True
    return mode


def shutdown_tracing() -> None:
    provider = trace.get_tracer_provider()
    if hasattr(provider, "shutdown"):
        provider.shutdown()  # flushes what is still queued


def tracer() -> trace.Tracer:
    return trace.get_tracer(TRACER_NAME)


def tracing_env() -> dict[str, str]:
    """The tracing configuration of this process, to hand to processes it starts (Ray actors)."""
    return {k: v for k, v in os.environ.items() if k.startswith("OTEL_") or k == "SPECSERVE_TRACING"}


def carrier() -> dict[str, str]:
    """The current span context as a plain dict (for Ray calls and other non-gRPC hops)."""
    out: dict[str, str] = {}
    propagate.inject(out)
    return out


def attach_carrier(c: dict[str, str]):
    """Make a carrier's context current; returns the token for `otel_context.detach`."""
    return otel_context.attach(propagate.extract(c or {}))


def outgoing_metadata() -> Sequence[tuple[str, str]]:
    """The current span context as gRPC metadata (empty when nothing is recording)."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return tuple(carrier.items())


class TracingServerInterceptor(grpc.aio.ServerInterceptor):
    """One SERVER span per RPC, parented by the caller's context from the metadata."""

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or not _enabled:
            return handler
        carrier = {k: v for k, v in (details.invocation_metadata or ()) if isinstance(v, str)}
        name = details.method.lstrip("/")

        @contextlib.asynccontextmanager
        async def around(_request, _context):
            token = otel_context.attach(propagate.extract(carrier))
            try:
                with tracer().start_as_current_span(name, kind=SpanKind.SERVER,
                                                    attributes={"specserve.api": "grpc"}) as span:
                    try:
                        yield
                    except Exception as exc:
                        span.set_status(Status(StatusCode.ERROR, str(exc)))
                        raise
            finally:
                otel_context.detach(token)

        return rewrap(handler, around)


def start_metrics_server(registry, port: int, host: str = "127.0.0.1") -> int:
    """Serve Prometheus metrics on host:port (0 = a free port, -1 = none); returns the port."""
    if port < 0:
        return -1
    from prometheus_client import start_http_server

    server, _ = start_http_server(port, addr=host, registry=registry)
    return int(server.server_port)


def publish_ports(grpc_port: int, port_file: str, registry, metrics_port: int, metrics_port_file: str,
                  host: str) -> int:
    """Start the metrics endpoint and write the bound ports where a launcher looks for them."""
    from pathlib import Path

    if port_file:
        Path(port_file).write_text(str(grpc_port))
    bound = start_metrics_server(registry, metrics_port, host)
    if metrics_port_file:
        Path(metrics_port_file).write_text(str(bound))
    return bound
