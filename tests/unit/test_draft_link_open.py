"""A draft replica's end of the link (`services/draft/link.py`) opening a constrained session:
the constraint compiles on a thread of its own, not on the event loop that carries every
session's blocks; the session's blocks draft under it; one that does not compile is handed
back to the target (`failed_session`, it runs plain). A fake servicer: no model."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

from specserve.errors import InvalidRequest
from specserve.services.draft.link import Link
from specserve.v1 import draft_pb2


class _Servicer:
    def __init__(self, fail: bool = False, busy: bool = False) -> None:
        self.fail = fail
        self.busy = busy  # saturated: its queue at the bound (ADR 0021)
        self.compiled_on: list[str] = []
        self.drafted_under: list[object] = []
        self.released: list[str] = []
        self.sessions = SimpleNamespace(release=self.released.append)
        self.shed: dict[str, int] = {}
        self.metrics = SimpleNamespace(shed=SimpleNamespace(labels=lambda reason: SimpleNamespace(
            inc=lambda: self.shed.__setitem__(reason, self.shed.get(reason, 0) + 1))))
        self.max_queue = 1
        self.core = SimpleNamespace(scheduler=SimpleNamespace(depth=lambda: 1 if self.busy else 0))

    def saturated(self) -> bool:
        return self.busy

    def grammar(self, kind: str, value: str, prompt_len: int):
        self.compiled_on.append(threading.current_thread().name)
        if self.fail:
            raise InvalidRequest(f"cannot compile {kind}")
        return ("compiled", kind, prompt_len)

    async def propose(self, request, push, grammar):
        self.drafted_under.append(grammar)
        return draft_pb2.ProposeResponse(tokens=[1, 2])


def _open(sid: str, kind: str = "", priority: int = 0) -> draft_pb2.LinkIn:
    return draft_pb2.LinkIn(open=draft_pb2.LinkOpen(session_id=sid, committed=[5, 6, 7], k=2,
                                                     constraint_kind=kind, prompt_len=3, draft_priority=priority))


async def _first_reply(fail: bool, kind: str) -> tuple[_Servicer, Link, draft_pb2.LinkOut, str]:
    servicer = _Servicer(fail)
    link = Link(servicer)
    link._receive(_open("s", kind))
    reply = await asyncio.wait_for(link.out.get(), 10)
    return servicer, link, reply, threading.current_thread().name


def test_a_constraint_compiles_off_the_event_loop_and_the_blocks_draft_under_it():
    servicer, _, reply, loop_thread = asyncio.run(_first_reply(False, "json_object"))
    assert len(servicer.compiled_on) == 1 and servicer.compiled_on[0] != loop_thread, servicer.compiled_on
    assert servicer.drafted_under == [("compiled", "json_object", 3)]
    assert list(reply.block.block.tokens) == [1, 2] and reply.block.session_id == "s"


def test_an_unconstrained_session_compiles_nothing():
    servicer, _, reply, _ = asyncio.run(_first_reply(False, ""))
    assert servicer.compiled_on == [] and servicer.drafted_under == [None]
    assert list(reply.block.block.tokens) == [1, 2]


def test_a_constraint_that_does_not_compile_hands_the_session_back_to_the_target():
    servicer, link, reply, _ = asyncio.run(_first_reply(True, "json_object"))
    assert reply.failed_session == "s" and "cannot compile" in reply.error
    assert "s" not in link.sessions and servicer.drafted_under == []


def test_a_saturated_replica_refuses_new_sessions_and_sheds_those_its_drafts_help_least():
    """Draft capacity (ADR 0021). Saturated, a replica refuses a new session at its open
    (RESOURCE_EXHAUSTED: the target runs it plain), and at a running session's next outcome
    sheds it if its blocks' accepted drafts are below the stream's mean; a session above the
    mean keeps its drafts. Not saturated, nothing is refused."""
    import grpc

    async def go():
        servicer = _Servicer()
        link = Link(servicer)
        for sid in ("good", "poor"):
            link._receive(_open(sid))
            await asyncio.wait_for(link.out.get(), 10)  # its first block: tokens [1, 2]
        # "good": the target accepted both drafts; "poor": none
        for sid, emitted in (("good", [1, 2, 9]), ("poor", [4])):
            link._receive(draft_pb2.LinkIn(outcome=draft_pb2.LinkOutcome(
                session_id=sid, committed_len=3 + len(emitted), emitted=emitted, k=2)))
            await asyncio.wait_for(link.out.get(), 10)
        servicer.busy = True
        link._receive(_open("late"))
        refused = await asyncio.wait_for(link.out.get(), 10)
        for sid, emitted in (("good", [1, 2, 9]), ("poor", [4])):
            n = 3 + 3 + len(emitted) if sid == "good" else 3 + 1 + len(emitted)
            link._receive(draft_pb2.LinkIn(outcome=draft_pb2.LinkOutcome(
                session_id=sid, committed_len=n, emitted=emitted, k=2)))
        replies = [await asyncio.wait_for(link.out.get(), 10) for _ in range(2)]
        return servicer, link, refused, replies

    servicer, link, refused, replies = asyncio.run(go())
    assert refused.failed_session == "late" and refused.error_code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
    assert "saturated" in refused.error
    shed = [r for r in replies if r.failed_session]
    assert [r.failed_session for r in shed] == ["poor"] and "below the stream's mean" in shed[0].error
    assert any(r.block.session_id == "good" for r in replies)  # the helpful one keeps its drafts
    assert set(link.sessions) == {"good"} and servicer.released == ["poor"]
    assert servicer.shed == {"admission": 1, "saturated": 1}


def test_a_saturated_replica_keeps_the_higher_draft_priority_and_admits_it_first():
    """Draft capacity by class priority (ADR 0021). Saturated, a replica admits a new session
    of a priority above one it holds in that one's place (shed at once, so its sessions do not
    grow), refuses one of the lowest priority, and at a running session's outcome sheds a lower
    priority's session even when its drafts help it more than the higher priority's do."""
    import grpc

    async def go():
        servicer = _Servicer()
        link = Link(servicer)
        for sid, priority in (("low", 0), ("low2", 0), ("high", 5)):
            link._receive(_open(sid, priority=priority))
            await asyncio.wait_for(link.out.get(), 10)
        # "low" and "low2": the target accepted both drafts; "high": none
        for sid, emitted in (("low", [1, 2, 9]), ("low2", [1, 2, 9]), ("high", [4])):
            link._receive(draft_pb2.LinkIn(outcome=draft_pb2.LinkOutcome(
                session_id=sid, committed_len=3 + len(emitted), emitted=emitted, k=2)))
            await asyncio.wait_for(link.out.get(), 10)
        servicer.busy = True
        link._receive(_open("vip", priority=5))  # in place of a priority-0 session, shed now
        made_room = await asyncio.wait_for(link.out.get(), 10)
        admitted = await asyncio.wait_for(link.out.get(), 10)
        link._receive(_open("late", priority=0))
        refused = await asyncio.wait_for(link.out.get(), 10)
        link._receive(draft_pb2.LinkIn(outcome=draft_pb2.LinkOutcome(  # the other one helped again: shed
            session_id="low2", committed_len=9, emitted=[1, 2, 9], k=2)))
        shed = await asyncio.wait_for(link.out.get(), 10)
        return servicer, link, made_room, admitted, refused, shed

    servicer, link, made_room, admitted, refused, shed = asyncio.run(go())
    assert made_room.failed_session in ("low", "low2") and "took its place" in made_room.error
    assert admitted.block.session_id == "vip" and not admitted.failed_session
    assert refused.failed_session == "late" and refused.error_code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
    assert shed.failed_session == "low2" if made_room.failed_session == "low" else shed.failed_session == "low"
    assert "draft priority 0, below 5" in shed.error
    assert set(link.sessions) == {"high", "vip"}  # "high" keeps its drafts; as many sessions as before
    assert sorted(servicer.released) == ["low", "low2"]
    assert servicer.shed == {"admission": 1, "saturated": 2}
