"""The whole stack through a Redis primary failover under Sentinel (issue 41, ADR 0023).

`specserve up --redis-ha`'s servers (a primary, one replica, three sentinels) under the real
stack: a Ray target (simulated pass time, so a request lasts seconds), a draft replica and a
router whose readers confirm every read with a replica (`redis+sentinel://` turns that on).
Eight concurrent streams, four greedy and four at T = 1 with seeds; once each was served
FAULT_AT tokens, replication lag is injected (the replica stopped and its link cut, so the
primary's next commits reach no replica), then the primary is killed (SIGKILL) and the
sentinels promote the replica, which really lacks the primary's last commits (asserted).

Every client's received sequence must equal the same request's output without a failover
(greedy: target-only greedy decoding; T = 1: the same requests, seeds and pool on the healthy
stack just before), with contiguous offsets (no token repeated, none skipped), and none of
the tokens a client had been served may be missing on the promoted replica. The failover's
pause per stream is reported (SPECSERVE_FAULT_REPORT as in the fault matrix)."""

from __future__ import annotations

import json
import os
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import redis
from faultkit import LEASE_S

from specserve.serving.tls import channel
from specserve.state.store import session_key
from specserve.v1 import generation_pb2, generation_pb2_grpc

MAX_TOKENS = 96
FAULT_AT = 8  # tokens every stream received before the fault
LAG_S = 0.8  # the primary commits this long with no replica receiving
PASS_MS = 60
GREEDY, SAMPLED = 4, 4


@pytest.fixture(scope="module")
def ha_stack(demo_pair_dir, tmp_path_factory: pytest.TempPathFactory):
    from specserve.tooling.stack import PoolSpec, Stack, StackSpec

    spec = StackSpec(
        pair_dir=str(demo_pair_dir), run_dir=str(tmp_path_factory.mktemp("redis-failover")),
        pools={"small": PoolSpec("draft", replicas=1)}, redis_ha=True, target_threads=1, routers=1,
        router_env={"SPECSERVE_ROUTER_TARGET_WAIT_S": "180", "SPECSERVE_ROUTER_LEASE_S": str(LEASE_S),
                    "SPECSERVE_ROUTER_REAP_S": "1", "SPECSERVE_ROUTER_MAX_TOKENS_LIMIT": str(MAX_TOKENS)},
        env={"SPECSERVE_TARGET_SIMULATED_PASS_MS": str(PASS_MS), "SPECSERVE_TARGET_LEASE_S": str(LEASE_S),
             "SPECSERVE_TARGET_HEARTBEAT_S": "0.5"})
    with Stack(spec).running(timeout_s=480) as s:
        yield s


def _greedy(demo_pair, target_model, prompt: str) -> list[int]:
    from specserve.drafters import NgramDrafter
    from specserve.worker.reference import GenerationParams, ReferenceDecoder

    engine = ReferenceDecoder(target_model, NgramDrafter(target_model.vocab_size), demo_pair.tokenizer)
    return engine.generate(prompt, GenerationParams(max_tokens=MAX_TOKENS, num_draft_tokens=0)).token_ids


def _request(prompt: str, seed: int | None) -> generation_pb2.GenerateRequest:
    if seed is None:
        return generation_pb2.GenerateRequest(prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0,
                                              draft_pool="small")
    return generation_pb2.GenerateRequest(prompt=prompt, max_tokens=MAX_TOKENS, temperature=1.0, seed=seed,
                                          draft_pool="small")


def _work(stub, eval_prompts, demo_pair, target_model) -> tuple[list, list[list[int]]]:
    """Four greedy requests whose reference runs to MAX_TOKENS, and the four seeded T = 1
    requests (of eight tried at once on the healthy stack) with the longest outputs: every
    session is still running when the fault lands."""
    prompts = [p["prompt"] for p in eval_prompts]
    greedy = []
    for p in prompts:
        if len(greedy) == GREEDY:
            break
        if len(want := _greedy(demo_pair, target_model, p)) == MAX_TOKENS:
            greedy.append((_request(p, None), want))
    tried = [_request(p, 4100 + i) for i, p in enumerate(prompts[-2 * SAMPLED:])]
    with ThreadPoolExecutor(len(tried)) as pool:
        healthy = list(pool.map(lambda r: list(stub.Generate(r, timeout=240).token_ids), tried))
    sampled = sorted(zip(tried, healthy, strict=True), key=lambda x: -len(x[1]))[:SAMPLED]
    work = greedy + sampled
    return [r for r, _ in work], [w for _, w in work]


