"""The targets, as the control plane places sessions on them (ADR 0014).

Targets register in Redis (`{prefix}:target:{name}` -> {"address", "name", "incarnation",
"sessions"}, kept alive by the actor's heartbeat, which also adds the name to the index
`{prefix}:targets`). A new session goes to the target driving
the fewest sessions (ties broken by a hash of the session id, so concurrent routers spread
the same way), with `Target.Start`. A target with no KV room answers RESOURCE_EXHAUSTED:
the next target is tried, then the start waits and retries for `admission_wait_s`, then the
request fails with RESOURCE_EXHAUSTED and an actionable message (ADR 0013).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
from dataclasses import dataclass

import grpc
from opentelemetry.trace import SpanKind

from specserve.errors import (
    AdapterNotFound,
    InvalidRequest,
    ResourceExhausted,
    SessionClosed,
    SessionNotFound,
    Unavailable,
)
from specserve.serving.telemetry import outgoing_metadata, tracer
from specserve.serving.tls import TlsFiles, aio_channel
from specserve.v1 import target_pb2, target_pb2_grpc

log = logging.getLogger("specserve.router.targets")

_CHANNEL_OPTIONS = [("grpc.keepalive_time_ms", 10_000)]
BACKOFF_S = 0.05
BACKOFF_MAX_S = 1.0
REFRESH_S = 1.0  # a placement re-reads the registry at most this often (loads change)


@dataclass
class Target:
    name: str
    address: str
    load: int  # sessions it drives, as its last heartbeat said, plus those placed here since
    adapters: frozenset[str] = frozenset()  # the LoRA adapters it has loaded (ADR 0029)


def _text(v: bytes | str) -> str:
    return v if isinstance(v, str) else v.decode()


async def _scan(redis, match: str):
    async for key in redis.scan_iter(match=match, count=100):
        yield _text(key)


class TargetDirectory:
    def __init__(self, redis, prefix: str, wait_s: float = 30.0, admission_wait_s: float = 10.0,
                 tls: TlsFiles | None = None, call_timeout_s: float = 30.0) -> None:
        self.redis = redis
        self.prefix = prefix
        self.wait_s = wait_s  # how long a start waits for a target to (re)appear
        self.admission_wait_s = admission_wait_s
        self.tls = tls
        self.call_timeout_s = call_timeout_s
        self.targets: dict[str, Target] = {}  # by address
        self.channels: dict[str, grpc.aio.Channel] = {}
        self.stubs: dict[str, target_pb2_grpc.TargetStub] = {}
        self._read_at = -1e9

    async def refresh(self) -> list[Target]:
        """The registered targets: the names in the registry's index (`{prefix}:targets`, which
        each target's heartbeat adds itself to), each one's entry read; a name whose entry
        expired leaves the index. With an empty index (targets older than it), a SCAN for the
        entries, as before: a SCAN walks the whole keyspace, every session's keys included, so
        a router refreshing each second paid for every session kept for its TTL (ADR 0028)."""
        head = f"{self.prefix}:target:"
        names = sorted(_text(n) for n in await self.redis.smembers(f"{self.prefix}:targets"))
        if not names:
            names = [k[len(head):] async for k in _scan(self.redis, f"{head}*") if ":" not in k[len(head):]]
        found: dict[str, Target] = {}
        for name in names:
            raw = await self.redis.get(head + name)
            if not raw:
                await self.redis.srem(f"{self.prefix}:targets", name)  # (no-op where it is not there)
                continue
            e = json.loads(raw)
            found[e["address"]] = Target(e.get("name", name), e["address"], int(e.get("sessions", 0)),
                                         frozenset(e.get("adapters") or ()))
        self.targets = found
        for a in found:
            if a not in self.stubs:
                self.channels[a] = aio_channel(a, self.tls, _CHANNEL_OPTIONS)
                self.stubs[a] = target_pb2_grpc.TargetStub(self.channels[a])
        self._read_at = asyncio.get_running_loop().time()
        return list(found.values())

    def ranked(self, session_id: str, adapter: str = "") -> list[Target]:
        """Least loaded first; equal loads in the session id's hash order. With a LoRA adapter:
        only the targets that have it loaded (ADR 0029)."""
        def tie(t: Target) -> bytes:
            return hashlib.blake2b(f"{session_id}|{t.address}".encode(), digest_size=8).digest()

        return sorted((t for t in self.targets.values() if not adapter or adapter in t.adapters),
                      key=lambda t: (t.load, tie(t)))

    async def adapters(self, fresh: bool = False) -> set[str]:
        """The LoRA adapters some live target has loaded (the registry at most REFRESH_S old)."""
        if fresh or not self.targets or asyncio.get_running_loop().time() - self._read_at > REFRESH_S:
            await self.refresh()
        return {a for t in self.targets.values() for a in t.adapters}

    async def require_adapter(self, adapter: str) -> None:
        """AdapterNotFound unless some live target has `adapter` loaded (read again before refusing)."""
        if adapter in await self.adapters() or adapter in await self.adapters(fresh=True):
            return
        known = sorted(await self.adapters())
        raise AdapterNotFound(f"the adapter (model) {adapter!r} does not exist: no target has it loaded; loaded: "
                              f"{', '.join(known) if known else 'none'} (specserve adapter list)")

    async def start(self, session_id: str, adapter: str = "") -> str:
        """Start the session on a target (one with its LoRA adapter); returns the target's name."""
        loop = asyncio.get_running_loop()
        appear_by = loop.time() + self.wait_s
        admitted_by: float | None = None
        backoff, refused = BACKOFF_S, ""
        with tracer().start_as_current_span("specserve.target.start_session", kind=SpanKind.CLIENT) as span:
            span.set_attribute("specserve.session_id", session_id)
            while True:
                if not self.targets or loop.time() - self._read_at > REFRESH_S:
                    await self.refresh()
                candidates = self.ranked(session_id, adapter)
                if not candidates and loop.time() >= appear_by:
                    if adapter and self.targets:
                        raise AdapterNotFound(f"no live target has adapter {adapter!r} loaded")
                    raise Unavailable("no target worker is registered; retry later")
                for t in candidates:
                    try:
                        await self.stubs[t.address].Start(target_pb2.StartRequest(session_id=session_id),
                                                          timeout=self.call_timeout_s, metadata=outgoing_metadata())
                    except grpc.aio.AioRpcError as err:
                        code = err.code()
                        if code == grpc.StatusCode.NOT_FOUND:
                            raise SessionNotFound(err.details() or session_id) from err
                        if code == grpc.StatusCode.FAILED_PRECONDITION:
                            raise SessionClosed(err.details() or session_id) from err
                        if code == grpc.StatusCode.INVALID_ARGUMENT:
                            raise InvalidRequest(err.details() or "the target refused the request") from err
                        if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                            refused = f"target {t.name}: {err.details()}"
                            admitted_by = admitted_by or loop.time() + self.admission_wait_s
                            continue
                        log.warning("target %s (%s) did not start session %s: %s", t.name, t.address, session_id,
                                    code)
                        self.targets.pop(t.address, None)  # rediscover before the next try
                        continue
                    t.load += 1
                    span.set_attribute("specserve.target", t.name)
                    return t.name
                if admitted_by is not None and loop.time() >= admitted_by:
                    raise ResourceExhausted(
                        f"no target has had KV room for this session for {self.admission_wait_s:g} s ({refused}); "
                        "retry later, send fewer concurrent requests, or raise the target's kv_budget_mb / add "
                        "targets")
                if admitted_by is None and loop.time() >= appear_by:
                    raise Unavailable("no target answered Start; retry later")
                await asyncio.sleep(backoff)
                backoff = min(2 * backoff, BACKOFF_MAX_S)
                self._read_at = -1e9

    async def stop(self, session_id: str) -> None:
        """Tell every target to stop driving the session now (the one driving it does)."""
        async def one(stub: target_pb2_grpc.TargetStub) -> None:
            with contextlib.suppress(grpc.aio.AioRpcError):
                await stub.Stop(target_pb2.StopRequest(session_id=session_id), timeout=1.0)

        await asyncio.gather(*(one(self.stubs[a]) for a in self.targets if a in self.stubs))

    async def close(self) -> None:
        await asyncio.gather(*(ch.close() for ch in self.channels.values()))
