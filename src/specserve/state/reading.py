"""Reading a session's committed chunks from its `:out` stream: catch up, then follow live
commits, riding out Redis restarts and failovers (the readers of DESIGN §5: GenerateStream,
Resume).

Under a replicated Redis (ADR 0023) a reader serves only what a replica holds: each read is
one pipeline on one connection, `[read, a write of the session's read_at, WAIT n]`. The
replication stream is ordered, so a replica that acknowledged the write holds every commit
the read returned; Sentinel promotes the most advanced replica, so a failover never takes
back a served token. A read that is not acknowledged is not served: it is repeated (on the
new primary, after a failover) until it is, or for `replica_wait_s`, after which it is
served unreplicated and counted (the store's `unreplicated_reads`)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial
from typing import TYPE_CHECKING, Any

from redis.exceptions import AskError, MovedError

from specserve.errors import InvalidRequest, ServedTokensChanged, SessionNotFound
from specserve.state.connection import OUTAGE_BACKOFF_MAX_S, OUTAGE_BACKOFF_S, REDIS_DOWN
from specserve.state.records import Chunk, SessionStatus, as_str

if TYPE_CHECKING:
    from specserve.state.store import SessionStore

log = logging.getLogger("specserve.state")
_PAGE = 256  # stream entries per XRANGE while a reader catches up


async def read_chunks(
    store: SessionStore, session_id: str, from_offset: int = 0, block_ms: int = 1000,
    on_wait: Callable[[], Awaitable[None]] | None = None, outage_s: float = 0.0,
) -> AsyncIterator[Chunk]:
    """Committed chunks from generated token `from_offset` on, then live ones, until the
    chunk that ends the session. `block_ms` bounds each XREAD: between blocks the reader
    checks that the session still exists (so it never waits on an expired one forever),
    marks it read, and awaits `on_wait()` (a follower checks the owner's lease there).

    The reader tracks the offset it has delivered up to, not stream ids: after a Redis
    restart that lost the last commits, the session is driven again from a shorter
    prefix, and the chunks that come are trimmed to that offset, so nothing is repeated
    or skipped. Redis errors are retried with backoff for `outage_s` (then raised)."""
    hash_key, tok_key = store._keys(session_id)[:2]
    if from_offset < 0 or block_ms < 1:
        raise InvalidRequest("read_chunks needs from_offset >= 0 and block_ms >= 1")
    async with store._r.pipeline(transaction=True) as pipe:
        exists, length = await pipe.exists(hash_key).llen(tok_key).execute()
    if not exists:
        raise SessionNotFound(f"session {session_id} does not exist or expired")
    if from_offset > length:
        raise InvalidRequest(f"offset {from_offset} is past the {length} committed tokens")
    pos, down_since, backoff = from_offset, None, OUTAGE_BACKOFF_S
    served: list[int] = []  # what this reader sent, from from_offset: a redone chunk must match it
    while True:  # ride_out's policy, inlined: this is a generator
        try:
            async for chunk in _follow(store, session_id, pos, block_ms, on_wait, served, from_offset):
                yield chunk
                served.extend(chunk.tokens)
                pos, down_since, backoff = chunk.offset + len(chunk.tokens), None, OUTAGE_BACKOFF_S
                if chunk.finish_reason:
                    return
            return  # closed without a final chunk (defensive)
        except _Reseek:
            continue
        except REDIS_DOWN:
            now = time.monotonic()
            down_since = down_since or now
            if now - down_since >= outage_s:
                raise
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, OUTAGE_BACKOFF_MAX_S)

async def _follow(store: SessionStore, session_id: str, pos: int, block_ms: int,
                  on_wait: Callable[[], Awaitable[None]] | None, served: list[int],
                  from_offset: int) -> AsyncIterator[Chunk]:
    hash_key, _, out_key = store._keys(session_id)[:3]
    # The chunk holding pos is the last one that starts at or before it.
    before = await store._r.xrevrange(out_key, max=f"{pos}-1", min="-", count=1)
    start, last_id, catching_up = (as_str(before[0][0]) if before else "-"), "0-0", True
    marked = 0.0
    confirmed = store.replica_acks > 0
    while True:
        closed = False
        if not confirmed and time.monotonic() - marked >= 1.0:  # someone reads it: not abandoned
            await store.mark_read(session_id)  # (a confirmed read marks it with every read)
            marked = time.monotonic()
        if catching_up:  # page through what is already committed
            entries = await _read(store, hash_key, partial(_xrange, out_key, start, _PAGE))
            catching_up = len(entries) == _PAGE
        else:  # follow live commits
            reply = await _read(store, hash_key, partial(_xread, out_key, last_id, block_ms))
            entries = _xread_entries(reply)
            if not entries:
                status = await store._r.hget(hash_key, "status")
                if status is None:
                    raise SessionNotFound(f"session {session_id} expired while being read")
                if as_str(status) == SessionStatus.RUNNING:
                    if on_wait is not None:
                        await on_wait()
                    continue
                # Closed: its final chunk was written with the status, so one read gets it.
                entries = await _read(store, hash_key, partial(_xrange, out_key, f"({last_id}", None))
                closed = True
        for entry_id, fields in entries:
            last_id = as_str(entry_id)
            if _offset(fields) > pos:
                raise _Reseek  # commits were lost and redone: find pos's chunk again
            _check_redone(session_id, fields, pos, served, from_offset)
            chunk = _chunk(fields, pos)
            if chunk is not None:
                yield chunk
                pos = chunk.offset + len(chunk.tokens)
                if chunk.finish_reason:
                    return
        start = f"({last_id}"
        if closed:
            return


class _Reseek(Exception):
    pass


def _xrange(key: str, start: str, count: int | None, client: Any) -> Any:
    return client.xrange(key, min=start, max="+", count=count)


def _xread(key: str, last_id: str, block_ms: int, client: Any) -> Any:
    return client.xread({key: last_id}, block=block_ms)


async def _read(store: SessionStore, hash_key: str, command: Callable[[Any], Any]) -> Any:
    """`command(client)`'s reply; under `replica_acks`, only once a replica acknowledged a
    write issued after it on the same connection (the module's docstring). A primary left
    without replicas (its only one failed over to it, or died) would stall every read: after
    one read waited `replica_wait_s`, reads are served unconfirmed (counted) and a read a
    second probes whether replicas answer again."""
    if store.replica_acks <= 0:
        return await command(store._r)
    since = time.monotonic()
    while True:
        probing = store.unreplicated_since is not None
        if probing and time.monotonic() < store.probe_at:
            store.count_unreplicated()
            return await command(store._r)
        wait_ms = _PROBE_MS if probing else store.replica_wait_ms
        # on a Cluster: a plain client to the node that owns the session's slot (WAIT counts
        # that node's replicas; redis-py's cluster pipeline takes no scripts)
        client = store.node_client(hash_key) if store._cluster else store._r
        try:
            async with client.pipeline(transaction=False) as pipe:
                command(pipe)
                await store._mark_read(keys=[hash_key], client=pipe)
                pipe.execute_command("WAIT", store.replica_acks, wait_ms)
                reply, _, acked = await pipe.execute()
        except (MovedError, AskError, *REDIS_DOWN):
            if not store._cluster:
                raise
            # the slot moved, or its node died: one command through the cluster client follows
            # the redirection and re-reads the slots (it raises REDIS_DOWN while the cluster
            # elects a replica: the reader rides that out), then the read is made again. (A
            # one-key command: redis-py's EXISTS goes through a cluster pipeline instead.)
            await store._r.hget(hash_key, "status")
            continue
        now = time.monotonic()
        if int(acked) >= store.replica_acks:
            store.unreplicated_since = None
            return reply
        if probing or now - since >= store.replica_wait_s:
            if store.unreplicated_since is None:
                store.unreplicated_since = now
                log.warning("no Redis replica acknowledged reads for %.1f s: serving unreplicated (a failover "
                            "now could take tokens back)", now - since)
            store.probe_at = now + _PROBE_EVERY_S
            store.count_unreplicated()
            return reply  # no replica for that long: serve (availability), counted


_PROBE_MS, _PROBE_EVERY_S = 20, 1.0


def _check_redone(session_id: str, fields: dict, pos: int, served: list[int], from_offset: int) -> None:
    """A chunk that starts before `pos` was served in part already (commits lost with a Redis
    restart or an unreplicated failover, then driven again): its served part must be what the
    reader sent. Raised otherwise: the client saw tokens the store no longer holds."""
    offset = _offset(fields)
    if offset >= pos or offset < from_offset:
        return
    f = {as_str(k): as_str(v) for k, v in fields.items()}
    tokens = [int(t) for t in f["tokens"].split(",")] if f["tokens"] else []
    redone = tokens[: pos - offset]
    sent = served[offset - from_offset : offset - from_offset + len(redone)]
    if redone != sent:
        raise ServedTokensChanged(
            f"session {session_id}: tokens {offset}..{offset + len(redone)} were served as {sent} and are now "
            f"committed as {redone} (a Redis failover lost served commits; see ADR 0023)")


def _xread_entries(reply: Any) -> list:
    """XREAD's entries for our one stream; RESP2 answers a list, RESP3 a dict."""
    if not reply:
        return []
    if isinstance(reply, dict):
        return next(iter(reply.values()))[0]
    return reply[0][1]


def _offset(fields: dict) -> int:
    return int(as_str(fields.get("offset", fields.get(b"offset", 0))))


def _chunk(fields: dict, from_offset: int) -> Chunk | None:
    """A stream entry as a Chunk from `from_offset` on; None if it lies wholly before it."""
    f = {as_str(k): as_str(v) for k, v in fields.items()}
    offset = int(f["offset"])
    tokens = tuple(int(t) for t in f["tokens"].split(",")) if f["tokens"] else ()
    finish = f.get("finish_reason") or None
    error = f.get("error") or None
    if offset >= from_offset:
        return Chunk(offset, tokens, f["text"], finish, error=error)
    if offset + len(tokens) <= from_offset and finish is None:
        return None
    # The reader resumed inside this chunk (or right after the last one, and this is the end).
    tail = tokens[from_offset - offset :]
    return Chunk(from_offset, tail, "", finish, partial=True, error=error)
