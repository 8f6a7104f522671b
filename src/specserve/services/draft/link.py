"""The draft worker's end of a target's stream (`Draft.Link`, ADR 0014).

The target opens sessions and sends each round's outcome. The worker keeps each session's
committed prefix from those messages, drafts the next block through the same path as
`Propose` (reconcile, the speculation cache, batched drafting, drafting ahead), and pushes it
named by the prefix it assumes. Blocks drafted ahead for likely outcomes are pushed as soon
as they are ready. When the target's round lands on one of them, the block is already there
and the round has no network hop on its critical path.

A session's messages are handled in order (a lock per session); different sessions draft
concurrently, so the scheduler batches them. An outcome already overtaken by a newer one
only moves the prefix. Its block would be stale on arrival.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import grpc

from specserve.errors import NeedsFullPrefix, ResourceExhausted, SessionNotFound, SpecserveError
from specserve.serving.grpc_server import status_for
from specserve.serving.telemetry import attach_carrier, tracer
from specserve.serving.wire import prefix_to_proto
from specserve.state.prefix import CommittedPrefix
from specserve.v1 import common_pb2, draft_pb2

GAIN_PRIOR = 1.0  # a new session's accepted drafts a block, until its outcomes tell


@dataclass
class _Linked:
    """One session on this stream: the committed prefix the target told us, and how to draft."""

    prefix: CommittedPrefix
    sampling: common_pb2.SamplingParams
    seed: int
    branches: int
    held: int = 0  # prefix length the worker's session table holds (the incremental base)
    latest: int = 0  # committed length of the newest outcome received
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    carrier: dict[str, str] = field(default_factory=dict)  # the session's trace (from its open)
    grammar: Any = None  # structured/grammar.py DraftGrammar: its blocks draft from the masked q
    compiling: asyncio.Future | None = None  # the constraint, compiling on a thread (the grammar, when done)
    # a block asked for before the features it drafts from were here (K, trace): drafted when they come
    deferred: tuple[int, dict] | None = None
    features_through: int = 0  # the open's: the target's features of positions before it follow the open
    # what this replica's drafts are worth to the session (ADR 0021): its last block, and the
    # drafts the target accepted a block (smoothed); a saturated replica sheds the lowest first
    last_block: tuple[int, ...] = ()
    gain: float = GAIN_PRIOR
    priority: int = 0  # its class's draft_priority: a saturated replica sheds lower priorities first


class Link:
    def __init__(self, servicer) -> None:  # specserve.services.draft.server.DraftServicer
        self.servicer = servicer
        self.sessions: dict[str, _Linked] = {}
        self.out: asyncio.Queue[draft_pb2.LinkOut | None] = asyncio.Queue()
        self.tasks: set[asyncio.Task] = set()

    async def serve(self, messages: AsyncIterator[draft_pb2.LinkIn]) -> AsyncIterator[draft_pb2.LinkOut]:
        pump = asyncio.ensure_future(self._pump(messages))
        try:
            while (reply := await self.out.get()) is not None:
                yield reply
        finally:
            pump.cancel()
            for task in list(self.tasks):
                task.cancel()
            for sid in self.sessions:
                self.servicer.sessions.release(sid)

    def end(self) -> None:
        """End the reply stream (the replica drains): the target moves this link's sessions to
        another replica at once."""
        self.out.put_nowait(None)

    async def _pump(self, messages: AsyncIterator[draft_pb2.LinkIn]) -> None:
        try:
            async for msg in messages:
                self._receive(msg)
        except (asyncio.CancelledError, grpc.aio.AioRpcError):
            pass
        finally:
            self.out.put_nowait(None)  # the target hung up: end the reply stream

    def _receive(self, msg: draft_pb2.LinkIn) -> None:
        kind = msg.WhichOneof("kind")
        if kind == "features":  # queued in the session's drafter, ahead of the outcome that follows
            f = msg.features
            linked = self.sessions.get(f.session_id)
            if linked is not None:
                try:
                    self.servicer.features(f.session_id, f.features)
                except SpecserveError as exc:
                    self._fail(f.session_id, exc)
                    return
                if linked.deferred is not None and self.servicer.ready(f.session_id, len(linked.prefix)):
                    (k, carrier), linked.deferred = linked.deferred, None
                    self._spawn(self._draft(f.session_id, k, None, carrier))
            return
        if kind == "close":
            linked = self.sessions.pop(msg.close, None)
            if linked is not None:
                self.servicer.sessions.release(msg.close)
            return
        if kind == "open":
            o = msg.open
            if self.servicer.saturated() and not self._make_room(o.session_id, int(o.draft_priority)):
                # admission (ADR 0021): the target runs it plain at once
                self.servicer.metrics.shed.labels("admission").inc()
                self._fail(o.session_id, ResourceExhausted(
                    f"draft replica saturated: {self.servicer.core.scheduler.depth()} work items queued "
                    f"(max_queue {self.servicer.max_queue}); session {o.session_id} decodes without drafts"))
                return
            linked = self.sessions[o.session_id] = _Linked(CommittedPrefix(o.committed), o.sampling, int(o.seed),
                                                           o.predraft_branches, latest=len(o.committed),
                                                           carrier=dict(msg.trace_context),
                                                           features_through=int(o.features_through),
                                                           priority=int(o.draft_priority))
            if o.constraint_kind:  # compiled on a thread: this loop carries every session's blocks
                linked.compiling = asyncio.ensure_future(asyncio.to_thread(
                    self.servicer.grammar, o.constraint_kind, o.constraint_value, o.prompt_len))
                linked.compiling.add_done_callback(lambda f: f.cancelled() or f.exception())  # (read in _compiled)
            sid, k, update = o.session_id, o.k, None
        elif kind == "outcome":
            linked_or_none = self.sessions.get(msg.outcome.session_id)
            if linked_or_none is None:
                return  # closed meanwhile
            linked_or_none.latest = max(linked_or_none.latest, msg.outcome.committed_len)
            sid, k, update = msg.outcome.session_id, msg.outcome.k, msg.outcome
        else:
            return
        self._spawn(self._draft(sid, k, update, dict(msg.trace_context)))

    def _spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _draft(self, sid: str, k: int, outcome: draft_pb2.LinkOutcome | None, carrier: dict) -> None:
        linked = self.sessions.get(sid)
        if linked is None:
            return
        async with linked.lock:
            if outcome is not None:
                linked.deferred = None  # a newer round: its own block is what is wanted now
                linked.gain += 0.3 * (_accepted(linked.last_block, outcome.emitted) - linked.gain)
                if self._shed(sid, linked):
                    return
                linked.prefix.crop(outcome.committed_len - len(outcome.emitted))
                linked.prefix.extend(outcome.emitted)
                if outcome.committed_len < linked.latest:
                    return  # a newer outcome is queued behind: this block would be stale
            if k <= 0 or sid not in self.sessions or not await self._compiled(sid, linked):
                return
            n = len(linked.prefix)
            if linked.features_through and not self.servicer.ready(sid, n):
                # A feature head reopened here after a failover, before the target's features
                # that follow its open came: its block is drafted when they come (an empty one
                # would make the round plain, and cost an exact session its wait). (A new
                # session has none at its open: its empty first block is what the local pool's
                # nothing is, a plain first round, and tells the target the replica answers.)
                linked.deferred = (k, carrier)
                return
            attach_carrier(carrier or linked.carrier)  # each block is a span of the session's trace
            request = draft_pb2.ProposeRequest(session_id=sid, prefix=prefix_to_proto(linked.prefix, linked.held),
                                               k=k, sampling=linked.sampling, seed=linked.seed,
                                               predraft_branches=linked.branches,
                                               tree_width=outcome.tree_width if outcome is not None else 0)
            try:
                with tracer().start_as_current_span("specserve.draft.block") as span:
                    span.set_attributes({"specserve.session_id": sid, "specserve.k": k,
                                         "specserve.prefix_len": n})
                    block = await self._propose(request, linked)
            except SpecserveError as exc:  # bad parameters, no KV room: the target runs it plain
                self._fail(sid, exc)
                return
            linked.held = n
            linked.last_block = tuple(block.tokens) if not block.parents else ()
            self._send(sid, n, linked.prefix.hash_at(n), k, block)

    async def _compiled(self, sid: str, linked: _Linked) -> bool:
        """The session's constraint is ready (or it has none); False when this replica cannot
        compile it: the session leaves the link and the target runs it plain."""
        if linked.compiling is None:
            return True
        try:
            linked.grammar = await linked.compiling
        except SpecserveError as exc:
            self.sessions.pop(sid, None)
            self._fail(sid, exc)
            return False
        linked.compiling = None
        return True

    def _make_room(self, sid: str, priority: int) -> bool:
        """Saturated: admit a session of this draft priority in place of the session of the
        lowest priority below it on this stream (the one whose drafts help it least among
        those), shed at once, so the replica's sessions do not grow; False when none is below."""
        below = [(s.priority, s.gain, other) for other, s in self.sessions.items() if s.priority < priority]
        if not below:
            return False
        _, _, victim = min(below)
        self._drop(victim, f"a session of draft priority {priority} ({sid}) took its place")
        return True

    def _drop(self, sid: str, why: str) -> None:
        """Shed a session to plain decoding: it leaves the link, its KV slot is freed, the target
        hears it (RESOURCE_EXHAUSTED) and runs its rounds plain."""
        self.sessions.pop(sid, None)
        self.servicer.sessions.release(sid)
        self.servicer.metrics.shed.labels("saturated").inc()
        self._fail(sid, ResourceExhausted(f"draft replica saturated: session {sid} shed to plain decoding ({why})"))

    def _shed(self, sid: str, linked: _Linked) -> bool:
        """Saturated (ADR 0021): shed this session to plain if a session of a higher draft
        priority (its class's) is on this stream, or, among the sessions of its own priority,
        if its drafts help it less than theirs on average (accepted drafts a block): the
        classes that matter most, then the sessions that gain most, keep the capacity. True
        when it was shed."""
        if not self.servicer.saturated() or len(self.sessions) < 2:
            return False
        top = max(s.priority for s in self.sessions.values())
        peers = [s for s in self.sessions.values() if s.priority == linked.priority]
        mean = sum(s.gain for s in peers) / len(peers)
        if linked.priority < top:
            why = f"its class's draft priority {linked.priority}, below {top} of others on this stream"
        elif linked.gain < mean:
            why = (f"its blocks' accepted drafts {linked.gain:.2f} a block, below the stream's mean {mean:.2f} "
                   f"at its draft priority {linked.priority}")
        else:
            return False
        self._drop(sid, why)
        return True

    def _fail(self, sid: str, exc: SpecserveError) -> None:
        self.out.put_nowait(draft_pb2.LinkOut(failed_session=sid, error_code=status_for(exc).value[0], error=str(exc)))

    async def _propose(self, request: draft_pb2.ProposeRequest, linked: _Linked) -> draft_pb2.ProposeResponse:
        """Propose from what the worker holds; the whole prefix when it holds too little (an
        eviction, a release)."""
        try:
            return await self.servicer.propose(request, self._push, linked.grammar)
        except (NeedsFullPrefix, SessionNotFound):
            if linked.held == 0:
                raise
            linked.held = 0
            request.prefix.CopyFrom(prefix_to_proto(linked.prefix, 0))
            return await self.servicer.propose(request, self._push, linked.grammar)

    def _send(self, sid: str, n: int, prefix_hash: int, k: int, block: draft_pb2.ProposeResponse) -> None:
        self.out.put_nowait(draft_pb2.LinkOut(block=draft_pb2.Predraft(
            session_id=sid, prefix_len=n, prefix_hash=prefix_hash, k=k, block=block)))

    def _push(self, block: draft_pb2.Predraft) -> None:
        """A block drafted ahead (propose's push): on the stream as it is."""
        if block.session_id in self.sessions:
            self.out.put_nowait(draft_pb2.LinkOut(block=block))


def _accepted(block: tuple[int, ...], emitted) -> int:
    """Drafts of `block` the round accepted: its leading tokens the target emitted, the
    round's last emitted token (recovered or bonus) aside."""
    n = 0
    for d, e in zip(block, list(emitted)[:-1], strict=False):  # (a block may be longer than what was accepted)
        if d != e:
            break
        n += 1
    return n