class _Stream:
    """One client's stream on a thread: its chunks and when each came."""

    def __init__(self, stub, request) -> None:
        self.chunks: list = []
        self.times: list[float] = []
        self.error: Exception | None = None
        self.thread = threading.Thread(target=self._run, args=(stub, request), daemon=True)
        self.thread.start()

    def _run(self, stub, request) -> None:
        try:
            for c in stub.GenerateStream(request, timeout=240):
                self.chunks.append(c)
                self.times.append(time.monotonic())
        except Exception as exc:  # reported by the test
            self.error = exc

    @property
    def tokens(self) -> list[int]:
        return [t for c in list(self.chunks) for t in c.token_ids]


def _lengths(port: int, password: str, sids: list[str]) -> dict[str, int]:
    c = redis.Redis(port=port, password=password, socket_timeout=5)
    try:
        return {s: c.llen(session_key(s) + ":tok") for s in sids}
    finally:
        c.close()


def test_a_primary_failover_mid_generation_loses_no_served_token(ha_stack, eval_prompts, demo_pair, target_model):
    ha = ha_stack.redis_ha
    with channel(ha_stack.info.router, "") as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)
        # the references: greedy from the target alone; T = 1 from the same requests, healthy
        requests, wants = _work(stub, eval_prompts, demo_pair, target_model)
        assert len(requests) == GREEDY + SAMPLED and all(len(w) > 2 * FAULT_AT for w in wants), [len(w) for w in wants]

        streams = [_Stream(stub, r) for r in requests]
        deadline = time.monotonic() + 120
        while any(len(s.tokens) < FAULT_AT for s in streams):
            assert time.monotonic() < deadline and not any(s.error for s in streams), [s.error for s in streams]
            time.sleep(0.01)
        sids = [s.chunks[0].session_id for s in streams]
        ha.cut_replication()
        try:
            time.sleep(LAG_S)
            on_primary = _lengths(ha.primary.port, ha.password, sids)
            served = [len(s.tokens) for s in streams]
            kill_at = time.monotonic()
            ha.primary.kill()
        finally:
            ha.resume_replica()
        time.sleep(0.3)  # the replica applies what reached it, then finds its primary gone
        on_replica = _lengths(ha.replica.port, ha.password, sids)
        for s in streams:
            s.thread.join(240)
    done = time.monotonic() - kill_at
    pauses = sorted(max((b - a for a, b in zip(s.times, s.times[1:], strict=False) if b > kill_at), default=0.0)
                    for s in streams)
    report = {"redis_failover/pause_p50_s": statistics.median(pauses), "redis_failover/pause_max_s": pauses[-1],
              "redis_failover/lost_commits": sum(on_primary[s] - on_replica[s] for s in sids),
              "redis_failover/recovered_s": done}
    print(json.dumps(report))
    if path := os.environ.get("SPECSERVE_FAULT_REPORT"):
        with open(path, "a") as f:
            f.write(json.dumps(report) + "\n")
    assert not any(s.error for s in streams), [s.error for s in streams]
    # mid-generation: every session was running with tokens still to come at the kill
    assert all(on_primary[sid] < len(want) for sid, want in zip(sids, wants, strict=True)), on_primary
    # the lag hit: the promoted replica lacks commits the primary had acknowledged
    assert any(on_primary[sid] > on_replica[sid] for sid in sids), (on_primary, on_replica)
    for i, (s, want, sid) in enumerate(zip(streams, wants, sids, strict=True)):
        assert served[i] <= on_replica[sid], (i, served[i], on_replica[sid])  # nothing served was lost
        pos = 0
        for c in s.chunks:
            assert c.offset == pos, (i, c.offset, pos)  # no token repeated, none skipped
            pos += len(c.token_ids)
        assert s.tokens == want, i  # what the same request gives without a failover
        assert s.chunks[-1].finish_reason in ("eos", "length")
