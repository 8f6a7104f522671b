"""The controller's model and choices, without Redis: the statistics a batch writes, the
expected speedup S(K), decisions at the thresholds and the probe arms."""

from __future__ import annotations

import random

import pytest

from specserve.control.arms import RequestFacts, assess, choose_arm, request_reason
from specserve.control.controller import Batch, Estimate, estimate
from specserve.control.policy import Policy
from specserve.errors import InvalidRequest


def _stats(alpha: list[float], rounds: dict[int, tuple[float, float, float]], n: float = 100.0) -> dict[str, float]:
    """Stats hash as a router would write it: per-position rates alpha, per-K times."""
    s: dict[str, float] = {}
    for i, a in enumerate(alpha, start=1):
        s[f"pe:{i}"] = n
        s[f"pa:{i}"] = n * a
    for k, (d, v, o) in rounds.items():
        s[f"n:{k}"], s[f"d:{k}"], s[f"v:{k}"], s[f"o:{k}"] = n, n * d, n * v, n * o
    return s


PLAIN = {"n:0": 50.0, "v:0": 50 * 10.0, "o:0": 50 * 2.0}  # a plain step costs 12 ms


def test_batch_counts_evaluated_and_accepted_positions():
    b = Batch()
    b.add_round(k=4, accepted=2, draft_ms=3, verify_ms=10, other_ms=1)  # positions 1,2 accepted, 3 rejected
    b.add_round(k=2, accepted=2, draft_ms=2, verify_ms=9, other_ms=1)  # all accepted: no position 3
    assert b.inc["pe:1"] == 2 and b.inc["pe:2"] == 2 and b.inc["pe:3"] == 1 and "pe:4" not in b.inc
    assert b.inc["pa:1"] == 2 and b.inc["pa:2"] == 2 and "pa:3" not in b.inc
    assert b.inc["n:4"] == 1 and b.inc["d:4"] == 3 and b.inc["v:2"] == 9


def test_estimate_matches_the_closed_form():
    spec = _stats([0.8, 0.5], {2: (2.0, 11.0, 2.0), 4: (4.0, 13.0, 2.0)})
    est = estimate(spec, PLAIN, k_max=4)
    # E(K) = 1 + a1 + a1 a2 + a1 a2 a2 ... (unseen positions take the last rate seen)
    assert est.emitted[2] == pytest.approx(1 + 0.8 + 0.4)
    assert est.emitted[4] == pytest.approx(1 + 0.8 + 0.4 + 0.2 + 0.1)
    # times are linear in K between the K values seen: T(3) = 3 + 12 + 2
    assert est.round_ms[3] == pytest.approx(17.0)
    assert est.speedup[2] == pytest.approx(2.2 * 12.0 / 15.0)
    assert est.plain_step_ms == pytest.approx(12.0)


def test_one_k_seen_scales_the_draft_cost_per_token():
    est = estimate(_stats([0.9], {4: (8.0, 14.0, 2.0)}), PLAIN, k_max=8)
    assert est.round_ms[8] == pytest.approx(16.0 + (10.0 + (14.0 - 10.0) * 2) + 2.0)


def test_without_plain_statistics_a_plain_step_is_priced_from_the_pools_rounds():
    """An adaptive class speculates on every request (the engine holds rounds plain at its own
    load), so its plain statistics decay; the pool's verify step plus overhead at its smallest
    K stands in for a plain step, flagged. With plain statistics, they are used."""
    spec = _stats([0.9], {2: (4.0, 12.0, 2.0), 4: (8.0, 14.0, 2.0)})
    est = estimate(spec, {}, k_max=4)
    assert est.plain_from_pool and est.plain_step_ms == pytest.approx(12.0 + 2.0)
    assert est.speedup[4] == pytest.approx(est.emitted[4] * 14.0 / 24.0)
    assert est.plain_rounds == 0.0  # the decision rules still see that no plain round was measured
    with_plain = estimate(spec, PLAIN, k_max=4)
    assert not with_plain.plain_from_pool and with_plain.plain_step_ms == pytest.approx(12.0)
    # nothing speculative either: no estimate at all
    assert estimate({}, {}, k_max=4).speedup == {}


