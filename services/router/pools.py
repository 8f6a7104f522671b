"""Clients for the draft pools and the targets.

Draft pool: several replicas, session affinity by consistent hash (a replica's KV cache is
reused), background health checks, a per-call deadline. A failed or slow call tries the
next healthy replica on the ring; when none answers, the caller falls back to a plain
decode step: a request never fails because a draft worker died.

Targets are discovered in Redis (`{prefix}:target:{name}` -> {"address", "pid"}, kept alive
by the actor's heartbeat) and picked by consistent hash of the session id.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import hashlib
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specserve.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2_grpc

log = logging.getLogger("specserve.router.pools")

_CHANNEL_OPTIONS = [("grpc.keepalive_time_ms", 10_000), ("grpc.max_receive_message_length", 64 << 20),
                    ("grpc.max_send_message_length", 64 << 20)]


def _h(key: str) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big")


class HashRing:
    """Consistent hashing with virtual nodes: removing a replica moves only its sessions."""

    def __init__(self, members: Sequence[str], vnodes: int = 64) -> None:
        self.points = sorted((_h(f"{m}#{i}"), m) for m in members for i in range(vnodes))

    def order(self, key: str) -> list[str]:
        """Members in ring order starting at key's position, each once."""
        if not self.points:
            return []
        start = bisect.bisect(self.points, (_h(key), ""))
        seen: list[str] = []
        for i in range(len(self.points)):
            m = self.points[(start + i) % len(self.points)][1]
            if m not in seen:
                seen.append(m)
        return seen


@dataclass
class Replica:
    address: str
    channel: grpc.aio.Channel
    stub: draft_pb2_grpc.DraftStub
    healthy: bool = True


@dataclass
class DraftAnswer:
    response: draft_pb2.ProposeResponse
    replica: str


@dataclass
class DraftPool:
    name: str
    addresses: list[str]
    timeout_s: float
    replicas: dict[str, Replica] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for a in self.addresses:
            ch = grpc.aio.insecure_channel(a, options=_CHANNEL_OPTIONS)
            self.replicas[a] = Replica(a, ch, draft_pb2_grpc.DraftStub(ch))
        self.ring = HashRing(self.addresses)

    def candidates(self, session_id: str) -> list[Replica]:
        ordered = [self.replicas[a] for a in self.ring.order(session_id)]
        return [r for r in ordered if r.healthy] + [r for r in ordered if not r.healthy]

    async def check_health(self) -> None:
        async def one(r: Replica) -> None:
            try:
                resp = await health_pb2_grpc.HealthStub(r.channel).Check(
                    health_pb2.HealthCheckRequest(service="specserve.v1.Draft"), timeout=1.0)
                r.healthy = resp.status == health_pb2.HealthCheckResponse.SERVING
            except grpc.aio.AioRpcError:
                r.healthy = False

        await asyncio.gather(*(one(r) for r in self.replicas.values()))

    async def release(self, session_id: str, replica: str) -> None:
        r = self.replicas.get(replica)
        if r is not None:
            with contextlib.suppress(grpc.aio.AioRpcError):
                await r.stub.Release(common_pb2.ReleaseRequest(session_id=session_id), timeout=1.0)

    async def close(self) -> None:
        await asyncio.gather(*(r.channel.close() for r in self.replicas.values()))


class TargetDirectory:
    """Targets registered in Redis; channels kept open per address."""

    def __init__(self, redis, prefix: str) -> None:
        self.redis = redis
        self.pattern = f"{prefix}:target:*"
        self.addresses: list[str] = []
        self.ring = HashRing([])  # rebuilt only when the registry changes, not per Verify
        self.channels: dict[str, grpc.aio.Channel] = {}
        self.stubs: dict[str, target_pb2_grpc.TargetStub] = {}

    async def refresh(self) -> list[str]:
        found = []
        async for key in self.redis.scan_iter(match=self.pattern, count=100):
            raw = await self.redis.get(key)
            if raw:
                found.append(json.loads(raw)["address"])
        self._set(sorted(set(found)))
        for a in self.addresses:
            if a not in self.stubs:
                ch = grpc.aio.insecure_channel(a, options=_CHANNEL_OPTIONS)
                self.channels[a] = ch
                self.stubs[a] = target_pb2_grpc.TargetStub(ch)
        return self.addresses

    async def pick(self, session_id: str, wait_s: float) -> tuple[str, target_pb2_grpc.TargetStub] | None:
        """The session's target (consistent hash), waiting up to wait_s for one to register."""
        deadline = asyncio.get_running_loop().time() + wait_s
        while True:
            if not self.addresses:
                await self.refresh()
            if self.addresses:
                addr = self.ring.order(session_id)[0]
                return addr, self.stubs[addr]
            if asyncio.get_running_loop().time() >= deadline:
                return None
            await asyncio.sleep(0.2)

    async def release(self, session_id: str, addresses: list[str]) -> None:
        for a in addresses:
            stub = self.stubs.get(a)
            if stub is not None:
                with contextlib.suppress(grpc.aio.AioRpcError):
                    await stub.Release(common_pb2.ReleaseRequest(session_id=session_id), timeout=1.0)

    def forget(self, address: str) -> None:
        """A call to `address` failed: rediscover before the next pick."""
        self._set([a for a in self.addresses if a != address])

    def _set(self, addresses: list[str]) -> None:
        if addresses != self.addresses:
            self.addresses = addresses
            self.ring = HashRing(addresses)

    async def close(self) -> None:
        await asyncio.gather(*(ch.close() for ch in self.channels.values()))
