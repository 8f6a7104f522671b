"""`python -m specserve.services.router`: the Generation service in front of the draft pools and the
target. SERVING once Redis answers; targets are discovered per request."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
import uuid
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

from specserve.config import RouterSettings
from specserve.control.controller import Controller, ShadowLog
from specserve.control.policy import DEFAULT_CLASS, Policy, PolicyCache, PolicyConflict, PolicyStore
from specserve.errors import InvalidRequest
from specserve.model_info import ModelInfo
from specserve.services.router.adapter_admin import AdapterAdminServicer
from specserve.services.router.admin import PolicyAdminServicer
from specserve.services.router.classifier import Classifier, Rule
from specserve.services.router.openai_api import OpenAIApp, start_http
from specserve.services.router.planner import Planner
from specserve.services.router.pools import DraftPool
from specserve.services.router.service import GenerationService, GenerationServicer
from specserve.services.router.sessions import Ownership, Sessions
from specserve.services.router.targets import TargetDirectory
from specserve.serving.chat import ChatTemplate
from specserve.serving.grpc_server import GrpcServer, ServerLimits, run_main
from specserve.serving.metrics import RouterMetrics
from specserve.serving.telemetry import (
    TracingServerInterceptor,
    publish_ports,
    setup_tracing,
    shutdown_tracing,
)
from specserve.serving.tls import load as load_tls
from specserve.state.adapters import AdapterRegistry
from specserve.state.store import REDIS_DOWN, SessionStore, connect
from specserve.v1 import adapter_pb2, adapter_pb2_grpc, generation_pb2, generation_pb2_grpc, policy_pb2, policy_pb2_grpc

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
    """`default` while none is stored: the router's default pool under the controller, which
    may move a class to any other pool this router has (ADR 0006: a deployment's pools are
    there to be used; a stored policy narrows them), with adaptive K up to the router's
    default K: the engine picks each round's K, or plain, at the load it runs at (ADR 0014)."""
    pools = settings.draft_pools
    if settings.default_pool not in pools or settings.default_k == 0:
        return Policy(DEFAULT_CLASS, mode="off", draft_pool="")
    others = tuple(sorted(p for p in pools if p != settings.default_pool))
    return Policy(DEFAULT_CLASS, mode="enabled", draft_pool=settings.default_pool, draft_pools=others,
                  k=settings.default_k, adaptive_k=True, k_min=1, k_max=settings.default_k)


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
    if moved := await store.migrate_layout():
        log.info("copied %d policies from the key layout before ADR 0023", moved)
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