def _waited(spec: dict[str, float], wait_ms: dict[int, float]) -> dict[str, float]:
    return {**spec, **{f"w:{k}": spec[f"n:{k}"] * w for k, w in wait_ms.items()}}


def test_where_the_sessions_waits_were_measured_they_replace_the_drafts_compute():
    """A block drafted ahead costs its session nothing; a late one costs its wait, which the
    engine measures (RoundStats.wait_ms). The replica's compute is not on the round's path
    then, and adding it would count the drafting twice."""
    spec = _stats([0.8], {4: (8.0, 14.0, 2.0)})
    assert estimate(spec, PLAIN, k_max=4).round_ms[4] == pytest.approx(24.0)  # no waits measured: d + v + o
    assert estimate(_waited(spec, {4: 6.0}), PLAIN, k_max=4).round_ms[4] == pytest.approx(22.0)  # v + o + w


def test_pools_measured_at_different_loads_rank_by_what_differs_between_them():
    """An adaptive class's pools, each priced against its own steps (Controller.estimates'
    plain_from_pools): `light` was measured at 1 stream (10 ms steps), `heavy` at 16 (40 ms
    steps), with the same acceptance and no waits; `late` at 16 too, its rows waiting 20 ms a
    round for blocks (a remote pool's). Against the class's plain step (12 ms, from 1 stream)
    `light` looks nearly 3x as fast as `heavy`; against their own steps they are equal, and `late`
    is below both. (On the real CPU the controller chose the replica's n-gram over the one
    inside the target, which 16-stream cells had measured last: ADR 0014, session 13.)"""
    light = _stats([0.7], {4: (0.1, 10.0, 1.0)})
    heavy = _stats([0.7], {4: (0.1, 40.0, 2.0)})
    late = _waited(heavy, {4: 20.0})
    shared = {p: estimate(s, PLAIN, 4).best(1, 4)[1] for p, s in (("light", light), ("heavy", heavy))}
    assert shared["light"] > 2.5 * shared["heavy"]
    own = {p: estimate(s, {}, 4).best(1, 4)[1] for p, s in (("light", light), ("heavy", heavy), ("late", late))}
    assert own["light"] == pytest.approx(own["heavy"], rel=0.05) and own["late"] < 0.8 * own["heavy"]


MIN_ROUNDS = 8


def _decide(policy: Policy, spec: dict, plain: dict = PLAIN):
    """The class's decision from its (class, pool) and plain statistics."""
    return assess(policy, {policy.draft_pool: estimate(spec, plain, policy.k_range[1])}, MIN_ROUNDS)


def _choose(policy: Policy, spec: dict, rng: random.Random, plain: dict = PLAIN):
    """One request's arm (a request that pins nothing)."""
    estimates = {policy.draft_pool: estimate(spec, plain, policy.k_range[1])}
    return choose_arm(RequestFacts(temperature=0.0, prompt_tokens=10), policy, {policy.draft_pool}, estimates, rng,
                      MIN_ROUNDS)[0]


def test_speculates_above_the_margin_and_not_below():
    good = _stats([0.9, 0.8, 0.7, 0.6], {4: (2.0, 12.0, 2.0)})
    bad = _stats([0.1], {4: (8.0, 14.0, 2.0)})
    policy = Policy("c", draft_pool="p", k=4, safety_margin=0.1)
    d = _decide(policy, good)
    assert d.decision == "speculate" and d.k == 4 and "S=" in d.reason
    d = _decide(policy, bad)
    assert d.decision == "plain" and d.estimate.speedup[4] < 1.1
    # the margin decides: the same statistics, a margin above S
    s = _decide(policy, good).estimate.speedup[4]
    assert _decide(Policy("c", draft_pool="p", k=4, safety_margin=s - 1 + 0.01), good).decision == "plain"


def test_too_few_rounds_means_learning():
    d = _decide(Policy("c", draft_pool="p"), _stats([0.9], {4: (2, 12, 2)}, n=3.0))
    assert d.decision == "learn"


