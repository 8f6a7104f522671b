"""The distributed system end to end: router -> draft pool -> Ray target -> Redis commit,
all real, on loopback. The in-process reference decoder is the reference."""

from __future__ import annotations

import json
import os
import signal
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specserve.config import LOCAL
from specserve.drafters import NgramDrafter
from specserve.state.store import session_key
from specserve.v1 import generation_pb2, generation_pb2_grpc
from specserve.worker.reference import GenerationParams, ReferenceDecoder

MAX_TOKENS = 24


@pytest.fixture(scope="module")
def stub(stack):
    channel = grpc.insecure_channel(stack.info.router)
    yield generation_pb2_grpc.GenerationStub(channel)
    channel.close()


@pytest.fixture(scope="module")
def reference(demo_pair, target_model):
    """Target-only greedy continuation, by the in-process reference decoder (itself checked against
    transformers in tests/unit)."""
    engine = ReferenceDecoder(target_model, NgramDrafter(target_model.vocab_size), demo_pair.tokenizer)
    cache: dict[tuple[str, int], list[int]] = {}

    def ref(prompt: str, n: int = MAX_TOKENS) -> list[int]:
        if (prompt, n) not in cache:
            cache[(prompt, n)] = engine.generate(prompt, GenerationParams(max_tokens=n, num_draft_tokens=0)).token_ids
        return cache[(prompt, n)]

    return ref


def _req(prompt: str, **kw) -> generation_pb2.GenerateRequest:
    kw.setdefault("max_tokens", MAX_TOKENS)
    return generation_pb2.GenerateRequest(prompt=prompt, **kw)


def _prompts(eval_prompts, n_per_class: int) -> list[dict]:
    out = []
    for cls in ("code", "chat", "extraction"):
        out += [p for p in eval_prompts if p["workload_class"] == cls][:n_per_class]
    return out


@pytest.mark.parametrize("pool", ["small", "ngram", "ngram-local", "eagle-local", "eagle", "suffix", "draft-local"])
def test_greedy_through_router_equals_target_only(stub, reference, eval_prompts, pool):
    drafted = 0
    # (the eagle pools and draft-local: 2 prompts a class; their drafting on this CPU is the slow part)
    for item in _prompts(eval_prompts, 2 if pool.startswith("eagle") or pool == "draft-local" else 4):
        resp = stub.Generate(_req(item["prompt"], draft_pool=pool, workload_class=item["workload_class"]), timeout=120)
        assert list(resp.token_ids) == reference(item["prompt"])[: len(resp.token_ids)], item["prompt"][:50]
        assert resp.finish_reason in ("eos", "length")
        assert resp.stats.draft_pool == pool and resp.stats.workload_class == item["workload_class"]
        drafted += resp.stats.draft_tokens
        if pool in ("ngram-local", "suffix", "draft-local"):  # drafted inside the target at each outcome: no wait
            assert not [r for r in resp.stats.round if r.fallback_reason == "draft_late"]
        chunks = list(stub.GenerateStream(_req(item["prompt"], draft_pool=pool), timeout=120))
        assert [t for c in chunks for t in c.token_ids] == list(resp.token_ids)
        assert "".join(c.text for c in chunks) == resp.text
        assert chunks[-1].finish_reason == resp.finish_reason and not any(c.finish_reason for c in chunks[:-1])
        offsets = [c.offset for c in chunks]
        assert offsets == sorted(offsets) and offsets[0] == 0
    assert drafted > 0