class Router:
    """The router's parts, built from its settings, and what it does with them: serve gRPC
    and HTTP, follow Redis and the pools' health, drain."""

    def __init__(self, settings: RouterSettings) -> None:
        self.settings = settings
        self.redis = redis = connect(settings.redis_url)
        store = SessionStore(redis, prefix=settings.key_prefix, ttl_s=settings.session_ttl_s,
                             lease_s=settings.lease_s, replica_acks=settings.replica_acks,
                             replica_wait_s=settings.redis_replica_wait_s)
        self.tls = tls = load_tls(settings.tls_dir, settings.tls_server_name)
        self.pools = {name: DraftPool(name, addrs, tls=tls) for name, addrs in settings.draft_pools.items()}
        self.targets = TargetDirectory(redis, settings.key_prefix, settings.target_wait_s, settings.admission_wait_s,
                                       tls=tls)
        self.metrics = metrics = RouterMetrics()
        store.replicas.on_unreplicated = metrics.unreplicated.inc
        self.store = store
        self.policy_store = PolicyStore(redis, settings.key_prefix)
        self.policies = PolicyCache(self.policy_store, builtin_policy(settings), settings.policy_reload_s)
        self.controller = Controller(redis, settings.key_prefix, settings.controller_half_life_s,
                                     settings.controller_refresh_s, settings.controller_min_rounds,
                                     settings.stats_ttl_s)
        owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
        self.sessions = Sessions(store, self.targets, owner, metrics, Ownership(reap_s=settings.reap_s))
        planner = Planner(self.policies, self.controller, self.pools, metrics)
        self.service = GenerationService(settings, ModelInfo(settings.tokenizer), classifier_from(settings), planner,
                                         self.sessions, store)
        tokens = {name: tok.get_secret_value() for name, tok in settings.admin_tokens.items()}
        if settings.admin_token.get_secret_value():
            tokens.setdefault("admin", settings.admin_token.get_secret_value())
        self.admin = PolicyAdminServicer(self.policy_store, self.policies, planner, tokens,
                                         ShadowLog(redis, settings.key_prefix, settings.stats_ttl_s))
        self.adapters = AdapterAdminServicer(self.targets, AdapterRegistry(redis, settings.key_prefix), tokens)
        self.serving = False  # the HTTP API's /health follows it as gRPC health does
        self.http: tuple[Any, asyncio.Task, int] | None = None  # uvicorn's server, its task, its port

    def grpc_server(self) -> GrpcServer:
        servicer, s = GenerationServicer(self.service), self.settings

        def add(server) -> None:
            generation_pb2_grpc.add_GenerationServicer_to_server(servicer, server)
            policy_pb2_grpc.add_PolicyAdminServicer_to_server(self.admin, server)
            adapter_pb2_grpc.add_AdapterAdminServicer_to_server(self.adapters, server)  # (ADR 0029)

        self.server = GrpcServer([generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name,
                                  policy_pb2.DESCRIPTOR.services_by_name["PolicyAdmin"].full_name,
                                  adapter_pb2.DESCRIPTOR.services_by_name["AdapterAdmin"].full_name],
                                 s.host, s.port, s.grace_s, add, interceptors=[TracingServerInterceptor()],
                                 limits=ServerLimits(s.max_message_bytes, s.max_concurrent_rpcs),
                                 credentials=self.tls.server(require_client_cert=False) if self.tls else None)
        return self.server

    async def start_http(self) -> None:
        s = self.settings
        if s.http_port < 0:
            return
        api = OpenAIApp(self.service, s.model_name, ChatTemplate.for_model(s.tokenizer),
                        {k.get_secret_value() for k in s.api_keys}, s.http_max_in_flight, lambda: self.serving,
                        self.metrics)
        self.http = await start_http(api.app, s.host, s.http_port)
        if s.http_port_file:
            Path(s.http_port_file).write_text(str(self.http[2]))

    async def start_control(self) -> None:
        """Once Redis answers: the configured policies, the caches, the target registry."""
        await wait_for_redis(self.redis)
        await seed_policies(self.policy_store, self.settings)
        await self.policies.start()
        await self.controller.start()
        await self.targets.refresh()

    async def watch(self) -> None:
        """Health follows Redis (without it no session can be served); the draft replicas'
        health and the target registry are refreshed every HEALTH_INTERVAL_S."""
        while True:
            up = await redis_answers(self.redis)
            if up != self.serving:
                if up:  # a Redis that came back without its data gets the configured policies
                    with contextlib.suppress(*REDIS_DOWN):
                        await seed_policies(self.policy_store, self.settings)
                await (self.server.set_serving() if up else self.server.set_not_serving())
                (log.info if up else log.error)("Redis %s", "is back: SERVING" if up else
                                                f"is unreachable at {self.settings.redis_url}: NOT_SERVING")
                self.serving = up
            await asyncio.gather(*(p.check_health() for p in self.pools.values()), self.targets.refresh(),
                                 return_exceptions=True)
            self.metrics.serving.set(int(self.serving))
            for name, pool in self.pools.items():  # the alert on a pool with no replica left reads this
                self.metrics.pool_healthy.labels(name).set(pool.healthy)
            await asyncio.sleep(HEALTH_INTERVAL_S)

    async def drain(self, tasks: list[asyncio.Task]) -> None:
        self.serving = False
        if self.http is not None:  # in-flight HTTP requests get uvicorn's graceful shutdown
            self.http[0].should_exit = True
            await asyncio.gather(self.http[1], return_exceptions=True)
        for task in tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await asyncio.gather(*(p.close() for p in self.pools.values()), self.targets.close(), self.policies.close(),
                             self.controller.close())
        await self.store.aclose()
        await self.redis.aclose()


async def main(settings: RouterSettings) -> None:
    setup_tracing("specserve-router")
    router = Router(settings)
    server = router.grpc_server()
    await server.start()
    await router.start_http()
    publish_ports(server.port, settings.port_file, router.metrics.registry, settings.metrics_port,
                  settings.metrics_port_file, settings.host)
    await router.start_control()
    reaper = asyncio.create_task(router.sessions.reap_forever())
    await server.set_serving()
    router.serving = True
    watcher = asyncio.create_task(router.watch())  # from SERVING on: it flips `serving` with Redis
    log.info("router serving on %s:%d (pools: %s)%s", settings.host, server.port,
             ", ".join(router.pools) or "none", f"; HTTP on {settings.host}:{router.http[2]}" if router.http else "")
    await server.wait_for_termination()
    t0 = time.monotonic()
    log.info("router draining: gRPC stopped in %.1f s (grace %.0f s)", time.monotonic() - server.stop_began,
             settings.grace_s)
    await router.drain([watcher, reaper])
    log.info("router drain: HTTP and background tasks in %.1f s", time.monotonic() - t0)
    shutdown_tracing()
    log.info("router drained and stopped")


if __name__ == "__main__":
    run_main(main, RouterSettings())
