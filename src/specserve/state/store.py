"""The session/commit store: committed tokens in Redis are the single source of truth.

A session is one generation request (DESIGN §2). Its driver (the target's engine, ADR 0014)
appends each round's emitted tokens with `commit` / `commit_batch`, one Lua script that is
atomic and fenced (DESIGN §3, invariant 3): it appends only if the stored length equals the
driver's `expected_len` and the session epoch is the driver's, and a retried round (same
round id) is a no-op. Readers (`GenerateStream`, `Resume`) follow the `:out` stream
(state/reading.py), so only committed text is ever shown. The scripts are in
state/scripts.py, the client and its outage ride-out in state/connection.py.

Keys, all under a prefix `p`, all with a TTL that every write refreshes (DESIGN §5), and
each session's in one Redis Cluster slot: they carry its hash tag `{t}`, the first two hex
digits of its id (256 tags; ADR 0023):
  {p}:sess:{t}{id}          hash: status, params, prompt_ids, epoch, owner, created, updated,
                            finish_reason, committed, request_id, error
  {p}:sess:{t}{id}:tok      list: committed generated token ids (the prompt is in the hash)
  {p}:sess:{t}{id}:out      stream: one entry per commit: offset, tokens, text, finish_reason
  {p}:sess:{t}{id}:rounds   set: applied round ids (idempotency)
  {p}:running:{t}           set: ids of the running sessions of tag t, the index the routers'
                            reapers read (one shard per tag; a session leaves it when it
                            closes, an expired one when a reaper finds its hash gone)
  {p}:claim:{t}{id}         string: a router's claim to re-place the session (CLAIM)
A request id names its session: the id is a keyed hash of it, so a retried request finds its
session's hash and joins it, for as long as the session's keys live (no key maps one to the
other; a session without a request id gets a random id).
Ownership (ADR 0011): the owner's lease is the hash's `lease_until` (Redis clock), renewed by
its heartbeat; `adopt` takes a running session over only once that has passed. `read_at` is
when a client last read the session: a detached session nobody reads is closed by its owner.
Stream entry ids are "{offset}-1" rather than timestamps: offsets strictly increase from one
commit to the next, and a reader resuming at any offset finds its chunk with one XREVRANGE.
Every script touches only the keys it is given (state/scripts.py), so the store runs on one
Redis, under Sentinel, or on a Redis Cluster alike.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis

from specserve.errors import InvalidRequest, RequestIdConflict, SessionNotFound
from specserve.state import reading, scripts
from specserve.state.connection import MAX_CONNECTIONS, REDIS_DOWN, connect, evalsha_pipeline, ride_out
from specserve.state.follow import StreamFollower
from specserve.state.nodes import ClusterNodes
from specserve.state.records import (
    Chunk,
    CommitResult,
    CommitStatus,
    RoundCommit,
    SessionHandle,
    SessionInfo,
    SessionStatus,
    as_str,
)

# what the store's users import from here (the pieces live in connection, records, reading)
__all__ = ["MAX_CONNECTIONS", "REDIS_DOWN", "Chunk", "CommitResult", "CommitStatus", "RoundCommit", "SessionHandle",
           "SessionInfo", "SessionStatus", "SessionStore", "connect", "ride_out"]

_SESSION_ID = re.compile(r"[0-9a-f]{32}")  # uuid4().hex; anything else could alias a sub-key
_MAX_REQUEST_ID = 256
TAGS = 256  # session hash tags: the first two hex digits of a session id


def tag_of(session_id: str) -> str:
    return session_id[:2]


def session_key(session_id: str, prefix: str = "specserve") -> str:
    """A session's hash key (its other keys add `:tok`, `:out`, `:rounds`): for tools and tests
    that read the store's keys directly."""
    return f"{prefix}:sess:{{{tag_of(session_id)}}}{session_id}"

@dataclass(frozen=True)
class _Round:
    """One round's commit, for `commit` (the engine hands its own CommitRecords to `commit_batch`)."""

    session_id: str
    epoch: int
    expected_len: int
    round_id: str
    tokens: tuple[int, ...]
    text: str
    finish_reason: str | None
    stats: str = ""


