"""Policies, the controller and shadow mode on the real system: its own redis-server, Ray
target, draft pools (`small` and `spare`: the distilled draft, `poor`: the same architecture
untrained) and two router replicas, all on loopback.

The target sleeps 30 ms per forward pass and the `small` draft 5 ms per proposed token
(SPECSERVE_*_SIMULATED_*): on this CPU the tiny target is so cheap that speculation never
pays, which is a fine result but would leave the controller nothing to choose. The
simulated costs model a large target on a GPU (flat in K) and a draft on a small GPU; they
are sleeps, so timings here are far steadier than compute-bound ones.
"""

from __future__ import annotations

import collections
import json
import random
import statistics
import threading
import time
import uuid

import grpc
import pytest
import redis

from specserve.control.arms import in_slice
from specserve.control.policy import Policy
from specserve.state.store import session_key
from specserve.v1 import generation_pb2, generation_pb2_grpc, policy_pb2, policy_pb2_grpc

TOKEN = "test-admin-token"
AUTH = [("authorization", f"Bearer {TOKEN}")]
ENABLED, SHADOW, OFF = policy_pb2.POLICY_MODE_ENABLED, policy_pb2.POLICY_MODE_SHADOW, policy_pb2.POLICY_MODE_OFF


@pytest.fixture(scope="module")
def pstack(demo_pair_dir, tmp_path_factory):
    from specserve.tooling.modelbuild.build import untrained_copy
    from specserve.tooling.stack import PoolSpec, Stack, StackSpec

    run_dir = tmp_path_factory.mktemp("pstack")
    poor = untrained_copy(demo_pair_dir / "draft", run_dir / "poor-draft", seed=1)
    spec = StackSpec(
        pair_dir=str(demo_pair_dir), run_dir=str(run_dir), routers=2, target_threads=1,
        pools={"small": PoolSpec("draft", env={"SPECSERVE_DRAFT_SIMULATED_TOKEN_MS": "5"}),
               "poor": PoolSpec(str(poor)),
               # the distilled draft again, on a faster simulated device (1 ms per token: S
               # well above the margin even on a loaded machine), for the two-pool test alone
               # (it kills it)
               "spare": PoolSpec("draft", env={"SPECSERVE_DRAFT_SIMULATED_TOKEN_MS": "1"})},
        router_env={"SPECSERVE_ROUTER_ADMIN_TOKENS": json.dumps({"ops": TOKEN}),
                    "SPECSERVE_ROUTER_MAX_TOKENS_LIMIT": "256", "SPECSERVE_ROUTER_TARGET_WAIT_S": "120",
                    "SPECSERVE_ROUTER_CONTROLLER_HALF_LIFE_S": "60"},
        # the engine feeds the statistics the router reads: the same half-life on both sides
        env={"SPECSERVE_TARGET_SIMULATED_PASS_MS": "30", "SPECSERVE_TARGET_CONTROLLER_HALF_LIFE_S": "60"},
    )
    with Stack(spec).running(timeout_s=480) as s:
        yield s


@pytest.fixture(scope="module")
def routers(pstack):
    channels = [grpc.insecure_channel(a) for a in pstack.info.routers]
    yield [(generation_pb2_grpc.GenerationStub(c), policy_pb2_grpc.PolicyAdminStub(c)) for c in channels]
    for c in channels:
        c.close()


@pytest.fixture(scope="module")
def rdb(pstack):
    client = redis.Redis.from_url(pstack.info.redis_url, decode_responses=True)
    yield client
    client.close()


@pytest.fixture(scope="module")
def code_prompts(eval_prompts):
    return [p["prompt"] for p in eval_prompts if p["workload_class"] == "code"][:4]


@pytest.fixture(scope="module")
def readable_code_prompts(eval_prompts, demo_pair):
    """Code prompts whose greedy 32-token target continuation does not loop (textquality). On
    a loop ("CPPPP…") even an untrained draft is accepted, since a random model with tied
    embeddings tends to repeat its input token: such a prompt would make the poor pool pay."""
    from specserve.tooling.textquality import is_degenerate

    tok, keep = demo_pair.tokenizer, []
    for p in (p for p in eval_prompts if p["workload_class"] == "code"):
        ids = tok(p["prompt"], return_tensors="pt").input_ids
        out = demo_pair.target.generate(ids, max_new_tokens=32, do_sample=False)[0, ids.shape[1]:].tolist()
        if not is_degenerate(out):
            keep.append(p["prompt"])
        if len(keep) == 4:
            return keep
    pytest.fail(f"only {len(keep)} readable code prompts among the held-out ones")


@pytest.fixture(scope="module")
def extraction_prompts(eval_prompts):
    """Where the distilled draft is strong (MODEL_CARD.md: 2.75 of 4 drafts accepted per round
    held out, against 0.79 on code), so a pool's worth is clear from a few requests."""
    return [p["prompt"] for p in eval_prompts if p["workload_class"] == "extraction"][:4]


def _cls(name: str) -> str:
    return f"{name}-{uuid.uuid4().hex[:6]}"


def _set(admin, cls: str, **fields) -> policy_pb2.Policy:
    fields = {"workload_class": cls, "mode": ENABLED, "draft_pool": "small", "k": 4, "safety_margin": 0.1,
              "probe_fraction": 0.05, **fields}
    return admin.SetPolicy(policy_pb2.SetPolicyRequest(policy=policy_pb2.Policy(**fields)),
                           metadata=AUTH, timeout=10)


def _gen(stub, prompt: str, cls: str, max_tokens: int = 32, **kw) -> generation_pb2.GenerateResponse:
    return stub.Generate(generation_pb2.GenerateRequest(prompt=prompt, max_tokens=max_tokens, workload_class=cls, **kw),
                         timeout=120)


