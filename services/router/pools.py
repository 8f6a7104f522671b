"""The router's clients of the workers: draft pools (Propose) and targets (Verify).

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
import functools
import hashlib
import json
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry.trace import SpanKind

from specserve.errors import InvalidRequest, ResourceExhausted, Unavailable
from specserve.serving.streams import StreamClient
from specserve.serving.telemetry import outgoing_metadata, tracer
from specserve.serving.tls import TlsFiles, aio_channel
from specserve.serving.wire import prefix_to_proto
from specserve.state.prefix import CommittedPrefix
from specserve.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc

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


Call = Callable[[Any, float], Awaitable[Any]]  # (request, timeout_s) -> response


def per_round_call(unary: grpc.aio.UnaryUnaryMultiCallable, stream: grpc.aio.StreamStreamMultiCallable,
                   call_type: type, streams: bool) -> Call:
    """A worker method as the round loop calls it: over the (router, worker) stream, or as
    one unary call each (ADR 0010 measures both)."""
    if streams:
        return StreamClient(stream, call_type)
    return lambda request, timeout: unary(request, timeout=timeout, metadata=outgoing_metadata())


@dataclass
class Replica:
    address: str
    channel: grpc.aio.Channel
    stub: draft_pb2_grpc.DraftStub
    propose: Call
    healthy: bool = True


@dataclass
class Drafted:
    """A block for this round: asked for, or pushed by the worker ahead of time (pre-drafted
    for exactly this committed prefix, so the round made no call for it)."""

    response: draft_pb2.ProposeResponse
    pushed: bool = False


@dataclass
class DraftPool:
    name: str
    addresses: list[str]
    timeout_s: float
    streams: bool = True
    predraft_branches: int = 0  # asked of the workers: likely next prefixes to draft ahead for
    replicas: dict[str, Replica] = field(default_factory=dict)
    max_sessions: int = 4096  # sessions whose pushed blocks are kept (least recently used go)
    tls: TlsFiles | None = None  # mTLS to the replicas (ADR 0011)

    def __post_init__(self) -> None:
        # session -> (committed length, prefix hash, K) -> (block, replica that drafted it)
        self.pushed: OrderedDict[str, dict[tuple[int, int, int], tuple[draft_pb2.ProposeResponse, str]]] = \
            OrderedDict()
        self.informing: dict[str, asyncio.Task] = {}  # a Propose sent without waiting, per session
        for a in self.addresses:
            ch = aio_channel(a, self.tls, _CHANNEL_OPTIONS)
            stub = draft_pb2_grpc.DraftStub(ch)
            call: Call = StreamClient(stub.ProposeStream, draft_pb2.ProposeCall, functools.partial(self._on_push, a)) \
                if self.streams else per_round_call(stub.Propose, stub.ProposeStream, draft_pb2.ProposeCall, False)
            self.replicas[a] = Replica(a, ch, stub, call)
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

    def _on_push(self, replica: str, msg: draft_pb2.ProposeReply) -> None:
        d = msg.predraft
        blocks = self.pushed.setdefault(d.session_id, {})
        self.pushed.move_to_end(d.session_id)
        if len(blocks) >= 16:  # blocks of rounds long gone
            blocks.clear()
        blocks[(d.prefix_len, d.prefix_hash, d.k)] = (d.block, replica)
        while len(self.pushed) > self.max_sessions:
            self.pushed.popitem(last=False)

    async def propose(self, session_id: str, committed: CommittedPrefix, held: dict[str, int], k: int,
                      sampling: common_pb2.SamplingParams, seed: int) -> Drafted | None:
        """K drafts for the round: a block the worker pushed ahead for exactly this committed
        prefix (then the Propose that tells the worker where the session is goes out without
        waiting, and it drafts ahead again), else from the session's replica or the next
        healthy one; None when none answers (the round then runs as a plain step). `held`
        (replica -> committed length it holds) is updated: only the delta is sent to a replica
        that holds the prefix."""
        informing = self.informing.pop(session_id, None)
        if informing is not None:
            await asyncio.gather(informing, return_exceptions=True)  # keep the worker's calls in order
        n = len(committed)
        blocks = self.pushed.get(session_id)
        ahead = blocks.pop((n, committed.hash_at(n), k), None) if blocks else None
        if ahead is not None:
            block, address = ahead
            replica = self.replicas[address]
            self.informing[session_id] = asyncio.ensure_future(
                self._inform(replica, session_id, committed, held, k, sampling, seed))
            return Drafted(block, pushed=True)
        for replica in self.candidates(session_id):
            resp = await self._ask(replica, session_id, committed, held, k, sampling, seed)
            if resp is not None:
                return Drafted(resp)
        return None

    async def _inform(self, *args) -> draft_pb2.ProposeResponse | None:
        """The Propose sent without waiting after a pushed block was used: it outlives the
        round's propose span, so it has a client span of its own."""
        with tracer().start_as_current_span("specserve.draft.inform", kind=SpanKind.CLIENT):
            return await self._ask(*args)

    async def _ask(self, replica: Replica, session_id: str, committed: CommittedPrefix, held: dict[str, int], k: int,
                   sampling: common_pb2.SamplingParams, seed: int) -> draft_pb2.ProposeResponse | None:
        base = held.get(replica.address, 0)
        for _ in range(2):  # the second try resends the full prefix
            req = draft_pb2.ProposeRequest(session_id=session_id, prefix=prefix_to_proto(committed, base), k=k,
                                           sampling=sampling, seed=seed, predraft_branches=self.predraft_branches)
            try:
                resp = await replica.propose(req, self.timeout_s)
            except grpc.aio.AioRpcError as err:
                if err.code() == grpc.StatusCode.FAILED_PRECONDITION and base > 0:
                    base = 0
                    continue
                if err.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    replica.healthy = False
                log.warning("draft %s/%s failed: %s", self.name, replica.address, err.code())
                held.pop(replica.address, None)
                return None
            held[replica.address] = len(committed)
            return resp
        return None

    async def release(self, session_id: str, replica: str) -> None:
        self.pushed.pop(session_id, None)
        informing = self.informing.pop(session_id, None)
        if informing is not None:
            await asyncio.gather(informing, return_exceptions=True)
        r = self.replicas.get(replica)
        if r is not None:
            with contextlib.suppress(grpc.aio.AioRpcError):
                await r.stub.Release(common_pb2.ReleaseRequest(session_id=session_id), timeout=1.0)

    async def close(self) -> None:
        await _close_calls([r.propose for r in self.replicas.values()])
        await asyncio.gather(*(r.channel.close() for r in self.replicas.values()))


