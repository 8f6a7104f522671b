"""The suffix pool fed by the fleet through Redis (ADR 0026), on a real redis-server and on a
real Redis Cluster: each target shares its class's committed outputs in a capped stream per
class (one hash tag, so one XREAD follows them all in a Cluster too); a target started later,
or restarted, loads what the others served, follows what they serve next and skips its own.

And with the demo pair: a second target, started after a first one served held-out
extraction requests, drafts from what the first served, and its acceptance rises against a
target with an empty index; greedy output stays the target's."""

from __future__ import annotations

import asyncio
import threading
import uuid

import pytest
from redis.crc import key_slot

from specserve.algorithm.stops import StopChecker
from specserve.engine.loop import EngineLoop
from specserve.engine.session import EnginePlan
from specserve.params import GenerationParams
from specserve.services.target.suffix import SuffixFleet
from specserve.state.suffix_share import SuffixShare, decode_tokens, encode_tokens
from specserve.worker.model_step import Batching, make_target_step


def test_tokens_survive_the_streams_encoding():
    for tokens in ([], [0], [4095, 1, 2], [151_935, 7], list(range(300))):
        assert decode_tokens(encode_tokens(tokens)) == tokens
        assert decode_tokens(encode_tokens(tokens).encode()) == tokens  # a client that answers bytes


def test_outputs_reach_a_later_target_and_a_follower_skips_its_own(redis_client, run):
    """On one Redis and on a Cluster: what A shares, B (started after) loads, and a follower
    delivers only the other targets' outputs, in order, across classes."""
    prefix = f"t{uuid.uuid4().hex[:8]}"

    async def go():
        a = SuffixShare(redis_client, prefix, origin="target-a:1")
        for i in range(5):
            await a.publish("agent", [1, 2, 3, i], max_requests=3, conf={"max_requests": 3, "max_tokens": 100})
        await a.publish("chat", [9, 9], max_requests=256)
        b = SuffixShare(redis_client, prefix, origin="target-b:1")
        loaded = await b.load()
        got: list = []
        follower = asyncio.create_task(b.follow(got.append, block_ms=50, classes_every_s=0.2))
        await asyncio.sleep(0.2)
        await b.publish("agent", [7, 7, 7], max_requests=3)  # its own: skipped
        await a.publish("chat", [8, 8], max_requests=256)
        await a.publish("tools", [5], max_requests=256)  # a class B did not know: picked up
        async with asyncio.timeout(20):
            while len(got) < 2:
                await asyncio.sleep(0.05)
        follower.cancel()
        keys = [a.classes_key, *(a.key(c) for c in ("agent", "chat", "tools"))]
        ttls = [await redis_client.ttl(k) for k in keys]
        return loaded, got, keys, ttls

    loaded, got, keys, ttls = run(go())
    assert [(o.workload_class, o.tokens) for o in loaded] == [
        *(("agent", [1, 2, 3, i]) for i in range(5)), ("chat", [9, 9])]  # (MAXLEN ~: trimmed by whole nodes)
    assert loaded[0].origin == "target-a:1" and loaded[0].conf == {"max_requests": 3, "max_tokens": 100}
    assert [(o.workload_class, o.tokens) for o in got] == [("chat", [8, 8]), ("tools", [5])]
    # every key under the one hash tag (one Cluster slot: one XREAD follows them all), each
    # expiring (a TTL of -2 would be a key that is not there, -1 one that never expires)
    assert len({key_slot(k.encode()) for k in keys}) == 1 and all("{suffix}" in k for k in keys)
    assert all(0 < t <= 7 * 86400 for t in ttls), ttls


def test_a_restarted_target_keeps_its_class_index(redis_client, run):
    """A target's index lives on in Redis: its next incarnation's pool starts with the class's
    outputs, bounded as the class's policy bounds them, and drafts from them at once."""
    prefix = f"t{uuid.uuid4().hex[:8]}"

    async def go():
        loop = asyncio.get_running_loop()
        first = SuffixFleet(96, redis_client, prefix, loop)
        await first.start("target-0:aaa")
        for i in range(6):  # six outputs of the class served by the first incarnation
            await first.share.publish("agent", [10 + i, 20, 30, 40, 50, 60], max_requests=4,
                                      conf={"max_requests": 4, "max_tokens": 1000})
        await first.close()
        again = SuffixFleet(96, redis_client, prefix, loop)  # the restarted target
        await again.start("target-0:bbb")
        again.source.drain()  # (the engine thread's, before its next draft)
        await again.close()
        return again.source

    source = run(go())
    index = source.indexes["agent"]
    assert index.requests == 4 and index.max_requests == 4  # the class's bound came with its outputs
    # drafted from the old incarnation's outputs (a 3-token match: 3 drafts); the two oldest went
    assert source.suffix.start(index).drafts([1, 13, 20, 30], 3).tokens == [40, 50, 60]
    assert source.suffix.start(index).drafts([1, 11, 20, 30], 3).tokens == [40, 50]  # (a 2-token match)
    assert source.snapshot()["agent"].added == {"local": 0, "fleet": 6}


