"""The services' Redis client: a bounded, blocking pool whose commands retry on a fresh
connection, and `ride_out` for the callers that wait out a longer outage (ADR 0011)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

# Redis is down, restarting or still loading its AOF (BusyLoadingError is a ConnectionError).
REDIS_DOWN = (RedisConnectionError, RedisTimeoutError)
OUTAGE_BACKOFF_S, OUTAGE_BACKOFF_MAX_S = 0.05, 1.0


# Every stream reader holds a connection for its blocking XREAD, so a router's connections
# grow with its streams (64 streams moved onto one router by a kill took more than redis-py's
# default 100, and the pool's "Too many connections" read as Redis being down). A command
# beyond this waits up to POOL_WAIT_S for a free connection instead of failing.
MAX_CONNECTIONS = 1024
POOL_WAIT_S = 20.0


def connect(url: str) -> Redis:
    """The services' client. Each command is retried a few times with a fresh connection, so
    a pooled socket that a Redis restart closed costs nothing; longer outages are ridden
    out by the callers (`ride_out`, `read_chunks(outage_s=...)`). The retry class must be
    redis.asyncio's: the sync one hands the coroutine back unawaited, so nothing retries.
    The pool blocks when full (MAX_CONNECTIONS) rather than raising."""
    pool = BlockingConnectionPool.from_url(
        url, max_connections=MAX_CONNECTIONS, timeout=POOL_WAIT_S,
        retry=Retry(ExponentialBackoff(cap=0.5, base=0.02), 3), retry_on_error=list(REDIS_DOWN),
        socket_connect_timeout=2.0, health_check_interval=10)
    return Redis.from_pool(pool)


async def ride_out(call: Callable[[], Awaitable[Any]], outage_s: float) -> Any:
    """`call()`, retried with backoff while Redis is down, for up to `outage_s` (then raised).
    Only for calls that are safe to repeat (a commit is: its round id makes a repeat a no-op)."""
    deadline, backoff = time.monotonic() + outage_s, OUTAGE_BACKOFF_S
    while True:
        try:
            return await call()
        except REDIS_DOWN:
            if time.monotonic() >= deadline:
                raise
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, OUTAGE_BACKOFF_MAX_S)
