"""Rollout guards (ADR 0022): a class in stage `slice` goes back to `shadow` when its slice's
speculation stops paying (S under the guard) or its drafts stop being accepted; never on too
few rounds, never outside the slice stage, never when clean."""

from __future__ import annotations

from dataclasses import replace

import pytest

from specserve.control.arms import Decision
from specserve.control.arms import assess as assess_class
from specserve.control.controller import estimate
from specserve.control.guards import check_guards, promotion_due
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

