"""Redis under Sentinel (ADR 0023): the services' client follows a `redis+sentinel://` address
to the primary, and after the primary is killed (SIGKILL) and the sentinels promote its
replica, the same client reaches the new primary within the outage ride-through and finds
what was replicated. Real processes: a primary, a replica and three sentinels on loopback."""

from __future__ import annotations

import asyncio
import time

import pytest

from specserve.state.connection import connect, parse_sentinel_url, ride_out
from specserve.tooling.redis_server import MASTER, start_redis_ha


@pytest.fixture()
def ha(tmp_path):
    servers = start_redis_ha(tmp_path)
    yield servers
    servers.stop()


def test_sentinel_urls_name_their_sentinels_master_and_password():
    assert parse_sentinel_url("redis+sentinel://:pw@127.0.0.1:1,10.0.0.2:2/specserve/3") == (
        [("127.0.0.1", 1), ("10.0.0.2", 2)], "specserve", "pw", 3)
    with pytest.raises(ValueError, match="master name"):
        parse_sentinel_url("redis+sentinel://127.0.0.1:1")
    with pytest.raises(ValueError, match="host:port"):
        parse_sentinel_url("redis+sentinel://127.0.0.1/specserve")


def test_the_client_follows_a_failover_to_the_promoted_replica(ha):
    async def go():
        client = connect(ha.url)
        for i in range(50):
            await client.rpush("tokens", i)
        acked = await client.wait(1, 5000)  # replicated before the primary dies (what WAIT acknowledges)
        assert acked == 1, "the replica did not acknowledge the writes"
        before = (await client.connection_pool.get_master_address())[1] if hasattr(
            client.connection_pool, "get_master_address") else None
        ha.primary.kill()
        t0 = time.monotonic()
        await ride_out(lambda: client.rpush("tokens", 50), outage_s=30.0)
        pause = time.monotonic() - t0
        got = [int(x) for x in await client.lrange("tokens", 0, -1)]
        after = (await client.connection_pool.get_master_address())[1]
        await client.aclose()
        return before, after, got, pause

    before, after, got, pause = asyncio.run(go())
    assert before == ha.primary.port and after == ha.replica.port  # the replica was promoted
    assert got == list(range(51))  # nothing acknowledged by the replica was lost, nothing twice
    print(f"sentinel failover of {MASTER}: the client's write waited {pause:.2f} s")
    assert pause < 30.0
