"""The services' Redis client: a bounded, blocking pool whose commands retry on a fresh
connection, and `ride_out` for the callers that wait out a longer outage (ADR 0011)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ClusterDownError, NoScriptError, ReadOnlyError, SlotNotCoveredError, TryAgainError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

# Redis is down, restarting or still loading its AOF (BusyLoadingError is a ConnectionError);
# a Cluster is re-electing a master (CLUSTERDOWN, TRYAGAIN, a slot no node serves yet); a
# Sentinel's old primary answers READONLY once demoted (ADR 0023).
REDIS_DOWN = (RedisConnectionError, RedisTimeoutError, ClusterDownError, TryAgainError, SlotNotCoveredError,
              ReadOnlyError)
OUTAGE_BACKOFF_S, OUTAGE_BACKOFF_MAX_S = 0.05, 1.0


SENTINEL_SCHEME = "redis+sentinel://"
CLUSTER_SCHEME = "redis+cluster://"


def _hosts(hosts: str, url: str, what: str) -> list[tuple[str, int]]:
    out = []
    for h in hosts.split(","):
        host, _, port = h.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"{what} address {h!r} in {url!r} is not host:port")
        out.append((host, int(port)))
    return out


def _auth(rest: str) -> tuple[str, str]:
    """(password, the rest) of `[:password@]rest`."""
    if "@" not in rest:
        return "", rest
    auth, rest = rest.rsplit("@", 1)
    return (auth.split(":", 1)[1] if ":" in auth else auth), rest


def parse_cluster_url(url: str) -> tuple[list[tuple[str, int]], str]:
    """`redis+cluster://[:password@]h1:p1[,h2:p2...]` -> (startup nodes, password)."""
    password, rest = _auth(url[len(CLUSTER_SCHEME):])
    hosts, _, path = rest.partition("/")
    if not hosts:
        raise ValueError(f"a Cluster URL needs nodes: {CLUSTER_SCHEME}[:password@]host:port[,host:port], got {url!r}")
    if path.strip("/") not in ("", "0"):
        raise ValueError(f"a Redis Cluster has only database 0, got {url!r}")
    return _hosts(hosts, url, "cluster node"), password


def parse_sentinel_url(url: str) -> tuple[list[tuple[str, int]], str, str, int]:
    """`redis+sentinel://[:password@]h1:p1,h2:p2/master[/db]` -> (sentinels, master, password,
    db); ValueError naming what is missing."""
    password, rest = _auth(url[len(SENTINEL_SCHEME):])
    hosts, _, path = rest.partition("/")
    parts = [p for p in path.split("/") if p]
    if not hosts or not parts:
        raise ValueError(f"a Sentinel URL needs sentinels and a master name: {SENTINEL_SCHEME}"
                         f"[:password@]host:port[,host:port]/master[/db], got {url!r}")
    sentinels = _hosts(hosts, url, "sentinel")
    return sentinels, parts[0], password, int(parts[1]) if len(parts) > 1 else 0


def _sentinel(url: str) -> Redis:
    from redis.asyncio.sentinel import Sentinel

    sentinels, master, password, db = parse_sentinel_url(url)
    # the sentinels themselves take no password here (`requirepass` on the data nodes only)
    s = Sentinel(sentinels, socket_connect_timeout=2.0, socket_timeout=5.0)
    return s.master_for(master, password=password or None, db=db, socket_connect_timeout=2.0,
                        retry=Retry(ExponentialBackoff(cap=0.5, base=0.02), 3), retry_on_error=list(REDIS_DOWN),
                        health_check_interval=10, max_connections=MAX_CONNECTIONS)


def _cluster(url: str) -> Redis:
    from redis.asyncio.cluster import ClusterNode, RedisCluster

    class Cluster(RedisCluster):
        """redis-py's cluster client, with one of its races made an outage: while the client
        re-reads the slots after a node died, a connection can be torn down under a command
        that is still connecting, and the command fails with AttributeError ('NoneType' has no
        'writelines'; seen in the Cluster failover test under load). That is Redis being
        away, to be ridden out like any other (REDIS_DOWN), not a bug of the caller's."""

        async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
            try:
                return await super().execute_command(*args, **kwargs)
            except AttributeError as exc:
                raise RedisConnectionError(f"a Redis Cluster connection was reset mid-command: {exc}") from exc

    nodes, password = parse_cluster_url(url)
    # (a RedisCluster, not a Redis: the store uses only what both have; typed as the store's)
    client: Any = Cluster(startup_nodes=[ClusterNode(h, p) for h, p in nodes], password=password or None,
                               socket_connect_timeout=2.0, max_connections=MAX_CONNECTIONS,
                               retry=Retry(ExponentialBackoff(cap=0.5, base=0.02), 3),
                               retry_on_error=list(REDIS_DOWN))
    return client


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
    The pool blocks when full (MAX_CONNECTIONS) rather than raising.

    `redis+sentinel://[:password@]host:port[,host:port...]/master[/db]` (ADR 0023): the
    primary Sentinel names for `master`, found again after a failover (a command that meets
    the old primary's closed socket or a demoted replica's READONLY asks the sentinels anew).
    `redis+cluster://[:password@]host:port[,host:port...]`: a Redis Cluster (ADR 0023); the
    client follows the slots' owners (MOVED, ASK) and a promoted replica."""
    if url.startswith(SENTINEL_SCHEME):
        return _sentinel(url)
    if url.startswith(CLUSTER_SCHEME):
        return _cluster(url)
    pool = BlockingConnectionPool.from_url(
        url, max_connections=MAX_CONNECTIONS, timeout=POOL_WAIT_S,
        retry=Retry(ExponentialBackoff(cap=0.5, base=0.02), 3), retry_on_error=list(REDIS_DOWN),
        socket_connect_timeout=2.0, health_check_interval=10)
    return Redis.from_pool(pool)