@pytest.mark.parametrize("pool", ["small", "ngram", "ngram-local", "draft-local"])
def test_seeded_sampling_through_router_equals_in_process_engine(stub, demo_pair, target_model, eval_prompts, pool):
    """Randomness is keyed by (seed, position, purpose) on every side of the wire, so the
    distributed rounds reproduce the in-process reference decoder's sampled tokens exactly.
    A seeded request's tokens no longer depend on its drafts (ADR 0027), so the drafts are
    checked apart: a replica draws with the noise the target draws with, so it keeps what the
    in-process drafter keeps (a replica drafting with other noise keeps fewer)."""
    from specserve.algorithm.sampling import SamplingParams
    from specserve.drafters import HFDrafter

    drafter = HFDrafter(demo_pair.draft) if pool in ("small", "draft-local") else NgramDrafter(target_model.vocab_size)
    engine = ReferenceDecoder(target_model, drafter, demo_pair.tokenizer)
    for item in _prompts(eval_prompts, 1):
        want = engine.generate(item["prompt"], GenerationParams(
            max_tokens=MAX_TOKENS, num_draft_tokens=3, seed=77,
            sampling=SamplingParams(temperature=0.8, top_p=0.95)))
        got = stub.Generate(_req(item["prompt"], draft_pool=pool, num_draft_tokens=3, seed=77,
                                 temperature=0.8, top_p=0.95), timeout=120)
        assert list(got.token_ids) == want.token_ids
        assert got.stats.seed == 77
        assert got.stats.accepted_tokens == sum(want.accepted_per_round), item["prompt"][:40]


def _scrape(address: str) -> dict[tuple[str, tuple], float]:
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=5).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _suffix(metrics: dict, name: str, **labels) -> float:
    return sum(v for (n, ls), v in metrics.items() if n == name and all((k, w) in ls for k, w in labels.items()))


def _target_metrics(stack) -> str:
    """The running target's metrics address (a restarted one registers its own port)."""
    entry = json.loads(redis.Redis.from_url(stack.info.redis_url).get("specserve:target:target-0"))
    return f"127.0.0.1:{entry['metrics_port']}"


AGENT_RECORDS = 3


def test_the_suffix_pool_drafts_a_repeat_heavy_class_from_its_index_exactly(stub, stack, reference):
    """The `agent` workload (ADR 0026): its warm requests run plain and the class's index
    learns their outputs; then held-out renderings of the same orders (prompts the index has
    never seen) run on the suffix pool: each output is target-only greedy, and the blocks come
    from the index (the class has no policy here: its index is `other`'s)."""
    from specserve.tooling.workloads import agent_workload

    work = agent_workload(AGENT_RECORDS)
    for prompt in work.warm:
        stub.Generate(_req(prompt, max_tokens=40, draft_pool="none", workload_class="agent"), timeout=120)
    before = _scrape(_target_metrics(stack))
    accepted = rounds = 0
    for prompt in work.held_out[:AGENT_RECORDS]:
        resp = stub.Generate(_req(prompt, max_tokens=40, draft_pool="suffix", num_draft_tokens=32,
                                  workload_class="agent"), timeout=120)
        assert list(resp.token_ids) == reference(prompt, 40)[: len(resp.token_ids)], prompt[:60]
        accepted, rounds = accepted + resp.stats.accepted_tokens, rounds + resp.stats.rounds
    after = _scrape(_target_metrics(stack))
    from_index = _suffix(after, "specserve_suffix_proposals_total", workload_class="other", source="index") - \
        _suffix(before, "specserve_suffix_proposals_total", workload_class="other", source="index")
    assert from_index >= AGENT_RECORDS and accepted / rounds > 2.0, (from_index, accepted, rounds)
    assert _suffix(after, "specserve_suffix_index_outputs", workload_class="other") >= 2 * AGENT_RECORDS
    assert _suffix(after, "specserve_suffix_index_bytes", workload_class="other") > 0


def test_speculation_off_is_plain_decoding(stub, reference, eval_prompts):
    item = eval_prompts[5]
    resp = stub.Generate(_req(item["prompt"], draft_pool="none"), timeout=120)
    assert list(resp.token_ids) == reference(item["prompt"])[: len(resp.token_ids)]
    assert resp.stats.draft_tokens == 0 and all(r.fallback_reason == "speculation_off" for r in resp.stats.round)


def test_concurrent_requests_are_correct_and_committed(stub, stack, reference, eval_prompts):
    items = _prompts(eval_prompts, 3)  # 9 requests at once
    with ThreadPoolExecutor(len(items)) as pool:
        futures = [pool.submit(stub.Generate, _req(it["prompt"], draft_pool=("small", "ngram")[i % 2]), timeout=300)
                   for i, it in enumerate(items)]
        responses = [f.result() for f in futures]
    r = redis.Redis.from_url(stack.info.redis_url)
    for it, resp in zip(items, responses, strict=True):
        assert list(resp.token_ids) == reference(it["prompt"])[: len(resp.token_ids)]
        stored = [int(t) for t in r.lrange(session_key(resp.session_id) + ":tok", 0, -1)]
        assert stored == list(resp.token_ids)
        assert r.hget(session_key(resp.session_id), "status") == b"finished"