def _effective(admin, cls: str) -> policy_pb2.EffectivePolicy:
    return admin.GetEffectivePolicy(policy_pb2.GetEffectivePolicyRequest(workload_class=cls), metadata=AUTH, timeout=10)


# -- propagation and in-flight requests ----------------------------------------------------
def test_a_change_reaches_both_replicas_within_one_second(routers):
    (gen0, admin0), (gen1, admin1) = routers
    cls = _cls("prop")
    for mode in (ENABLED, OFF, SHADOW):
        stored = _set(admin0, cls, mode=mode)
        t0 = time.monotonic()
        while _effective(admin1, cls).policy.version != stored.version:
            assert time.monotonic() - t0 < 1.0, "replica 1 did not see the change within 1 s"
            time.sleep(0.005)
        assert _effective(admin1, cls).policy.mode == mode
    # and it is what requests on replica 1 get: speculation off without a restart
    _set(admin0, cls, mode=OFF)
    time.sleep(1.0)
    resp = _gen(gen1, "def add(a, b):\n", cls, max_tokens=8)
    assert resp.stats.draft_pool == "" and resp.stats.round[0].fallback_reason == "policy_off"


def test_in_flight_requests_keep_the_policy_they_started_with(routers, code_prompts):
    (gen0, admin0), (gen1, _) = routers
    cls = _cls("inflight")
    _set(admin0, cls, k=3)
    req = generation_pb2.GenerateRequest(prompt=code_prompts[0], max_tokens=60, workload_class=cls, draft_pool="small")
    stream = gen1.GenerateStream(req, timeout=120)
    first = next(stream)
    assert first.token_ids
    _set(admin0, cls, mode=OFF)  # while the request runs on replica 1
    changed_at = time.monotonic()
    chunks = [first, *stream]
    assert time.monotonic() - changed_at > 0.3, "the request ended too soon to prove anything"
    stats = chunks[-1].stats
    assert stats.draft_pool == "small", "it changed policy mid-flight"
    assert not any(r.fallback_reason == "policy_off" for r in stats.round), "it changed policy mid-flight"
    # it kept speculating after the change: verify rounds in the second half of the run, and
    # every round without drafts is one the engine ran plain for a draft reason (a block not
    # worth waiting for, ADR 0014), or the budget's last token - never the policy
    late = stats.round[len(stats.round) // 2:]
    assert sum(r.k > 0 for r in late) >= 3, [(r.k, r.fallback_reason) for r in stats.round]
    assert {r.fallback_reason for r in stats.round if r.k == 0} <= {"draft_late", ""}, \
        [(r.k, r.fallback_reason) for r in stats.round]
    after = _gen(gen1, code_prompts[0], cls, max_tokens=8, draft_pool="small")
    assert after.stats.draft_pool == "" and after.stats.round[0].fallback_reason == "policy_off"


def test_temperature_ceiling_and_prompt_limit_run_plain(routers, code_prompts):
    gen, admin = routers[0]
    cls = _cls("limits")
    _set(admin, cls, temperature_ceiling=0.5, max_prompt_tokens=12)
    hot = _gen(gen, "def f(x):\n", cls, max_tokens=6, temperature=0.9, seed=1, draft_pool="small")
    assert hot.stats.draft_pool == "" and hot.stats.round[0].fallback_reason == "temperature_above_ceiling"
    long = _gen(gen, code_prompts[0], cls, max_tokens=6, draft_pool="small")  # held-out prompts are longer
    assert long.stats.draft_pool == "" and long.stats.round[0].fallback_reason == "prompt_above_limit"
    ok = _gen(gen, "def f(x):\n", cls, max_tokens=6, temperature=0.3, seed=1, draft_pool="small")
    assert ok.stats.draft_pool == "small"


# -- the controller ------------------------------------------------------------------------
def test_a_poor_draft_pool_is_switched_to_plain_and_throughput_recovers(routers, readable_code_prompts):
    code_prompts = readable_code_prompts
    (gen0, admin0), (gen1, _) = routers
    cls = _cls("poor")
    _set(admin0, cls, draft_pool="poor", k=4, probe_fraction=0.05)
    # learning: until both arms have statistics the controller tries both
    for i in range(40):
        _gen((gen0, gen1)[i % 2], code_prompts[i % len(code_prompts)], cls)
        d = _effective(admin0, cls).decision
        if d.decision == "plain":
            break
    assert d.decision == "plain", d.reason
    assert d.expected_speedup < 1.1 and d.acceptance[0] < 0.5
    learned_after = i + 1
    # now: interleaved, the same prompts, the controller's class vs speculation off
    ctrl_t, plain_t, ctrl_tokens, plain_tokens, speculative = [], [], 0, 0, 0
    for i in range(16):
        prompt = code_prompts[i % len(code_prompts)]
        t = time.perf_counter()
        r = _gen(gen0, prompt, cls)
        ctrl_t.append(time.perf_counter() - t)
        ctrl_tokens += len(r.token_ids)
        speculative += bool(r.stats.draft_pool)
        t = time.perf_counter()
        p = _gen(gen0, prompt, cls, draft_pool="none")
        plain_t.append(time.perf_counter() - t)
        plain_tokens += len(p.token_ids)
    ratio = (ctrl_tokens / sum(ctrl_t)) / (plain_tokens / sum(plain_t))
    print(f"poor pool: plain after {learned_after} requests; throughput vs plain {ratio:.3f}; "
          f"{speculative}/16 probes")
    assert speculative <= 4  # probe fraction 5 %: P(binomial(16, 0.05) > 4) < 0.001
    assert ratio >= 0.90


def _router_metric(pstack, name: str) -> float:
    """The sum of a counter's samples over both routers' /metrics."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for router, address in pstack.info.metrics.items():
        if router.startswith("router"):
            text = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
            total += sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
                         if s.name == name)
    return total


def test_a_rollout_slice_on_a_pool_that_hurts_goes_back_to_shadow_by_itself(pstack, routers, readable_code_prompts,
                                                                            extraction_prompts):
    """Rollout guards (ADR 0022): a class at a 50 % slice on the untrained pool goes back to
    shadow by itself once its slice has enough rounds (S under 1), as one write by `controller`
    in the audit log with the guard's reason, counted; its requests then run plain. A class at
    the same slice on the distilled pool, over as many requests, stays in its slice (the
    false-positive control)."""
    (gen0, admin0), (gen1, _) = routers
    poor, good = _cls("slice-poor"), _cls("slice-good")
    _set(admin0, poor, mode=policy_pb2.POLICY_MODE_SLICE, slice_percent=50.0, draft_pool="poor", k=4)
    _set(admin0, good, mode=policy_pb2.POLICY_MODE_SLICE, slice_percent=50.0, draft_pool="small", k=4)
    before = _router_metric(pstack, "specserve_rollout_rollbacks_total")
    sent = 0
    for i in range(40):
        _gen((gen0, gen1)[i % 2], readable_code_prompts[i % 4], poor, max_tokens=24, request_id=f"{poor}-{i}")
        sent += 1
        got = admin0.GetPolicy(policy_pb2.GetPolicyRequest(workload_class=poor), metadata=AUTH, timeout=10)
        if got.mode == SHADOW:
            break
    assert got.mode == SHADOW and got.slice_percent == 0, f"still {got.mode} after {sent} requests"
    audit = admin0.ListAudit(policy_pb2.ListAuditRequest(workload_class=poor), metadata=AUTH, timeout=10).entries
    assert [(e.action, e.who) for e in audit][:1] == [("rollback", "controller")]
    assert "guard speedup" in audit[0].comment and audit[0].old.mode == policy_pb2.POLICY_MODE_SLICE
    assert sum(e.action == "rollback" for e in audit) == 1  # one router wrote it
    assert _router_metric(pstack, "specserve_rollout_rollbacks_total") == before + 1
    served = _gen(gen0, readable_code_prompts[0], poor, max_tokens=8, request_id=f"{poor}-after")
    assert served.stats.decision == "shadow"  # its requests now serve plain output
    for i in range(sent):  # the control: as many requests on a pool that pays
        _gen((gen0, gen1)[i % 2], extraction_prompts[i % 4], good, max_tokens=24, request_id=f"{good}-{i}")
    got = admin0.GetPolicy(policy_pb2.GetPolicyRequest(workload_class=good), metadata=AUTH, timeout=10)
    assert got.mode == policy_pb2.POLICY_MODE_SLICE and got.version == 1
    print(f"rollout guard: the poor slice went back to shadow after {sent} requests; the good one stayed")
    # and one whose policy promotes it after a clean window of 2 s goes to enabled by itself
    # (its speedup guard at 0.5: this part is about promotion; on a machine 3x slower than usual,
    # under the suite's load, the distilled pool's S dipped under 1 twice and tripped a guard at 1)
    promo = _cls("slice-promo")
    _set(admin0, promo, mode=policy_pb2.POLICY_MODE_SLICE, slice_percent=50.0, draft_pool="small", k=4,
         promote_after_s=2.0, guard_min_speedup=0.5)
    for i in range(40):
        _gen((gen0, gen1)[i % 2], extraction_prompts[i % 4], promo, max_tokens=24, request_id=f"{promo}-{i}")
        got = admin0.GetPolicy(policy_pb2.GetPolicyRequest(workload_class=promo), metadata=AUTH, timeout=10)
        if got.mode == ENABLED:
            break
    assert got.mode == ENABLED and got.updated_by == "controller"
    audit = admin0.ListAudit(policy_pb2.ListAuditRequest(workload_class=promo), metadata=AUTH, timeout=10).entries
    assert audit[0].action == "promote" and "clean for" in audit[0].comment


def test_an_enabled_class_whose_drafts_stop_being_accepted_goes_back_to_a_slice(pstack, routers,
                                                                                 readable_code_prompts,
                                                                                 extraction_prompts):
    """Guards at stage enabled (ADR 0022): a class enabled on the untrained pool with an
    acceptance floor of 0.5 drafts a round goes back one stage, to a 10 % slice, by itself, as a
    `controller` rollback in the audit log naming the guard and the stage. The same class on
    the distilled pool, over as many requests, stays enabled (the false-positive control). The
    speedup guard does not apply at enabled: the controller already runs such a class plain."""
    (gen0, admin0), (gen1, _) = routers
    poor, good = _cls("enabled-poor"), _cls("enabled-good")
    _set(admin0, poor, draft_pool="poor", guard_min_accepted=0.5)
    _set(admin0, good, draft_pool="small", guard_min_accepted=0.5)
    sent = 0
    for i in range(40):
        _gen((gen0, gen1)[i % 2], readable_code_prompts[i % 4], poor, max_tokens=24, request_id=f"{poor}-{i}")
        sent += 1
        got = admin0.GetPolicy(policy_pb2.GetPolicyRequest(workload_class=poor), metadata=AUTH, timeout=10)
        if got.mode != ENABLED:
            break
    assert got.mode == policy_pb2.POLICY_MODE_SLICE and got.slice_percent == 10.0, \
        f"mode {got.mode} after {sent} requests"
    audit = admin0.ListAudit(policy_pb2.ListAuditRequest(workload_class=poor), metadata=AUTH, timeout=10).entries
    assert (audit[0].action, audit[0].who) == ("rollback", "controller")
    assert "guard acceptance (enabled)" in audit[0].comment and audit[0].old.mode == ENABLED, audit[0].comment
    # the statistics that tripped it do not take the slice on to shadow at once: requests whose
    # ids land in the 10 % slice (so the slice's guards are evaluated for them) leave it as it is
    sliced = Policy(poor, mode="slice", slice_percent=10.0)
    inside = [rid for rid in (f"{poor}-more-{j}" for j in range(400)) if in_slice(sliced, rid, random.Random(0))][:3]
    for i, rid in enumerate(inside):
        _gen((gen0, gen1)[i % 2], readable_code_prompts[i % 4], poor, max_tokens=8, request_id=rid)
    again = admin0.GetPolicy(policy_pb2.GetPolicyRequest(workload_class=poor), metadata=AUTH, timeout=10)
    assert len(inside) == 3 and (again.mode, again.version) == (got.mode, got.version), again.updated_by
    for i in range(sent):
        _gen((gen0, gen1)[i % 2], extraction_prompts[i % 4], good, max_tokens=24, request_id=f"{good}-{i}")
    got = admin0.GetPolicy(policy_pb2.GetPolicyRequest(workload_class=good), metadata=AUTH, timeout=10)
    assert got.mode == ENABLED and got.version == 1
    print(f"enabled guard: the poor class went back to a slice after {sent} requests: {audit[0].comment}")


def test_a_slice_slower_than_its_plain_requests_trips_the_tpot_guard(pstack, routers, readable_code_prompts):
    """The outcome guards (ADR 0022): with the speedup guard off, a class at a 50 % slice whose
    requests pin the untrained pool (so the slice speculates whatever the controller thinks,
    and every round's drafts are rejected) goes back to shadow once one router has seen enough
    of its requests in both arms, because the slice's TPOT p90 (clients' time per token)
    exceeds 1.05x that of the class's plain requests in the same window (1.18x measured: the
    simulated pass costs the same for 5 tokens as for 1, so a rejected round costs little more
    than a plain step); written by `controller` with the guard's reason."""
    (gen0, admin0), _ = routers
    cls = _cls("slice-tpot")
    _set(admin0, cls, mode=policy_pb2.POLICY_MODE_SLICE, slice_percent=50.0, draft_pool="poor", k=4,
         guard_min_speedup=0.0, guard_max_tpot_ratio=1.05)
    sent = 0
    for i in range(80):  # one router: the windows are each router's own
        _gen(gen0, readable_code_prompts[i % 4], cls, max_tokens=24, request_id=f"{cls}-{i}", draft_pool="poor",
             num_draft_tokens=4)
        sent += 1
        got = admin0.GetPolicy(policy_pb2.GetPolicyRequest(workload_class=cls), metadata=AUTH, timeout=10)
        if got.mode == SHADOW:
            break
    assert got.mode == SHADOW, f"still {got.mode} after {sent} requests"
    audit = admin0.ListAudit(policy_pb2.ListAuditRequest(workload_class=cls), metadata=AUTH, timeout=10).entries
    assert audit[0].action == "rollback" and audit[0].who == "controller"
    assert "guard tpot" in audit[0].comment, audit[0].comment
    print(f"tpot guard: rolled back after {sent} requests: {audit[0].comment}")


