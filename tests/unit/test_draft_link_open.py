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
    def __init__(self, fail: bool) -> None:
        self.fail = fail
        self.compiled_on: list[str] = []
        self.drafted_under: list[object] = []
        self.sessions = SimpleNamespace(release=lambda sid: None)

    def grammar(self, kind: str, value: str, prompt_len: int):
        self.compiled_on.append(threading.current_thread().name)
        if self.fail:
            raise InvalidRequest(f"cannot compile {kind}")
        return ("compiled", kind, prompt_len)

    async def propose(self, request, push, grammar):
        self.drafted_under.append(grammar)
        return draft_pb2.ProposeResponse(tokens=[1, 2])


def _open(sid: str, kind: str = "") -> draft_pb2.LinkIn:
    return draft_pb2.LinkIn(open=draft_pb2.LinkOpen(session_id=sid, committed=[5, 6, 7], k=2,
                                                     constraint_kind=kind, prompt_len=3))


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
