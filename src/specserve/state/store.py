"""The session/commit store: committed tokens in Redis are the single source of truth.

A session is one generation request (DESIGN §2). The router appends each round's emitted
tokens with `commit`, one Lua script that is atomic and fenced (DESIGN §3, invariant 3): it
appends only if the stored length equals the router's `expected_len` and the session epoch
equals the router's lease, and a retried round (same round id) is a no-op. Readers
(`GenerateStream`, `Resume`) follow the `:out` stream, so only committed text is ever shown.

Keys, all under a prefix `p` and all with a TTL that every write refreshes (DESIGN §5):
  {p}:sess:{id}          hash: status, params, prompt_ids, epoch, owner, created, updated,
                         finish_reason, committed, request_id, error
  {p}:sess:{id}:tok      list: committed generated token ids (the prompt is in the hash)
  {p}:sess:{id}:out      stream: one entry per commit: offset, tokens, text, finish_reason
  {p}:sess:{id}:rounds   set: applied round ids (idempotency)
  {p}:req:{request_id}   string: session id, so a retried request joins its session
  {p}:running            set: ids of running sessions, the index the routers' reapers read
                         (a session leaves it when it closes; an expired one when a reaper
                         finds its hash gone); its TTL too is refreshed by every write
Ownership (ADR 0011): the owner's lease is the hash's `lease_until` (Redis clock), renewed by
its heartbeat; `adopt` takes a running session over only once that has passed. `read_at` is
when a client last read the session: a detached session nobody reads is closed by its owner.
Stream entry ids are "{offset}-1" rather than timestamps: offsets strictly increase from one
commit to the next, and a reader resuming at any offset finds its chunk with one XREVRANGE.
The scripts build the `:req:` key from the prefix, so this store assumes a single Redis node.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Protocol

from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from specserve.errors import InvalidRequest, RequestIdConflict, SessionNotFound

# Redis is down, restarting or still loading its AOF (BusyLoadingError is a ConnectionError).
REDIS_DOWN = (RedisConnectionError, RedisTimeoutError)
OUTAGE_BACKOFF_S, OUTAGE_BACKOFF_MAX_S = 0.05, 1.0


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
    The pool blocks when full (MAX_CONNECTIONS) rather than raising."""
    pool = BlockingConnectionPool.from_url(
        url, max_connections=MAX_CONNECTIONS, timeout=POOL_WAIT_S,
        retry=Retry(ExponentialBackoff(cap=0.5, base=0.02), 3), retry_on_error=list(REDIS_DOWN),
        socket_connect_timeout=2.0, health_check_interval=10)
    return Redis.from_pool(pool)


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


class SessionStatus(StrEnum):
    RUNNING = "running"
    FINISHED = "finished"
    CANCELLED = "cancelled"
    FAILED = "failed"


class CommitStatus(StrEnum):
    OK = "ok"
    DUPLICATE = "duplicate"  # this round id was applied before: nothing written
    MISSING = "missing"  # no such session (never created, or expired)
    CLOSED = "closed"  # finished, cancelled or failed: no more tokens
    STALE_EPOCH = "stale_epoch"  # another router took the session over
    STALE_LEN = "stale_len"  # expected_len is not the committed length


class RoundCommit(Protocol):
    """One round's commit as `commit_batch` takes it (the engine's CommitRecord)."""

    @property
    def session_id(self) -> str: ...
    @property
    def epoch(self) -> int: ...
    @property
    def expected_len(self) -> int: ...
    @property
    def round_id(self) -> str: ...
    @property
    def tokens(self) -> Sequence[int]: ...
    @property
    def text(self) -> str: ...
    @property
    def finish_reason(self) -> str | None: ...


@dataclass(frozen=True)
class SessionHandle:
    session_id: str
    epoch: int
    created: bool  # False: the request_id was seen before and this call joined its session

    @property
    def joined(self) -> bool:
        return not self.created


@dataclass(frozen=True)
class CommitResult:
    status: CommitStatus
    committed_len: int  # the number of committed generated tokens after the call

    @property
    def applied(self) -> bool:
        """The round's tokens are committed, by this call or by an earlier retry."""
        return self.status in (CommitStatus.OK, CommitStatus.DUPLICATE)


@dataclass(frozen=True)
class SessionInfo:
    session_id: str
    status: SessionStatus
    params: dict[str, Any]
    prompt_ids: list[int]
    epoch: int
    owner: str
    created: float  # unix seconds, from the Redis clock
    updated: float
    finish_reason: str | None
    committed: int
    request_id: str | None
    error: str | None


