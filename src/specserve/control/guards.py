"""Rollout guards (ADR 0022): what moves a class in stage `slice` back to `shadow` by itself,
and what promotes it to `enabled` after a clean window when its policy asks for that.

A pure function of the class's policy, the controller's assessment and the router's window
of the class's recent requests (`ArmOutcomes`: TPOT and errors of the slice against the plain
requests), evaluated by every router as it plans the class's requests
(services/router/planner.py); the rollback itself is a compare-and-set policy write by
"controller", so of several routers that see the same statistics one writes it, and it is in
the audit log. Torch- and Redis-free.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from specserve.control.arms import Assessment
from specserve.control.policy import Policy


@dataclass(frozen=True)
class Tripped:
    guard: str  # "speedup" | "acceptance" | "tpot" | "errors": the metric's label
    reason: str  # what the audit log and the log line say


# the outcome guards' window: a router's last requests of a class per arm, within WINDOW_S,
# and the fewest in each arm before they judge (a p90 of 10 requests is their slowest)
WINDOW_REQUESTS, WINDOW_S, MIN_REQUESTS = 200, 600.0, 10
SLICE, PLAIN = "slice", "plain"


@dataclass(frozen=True)
class ArmWindow:
    requests: int
    tpot_p90: float  # seconds; nan with fewer than two tokens in every request
    error_rate: float


class ArmOutcomes:
    """A router's recent requests per (class, arm): when each ended, its TPOT (seconds a token
    after the first; None below two tokens) and whether it failed. Arms: SLICE (a slice
    request that speculated) and PLAIN (the class's requests outside the slice)."""

    def __init__(self, window_requests: int = WINDOW_REQUESTS, window_s: float = WINDOW_S) -> None:
        self.window_s = window_s
        self._n = window_requests
        self._arms: dict[tuple[str, str], deque[tuple[float, float | None, bool]]] = {}

    def record(self, workload_class: str, arm: str, now: float, tpot_s: float | None, failed: bool) -> None:
        q = self._arms.setdefault((workload_class, arm), deque(maxlen=self._n))
        q.append((now, tpot_s, failed))

    def window(self, workload_class: str, arm: str, now: float) -> ArmWindow:
        q = self._arms.get((workload_class, arm), ())
        recent = [(t, tpot, failed) for t, tpot, failed in q if now - t <= self.window_s]
        tpots = sorted(tpot for _, tpot, failed in recent if tpot is not None and not failed)
        p90 = tpots[min(len(tpots) - 1, math.ceil(0.9 * len(tpots)) - 1)] if tpots else math.nan
        errors = sum(failed for _, _, failed in recent)
        return ArmWindow(len(recent), p90, errors / len(recent) if recent else 0.0)

    def forget(self, workload_class: str) -> None:
        """A stage change starts the class's windows again (the slice's requests were another
        stage's)."""
        for arm in (SLICE, PLAIN):
            self._arms.pop((workload_class, arm), None)


def check_outcomes(policy: Policy, slice_w: ArmWindow, plain_w: ArmWindow) -> Tripped | None:
    """A class in stage `slice`: its TPOT and error guards against its plain requests of the
    same window (at the same load), once each arm has MIN_REQUESTS.

    - tpot: the slice's TPOT p90 above `guard_max_tpot_ratio` x the plain requests' p90;
    - errors: the slice's error rate above the plain requests' by more than
      `guard_max_error_rate`."""
    if policy.mode != "slice" or slice_w.requests < MIN_REQUESTS or plain_w.requests < MIN_REQUESTS:
        return None
    if policy.guard_max_tpot_ratio and slice_w.tpot_p90 > 0 and plain_w.tpot_p90 > 0:
        ratio = slice_w.tpot_p90 / plain_w.tpot_p90
        if ratio > policy.guard_max_tpot_ratio:
            return Tripped("tpot", f"guard tpot: the slice's TPOT p90 {slice_w.tpot_p90 * 1e3:.1f} ms is {ratio:.2f}x "
                                   f"the plain requests' {plain_w.tpot_p90 * 1e3:.1f} ms over {slice_w.requests} and "
                                   f"{plain_w.requests} requests, above {policy.guard_max_tpot_ratio:.2f}x")
    if policy.guard_max_error_rate and slice_w.error_rate - plain_w.error_rate > policy.guard_max_error_rate:
        return Tripped("errors", f"guard errors: the slice's error rate {slice_w.error_rate:.1%} against the plain "
                                 f"requests' {plain_w.error_rate:.1%} over {slice_w.requests} and {plain_w.requests} "
                                 f"requests, above them by more than {policy.guard_max_error_rate:.1%}")
    return None


def check_guards(policy: Policy, a: Assessment, min_rounds: float) -> Tripped | None:
    """A class in stage `slice` whose slice speculated on at least `min_rounds` rounds of its
    pool: its guards against the controller's estimate of that pool at its K.

    - speedup: S (target time per emitted token, plain over speculative, at the slice's load,
      the engine's own time included) below `guard_min_speedup`: speculation makes the slice's
      tokens slower or dearer than plain ones;
    - acceptance: the drafts the target accepts a round, by the class's per-position rates,
      below `guard_min_accepted`.
    None when clean, off, or not yet measured."""
    if policy.mode != "slice" or not a.pool:
        return None
    e = a.estimate
    if e.spec_rounds < min_rounds:
        return None
    k, s = (a.k, a.speedup) if a.speedup else e.best(*policy.k_range)
    if policy.guard_min_speedup and s and s < policy.guard_min_speedup:
        return Tripped("speedup", f"guard speedup: S={s:.2f} at K={k} on {a.pool} over {e.spec_rounds:.0f} rounds, "
                                  f"below {policy.guard_min_speedup:.2f}")
    accepted = e.emitted.get(k, 0.0) - 1.0
    if policy.guard_min_accepted and k in e.emitted and accepted < policy.guard_min_accepted:
        return Tripped("acceptance", f"guard acceptance: {accepted:.2f} drafts accepted a round at K={k} on "
                                     f"{a.pool}, below {policy.guard_min_accepted:.2f}")
    return None


def promotion_due(policy: Policy, a: Assessment, min_rounds: float, now: float) -> str | None:
    """A class in stage `slice` whose policy promotes it after a clean window
    (`promote_after_s`): the reason to promote it to `enabled` now, or None. Clean: its slice
    speculated on at least `min_rounds` rounds of its pool and no guard trips (check_guards),
    and the window has run since the policy was last written (a rollback or any change
    starts it again)."""
    if policy.mode != "slice" or not policy.promote_after_s or not a.pool:
        return None
    if a.estimate.spec_rounds < min_rounds or check_guards(policy, a, min_rounds) is not None:
        return None
    clean_s = now - policy.updated_at
    if clean_s < policy.promote_after_s:
        return None
    return (f"promoted: slice clean for {clean_s:.0f} s (>= {policy.promote_after_s:.0f} s) on {a.pool}, "
            f"S={a.speedup:.2f} at K={a.k} over {a.estimate.spec_rounds:.0f} rounds")