def test_a_class_with_two_pools_ends_on_the_good_one_and_leaves_it_when_it_degrades(pstack, routers,
                                                                                  extraction_prompts):
    """The policy prefers `poor` but allows `spare` (the distilled draft): the controller
    measures plain and both pools, then runs the class on `spare`. When `spare` degrades (its
    only replica is killed: its link breaks, its rounds run plain, 0 accepted), the
    class leaves it, and it does not go to `poor`, which does not pay either."""
    import os
    import signal

    (gen0, admin0), (gen1, _) = routers
    prompts = extraction_prompts
    cls = _cls("twopools")
    _set(admin0, cls, draft_pool="poor", draft_pools=["spare"], k=4, probe_fraction=0.05)
    history: list[str] = []
    for i in range(16):
        r = _gen((gen0, gen1)[i % 2], prompts[i % len(prompts)], cls)
        history.append(r.stats.draft_pool or "plain")
        d = _effective(admin0, cls).decision
        if d.decision == "speculate":
            break
    # learning sends each request to an arm without statistics: 3 arms, each measured by one
    # 32-token request, so 16 requests leave P(an arm never drawn) < 3 * (2/3)^16 < 0.002
    assert (d.decision, d.draft_pool) == ("speculate", "spare"), (d.reason, history)
    assert d.speedup_by_pool["spare"] > 1.1 > d.speedup_by_pool["poor"]
    settled_after = i + 1
    placed = []
    for j in range(8):
        r = _gen(gen0, prompts[j % len(prompts)], cls)
        placed.append((r.stats.draft_pool or "plain", r.stats.decision, r.stats.decision_reason))
    # the class's own placements all run on spare; probes (5 %) may go elsewhere:
    # P(binomial(8, 0.05) > 2) < 0.006. (Split so that a failure says which rule broke: one
    # CI run saw 5 of 8 on spare, the first a probe of poor, the rest not shown.)
    probes = [(pool, reason[:120]) for pool, _, reason in placed if reason.startswith("a probe")]
    decided = [(pool, decision, reason[:120]) for pool, decision, reason in placed if not reason.startswith("a probe")]
    print("placed after settling:", *[(pool, decision) for pool, decision, _ in decided], sep="\n  ")
    assert all(pool == "spare" and decision == "speculate" for pool, decision, _ in decided), decided
    assert len(probes) <= 2, probes
    os.kill(pstack.info.pids["draft-spare-0"], signal.SIGKILL)
    # a dead pool's rounds run plain at once (no wait for a block) and cost what a plain step
    # costs, so S falls only as its first position's acceptance decays toward 0 (hyperbolically,
    # against the mass of the rounds before the kill): measured at 1.11 after 40 requests once
    for j in range(80):
        r = _gen((gen0, gen1)[j % 2], prompts[j % len(prompts)], cls)
        assert len(r.token_ids) == 32  # a dead pool never fails a request
        d = _effective(admin0, cls).decision
        if d.draft_pool != "spare" or d.decision != "speculate":
            break
    print(f"two pools: on spare after {settled_after} requests ({history}); left it {j + 1} requests after "
          f"it degraded: {d.decision} on {d.draft_pool}, S by pool {dict(d.speedup_by_pool)}")
    # it stops speculating on `spare`: plain (or re-measuring `poor` if its statistics decayed)
    assert d.decision in ("plain", "learn") and d.speedup_by_pool["spare"] < 1.1, d.reason
    assert d.speedup_by_pool["poor"] < 1.1


