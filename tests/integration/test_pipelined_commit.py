"""Commits off the critical path (ADR 0014): the engine's next steps run while a step's
commits are in flight. A commit refused for a stale epoch (another driver claimed the
session) must end the engine's run with nothing after it committed, even though later
steps were already running. The usurper here never drives the session, so once its lease
lapses the stream's own reader re-places it on a target and the client still gets the whole
output."""

from __future__ import annotations

import asyncio
import time
import uuid

import grpc
import redis
import redis.asyncio as aioredis

from specserve.state.store import SessionStore, session_key
from specserve.v1 import generation_pb2, generation_pb2_grpc


def _take_over(url: str, session_id: str) -> int:
    async def go() -> int:
        client = aioredis.Redis.from_url(url)
        try:
            return await SessionStore(client, prefix="specserve").take_over(session_id, "test-usurper")
        finally:
            await client.aclose()

    return asyncio.run(go())


def _runs(receiver, session_id: str, timeout_s: float = 20.0) -> list[dict]:
    """The engine's runs of the session (its `specserve.engine.session` spans), once both
    have been exported."""
    deadline = time.monotonic() + timeout_s
    while True:
        runs = sorted((s for s in receiver.snapshot() if s["name"] == "specserve.engine.session"
                       and s["attributes"].get("specserve.session_id") == session_id), key=lambda s: s["start_ns"])
        if len(runs) >= 2 or time.monotonic() > deadline:
            return runs
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
        key = session_key(session_id)
        _take_over(stack.info.redis_url, session_id)  # as a router taking the session over would
        assert 0 < int(r.hget(key, "committed")) < 200, "the fault did not hit mid-generation"
        chunks.extend(stream)  # the usurper went silent: adopted after its lease, finished
    assert chunks[-1].finish_reason == "length"
    assert int(r.hget(key, "epoch")) == 4  # created 1, started 2, usurped 3, re-placed and started 4

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

    # the engine's first run ended on the refused commit; the second resumed after what it
    # had committed, in the same trace (the reader re-placed it under the request's span)
    runs = _runs(otlp_receiver, session_id)
    assert [x["attributes"]["specserve.finish_reason"] for x in runs] == ["stale_epoch", "length"]
    assert 0 < runs[1]["attributes"]["specserve.resumed_after"] < 200
    assert runs[0]["trace_id"] == runs[1]["trace_id"]
    r.close()
