"""The host path a step, not a token (ADR 0028), on a real redis-server and a local Cluster: a
step's commits in one script call (one a hash tag on a Cluster), one read for every stream a
router follows, live chunks that came together served as one, and the target registry read
from its index rather than a SCAN of the keyspace."""

from __future__ import annotations

import asyncio
import json
import uuid
from dataclasses import dataclass

import pytest
from redis.crc import key_slot

from specserve.services.router.targets import TargetDirectory
from specserve.state import follow
from specserve.state.reading import _chunks
from specserve.state.store import Chunk, CommitStatus, SessionStore

pytestmark = pytest.mark.timeout(60)

PARAMS = {"max_tokens": 64, "temperature": 0.0}


@dataclass(frozen=True)
class Round:
    session_id: str
    epoch: int
    expected_len: int
    round_id: str
    tokens: tuple[int, ...]
    text: str
    finish_reason: str | None = None
    stats: str = ""


async def _sessions(store: SessionStore, n: int) -> list[str]:
    return [(await store.create_or_join(None, PARAMS, [1, 2], owner="t")).session_id for _ in range(n)]


def test_a_steps_commits_are_one_script_call_on_one_redis_and_one_a_hash_tag_on_a_cluster(store, run):
    async def body():
        sids = await _sessions(store, 24)
        calls: list[list[str]] = []
        scripts = store._scripts

        async def counted(batch):
            calls.extend(keys for _, keys, _ in batch)
            return await scripts(batch)

        store._scripts = counted
        step = [Round(s, 1, 0, f"{s}:0", (10 + i,), "a") for i, s in enumerate(sids)]
        step.append(Round(sids[0], 1, 1, f"{sids[0]}:1", (99,), "b", "length", stats='{"rounds": []}'))
        results = await store.commit_batch(step)
        assert [r.status for r in results] == [CommitStatus.OK] * 25
        assert [r.committed_len for r in results] == [1] * 24 + [2]  # the same session's two rounds, in order
        if store._nodes is None:  # one Redis: the whole step in one call
            assert len(calls) == 1 and len(calls[0]) == 5 * 25
        else:  # a Cluster: one call a hash tag, its keys in one slot
            assert len(calls) == len({s[:2] for s in sids})
            assert all(len({key_slot(k.encode()) for k in keys}) == 1 for keys in calls)
        assert await store.committed_tokens(sids[0]) == [10, 99]
        info = await store.get(sids[0])
        assert (info.status, info.finish_reason, info.stats) == ("finished", "length", {"rounds": []})
        again = await store.commit_batch(step[:3])  # a retried step: every round a no-op
        assert [r.status for r in again] == [CommitStatus.DUPLICATE] * 3

    run(body())


def test_one_read_serves_every_stream_a_store_follows(store, run):
    """16 readers, 12 steps of one commit each: every reader gets its session's tokens exactly,
    and on one Redis the follower read a few times a step, not once a commit; on a Cluster each
    reader reads its own stream (no follower)."""
    async def body():
        sids = await _sessions(store, 16)
        readers = [asyncio.ensure_future(_collect(store, s)) for s in sids]
        await asyncio.sleep(0.3)  # every reader has caught up and follows
        steps = 12
        for n in range(steps):
            final = "length" if n == steps - 1 else None
            await store.commit_batch([Round(s, 1, n, f"{s}:{n}", (n,), f"<{n}>", final) for s in sids])
            await asyncio.sleep(0.02)
        for chunks in await asyncio.gather(*readers):
            assert [t for c in chunks for t in c.tokens] == list(range(steps))
            assert "".join(c.text for c in chunks) == "".join(f"<{n}>" for n in range(steps))
            assert [c.offset for c in chunks] == [sum(len(c.tokens) for c in chunks[:i]) for i in range(len(chunks))]
            assert chunks[-1].finish_reason == "length"
        if store._nodes is None:
            assert store.follower is not None and not store.follower.subs  # every reader left
            assert store.follower.reads <= 3 * steps + 2 * len(sids), store.follower.reads  # commits: 192
        else:
            assert store.follower is None
        await store.aclose()

    run(body())


def test_a_new_reader_wakes_the_followers_blocked_read(store, run, monkeypatch):
    """A reader that subscribes while the follower blocks on other streams gets its first chunk at
    once: its doorbell ends the blocked read (held here for 30 s, the test's limit twice over)."""
    if store._nodes is not None:
        pytest.skip("a Cluster has no follower: each reader reads its own stream")
    monkeypatch.setattr(follow, "BLOCK_MS", 30_000)

    async def body():
        first, second = await _sessions(store, 2)
        reading = asyncio.ensure_future(_collect(store, first))
        await asyncio.sleep(0.3)  # the follower blocks on `first`'s stream
        late = store.read_chunks(second, 0, block_ms=50)
        chunk = asyncio.ensure_future(anext(late))
        await asyncio.sleep(0.3)
        await store.commit(second, 0, 1, "r", [7], "x", None)  # (not the last: no reader polls it closed)
        assert (await asyncio.wait_for(chunk, 10)).tokens == (7,)
        await store.commit(second, 1, 1, "r2", [9], "z", "length")
        assert [c.tokens async for c in late] == [(9,)]
        await store.commit(first, 0, 1, "r", [8], "y", "length")
        assert [c.tokens for c in await reading] == [(8,)]
        await store.aclose()

    run(body())


def test_live_chunks_that_came_together_are_served_as_one_and_caught_up_ones_as_committed():
    sid = uuid.uuid4().hex
    entries = [(f"{o}-1", {"offset": str(o), "tokens": str(10 + o), "text": f"t{o}", "finish_reason": ""})
               for o in range(3)]
    entries.append(("3-1", {"offset": "3", "tokens": "13", "text": "t3", "finish_reason": "length"}))
    live, last = _chunks(sid, entries, 0, [], 0, "0-0", merge=True)
    assert last == "3-1"
    assert live == [Chunk(0, (10, 11, 12), "t0t1t2", None), Chunk(3, (13,), "t3", "length")]
    caught_up, _ = _chunks(sid, entries, 0, [], 0, "0-0", merge=False)
    assert [c.offset for c in caught_up] == [0, 1, 2, 3]
    resumed, _ = _chunks(sid, entries, 1, [10], 0, "0-0", merge=True)  # from inside: the tail as a chunk
    assert [c.offset for c in resumed] == [1, 3] and resumed[0].tokens == (11, 12)


def test_routers_find_targets_in_the_registrys_index_and_drop_the_expired(redis_client, run):
    prefix = f"reg{uuid.uuid4().hex[:6]}"

    async def body():
        head = f"{prefix}:target:"
        for name, port in (("t0", 1), ("t1", 2)):
            await redis_client.set(head + name, json.dumps({"address": f"127.0.0.1:{port}", "name": name}))
        directory = TargetDirectory(redis_client, prefix)
        # an empty index (targets older than it): found by a SCAN, as before
        assert sorted(t.name for t in await directory.refresh()) == ["t0", "t1"]
        await redis_client.sadd(f"{prefix}:targets", "t0", "gone")
        # with an index, only its names (t1 is no longer looked for); a name whose entry expired leaves it
        assert [t.name for t in await directory.refresh()] == ["t0"]
        assert await redis_client.smembers(f"{prefix}:targets") == {"t0"}
        await directory.close()

    run(body())


async def _collect(store: SessionStore, session_id: str) -> list[Chunk]:
    return [c async for c in store.read_chunks(session_id, 0, block_ms=50)]