def _sweep_rate(responses) -> float:
    """Tokens per second at a pinned K: per request, the tokens its rounds emitted over the
    time they took (every round: one whose block came late or was used at an offset verifies
    fewer drafts, and that is part of running at K), then the median over the requests,
    because a 2-core CI machine stalls now and then (CPU steal) and one stall would otherwise
    decide the sweep. Not the rounds that verified exactly K alone: those are the lucky ones
    (at K = 5 they emitted 5.25 tokens on average against 3.6 over all rounds), and picking
    them made K = 5 look 35 % faster than the requests ran."""
    rates = []
    for resp in responses:
        spent_ms = sum(r.draft_ms + r.verify_ms + r.overhead_ms for r in resp.stats.round)
        rates.append(sum(r.emitted for r in resp.stats.round) / (spent_ms / 1e3))
    return statistics.median(rates)


def test_adaptive_k_settles_within_one_step_of_the_sweeps_best(routers, extraction_prompts):
    # extraction: where the demo draft's acceptance makes K matter (on code its first draft
    # is accepted 20-40 % of the time, S sits at 1 and the controller rightly runs plain)
    prompts = extraction_prompts
    (gen0, admin0), (gen1, _) = routers
    # the sweep: each K pinned, under a class of its own; the K values interleaved (a slow
    # spell of the machine then hits all of them alike), every prompt twice per K
    sweep_cls = _cls("sweep")
    _set(admin0, sweep_cls, k=1)
    ks = list(range(1, 7))
    responses: dict[int, list] = {k: [] for k in ks}
    for rep in range(2):
        for i, prompt in enumerate(prompts):
            order = ks[(i + rep) % len(ks):] + ks[:(i + rep) % len(ks)]
            for k in order:
                responses[k].append(_gen(gen0, prompt, sweep_cls, num_draft_tokens=k))
    measured = {k: _sweep_rate(responses[k]) for k in ks}
    # each K against its neighbours (a 3-point median): under the suite's load one K's cell
    # came out 11-18 % above both neighbours while the rest of the top was flat (K = 2..6 at
    # 37.2, 37.1, 41.3, 36.5, 36.4 tok/s; K = 3..5 at 57.5, 67.7, 54.6), so the best was that K
    # alone and the engine's K = 2 two steps from it. The engine's own K was 2 in 94 of its
    # 114 rounds there, no probes: it chose K on the flat top, which one noisy cell hid
    rate = {k: statistics.median([measured[j] for j in (k - 1, k, k + 1) if j in measured]) for k in ks}
    top = max(rate.values())
    # K values within 8 % of the best are ties: the curve is flat near its top (E(K) saturates
    # while T(K) grows). Two calm sweeps on a 2-core AVX-512 machine differed by up to 4 % at
    # one K; on a 2-core AVX2 one a sweep ran K = 1, 2, 3 at 52.0, 51.4, 54.8 tok/s (not even
    # in order), and with a 5 % band K = 1 (0.949 of the top) was not a tie
    best = {k for k, v in rate.items() if v >= 0.92 * top}
    # adaptive K under a fresh class: the controller decides to speculate, and the engine
    # picks each round's K in [k_min, k_max] from its measured step cost (ADR 0014)
    cls = _cls("adaptive")
    _set(admin0, cls, adaptive_k=True, k_min=1, k_max=6, safety_margin=0.0, probe_fraction=0.1)
    ks_of: list[list[int]] = []
    probes = held = 0  # in the last 10 requests: rounds that probed, and rounds held plain
    for i in range(36):
        r = _gen((gen0, gen1)[i % 2], prompts[i % len(prompts)], cls)
        # the engine's choices: a probe's K (held plain, it asks for 2 to keep learning) is not one
        ks_of.append([x.k for x in r.stats.round if x.k > 0 and not x.probe] if r.stats.draft_pool else [])
        if i >= 26:
            probes += sum(x.probe for x in r.stats.round)
            held += sum(x.fallback_reason == "speculation_not_paying" for x in r.stats.round)
    d = _effective(admin0, cls).decision
    settled = [k for ks in ks_of[-10:] for k in ks]  # the engine's Ks in the last 10 requests
    engine_k = collections.Counter(settled).most_common(1)[0][0] if settled else 0
    print(f"sweep tokens/s { {k: round(v, 1) for k, v in measured.items()} }, each against its neighbours "
          f"{ {k: round(v, 1) for k, v in rate.items()} }; best K {sorted(best)}; "
          f"controller: {d.decision}: {d.reason}; the engine's Ks in the last 10 requests "
          f"{dict(sorted(collections.Counter(settled).items()))}, probes {probes}, held plain {held}")
    assert d.decision == "speculate", d.reason

    def near(k: int) -> bool:
        """Within one of the sweep's best, or a K whose own sweep rate is within 15 % of the
        top. Under the suite's load the engine's K sat a step below the best in three full runs
        of sessions 19 and 20, where that K's rate was about 0.90 of the top. A choice that
        costs more than 15 % of the throughput still fails (K = 1 at 28.9 against 41.3 tok/s
        would)."""
        return min(abs(k - b) for b in best) <= 1 or rate.get(k, 0.0) >= 0.85 * top

    # the K it runs most is near the sweep's best; a K the engine verifies fewer drafts of (a
    # block whose first drafts a plain round committed) counts as smaller
    assert near(engine_k), engine_k
    assert sum(near(k) for k in settled) >= 0.6 * len(settled)


