"""Rollout guards (ADR 0022): a class in stage `slice` goes back to `shadow` when its slice's
speculation stops paying (S under the guard) or its drafts stop being accepted, and one at
`enabled` to a slice when its drafts stop being accepted or its speculating requests are slower
or fail more than its plain probes; never on too few rounds, never in shadow or off, never when
clean. And a class's draft priority, from its policy to the draft replica."""

from __future__ import annotations

from dataclasses import replace

import pytest

from specserve.control import guards
from specserve.control.arms import Choice, Decision, Fallback
from specserve.control.arms import assess as assess_class
from specserve.control.controller import estimate
from specserve.control.guards import PLAIN as GUARD_PLAIN
from specserve.control.guards import SPECULATING as GUARD_SLICE
from specserve.control.guards import ArmOutcomes, check_guards, check_outcomes, promotion_due
from specserve.control.policy import Policy
from specserve.errors import InvalidRequest

MIN_ROUNDS = 8
PLAIN = {"n:0": 50.0, "v:0": 50 * 10.0, "o:0": 50 * 2.0}  # a plain step costs 12 ms


def _stats(alpha: list[float], d: float, v: float, n: float = 100.0) -> dict[str, float]:
    s: dict[str, float] = {}
    for i, a in enumerate(alpha, start=1):
        s[f"pe:{i}"], s[f"pa:{i}"] = n, n * a
    s["n:4"], s["d:4"], s["v:4"], s["o:4"] = n, n * d, n * v, n * 2.0
    return s


GOOD = _stats([0.9, 0.8, 0.7, 0.6], 2.0, 12.0)  # S(4) = 2.57
POOR = _stats([0.1], 8.0, 14.0)  # S(4) = 1.11 x 12 / 24 = 0.56
SLICE = Policy("c", mode="slice", slice_percent=10.0, draft_pool="a", k=4, guard_min_speedup=1.0)


def _assess(policy: Policy, stats: dict[str, float], n: float = 100.0):
    return assess_class(policy, {"a": estimate(stats, PLAIN, 4)}, MIN_ROUNDS, ["a"])


def test_a_slice_whose_speculation_hurts_trips_its_speedup_guard():
    tripped = check_guards(SLICE, _assess(SLICE, POOR), MIN_ROUNDS)
    assert tripped is not None and tripped.guard == "speedup"
    assert "S=0.56" in tripped.reason and "below 1.00" in tripped.reason


def test_a_clean_slice_trips_nothing():
    assert check_guards(SLICE, _assess(SLICE, GOOD), MIN_ROUNDS) is None


def test_too_few_rounds_or_another_stage_trip_nothing():
    few = _stats([0.1], 8.0, 14.0, n=4.0)  # 4 rounds of the slice: not yet measured
    assert check_guards(SLICE, _assess(SLICE, few), MIN_ROUNDS) is None
    enabled = replace(SLICE, mode="enabled", slice_percent=0.0)
    assert check_guards(enabled, _assess(enabled, POOR), MIN_ROUNDS) is None  # the controller's own job there
    off = replace(SLICE, guard_min_speedup=0.0)
    assert check_guards(off, _assess(off, POOR), MIN_ROUNDS) is None  # the guard switched off


def test_the_acceptance_guard_trips_under_its_floor():
    floor = replace(SLICE, guard_min_speedup=0.0, guard_min_accepted=2.0)
    a = _assess(floor, GOOD)  # E(4) - 1 = 2.43 accepted a round
    assert a.decision is Decision.SPECULATE and check_guards(floor, a, MIN_ROUNDS) is None
    fair = _stats([0.6, 0.5, 0.4, 0.3], 2.0, 12.0)  # E(4) - 1 = 1.06
    tripped = check_guards(floor, _assess(floor, fair), MIN_ROUNDS)
    assert tripped is not None and tripped.guard == "acceptance" and "1.06" in tripped.reason


@pytest.mark.parametrize("fields, needle", [
    (dict(guard_min_speedup=-1.0), "guard_min_speedup"), (dict(guard_min_speedup=float("nan")), "guard_min_speedup"),
    (dict(guard_min_accepted=40.0), "guard_min_accepted"),
])
def test_guards_out_of_range_are_refused(fields, needle):
    with pytest.raises(InvalidRequest, match=needle):
        replace(SLICE, **fields).validate()


