"""A draft pool as the engine's draft source: one `Draft.Link` stream per replica (ADR 0014).

The engine's calls (open, outcome, close) come from the loop thread and are handed to the
event loop, which owns the streams. Blocks coming back are delivered to the engine, which
uses each only for exactly the committed prefix it names. Only token ids cross (and sparse q
at T > 0).

Each session drafts on one replica, chosen by rendezvous hashing among the live ones, so
its KV stays in one place. When a replica's stream breaks, its sessions move to the next
live replica and are opened there from the whole committed prefix (this source keeps each
session's prefix from the outcomes). With no live replica, a session's rounds run plain:
the source fails closed. A broken replica is reconnected in the background.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from specserve.engine.drafting import Deliver
from specserve.engine.session import DraftBlock, EngineSession, Outcome
from specserve.serving.tls import TlsFiles, aio_channel
from specserve.serving.wire import sampling_to_proto
from specserve.state.prefix import CommittedPrefix
from specserve.v1 import common_pb2, draft_pb2, draft_pb2_grpc
from specserve.worker.qcodec import q_from_proto

if TYPE_CHECKING:
    import torch

log = logging.getLogger("specserve.engine")


@dataclass
class _Session:
    prefix: CommittedPrefix
    sampling: common_pb2.SamplingParams
    seed: int
    k: int
    constraint: tuple[str, str, int] = ("", "", 0)  # (kind, value, prompt length): the replica masks its drafts
    replica: _Replica | None = None
    failed: bool = False  # the replica refused it (bad parameters, no room): plain rounds
    asked: float | None = None  # event-loop time of the open or outcome still waiting for its block
    # a feature pool's sessions (ADR 0020): the target's features of the committed positions as
    # sent, kept to open the session on another replica after a failover
    features: list[draft_pb2.Features] = field(default_factory=list)
    draft_priority: int = 0  # its class's (ADR 0021): a saturated replica sheds the lowest first


class _Replica:
    def __init__(self, address: str) -> None:
        self.address = address
        self.up = False
        self.queue: asyncio.Queue[draft_pb2.LinkIn | None] = asyncio.Queue()
        self.task: asyncio.Task[None] | None = None


def replica_for(session_id: str, addresses: list[str]) -> str:
    """The replica a session drafts on among `addresses` (rendezvous hashing: when one goes
    away, only its sessions move)."""
    return max(addresses, key=lambda a: hashlib.blake2b(f"{session_id}@{a}".encode(), digest_size=8).digest())


class RemoteDrafts:
    def __init__(self, addresses: list[str], loop: asyncio.AbstractEventLoop, vocab_size: int,
                 predraft_branches: int = 2, tls: TlsFiles | None = None,
                 reconnect_s: float = 0.5, timeout_s: float = 1.0, wants_features: bool = False) -> None:
        if not addresses:
            raise ValueError("a draft pool needs at least one replica address")
        self.loop = loop
        self.vocab_size = vocab_size
        self.predraft_branches = predraft_branches
        self.tls = tls  # mutual TLS to the replicas (ADR 0011); None = plaintext
        self.reconnect_s = reconnect_s
        # a replica that owes a block for this long is taken for dead (stopped, hung: its
        # stream may not break) and its sessions move to the next live replica
        self.timeout_s = timeout_s
        self.replicas = [_Replica(a) for a in addresses]
        # a pool whose replicas draft from the target's features (an EAGLE head, ADR 0020): the
        # engine asks the target for them and they go on the stream before each outcome
        self.wants_features = wants_features
        self.feature_bytes = 0
        self.sessions: dict[str, _Session] = {}
        self.deliver: Deliver | None = None
        # a session's trace context for the replica (its draft spans join the request's trace)
        self.carrier_for: Callable[[str], dict[str, str]] = lambda sid: {}

    # ---- the engine's side (loop thread): hand everything to the event loop ----
    def attach(self, deliver: Deliver) -> None:
        self.deliver = deliver

    def drafts_for(self, session_id: str) -> bool:
        s = self.sessions.get(session_id)
        if s is not None and s.failed:
            return False
        return any(r.up for r in self.replicas)

    def refused(self, session_id: str) -> bool:
        s = self.sessions.get(session_id)
        return s is not None and s.failed

    def open(self, session: EngineSession) -> None:
        sampling = sampling_to_proto(session.plan.params.sampling)
        c = session.plan.constraint
        constraint = (c.kind, c.value, session.prompt_len) if c is not None else ("", "", 0)
        args = (session.id, list(session.committed.ids), sampling, session.plan.seed, session.k_next, constraint,
                session.plan.draft_priority)
        self.loop.call_soon_threadsafe(self._open, *args)

    def outcome(self, outcome: Outcome) -> None:
        self.loop.call_soon_threadsafe(self._outcome, outcome)

    def features(self, session_id: str, start: int, feats: torch.Tensor) -> None:
        """The target's features of committed positions (loop thread): they leave the target's
        device here, once, as bf16 bytes, and go on the stream ahead of the round's outcome."""
        from specserve.drafters.eagle import features_to_wire

        if not self.wants_features or feats is None or feats.shape[0] == 0:
            return
        rows, width, data = features_to_wire(feats)
        self.feature_bytes += len(data)
        msg = draft_pb2.Features(start=start, rows=rows, width=width, data=data)
        self.loop.call_soon_threadsafe(self._features, session_id, msg)

    def close(self, session_id: str) -> None:
        self.loop.call_soon_threadsafe(self._close, session_id)

    # ---- the event loop ----
    def start(self) -> RemoteDrafts:
        for r in self.replicas:
            r.task = self.loop.create_task(self._keep_linked(r))
        self._watchdog = self.loop.create_task(self._watch())
        return self

    async def stop(self) -> None:
        self._watchdog.cancel()
        for r in self.replicas:
            if r.task is not None:
                r.task.cancel()
                await asyncio.gather(r.task, return_exceptions=True)

    def _open(self, sid: str, ids: list[int], sampling: common_pb2.SamplingParams, seed: int, k: int,
              constraint: tuple[str, str, int] = ("", "", 0), draft_priority: int = 0) -> None:
        s = self.sessions[sid] = _Session(CommittedPrefix(ids), sampling, seed, k, constraint,
                                          draft_priority=draft_priority)
        self._place(sid, s)

    def _place(self, sid: str, s: _Session) -> None:
        """Open the session on its replica (the likeliest live one) from the whole prefix."""
        s.replica = self._pick(sid)
        s.asked = self.loop.time() if s.k > 0 else None
        if s.replica is not None:
            s.replica.queue.put_nowait(draft_pb2.LinkIn(open=draft_pb2.LinkOpen(
                session_id=sid, committed=s.prefix.ids, sampling=s.sampling, seed=s.seed, k=s.k,
                predraft_branches=0 if self.wants_features else self.predraft_branches,
                constraint_kind=s.constraint[0], constraint_value=s.constraint[1], prompt_len=s.constraint[2],
                features_through=s.features[-1].start + s.features[-1].rows if s.features else 0,
                draft_priority=s.draft_priority),
                trace_context=self.carrier_for(sid)))
            for f in s.features:  # a feature pool's session opened elsewhere: what it had so far
                s.replica.queue.put_nowait(draft_pb2.LinkIn(features=draft_pb2.LinkFeatures(session_id=sid,
                                                                                            features=f)))

    def _pick(self, sid: str) -> _Replica | None:
        live = {r.address: r for r in self.replicas if r.up}
        return live[replica_for(sid, list(live))] if live else None

    def _outcome(self, o: Outcome) -> None:
        s = self.sessions.get(o.session_id)
        if s is None or s.failed:
            return
        s.prefix.crop(o.committed_len - len(o.emitted))
        s.prefix.extend(o.emitted)
        s.k = o.k
        s.asked = self.loop.time() if o.k > 0 and s.asked is None else s.asked
        if s.replica is None or not s.replica.up:  # its replica went away: open it elsewhere
            self._place(o.session_id, s)
            return
        s.replica.queue.put_nowait(draft_pb2.LinkIn(outcome=draft_pb2.LinkOutcome(
            session_id=o.session_id, committed_len=o.committed_len, emitted=o.emitted, k=o.k,
            tree_width=o.width)))

    def _features(self, sid: str, f: draft_pb2.Features) -> None:
        s = self.sessions.get(sid)
        if s is None or s.failed:
            return
        while s.features and s.features[-1].start >= f.start:  # a re-prefill from an earlier position
            s.features.pop()
        if s.features and s.features[-1].start + s.features[-1].rows > f.start:
            last = s.features[-1]
            keep = f.start - last.start
            s.features[-1] = draft_pb2.Features(start=last.start, rows=keep, width=last.width,
                                                data=last.data[:2 * keep * last.width])
        s.features.append(f)
        if s.replica is not None and s.replica.up:
            s.replica.queue.put_nowait(draft_pb2.LinkIn(features=draft_pb2.LinkFeatures(session_id=sid, features=f)))

    def _close(self, sid: str) -> None:
        s = self.sessions.pop(sid, None)
        if s is not None and s.replica is not None and s.replica.up:
            s.replica.queue.put_nowait(draft_pb2.LinkIn(close=sid))

    async def _keep_linked(self, r: _Replica) -> None:
        while True:
            try:
                await self._link(r)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the replica died or refused: move its sessions, retry later
                log.info("draft replica %s: link lost (%s)", r.address, exc)
            self._lost(r)
            await asyncio.sleep(self.reconnect_s)

    async def _link(self, r: _Replica) -> None:
        async with aio_channel(r.address, self.tls, []) as channel:
            await asyncio.wait_for(channel.channel_ready(), timeout=2.0)
            r.queue = asyncio.Queue()
            call = draft_pb2_grpc.DraftStub(channel).Link(self._requests(r.queue))
            r.up = True
            for sid, s in self.sessions.items():  # sessions with no live replica come here
                if s.replica is None and not s.failed:
                    self._place(sid, s)
            async for reply in call:
                self._receive(reply)

    async def _requests(self, queue: asyncio.Queue[draft_pb2.LinkIn | None]) -> AsyncIterator[draft_pb2.LinkIn]:
        while (msg := await queue.get()) is not None:
            yield msg

    def _lost(self, r: _Replica) -> None:
        r.up = False
        r.queue.put_nowait(None)
        for sid, s in self.sessions.items():
            if s.replica is r:
                self._place(sid, s)  # the next live replica, or none (plain until one is back)

    async def _watch(self) -> None:
        """Fail over from a replica that owes a block for longer than `timeout_s`."""
        while True:
            await asyncio.sleep(self.timeout_s / 4)
            now = self.loop.time()
            late = {s.replica for s in self.sessions.values()
                    if s.asked is not None and s.replica is not None and s.replica.up
                    and now - s.asked > self.timeout_s}
            for r in late:
                assert r is not None
                log.warning("draft replica %s owes a block for over %.1f s: its sessions move", r.address,
                            self.timeout_s)
                if r.task is not None:
                    r.task.cancel()  # drop the stream; reconnect in the background
                self._lost(r)
                r.task = self.loop.create_task(self._relink(r))

    async def _relink(self, r: _Replica) -> None:
        await asyncio.sleep(self.timeout_s)
        await self._keep_linked(r)

    def _receive(self, reply: draft_pb2.LinkOut) -> None:
        if reply.failed_session:
            s = self.sessions.get(reply.failed_session)
            if s is not None:
                s.failed, s.asked = True, None
                log.info("draft replica refused session %s: %s", reply.failed_session, reply.error)
            return
        b = reply.block
        s = self.sessions.get(b.session_id)
        if self.deliver is None or s is None:
            return
        s.asked = None
        tokens = tuple(int(t) for t in b.block.tokens)
        parents = tuple(int(p) for p in b.block.parents) or None  # a token tree (ADR 0020)
        if parents is not None and (len(parents) != len(tokens) or any(not -1 <= p < i for i, p in enumerate(parents))):
            log.warning("draft replica sent a malformed tree for %s: ignored", b.session_id)
            return
        self.deliver(DraftBlock(b.session_id, b.prefix_len, b.prefix_hash, tokens,
                                q_from_proto(b.block.q, len(tokens), self.vocab_size),
                                draft_ms=b.block.draft_ms, predrafted=b.block.predrafted, parents=parents))
