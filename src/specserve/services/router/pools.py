"""The router's view of the draft pools: their replicas' health, for the
`specserve_pool_healthy_replicas` gauge (and the alert on a pool with no replica left).

Since ADR 0014 the router makes no per-round call to a draft worker: the target's engine
links to the replicas itself (`specserve.engine.remote_drafts.RemoteDrafts`) and fails a session
over to the next replica, or to plain rounds, when one dies. The router only asks each
replica's gRPC health service.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specserve.config import LOCAL
from specserve.serving.tls import TlsFiles, aio_channel

_CHANNEL_OPTIONS = [("grpc.keepalive_time_ms", 10_000)]
HEALTH_TIMEOUT_S = 1.0


@dataclass
class Replica:
    address: str
    channel: grpc.aio.Channel | None  # None: `local:ngram`, drafted inside the target (always there)
    healthy: bool = True


@dataclass
class DraftPool:
    name: str
    addresses: list[str]
    tls: TlsFiles | None = None  # mTLS to the replicas (ADR 0011)
    replicas: dict[str, Replica] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for a in self.addresses:
            self.replicas[a] = Replica(a, None if a in LOCAL else aio_channel(a, self.tls, _CHANNEL_OPTIONS))

    @property
    def healthy(self) -> int:
        return sum(r.healthy for r in self.replicas.values())

    async def check_health(self) -> None:
        async def one(r: Replica) -> None:
            if r.channel is None:  # in the target: the target's own health covers it
                return
            try:
                resp = await health_pb2_grpc.HealthStub(r.channel).Check(
                    health_pb2.HealthCheckRequest(service="specserve.v1.Draft"), timeout=HEALTH_TIMEOUT_S)
                r.healthy = resp.status == health_pb2.HealthCheckResponse.SERVING
            except grpc.aio.AioRpcError:
                r.healthy = False

        await asyncio.gather(*(one(r) for r in self.replicas.values()))

    async def close(self) -> None:
        await asyncio.gather(*(r.channel.close() for r in self.replicas.values() if r.channel is not None))
