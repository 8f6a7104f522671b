"""The engine's K choice (ADR 0014), one case per rule, with literal numbers: E[emitted],
S(K) from the load-priced step cost, plain unless speculation pays, and acceptance learnt
per position."""

from __future__ import annotations

import pytest

from specserve.engine.kchoice import Acceptance, choose_k, expected_emitted, speedups


def _cost(batch: int, a: float = 10.0, b: float = 1.0):
    return lambda n: a + b * batch * n  # ms: the fit of worker/cost.py with r = 0


def test_expected_emitted_multiplies_the_rates_along_the_block():
    assert expected_emitted([0.5], 2) == pytest.approx(1.75)
    assert expected_emitted([1.0, 0.5, 0.0], 4) == pytest.approx(1 + 1 + 0.5)
    assert expected_emitted([0.9], 0) == 1.0


def test_one_stream_speculates_deep_when_acceptance_is_high():
    s = speedups([0.8], 8, _cost(1))
    assert s[4] == pytest.approx(3.3616 * 11 / 15)
    assert choose_k(speedups([0.8], 8, _cost(1))) == 6


def test_under_load_long_blocks_stop_paying_and_k_shrinks():
    assert choose_k(speedups([0.8], 8, _cost(16))) == 1
    assert choose_k(speedups([0.8], 8, _cost(64))) == 0  # S(1) = 1.8 * 74 / 138 < 1: plain


def test_low_acceptance_runs_plain_and_the_margin_is_respected():
    assert choose_k(speedups([0.05], 8, _cost(1))) == 0
    # S(1) = 1.3 * 11 / 12 = 1.19: above a 0.1 margin, below a 0.3 one
    assert choose_k(speedups([0.3], 1, _cost(1)), margin=0.1) == 1
    assert choose_k(speedups([0.3], 1, _cost(1)), margin=0.3) == 0


def test_acceptance_is_learnt_per_position_from_rounds():
    table = Acceptance()
    for _ in range(50):
        table.observe(k=3, num_accepted=1)  # position 0 always accepted, position 1 always rejected
    alphas = table.alphas()
    assert alphas[0] > 0.95 and alphas[1] < 0.05
    assert len(alphas) == 3 and alphas[2] == pytest.approx(0.6)  # never reached: the prior
