"""Admission (ADR 0013, ADR 0014) on the real stack (redis-server, Ray-placed target, router,
n-gram pool): a target with room for 2 sessions. Two long sessions hold its slots; then a
request through a router that waits is queued (Target.Start answers RESOURCE_EXHAUSTED)
until one of them is cancelled, and is served with exactly the target-only greedy tokens;
through a router that waits briefly it fails with RESOURCE_EXHAUSTED and a message that says
what to do, and that router serves the next request once there is room."""

from __future__ import annotations

import threading
import time
import urllib.request

import grpc
import pytest

from specserve.drafters import NgramDrafter
from specserve.v1 import generation_pb2, generation_pb2_grpc
from specserve.worker.reference import GenerationParams, ReferenceDecoder

MAX_TOKENS = 16


@pytest.fixture(scope="module")
def small_stack(demo_pair_dir, tmp_path_factory):
    from specserve.tooling.stack import PoolSpec, Stack, StackSpec

    spec = StackSpec(
        pair_dir=str(demo_pair_dir), run_dir=str(tmp_path_factory.mktemp("admission")),
        pools={"ngram": PoolSpec("ngram")}, target_threads=1, routers=2,
        # 2 sessions fit in the target's engine
        env={"SPECSERVE_TARGET_MAX_SESSIONS": "2"},
        router_env={"SPECSERVE_ROUTER_TARGET_WAIT_S": "180"},
        router_env_each=[{"SPECSERVE_ROUTER_ADMISSION_WAIT_S": "120"},
                         {"SPECSERVE_ROUTER_ADMISSION_WAIT_S": "0.5"}],
    )
    with Stack(spec).running(timeout_s=480) as s:
        yield s


def _hog(stub, prompt: str, eos: int) -> str:
    """A session that holds a KV slot until it is cancelled (no EOS, a long budget)."""
    stream = stub.GenerateStream(generation_pb2.GenerateRequest(
        prompt=prompt, max_tokens=800, draft_pool="none", banned_token_ids=[eos]), timeout=170)
    return next(stream).session_id


def _refused(stack) -> float:
    text = urllib.request.urlopen(f"http://{stack.info.metrics['target']}/metrics", timeout=10).read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("specserve_target_refused_sessions_total"))


def test_no_kv_room_queues_then_serves_or_fails_with_an_actionable_message(small_stack, demo_pair, target_model,
                                                                         eval_prompts):
    prompt = eval_prompts[0]["prompt"]
    engine = ReferenceDecoder(target_model, NgramDrafter(target_model.vocab_size), demo_pair.tokenizer)
    expected = engine.generate(prompt, GenerationParams(max_tokens=MAX_TOKENS, num_draft_tokens=0)).token_ids
    req = generation_pb2.GenerateRequest(prompt=prompt, max_tokens=MAX_TOKENS, draft_pool="ngram")
    with grpc.insecure_channel(small_stack.info.routers[0]) as ch0, \
            grpc.insecure_channel(small_stack.info.routers[1]) as ch1:
        patient, hasty = generation_pb2_grpc.GenerationStub(ch0), generation_pb2_grpc.GenerationStub(ch1)
        eos = demo_pair.tokenizer.eos_token_id
        hogs = [_hog(patient, eval_prompts[i]["prompt"], eos) for i in (1, 2)]
        refused_before = _refused(small_stack)

        # a router that waits only 0.5 s: RESOURCE_EXHAUSTED, with what to do
        with pytest.raises(grpc.RpcError) as err:
            hasty.Generate(req, timeout=60)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "KV room" in err.value.details() and "retry" in err.value.details()
        assert _refused(small_stack) > refused_before

        # a patient router queues the request until a hog ends, then serves it in full
        result: dict = {}
        worker = threading.Thread(target=lambda: result.update(r=patient.Generate(req, timeout=170)))
        worker.start()
        time.sleep(1.5)
        assert worker.is_alive()  # still queued: both slots are held
        assert patient.Cancel(generation_pb2.CancelRequest(session_id=hogs[0]), timeout=10).cancelled
        worker.join(170)
        assert "r" in result
        assert list(result["r"].token_ids) == expected  # no token lost or repeated

        # the hasty router serves once there is room
        assert hasty.Cancel(generation_pb2.CancelRequest(session_id=hogs[1]), timeout=10).cancelled
        assert list(hasty.Generate(req, timeout=120).token_ids) == expected
