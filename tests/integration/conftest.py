"""Integration fixtures: a private redis-server (never the machine's own 6379), an asyncio
runner per test, and a store on a key prefix of its own. The store's tests (sessions,
commits, readers, ownership, policies: whatever takes `redis_client`) run twice: on one Redis
and on a local Redis Cluster of three masters with a replica each (ADR 0023).

Tests are plain functions that call `run(coro)`: one event loop per test, shared by the
fixtures and the test body, because a redis.asyncio connection belongs to the loop that
opened it. No pytest-asyncio needed.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable, Coroutine, Iterator
from typing import Any

import pytest
import redis.asyncio as aioredis

from specserve.state.connection import parse_cluster_url
from specserve.state.store import SessionStore
from specserve.tooling.redis_server import (
    LocalRedis,
    LocalRedisCluster,
    start_redis,
    start_redis_cluster,
)

Run = Callable[[Coroutine[Any, Any, Any]], Any]


def _started(start: Callable[[Any], Any], directory: Any) -> Iterator[Any]:
    servers = start(directory)
    try:
        yield servers
    finally:
        servers.stop()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalRedis]:
    yield from _started(start_redis, tmp_path_factory.mktemp("redis"))


@pytest.fixture
def run() -> Iterator[Run]:
    with asyncio.Runner() as runner:
        yield runner.run


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalRedisCluster]:
    yield from _started(start_redis_cluster, tmp_path_factory.mktemp("redis-cluster"))


@pytest.fixture(params=["redis", "cluster"])
def redis_client(request, redis_server: LocalRedis, run: Run) -> Iterator[aioredis.Redis]:
    if request.param == "redis":
        client = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
    else:  # the services' cluster client, as `connect` makes it, decoding as the one above
        from redis.asyncio.cluster import ClusterNode, RedisCluster

        nodes, password = parse_cluster_url(request.getfixturevalue("redis_cluster").url)
        client = RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in nodes], password=password,
                              decode_responses=True)
    run(client.flushdb())
    yield client
    run(client.aclose())


@pytest.fixture
def store(redis_client: aioredis.Redis) -> SessionStore:
    return SessionStore(redis_client, prefix=f"t{uuid.uuid4().hex[:8]}", ttl_s=600)


@pytest.fixture(scope="session")
def otlp_receiver():
    """A real OTLP/gRPC trace receiver the services export to."""
    from specserve.tooling.otlp_receiver import OtlpReceiver

    receiver = OtlpReceiver().start()
    yield receiver
    receiver.stop()


@pytest.fixture(scope="session")
def stack(demo_pair_dir, tmp_path_factory: pytest.TempPathFactory, otlp_receiver):
    """The whole system on loopback: its own redis-server, a Ray head owned by the target
    launcher, pools `small` (2 model replicas), `ngram` (1), `ngram-local`, `eagle-local`,
    `suffix` and `draft-local` (drafted inside the target: no replica), `eagle` (1 replica of the
    pair's head) and `small-records` (the demo LoRA adapter's drafter), the adapter loaded on the
    target, and the router; every service
    exports its spans to `otlp_receiver`."""
    from specserve.tooling.stack import PoolSpec, Stack, StackSpec

    run_dir = tmp_path_factory.mktemp("stack")
    spec = StackSpec(
        pair_dir=str(demo_pair_dir), run_dir=str(run_dir),
        pools={"small": PoolSpec("draft", replicas=2), "ngram": PoolSpec("ngram", replicas=1),
               "ngram-local": PoolSpec("ngram", local=True),
               # the pair's EAGLE head, beside the target and on a replica fed its features
               "eagle-local": PoolSpec("eagle", local=True), "eagle": PoolSpec("eagle", replicas=1),
               "suffix": PoolSpec("suffix", local=True),  # suffix decoding (ADR 0026)
               # the pair's draft model inside the target (ADR 0025; on the engine's thread on this CPU)
               "draft-local": PoolSpec("draft", local=True),
               # the demo adapter's own drafter: the draft with its draft-side LoRA merged (ADR 0029)
               "small-records": PoolSpec("draft", replicas=1, lora="adapters/records-nested/draft")},
        adapters={"records-nested": "adapters/records-nested/target"},  # loaded at start (ADR 0029)
        target_threads=1,
        # tests kill workers on purpose: fail over fast, and wait long enough for Ray's restart
        router_env={"SPECSERVE_ROUTER_TARGET_WAIT_S": "180",
                    "SPECSERVE_ROUTER_MAX_TOKENS_LIMIT": "256",
                    "SPECSERVE_ROUTER_ADMIN_TOKEN": "lora-admin"},  # (tests/integration/test_lora.py)
        env={"SPECSERVE_TRACING": "otlp", "OTEL_EXPORTER_OTLP_ENDPOINT": otlp_receiver.endpoint,
             "OTEL_TRACES_SAMPLER": "always_on"},
    )
    with Stack(spec).running(timeout_s=480) as s:
        yield s
