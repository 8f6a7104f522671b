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

from redis.exceptions import AskError, MovedError, NoScriptError

from specserve.errors import InvalidRequest, ServedTokensChanged, SessionNotFound
from specserve.state import scripts
from specserve.state.connection import OUTAGE_BACKOFF_MAX_S, OUTAGE_BACKOFF_S, REDIS_DOWN, raise_if_cancelled
from specserve.state.records import Chunk, SessionStatus, as_str

if TYPE_CHECKING:
    from specserve.state.follow import Subscription
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
    # The chunk holding pos is the last one that starts at or before it (from the start: the first).
    before = await store._r.xrevrange(out_key, max=f"{pos}-1", min="-", count=1) if pos else None
    start, last_id, catching_up = (as_str(before[0][0]) if before else "-"), "0-0", True
    marked = 0.0
    follower = store.follower  # one read for every stream this router follows (None on a Cluster)
    sub: Subscription | None = None
    marks = store.replicas.acks == 0 or follower is not None  # (else every read marks it: _read)
    try:
        while True:
            closed, live = False, not catching_up
            if marks and time.monotonic() - marked >= 1.0:  # someone reads it: not abandoned
                await store.mark_read(session_id)
                marked = time.monotonic()
            if catching_up:  # page through what is already committed
                entries = await _read(store, hash_key, partial(_xrange, out_key, start, _PAGE))
                catching_up = len(entries) == _PAGE
            else:  # follow live commits
                if follower is not None and sub is None:
                    sub = await follower.follow(out_key, last_id)
                entries = await sub.next(block_ms) if sub is not None else _xread_entries(
                    await _read(store, hash_key, partial(_xread, out_key, last_id, block_ms)))
                raise_if_cancelled()
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
            chunks, last_id = _chunks(session_id, entries, pos, served, from_offset, last_id, merge=live)
            for chunk in chunks:
                yield chunk
                pos = chunk.offset + len(chunk.tokens)
                if chunk.finish_reason:
                    return
            start = f"({last_id}"
            if closed:
                return
    finally:
        if sub is not None and follower is not None:
            follower.unfollow(sub)


def _chunks(session_id: str, entries: list, pos: int, served: list[int], from_offset: int,
            last_id: str, merge: bool) -> tuple[list[Chunk], str]:
    """One read's entries as the chunks to serve from `pos` on (and the last entry's id).
    With `merge` (a live read), whole chunks that came in one read are served as one: a reader
    that fell behind by several commits sends one message for them, not one each (ADR 0028).
    What a reader catches up on is served as committed, a chunk a commit, and so is a last
    chunk (its finish reason, or the error)."""
    out: list[Chunk] = []
    for entry_id, fields in entries:
        last_id = as_str(entry_id)
        entry = _entry(fields)
        if entry.offset > pos:
            raise _Reseek  # commits were lost and redone: find pos's chunk again
        _check_redone(session_id, entry, pos, served, from_offset)
        chunk = _from(entry, pos)
        if chunk is None:
            continue
        prev = out[-1] if merge and out else None
        if prev is not None and not (prev.partial or chunk.partial or prev.finish_reason or chunk.finish_reason):
            out[-1] = Chunk(prev.offset, prev.tokens + chunk.tokens, prev.text + chunk.text, None)
        else:
            out.append(chunk)
        pos = chunk.offset + len(chunk.tokens)
        if chunk.finish_reason:
            break
    return out, last_id


class _Reseek(Exception):
    pass


def _xrange(key: str, start: str, count: int | None, client: Any) -> Any:
    return client.xrange(key, min=start, max="+", count=count)


def _xread(key: str, last_id: str, block_ms: int, client: Any) -> Any:
    return client.xread({key: last_id}, block=block_ms)


class ReplicaAcks:
    """How many replicas a read waits for (`acks`; 0 = none, one Redis), for how long
    (`wait_s`), and the fallback when none answers: after one read waited `wait_s`, reads are
    served unconfirmed (counted; `on_unreplicated` is the router's counter) and one read a
    second probes whether replicas answer again. One per store: every reader of it shares it."""

    def __init__(self, acks: int = 0, wait_s: float = 2.0) -> None:
        if not isinstance(acks, int) or acks < 0:
            raise InvalidRequest(f"store replica_acks must be an int >= 0, got {acks!r}")
        self.acks = acks
        self.wait_s = wait_s
        self.unreplicated_reads = 0
        self.on_unreplicated: Callable[[], None] | None = None
        self._since: float | None = None  # no replica answered since then: reads unconfirmed
        self._probe_at = 0.0

    @property
    def degraded(self) -> bool:
        """No replica has answered lately: reads go unconfirmed, with a probe a second."""
        return self._since is not None

    def wait_ms(self, now: float) -> int | None:
        """One WAIT's timeout for a read now; None: serve it unconfirmed, no WAIT."""
        if self._since is None:
            return max(1, min(500, int(self.wait_s * 1000)))
        return _PROBE_MS if now >= self._probe_at else None

    def acknowledged(self) -> None:
        self._since = None

    def unacknowledged(self, now: float, waited_s: float, probing: bool) -> bool:
        """A read's WAIT came back short: True to serve it anyway (counted), False to read again."""
        if not probing and waited_s < self.wait_s:
            return False
        if self._since is None:
            self._since = now
            log.warning("no Redis replica acknowledged reads for %.1f s: serving unreplicated (a failover "
                        "now could take tokens back)", waited_s)
        self._probe_at = now + _PROBE_EVERY_S
        self.served_unconfirmed()
        return True

    def served_unconfirmed(self) -> None:
        self.unreplicated_reads += 1
        if self.on_unreplicated is not None:
            self.on_unreplicated()