def test_retried_request_id_joins_without_generating_twice(stub, stack, eval_prompts):
    req = _req(eval_prompts[2]["prompt"], request_id="retry-me-1", temperature=0.9)
    first = stub.Generate(req, timeout=120)
    r = redis.Redis.from_url(stack.info.redis_url)
    rounds_before = r.scard(session_key(first.session_id) + ":rounds")
    second = stub.Generate(req, timeout=120)
    assert second.session_id == first.session_id and second.stats.joined
    assert list(second.token_ids) == list(first.token_ids) and second.text == first.text
    assert r.scard(session_key(first.session_id) + ":rounds") == rounds_before  # no new rounds
    assert r.xlen(session_key(first.session_id) + ":out") == rounds_before


def test_resume_from_offset_returns_exactly_the_rest(stub, eval_prompts):
    resp = stub.Generate(_req(eval_prompts[20]["prompt"], max_tokens=40), timeout=120)
    n = len(resp.token_ids)
    for offset in (0, 1, n // 2, n):
        chunks = list(stub.Resume(generation_pb2.ResumeRequest(session_id=resp.session_id, from_offset=offset),
                                  timeout=60))
        assert [t for c in chunks for t in c.token_ids] == list(resp.token_ids)[offset:]
        assert chunks[-1].finish_reason == resp.finish_reason
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Resume(generation_pb2.ResumeRequest(session_id="0" * 32, from_offset=0), timeout=10))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_cancel_stops_a_running_session(stub, eval_prompts):
    stream = stub.GenerateStream(_req(eval_prompts[0]["prompt"], max_tokens=200, draft_pool="none"), timeout=120)
    first = next(stream)
    assert stub.Cancel(generation_pb2.CancelRequest(session_id=first.session_id), timeout=10).cancelled
    rest = list(stream)
    assert rest and rest[-1].finish_reason == "cancelled"
    assert sum(len(c.token_ids) for c in [first, *rest]) < 200


BAD = [
    (dict(temperature=-0.5), "temperature"),
    (dict(top_p=1.5), "top_p"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=100_000), "max_tokens"),
    (dict(workload_class="Poetry!"), "workload_class"),  # unknown names are fine (the default policy)
    (dict(draft_pool="huge"), "draft_pool"),
    (dict(num_draft_tokens=99), "num_draft_tokens"),
]


@pytest.mark.parametrize("fields,word", BAD, ids=[w for _, w in BAD])
def test_bad_requests_are_invalid_argument(stub, stack, fields, word):
    with pytest.raises(grpc.RpcError) as err:
        stub.Generate(_req("def f(x):\n", **fields), timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert word in err.value.details()


def test_bad_prompts_are_invalid_argument_and_router_stays_up(stub, stack):
    for req, word in ((generation_pb2.GenerateRequest(prompt="", max_tokens=4), "empty"),
                      (generation_pb2.GenerateRequest(prompt_ids=generation_pb2.TokenIds(ids=[1, 10**6]), max_tokens=4),
                       "outside the vocabulary"),
                      (generation_pb2.GenerateRequest(prompt="x " * 5000, max_tokens=4), "limit")):
        with pytest.raises(grpc.RpcError) as err:
            stub.Generate(req, timeout=30)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and word in err.value.details()
    with grpc.insecure_channel(stack.info.router) as ch:
        status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5).status
    assert status == health_pb2.HealthCheckResponse.SERVING