def test_a_clean_slice_is_promoted_once_its_window_has_run_and_only_if_its_policy_asks():
    promo = replace(SLICE, promote_after_s=600.0, updated_at=1000.0)
    clean = _assess(promo, GOOD)
    assert promotion_due(promo, clean, MIN_ROUNDS, now=1000.0 + 599) is None  # the window has not run
    why = promotion_due(promo, clean, MIN_ROUNDS, now=1000.0 + 601)
    assert why is not None and "clean for 601 s" in why and "S=2.57" in why
    assert promotion_due(promo, _assess(promo, POOR), MIN_ROUNDS, now=5000.0) is None  # a guard trips
    few = _stats([0.9, 0.8, 0.7, 0.6], 2.0, 12.0, n=4.0)
    assert promotion_due(promo, _assess(promo, few), MIN_ROUNDS, now=5000.0) is None  # not yet measured
    explicit = replace(promo, promote_after_s=0.0)
    assert promotion_due(explicit, clean, MIN_ROUNDS, now=5000.0) is None  # promotion is the operator's
    with pytest.raises(InvalidRequest, match="promote_after_s"):
        replace(promo, promote_after_s=-1.0).validate()



# -- the outcome guards: the slice's TPOT p90 and error rate against the class's plain requests

OUTCOMES = replace(SLICE, guard_min_speedup=0.0, guard_max_tpot_ratio=1.2, guard_max_error_rate=0.05)


def _window(slice_tpots: list[float | None], plain_tpots: list[float | None], slice_failed: int = 0,
            plain_failed: int = 0, now: float = 1000.0) -> tuple[object, object]:
    out = ArmOutcomes()
    for i, t in enumerate(slice_tpots):
        out.record("c", GUARD_SLICE, now - 1, t, failed=i < slice_failed)
    for i, t in enumerate(plain_tpots):
        out.record("c", GUARD_PLAIN, now - 1, t, failed=i < plain_failed)
    return out.window("c", GUARD_SLICE, now), out.window("c", GUARD_PLAIN, now)


def test_the_window_reads_a_p90_and_an_error_rate():
    slice_w, plain_w = _window([0.01 * i for i in range(1, 21)], [0.02] * 10, slice_failed=2)
    # 20 slice requests, 2 failed: the p90 of the 18 others' TPOT (0.03 .. 0.20) is the 17th
    assert (slice_w.requests, slice_w.error_rate) == (20, 0.1)
    assert slice_w.tpot_p90 == pytest.approx(0.19)
    assert (plain_w.requests, plain_w.tpot_p90, plain_w.error_rate) == (10, 0.02, 0.0)
    old = ArmOutcomes(window_s=60.0)
    old.record("c", GUARD_SLICE, 0.0, 0.5, failed=True)
    assert old.window("c", GUARD_SLICE, 100.0).requests == 0  # outside the window: forgotten


def test_a_slower_slice_trips_the_tpot_guard_a_faster_one_does_not():
    tripped = check_outcomes(OUTCOMES, *_window([0.030] * 12, [0.020] * 12))
    assert tripped is not None and tripped.guard == "tpot" and "1.50x" in tripped.reason
    assert check_outcomes(OUTCOMES, *_window([0.023] * 12, [0.020] * 12)) is None  # 1.15x: under 1.2
    assert check_outcomes(OUTCOMES, *_window([0.015] * 12, [0.020] * 12)) is None


def test_a_failing_slice_trips_the_error_guard():
    tripped = check_outcomes(OUTCOMES, *_window([0.02] * 20, [0.02] * 20, slice_failed=3, plain_failed=1))
    assert tripped is not None and tripped.guard == "errors"  # 15 % against 5 %: 10 points over
    assert check_outcomes(OUTCOMES, *_window([0.02] * 20, [0.02] * 20, slice_failed=2, plain_failed=1)) is None


