"""`python -m services.router`: the Generation service in front of the draft pools and the
target. SERVING once Redis answers; targets are discovered per request."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import uuid
from pathlib import Path

import redis.asyncio as aioredis

from services.router.admin import PolicyAdminServicer
from services.router.classifier import Classifier, Rule
from services.router.model_info import ModelInfo
from services.router.openai_api import OpenAIApp, start_http
from services.router.planner import Planner
from services.router.pools import DraftPool
from services.router.service import GenerationService, GenerationServicer
from services.router.sessions import Ownership, Sessions
from services.router.targets import TargetDirectory
from specserve.config import RouterSettings
from specserve.control.controller import Controller, ShadowLog
from specserve.control.policy import DEFAULT_CLASS, Policy, PolicyCache, PolicyConflict, PolicyStore
from specserve.errors import InvalidRequest
from specserve.serving.chat import ChatTemplate
from specserve.serving.metrics import RouterMetrics
from specserve.serving.server import GrpcServer, ServerLimits
from specserve.serving.telemetry import (
    TracingServerInterceptor,
    publish_ports,
    setup_tracing,
    shutdown_tracing,
)
from specserve.serving.tls import load as load_tls
from specserve.state.store import REDIS_DOWN, SessionStore, connect
from specserve.v1 import generation_pb2, generation_pb2_grpc, policy_pb2, policy_pb2_grpc

log = logging.getLogger("specserve.router")

HEALTH_INTERVAL_S = 1.0


async def redis_answers(redis: aioredis.Redis) -> bool:
    try:
        return bool(await asyncio.wait_for(redis.ping(), 2.0))
    except (*REDIS_DOWN, TimeoutError, OSError):
        return False


async def wait_for_redis(redis: aioredis.Redis, timeout_s: float = 60.0) -> None:
    """Start-up waits for Redis (it may be loading its AOF) rather than crash-looping."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not await redis_answers(redis):
        if asyncio.get_running_loop().time() > deadline:
            raise SystemExit(f"Redis did not answer within {timeout_s:.0f} s")
        await asyncio.sleep(0.5)


def builtin_policy(settings: RouterSettings) -> Policy:
    """`default` while none is stored: the router's default pool and K under the controller."""
    pools = settings.draft_pools
    if settings.default_pool not in pools or settings.default_k == 0:
        return Policy(DEFAULT_CLASS, mode="off", draft_pool="")
    return Policy(DEFAULT_CLASS, mode="enabled", draft_pool=settings.default_pool, k=settings.default_k)


def classifier_from(settings: RouterSettings) -> Classifier:
    rules = None
    if settings.classifier_rules is not None:
        try:
            rules = [Rule(**r) for r in settings.classifier_rules]
            for r in rules:
                r.compiled()
        except Exception as exc:
            raise SystemExit(f"SPECSERVE_ROUTER_CLASSIFIER_RULES: {exc}") from exc
    return Classifier(rules, fallback=settings.classifier_fallback)


async def seed_policies(store: PolicyStore, settings: RouterSettings) -> None:
    """Create the configured policies whose class has none yet; a stored policy wins."""
    for cls, fields in settings.policies.items():
        try:
            policy = Policy.from_dict({**fields, "workload_class": cls}).validate(set(settings.draft_pools))
        except InvalidRequest as exc:
            raise SystemExit(f"SPECSERVE_ROUTER_POLICIES: {exc}") from exc
        try:
            await store.set(policy, "router-config", "", expected_version=0, comment="seeded at start",
                            action="seed")
            log.info("seeded policy for %s", cls)
        except PolicyConflict:
            pass


