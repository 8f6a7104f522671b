"""Session ownership in the store (ADR 0011): a lease the owner renews, adoption only once it
lapses (one winner), the `running` index the reapers read, and readers that survive Redis
losing its last commits (a restart inside the AOF's fsync window)."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from specserve.state.store import Chunk, CommitStatus, SessionStore

pytestmark = pytest.mark.timeout(60)

PARAMS = {"max_tokens": 16}
PROMPT = [5, 6, 7]


def rid() -> str:
    return uuid.uuid4().hex


@pytest.fixture
def short(redis_client) -> SessionStore:
    return SessionStore(redis_client, prefix=f"o{uuid.uuid4().hex[:8]}", ttl_s=600, lease_s=0.3)


def test_adoption_waits_for_the_lease_and_has_one_winner(short, run):
    async def body():
        h = await short.create_or_join(None, PARAMS, PROMPT, owner="a")
        assert await short.adopt(h.session_id, "b") is None  # the owner's lease holds
        assert await short.orphans() == []
        for _ in range(3):  # the owner's heartbeat keeps it
            await asyncio.sleep(0.15)
            assert (await short.heartbeat(h.session_id, h.epoch))[0] == "ok"
        assert await short.adopt(h.session_id, "b") is None
        await asyncio.sleep(0.4)  # the owner went silent
        assert await short.orphans() == [h.session_id]
        won = await asyncio.gather(*(short.adopt(h.session_id, f"r{i}") for i in range(5)))
        assert sorted(won, key=str) == [2, None, None, None, None]  # exactly one new epoch
        # the old owner is fenced out: its heartbeat and its commits are refused
        assert (await short.heartbeat(h.session_id, h.epoch))[0] == "stale_epoch"
        old = await short.commit(h.session_id, 0, h.epoch, rid(), [1], "a", None)
        assert old.status is CommitStatus.STALE_EPOCH

    run(body())


def test_running_index_forgets_closed_sessions(short, redis_client, run):
    async def body():
        a = await short.create_or_join(None, PARAMS, PROMPT, owner="a")
        b = await short.create_or_join(None, PARAMS, PROMPT, owner="a")
        running = set()
        for key in {short._keys(a.session_id)[4], short._keys(b.session_id)[4]}:
            running |= await redis_client.smembers(key)
        assert running == {a.session_id, b.session_id}
        await short.commit(a.session_id, 0, a.epoch, rid(), [1], "x", "eos")
        assert await short.cancel(b.session_id)
        for key in short.running_keys:
            assert await redis_client.smembers(key) == set()
        await asyncio.sleep(0.4)
        assert await short.orphans() == [] and await short.adopt(a.session_id, "b") is None

    run(body())


def test_unread_seconds_count_from_the_last_read(short, run):
    async def body():
        h = await short.create_or_join(None, PARAMS, PROMPT, owner="a")
        await asyncio.sleep(0.3)
        _, unread = await short.heartbeat(h.session_id, h.epoch)
        assert unread >= 0.25
        await short.mark_read(h.session_id)
        _, unread = await short.heartbeat(h.session_id, h.epoch)
        assert unread < 0.25
        assert await short.abandon(h.session_id, h.epoch, "nobody read it") is CommitStatus.OK
        assert (await short.get(h.session_id)).error == "nobody read it"

    run(body())


def test_a_reader_trims_commits_redone_from_a_shorter_prefix(short, redis_client, run):
    """Redis came back without the last commit (lost in the fsync window): the session is
    driven again from the shorter prefix in bigger rounds. A reader that had delivered the
    lost tokens goes on from where it was: nothing repeated, nothing skipped."""
    async def body():
        h = await short.create_or_join(None, PARAMS, PROMPT, owner="a")
        sid = h.session_id
        await short.commit(sid, 0, h.epoch, rid(), [1, 2], "ab", None)
        await short.commit(sid, 2, h.epoch, rid(), [3, 4], "cd", None)
        reader = short.read_chunks(sid, 0, block_ms=50)
        seen = [await anext(reader), await anext(reader)]
        assert [c.offset for c in seen] == [0, 2]
        # Redis "loses" the second commit: what a restart inside the window leaves
        base = short.session_key(sid)
        first = (await redis_client.xrange(f"{base}:out", "0-1", "0-1"))[0][1]
        await redis_client.delete(f"{base}:out")  # (XDEL would keep the stream's last id)
        await redis_client.xadd(f"{base}:out", first, id="0-1")
        await redis_client.ltrim(f"{base}:tok", 0, 1)
        await redis_client.hset(base, "committed", 2)
        epoch = await short.take_over(sid, "a")
        await short.commit(sid, 2, epoch, rid(), [3], "c", None)  # redone in other rounds
        await short.commit(sid, 3, epoch, rid(), [4, 5, 6], "def", "length")
        rest = [c async for c in reader]
        assert rest == [Chunk(4, (5, 6), "", "length", partial=True)]

    run(body())


STALE = "ff" + "c" * 30  # a session id in the last shard


def test_the_reapers_sample_reaches_every_shard_of_the_running_index(short, redis_client, run):
    """The running index is 256 shards; a reap samples about `limit` ids across them. With the
    first half of the shards holding two ids each and one stale id in the last shard, a reap of
    256 must still reach it (a sample cut in shard order, as before, never did: that id would
    never be seen, so its session never re-placed). Stale ids (no session) leave the index."""
    async def body():
        for tag in range(128):
            await redis_client.sadd(short.running_keys[tag], f"{tag:02x}" + "a" * 30, f"{tag:02x}" + "b" * 30)
        await redis_client.sadd(short.running_keys[255], STALE)
        assert await short.orphans(limit=256) == []  # none has a session: all stale
        return await redis_client.sismember(short.running_keys[255], STALE)

    assert not run(body())  # reached, and dropped from the index
