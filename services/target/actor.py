"""The target as a named, detached Ray actor. Its constructor (re-run by Ray after every
restart) starts a grpc.aio Target server on its own event-loop thread and registers
host:port in Redis under a heartbeat TTL; routers discover targets there and talk to the
actor's port directly (DESIGN §4: the Serve proxy is not on the per-round path)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading

from specserve.config import TargetSettings

log = logging.getLogger("specserve.target")


def registry_key(prefix: str, name: str) -> str:
    return f"{prefix}:target:{name}"


class TargetWorker:
    """Plain class (Ray wraps it with `ray.remote` in the launcher, options from settings)."""

    def __init__(self, settings_json: str, trace_carrier: dict[str, str] | None = None) -> None:
        self.settings = TargetSettings.model_validate_json(settings_json)
        self._carrier = trace_carrier or {}  # the launcher's span: context crosses into Ray explicitly
        self.metrics_port = -1
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self.address = ""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="target-grpc", daemon=True)
        self._thread.start()

    def info(self, timeout_s: float = 300.0) -> dict:
        """Blocks until the server is SERVING; returns {"address", "pid"}."""
        if not self._ready.wait(timeout_s):
            raise TimeoutError(f"target not ready after {timeout_s} s")
        if self._error is not None:
            raise RuntimeError(f"target failed to start: {self._error!r}")
        return {"address": self.address, "pid": os.getpid(), "metrics_port": self.metrics_port}

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._serve())
        except BaseException as exc:  # surfaced through info()
            self._error = exc
            self._ready.set()
            log.exception("target worker stopped")

    async def _serve(self) -> None:
        import torch

        from services.target.server import TargetServicer
        from specserve.models.loading import load_model
        from specserve.models.verifier import TargetModel
        from specserve.serving.server import GrpcServer
        from specserve.serving.telemetry import (
            TracingServerInterceptor,
            attach_carrier,
            setup_tracing,
            start_metrics_server,
            tracer,
        )
        from specserve.serving.tls import load as load_tls
        from specserve.state.store import connect
        from specserve.v1 import target_pb2, target_pb2_grpc
        from specserve.worker.model_runner import Batching

        s = self.settings
        setup_tracing("specserve-target")
        attach_carrier(self._carrier)
        with tracer().start_as_current_span("specserve.target.start") as span:
            span.set_attribute("specserve.target", s.name)
            torch.set_num_threads(s.torch_threads)
            target = TargetModel(load_model(s.model))
            servicer = TargetServicer(target, s.max_sessions, simulated_pass_ms=s.simulated_pass_ms,
                                      batching=Batching.from_settings(s), max_batch=s.max_batch,
                                      max_wait_ms=s.max_wait_ms, evict_idle_s=s.kv_evict_idle_s)
            server = GrpcServer([target_pb2.DESCRIPTOR.services_by_name["Target"].full_name], s.host, s.port,
                                s.grace_s, lambda srv: target_pb2_grpc.add_TargetServicer_to_server(servicer, srv),
                                interceptors=[TracingServerInterceptor()],
                                credentials=tls.server(require_client_cert=True) if (tls := load_tls(s.tls_dir))
                                else None)
            await server.start()
            await servicer.warm_up()
            await server.set_serving()
            self.metrics_port = start_metrics_server(servicer.metrics.registry, s.metrics_port, s.host)
        self.address = f"{s.host}:{server.port}"
        redis = connect(s.redis_url)  # the registry heartbeat rides a Redis restart
        entry = json.dumps({"address": self.address, "pid": os.getpid(), "name": s.name,
                            "metrics_port": self.metrics_port})
        key = registry_key(s.key_prefix, s.name)
        await redis.set(key, entry, px=int(s.registry_ttl_s * 1000))
        log.info("target %s serving on %s (pid %d)", s.name, self.address, os.getpid())
        self._ready.set()
        while True:  # heartbeat: the entry expires registry_ttl_s after this process dies
            await asyncio.sleep(s.heartbeat_s)
            try:
                await redis.set(key, entry, px=int(s.registry_ttl_s * 1000))
            except Exception:  # Redis blips must not kill the worker; the next beat retries
                log.warning("heartbeat to Redis failed", exc_info=True)