# -- shadow mode ---------------------------------------------------------------------------
def _shadow_record(rdb, session_id: str, timeout_s: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        raw = rdb.hget(session_key(session_id), "shadow")
        if raw:
            return json.loads(raw)
        time.sleep(0.1)
    raise AssertionError("no shadow record")


def test_shadow_mode_serves_plain_output_and_records_agreement(routers, rdb, code_prompts):
    (gen0, admin0), _ = routers
    cls = _cls("shadow")
    _set(admin0, cls, mode=SHADOW, k=3)
    for prompt in code_prompts[:2]:
        shadowed = _gen(gen0, prompt, cls)
        plain = _gen(gen0, prompt, cls, draft_pool="none")
        assert shadowed.token_ids == plain.token_ids and shadowed.text == plain.text
        assert shadowed.stats.draft_pool == "" and shadowed.stats.draft_tokens == 0  # served plain
        rec = _shadow_record(rdb, shadowed.session_id)
        assert rec["outcome"] == "agree" and rec["greedy"] is True
        assert rec["shadow_tokens"] == rec["served_tokens"] == len(plain.token_ids)
        assert rec["drafted"] > 0 and 0 <= rec["accepted"] <= rec["drafted"]
        # each round emits accepted + 1 tokens, but an EOS may cut the last one short
        assert len(plain.token_ids) - rec["accepted"] <= rec["rounds"] <= len(plain.token_ids)
    # sampled: same seed, same served output; compared by acceptance statistics
    s = _gen(gen0, code_prompts[2], cls, temperature=0.8, seed=11)
    p = _gen(gen0, code_prompts[2], cls, temperature=0.8, seed=11, draft_pool="none")
    assert s.token_ids == p.token_ids
    rec = _shadow_record(rdb, s.session_id)
    assert rec["outcome"] == "sampled" and rec["drafted"] > 0
    summary = _effective(admin0, cls).shadow
    assert summary.requests == 3 and summary.agreed == 2 and summary.sampled == 1 and summary.disagreed == 0


# -- admin: auth, validation, CAS, audit -------------------------------------------------
def test_unauthenticated_and_unauthorised_changes_are_refused(routers):
    _, admin = routers[0]
    req = policy_pb2.SetPolicyRequest(policy=policy_pb2.Policy(workload_class="x", mode=OFF))
    with pytest.raises(grpc.RpcError) as e:
        admin.SetPolicy(req, timeout=10)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as e:
        admin.SetPolicy(req, metadata=[("authorization", "Bearer not-the-token")], timeout=10)
    assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
    with pytest.raises(grpc.RpcError) as e:
        admin.ListAudit(policy_pb2.ListAuditRequest(), metadata=[("authorization", "Basic abc")], timeout=10)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as e:
        admin.GetPolicy(policy_pb2.GetPolicyRequest(workload_class="x"), metadata=AUTH, timeout=10)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND  # nothing was written


@pytest.mark.parametrize("fields, needle", [
    (dict(k=0), "k must be"), (dict(draft_pool="huge"), "unknown draft_pool"), (dict(mode=0), "mode"),
    (dict(adaptive_k=True, k_min=4, k_max=2), "adaptive"), (dict(probe_fraction=0.9), "probe_fraction"),
    (dict(safety_margin=float("nan")), "finite"), (dict(workload_class="Bad Name"), "class name"),
    (dict(mode=policy_pb2.POLICY_MODE_SLICE), "slice_percent"), (dict(slice_percent=5.0), "mode slice only"),
])
def test_invalid_policies_are_refused(routers, fields, needle):
    _, admin = routers[0]
    with pytest.raises(grpc.RpcError) as e:
        _set(admin, "valid", **fields)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and needle in e.value.details()


def test_compare_and_set_and_the_audit_log(routers):
    _, admin = routers[0]
    _, admin1 = routers[1]
    cls = _cls("audit")
    v1 = admin.SetPolicy(policy_pb2.SetPolicyRequest(policy=policy_pb2.Policy(
        workload_class=cls, mode=ENABLED, draft_pool="small", k=4), expected_version=0, comment="create"),
        metadata=AUTH, timeout=10)
    assert v1.version == 1 and v1.updated_by == "ops"
    with pytest.raises(grpc.RpcError) as e:  # must not exist yet
        admin.SetPolicy(policy_pb2.SetPolicyRequest(policy=v1, expected_version=0), metadata=AUTH, timeout=10)
    assert e.value.code() == grpc.StatusCode.ABORTED
    v2 = admin1.SetPolicy(policy_pb2.SetPolicyRequest(policy=policy_pb2.Policy(
        workload_class=cls, mode=OFF, draft_pool="small", k=4), expected_version=1), metadata=AUTH, timeout=10)
    with pytest.raises(grpc.RpcError) as e:  # a stale writer loses
        admin.SetPolicy(policy_pb2.SetPolicyRequest(policy=v1, expected_version=1), metadata=AUTH, timeout=10)
    assert e.value.code() == grpc.StatusCode.ABORTED and "version 2" in e.value.details()
    assert admin.DeletePolicy(policy_pb2.DeletePolicyRequest(workload_class=cls, expected_version=v2.version),
                              metadata=AUTH, timeout=10).deleted
    entries = admin.ListAudit(policy_pb2.ListAuditRequest(workload_class=cls), metadata=AUTH, timeout=10).entries
    assert [e.action for e in entries] == ["delete", "set", "set"]  # newest first; refused writes are absent
    delete, change, create = entries
    assert all(e.who == "ops" and e.peer and e.at > 0 for e in entries)
    assert not create.HasField("old") and create.new.version == 1 and create.comment == "create"
    assert change.old.mode == ENABLED and change.new.mode == OFF and change.new.version == 2
    assert delete.old.version == 2 and not delete.HasField("new")
    assert _effective(admin, cls).source in ("default", "builtin")


def test_policy_cli(pstack, tmp_path):
    import subprocess
    import sys

    cls = _cls("cli")
    env_run = [sys.executable, "-m", "specserve.tooling.cli", "policy"]
    common = ["--router", pstack.info.router]

    def cli(*args: str, token: str = TOKEN) -> subprocess.CompletedProcess:
        return subprocess.run([*env_run, *args, *common], capture_output=True, text=True, timeout=60,
                              env={**__import__("os").environ, "SPECSERVE_ADMIN_TOKEN": token})

    out = cli("set", cls, "--pool", "small", "--k", "adaptive", "--k-max", "5", "--comment", "via cli")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["adaptive_k"] is True
    assert cli("set", cls, "--margin", "0.3").returncode == 0
    got = json.loads(cli("get", cls).stdout)
    assert got["safety_margin"] == 0.3 and got["version"] == "2"
    assert cls in cli("list").stdout
    eff = json.loads(cli("get", cls, "--effective").stdout)
    assert eff["source"] == "class" and eff["decision"]["decision"]
    bad = cli("set", cls, "--k", "99")
    assert bad.returncode == 2 and "INVALID_ARGUMENT" in bad.stderr
    stale = cli("set", cls, "--k", "3", "--expected-version", "1")
    assert stale.returncode == 2 and "ABORTED" in stale.stderr
    denied = cli("list", token="wrong")
    assert denied.returncode == 2 and "PERMISSION_DENIED" in denied.stderr
    hist = cli("history", cls).stdout
    assert "safety_margin: 0.1 -> 0.3" in hist and "via cli" in hist
    # a rollout through its stages (ADR 0022): shadow, a 10 % slice, enabled; each in the audit log
    assert cli("set", cls, "--mode", "shadow", "--comment", "rollout").returncode == 0
    sliced = cli("set", cls, "--slice", "10", "--comment", "rollout")
    assert sliced.returncode == 0, sliced.stderr
    got = json.loads(cli("get", cls).stdout)
    assert got["mode"] == "POLICY_MODE_SLICE" and got["slice_percent"] == 10
    assert cli("set", cls, "--mode", "enabled", "--comment", "rollout").returncode == 0
    got = json.loads(cli("get", cls).stdout)
    assert got["mode"] == "POLICY_MODE_ENABLED" and not got.get("slice_percent")
    bad_slice = cli("set", cls, "--slice", "150")
    assert bad_slice.returncode == 2 and "slice_percent" in bad_slice.stderr
    hist = cli("history", cls).stdout
    assert "POLICY_MODE_SHADOW -> POLICY_MODE_SLICE" in hist and "POLICY_MODE_SLICE -> POLICY_MODE_ENABLED" in hist
    # a class's draft priority (ADR 0021): what a saturated draft replica keeps first
    assert cli("set", cls, "--draft-priority", "3", "--guard-accepted", "0.5", "--guard-speedup", "0.9").returncode == 0
    got = json.loads(cli("get", cls).stdout)
    assert (got["draft_priority"], got["guard_min_accepted"], got["guard_min_speedup"]) == (3, 0.5, 0.9)
    assert cli("set", cls, "--draft-priority", "12").returncode == 2  # 0-9
    # a class's suffix index (ADR 0026): its bounds and drafting floor; what is not set keeps its default
    assert cli("set", cls, "--suffix", "max_requests=64", "--suffix", "min_prob=0.25").returncode == 0
    got = json.loads(cli("get", cls).stdout)
    assert (got["suffix_max_requests"], got["suffix_min_prob"], got["suffix_max_tokens"]) == (64, 0.25, 65536)
    bad_suffix = cli("set", cls, "--suffix", "min_prob=2")
    assert bad_suffix.returncode == 2 and "suffix_min_prob" in bad_suffix.stderr
    assert cli("set", cls, "--suffix", "depth=3").returncode == 2  # an unknown key: refused by the CLI
    assert cli("delete", cls).stdout.strip() == "deleted"


def test_classification_is_counted_in_the_router_metrics(routers, pstack):
    gen, _ = routers[0]
    resp = gen.Generate(generation_pb2.GenerateRequest(
        prompt='Extract the name and the date as JSON: "Ada met Alan on 3 May."', max_tokens=4), timeout=60)
    assert resp.stats.workload_class == "extraction"
    import urllib.request

    metrics = urllib.request.urlopen(f"http://{pstack.info.metrics['router']}/metrics", timeout=10).read().decode()
    assert 'specserve_classified_requests_total{reason="rules",workload_class="extraction"}' in metrics
    assert "specserve_controller_decisions_total" in metrics


def test_requests_keep_flowing_while_policies_churn(routers, code_prompts):
    """Many changes while requests run on both replicas: nothing fails."""
    (gen0, admin0), (gen1, _) = routers
    cls = _cls("churn")
    _set(admin0, cls)
    errors: list[Exception] = []
    done = threading.Event()

    def churn() -> None:
        modes = [ENABLED, OFF, SHADOW]
        i = 0
        while not done.is_set():
            try:
                _set(admin0, cls, mode=modes[i % 3], k=1 + i % 4)
            except Exception as exc:
                errors.append(exc)
            i += 1
            time.sleep(0.05)

    t = threading.Thread(target=churn)
    t.start()
    try:
        lens = [len(_gen((gen0, gen1)[i % 2], code_prompts[i % 4], cls, max_tokens=12).token_ids) for i in range(8)]
    finally:
        done.set()
        t.join()
    assert not errors and min(lens) > 0


# -- a class's default output (ADR 0017) --------------------------------------------------------
def test_a_class_can_default_to_json_object_output_and_a_request_can_opt_out(routers, extraction_prompts):
    pytest.importorskip("xgrammar")
    (gen0, admin0), (gen1, _) = routers
    cls = _cls("jsonout")
    _set(admin0, cls, output_format="json_object", k=4)
    prompt = extraction_prompts[0]
    # greedy: the same text whichever router and pool; the pair closes its record well within 96
    r = _gen(gen0, prompt, cls, max_tokens=96)
    assert r.finish_reason == "eos", r.text
    assert isinstance(json.loads(r.text), dict)
    assert _gen(gen1, prompt, cls, max_tokens=96, draft_pool="none").text == r.text
    # free text, asked for explicitly: the class's default does not apply; unconstrained, the
    # pair writes the record and runs on into another prompt
    free = _gen(gen0, prompt, cls, max_tokens=96, constraint=generation_pb2.Constraint(text=True))
    unclassed = _gen(gen0, prompt, _cls("free"), max_tokens=96)
    assert free.text == unclassed.text != r.text
    assert free.finish_reason == "length"
    with pytest.raises(grpc.RpcError) as err:
        _set(admin0, cls, output_format="xml")
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "output_format" in err.value.details()


def test_shadow_mode_under_a_constraint_serves_it_plain_and_keeps_its_statistics_apart(routers, rdb,
                                                                                      extraction_prompts):
    pytest.importorskip("xgrammar")
    (gen0, admin0), _ = routers
    cls = _cls("shadowjson")
    _set(admin0, cls, mode=SHADOW, k=3)
    constraint = generation_pb2.Constraint(json_object=True)
    shadowed = _gen(gen0, extraction_prompts[1], cls, max_tokens=96, constraint=constraint)
    plain = _gen(gen0, extraction_prompts[1], cls, max_tokens=96, constraint=constraint, draft_pool="none")
    assert shadowed.text == plain.text and shadowed.stats.draft_tokens == 0  # served plain, constrained
    assert isinstance(json.loads(shadowed.text), dict)
    rec = _shadow_record(rdb, shadowed.session_id)
    assert rec["outcome"] == "agree" and rec["drafted"] > 0  # the twin ran under the same constraint
    # constrained rounds are the class's `+json_object` statistics, not its free-text ones
    assert _effective(admin0, cls).shadow.requests == 0


# -- seeds (issue 53, ADR 0027) --------------------------------------------------------------
def test_a_seeded_request_gives_the_same_tokens_whatever_the_controller_chooses(routers, extraction_prompts):
    """The same seeded sampled request, naming no pool and no K, sent under the `default`
    policy five times while the policy is switched between the sends, so that the controller
    chooses another arm each time: the draft model at K = 4, the untrained draft at K = 2,
    plain, adaptive K on the spare pool and on the draft model. Every response has the same
    tokens (the coupled sampler: a seeded row's tokens are plain decoding's with its seed).
    Before ADR 0027 the drafts changed the sample path and the responses differed from the
    first round that judged a draft (issue 53: 3 of 6 seeded requests under `specserve up`).
    The `default` policy is put back as it was at the end."""
    (gen, admin), _ = routers
    try:
        before = admin.GetPolicy(policy_pb2.GetPolicyRequest(workload_class="default"), metadata=AUTH, timeout=10)
    except grpc.RpcError as err:
        assert err.code() == grpc.StatusCode.NOT_FOUND
        before = None
    cls = _cls("nopolicy")  # a class with no policy of its own: under `default`
    arms = [dict(draft_pool="small", k=4), dict(draft_pool="poor", k=2), dict(mode=OFF, draft_pool=""),
            dict(draft_pool="spare", adaptive_k=True, k_min=1, k_max=6),
            dict(draft_pool="small", adaptive_k=True, k_min=1, k_max=8)]
    outs, pools, accepted = [], [], 0
    try:
        for fields in arms:
            stored = _set(admin, "default", **fields)
            t0 = time.monotonic()
            while _effective(admin, cls).policy.version != stored.version:
                assert time.monotonic() - t0 < 5.0, "the router did not take the new default policy"
                time.sleep(0.01)
            resp = _gen(gen, extraction_prompts[2], cls, max_tokens=40, temperature=1.0, seed=2027)
            outs.append(list(resp.token_ids))
            pools.append(resp.stats.draft_pool)
            accepted += resp.stats.accepted_tokens
            assert resp.stats.seed == 2027
    finally:
        if before is None:
            admin.DeletePolicy(policy_pb2.DeletePolicyRequest(workload_class="default"), metadata=AUTH, timeout=10)
        else:
            admin.SetPolicy(policy_pb2.SetPolicyRequest(policy=before), metadata=AUTH, timeout=10)
    assert len(set(pools)) >= 3, pools  # the controller's choice did change
    assert accepted > 0  # and drafts were kept: not plain against plain
    assert all(o == outs[0] for o in outs), [(p, o[:8]) for p, o in zip(pools, outs, strict=True)]