def test_the_outcome_guards_wait_for_both_arms_and_stay_off_at_zero():
    assert check_outcomes(OUTCOMES, *_window([0.05] * 9, [0.02] * 20)) is None  # 9 slice requests
    assert check_outcomes(OUTCOMES, *_window([0.05] * 20, [0.02] * 9)) is None  # 9 plain ones
    off = replace(OUTCOMES, guard_max_tpot_ratio=0.0, guard_max_error_rate=0.0)
    assert check_outcomes(off, *_window([0.05] * 20, [0.02] * 20, slice_failed=20)) is None
    assert check_outcomes(replace(OUTCOMES, mode="shadow", slice_percent=0.0),
                          *_window([0.05] * 20, [0.02] * 20)) is None  # shadow serves plain: nothing to guard


@pytest.mark.parametrize(("fields", "needle"), [
    (dict(guard_max_tpot_ratio=0.5), "guard_max_tpot_ratio"),
    (dict(guard_max_error_rate=1.5), "guard_max_error_rate"),
])
def test_outcome_guards_out_of_range_are_refused(fields, needle):
    with pytest.raises(InvalidRequest, match=needle):
        replace(OUTCOMES, **fields).validate()


def test_the_outcome_guards_travel_through_the_admin_api():
    from specserve.services.router.admin import policy_from_pb, policy_to_pb

    back = policy_from_pb(policy_to_pb(OUTCOMES))
    assert (back.guard_max_tpot_ratio, back.guard_max_error_rate) == (1.2, 0.05)
    assert Policy.from_body(OUTCOMES.body()).guard_max_tpot_ratio == 1.2  # and through Redis


# -- the guards at stage enabled: back to a slice, not to shadow

ENABLED = replace(OUTCOMES, mode="enabled", slice_percent=0.0, guard_min_speedup=1.0, guard_min_accepted=2.0)


def test_an_enabled_class_keeps_its_acceptance_and_outcome_guards_but_not_the_speedup_one():
    """At enabled the controller itself runs a request plain where speculation stops paying at
    the load, so S under the guard is not a rollback there (a busy minute would demote the
    class); a draft whose acceptance fell, or speculating requests slower or failing more than
    the controller's plain probes, are."""
    poor = _assess(ENABLED, POOR)  # S 0.56 and 0.11 drafts accepted a round
    tripped = check_guards(ENABLED, poor, MIN_ROUNDS)
    assert tripped is not None and tripped.guard == "acceptance" and "(enabled)" in tripped.reason
    no_floor = replace(ENABLED, guard_min_accepted=0.0)
    assert check_guards(no_floor, _assess(no_floor, POOR), MIN_ROUNDS) is None  # speedup: not at enabled
    assert check_guards(ENABLED, _assess(ENABLED, GOOD), MIN_ROUNDS) is None  # 2.6 accepted: over the floor
    slower = check_outcomes(ENABLED, *_window([0.030] * 12, [0.020] * 12))
    assert slower is not None and slower.guard == "tpot" and "(enabled)" in slower.reason
    failing = check_outcomes(ENABLED, *_window([0.02] * 20, [0.02] * 20, slice_failed=3, plain_failed=1))
    assert failing is not None and failing.guard == "errors"
    assert check_outcomes(ENABLED, *_window([0.019] * 12, [0.020] * 12)) is None


def test_a_rollback_goes_back_one_stage():
    back = guards.rolled_back(ENABLED)
    assert (back.mode, back.slice_percent) == ("slice", guards.ENABLED_ROLLBACK_PERCENT)
    back.validate()  # a policy the store accepts
    shadow = guards.rolled_back(back)
    assert (shadow.mode, shadow.slice_percent) == ("shadow", 0.0)
    shadow.validate()


def test_a_stage_the_controller_just_wrote_settles_before_its_guards_judge_again():
    """After a rollback the statistics that tripped it are still there: judged at once, an
    enabled class would go on through its slice to shadow within a few requests. A stage the
    controller wrote waits one half-life of its statistics; an operator's is judged at once."""
    back = replace(guards.rolled_back(ENABLED), updated_by="controller", updated_at=1000.0)
    assert guards.settling(back, half_life_s=60.0, now=1030.0)
    assert not guards.settling(back, half_life_s=60.0, now=1061.0)
    assert not guards.settling(replace(back, updated_by="ops"), half_life_s=60.0, now=1001.0)