def test_every_service_has_health_and_reflection(stack):
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    services = {stack.info.router: "specserve.v1.Generation", stack.info.target["address"]: "specserve.v1.Target",
                **{a: "specserve.v1.Draft" for addrs in stack.info.pools.values() for a in addrs
                   if a not in LOCAL}}  # drafted inside the target: no service of its own
    for address, name in services.items():
        with grpc.insecure_channel(address) as ch:
            health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
            assert health.status == health_pb2.HealthCheckResponse.SERVING, address
            answers = reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5)
            listed = {s.name for a in answers for s in a.list_services_response.service}
            assert {name, "grpc.health.v1.Health"} <= listed, (address, listed)


# -- faults (run last in this module: they kill workers) -----------------------------------

def test_kill_a_draft_replica_mid_request(stub, stack, reference, eval_prompts):
    """The session's replica dies mid-request: the pool fails over (or falls back to plain
    steps) and the complete greedy output is still exactly the reference."""
    from specserve.engine.remote_drafts import replica_for

    prompt = eval_prompts[1]["prompt"]
    want = reference(prompt, 60)
    stream = stub.GenerateStream(_req(prompt, max_tokens=60, draft_pool="small"), timeout=180)
    first = next(stream)
    r = redis.Redis.from_url(stack.info.redis_url)
    assert r.hget(session_key(first.session_id), "status") == b"running"  # mid-generation
    replica = replica_for(first.session_id, stack.info.pools["small"])  # the session's replica
    name = f"draft-small-{stack.info.pools['small'].index(replica)}"
    os.kill(stack.info.pids[name], signal.SIGKILL)
    chunks = [first, *stream]
    _contiguous(chunks)
    assert [t for c in chunks for t in c.token_ids] == want  # all of it, not a prefix
    assert chunks[-1].finish_reason in ("eos", "length")


def _contiguous(chunks) -> None:
    pos = 0
    for c in chunks:  # each chunk starts where the previous ended: nothing duplicated or lost
        assert c.offset == pos
        pos += len(c.token_ids)


def test_kill_the_target_actor_process(stub, stack, reference, eval_prompts):
    """Ray restarts the killed actor and its new incarnation adopts the session from Redis
    and re-prefills it: the request completes, exactly (an UNAVAILABLE here would be a failed
    recovery, not an outcome)."""
    r = redis.Redis.from_url(stack.info.redis_url)
    before = json.loads(r.get("specserve:target:target-0"))
    prompt = eval_prompts[11]["prompt"]
    want = reference(prompt, 60)
    stream = stub.GenerateStream(_req(prompt, max_tokens=60, draft_pool="ngram"), timeout=300)
    first = next(stream)
    assert r.hget(session_key(first.session_id), "status") == b"running"  # mid-generation
    os.kill(before["pid"], signal.SIGKILL)
    chunks = [first, *stream]
    _contiguous(chunks)
    assert [t for c in chunks for t in c.token_ids] == want, "wrong, lost or duplicated output after a restart"
    assert chunks[-1].finish_reason in ("eos", "length")
    after = json.loads(r.get("specserve:target:target-0"))
    assert after["pid"] != before["pid"], "Ray restarted the actor in a new process"


def test_a_restarted_target_keeps_its_classes_suffix_index(stub, stack):
    """After the kill above, Ray's new incarnation of the target loaded every class's index
    from the fleet's Redis streams (ADR 0026): the `agent` outputs served before the kill are
    in it (origin fleet: the old incarnation is another target to it), and a held-out request
    drafts from them at once."""
    from specserve.tooling.workloads import agent_workload

    prompt = agent_workload(AGENT_RECORDS).held_out[AGENT_RECORDS]  # a rendering not served before
    resp = stub.Generate(_req(prompt, max_tokens=40, draft_pool="suffix", num_draft_tokens=32,
                              workload_class="agent"), timeout=120)
    metrics = _scrape(_target_metrics(stack))  # (the engine indexes what it loaded before it drafts)
    assert _suffix(metrics, "specserve_suffix_index_added_total", workload_class="other", origin="fleet") \
        >= 2 * AGENT_RECORDS
    assert _suffix(metrics, "specserve_suffix_index_added_total", workload_class="other", origin="local") <= 1
    assert _suffix(metrics, "specserve_suffix_proposals_total", workload_class="other", source="index") >= 1
    assert resp.stats.accepted_tokens > 10  # the order's JSON, drafted from the index