@dataclass(frozen=True)
class Chunk:
    offset: int  # index of the first token among the generated tokens
    tokens: tuple[int, ...]
    text: str  # newly visible text; "" when partial (the caller re-detokenizes)
    finish_reason: str | None  # set on the last chunk of a session only
    partial: bool = False  # the tail of a stored chunk: a reader resumed inside it
    error: str | None = None  # why the session failed


# Shared by the scripts below. KEYS are the session's own keys; ARGV[1] = prefix, ARGV[2] = ttl.
_LUA_HELPERS = """
local function now()
  local t = redis.call('TIME')
  return t[1] .. '.' .. string.format('%06d', t[2])
end
local function later(seconds)
  local t = redis.call('TIME')
  return string.format('%.6f', tonumber(t[1]) + tonumber(t[2]) / 1e6 + tonumber(seconds))
end
local function touch(request_id)
  for _, key in ipairs(KEYS) do redis.call('EXPIRE', key, ARGV[2]) end
  redis.call('EXPIRE', ARGV[1] .. ':running', ARGV[2])
  if request_id and request_id ~= '' then
    redis.call('EXPIRE', ARGV[1] .. ':req:' .. request_id, ARGV[2])
  end
end
"""

# KEYS: hash [, req]. ARGV[3..8]: session_id, params, prompt_ids, owner, request_id, lease_s.
# GET-then-SET inside one script is SET NX made atomic with the hash write, so a joiner never
# sees a request mapped to a session whose hash does not exist yet.
_CREATE = (
    _LUA_HELPERS
    + """
if KEYS[2] then
  local existing = redis.call('GET', KEYS[2])
  if existing then
    local h = redis.call('HMGET', ARGV[1] .. ':sess:' .. existing, 'prompt_ids', 'epoch')
    if h[1] then
      if h[1] ~= ARGV[5] then return {'conflict', existing, 0} end
      return {'joined', existing, tonumber(h[2])}
    end
  end
  redis.call('SET', KEYS[2], ARGV[3], 'EX', ARGV[2])
end
local t = now()
redis.call('HSET', KEYS[1], 'status', 'running', 'params', ARGV[4], 'prompt_ids', ARGV[5],
  'epoch', 1, 'owner', ARGV[6], 'created', t, 'updated', t, 'finish_reason', '',
  'committed', 0, 'request_id', ARGV[7], 'error', '', 'lease_until', later(ARGV[8]), 'read_at', t)
redis.call('EXPIRE', KEYS[1], ARGV[2])
redis.call('SADD', ARGV[1] .. ':running', ARGV[3])
redis.call('EXPIRE', ARGV[1] .. ':running', ARGV[2])
return {'created', ARGV[3], 1}
"""
)

# KEYS: hash, tok, out, rounds. ARGV[3..7]: epoch, expected_len, round_id, text,
# finish_reason ('' = not final); ARGV[8..]: token ids.
_COMMIT = (
    _LUA_HELPERS
    + """
local len = redis.call('LLEN', KEYS[2])
if redis.call('SISMEMBER', KEYS[4], ARGV[5]) == 1 then return {'duplicate', len} end
local h = redis.call('HMGET', KEYS[1], 'status', 'epoch', 'request_id')
if not h[1] then return {'missing', len} end
if h[1] ~= 'running' then return {'closed', len} end
if tonumber(h[2]) ~= tonumber(ARGV[3]) then return {'stale_epoch', len} end
if len ~= tonumber(ARGV[4]) then return {'stale_len', len} end
-- XADD first: it is the only write that could fail, and a failed script is not rolled back.
redis.call('XADD', KEYS[3], len .. '-1', 'offset', len, 'tokens', table.concat(ARGV, ',', 8),
  'text', ARGV[6], 'finish_reason', ARGV[7])
for i = 8, #ARGV, 1000 do  -- unpack() has a stack limit
  redis.call('RPUSH', KEYS[2], unpack(ARGV, i, math.min(i + 999, #ARGV)))
end
local n = len + #ARGV - 7
redis.call('SADD', KEYS[4], ARGV[5])
redis.call('HSET', KEYS[1], 'committed', n, 'updated', now())
if ARGV[7] ~= '' then
  redis.call('HSET', KEYS[1], 'status', 'finished', 'finish_reason', ARGV[7])
  redis.call('SREM', ARGV[1] .. ':running', string.match(KEYS[1], ':sess:(%x+)$'))
end
touch(h[3])
return {'ok', n}
"""
)

