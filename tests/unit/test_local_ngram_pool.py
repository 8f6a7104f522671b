"""A `local:ngram` pool: n-gram drafting inside the target's process (ADR 0014, "n-gram beside
the target"). The settings accept it only as a pool's only address; the router's view of it
has no replica to probe and always counts it healthy."""

from __future__ import annotations

import asyncio

import pytest
from pydantic import ValidationError

from specserve.config import LOCAL_NGRAM, RouterSettings, TargetSettings


@pytest.mark.parametrize("settings", [RouterSettings, TargetSettings])
def test_local_ngram_is_a_pools_only_address(settings):
    s = settings(draft_pools={"ngram": [LOCAL_NGRAM], "small": ["127.0.0.1:1"]})
    assert s.draft_pools["ngram"] == [LOCAL_NGRAM]
    for bad in ([LOCAL_NGRAM, "127.0.0.1:1"], ["local:small"], [LOCAL_NGRAM, LOCAL_NGRAM]):
        with pytest.raises(ValidationError, match="only address"):
            settings(draft_pools={"ngram": bad})


def test_the_routers_view_of_a_local_pool_needs_no_replica():
    from specserve.services.router.pools import DraftPool

    async def go() -> tuple[int, int]:
        pool = DraftPool("ngram", [LOCAL_NGRAM])
        await pool.check_health()  # nothing to ask: no channel was made
        remote = DraftPool("small", ["127.0.0.1:9"])  # nothing listens there
        await remote.check_health()
        healthy = pool.healthy, remote.healthy
        await asyncio.gather(pool.close(), remote.close())
        return healthy

    assert asyncio.run(go()) == (1, 0)
    assert DraftPool("ngram", [LOCAL_NGRAM]).replicas[LOCAL_NGRAM].channel is None
