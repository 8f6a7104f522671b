"""Commit off the critical path (ADR 0010): round n+1 drafts and verifies while round n's
commit is in flight. A commit refused for a stale epoch (another router took the session
over) must end the run with nothing after it committed, even though the next round was
already running. The usurper here never drives the session, so once its lease lapses the
stream's own reader adopts it (ADR 0011) and the client still gets the whole output."""

from __future__ import annotations

import asyncio
import time
import uuid

import grpc
import redis
import redis.asyncio as aioredis

from specserve.state.store import SessionStore
from specserve.v1 import generation_pb2, generation_pb2_grpc


def _take_over(url: str, session_id: str) -> int:
    async def go() -> int:
        client = aioredis.Redis.from_url(url)
        try:
            return await SessionStore(client, prefix="specserve").take_over(session_id, "test-usurper")
        finally:
            await client.aclose()

    return asyncio.run(go())


def _spans(receiver, session_id: str, timeout_s: float = 20.0) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    while True:
        spans = receiver.snapshot()
        gen = [s for s in spans if s["name"] == "specserve.generate"
               and s["attributes"].get("specserve.session_id") == session_id]
        trace = [s for s in spans if gen and s["trace_id"] == gen[0]["trace_id"]]
        refused = [s for s in trace if s["name"] == "specserve.commit"
                   and s["attributes"].get("specserve.commit_status") == "stale_epoch"]
        if refused or time.monotonic() > deadline:
            return trace
        time.sleep(0.3)


def test_a_commit_refused_while_the_next_round_is_in_flight_ends_the_run(stack, otlp_receiver, eval_prompts,
                                                                        demo_pair):
    eos = demo_pair.tokenizer.eos_token_id
    req = generation_pb2.GenerateRequest(
        prompt=eval_prompts[0]["prompt"], max_tokens=200, draft_pool="small", num_draft_tokens=3,
        banned_token_ids=[eos], request_id=uuid.uuid4().hex)  # no EOS: it cannot end before the fault
    with grpc.insecure_channel(stack.info.router) as channel:
        stream = generation_pb2_grpc.GenerationStub(channel).GenerateStream(req, timeout=120)
        chunks = [next(stream)]
        session_id = chunks[0].session_id
        r = redis.Redis.from_url(stack.info.redis_url, decode_responses=True)
        key = f"specserve:sess:{session_id}"
        _take_over(stack.info.redis_url, session_id)  # as a router taking the session over would
        assert 0 < int(r.hget(key, "committed")) < 200, "the fault did not hit mid-generation"
        chunks.extend(stream)  # the usurper went silent: adopted after its lease, finished
    assert chunks[-1].finish_reason == "length"
    assert int(r.hget(key, "epoch")) == 3  # created 1, usurped 2, adopted 3

    committed = [int(t) for t in r.lrange(f"{key}:tok", 0, -1)]
    assert len(committed) == 200
    # what any reader sees: contiguous chunks that add up to exactly the committed tokens
    entries = r.xrange(f"{key}:out")
    offsets, seen = 0, []
    for _, f in entries:
        assert int(f["offset"]) == offsets
        tokens = [int(t) for t in f["tokens"].split(",")] if f["tokens"] else []
        seen += tokens
        offsets += len(tokens)
    assert seen == committed
    client_seen = [t for c in chunks for t in c.token_ids]
    assert client_seen == committed

    # the trace: the refused commit overlapped the next round, and that round sent no commit
    trace = _spans(otlp_receiver, session_id)
    refused = [s for s in trace if s["name"] == "specserve.commit"
               and s["attributes"].get("specserve.commit_status") == "stale_epoch"]
    assert len(refused) == 1, [s["attributes"] for s in trace if s["name"] == "specserve.commit"][-3:]
    bad = refused[0]
    own_round = next(s for s in trace if s["span_id"] == bad["parent_span_id"])
    rounds = sorted((s for s in trace if s["name"] == "specserve.round"  # of the refused run only
                     and s["parent_span_id"] == own_round["parent_span_id"]), key=lambda s: s["start_ns"])
    later = [s for s in rounds if s["start_ns"] > own_round["start_ns"]]
    assert later and later[0]["start_ns"] < bad["end_ns"], "the next round was not in flight during the commit"
    commits_after = [s for s in trace if s["name"] == "specserve.commit" and s["parent_span_id"] in
                     {x["span_id"] for x in later}]
    assert commits_after == []
    r.close()