def raise_if_cancelled() -> None:
    """Raise CancelledError where this task was cancelled but the read it awaited returned.
    redis-py's blocking reads can swallow a cancellation: one that lands as an XREAD's block
    runs out comes back as the empty reply (seen with redis-py 8.1 on Python 3.11, in about
    one cancel in ten of a follower blocked 50 ms at a time). A loop around such a read calls
    this after each, so that a cancelled follower stops instead of reading on forever."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


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


async def evalsha_pipeline(client: Any, calls: Sequence[tuple[Any, list[str], list[Any]]]) -> list[Any]:
    """Script calls (a registered script, keys, args) on `client`, answered in order: one EVALSHA,
    or one pipeline of them. redis-py's pipeline of script objects first asks SCRIPT EXISTS for
    them, a round trip more a pipeline (the engine's commits paid it every step, ADR 0028). Here a
    script the server lacks (NOSCRIPT: after a restart) is loaded and the calls it refused are
    sent again: a call refused NOSCRIPT did not run, and a server lacks a script for every call
    of it at once. An error reply raises the first, as a pipeline's execute does."""
    if len(calls) == 1:  # the script object's own call: EVALSHA, and on NOSCRIPT a load and again
        script, keys, args = calls[0]
        return [await script(keys=keys, args=args, client=client)]
    replies = await _evalsha(client, calls, range(len(calls)))
    missing = [i for i, r in enumerate(replies) if isinstance(r, NoScriptError)]
    if missing:
        for script in {id(calls[i][0]): calls[i][0] for i in missing}.values():
            await client.script_load(script.script)
        for i, reply in zip(missing, await _evalsha(client, calls, missing), strict=True):
            replies[i] = reply
    for reply in replies:
        if isinstance(reply, Exception):
            raise reply
    return replies


async def _evalsha(client: Any, calls: Sequence[tuple[Any, list[str], list[Any]]], which: Sequence[int]) -> list:
    async with client.pipeline(transaction=False) as pipe:
        for i in which:
            script, keys, args = calls[i]
            pipe.evalsha(script.sha, len(keys), *keys, *args)
        return list(await pipe.execute(raise_on_error=False))