def test_adaptive_k_picks_the_argmax():
    # cheap drafts, flat verify: with these rates the best K is where a_i drops
    spec = _stats([0.95, 0.9, 0.9, 0.2, 0.1], {1: (1.0, 10.0, 2.0), 6: (6.0, 10.5, 2.0)})
    policy = Policy("c", draft_pool="p", adaptive_k=True, k_min=1, k_max=8)
    d = _decide(policy, spec)
    best = max(range(1, 9), key=lambda k: d.estimate.speedup[k])
    assert d.decision == "speculate" and d.k == best == 3


def test_probe_fraction_is_respected():
    rng = random.Random(1)
    policy = Policy("c", draft_pool="p", k=4, probe_fraction=0.1)
    bad = _stats([0.1], {4: (8.0, 14.0, 2.0)})
    assert _decide(policy, bad).decision == "plain"
    choices = [_choose(policy, bad, rng) for _ in range(4000)]
    spec = sum(c.pool is not None for c in choices) / len(choices)
    # binomial(4000, 0.1): sd 0.0047; 5 sd either side
    assert 0.1 - 0.024 < spec < 0.1 + 0.024
    assert all(c.probe for c in choices if c.pool is not None)


def test_off_and_shadow_choices():
    rng = random.Random(0)
    assert _choose(Policy("c", mode="off", draft_pool="p"), {}, rng).pool is None
    shadow = Policy("c", mode="shadow", draft_pool="p", k=3)
    c = _choose(shadow, {}, rng)
    assert c.shadow and c.pool == "p" and c.k == 3


@pytest.mark.parametrize("bad, field", [
    (dict(mode="sometimes"), "mode"), (dict(k=0), "k must"), (dict(k=33), "k must"),
    (dict(adaptive_k=True, k_min=5, k_max=2), "adaptive"), (dict(safety_margin=-0.1), "safety_margin"),
    (dict(probe_fraction=0.9), "probe_fraction"), (dict(temperature_ceiling=-1.0), "temperature_ceiling"),
    (dict(draft_pool="huge"), "unknown draft_pool"), (dict(workload_class="Bad Class"), "class name"),
])
def test_invalid_policies_are_refused_with_the_field_named(bad, field):
    with pytest.raises(InvalidRequest, match=field):
        Policy(**{"workload_class": "c", "draft_pool": "small", **bad}).validate({"small"})


def test_policy_body_round_trips_and_ignores_server_fields():
    p = Policy("code", mode="shadow", draft_pool="small", adaptive_k=True, k_min=2, k_max=6, temperature_ceiling=0.7)
    back = Policy.from_body(p.body(), version=3, updated_by="ops")
    assert back == Policy(**{**p.__dict__, "version": 3, "updated_by": "ops"})
    with pytest.raises(InvalidRequest, match="unknown policy field"):
        Policy.from_dict({"workload_class": "x", "colour": "red"})


def test_estimate_best_breaks_ties_toward_small_k():
    assert Estimate(speedup={2: 1.5, 3: 1.5, 4: 1.2}).best(1, 8) == (2, 1.5)


def test_a_plain_class_comes_back_when_its_probes_improve():
    """Probes keep adding speculative rounds; with time decay the old, bad rounds fade and
    the decision returns to speculate (what the Lua script does on each flush)."""
    policy = Policy("c", draft_pool="p", k=4, safety_margin=0.1)
    bad = _stats([0.1], {4: (8.0, 14.0, 2.0)}, n=200.0)
    assert _decide(policy, bad).decision == "plain"
    good = _stats([0.95, 0.9, 0.9, 0.9], {4: (2.0, 12.0, 2.0)}, n=5.0)  # a few probes' worth per half-life
    state = dict(bad)
    decisions = []
    for _ in range(12):  # twelve half-lives of probing
        state = {k: v / 2 for k, v in state.items()}  # one half-life passes
        for f, v in good.items():
            state[f] = state.get(f, 0.0) + v
        decisions.append(_decide(policy, state).decision)
    assert decisions[0] == "plain" and decisions[-1] == "speculate"