# Cancel and fail. KEYS: hash, tok, out, rounds. ARGV[3..6]: status, finish_reason, error,
# epoch ('' = any: a client's Cancel is not fenced, a router's fail is).
_CLOSE = (
    _LUA_HELPERS
    + """
local len = redis.call('LLEN', KEYS[2])
local h = redis.call('HMGET', KEYS[1], 'status', 'epoch', 'request_id')
if not h[1] then return {'missing', len} end
if h[1] ~= 'running' then return {'closed', len} end
if ARGV[6] ~= '' and tonumber(h[2]) ~= tonumber(ARGV[6]) then return {'stale_epoch', len} end
redis.call('XADD', KEYS[3], len .. '-1', 'offset', len, 'tokens', '', 'text', '',
  'finish_reason', ARGV[4], 'error', ARGV[5])
redis.call('HSET', KEYS[1], 'status', ARGV[3], 'finish_reason', ARGV[4], 'error', ARGV[5],
  'updated', now())
redis.call('SREM', ARGV[1] .. ':running', string.match(KEYS[1], ':sess:(%x+)$'))
touch(h[3])
return {'ok', len}
"""
)

# KEYS: hash, tok, out, rounds. ARGV[3..5]: owner, lease_s, only_if_lapsed ('1' or '').
# Returns the new epoch; 0 if missing, -1 if closed, -2 if the owner's lease still holds.
_TAKE_OVER = (
    _LUA_HELPERS
    + """
local h = redis.call('HMGET', KEYS[1], 'status', 'lease_until', 'request_id')
if not h[1] then return 0 end
if ARGV[5] ~= '' then
  if h[1] ~= 'running' then return -1 end
  if h[2] and tonumber(h[2]) > tonumber(now()) then return -2 end
end
local epoch = redis.call('HINCRBY', KEYS[1], 'epoch', 1)
redis.call('HSET', KEYS[1], 'owner', ARGV[3], 'updated', now(), 'lease_until', later(ARGV[4]))
touch(h[3])
return epoch
"""
)

# The owner's heartbeat. KEYS: hash, tok, out, rounds. ARGV[3..4]: epoch, lease_s.
# Returns {status, seconds since a client last read it (read_at, set by readers)}.
_HEARTBEAT = (
    _LUA_HELPERS
    + """
local h = redis.call('HMGET', KEYS[1], 'status', 'epoch', 'read_at', 'request_id')
if not h[1] then return {'missing', '0'} end
if h[1] ~= 'running' then return {'closed', '0'} end
if tonumber(h[2]) ~= tonumber(ARGV[3]) then return {'stale_epoch', '0'} end
local t = now()
if not h[3] then h[3] = t; redis.call('HSET', KEYS[1], 'read_at', t) end
redis.call('HSET', KEYS[1], 'lease_until', later(ARGV[4]))
touch(h[4])
return {'ok', string.format('%.3f', tonumber(t) - tonumber(h[3]))}
"""
)

# KEYS: hash. One round trip, and never recreates a hash that expired (it would have no TTL).
_MARK_READ = """
if redis.call('EXISTS', KEYS[1]) == 1 then
  local t = redis.call('TIME')
  redis.call('HSET', KEYS[1], 'read_at', t[1] .. '.' .. string.format('%06d', t[2]))
end
"""

_SESSION_ID = re.compile(r"[0-9a-f]{32}")  # uuid4().hex; anything else could alias a sub-key
_MAX_REQUEST_ID = 256
_PAGE = 256  # stream entries per XRANGE while a reader catches up