def test_the_arms_of_an_enabled_class_are_its_speculative_decisions_and_its_plain_probes():
    """Both drawn from the controller's SPECULATE decisions, so at the same load; its probes of
    another pool or K (which may not pay) and its plain decisions (a load where speculation
    does not pay) count in neither arm."""
    speculate = Choice("a", 4, False, Decision.SPECULATE, Fallback.NONE)
    assert guards.guard_arm(ENABLED, speculate) == GUARD_SLICE
    assert guards.guard_arm(ENABLED, replace(speculate, probe=True)) == ""
    plain_probe = Choice(None, 0, False, Decision.SPECULATE, Fallback.CONTROLLER_PROBE, probe=True)
    assert guards.guard_arm(ENABLED, plain_probe) == GUARD_PLAIN
    assert guards.guard_arm(ENABLED, Choice(None, 0, False, Decision.PLAIN, Fallback.CONTROLLER_PLAIN)) == ""
    outside = Choice(None, 0, False, Decision.SLICE, Fallback.ROLLOUT)
    assert guards.guard_arm(SLICE, outside) == GUARD_PLAIN and guards.guard_arm(SLICE, speculate) == GUARD_SLICE
    assert guards.guard_arm(replace(SLICE, mode="shadow", slice_percent=0.0), speculate) == ""


# -- a class's draft priority (ADR 0021): from the policy to the draft replica's open


def test_a_draft_priority_travels_from_the_policy_to_the_draft_replicas_open():
    """Policy (validated, admin API, Redis body) -> the session's stored plan -> the engine's
    plan -> the LinkOpen a target sends its draft replica, which sheds the lowest first."""
    import asyncio

    from specserve.engine.remote_drafts import RemoteDrafts
    from specserve.engine.session import EnginePlan
    from specserve.params import GenerationParams
    from specserve.services.router.admin import policy_from_pb, policy_to_pb
    from specserve.services.router.plan import SessionPlan
    from specserve.serving.wire import sampling_to_proto

    vip = replace(SLICE, draft_priority=7)
    assert policy_from_pb(policy_to_pb(vip)).draft_priority == 7
    assert Policy.from_body(vip.body()).draft_priority == 7
    for bad in (10, -1):
        with pytest.raises(InvalidRequest, match="draft_priority"):
            replace(vip, draft_priority=bad).validate()
    choice = Choice("a", 4, False, Decision.SPECULATE, Fallback.NONE)
    plan = SessionPlan(GenerationParams(max_tokens=8, seed=1), "c", "explicit", "c", choice, draft_priority=7)
    stored = plan.encode()
    assert SessionPlan.decode(stored).draft_priority == 7
    assert EnginePlan.from_stored(stored).draft_priority == 7
    assert "draft_priority" not in replace(plan, draft_priority=0).encode()  # older readers see nothing new

    async def opened():
        drafts = RemoteDrafts(["replica-0"], asyncio.get_running_loop(), vocab_size=64)  # never dialled
        drafts.replicas[0].up = True
        drafts._open("s", [1, 2, 3], sampling_to_proto(plan.params.sampling), 1, 4, ("", "", 0), 7)
        return drafts.replicas[0].queue.get_nowait()

    assert asyncio.run(opened()).open.draft_priority == 7


def test_the_windows_measure_one_version_of_the_policy():
    """A stage change is a new policy version: a request of the new version starts the
    windows again, one planned under the old version is not counted, and the windows read
    for another version are empty."""
    out = ArmOutcomes()
    for _ in range(12):
        out.record("c", GUARD_SLICE, 999.0, 0.05, False, version=3)
    assert out.window("c", GUARD_SLICE, 1000.0, version=3).requests == 12
    assert out.window("c", GUARD_SLICE, 1000.0, version=4).requests == 0
    out.record("c", GUARD_SLICE, 999.0, 0.02, False, version=4)  # the new stage's first request
    assert out.window("c", GUARD_SLICE, 1000.0, version=4).requests == 1
    out.record("c", GUARD_SLICE, 999.0, 0.05, False, version=3)  # an old request ending late
    assert out.window("c", GUARD_SLICE, 1000.0, version=4).requests == 1
