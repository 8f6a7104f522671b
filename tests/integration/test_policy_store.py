"""The controller's statistics script and the policy store on a real redis-server."""

from __future__ import annotations

import asyncio

import pytest

from specserve.control.controller import Controller
from specserve.control.policy import Policy, PolicyCache, PolicyConflict, PolicyStore


def test_statistics_decay_by_half_life(redis_client, run):
    ctrl = Controller(redis_client, prefix="t", half_life_s=10.0)
    key = ctrl.key("c", "p")

    async def go():
        await ctrl._add(keys=[key], args=[1000.0, 10.0, 60, "n:4", 8, "pa:1", 4])
        await ctrl._add(keys=[key], args=[1010.0, 10.0, 60, "n:4", 2])  # one half-life later
        await ctrl._add(keys=[key], args=[1005.0, 10.0, 60, "n:4", 1])  # a late writer: no decay backwards
        return await redis_client.hgetall(key), await redis_client.ttl(key)

    raw, ttl = run(go())
    assert float(raw["n:4"]) == pytest.approx(8 * 0.5 + 2 + 1)
    assert float(raw["pa:1"]) == pytest.approx(4 * 0.5)
    assert float(raw["_t"]) == 1010.0 and 0 < ttl <= 60


def test_record_flush_and_read_back(redis_client, run):
    ctrl = Controller(redis_client, prefix="t2", half_life_s=3600.0)

    async def go():
        for _ in range(3):
            ctrl.record("code", "small", 4, 2, 3.0, 10.0, 1.0)
        ctrl.record("code", None, 4, 0, 0.0, 8.0, 1.0)  # a plain round
        await ctrl.flush()
        await ctrl.refresh({("code", "small")})
        return ctrl._stats

    stats = run(go())
    spec, plain = stats[("code", "small")], stats[("code", "none")]
    assert spec["n:4"] == pytest.approx(3, rel=1e-3) and spec["pe:3"] == pytest.approx(3, rel=1e-3)
    assert ("pa:3" not in spec and plain["n:0"] == pytest.approx(1, rel=1e-3)
            and plain["v:0"] == pytest.approx(8, rel=1e-3))


def test_policy_store_cas_audit_and_cache(redis_client, run):
    store = PolicyStore(redis_client, prefix="t3")
    cache = PolicyCache(store, Policy("default", draft_pool="small"))

    async def go():
        await cache.start()
        try:
            v1 = await store.set(Policy("code", draft_pool="small"), "alice", expected_version=0)
            with pytest.raises(PolicyConflict):
                await store.set(Policy("code", draft_pool="small", k=2), "bob", expected_version=0)
            v2 = await store.set(Policy("code", draft_pool="small", k=2), "bob", expected_version=1)
            for _ in range(100):  # pub/sub reaches the cache
                if cache.effective("code")[0].version == 2:
                    break
                await asyncio.sleep(0.01)
            seen = cache.effective("code")
            assert await store.list() == [v2]  # from the class index
            assert await store.delete("code", "carol")
            assert await store.list() == []
            assert not await store.delete("code", "carol")  # nothing left: no audit entry
            for _ in range(100):
                if "code" not in cache.policies:
                    break
                await asyncio.sleep(0.01)
            return v1, v2, seen, cache.effective("code"), await store.audit("code")
        finally:
            await cache.close()

    v1, v2, seen, after, audit = run(go())
    assert (v1.version, v2.version) == (1, 2) and seen == (v2, "class")
    assert after[1] == "builtin"
    assert [(e.action, e.who) for e in audit] == [("delete", "carol"), ("set", "bob"), ("set", "alice")]
    assert audit[1].old == v1 and audit[1].new is not None and audit[1].new.k == 2


def test_policies_in_the_key_layout_before_adr_0023_are_copied_once(redis_client, run):
    store = PolicyStore(redis_client, prefix="t5")

    async def go():
        # what an earlier router wrote: `{p}:policies`, `{p}:policy:{class}`, `{p}:policy-audit`
        old = Policy("code", draft_pool="small", k=6)
        await redis_client.sadd("t5:policies", "code")
        await redis_client.hset("t5:policy:code", mapping={"body": old.body(), "version": 3, "updated_by": "alice",
                                                           "updated_at": 1.0})
        await redis_client.xadd("t5:policy-audit", {"at": "1.0", "who": "alice", "peer": "", "action": "set",
                                                    "class": "code", "old_body": "", "old_version": 0,
                                                    "new_body": old.body(), "new_version": 3, "comment": ""})
        # two routers upgraded at once: one copies (the other would have copied the audit twice)
        moved = await asyncio.gather(store.migrate_layout(), PolicyStore(redis_client, prefix="t5").migrate_layout())
        again = await store.migrate_layout()  # today's index exists now: nothing more
        return sorted(moved), again, await store.list(), await store.audit("code")

    moved, again, policies, audit = run(go())
    assert (moved, again) == ([0, 1], 0)
    assert [(p.workload_class, p.k, p.version, p.updated_by) for p in policies] == [("code", 6, 3, "alice")]
    assert [(a.who, a.new.k) for a in audit] == [("alice", 6)]