ADMISSION_BACKOFF_S, ADMISSION_BACKOFF_MAX_S = 0.005, 0.1


class TargetDirectory:
    """Targets registered in Redis; channels kept open per address."""

    def __init__(self, redis, prefix: str, verify_timeout_s: float = 10.0, wait_s: float = 30.0,
                 streams: bool = True, admission_wait_s: float = 10.0, tls: TlsFiles | None = None) -> None:
        self.tls = tls
        self.verify_timeout_s = verify_timeout_s
        self.admission_wait_s = admission_wait_s  # how long a round waits for KV room on its target
        self.streams = streams
        self.calls: dict[str, Call] = {}
        self.wait_s = wait_s  # how long a round waits for a target to (re)appear
        self._lost: set[str] = set()
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
                ch = aio_channel(a, self.tls, _CHANNEL_OPTIONS)
                self.channels[a] = ch
                stub = self.stubs[a] = target_pb2_grpc.TargetStub(ch)
                self.calls[a] = per_round_call(stub.Verify, stub.VerifyStream, target_pb2.VerifyCall, self.streams)
        return self.addresses

    async def pick(self, session_id: str, wait_s: float) -> tuple[str, Call] | None:
        """The session's target (consistent hash), waiting up to wait_s for one to register."""
        deadline = asyncio.get_running_loop().time() + wait_s
        while True:
            if not self.addresses:
                await self.refresh()
            if self.addresses:
                addr = self.ring.order(session_id)[0]
                return addr, self.calls[addr]
            if asyncio.get_running_loop().time() >= deadline:
                return None
            await asyncio.sleep(0.2)

    async def verify(self, session_id: str, committed: CommittedPrefix, held: dict[str, int],
                     proposal: draft_pb2.ProposeResponse | None, sampling: common_pb2.SamplingParams, seed: int,
                     deadline: float) -> target_pb2.VerifyResponse:
        """Verify on the session's target (a plain step without a proposal). On a lost
        target, rediscover and resend the full prefix (a re-prefill) until `deadline`
        (event-loop time); `held` is updated as in DraftPool.propose."""
        loop = asyncio.get_running_loop()
        admitted_by: float | None = None  # set at the first RESOURCE_EXHAUSTED
        backoff = ADMISSION_BACKOFF_S
        while True:
            picked = await self.pick(session_id, max(min(self.wait_s, deadline - loop.time()), 0.0))
            if picked is None:
                raise Unavailable("no target worker is registered; retry later")
            address, call = picked
            base = held.get(address, 0)
            req = target_pb2.VerifyRequest(
                session_id=session_id, prefix=prefix_to_proto(committed, base),
                draft_tokens=proposal.tokens if proposal else [],
                q=proposal.q if proposal else common_pb2.DraftProbs(), sampling=sampling, seed=seed)
            timeout = min(self.verify_timeout_s, max(deadline - loop.time(), 0.001))
            try:
                resp = await call(req, timeout)
            except grpc.aio.AioRpcError as err:
                code = err.code()
                held.pop(address, None)
                if code == grpc.StatusCode.FAILED_PRECONDITION:
                    continue
                if code == grpc.StatusCode.INVALID_ARGUMENT:
                    raise InvalidRequest(err.details() or "the target refused the request") from err
                if code == grpc.StatusCode.RESOURCE_EXHAUSTED:  # no KV room yet: queue (ADR 0013)
                    admitted_by = admitted_by or loop.time() + self.admission_wait_s
                    if loop.time() >= min(admitted_by, deadline):
                        raise ResourceExhausted(
                            f"target {address} has had no KV room for this session for {self.admission_wait_s:g} s "
                            f"({err.details()}); the committed tokens are kept: retry or resume later, send fewer "
                            f"concurrent requests, or raise the target's kv_budget_mb / add targets") from err
                    await asyncio.sleep(backoff)
                    backoff = min(2 * backoff, ADMISSION_BACKOFF_MAX_S)
                    continue
                if loop.time() >= deadline:
                    raise Unavailable(f"target {address} did not answer before the deadline") from err
                # one warning per lost target, not one per retry while Ray restarts it
                (log.debug if address in self._lost else log.warning)(
                    "target %s failed (%s); rediscovering", address, code)
                self._lost.add(address)
                self.forget(address)
                await asyncio.sleep(0.1)
                continue
            held[address] = len(committed)
            return resp

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
        await _close_calls(list(self.calls.values()))
        await asyncio.gather(*(ch.close() for ch in self.channels.values()))


async def _close_calls(calls: list[Call]) -> None:
    await asyncio.gather(*(c.close() for c in calls if isinstance(c, StreamClient)))
