"""The session/commit store against a real redis-server: atomic, fenced, idempotent commits
(DESIGN §3, invariant 3) and readers that see committed chunks only."""

from __future__ import annotations

import asyncio
import uuid

import pytest
import redis.asyncio as aioredis

from specserve.errors import InvalidRequest, RequestIdConflict, SessionNotFound
from specserve.state.store import Chunk, CommitStatus, SessionStatus, SessionStore

pytestmark = pytest.mark.timeout(60)

PARAMS = {"max_tokens": 16, "temperature": 0.0}
PROMPT = [5, 6, 7]


def rid() -> str:
    return uuid.uuid4().hex


async def new_session(store: SessionStore) -> tuple[str, int]:
    handle = await store.create_or_join(None, PARAMS, PROMPT, owner="router-a")
    return handle.session_id, handle.epoch


async def collect(store: SessionStore, session_id: str, offset: int = 0) -> list[Chunk]:
    return [c async for c in store.read_chunks(session_id, offset, block_ms=50)]


async def _request_session(redis, store: SessionStore, request_id: str) -> str | None:
    """The session a request id names, if it exists (its id is a keyed hash of the request id)."""
    sid = store._session_id_for(request_id)
    return sid if await redis.exists(store.session_key(sid)) else None


def test_retried_request_joins_its_session(store, redis_client, run):
    async def body():
        first = await store.create_or_join("req-1", PARAMS, PROMPT, owner="router-a")
        again = await store.create_or_join("req-1", {"other": 1}, PROMPT, owner="router-b")
        assert first.created and not again.created and again.joined
        assert again.session_id == first.session_id and again.epoch == first.epoch == 1
        assert await _request_session(redis_client, store, "req-1") == first.session_id
        assert await _request_session(redis_client, store, "req-2") is None
        info = await store.get(first.session_id)
        # The first request's params and owner win; a join changes nothing.
        assert (info.status, info.params, info.prompt_ids) == ("running", PARAMS, PROMPT)
        assert (info.owner, info.committed, info.request_id) == ("router-a", 0, "req-1")
        with pytest.raises(RequestIdConflict):
            await store.create_or_join("req-1", PARAMS, [9, 9], owner="router-a")
        a, b = await new_session(store), await new_session(store)
        assert a[0] != b[0]  # without a request_id every call is a new session

    run(body())


def test_concurrent_create_or_join_creates_exactly_one(store, redis_client, run):
    async def body():
        handles = await asyncio.gather(
            *(store.create_or_join("same", PARAMS, PROMPT, owner=f"r{i}") for i in range(20))
        )
        assert sum(h.created for h in handles) == 1
        assert len({h.session_id for h in handles}) == 1
        hashes = [k async for k in redis_client.scan_iter(f"{store.prefix}:sess:*")]
        assert hashes == [store.session_key(handles[0].session_id)]

    run(body())


def test_commit_appends_tokens_and_one_stream_entry_per_chunk(store, redis_client, run):
    async def body():
        sid, epoch = await new_session(store)
        r1 = await store.commit(sid, 0, epoch, rid(), [10, 11, 12], "abc", None)
        r2 = await store.commit(sid, 3, epoch, rid(), [13, 14], "de", None)
        assert (r1.status, r1.committed_len, r2.status, r2.committed_len) == ("ok", 3, "ok", 5)
        assert await store.committed_tokens(sid) == [10, 11, 12, 13, 14]
        assert (await store.get(sid)).committed == 5
        entries = await redis_client.xrange(store.session_key(sid) + ":out")
        assert [fields for _, fields in entries] == [
            {"offset": "0", "tokens": "10,11,12", "text": "abc", "finish_reason": ""},
            {"offset": "3", "tokens": "13,14", "text": "de", "finish_reason": ""},
        ]

    run(body())


def test_stale_expected_len_is_refused_and_writes_nothing(store, redis_client, run):
    async def body():
        sid, epoch = await new_session(store)
        await store.commit(sid, 0, epoch, rid(), [10, 11, 12], "abc", None)
        round_id = rid()
        stale = await store.commit(sid, 0, epoch, round_id, [99], "z", None)
        assert (stale.status, stale.committed_len) == (CommitStatus.STALE_LEN, 3)
        assert not stale.applied
        assert await store.committed_tokens(sid) == [10, 11, 12]
        assert await redis_client.xlen(store.session_key(sid) + ":out") == 1
        # The refused round was not recorded, so the same round at the right length applies.
        retry = await store.commit(sid, 3, epoch, round_id, [99], "z", None)
        assert (retry.status, retry.committed_len) == (CommitStatus.OK, 4)

    run(body())