async def _read(store: SessionStore, hash_key: str, command: Callable[[Any], Any]) -> Any:
    """`command(client)`'s reply; under `store.replicas.acks`, only once a replica acknowledged
    a write issued after it on the same connection (the module's docstring), unless no replica
    answers for `wait_s` (ReplicaAcks)."""
    replicas = store.replicas
    if replicas.acks <= 0:
        return await command(store._r)
    since = time.monotonic()
    while True:
        probing = replicas.degraded
        wait_ms = replicas.wait_ms(time.monotonic())
        if wait_ms is None:
            replicas.served_unconfirmed()
            return await command(store._r)
        # on a Cluster: a plain client to the node that owns the session's slot (WAIT counts
        # that node's replicas; redis-py's cluster pipeline takes no scripts)
        cluster = store._nodes
        client = cluster.client_for(hash_key) if cluster is not None else store._r
        try:
            async with client.pipeline(transaction=False) as pipe:
                command(pipe)
                # EVALSHA, not the script object: that costs a SCRIPT EXISTS round trip a pipeline
                pipe.evalsha(store._mark_read.sha, 1, hash_key)
                pipe.execute_command("WAIT", replicas.acks, wait_ms)
                reply, _, acked = await pipe.execute()
        except NoScriptError:  # a restarted server: load it, then read again
            await client.script_load(scripts.MARK_READ)
            continue
        except (MovedError, AskError, *REDIS_DOWN):
            if cluster is None:
                raise
            # the slot moved, or its node died: one command through the cluster client follows
            # the redirection and re-reads the slots (it raises REDIS_DOWN while the cluster
            # elects a replica: the reader rides that out), then the read is made again. (A
            # one-key command: redis-py's EXISTS goes through a cluster pipeline instead.)
            await store._r.hget(hash_key, "status")
            continue
        now = time.monotonic()
        if int(acked) >= replicas.acks:
            replicas.acknowledged()
            return reply
        if replicas.unacknowledged(now, now - since, probing):
            return reply  # no replica for that long: served (availability), counted


_PROBE_MS, _PROBE_EVERY_S = 20, 1.0


def _check_redone(session_id: str, entry: Chunk, pos: int, served: list[int], from_offset: int) -> None:
    """A chunk that starts before `pos` was served in part already (commits lost with a Redis
    restart or an unreplicated failover, then driven again): its served part must be what the
    reader sent. Raised otherwise: the client saw tokens the store no longer holds."""
    if entry.offset >= pos or entry.offset < from_offset:
        return
    redone = list(entry.tokens[: pos - entry.offset])
    sent = served[entry.offset - from_offset : entry.offset - from_offset + len(redone)]
    if redone != sent:
        raise ServedTokensChanged(
            f"session {session_id}: tokens {entry.offset}..{entry.offset + len(redone)} were served as {sent} and "
            f"are now committed as {redone} (a Redis failover lost served commits; see ADR 0023)")


def _xread_entries(reply: Any) -> list:
    """XREAD's entries for our one stream; RESP2 answers a list, RESP3 a dict."""
    if not reply:
        return []
    if isinstance(reply, dict):
        return next(iter(reply.values()))[0]
    return reply[0][1]


def _entry(fields: dict) -> Chunk:
    """A stream entry, whole, at its own offset."""
    f = {as_str(k): as_str(v) for k, v in fields.items()}
    tokens = tuple(int(t) for t in f["tokens"].split(",")) if f["tokens"] else ()
    return Chunk(int(f["offset"]), tokens, f["text"], f.get("finish_reason") or None, error=f.get("error") or None)


def _from(entry: Chunk, from_offset: int) -> Chunk | None:
    """The entry from `from_offset` on; None if it lies wholly before it."""
    if entry.offset >= from_offset:
        return entry
    if entry.offset + len(entry.tokens) <= from_offset and entry.finish_reason is None:
        return None
    # The reader resumed inside this chunk (or right after the last one, and this is the end).
    return Chunk(from_offset, entry.tokens[from_offset - entry.offset :], "", entry.finish_reason, partial=True,
                 error=entry.error)
