"""One read for every live stream a router follows (ADR 0028): how a router learns of new tokens.

A reader following a session's `:out` stream used to send one `XREAD BLOCK` of its own for each
commit: a Redis call, a reply to parse and a pooled connection held, per token per stream. The
engine commits a step's rounds in one script call (state/scripts.py: COMMIT), so they land at
once; here one task per store sends one `XREAD BLOCK` over every followed stream, and each
reply hands every stream's new entries to its readers. At 64 streams that is a call or two a
step instead of 64.

- A reader subscribes once it has caught up (`follow(key, after_id)`) and takes what came with
  `Subscription.next(block_ms)`: every entry after its own last one, or [] when none came in
  `block_ms` (it then checks the session, as before).
- A new subscription rings the follower's doorbell (an `XADD` to its own stream, which every
  read includes): a read already blocked returns at once and the next includes the new stream.
  A read sent after the ring finds the doorbell's entry and returns at once too, so no
  subscription waits out a block.
- Under a replicated Redis (ADR 0023) the read is the pipeline `[XREAD, a write, WAIT n]` that
  `reading._read` sends, the write being the follower's own key: a reply a replica did not
  acknowledge is not handed on, and is read again (from the same ids); `ReplicaAcks` says
  when to serve unconfirmed.
- A Redis error reaches every subscriber (each rides it out as before and subscribes again;
  any other error is raised to the readers, never left a stall); the follower waits a backoff
  before its next read.
- Only on one Redis or a Sentinel's primary: a Cluster refuses an `XREAD` over keys of several
  slots, and each reader there reads its own stream (`reading._xread`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from typing import TYPE_CHECKING, Any

from specserve.state.connection import OUTAGE_BACKOFF_MAX_S, OUTAGE_BACKOFF_S, REDIS_DOWN, raise_if_cancelled
from specserve.state.records import as_str

if TYPE_CHECKING:
    from specserve.state.store import SessionStore

log = logging.getLogger("specserve.state")
BELL_TTL_MS = 60_000  # the doorbell and acknowledgement keys outlive an idle follower this long
BLOCK_MS = 1_000  # a read waits this long when nothing comes (a ring or an entry ends it sooner)


def _id(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


class Subscription:
    """One reader's live entries of one stream."""

    def __init__(self, key: str, after_id: str) -> None:
        self.key = key
        self.last = after_id  # the last entry handed to this reader (or before it subscribed)
        self._entries: list = []
        self._error: BaseException | None = None
        self._ready = asyncio.Event()

    def _push(self, entries: list) -> None:
        last = _id(self.last)
        new = [e for e in entries if _id(as_str(e[0])) > last]
        if new:
            self._entries += new
            self.last = as_str(new[-1][0])
            self._ready.set()

    def _fail(self, error: BaseException) -> None:
        self._error = error
        self._ready.set()

    async def next(self, block_ms: int) -> list:
        """The entries that came since the last call ([] if none within `block_ms`); raises the
        follower's Redis error."""
        if not self._ready.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._ready.wait(), block_ms / 1e3)
        if self._error is not None:
            error, self._error = self._error, None
            self._ready.clear()
            raise error
        entries, self._entries = self._entries, []
        self._ready.clear()
        return entries


class StreamFollower:
    def __init__(self, store: SessionStore) -> None:
        self.store = store
        name = uuid.uuid4().hex[:12]
        self.bell = f"{store.prefix}:follow:{name}"  # its doorbell stream
        self.ack_key = f"{store.prefix}:follow:{name}:ack"  # the write a confirmed read waits for
        self.subs: dict[str, list[Subscription]] = {}
        self.reads = 0  # XREADs sent (the benchmark's count)
        self._bell_id = "0-0"
        self._task: asyncio.Task | None = None
        self._idle = asyncio.Event()

    async def follow(self, key: str, after_id: str) -> Subscription:
        sub = Subscription(key, after_id)
        self.subs.setdefault(key, []).append(sub)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())
        self._idle.set()
        await self._ring()
        return sub

    def unfollow(self, sub: Subscription) -> None:
        subs = self.subs.get(sub.key, [])
        if sub in subs:
            subs.remove(sub)
        if not subs:
            self.subs.pop(sub.key, None)

    async def _ring(self) -> None:
        """Wake a read in flight, so that the next includes the new subscription (best effort: a
        ring Redis refuses leaves the read to end at its block)."""
        with contextlib.suppress(*REDIS_DOWN):
            async with self.store.client.pipeline(transaction=False) as pipe:
                pipe.xadd(self.bell, {"r": 1}, maxlen=8, approximate=False)
                pipe.pexpire(self.bell, BELL_TTL_MS)
                await pipe.execute()

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task

    async def _run(self) -> None:
        backoff = OUTAGE_BACKOFF_S
        while True:
            if not self.subs:
                self._idle.clear()
                await self._idle.wait()
                continue
            try:
                reply = await self._read()
                raise_if_cancelled()
                backoff = OUTAGE_BACKOFF_S
            except Exception as exc:  # Redis away (its readers ride it out), or a bug: never a silent stall
                raise_if_cancelled()
                if not isinstance(exc, REDIS_DOWN):
                    log.exception("the stream follower's read failed")
                for subs in list(self.subs.values()):
                    for sub in subs:
                        sub._fail(exc)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, OUTAGE_BACKOFF_MAX_S)
                continue
            self._deliver(reply)

    def _deliver(self, reply: Any) -> None:
        for key, entries in _streams(reply):
            if key == self.bell:
                self._bell_id = as_str(entries[-1][0])
                continue
            for sub in list(self.subs.get(key, ())):
                sub._push(entries)

    def _args(self) -> dict[str, str]:
        streams = {self.bell: self._bell_id}
        for key, subs in self.subs.items():
            streams[key] = min((s.last for s in subs), key=_id)
        return streams

    async def _read(self) -> Any:
        """One XREAD over every followed stream (and the doorbell); under replica acks, only
        a reply a replica acknowledged (reading._read's rule), read again until it is."""
        store, replicas = self.store, self.store.replicas
        self.reads += 1
        if replicas.acks <= 0:
            return await store.client.xread(self._args(), block=BLOCK_MS)
        since = time.monotonic()
        while True:
            probing = replicas.degraded
            wait_ms = replicas.wait_ms(time.monotonic())
            if wait_ms is None:
                reply = await store.client.xread(self._args(), block=BLOCK_MS)
                if _streams(reply):
                    replicas.served_unconfirmed()
                return reply
            async with store.client.pipeline(transaction=False) as pipe:
                pipe.xread(self._args(), block=BLOCK_MS)
                pipe.set(self.ack_key, 1, px=BELL_TTL_MS)
                pipe.execute_command("WAIT", replicas.acks, wait_ms)
                reply, _, acked = await pipe.execute()
            now = time.monotonic()
            if int(acked) >= replicas.acks:
                replicas.acknowledged()
                return reply
            if replicas.unacknowledged(now, now - since, probing):
                return reply


def _streams(reply: Any) -> list[tuple[str, list]]:
    """XREAD's reply as (key, entries) pairs; RESP2 answers a list, RESP3 a dict."""
    if not reply:
        return []
    if isinstance(reply, dict):
        return [(as_str(k), v[0]) for k, v in reply.items()]
    return [(as_str(k), entries) for k, entries in reply]
