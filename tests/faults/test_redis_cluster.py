"""The whole stack on a Redis Cluster (issue 41, ADR 0023): three masters with a replica each
(`start_redis_cluster`: `redis-server --cluster-enabled yes` + `redis-cli --cluster create`),
the services given its `redis+cluster://` address. A Ray target (simulated pass time), a
draft replica and a router.

- Generate and Resume: the output equals target-only greedy decoding, and Resume returns
  exactly what the session's keys (spread over the masters by their hash tags) hold.
- A master killed (SIGKILL) mid-generation: the master that owns the slot of a greedy and a
  seeded session's keys. The cluster promotes its replica (node timeout 2 s); the streams go
  on and equal the same requests' output without the fault, with contiguous offsets."""

from __future__ import annotations

import threading
import time

import pytest
from redis.cluster import RedisCluster

from specserve.serving.tls import channel
from specserve.state.connection import parse_cluster_url
from specserve.state.store import session_key
from specserve.v1 import generation_pb2, generation_pb2_grpc

MAX_TOKENS = 64
FAULT_AT = 8
COLUMNS = {"greedy": dict(temperature=0.0), "seeded": dict(temperature=0.8, top_p=0.95, seed=77)}


@pytest.fixture(scope="module")
def cluster_stack(demo_pair_dir, tmp_path_factory: pytest.TempPathFactory):
    from specserve.tooling.redis_server import start_redis_cluster
    from specserve.tooling.stack import PoolSpec, Stack, StackSpec

    run_dir = tmp_path_factory.mktemp("redis-cluster-stack")
    cluster = start_redis_cluster(run_dir / "cluster")
    spec = StackSpec(
        pair_dir=str(demo_pair_dir), run_dir=str(run_dir / "run"), redis_url=cluster.url,
        pools={"small": PoolSpec("draft", replicas=1)}, target_threads=1, routers=1,
        router_env={"SPECSERVE_ROUTER_TARGET_WAIT_S": "180", "SPECSERVE_ROUTER_MAX_TOKENS_LIMIT": str(MAX_TOKENS)},
        env={"SPECSERVE_TARGET_SIMULATED_PASS_MS": "60"})
    try:
        with Stack(spec).running(timeout_s=480) as s:
            yield s, cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def stub(cluster_stack):
    with channel(cluster_stack[0].info.router, "") as ch:
        yield generation_pb2_grpc.GenerationStub(ch)


def _req(prompt: str, column: str) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(prompt=prompt, max_tokens=MAX_TOKENS, draft_pool="small", **COLUMNS[column])


def _greedy(demo_pair, target_model, prompt: str) -> list[int]:
    from specserve.drafters import NgramDrafter
    from specserve.worker.reference import GenerationParams, ReferenceDecoder

    engine = ReferenceDecoder(target_model, NgramDrafter(target_model.vocab_size), demo_pair.tokenizer)
    return engine.generate(prompt, GenerationParams(max_tokens=MAX_TOKENS, num_draft_tokens=0)).token_ids


def _contiguous(chunks) -> list[int]:
    pos = 0
    for c in chunks:
        assert c.offset == pos, (c.offset, pos)
        pos += len(c.token_ids)
    return [t for c in chunks for t in c.token_ids]


def test_generate_and_resume_on_a_cluster(cluster_stack, stub, eval_prompts, demo_pair, target_model):
    prompt = eval_prompts[0]["prompt"]
    resp = stub.Generate(_req(prompt, "greedy"), timeout=240)
    assert list(resp.token_ids) == _greedy(demo_pair, target_model, prompt)
    resumed = list(stub.Resume(generation_pb2.ResumeRequest(session_id=resp.session_id, from_offset=0), timeout=60))
    assert _contiguous(resumed) == list(resp.token_ids)


def test_a_master_killed_mid_generation(cluster_stack, stub, eval_prompts, demo_pair, target_model):
    stack, cluster = cluster_stack
    prompts = {c: eval_prompts[i + 1]["prompt"] for i, c in enumerate(COLUMNS)}
    wants = {"greedy": _greedy(demo_pair, target_model, prompts["greedy"]),
             "seeded": list(stub.Generate(_req(prompts["seeded"], "seeded"), timeout=240).token_ids)}
    assert all(len(w) > 2 * FAULT_AT for w in wants.values()), {c: len(w) for c, w in wants.items()}
    got: dict[str, list] = {c: [] for c in COLUMNS}
    errors: list[Exception] = []

    def follow(column: str) -> None:
        try:
            for c in stub.GenerateStream(_req(prompts[column], column), timeout=240):
                got[column].append(c)
        except Exception as exc:
            errors.append(exc)

    threads = [threading.Thread(target=follow, args=(c,), daemon=True) for c in COLUMNS]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 120
    while any(sum(len(c.token_ids) for c in got[col]) < FAULT_AT for col in COLUMNS):
        assert time.monotonic() < deadline and not errors, errors
        time.sleep(0.01)
    nodes, password = parse_cluster_url(cluster.url)
    rc = RedisCluster(host=nodes[0][0], port=nodes[0][1], password=password)
    try:
        key = session_key(got["greedy"][0].session_id)
        owner = rc.get_node_from_key(key)
        status, committed = rc.hmget(key, "status", "committed")
        assert status == b"running" and int(committed) < len(wants["greedy"])  # mid-generation
    finally:
        rc.close()
    (victim,) = [n for n in cluster.nodes if n.port == owner.port]
    t0 = time.monotonic()
    victim.kill()
    for t in threads:
        t.join(240)
    recovered = time.monotonic() - t0
    print(f"cluster master {victim.port} killed: streams done {recovered:.1f} s later")
    assert not errors, errors
    for c in COLUMNS:
        assert _contiguous(got[c]) == wants[c], c
    # the killed master's replica took its slots over
    survivors = [n for n in cluster.nodes if n.port != victim.port]
    roles = {n.port: cluster.role(n) for n in survivors}
    assert list(roles.values()).count("master") == 3, roles