# ---- two targets on the demo pair ----
class Target:
    """An engine with a suffix pool linked to the fleet through Redis, as the target worker
    wires one (services/target/suffix.py), its loop on a thread of its own."""

    def __init__(self, demo_pair, target_model, redis, prefix: str, loop: asyncio.AbstractEventLoop) -> None:
        self.fleet = SuffixFleet(target_model.vocab_size, redis, prefix, loop)
        model = make_target_step(target_model, Batching(kv_budget_mb=96, max_sessions=16, prefill_chunk=64,
                                                        max_len=384))
        eos = target_model.eos_token_ids
        self.engine = EngineLoop(model, lambda p: StopChecker(eos, p.stop, demo_pair.tokenizer.decode),
                                 {"suffix": self.fleet.source})
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.engine.run_forever, args=(self.stop,), daemon=True)

    async def start(self) -> Target:
        await self.fleet.start(f"target:{uuid.uuid4().hex[:8]}")
        self.thread.start()
        return self

    async def serve(self, items: list[tuple[str, list[int]]], pool: str | None) -> None:
        added = []
        for sid, ids in items:
            plan = EnginePlan(GenerationParams(max_tokens=48, num_draft_tokens=16, seed=1), pool=pool,
                              workload_class="extraction", stats_class="extraction")
            added.append(asyncio.wrap_future(self.engine.add(sid, ids, plan)))
        await asyncio.gather(*added)  # (a session the KV slots cannot hold would raise here)
        async with asyncio.timeout(300):
            while not all(sid in self.engine.ended for sid, _ in items):
                await asyncio.sleep(0.02)
        await asyncio.sleep(0.1)  # its outputs' XADDs (posted to this loop) go out

    async def close(self) -> None:
        self.stop.set()
        self.engine.wake()
        self.thread.join(30)
        await self.fleet.close()


@pytest.fixture(scope="module")
def extraction(demo_pair, demo_pair_dir):
    from specserve.tooling.modelbuild.build import load_eval_prompts

    held_out = [p["prompt"] for p in load_eval_prompts(demo_pair_dir) if p["workload_class"] == "extraction"]
    return [demo_pair.tokenizer.encode(p) for p in held_out[:12]]


def test_a_target_started_later_drafts_from_what_the_first_served(demo_pair, target_model, extraction,
                                                                  redis_server, run):
    """The first target serves 8 held-out extraction requests (plain: the index learns from
    every finished session of its class, whichever pool). A second target started after it,
    and a third on an empty fleet, then serve 4 others on the suffix pool: the same greedy
    tokens, and the second accepts more drafts a round (the JSON records' keys and shapes
    recur from request to request; their values are in each prompt, which both see). One run
    at 10 + 6 requests: 1.55 drafts accepted a round against 0.26, in 113 target passes
    against 229."""
    import redis.asyncio as aioredis

    prefix = f"t{uuid.uuid4().hex[:8]}"

    async def go():
        client = aioredis.Redis.from_url(redis_server.url)
        loop = asyncio.get_running_loop()
        first = await Target(demo_pair, target_model, client, prefix, loop).start()
        await first.serve([(f"w{i}", ids) for i, ids in enumerate(extraction[:8])], pool=None)
        await first.close()
        out = {}
        for name, p in (("later", prefix), ("empty", f"{prefix}-empty")):
            target = await Target(demo_pair, target_model, client, p, loop).start()
            await target.serve([(f"h{i}", ids) for i, ids in enumerate(extraction[8:12])], pool="suffix")
            await target.close()
            out[name] = ({sid: s.generated for sid, s in target.engine.ended.items()},
                         [r for s in target.engine.ended.values() for r in s.rounds],
                         target.fleet.source.snapshot()["extraction"])
        await client.aclose()
        return out

    out = run(go())
    (later, later_rounds, later_stats), (empty, empty_rounds, _) = out["later"], out["empty"]
    assert later == empty  # greedy: the index changes the drafts, never the tokens

    def per_round(rounds) -> float:
        return sum(r.accepted for r in rounds) / len(rounds)

    assert later_stats.added["fleet"] == 8 and later_stats.proposals["index"] > 10
    assert per_round(later_rounds) > per_round(empty_rounds) + 0.5, (per_round(later_rounds),
                                                                      per_round(empty_rounds))
    assert len(later_rounds) < 0.8 * len(empty_rounds)  # fewer target passes for the same tokens
