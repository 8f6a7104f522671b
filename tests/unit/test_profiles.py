"""The simulated device profiles' bound on speculation (bench/profiles.py, ADR 0014): what a
fixed K can gain over plain with the benchmark's synthetic pool, for any schedule, with
literal numbers from the profile's own figures."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("bench_profiles", Path(__file__).resolve().parents[2] / "bench" / "profiles.py")
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
