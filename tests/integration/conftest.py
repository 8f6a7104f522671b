"""Integration fixtures: a private redis-server (never the machine's own 6379), an asyncio
runner per test, and a store on a key prefix of its own.

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

from specserve.redis_server import LocalRedis, start_redis
from specserve.store import SessionStore

Run = Callable[[Coroutine[Any, Any, Any]], Any]


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalRedis]:
    server = start_redis(tmp_path_factory.mktemp("redis"))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def run() -> Iterator[Run]:
    with asyncio.Runner() as runner:
        yield runner.run


@pytest.fixture
def redis_client(redis_server: LocalRedis, run: Run) -> Iterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
    run(client.flushdb())
    yield client
    run(client.aclose())


@pytest.fixture
def store(redis_client: aioredis.Redis) -> SessionStore:
    return SessionStore(redis_client, prefix=f"t{uuid.uuid4().hex[:8]}", ttl_s=600)