class SessionStore:
    def __init__(self, redis: Redis, prefix: str = "specserve", ttl_s: int = 3600, lease_s: float = 5.0) -> None:
        if not prefix or any(c.isspace() for c in prefix):
            raise InvalidRequest(f"store prefix must be non-empty without spaces, got {prefix!r}")
        if not isinstance(ttl_s, int) or ttl_s <= 0:
            raise InvalidRequest(f"store ttl_s must be a positive int of seconds, got {ttl_s!r}")
        if not lease_s > 0:
            raise InvalidRequest(f"store lease_s must be positive, got {lease_s!r}")
        self.lease_s = lease_s
        # redis-py types its commands as sync | async unions; the client here is always async.
        self._r: Any = redis
        self.prefix = prefix
        self.ttl_s = ttl_s
        # register_script runs EVALSHA and reloads the script after a NOSCRIPT (Redis restart).
        self._create: Any = redis.register_script(_CREATE)
        self._commit: Any = redis.register_script(_COMMIT)
        self._close: Any = redis.register_script(_CLOSE)
        self._take_over: Any = redis.register_script(_TAKE_OVER)
        self._heartbeat: Any = redis.register_script(_HEARTBEAT)
        self._mark_read: Any = redis.register_script(_MARK_READ)
        self.running_key = f"{prefix}:running"

    @property
    def client(self) -> Any:
        """The Redis client (for keys beside the sessions', under the same prefix)."""
        return self._r

    def _keys(self, session_id: str) -> list[str]:
        if not isinstance(session_id, str) or not _SESSION_ID.fullmatch(session_id):
            raise InvalidRequest(f"session_id must be 32 lowercase hex digits, got {session_id!r}")
        base = f"{self.prefix}:sess:{session_id}"
        return [base, f"{base}:tok", f"{base}:out", f"{base}:rounds"]

    def _req_key(self, request_id: str) -> str:
        if not isinstance(request_id, str) or not 0 < len(request_id) <= _MAX_REQUEST_ID:
            raise InvalidRequest(f"request_id must be 1..{_MAX_REQUEST_ID} characters")
        return f"{self.prefix}:req:{request_id}"

    async def create_or_join(
        self, request_id: str | None, params: dict, prompt_ids: list[int], owner: str
    ) -> SessionHandle:
        """A new running session, or the session an earlier call with `request_id` created
        (its stored params win; a different prompt raises RequestIdConflict)."""
        session_id = uuid.uuid4().hex
        keys = self._keys(session_id)[:1]
        if request_id is not None:
            keys.append(self._req_key(request_id))
        params_json = json.dumps(params, sort_keys=True)
        prompt_json = json.dumps([int(t) for t in prompt_ids])
        rid = request_id or ""
        args = [self.prefix, self.ttl_s, session_id, params_json, prompt_json, owner, rid, self.lease_s]
        outcome, sid, epoch = await self._create(keys=keys, args=args)
        outcome, sid = _str(outcome), _str(sid)
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

    async def heartbeat(self, session_id: str, epoch: int) -> tuple[str, float]:
        """Renew the owner's lease: (status, seconds since a client last read the session).
        Status "ok", or "closed"/"stale_epoch"/"missing": the owner should stop."""
        args = [self.prefix, self.ttl_s, epoch, self.lease_s]
        status, unread = await self._heartbeat(keys=self._keys(session_id), args=args)
        return _str(status), float(_str(unread))

    async def mark_read(self, session_id: str) -> None:
        """A client is reading the session (it is not abandoned)."""
        await self._mark_read(keys=self._keys(session_id)[:1])

    async def orphans(self, limit: int = 256) -> list[str]:
        """Running sessions whose owner's lease has lapsed, from the `running` index; ids
        whose session expired or closed are dropped from the index on the way."""
        ids = [_str(m) for m in await self._r.srandmember(self.running_key, limit)]
        if not ids:
            return []
        now = await self._r.time()
        t = now[0] + now[1] / 1e6
        async with self._r.pipeline(transaction=False) as pipe:
            for sid in ids:
                pipe.hmget(f"{self.prefix}:sess:{sid}", "status", "lease_until")
            rows = await pipe.execute()
        out, gone = [], []
        for sid, (status, lease_until) in zip(ids, rows, strict=True):
            if status is None or _str(status) != SessionStatus.RUNNING:
                gone.append(sid)
            elif lease_until is None or float(_str(lease_until)) < t:
                out.append(sid)
        if gone:
            await self._r.srem(self.running_key, *gone)
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
        status, length = await self._commit(**self._commit_call(session_id, expected_len, epoch, round_id, tokens,
                                                                 text, finish_reason))
        return CommitResult(CommitStatus(_str(status)), int(length))

    def _commit_call(self, session_id: str, expected_len: int, epoch: int, round_id: str, tokens: list[int],
                     text: str, finish_reason: str | None) -> dict[str, Any]:
        if expected_len < 0 or epoch < 1 or not round_id:
            raise InvalidRequest("commit needs expected_len >= 0, epoch >= 1 and a round_id")
        if not tokens and not finish_reason:
            raise InvalidRequest("a commit without tokens must finish the session")
        if any(t < 0 for t in tokens):
            raise InvalidRequest("token ids must be non-negative")
        args = [self.prefix, self.ttl_s, epoch, expected_len, round_id, text, finish_reason or ""]
        return {"keys": self._keys(session_id), "args": args + [int(t) for t in tokens]}

    async def commit_batch(self, rounds: Sequence[RoundCommit]) -> list[CommitResult]:
        """Several rounds' commits in one pipeline (one round trip; the engine sends one per
        step), each fenced exactly like `commit`. Applied in order, so a session's rounds in
        one batch land one after the other."""
        calls = [self._commit_call(r.session_id, r.expected_len, r.epoch, r.round_id, list(r.tokens), r.text,
                                   r.finish_reason) for r in rounds]
        async with self._r.pipeline(transaction=False) as pipe:
            for call in calls:
                await self._commit(client=pipe, **call)
            replies = await pipe.execute()
        return [CommitResult(CommitStatus(_str(status)), int(length)) for status, length in replies]

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
        return CommitStatus(_str(outcome))

    async def annotate(self, session_id: str, fields: dict[str, str]) -> bool:
        """Add informational fields (e.g. a shadow run's record) to a session that exists."""
        key = self._keys(session_id)[0]
        if not await self._r.exists(key):
            return False
        await self._r.hset(key, mapping=fields)
        return True

    async def committed_tokens(self, session_id: str) -> list[int]:
        hash_key, tok_key, _, _ = self._keys(session_id)
        async with self._r.pipeline(transaction=True) as pipe:
            exists, tokens = await pipe.exists(hash_key).lrange(tok_key, 0, -1).execute()
        if not exists:
            raise SessionNotFound(f"session {session_id} does not exist or expired")
        return [int(t) for t in tokens]

    async def get(self, session_id: str) -> SessionInfo | None:
        raw = await self._r.hgetall(self._keys(session_id)[0])
        if not raw:
            return None
        h = {_str(k): _str(v) for k, v in raw.items()}
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
        )

    async def request_session(self, request_id: str) -> str | None:
        value = await self._r.get(self._req_key(request_id))
        return None if value is None else _str(value)

    async def read_chunks(
        self, session_id: str, from_offset: int = 0, block_ms: int = 1000,
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
        hash_key, tok_key, _, _ = self._keys(session_id)
        if from_offset < 0 or block_ms < 1:
            raise InvalidRequest("read_chunks needs from_offset >= 0 and block_ms >= 1")
        async with self._r.pipeline(transaction=True) as pipe:
            exists, length = await pipe.exists(hash_key).llen(tok_key).execute()
        if not exists:
            raise SessionNotFound(f"session {session_id} does not exist or expired")
        if from_offset > length:
            raise InvalidRequest(f"offset {from_offset} is past the {length} committed tokens")
        pos, down_since, backoff = from_offset, None, OUTAGE_BACKOFF_S
        while True:  # ride_out's policy, inlined: this is a generator
            try:
                async for chunk in self._follow(session_id, pos, block_ms, on_wait):
                    yield chunk
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

    async def _follow(self, session_id: str, pos: int, block_ms: int,
                      on_wait: Callable[[], Awaitable[None]] | None) -> AsyncIterator[Chunk]:
        hash_key, _, out_key, _ = self._keys(session_id)
        # The chunk holding pos is the last one that starts at or before it.
        before = await self._r.xrevrange(out_key, max=f"{pos}-1", min="-", count=1)
        start, last_id, catching_up = (_str(before[0][0]) if before else "-"), "0-0", True
        marked = 0.0
        while True:
            closed = False
            if time.monotonic() - marked >= 1.0:  # someone reads it: not abandoned
                await self.mark_read(session_id)
                marked = time.monotonic()
            if catching_up:  # page through what is already committed
                entries = await self._r.xrange(out_key, min=start, max="+", count=_PAGE)
                catching_up = len(entries) == _PAGE
            else:  # follow live commits
                reply = await self._r.xread({out_key: last_id}, block=block_ms)
                entries = _xread_entries(reply)
                if not entries:
                    status = await self._r.hget(hash_key, "status")
                    if status is None:
                        raise SessionNotFound(f"session {session_id} expired while being read")
                    if _str(status) == SessionStatus.RUNNING:
                        if on_wait is not None:
                            await on_wait()
                        continue
                    # Closed: its final chunk was written with the status, so one read gets it.
                    entries = await self._r.xrange(out_key, min=f"({last_id}", max="+")
                    closed = True
            for entry_id, fields in entries:
                last_id = _str(entry_id)
                if _offset(fields) > pos:
                    raise _Reseek  # commits were lost and redone: find pos's chunk again
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


def _str(value: bytes | str | int) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _xread_entries(reply: Any) -> list:
    """XREAD's entries for our one stream; RESP2 answers a list, RESP3 a dict."""
    if not reply:
        return []
    if isinstance(reply, dict):
        return next(iter(reply.values()))[0]
    return reply[0][1]


def _offset(fields: dict) -> int:
    return int(_str(fields.get("offset", fields.get(b"offset", 0))))


def _chunk(fields: dict, from_offset: int) -> Chunk | None:
    """A stream entry as a Chunk from `from_offset` on; None if it lies wholly before it."""
    f = {_str(k): _str(v) for k, v in fields.items()}
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
