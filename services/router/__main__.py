"""`python -m services.router`: the Generation service in front of the draft pools and the
target. SERVING once Redis answers; targets are discovered per request."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import redis.asyncio as aioredis

from services.router.pools import DraftPool, TargetDirectory
from services.router.requests import ModelInfo
from services.router.rounds import RoundLoop
from services.router.service import GenerationServicer
from specserve.config import RouterSettings
from specserve.metrics import RouterMetrics
from specserve.serving import GrpcServer
from specserve.store import SessionStore
from specserve.telemetry import (
    TracingServerInterceptor,
    publish_ports,
    setup_tracing,
    shutdown_tracing,
)
from specserve.v1 import generation_pb2, generation_pb2_grpc

log = logging.getLogger("specserve.router")

HEALTH_INTERVAL_S = 2.0


async def main(settings: RouterSettings) -> None:
    setup_tracing("specserve-router")
    model = ModelInfo(settings.tokenizer)
    redis = aioredis.from_url(settings.redis_url)
    store = SessionStore(redis, prefix=settings.key_prefix, ttl_s=settings.session_ttl_s)
    pools = {name: DraftPool(name, addrs, settings.draft_timeout_ms / 1000)
             for name, addrs in settings.draft_pools.items()}
    targets = TargetDirectory(redis, settings.key_prefix)
    servicer = GenerationServicer(settings, model, store, pools, None)  # type: ignore[arg-type]
    metrics = RouterMetrics()
    servicer.loop = RoundLoop(store, targets, servicer.stops_for, settings.verify_timeout_ms / 1000,
                              settings.target_wait_s, metrics, model.kv_bytes_per_token)
    server = GrpcServer([generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name],
                        settings.host, settings.port, settings.grace_s,
                        lambda s: generation_pb2_grpc.add_GenerationServicer_to_server(servicer, s),
                        interceptors=[TracingServerInterceptor()])
    await server.start()
    publish_ports(server.port, settings.port_file, metrics.registry, settings.metrics_port,
                  settings.metrics_port_file, settings.host)
    await redis.ping()
    await targets.refresh()

    async def watch() -> None:  # draft replica health and target registry, in the background
        while True:
            await asyncio.gather(*(p.check_health() for p in pools.values()), targets.refresh(),
                                 return_exceptions=True)
            await asyncio.sleep(HEALTH_INTERVAL_S)

    watcher = asyncio.create_task(watch())
    await server.set_serving()
    log.info("router serving on %s:%d (pools: %s)", settings.host, server.port, ", ".join(pools) or "none")
    await server.wait_for_termination()
    watcher.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await watcher
    await asyncio.gather(*(p.close() for p in pools.values()), targets.close())
    await redis.aclose()
    shutdown_tracing()
    log.info("router drained and stopped")


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    asyncio.run(main(RouterSettings()))
