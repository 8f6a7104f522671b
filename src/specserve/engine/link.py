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
from dataclasses import dataclass

import grpc

from specserve.engine.drafting import Deliver
from specserve.engine.session import DraftBlock, EngineSession, Outcome
from specserve.serving.wire import sampling_to_proto
from specserve.state.prefix import CommittedPrefix
from specserve.v1 import common_pb2, draft_pb2, draft_pb2_grpc
from specserve.worker.qcodec import q_from_proto

log = logging.getLogger("specserve.engine")


@dataclass
class _Session:
    prefix: CommittedPrefix
    sampling: common_pb2.SamplingParams
    seed: int
    k: int
    replica: _Replica | None = None
    failed: bool = False  # the replica refused it (bad parameters, no room): plain rounds


class _Replica:
    def __init__(self, address: str) -> None:
        self.address = address
        self.up = False
        self.queue: asyncio.Queue[draft_pb2.LinkIn | None] = asyncio.Queue()
        self.task: asyncio.Task | None = None


class RemoteDrafts:
    def __init__(self, addresses: list[str], loop: asyncio.AbstractEventLoop, vocab_size: int,
                 predraft_branches: int = 2, credentials: grpc.ChannelCredentials | None = None,
                 reconnect_s: float = 0.5) -> None:
        if not addresses:
            raise ValueError("a draft pool needs at least one replica address")
        self.loop = loop
        self.vocab_size = vocab_size
        self.predraft_branches = predraft_branches
        self.credentials = credentials
        self.reconnect_s = reconnect_s
        self.replicas = [_Replica(a) for a in addresses]
        self.sessions: dict[str, _Session] = {}
        self.deliver: Deliver | None = None

    # ---- the engine's side (loop thread): hand everything to the event loop ----
    def attach(self, deliver: Deliver) -> None:
        self.deliver = deliver

    def drafts_for(self, session_id: str) -> bool:
        s = self.sessions.get(session_id)
        if s is not None and s.failed:
            return False
        return any(r.up for r in self.replicas)

    def open(self, session: EngineSession) -> None:
        sampling = sampling_to_proto(session.plan.params.sampling)
        args = (session.id, list(session.committed.ids), sampling, session.plan.seed, session.k_wanted)
        self.loop.call_soon_threadsafe(self._open, *args)

    def outcome(self, outcome: Outcome) -> None:
        self.loop.call_soon_threadsafe(self._outcome, outcome)

    def close(self, session_id: str) -> None:
        self.loop.call_soon_threadsafe(self._close, session_id)

    # ---- the event loop ----
    def start(self) -> RemoteDrafts:
        for r in self.replicas:
            r.task = self.loop.create_task(self._keep_linked(r))
        return self

    async def stop(self) -> None:
        for r in self.replicas:
            if r.task is not None:
                r.task.cancel()
                await asyncio.gather(r.task, return_exceptions=True)

    def _open(self, sid: str, ids: list[int], sampling: common_pb2.SamplingParams, seed: int, k: int) -> None:
        s = self.sessions[sid] = _Session(CommittedPrefix(ids), sampling, seed, k)
        self._place(sid, s)

    def _place(self, sid: str, s: _Session) -> None:
        """Open the session on its replica (the likeliest live one) from the whole prefix."""
        s.replica = self._pick(sid)
        if s.replica is not None:
            s.replica.queue.put_nowait(draft_pb2.LinkIn(open=draft_pb2.LinkOpen(
                session_id=sid, committed=s.prefix.ids, sampling=s.sampling, seed=s.seed, k=s.k,
                predraft_branches=self.predraft_branches)))

    def _pick(self, sid: str) -> _Replica | None:
        live = [r for r in self.replicas if r.up]
        if not live:
            return None
        return max(live, key=lambda r: hashlib.blake2b(f"{sid}@{r.address}".encode(), digest_size=8).digest())

    def _outcome(self, o: Outcome) -> None:
        s = self.sessions.get(o.session_id)
        if s is None or s.failed:
            return
        s.prefix.crop(o.committed_len - len(o.emitted))
        s.prefix.extend(o.emitted)
        s.k = o.k
        if s.replica is None or not s.replica.up:  # its replica went away: open it elsewhere
            self._place(o.session_id, s)
            return
        s.replica.queue.put_nowait(draft_pb2.LinkIn(outcome=draft_pb2.LinkOutcome(
            session_id=o.session_id, committed_len=o.committed_len, emitted=o.emitted, k=o.k)))

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
        async with (grpc.aio.secure_channel(r.address, self.credentials) if self.credentials
                    else grpc.aio.insecure_channel(r.address)) as channel:
            await asyncio.wait_for(channel.channel_ready(), timeout=2.0)
            r.queue = asyncio.Queue()
            call = draft_pb2_grpc.DraftStub(channel).Link(self._requests(r.queue))
            r.up = True
            for sid, s in self.sessions.items():  # sessions with no live replica come here
                if s.replica is None and not s.failed:
                    self._place(sid, s)
            async for reply in call:
                self._receive(reply)

    async def _requests(self, queue: asyncio.Queue[draft_pb2.LinkIn | None]):
        while (msg := await queue.get()) is not None:
            yield msg

    def _lost(self, r: _Replica) -> None:
        r.up = False
        r.queue.put_nowait(None)
        for sid, s in self.sessions.items():
            if s.replica is r:
                self._place(sid, s)  # the next live replica, or none (plain until one is back)

    def _receive(self, reply: draft_pb2.LinkOut) -> None:
        if reply.failed_session:
            s = self.sessions.get(reply.failed_session)
            if s is not None:
                s.failed = True
                log.info("draft replica refused session %s: %s", reply.failed_session, reply.error)
            return
        b = reply.block
        if self.deliver is None or b.session_id not in self.sessions:
            return
        tokens = tuple(int(t) for t in b.block.tokens)
        self.deliver(DraftBlock(b.session_id, b.prefix_len, b.prefix_hash, tokens,
                                q_from_proto(b.block.q, len(tokens), self.vocab_size),
                                draft_ms=b.block.draft_ms, predrafted=b.block.predrafted,
                                rollback_tokens=b.block.rollback_tokens))