def test_a_requests_reason_agrees_with_its_arm_probes_included():
    """The reason a request's stats carry (the demo's policy table shows it beside the arm):
    the class's reason names the arm it chose, and a probe says it is one and which arm it
    measured. Before, a plain probe under a `speculate` decision reported "S=... on p at K=4"
    beside the arm `plain`."""
    rng = random.Random(3)
    policy = Policy("c", draft_pool="p", k=4, k_min=2, k_max=6, adaptive_k=True, probe_fraction=0.4)
    good = _stats([0.9, 0.8, 0.7, 0.6], {4: (2.0, 12.0, 2.0)})
    estimates = {"p": estimate(good, PLAIN, policy.k_range[1])}
    kinds = set()
    for _ in range(300):
        c, a = choose_arm(RequestFacts(temperature=0.0, prompt_tokens=10), policy, {"p"}, estimates, rng, MIN_ROUNDS)
        assert a is not None and a.decision == "speculate"
        r = request_reason(c, a)
        if c.probe:
            ran = "plain decoding" if c.pool is None else f"p at K={c.k}"
            assert r.startswith(f"a probe of {ran},") and a.reason in r, (c, r)
            kinds.add("plain probe" if c.pool is None else "K probe")
        else:
            assert r == a.reason and f"on {c.pool} at K={c.k} " in r, (c, r)
            kinds.add("chosen")
    assert kinds == {"plain probe", "K probe", "chosen"}  # 300 draws at 0.4: every kind occurs


def test_below_the_smallest_k_seen_a_round_costs_between_a_plain_step_and_k0():
    """Measured at K = 4 and 8 only, a fitted line through them can run below a plain step at
    K = 1 (the demo priced ngram K = 1 rounds at 2 ms beside a 31 ms plain step: S = 17.4, and
    the class moved to K = 1). Below the smallest K seen, a component runs between its plain
    step value (K = 0) and its cost at that K."""
    spec = _stats([0.5], {4: (4.0, 20.0, 1.0), 8: (8.0, 40.0, 1.0)})  # verify 5 ms a token, intercept 0
    est = estimate(spec, PLAIN, k_max=8)
    assert est.round_ms[4] == pytest.approx(25.0) and est.round_ms[8] == pytest.approx(49.0)  # the fit, as seen
    # K = 1: draft 1, verify 10 + (20 - 10) / 4, overhead 2 + (1 - 2) / 4
    assert est.round_ms[1] == pytest.approx(1.0 + 12.5 + 1.75)
    assert est.round_ms[1] > est.plain_step_ms  # a round verifies at least what a plain step does
    assert est.speedup[1] <= est.emitted[1]


def test_a_round_measured_cheaper_than_a_stale_plain_step_never_makes_s_exceed_e():
    """A pool whose replica died runs its rounds plain (0 accepted, a plain step's cost), while
    the class's plain statistics were measured minutes earlier on a busier machine (43 ms
    against 35 ms now). The ratio of the two is drift, not speculation: S is bounded by E(K),
    so the class leaves the dead pool (integration: test_policies' two-pool test, which kept
    the class on its dead pool at S = 1.28 while the suite ran beside other work)."""
    spec = _stats([0.01, 1.0, 0.96, 0.68], {4: (0.5, 34.0, 1.0)})  # 35.5 ms a round: plain now
    stale_plain = {"n:0": 2.0, "v:0": 2 * 41.0, "o:0": 2 * 2.0}  # 43 ms a step, measured then
    est = estimate(spec, stale_plain, k_max=4)
    assert est.round_ms[4] < est.plain_step_ms  # as measured: cheaper than the stale plain step
    assert est.speedup[4] == pytest.approx(est.emitted[4]) and est.speedup[4] < 1.1
    # a pool measured at a real cost above the plain step is priced as before
    healthy = estimate(_stats([0.8], {4: (4.0, 40.0, 2.0)}), stale_plain, k_max=4)
    assert healthy.speedup[4] == pytest.approx(healthy.emitted[4] * 43.0 / 46.0)