def test_take_over_fences_the_previous_owner(store, run):
    async def body():
        sid, old_epoch = await new_session(store)
        new_epoch = await store.take_over(sid, owner="router-b")
        assert new_epoch == old_epoch + 1
        stale = await store.commit(sid, 0, old_epoch, rid(), [1], "x", None)
        assert stale.status is CommitStatus.STALE_EPOCH
        assert await store.fail(sid, old_epoch, "old router") is CommitStatus.STALE_EPOCH
        assert await store.committed_tokens(sid) == []
        ok = await store.commit(sid, 0, new_epoch, rid(), [1], "x", None)
        assert ok.status is CommitStatus.OK
        info = await store.get(sid)
        assert (info.owner, info.epoch, info.status) == ("router-b", new_epoch, "running")
        with pytest.raises(SessionNotFound):
            await store.take_over(uuid.uuid4().hex, owner="router-b")

    run(body())


def test_duplicate_round_id_is_a_no_op(store, redis_client, run):
    async def body():
        sid, epoch = await new_session(store)
        round_id = rid()
        await store.commit(sid, 0, epoch, round_id, [10, 11], "ab", None)
        again = await store.commit(sid, 0, epoch, round_id, [10, 11], "ab", None)
        assert (again.status, again.committed_len, again.applied) == ("duplicate", 2, True)
        # A retry that arrives after later rounds is still recognised, not refused as stale.
        await store.commit(sid, 2, epoch, rid(), [12], "c", "stop")
        late = await store.commit(sid, 0, epoch, round_id, [10, 11], "ab", None)
        assert (late.status, late.committed_len) == (CommitStatus.DUPLICATE, 3)
        assert await store.committed_tokens(sid) == [10, 11, 12]
        assert await redis_client.xlen(store.session_key(sid) + ":out") == 2

    run(body())


def test_commit_after_finish_or_cancel_is_closed(store, redis_client, run):
    async def body():
        done, epoch = await new_session(store)
        assert (await store.commit(done, 0, epoch, rid(), [1], "a", "stop")).status == "ok"
        info = await store.get(done)
        assert (info.status, info.finish_reason) == (SessionStatus.FINISHED, "stop")
        assert (await store.commit(done, 1, epoch, rid(), [2], "b", None)).status == "closed"
        assert await store.cancel(done) is False  # finished sessions stay finished

        cancelled, epoch = await new_session(store)
        await store.commit(cancelled, 0, epoch, rid(), [1, 2], "ab", None)
        assert await store.cancel(cancelled) is True
        assert await store.cancel(cancelled) is False
        result = await store.commit(cancelled, 2, epoch, rid(), [3], "c", None)
        assert (result.status, result.committed_len) == (CommitStatus.CLOSED, 2)
        info = await store.get(cancelled)
        assert (info.status, info.finish_reason) == (SessionStatus.CANCELLED, "cancelled")
        last = await redis_client.xrevrange(store.session_key(cancelled) + ":out", count=1)
        assert last[0][1]["finish_reason"] == "cancelled" and last[0][1]["offset"] == "2"
        assert await store.cancel(uuid.uuid4().hex) is False  # unknown session

    run(body())


def test_fail_closes_the_session_and_tells_readers_why(store, run):
    async def body():
        sid, epoch = await new_session(store)
        await store.commit(sid, 0, epoch, rid(), [1], "a", None)
        assert await store.fail(sid, epoch, "target lost") is CommitStatus.OK
        info = await store.get(sid)
        assert (info.status, info.finish_reason, info.error) == ("failed", "error", "target lost")
        chunks = await collect(store, sid)
        assert chunks[-1] == Chunk(1, (), "", "error", error="target lost")
        assert (await store.commit(sid, 1, epoch, rid(), [2], "b", None)).status == "closed"

    run(body())


def test_read_chunks_from_zero_and_from_inside_a_chunk(store, run):
    async def body():
        sid, epoch = await new_session(store)
        await store.commit(sid, 0, epoch, rid(), [1, 2, 3], "abc", None)
        await store.commit(sid, 3, epoch, rid(), [4, 5], "de", "length")
        assert await collect(store, sid, 0) == [
            Chunk(0, (1, 2, 3), "abc", None),
            Chunk(3, (4, 5), "de", "length"),
        ]
        assert await collect(store, sid, 1) == [
            Chunk(1, (2, 3), "", None, partial=True),
            Chunk(3, (4, 5), "de", "length"),
        ]
        assert await collect(store, sid, 3) == [Chunk(3, (4, 5), "de", "length")]
        # Resuming at the very end still learns that (and why) the session ended.
        assert await collect(store, sid, 5) == [Chunk(5, (), "", "length", partial=True)]
        with pytest.raises(InvalidRequest):
            await collect(store, sid, 6)
        with pytest.raises(SessionNotFound):
            await collect(store, uuid.uuid4().hex)
        with pytest.raises(InvalidRequest):
            await collect(store, "../not-a-session")

    run(body())


