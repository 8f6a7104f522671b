"""A tensor-parallel target under Ray (ADR 0030): TP 2 as two Ray actors in a placement group
on loopback (gloo), served through the router like any target.

- Greedy output through every kind of pool (none, the small draft's replica, n-gram and the
  EAGLE head inside the target) is the one-device target's, a difference only at a near-tie
  (the model's own top two logits within TOLERANCE[fp32]); each engine step reached rank 1 as
  one message and both ranks computed the same verdicts (the registry entry's last check).
- One rank's process killed mid-generation (-9): the group goes down and Ray restarts it, the
  new group adopts the sessions from Redis, and every stream completes identical to the same
  request without the fault (greedy and seeded), with contiguous offsets.
- A group Ray cannot place (GPUs on a CPU-only cluster) is refused at start, with what it asked
  for, not left pending.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
import redis
import torch
from faultkit import PASS_MS

from specserve.serving.tls import channel
from specserve.state.store import session_key
from specserve.v1 import generation_pb2, generation_pb2_grpc

MAX_TOKENS = 32
FAULT_AT = 4
POOLS = ("none", "small", "ngram", "eagle-local")
COLUMNS = {"greedy": dict(temperature=0.0), "seeded": dict(temperature=0.8, top_p=0.95, seed=77)}
ENTRY = "specserve:target:target-0"


@pytest.fixture(scope="module")
def tp_stack(demo_pair_dir, tmp_path_factory: pytest.TempPathFactory):
    from specserve.tooling.stack import PoolSpec, Stack, StackSpec

    spec = StackSpec(
        pair_dir=str(demo_pair_dir), run_dir=str(tmp_path_factory.mktemp("tp")),
        pools={"small": PoolSpec("draft", replicas=1), "ngram": PoolSpec("ngram", local=True),
               "eagle-local": PoolSpec("eagle", local=True)},
        target_threads=1, tensor_parallel=2,
        router_env={"SPECSERVE_ROUTER_TARGET_WAIT_S": "180"},
        env={"SPECSERVE_TARGET_SIMULATED_PASS_MS": str(PASS_MS)},  # a request lasts long enough for a fault
    )
    with Stack(spec).running(timeout_s=480) as s:
        yield s


@pytest.fixture(scope="module")
def stub(tp_stack):
    ch = channel(tp_stack.info.router, "")
    yield generation_pb2_grpc.GenerationStub(ch)
    ch.close()


@pytest.fixture(scope="module")
def r(tp_stack):
    client = redis.Redis.from_url(tp_stack.info.redis_url)
    yield client
    client.close()


def _req(prompt: str, column: str = "greedy", pool: str = "none") -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(prompt=prompt, max_tokens=MAX_TOKENS, draft_pool=pool, **COLUMNS[column])


def _entry(r) -> dict:
    return json.loads(r.get(ENTRY))


def _checked(r, timeout_s: float = 10.0) -> dict:
    """The registry entry once its last check has every rank at the same step count."""
    deadline = time.monotonic() + timeout_s
    while True:
        e = _entry(r)
        if len({x["steps"] for x in e.get("ranks", [])}) == 1 or time.monotonic() > deadline:
            return e
        time.sleep(0.3)


def test_tp2_serves_every_pool_as_the_one_device_target(tp_stack, stub, r, eval_prompts, demo_pair, target_model):
    from specserve.tooling.hf_agreement import TOLERANCE
    from specserve.worker.reference import GenerationParams, ReferenceDecoder

    ref = ReferenceDecoder(target_model, None, demo_pair.tokenizer)
    prompts = [p["prompt"] for p in eval_prompts][::6][:2]
    before = _entry(r)
    for prompt in prompts:
        want = ref.generate(prompt, GenerationParams(max_tokens=MAX_TOKENS, num_draft_tokens=0)).token_ids
        ids = demo_pair.tokenizer.encode(prompt)
        for pool in POOLS:
            got = list(stub.Generate(_req(prompt, pool=pool), timeout=120).token_ids)
            n = next((j for j, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), None)
            if n is None:
                assert len(got) == len(want), (pool, prompt[:40])
                continue
            with torch.inference_mode():  # a difference only where the model itself is at a near-tie
                top = demo_pair.target(torch.tensor([ids + want[:n]])).logits[0, -1].float().topk(2).values
            assert float(top[0] - top[1]) <= TOLERANCE[torch.float32], (pool, n)
    time.sleep(1.5)  # (the next check, a second after the last step)
    e = _checked(r)
    assert e["tensor_parallel"] == 2 and e["pid"] == before["pid"]
    ranks = e["ranks"]
    assert [x["rank"] for x in ranks] == [0, 1] and ranks[0]["pid"] == e["pid"] and ranks[1]["pid"] != e["pid"]
    assert ranks[0]["steps"] == ranks[1]["steps"] > before["ranks"][0]["steps"] + len(prompts) * MAX_TOKENS // 4
    assert ranks[0]["digest"] == ranks[1]["digest"]
    with urllib.request.urlopen(f"http://{tp_stack.info.metrics['target']}/metrics", timeout=10) as resp:
        text = resp.read().decode()  # each rank's state in the target's metrics
    for rank in ("0", "1"):
        assert f'specserve_target_tp_step_messages_total{{rank="{rank}"}}' in text
        assert f'specserve_target_tp_collective_seconds_total{{op="reduce",rank="{rank}"}}' in text
        assert f'specserve_target_tp_memory_bytes{{rank="{rank}"}}' in text
    assert "specserve_target_tp_ranks_agree 1.0" in text


def test_kill_a_rank_mid_generation(tp_stack, stub, r, eval_prompts):
    """Rank 1 killed: the group restarts (a new rank 0 too), adopts, and completes each stream
    as the fault-free run of the same request."""
    prompt = eval_prompts[1]["prompt"]
    wants = {c: list(stub.Generate(_req(prompt, c), timeout=120).token_ids) for c in COLUMNS}
    assert all(len(w) >= 4 * FAULT_AT for w in wants.values()), wants
    before = _entry(r)
    streams = {c: stub.GenerateStream(_req(prompt, c), timeout=240) for c in COLUMNS}
    got = {c: [] for c in COLUMNS}
    for c, s in streams.items():
        while sum(len(x.token_ids) for x in got[c]) < FAULT_AT:
            got[c].append(next(s))
    for c in COLUMNS:
        status, committed = r.hmget(session_key(got[c][0].session_id), "status", "committed")
        assert status == b"running" and int(committed) < len(wants[c]), (status, committed)  # mid-generation
    victim = before["ranks"][1]["pid"]
    t0 = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    with ThreadPoolExecutor(2) as pool:
        rest = dict(zip(streams, pool.map(list, streams.values()), strict=True))
    assert time.monotonic() - t0 < 180  # Ray's restart, the group's start and the rest of the requests
    for c in COLUMNS:
        chunks = [*got[c], *rest[c]]
        pos = 0
        for x in chunks:
            assert x.offset == pos, (c, x.offset, pos)  # nothing repeated or lost
            pos += len(x.token_ids)
        assert [t for x in chunks for t in x.token_ids] == wants[c], c
    after = _checked(r)
    assert after["pid"] != before["pid"]  # the whole group restarted, rank 0 with it
    assert {x["pid"] for x in after["ranks"]}.isdisjoint({x["pid"] for x in before["ranks"]})


def test_a_group_ray_cannot_place_is_refused_at_start(tmp_path):
    env = {**os.environ, "SPECSERVE_TARGET_TENSOR_PARALLEL": "2", "SPECSERVE_TARGET_NUM_GPUS": "1",
           "SPECSERVE_TARGET_TP_PLACEMENT_TIMEOUT_S": "3", "SPECSERVE_TARGET_NAME": "unplaceable",
           "SPECSERVE_TARGET_INFO_FILE": str(tmp_path / "info.json"), "RAY_USAGE_STATS_ENABLED": "0"}
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "specserve.services.target"], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode != 0 and time.monotonic() - t0 < 100
    assert "could not place 2 bundles" in done.stderr and "'GPU': 1.0" in done.stderr, done.stderr[-2000:]
    assert not (tmp_path / "info.json").exists()
