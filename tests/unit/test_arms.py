"""The arm choice as a table: every precedence rule of ADR 0006, one row each, then the
choice across several pools (learn all of them, settle on the best, move when it degrades)."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from specserve.control.arms import (
    NO_SPECULATION,
    Decision,
    Fallback,
    RequestFacts,
    assess,
    choose_arm,
)
from specserve.control.controller import Batch, Estimate, estimate
from specserve.control.policy import Policy
from specserve.errors import InvalidRequest

MIN_ROUNDS = 8
PLAIN = {"n:0": 50.0, "v:0": 50 * 10.0, "o:0": 50 * 2.0}  # a plain step costs 12 ms


def stats(alpha: list[float], rounds: dict[int, tuple[float, float, float]], n: float = 100.0) -> dict[str, float]:
    s: dict[str, float] = {}
    for i, a in enumerate(alpha, start=1):
        s[f"pe:{i}"], s[f"pa:{i}"] = n, n * a
    for k, (d, v, o) in rounds.items():
        s[f"n:{k}"], s[f"d:{k}"], s[f"v:{k}"], s[f"o:{k}"] = n, n * d, n * v, n * o
    return s


# E(4) = 1 + .9 + .72 + .504 + .3024; S(4) = 3.43 * 12 / 16 = 2.57
GOOD = stats([0.9, 0.8, 0.7, 0.6], {4: (2.0, 12.0, 2.0)})
# E(4) = 1 + .6 + .3 + .12 + .036; S(4) = 2.06 * 12 / 16 = 1.54
FAIR = stats([0.6, 0.5, 0.4, 0.3], {4: (2.0, 12.0, 2.0)})
POOR = stats([0.1], {4: (8.0, 14.0, 2.0)})  # S(4) = 1.11 * 12 / 24 < 1


def est(spec: dict, k_max: int = 4) -> Estimate:
    return estimate(spec, PLAIN, k_max)


FACTS = RequestFacts(temperature=0.0, prompt_tokens=10)
P = Policy("c", draft_pool="a", k=4, safety_margin=0.1, probe_fraction=0.0)


@pytest.mark.parametrize("facts, policy, here, estimates, expect", [
    # 1. the request opts out (draft_pool "none", or K = 0): before everything else, even policy off
    (RequestFacts(0.0, 10, pinned_pool=NO_SPECULATION), Policy("c", mode="off", draft_pool="a"), {"a"}, {},
     (Decision.PINNED, Fallback.SPECULATION_OFF, None, False)),
    (RequestFacts(0.0, 10, pinned_k=0), P, {"a"}, {"a": est(GOOD)},
     (Decision.PINNED, Fallback.SPECULATION_OFF, None, False)),
    # 2. policy off beats the ceilings and a pinned pool
    (RequestFacts(5.0, 10, pinned_pool="a"), Policy("c", mode="off", draft_pool="a", temperature_ceiling=0.5), {"a"},
     {}, (Decision.OFF, Fallback.POLICY_OFF, None, False)),
    # 3. temperature ceiling, then prompt limit: plain even when speculation pays
    (RequestFacts(0.9, 10), Policy("c", draft_pool="a", temperature_ceiling=0.5), {"a"}, {"a": est(GOOD)},
     (Decision.PLAIN, Fallback.TEMPERATURE, None, False)),
    (RequestFacts(0.0, 500), Policy("c", draft_pool="a", max_prompt_tokens=100), {"a"}, {"a": est(GOOD)},
     (Decision.PLAIN, Fallback.PROMPT, None, False)),
    # 4. no allowed pool on this router
    (FACTS, P, {"b"}, {}, (Decision.PLAIN, Fallback.POOL_UNKNOWN, None, False)),
    # 5. shadow beats a pinned K: the served run is plain, the shadow run speculates
    (RequestFacts(0.0, 10, pinned_k=3), Policy("c", mode="shadow", draft_pool="a"), {"a"}, {},
     (Decision.SHADOW, Fallback.SHADOW, "a", True)),
    (FACTS, Policy("c", mode="shadow", draft_pool="a", k=3), {"a"}, {}, (Decision.SHADOW, Fallback.SHADOW, "a", True)),
    # 6. a pinned pool or K beats the controller, even one that says plain
    (RequestFacts(0.0, 10, pinned_pool="a"), P, {"a"}, {"a": est(POOR)}, (Decision.PINNED, Fallback.NONE, "a", False)),
    (RequestFacts(0.0, 10, pinned_k=2), P, {"a"}, {"a": est(POOR)}, (Decision.PINNED, Fallback.NONE, "a", False)),
    # 7. the controller: speculate when S pays, plain when it does not, learn without statistics
    (FACTS, P, {"a"}, {"a": est(GOOD)}, (Decision.SPECULATE, Fallback.NONE, "a", False)),
    (FACTS, P, {"a"}, {"a": est(POOR)}, (Decision.PLAIN, Fallback.CONTROLLER_PLAIN, None, False)),
])
def test_precedence(facts, policy, here, estimates, expect):
    choice, _ = choose_arm(facts, policy, here, estimates, random.Random(0), MIN_ROUNDS)
    assert (choice.decision, choice.reason, choice.pool, choice.shadow) == expect


def test_a_pinned_k_is_used_as_given_and_a_pinned_pool_takes_the_controllers_k():
    adaptive = Policy("c", draft_pool="a", adaptive_k=True, k_min=1, k_max=6, probe_fraction=0.0)
    c, _ = choose_arm(RequestFacts(0.0, 10, pinned_k=5), adaptive, {"a"}, {"a": est(GOOD, 6)}, random.Random(0), 8)
    assert c.k == 5
    c, a = choose_arm(RequestFacts(0.0, 10, pinned_pool="a"), adaptive, {"a"}, {"a": est(GOOD, 6)}, random.Random(0), 8)
    assert a is not None and c.k == a.k


def test_learning_ends_on_the_best_of_two_pools():
    policy = Policy("c", draft_pool="a", draft_pools=("b",), k=4, probe_fraction=0.0)
    a = assess(policy, {"a": est(FAIR), "b": est(GOOD)}, MIN_ROUNDS)
    assert (a.decision, a.pool, a.k) == (Decision.SPECULATE, "b", 4) and "a S=1.54" in a.reason
    # a pool without statistics does not block a decision on the measured one; it is explored
    a = assess(policy, {"a": Estimate(), "b": est(GOOD)}, MIN_ROUNDS)
    assert (a.decision, a.pool) == (Decision.SPECULATE, "b") and "exploring a" in a.reason
    # nothing measured yet: learn, the preferred pool first
    a = assess(policy, {"a": Estimate(), "b": Estimate()}, MIN_ROUNDS)
    assert (a.decision, a.pool) == (Decision.LEARN, "a")


def test_a_pool_without_statistics_gets_half_the_requests_until_it_has_them():
    policy = Policy("c", draft_pool="a", draft_pools=("b",), k=4, probe_fraction=0.0)
    rng = random.Random(5)
    picks = [choose_arm(FACTS, policy, {"a", "b"}, {"a": Estimate(plain_rounds=50.0), "b": est(GOOD)}, rng,
                        MIN_ROUNDS)[0] for _ in range(2000)]
    explored = sum(c.pool == "a" for c in picks) / len(picks)
    # binomial(2000, 0.5): sd 0.011; 5 sd bounds. The rest runs the decided arm, `b`.
    assert abs(explored - 0.5) < 0.056 and all(c.probe for c in picks if c.pool == "a")
    assert {c.pool for c in picks} == {"a", "b"}
    # learning (nothing measured): plain and every pool without statistics, uniformly
    picks = [choose_arm(FACTS, policy, {"a", "b"}, {"a": Estimate(), "b": Estimate()}, rng, MIN_ROUNDS)[0].pool
             for _ in range(300)]
    assert set(picks) == {None, "a", "b"}


def test_probes_reach_every_allowed_pool_and_plain():
    policy = Policy("c", draft_pool="a", draft_pools=("b",), k=4, probe_fraction=0.3)
    rng = random.Random(3)
    arms = [choose_arm(FACTS, policy, {"a", "b"}, {"a": est(GOOD), "b": est(FAIR)}, rng, MIN_ROUNDS)[0]
            for _ in range(3000)]
    on_a = sum(c.pool == "a" and not c.probe for c in arms) / len(arms)
    probe_b = sum(c.pool == "b" and c.probe for c in arms) / len(arms)
    probe_plain = sum(c.pool is None and c.probe for c in arms) / len(arms)
    # 70 % decided arm; the 30 % of probes split between plain and the other pool (binomial
    # sd at n=3000 is at most 0.009: 5 sd bounds)
    assert abs(on_a - 0.7) < 0.045 and abs(probe_b - 0.15) < 0.045 and abs(probe_plain - 0.15) < 0.045


def _feed(stats_by_pool: dict[str, Batch], pool: str | None, alpha: list[float], rounds: int, k: int,
          draft_ms: float, rng: random.Random) -> None:
    """Rounds of one request into the statistics, accepted positions drawn from alpha."""
    for _ in range(rounds):
        accepted = 0
        if pool is not None:
            while accepted < k and rng.random() < alpha[min(accepted, len(alpha) - 1)]:
                accepted += 1
        stats_by_pool.setdefault(pool or "none", Batch()).add_round(
            k if pool else 0, accepted, draft_ms if pool else 0.0, 12.0 if pool else 10.0, 2.0)


def _decayed(batch: Batch, f: float) -> dict[str, float]:
    return {k: v * f for k, v in batch.inc.items()}


def test_a_class_moves_to_the_pool_that_pays_and_again_when_it_degrades():
    """A simulated class with three pools: `poor` accepts 0.1 per position, `fair` 0.5 and
    `good` 0.85. Requests follow choose_arm; each runs 16 rounds into the statistics, decayed
    by 0.97 per request (a half-life of ~23 requests, as the Redis script decays over time).
    The class settles on `good` within a bounded number of requests; when `good` degrades
    (0.05 acceptance, 3x its draft cost) it moves to `fair`, not to plain."""
    policy = Policy("c", draft_pool="poor", draft_pools=("fair", "good"), k=4, safety_margin=0.1,
                    probe_fraction=0.2)
    pools = ("poor", "fair", "good")
    alphas = {"good": [0.85], "fair": [0.5], "poor": [0.1]}
    draft_ms = {"good": 2.0, "fair": 2.0, "poor": 2.0}
    rng, sim = random.Random(7), random.Random(11)
    batches: dict[str, Batch] = {}
    history: list[str] = []

    def request() -> None:
        plain = _decayed(batches.get("none", Batch()), 1.0)
        ests = {p: estimate(_decayed(batches.get(p, Batch()), 1.0), plain, 4) for p in pools}
        choice, _ = choose_arm(FACTS, policy, set(pools), ests, rng, MIN_ROUNDS)
        history.append(choice.pool or "plain")
        pool = choice.pool or ""
        _feed(batches, choice.pool, alphas.get(pool, [0.0]), 16, choice.k, draft_ms.get(pool, 0.0), sim)
        for b in batches.values():
            for f in b.inc:
                b.inc[f] *= 0.97

    for _ in range(60):
        request()
    # Learning needs ~8 rounds (one request) per arm. Once decided, 80 % of requests take the
    # decided pool and the 20 % probes split between plain and the other pools: 16 of 20
    # expected; 12 is more than 2 sd (binomial sd 1.8) below.
    assert history.index("good") < 12 and history[40:60].count("good") >= 12, history
    alphas["good"], draft_ms["good"] = [0.05], 6.0  # `good` degrades
    for _ in range(100):
        request()
    after = history[60 + 80:]
    # the decayed good rounds fade within ~2-3 half-lives; the last 20 requests run `fair`
    # except for probes (16 expected), and `good` only as a probe (10 % of 20: 2 expected)
    assert after.count("fair") >= 12 and after.count("good") <= 6, history[60:]


def test_with_no_policy_stored_the_controller_may_move_a_class_to_any_pool_of_the_router():
    """The built-in `default` policy prefers the router's default pool and lets the
    controller move a class to the router's other pools: a class with no stored policy ends
    on the pool that pays. (It named the default pool alone: on the real CPU, where the
    `small` draft loses to plain and `ngram` wins, a class without a policy could choose
    only between `small` and plain: 0.62-0.69 of the n-gram arm at 1 stream in bench_peer,
    ADR 0014's session 10.)"""
    from specserve.config import RouterSettings
    from specserve.services.router.__main__ import builtin_policy

    settings = RouterSettings(draft_pools={"small": ["127.0.0.1:1"], "ngram": ["127.0.0.1:2"]}, default_pool="small")
    policy = builtin_policy(settings)
    assert policy.pools == ("small", "ngram") and policy.mode == "enabled"
    # the engine picks K at the load each round runs at, up to the router's default K
    assert policy.adaptive_k and policy.k_range == (1, settings.default_k)
    a = assess(policy, {"small": est(POOR), "ngram": est(GOOD)}, MIN_ROUNDS)
    assert (a.decision, a.pool) == (Decision.SPECULATE, "ngram")
    # no pool of that name on this router, or K = 0 by default: speculation is off
    assert builtin_policy(RouterSettings(draft_pools={"ngram": ["127.0.0.1:2"]}, default_pool="small")).mode == "off"


def test_an_adaptive_class_leaves_plain_to_the_engine_where_no_pool_pays_over_the_loads_measured():
    """The controller's statistics mix the loads a class ran at; whether speculation pays
    depends on the load (at 1 stream the n-gram pool ran at 1.95x plain on the real CPU, at 16
    at 0.80x, in one run: ADR 0014, session 12). A fixed-K class goes plain on them; an
    adaptive one speculates on its best pool and the engine, which measures the step cost at
    the load a round runs at, holds its rounds plain where no K pays."""
    fixed = Policy("c", draft_pool="a", draft_pools=("b",), k=4, probe_fraction=0.0)
    adaptive = replace(fixed, adaptive_k=True, k_min=1, k_max=4)
    estimates = {"a": est(POOR), "b": est(stats([0.3], {4: (4.0, 20.0, 2.0)}))}  # b: S < 1 at every K, above a
    assert assess(fixed, estimates, MIN_ROUNDS).decision is Decision.PLAIN
    a = assess(adaptive, estimates, MIN_ROUNDS)
    assert (a.decision, a.pool) == (Decision.SPECULATE, "b") and "the engine runs each round plain" in a.reason
    choice, _ = choose_arm(FACTS, adaptive, {"a", "b"}, estimates, random.Random(0), MIN_ROUNDS)
    assert (choice.decision, choice.pool, choice.probe) == (Decision.SPECULATE, "b", False)
    # speculation that pays is decided as before; policy off and the request's opt-out still win
    pays = assess(adaptive, {"a": est(GOOD)}, MIN_ROUNDS)
    assert pays.decision is Decision.SPECULATE and ">=" in pays.reason and "the engine runs" not in pays.reason
    assert choose_arm(FACTS, replace(adaptive, mode="off"), {"a", "b"}, estimates, random.Random(0),
                      MIN_ROUNDS)[0].pool is None


def test_a_seeded_sampled_request_gets_the_arm_an_unseeded_one_gets():
    """A seed fixes the tokens whatever the arm (the coupled sampler, ADR 0027), so the arm of
    a seeded request follows the statistics as any other's. (Before, its K was held at the
    policy's, which fixed K but not the pool: the same seeded request still changed its tokens
    when the controller moved it to another pool, issue 53.)"""
    adaptive = Policy("c", draft_pool="a", k=4, adaptive_k=True, k_min=1, k_max=6, probe_fraction=0.0)
    k1_best = stats([0.3], {1: (0.5, 12.5, 2.0), 4: (2.0, 20.0, 2.0)})  # K = 1 pays, K = 4 does not
    seeded = RequestFacts(0.8, 10, pinned_pool="a", seeded=True)
    for facts in (seeded, replace(seeded, pinned_pool=None)):  # the pool pinned, or the controller's
        for estimates, k in (({"a": est(GOOD, 6)}, None), ({"a": est(k1_best, 6)}, 1)):
            choice, _ = choose_arm(facts, adaptive, {"a"}, estimates, random.Random(0), MIN_ROUNDS)
            free, _ = choose_arm(replace(facts, seeded=False), adaptive, {"a"}, estimates, random.Random(0),
                                 MIN_ROUNDS)
            assert (choice.pool, choice.k) == (free.pool, free.k), (facts, choice, free)
            assert k is None or choice.k == k
    # a K the request names is still its own
    assert choose_arm(replace(seeded, pinned_k=2), adaptive, {"a"}, {"a": est(GOOD, 6)}, random.Random(0),
                      MIN_ROUNDS)[0].k == 2


def test_an_adaptive_class_chooses_its_pool_without_plain_statistics():
    """An adaptive class speculates on every request, so its plain statistics decay (half-life
    30 s) while it runs. It kept re-entering learning for want of them, and learning sent its
    requests at random to plain and to every pool: in a scratch run of the stack the
    controller ran 1 of its 5 requests at 1 stream plain and 1 on `small` after a fixed
    `ngram-local` arm (ADR 0014, session 13). Priced from the pools' own
    rounds, it decides on its best pool; a fixed-K class, which must weigh plain, still learns."""
    pools = dict(draft_pool="a", draft_pools=("b",), probe_fraction=0.0)
    adaptive = Policy("c", k=4, adaptive_k=True, k_min=1, k_max=4, **pools)
    fixed = Policy("c", k=4, **pools)
    no_plain = {"a": estimate(FAIR, {}, 4), "b": estimate(GOOD, {}, 4)}
    a = assess(adaptive, no_plain, MIN_ROUNDS)
    assert (a.decision, a.pool) == (Decision.SPECULATE, "b") and "priced from the pool's rounds" in a.reason
    assert assess(fixed, no_plain, MIN_ROUNDS).decision is Decision.LEARN
    rng = random.Random(1)
    picks = [choose_arm(FACTS, adaptive, {"a", "b"}, no_plain, rng, MIN_ROUNDS)[0] for _ in range(200)]
    assert {c.pool for c in picks} == {"b"}
    # still learning (no pool measured): an adaptive class tries its pools, never plain
    picks = [choose_arm(FACTS, adaptive, {"a", "b"}, {"a": Estimate(), "b": Estimate()}, rng, MIN_ROUNDS)[0].pool
             for _ in range(200)]
    assert set(picks) == {"a", "b"}


def test_a_pool_whose_statistics_decayed_is_probed_not_explored_by_half_the_requests():
    """A pool measured before and found slow, whose statistics have decayed below the
    estimate's weight, goes back to the probes (unready pools first); half the requests go
    only to a pool never measured."""
    policy = Policy("c", draft_pool="a", draft_pools=("b",), k=4, probe_fraction=0.1)
    decayed = estimate({f: v * 1e-3 for f, v in POOR.items()}, PLAIN, 4)  # 0.1 of a round left
    assert not decayed.speedup and decayed.seen > 0
    rng = random.Random(2)
    picks = [choose_arm(FACTS, policy, {"a", "b"}, {"a": decayed, "b": est(GOOD)}, rng, MIN_ROUNDS)[0]
             for _ in range(2000)]
    on_a = sum(c.pool == "a" for c in picks) / len(picks)
    # probes are 10 %, split between plain and the other pool: 5 % expected on `a` (binomial
    # sd 0.005 at n=2000); half the requests (0.5) is what a never-measured pool gets
    assert 0.02 < on_a < 0.08 and all(c.probe for c in picks if c.pool == "a")


def test_an_adaptive_class_weighs_the_rounds_the_engine_held_plain_on_each_pool():
    """The engine holds a session's rounds plain where its pool's blocks do not pay at the
    load (a slow draft: on the real CPU it held 1024 of `small`'s rounds and verified 139 in
    one 16-stream cell). The few it verified can look good; what the pool did for the class
    is mostly plain rounds. An adaptive class ranks pools by that (Estimate.realized); a
    fixed-K class, which runs its K on every round, by S."""
    slow = replace(est(GOOD), held=9 * est(GOOD).spec_rounds)  # S 2.57 on 10 % of its rounds: 1.16
    fair = est(FAIR)  # S 1.54, never held
    pools = dict(draft_pool="slow", draft_pools=("fair",), probe_fraction=0.0)
    adaptive = Policy("c", k=4, adaptive_k=True, k_min=1, k_max=4, **pools)
    assert slow.realized(1, 4) == pytest.approx(1 + (slow.best(1, 4)[1] - 1) * 0.1)
    a = assess(adaptive, {"slow": slow, "fair": fair}, MIN_ROUNDS)
    assert a.pool == "fair" and "held plain 90%" in a.reason
    assert assess(Policy("c", k=4, **pools), {"slow": slow, "fair": fair}, MIN_ROUNDS).pool == "slow"


def test_a_rollout_slice_holds_its_share_and_a_retried_request_keeps_its_arm():
    """Rollout stage `slice` at 10 % (ADR 0022): over 400 request ids the share that speculates
    is 10 % within 3.5 binomial standard deviations (sd = sqrt(400 x 0.1 x 0.9) = 6: 19..61);
    the same id gives the same arm on every retry, whatever the random draws; outside the
    slice the reason says so; another class's slice is another set of requests."""
    from specserve.control.arms import in_slice

    policy = replace(P, mode="slice", slice_percent=10.0).validate()
    arms = {}
    for i in range(400):
        facts = replace(FACTS, request_id=f"req-{i}")
        first, _ = choose_arm(facts, policy, {"a"}, {"a": est(GOOD)}, random.Random(i), MIN_ROUNDS)
        for retry in range(3):  # other routers, other random states
            again, _ = choose_arm(facts, policy, {"a"}, {"a": est(GOOD)}, random.Random(1000 + retry), MIN_ROUNDS)
            assert again.pool == first.pool
        arms[f"req-{i}"] = first
    speculating = sum(c.pool is not None for c in arms.values())
    assert 19 <= speculating <= 61, speculating
    outside = [c for c in arms.values() if c.pool is None]
    assert all(c.decision is Decision.SLICE and c.reason is Fallback.ROLLOUT for c in outside)
    other = replace(policy, workload_class="d")
    moved = sum(in_slice(other, rid, random.Random(0)) != (arms[rid].pool is not None) for rid in arms)
    assert moved > 20  # not the same requests for every class
    # the stage's bounds
    for bad in (0.0, 100.0, -5.0, float("nan")):
        with pytest.raises(InvalidRequest, match="slice_percent"):
            replace(P, mode="slice", slice_percent=bad).validate()
    with pytest.raises(InvalidRequest, match="mode slice only"):
        replace(P, slice_percent=10.0).validate()
