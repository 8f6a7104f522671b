"""The simulated device profiles' bound on speculation (bench/profiles.py, ADR 0014): what a
fixed K can gain over plain with the benchmark's synthetic pool, for any schedule, with
literal numbers from the profile's own figures."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("bench_profiles",
                                               Path(__file__).resolve().parents[2] / "bench" / "profiles.py")
profiles = sys.modules["bench_profiles"] = importlib.util.module_from_spec(_spec)  # (a dataclass looks its module up)
_spec.loader.exec_module(profiles)
H100 = profiles.PROFILES["h100"]


def test_the_h100_profile_bounds_speculation_below_one_and_a_half_at_alpha_0_7():
    """16 rows, 768 cached positions: T_0 = T_1 = 6.4 + 0.04 + 0.3 = 6.74 ms (the weights'
    floor), d = 2.72 ms. K = 1: E = 1.7, the ahead block (2 d = 5.44 ms) is in time with
    probability 0.49, so a round takes at least 6.74 + 0.51 x 2.72 = 8.13 ms: 1.7 x 6.74 / 8.13."""
    b = H100.speculation_bound(0.7, 1, 16, 768)
    assert b["any"] == pytest.approx(1.7 * 6.7399 / (6.7399 + 0.51 * 2.72), rel=1e-3)
    assert b["held"] == pytest.approx(1.7 * 6.7399 / (6.7399 + 2.72), rel=1e-3)  # 0.49^16: some block is always late
    assert b["held_busy"] == pytest.approx(6.7399 / 9.4599, rel=1e-3)
    # K = 2: the ahead block takes 3 d = 8.16 ms, 1.42 ms past the 6.74 ms verify
    b2 = H100.speculation_bound(0.7, 2, 16, 768)
    assert b2["any"] == pytest.approx(2.19 * 6.7399 / (6.7399 + 0.343 * 1.4201 + 0.657 * 5.44), rel=1e-3)
    best = max(H100.speculation_bound(0.7, k, 16, 768)["any"] for k in range(1, 9))
    assert 1.40 < best < 1.5  # the engine-grade target (1.5 x plain) is out of this profile's reach at α 0.7
    # the engine's own time a step lifts speculation's share (it pays it once a round), not past 1.5
    assert max(H100.speculation_bound(0.7, k, 16, 768, overhead_ms=1.0)["any"] for k in range(1, 9)) < 1.5


def test_the_bound_grows_with_acceptance_and_is_not_below_one_and_a_half_everywhere():
    assert max(H100.speculation_bound(0.9, k, 16, 768)["any"] for k in range(1, 9)) > 1.9
    assert H100.speculation_bound(0.0, 1, 16, 768)["any"] < 1.0  # nothing accepted: the drafting is lost time


def test_a_trees_bound_at_one_stream_adds_the_second_candidates_tokens_at_the_same_verify_cost():
    """One row over 40 positions: 9 tokens verified cost what 5 do (6.70 ms, the weights'
    floor); the two branches drafted as a batch of 2 rows: d = 2.74 ms against 2.72. α 0.7,
    K 4: E = 2.773 for the chain; the tree adds (1 − α) β E(3) = 0.09 x 2.533 at β 0.3.
    A round: 6.702 + α^5 (5 d − 6.702) + (1 − α^5) 4 d = 16.996 ms."""
    chain = H100.speculation_bound(0.7, 4, 1, 40)["any"]
    tree = H100.speculation_bound(0.7, 4, 1, 40, width=2, beta=0.3)["any"]
    assert tree == pytest.approx((2.7731 + 0.09 * 2.533) * 6.7021 / 16.996, rel=1e-3)
    assert tree > 1.07 * chain
    # a second candidate that is never right only adds drafting time
    assert H100.speculation_bound(0.7, 4, 1, 40, width=2, beta=0.0)["any"] < chain
    # at 64 rows a tree's 9 tokens a row cost compute the chain's 5 do not: the verify grows
    assert H100.target_ms(64 * 9, 64 * 40) > 1.5 * H100.target_ms(64 * 5, 64 * 40)
