"""A minimal OTLP/gRPC trace receiver: implements opentelemetry-proto's TraceService, keeps
the spans it receives and writes them as JSON. Used by the tests (a real exporter talks to
it), by the tracing-overhead benchmark, and as input to `specserve trace`."""

from __future__ import annotations

import json
import threading
from concurrent import futures
from pathlib import Path

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

_KINDS = {0: "UNSPECIFIED", 1: "INTERNAL", 2: "SERVER", 3: "CLIENT", 4: "PRODUCER", 5: "CONSUMER"}


def _value(v):
    which = v.WhichOneof("value")
    return getattr(v, which) if which in ("string_value", "bool_value", "int_value", "double_value") else str(v)


class _Service(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, sink: list[dict], lock: threading.Lock) -> None:
        self.sink, self.lock = sink, lock

    def Export(self, request, context):
        spans = []
        for rs in request.resource_spans:
            resource = {a.key: _value(a.value) for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    spans.append({
                        "trace_id": s.trace_id.hex(), "span_id": s.span_id.hex(),
                        "parent_span_id": s.parent_span_id.hex(), "name": s.name, "kind": _KINDS.get(s.kind, "?"),
                        "start_ns": s.start_time_unix_nano, "end_ns": s.end_time_unix_nano,
                        "service": resource.get("service.name", ""),
                        "attributes": {a.key: _value(a.value) for a in s.attributes},
                        "events": [{"name": e.name, "time_ns": e.time_unix_nano,
                                    "attributes": {a.key: _value(a.value) for a in e.attributes}} for e in s.events],
                        "status": s.status.code,
                    })
        with self.lock:
            self.sink.extend(spans)
        return trace_service_pb2.ExportTraceServiceResponse()


class OtlpReceiver:
    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self.spans: list[dict] = []
        self._lock = threading.Lock()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_Service(self.spans, self._lock), self.server)
        self.port = self.server.add_insecure_port(f"{host}:{port}")
        self.endpoint = f"http://{host}:{self.port}"

    def start(self) -> OtlpReceiver:
        self.server.start()
        return self

    def stop(self) -> None:
        self.server.stop(grace=1)

    def snapshot(self) -> list[dict]:
        with self._lock:
            return list(self.spans)

    def dump(self, path: Path) -> None:
        Path(path).write_text(json.dumps(self.snapshot(), indent=0))