def test_read_chunks_follows_live_commits(store, run):
    async def body():
        sid, epoch = await new_session(store)
        rounds = [[1, 2], [3], [4, 5, 6]]

        async def router():
            length = 0
            for i, tokens in enumerate(rounds):
                await asyncio.sleep(0.1)  # the reader is blocked in XREAD by now
                final = "stop" if i == len(rounds) - 1 else None
                result = await store.commit(sid, length, epoch, rid(), tokens, f"t{i}", final)
                assert result.status is CommitStatus.OK
                length = result.committed_len

        chunks, _ = await asyncio.gather(collect(store, sid), router())
        assert [c.tokens for c in chunks] == [(1, 2), (3,), (4, 5, 6)]
        assert [c.offset for c in chunks] == [0, 2, 3]
        assert [c.text for c in chunks] == ["t0", "t1", "t2"]
        assert chunks[-1].finish_reason == "stop"

    run(body())


def test_cancel_ends_a_live_reader(store, run):
    async def body():
        sid, epoch = await new_session(store)
        await store.commit(sid, 0, epoch, rid(), [1], "a", None)
        reader = asyncio.create_task(collect(store, sid))
        await asyncio.sleep(0.1)
        assert not reader.done()  # blocked: the session is still running
        assert await store.cancel(sid)
        chunks = await asyncio.wait_for(reader, timeout=5)
        assert chunks == [Chunk(0, (1,), "a", None), Chunk(1, (), "", "cancelled")]

    run(body())


def test_every_key_is_prefixed_and_has_a_refreshed_ttl(store, redis_client, run):
    async def body():
        handle = await store.create_or_join("req-ttl", PARAMS, PROMPT, owner="router-a")
        sid = handle.session_id
        await store.commit(sid, 0, handle.epoch, rid(), [1, 2], "ab", None)
        base = store.session_key(sid)
        expected = {base, f"{base}:tok", f"{base}:out", f"{base}:rounds", store._keys(sid)[4]}
        assert all(k.startswith(store.prefix + ":") for k in expected)  # (built by the code under test)
        assert {k async for k in redis_client.scan_iter("*")} == expected
        for key in expected:
            assert 0 < await redis_client.ttl(key) <= store.ttl_s, key
            await redis_client.expire(key, 5)
        # Every commit pushes every key's expiry out again: an active session never expires.
        await store.commit(sid, 2, handle.epoch, rid(), [3], "c", None)
        for key in expected:
            assert await redis_client.ttl(key) > 5, key
        # Another prefix is another namespace.
        other = SessionStore(redis_client, prefix=store.prefix + "x")
        assert await other.get(sid) is None
        assert await _request_session(redis_client, other, "req-ttl") is None

    run(body())


def test_bad_commits_are_refused_before_redis(store, run):
    async def body():
        sid, epoch = await new_session(store)
        with pytest.raises(InvalidRequest):
            await store.commit(sid, 0, epoch, rid(), [], "", None)  # nothing, and not final
        with pytest.raises(InvalidRequest):
            await store.commit(sid, -1, epoch, rid(), [1], "a", None)
        missing = await store.commit(uuid.uuid4().hex, 0, 1, rid(), [1], "a", None)
        assert missing.status is CommitStatus.MISSING
        # An empty final commit is allowed: it only ends the session (e.g. a stop at a boundary).
        assert (await store.commit(sid, 0, epoch, rid(), [], "", "stop")).status == "ok"
        assert await collect(store, sid) == [Chunk(0, (), "", "stop")]

    run(body())


def test_store_works_on_a_bytes_client(redis_server, run):
    async def body():
        client = aioredis.Redis.from_url(redis_server.url)  # decode_responses=False
        try:
            store = SessionStore(client, prefix=f"b{uuid.uuid4().hex[:8]}")
            handle = await store.create_or_join("req-b", PARAMS, PROMPT, owner="router-a")
            await store.commit(handle.session_id, 0, handle.epoch, rid(), [7, 8], "hé", "stop")
            assert await _request_session(client, store, "req-b") == handle.session_id
            assert (await store.get(handle.session_id)).finish_reason == "stop"
            assert await collect(store, handle.session_id) == [Chunk(0, (7, 8), "hé", "stop")]
        finally:
            await client.aclose()

    run(body())


