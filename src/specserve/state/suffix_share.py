"""The suffix pool's outputs, shared through Redis (ADR 0026): what every target served of a
workload class, so a target started later, or restarted, drafts from what the others served.

  {p}:{suffix}:class:{class}   stream, capped (XADD MAXLEN ~ the class's suffix_max_requests):
                               one committed output an entry, fields o (the target incarnation
                               that served it), t (its tokens: int32 little-endian, base64),
                               c (the class's index bounds, JSON, when not the defaults)
  {p}:{suffix}:classes         set: the classes that have a stream

Every key carries the one hash tag `{suffix}`: one slot in a Redis Cluster, so one blocking
XREAD follows every class's stream at once (ADR 0023). Both keys expire `ttl_s` after their
last write. A stream, not a list: readers follow it by id (XREAD BLOCK), and XADD's MAXLEN
keeps it at the class's size in the same command (ADR 0026 has the measurements).

Sharing never fails a request: a write lost to a Redis outage is an output the fleet will
not draft from, logged and counted, nothing more.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from specserve.state.connection import OUTAGE_BACKOFF_MAX_S, OUTAGE_BACKOFF_S, REDIS_DOWN, raise_if_cancelled
from specserve.state.records import as_str

log = logging.getLogger("specserve.state.suffix")
MAX_LOAD = 1 << 16  # entries read of a class's stream at start (its MAXLEN is at most this)
CLASSES_EVERY_S = 5.0  # how often a follower looks for classes it does not follow yet


@dataclass(frozen=True)
class SharedOutput:
    workload_class: str
    tokens: list[int]
    origin: str  # the target incarnation that served it
    conf: dict[str, Any] | None  # the class's index bounds, as its policy had them (None: the defaults)
    at: float  # when it was shared (unix seconds, from the stream id)


def encode_tokens(tokens: list[int]) -> str:
    return base64.b64encode(np.asarray(tokens, dtype="<i4").tobytes()).decode()


def decode_tokens(text: str | bytes) -> list[int]:
    return np.frombuffer(base64.b64decode(text), dtype="<i4").tolist()


class SuffixShare:
    def __init__(self, redis: Any, prefix: str, origin: str, ttl_s: int = 7 * 86400) -> None:
        self.redis = redis
        self.prefix = prefix
        self.origin = origin
        self.ttl_s = ttl_s
        self.classes_key = f"{prefix}:{{suffix}}:classes"
        self.last_ids: dict[str, str] = {}  # per class followed: the last entry read
        self.published = 0
        self.lost = 0  # outputs not shared (Redis down)

    def key(self, workload_class: str) -> str:
        return f"{self.prefix}:{{suffix}}:class:{workload_class}"

    async def publish(self, workload_class: str, tokens: list[int], max_requests: int,
                      conf: dict[str, Any] | None = None) -> None:
        """One output of the class to the fleet's stream (capped at about `max_requests`)."""
        fields = {"o": self.origin, "t": encode_tokens(tokens)}
        if conf:
            fields["c"] = json.dumps(conf, sort_keys=True)
        key = self.key(workload_class)
        try:
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.xadd(key, fields, maxlen=max(max_requests, 1), approximate=True)
                pipe.expire(key, self.ttl_s)
                pipe.sadd(self.classes_key, workload_class)
                pipe.expire(self.classes_key, self.ttl_s)
                await pipe.execute()
            self.published += 1
        except REDIS_DOWN:
            self.lost += 1
            log.info("a %s output was not shared: Redis is down", workload_class)

    async def load(self) -> list[SharedOutput]:
        """Every class's stream as it stands, oldest first (what a starting target's indexes
        begin with); the classes are followed from there."""
        out: list[SharedOutput] = []
        for cls in sorted(as_str(c) for c in await self.redis.smembers(self.classes_key)):
            entries = await self.redis.xrange(self.key(cls), count=MAX_LOAD)
            out += [e for e in (self._entry(cls, i, f) for i, f in entries) if e is not None]
            self.last_ids[cls] = as_str(entries[-1][0]) if entries else "0-0"
        return out

    async def follow(self, deliver: Callable[[SharedOutput], None], block_ms: int = 1000,
                     classes_every_s: float = CLASSES_EVERY_S) -> None:
        """Forever: the other targets' new outputs of every class, to `deliver` (this target's
        own are skipped: it indexed them when it served them). New classes are picked up every
        `classes_every_s`; Redis outages are ridden out, resuming after the last id read."""
        backoff, loop = OUTAGE_BACKOFF_S, asyncio.get_running_loop()
        next_classes = 0.0
        while True:
            try:
                if loop.time() >= next_classes:
                    await self._new_classes()
                    next_classes = loop.time() + classes_every_s
                if not self.last_ids:
                    await asyncio.sleep(block_ms / 1e3)
                    continue
                reply = await self.redis.xread({self.key(c): i for c, i in self.last_ids.items()}, block=block_ms)
                raise_if_cancelled()
                for cls, entry_id, fields in _entries(reply, len(self.prefix) + len(":{suffix}:class:")):
                    self.last_ids[cls] = entry_id
                    shared = self._entry(cls, entry_id, fields)
                    if shared is not None and shared.origin != self.origin:
                        deliver(shared)
                backoff = OUTAGE_BACKOFF_S
            except REDIS_DOWN:
                raise_if_cancelled()
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, OUTAGE_BACKOFF_MAX_S)

    async def _new_classes(self) -> None:
        for cls in sorted(as_str(c) for c in await self.redis.smembers(self.classes_key)):
            self.last_ids.setdefault(cls, "0-0")

    def _entry(self, cls: str, entry_id: Any, fields: dict) -> SharedOutput | None:
        f = {as_str(k): v for k, v in (fields or {}).items()}
        try:
            tokens = decode_tokens(f["t"])
            conf = json.loads(as_str(f["c"])) if f.get("c") else None
        except (KeyError, ValueError, TypeError):  # not ours to read: skipped, never fatal
            log.warning("skipping a malformed entry %s of %s", as_str(entry_id), self.key(cls))
            return None
        at = int(as_str(entry_id).split("-")[0]) / 1e3
        return SharedOutput(cls, tokens, as_str(f.get("o", "")), conf, at)


def _entries(reply: Any, strip: int) -> list[tuple[str, str, dict]]:
    """XREAD's (class, id, fields), in order; RESP2 answers a list of [key, entries], RESP3 a
    dict of key -> [entries] (as `reading._xread_entries` reads it)."""
    if not reply:
        return []
    streams = [(k, v[0]) for k, v in reply.items()] if isinstance(reply, dict) else [(k, v) for k, v in reply]
    return [(as_str(key)[strip:], as_str(entry_id), fields) for key, entries in streams for entry_id, fields in entries]