async def main(settings: RouterSettings) -> None:
    setup_tracing("specserve-router")
    model = ModelInfo(settings.tokenizer)
    classifier = classifier_from(settings)
    redis = connect(settings.redis_url)
    store = SessionStore(redis, prefix=settings.key_prefix, ttl_s=settings.session_ttl_s, lease_s=settings.lease_s)
    tls = load_tls(settings.tls_dir, settings.tls_server_name)
    pools = {name: DraftPool(name, addrs, tls=tls) for name, addrs in settings.draft_pools.items()}
    targets = TargetDirectory(redis, settings.key_prefix, settings.target_wait_s, settings.admission_wait_s, tls=tls)
    metrics = RouterMetrics()
    policy_store = PolicyStore(redis, settings.key_prefix)
    policies = PolicyCache(policy_store, builtin_policy(settings), settings.policy_reload_s)
    controller = Controller(redis, settings.key_prefix, settings.controller_half_life_s, settings.controller_refresh_s,
                            settings.controller_min_rounds, settings.stats_ttl_s)
    shadow_log = ShadowLog(redis, settings.key_prefix, settings.stats_ttl_s)

    owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
    sessions = Sessions(store, targets, owner, metrics, Ownership(reap_s=settings.reap_s))
    planner = Planner(policies, controller, pools, metrics)
    service = GenerationService(settings, model, classifier, planner, sessions, store)
    servicer = GenerationServicer(service)
    tokens = {name: tok.get_secret_value() for name, tok in settings.admin_tokens.items()}
    if settings.admin_token.get_secret_value():
        tokens.setdefault("admin", settings.admin_token.get_secret_value())
    admin = PolicyAdminServicer(policy_store, policies, planner, tokens, shadow_log)

    def add(server) -> None:
        generation_pb2_grpc.add_GenerationServicer_to_server(servicer, server)
        policy_pb2_grpc.add_PolicyAdminServicer_to_server(admin, server)

    server = GrpcServer([generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name,
                         policy_pb2.DESCRIPTOR.services_by_name["PolicyAdmin"].full_name],
                        settings.host, settings.port, settings.grace_s, add,
                        interceptors=[TracingServerInterceptor()], limits=ServerLimits(
                            settings.max_message_bytes, settings.max_concurrent_rpcs),
                        credentials=tls.server(require_client_cert=False) if tls else None)
    await server.start()
    serving = False
    http = None
    if settings.http_port >= 0:
        api = OpenAIApp(service, settings.model_name, ChatTemplate.for_model(settings.tokenizer),
                        {k.get_secret_value() for k in settings.api_keys}, settings.http_max_in_flight,
                        lambda: serving, metrics)
        http = await start_http(api.app, settings.host, settings.http_port)
        if settings.http_port_file:
            Path(settings.http_port_file).write_text(str(http[2]))
    publish_ports(server.port, settings.port_file, metrics.registry, settings.metrics_port,
                  settings.metrics_port_file, settings.host)
    await wait_for_redis(redis)
    await seed_policies(policy_store, settings)
    await policies.start()
    await controller.start()
    await targets.refresh()

    async def watch() -> None:  # Redis, draft replica health and target registry
        nonlocal serving  # the HTTP API's /health follows Redis as gRPC health does
        while True:
            up = await redis_answers(redis)
            if up != serving:  # health follows Redis: without it no session can be served
                if up:  # a Redis that came back without its data gets the configured policies
                    with contextlib.suppress(*REDIS_DOWN):
                        await seed_policies(policy_store, settings)
                await (server.set_serving() if up else server.set_not_serving())
                (log.info if up else log.error)("Redis %s", "is back: SERVING" if up else
                                                f"is unreachable at {settings.redis_url}: NOT_SERVING")
                serving = up
            await asyncio.gather(*(p.check_health() for p in pools.values()), targets.refresh(),
                                 return_exceptions=True)
            metrics.serving.set(int(serving))
            for name, pool in pools.items():  # the alert on a pool with no replica left reads this
                metrics.pool_healthy.labels(name).set(pool.healthy)
            await asyncio.sleep(HEALTH_INTERVAL_S)

    reaper = asyncio.create_task(sessions.reap_forever())
    await server.set_serving()
    serving = True
    watcher = asyncio.create_task(watch())  # from SERVING on: it flips `serving` with Redis
    log.info("router serving on %s:%d (pools: %s)%s", settings.host, server.port, ", ".join(pools) or "none",
             f"; HTTP on {settings.host}:{http[2]}" if http else "")
    await server.wait_for_termination()
    serving = False
    if http is not None:  # in-flight HTTP requests get uvicorn's graceful shutdown
        http[0].should_exit = True
        await asyncio.gather(http[1], return_exceptions=True)
    for task in (watcher, reaper):
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    await asyncio.gather(*(p.close() for p in pools.values()), targets.close(), policies.close(),
                         controller.close())
    await redis.aclose()
    shutdown_tracing()
    log.info("router drained and stopped")


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    asyncio.run(main(RouterSettings()))