class SessionStore:
    def __init__(self, redis: Redis, prefix: str = "specserve", ttl_s: int = 3600, lease_s: float = 5.0,
                 replica_acks: int = 0, replica_wait_s: float = 2.0) -> None:
        if not prefix or any(c.isspace() for c in prefix):
            raise InvalidRequest(f"store prefix must be non-empty without spaces, got {prefix!r}")
        if not isinstance(ttl_s, int) or ttl_s <= 0:
            raise InvalidRequest(f"store ttl_s must be a positive int of seconds, got {ttl_s!r}")
        if not lease_s > 0:
            raise InvalidRequest(f"store lease_s must be positive, got {lease_s!r}")
        self.lease_s = lease_s
        # readers serve what this many replicas acknowledged (state/reading.py; ADR 0023)
        self.replicas = reading.ReplicaAcks(replica_acks, replica_wait_s)
        # redis-py types its commands as sync | async unions; the client here is always async.
        self._r: Any = redis
        # a redis-py RedisCluster: its nodes as plain clients (None on one Redis)
        self._nodes = ClusterNodes(redis) if hasattr(redis, "get_node_from_key") else None
        self.prefix = prefix
        self.ttl_s = ttl_s
        # register_script runs EVALSHA and reloads the script after a NOSCRIPT (Redis restart).
        self._create: Any = redis.register_script(scripts.CREATE)
        self._commit: Any = redis.register_script(scripts.COMMIT)
        self._close: Any = redis.register_script(scripts.CLOSE)
        self._take_over: Any = redis.register_script(scripts.TAKE_OVER)
        self._heartbeat: Any = redis.register_script(scripts.HEARTBEAT)
        self._mark_read: Any = redis.register_script(scripts.MARK_READ)
        self._claim: Any = redis.register_script(scripts.CLAIM)
        self.running_keys = [f"{prefix}:running:{{{t:02x}}}" for t in range(TAGS)]
        self._follower: StreamFollower | None = None

    @property
    def follower(self) -> StreamFollower | None:
        """The one live read of every stream this store's readers follow (state/follow.py); None
        on a Cluster, where each reader reads its own."""
        if self._follower is None and self._nodes is None:
            self._follower = StreamFollower(self)
        return self._follower

    @property
    def client(self) -> Any:
        """The Redis client (for keys beside the sessions', under the same prefix)."""
        return self._r

    def _keys(self, session_id: str) -> list[str]:
        """The session's keys as every script takes them: hash, tok, out, rounds, running."""
        if not isinstance(session_id, str) or not _SESSION_ID.fullmatch(session_id):
            raise InvalidRequest(f"session_id must be 32 lowercase hex digits, got {session_id!r}")
        base = self.session_key(session_id)
        return [base, f"{base}:tok", f"{base}:out", f"{base}:rounds", self.running_keys[int(tag_of(session_id), 16)]]

    def session_key(self, session_id: str) -> str:
        """The session's hash (its other keys add `:tok`, `:out`, `:rounds`)."""
        return session_key(session_id, self.prefix)

    def _session_id_for(self, request_id: str | None) -> str:
        if request_id is None:
            return uuid.uuid4().hex
        if not isinstance(request_id, str) or not 0 < len(request_id) <= _MAX_REQUEST_ID:
            raise InvalidRequest(f"request_id must be 1..{_MAX_REQUEST_ID} characters")
        return hashlib.blake2b(request_id.encode(), digest_size=16, key=self.prefix.encode()[:64]).hexdigest()

    async def create_or_join(
        self, request_id: str | None, params: dict, prompt_ids: list[int], owner: str
    ) -> SessionHandle:
        """A new running session, or the session an earlier call with `request_id` created
        (its stored params win; a different prompt raises RequestIdConflict)."""
        session_id = self._session_id_for(request_id)
        keys = self._keys(session_id)
        params_json = json.dumps(params, sort_keys=True)
        prompt_json = json.dumps([int(t) for t in prompt_ids])
        rid = request_id or ""
        args = [self.prefix, self.ttl_s, session_id, params_json, prompt_json, owner, rid, self.lease_s]
        outcome, sid, epoch = await self._create(keys=keys, args=args)
        outcome, sid = as_str(outcome), as_str(sid)
        if outcome == "conflict":
            raise RequestIdConflict(
                f"request_id {request_id!r} already names session {sid} with a different prompt"
            )
        return SessionHandle(sid, int(epoch), created=outcome == "created")

    async def take_over(self, session_id: str, owner: str) -> int:
        """Fence out the previous owner: its commits now fail with STALE_EPOCH."""
        args = [self.prefix, self.ttl_s, owner, self.lease_s, ""]
        epoch = int(await self._take_over(keys=self._keys(session_id), args=args))
        if epoch == 0:
            raise SessionNotFound(f"session {session_id} does not exist or expired")
        return epoch

    async def adopt(self, session_id: str, owner: str) -> int | None:
        """Take a running session over iff its owner's lease has lapsed: the new epoch, or
        None (closed, missing, or its owner is alive). Atomic, so one follower wins."""
        args = [self.prefix, self.ttl_s, owner, self.lease_s, "1"]
        epoch = int(await self._take_over(keys=self._keys(session_id), args=args))
        return epoch if epoch > 0 else None

    async def claim(self, session_id: str, owner: str, claim_s: float) -> bool:
        """Claim the re-placing of a running session whose driver's lease has lapsed: True
        for one caller per `claim_s` (ADR 0014; the epoch is bumped by the new driver)."""
        keys = [self._keys(session_id)[0], f"{self.prefix}:claim:{{{tag_of(session_id)}}}{session_id}"]
        return bool(await self._claim(keys=keys, args=[owner, int(claim_s * 1000)]))

    async def heartbeat(self, session_id: str, epoch: int) -> tuple[str, float]:
        """Renew the owner's lease: (status, seconds since a client last read the session).
        Status "ok", or "closed"/"stale_epoch"/"missing": the owner should stop."""
        args = [self.prefix, self.ttl_s, epoch, self.lease_s]
        status, unread = await self._heartbeat(keys=self._keys(session_id), args=args)
        return as_str(status), float(as_str(unread))

    async def heartbeats(self, sessions: Sequence[tuple[str, int]]) -> list[tuple[str, float]]:
        """`heartbeat` for many (session_id, epoch) at once: one pipeline."""
        calls = [(self._heartbeat, self._keys(sid), [self.prefix, self.ttl_s, epoch, self.lease_s])
                 for sid, epoch in sessions]
        replies = await self._scripts(calls)
        return [(as_str(status), float(as_str(unread))) for status, unread in replies]

    async def _scripts(self, calls: Sequence[tuple[Any, list[str], list[Any]]]) -> list[Any]:
        """Script calls (script, keys, args), answered in order: one pipeline on one Redis; on a
        Cluster, one per node (state/nodes.py)."""
        if self._nodes is not None:
            return await self._nodes.scripts(calls)
        return await evalsha_pipeline(self._r, calls)

    async def aclose(self) -> None:
        """Stop the follower's reads; close the plain clients to a Cluster's nodes (the cluster
        client is the caller's)."""
        if self._follower is not None:
            await self._follower.aclose()
        if self._nodes is not None:
            await self._nodes.aclose()

    async def mark_read(self, session_id: str) -> None:
        """A client is reading the session (it is not abandoned)."""
        await self._mark_read(keys=self._keys(session_id)[:1])

    async def orphans(self, limit: int = 256) -> list[str]:
        """Running sessions whose owner's lease has lapsed, from a random sample of the
        `running` index (every reap another); ids whose session expired or closed are dropped
        from the index on the way."""
        # a random sample of each shard, at most `limit` ids in all (not `limit` from each: a
        # router with many sessions would read 256 x limit ids every reap); cut at random, not
        # in shard order, so every shard is reached (a cut in order left the last shards out)
        each = -(-limit // TAGS)
        async with self._r.pipeline(transaction=False) as pipe:
            for key in self.running_keys:
                pipe.srandmember(key, each)
            shards = await pipe.execute()
        ids = [as_str(m) for members in shards for m in members]
        if len(ids) > limit:
            ids = random.sample(ids, limit)
        if not ids:
            return []
        now = await self._r.time()
        t = now[0] + now[1] / 1e6
        async with self._r.pipeline(transaction=False) as pipe:
            for sid in ids:
                pipe.hmget(self.session_key(sid), "status", "lease_until")
            rows = await pipe.execute()
        out, gone = [], []
        for sid, (status, lease_until) in zip(ids, rows, strict=True):
            if status is None or as_str(status) != SessionStatus.RUNNING:
                gone.append(sid)
            elif lease_until is None or float(as_str(lease_until)) < t:
                out.append(sid)
        if gone:
            async with self._r.pipeline(transaction=False) as pipe:
                for sid in gone:
                    pipe.srem(self._keys(sid)[4], sid)
                await pipe.execute()
        return out

    async def commit(
        self,
        session_id: str,
        expected_len: int,
        epoch: int,
        round_id: str,
        tokens: list[int],
        text: str,
        finish_reason: str | None,
    ) -> CommitResult:
        """Append one round's emitted tokens iff the session is where the caller thinks."""
        return (await self.commit_batch([_Round(session_id, epoch, expected_len, round_id, tuple(tokens), text,
                                                finish_reason)]))[0]

    def _commit_args(self, r: RoundCommit) -> tuple[list[str], list[Any]]:
        """One round's keys and its part of the COMMIT script's arguments."""
        if r.expected_len < 0 or r.epoch < 1 or not r.round_id:
            raise InvalidRequest("commit needs expected_len >= 0, epoch >= 1 and a round_id")
        if not r.tokens and not r.finish_reason:
            raise InvalidRequest("a commit without tokens must finish the session")
        tokens = [int(t) for t in r.tokens]
        if any(t < 0 for t in tokens):
            raise InvalidRequest("token ids must be non-negative")
        return self._keys(r.session_id), [r.epoch, r.expected_len, r.round_id, r.text, r.finish_reason or "",
                                          getattr(r, "stats", "") or "", len(tokens), *tokens]

    async def commit_batch(self, rounds: Sequence[RoundCommit]) -> list[CommitResult]:
        """Several rounds' commits (the engine sends a step's at once), each fenced exactly like
        `commit` and applied in order, so a session's rounds in one batch land one after the
        other. One script call for all of them on one Redis; on a Cluster one a hash tag (a
        call's keys must share a slot), sent as one pipeline a node (ADR 0028)."""
        groups: dict[str, list[int]] = {}
        for i, r in enumerate(rounds):
            groups.setdefault(tag_of(r.session_id) if self._nodes is not None else "", []).append(i)
        calls: list[tuple[Any, list[str], list[Any]]] = []
        for indices in groups.values():
            keys: list[str] = []
            args: list[Any] = [self.prefix, self.ttl_s]
            for i in indices:
                k, a = self._commit_args(rounds[i])
                keys += k
                args += a
            calls.append((self._commit, keys, args))
        replies = await self._scripts(calls)
        out: list[CommitResult | None] = [None] * len(rounds)
        for indices, reply in zip(groups.values(), replies, strict=True):
            for j, i in enumerate(indices):
                out[i] = CommitResult(CommitStatus(as_str(reply[2 * j])), int(reply[2 * j + 1]))
        return [r for r in out if r is not None]

    async def cancel(self, session_id: str) -> bool:
        """Close a running session on a client's request; False if it already ended."""
        status = await self._close_session(
            session_id, SessionStatus.CANCELLED, "cancelled", "", None
        )
        return status is CommitStatus.OK

    async def fail(self, session_id: str, epoch: int, reason: str) -> CommitStatus:
        """Close a running session as failed; fenced like commit, so a stale router cannot."""
        return await self._close_session(session_id, SessionStatus.FAILED, "error", reason, epoch)

    async def abandon(self, session_id: str, epoch: int, why: str) -> CommitStatus:
        """Close a running session nobody reads any more (detached and idle), as cancelled."""
        return await self._close_session(session_id, SessionStatus.CANCELLED, "cancelled", why, epoch)

    async def _close_session(
        self, session_id: str, status: SessionStatus, finish: str, error: str, epoch: int | None
    ) -> CommitStatus:
        fence = "" if epoch is None else epoch
        args = [self.prefix, self.ttl_s, status.value, finish, error, fence]
        outcome, _ = await self._close(keys=self._keys(session_id), args=args)
        return CommitStatus(as_str(outcome))

    async def annotate(self, session_id: str, fields: dict[str, str]) -> bool:
        """Add informational fields (e.g. a shadow run's record) to a session that exists."""
        key = self._keys(session_id)[0]
        if not await self._r.exists(key):
            return False
        await self._r.hset(key, mapping=fields)
        return True

    async def committed_tokens(self, session_id: str) -> list[int]:
        hash_key, tok_key = self._keys(session_id)[:2]
        async with self._r.pipeline(transaction=True) as pipe:
            exists, tokens = await pipe.exists(hash_key).lrange(tok_key, 0, -1).execute()
        if not exists:
            raise SessionNotFound(f"session {session_id} does not exist or expired")
        return [int(t) for t in tokens]

    async def get(self, session_id: str) -> SessionInfo | None:
        raw = await self._r.hgetall(self._keys(session_id)[0])
        if not raw:
            return None
        h = {as_str(k): as_str(v) for k, v in raw.items()}
        return SessionInfo(
            session_id=session_id,
            status=SessionStatus(h["status"]),
            params=json.loads(h["params"]),
            prompt_ids=json.loads(h["prompt_ids"]),
            epoch=int(h["epoch"]),
            owner=h["owner"],
            created=float(h["created"]),
            updated=float(h["updated"]),
            finish_reason=h.get("finish_reason") or None,
            committed=int(h["committed"]),
            request_id=h.get("request_id") or None,
            error=h.get("error") or None,
            stats=json.loads(h["stats"]) if h.get("stats") else None,
        )

    def read_chunks(
        self, session_id: str, from_offset: int = 0, block_ms: int = 1000,
        on_wait: Callable[[], Awaitable[None]] | None = None, outage_s: float = 0.0,
    ) -> AsyncIterator[Chunk]:
        """Committed chunks from generated token `from_offset` on, then live ones, until the
        chunk that ends the session (state/reading.py)."""
        return reading.read_chunks(self, session_id, from_offset, block_ms, on_wait, outage_s)