def test_the_services_client_rides_a_redis_restart_on_its_pooled_connections(tmp_path, run):
    """After a restart every pooled socket is dead; the client `connect` gives the services
    retries each command on a fresh one, so the first script, pipeline and stream read after
    the restart succeed without the caller seeing it (issue 13: routers answered UNAVAILABLE
    "Connection closed by server" here while their retry class was the synchronous one)."""
    from specserve.state.store import connect
    from specserve.tooling.redis_server import start_redis

    servers = [start_redis(tmp_path / "redis")]
    try:
        server = servers[0]

        async def body():
            client = connect(server.url)
            store = SessionStore(client, prefix="restart", ttl_s=600)
            sid, epoch = await new_session(store)
            # several pooled connections, so the restart leaves several dead sockets behind
            await asyncio.gather(*(client.ping() for _ in range(4)))
            assert (await store.commit(sid, 0, epoch, "r1", [1, 2], "ab", "")).status is CommitStatus.OK
            # SIGTERM: Redis writes its AOF out, loses nothing; the new server is stopped below
            servers.append(await asyncio.to_thread(server.restart))
            # first a plain command, then a script, then a pipeline and stream reads
            assert (await store.get(sid)).status is SessionStatus.RUNNING
            assert (await store.commit(sid, 2, epoch, "r2", [3], "c", "eos")).status is CommitStatus.OK
            chunks = await collect(store, sid)
            assert [list(c.tokens) for c in chunks] == [[1, 2], [3]] and chunks[-1].finish_reason == "eos"
            await client.aclose()

        run(body())
    finally:
        for s in servers:
            s.stop()


def test_the_services_client_waits_for_a_pooled_connection_rather_than_failing(redis_server, run):
    """More blocking stream reads at once than redis-py's default pool holds (100): each gets
    a connection (the pool grows to MAX_CONNECTIONS, then waits), none fails with "Too many
    connections" (which the router took for Redis being down, in the 64-stream soak)."""
    from specserve.state.store import MAX_CONNECTIONS, connect

    readers = 150
    assert readers <= MAX_CONNECTIONS

    async def body():
        client = connect(redis_server.url)
        try:
            got = await asyncio.gather(*(client.xread({f"pool-test:{i}": "$"}, block=300) for i in range(readers)))
            assert got == [[] for _ in range(readers)]  # every read ran its block out, empty
        finally:
            await client.aclose()

    run(body())


def test_a_request_ids_session_made_again_after_its_hash_expired_starts_empty(store, redis_client, run):
    """A request id names its session (ADR 0023), so a request sent again after its session's
    hash expired gets the same id: what the old session's other keys still held is cleared."""
    async def body():
        first = await store.create_or_join("req-again", PARAMS, PROMPT, owner="router-a")
        await store.commit(first.session_id, 0, first.epoch, rid(), [1, 2], "ab", None)
        await redis_client.delete(store.session_key(first.session_id))  # the hash expired first
        again = await store.create_or_join("req-again", PARAMS, [7], owner="router-b")
        assert again.created and again.session_id == first.session_id
        assert await store.committed_tokens(again.session_id) == []
        assert await redis_client.xlen(store.session_key(again.session_id) + ":out") == 0
        assert not await redis_client.exists(store.session_key(again.session_id) + ":rounds")  # its round ids too

    run(body())


def test_a_cancelled_follower_stops_though_redis_py_swallows_the_cancel(redis_server, run, monkeypatch):
    """redis-py's blocking XREAD can swallow a task's cancellation (one that lands as the block
    runs out returns the empty reply): the router's stream follower and the suffix pool's fleet
    follower, each a loop around such a read, read on forever after a cancel (the suite's
    teardown of test_suffix_fleet.py hung on it). Each is cancelled 120 times at a random
    moment of its 20 ms blocks and must stop within 2 s every time; before
    `raise_if_cancelled`, a few dozen cancels reached one that was swallowed."""
    import random

    from specserve.state import follow
    from specserve.state.store import connect
    from specserve.state.suffix_share import SuffixShare

    rng = random.Random(5)
    monkeypatch.setattr(follow, "BLOCK_MS", 20)

    async def stops(start) -> None:
        for i in range(120):
            task = await start()
            await asyncio.sleep(rng.random() * 0.05)
            task.cancel()
            done, _ = await asyncio.wait({task}, timeout=2.0)
            assert done and task.cancelled(), f"cancel {i} was swallowed: the follower reads on"

    async def body():
        client = connect(redis_server.url)
        store = SessionStore(client, prefix=f"c{uuid.uuid4().hex[:6]}", ttl_s=60)
        sid, _ = await new_session(store)
        share = SuffixShare(client, store.prefix, origin="here")
        await share.publish("agent", [1, 2, 3], max_requests=4)
        await share.load()

        async def fleet() -> asyncio.Task:
            return asyncio.get_running_loop().create_task(share.follow(lambda out: None, block_ms=20))

        async def router() -> asyncio.Task:  # the router's one XREAD for every stream it follows
            f = follow.StreamFollower(store)
            await f.follow(store._keys(sid)[2], "0-0")
            assert f._task is not None
            return f._task

        try:
            await stops(router)
            await stops(fleet)
        finally:
            await client.aclose()

    run(body())
