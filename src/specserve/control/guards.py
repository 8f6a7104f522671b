"""Rollout guards (ADR 0022): what moves a class back one stage by itself (`slice` to
`shadow`, `enabled` to a `slice` of ENABLED_ROLLBACK_PERCENT), and what promotes a slice to
`enabled` after a clean window when its policy asks for that.

At `slice` every guard applies. At `enabled` the speedup guard does not: there the controller
already runs a request plain wherever speculation stops paying at the current load (a class
demoted for every busy minute would be a false rollback). The acceptance floor and the outcome
guards do (a draft that got worse, or client TPOT and errors the controller's S cannot see),
the outcome guards against the controller's plain probes of the class as the plain arm.

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
from dataclasses import dataclass, replace

from specserve.control.arms import Assessment, Choice, Decision
from specserve.control.policy import Policy


@dataclass(frozen=True)
class Tripped:
    guard: str  # "speedup" | "acceptance" | "tpot" | "errors": the metric's label
    reason: str  # what the audit log and the log line say


# the outcome guards' window: a router's last requests of a class per arm, within WINDOW_S,
# and the fewest in each arm before they judge (a p90 of 10 requests is their slowest)
WINDOW_REQUESTS, WINDOW_S, MIN_REQUESTS = 200, 600.0, 10
# the arms: requests that speculated (at slice: in the slice; at enabled: the controller's
# speculative decisions, its probes left out), and the class's plain requests at the same time
# (at slice: outside the slice; at enabled: the controller's plain probes)
SPECULATING, PLAIN = "speculating", "plain"
GUARDED_STAGES = ("slice", "enabled")
ENABLED_ROLLBACK_PERCENT = 10.0  # an enabled class whose guard trips goes back to a slice this wide


def settling(policy: Policy, half_life_s: float, now: float) -> bool:
    """A stage the controller itself just wrote (a rollback) is not judged again until its
    statistics have turned over (one half-life of the controller's decay since the write):
    the statistics that tripped the guard at one stage would otherwise trip the next stage's
    guards at once, and an enabled class would pass through its slice to shadow in a few
    requests. An operator's write is judged at once."""
    return policy.updated_by == "controller" and now - policy.updated_at < half_life_s


@dataclass(frozen=True)
class ArmWindow:
    requests: int
    tpot_p90: float  # seconds; nan with fewer than two tokens in every request
    error_rate: float


class ArmOutcomes:
    """A router's recent requests per (class, arm): when each ended, its TPOT (seconds a token
    after the first; None below two tokens) and whether it failed. Arms: SPECULATING and PLAIN.
    The windows measure one version of the class's policy (a stage change is a new version):
    a request of a newer version starts them again, one of an older version is not counted,
    and a window read for another version is empty."""

    def __init__(self, window_requests: int = WINDOW_REQUESTS, window_s: float = WINDOW_S) -> None:
        self.window_s = window_s
        self._n = window_requests
        self._arms: dict[tuple[str, str], deque[tuple[float, float | None, bool]]] = {}
        self._version: dict[str, int] = {}  # per class: the policy version its windows measure

    def record(self, workload_class: str, arm: str, now: float, tpot_s: float | None, failed: bool,
               version: int = 0) -> None:
        seen = self._version.get(workload_class)
        if seen is not None and version < seen:
            return  # planned under an earlier version of the policy: another stage
        if seen != version:
            self._version[workload_class] = version
            for a in (SPECULATING, PLAIN):
                self._arms.pop((workload_class, a), None)
        q = self._arms.setdefault((workload_class, arm), deque(maxlen=self._n))
        q.append((now, tpot_s, failed))

    def window(self, workload_class: str, arm: str, now: float, version: int = 0) -> ArmWindow:
        current = self._version.get(workload_class) == version
        q = self._arms.get((workload_class, arm), ()) if current else ()
        recent = [(t, tpot, failed) for t, tpot, failed in q if now - t <= self.window_s]
        tpots = sorted(tpot for _, tpot, failed in recent if tpot is not None and not failed)
        p90 = tpots[min(len(tpots) - 1, math.ceil(0.9 * len(tpots)) - 1)] if tpots else math.nan
        errors = sum(failed for _, _, failed in recent)
        return ArmWindow(len(recent), p90, errors / len(recent) if recent else 0.0)


def check_outcomes(policy: Policy, slice_w: ArmWindow, plain_w: ArmWindow) -> Tripped | None:
    """A class in stage `slice` or `enabled`: its TPOT and error guards, the speculating arm
    against its plain requests of the same window (at the same load), once each arm has
    MIN_REQUESTS.

    - tpot: the speculating arm's TPOT p90 above `guard_max_tpot_ratio` x the plain p90;
    - errors: its error rate above the plain requests' by more than `guard_max_error_rate`."""
    if policy.mode not in GUARDED_STAGES or slice_w.requests < MIN_REQUESTS or plain_w.requests < MIN_REQUESTS:
        return None
    if policy.guard_max_tpot_ratio and slice_w.tpot_p90 > 0 and plain_w.tpot_p90 > 0:
        ratio = slice_w.tpot_p90 / plain_w.tpot_p90
        if ratio > policy.guard_max_tpot_ratio:
            return Tripped("tpot", f"guard tpot ({policy.mode}): the speculating requests' TPOT p90 "
                                   f"{slice_w.tpot_p90 * 1e3:.1f} ms is {ratio:.2f}x the plain requests' "
                                   f"{plain_w.tpot_p90 * 1e3:.1f} ms over {slice_w.requests} and "
                                   f"{plain_w.requests} requests, above {policy.guard_max_tpot_ratio:.2f}x")
    if policy.guard_max_error_rate and slice_w.error_rate - plain_w.error_rate > policy.guard_max_error_rate:
        return Tripped("errors", f"guard errors ({policy.mode}): the speculating requests' error rate "
                                 f"{slice_w.error_rate:.1%} against the plain requests' {plain_w.error_rate:.1%} over "
                                 f"{slice_w.requests} and {plain_w.requests} requests, above them by more than "
                                 f"{policy.guard_max_error_rate:.1%}")
    return None


def check_guards(policy: Policy, a: Assessment, min_rounds: float) -> Tripped | None:
    """A class in stage `slice` or `enabled` whose requests speculated on at least
    `min_rounds` rounds of its pool: its guards against the controller's estimate of that pool
    at its K.

    - speedup (at slice only): S (target time per emitted token, plain over speculative, at
      the slice's load, the engine's own time included) below `guard_min_speedup`:
      speculation makes the slice's tokens slower or dearer than plain ones;
    - acceptance: the drafts the target accepts a round, by the class's per-position rates,
      below `guard_min_accepted`.
    None when clean, off, or not yet measured."""
    if policy.mode not in GUARDED_STAGES or not a.pool:
        return None
    e = a.estimate
    if e.spec_rounds < min_rounds:
        return None
    k, s = (a.k, a.speedup) if a.speedup else e.best(*policy.k_range)
    if policy.mode == "slice" and policy.guard_min_speedup and s and s < policy.guard_min_speedup:
        return Tripped("speedup", f"guard speedup: S={s:.2f} at K={k} on {a.pool} over {e.spec_rounds:.0f} rounds, "
                                  f"below {policy.guard_min_speedup:.2f}")
    accepted = e.emitted.get(k, 0.0) - 1.0
    if policy.guard_min_accepted and k in e.emitted and accepted < policy.guard_min_accepted:
        return Tripped("acceptance", f"guard acceptance ({policy.mode}): {accepted:.2f} drafts accepted a round at "
                                     f"K={k} on {a.pool}, below {policy.guard_min_accepted:.2f}")
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


def rolled_back(policy: Policy) -> Policy:
    """The stage below the policy's: `slice` goes to `shadow`, `enabled` to a slice of
    ENABLED_ROLLBACK_PERCENT."""
    if policy.mode == "enabled":
        return replace(policy, mode="slice", slice_percent=ENABLED_ROLLBACK_PERCENT)
    return replace(policy, mode="shadow", slice_percent=0.0)


def guard_arm(policy: Policy, choice: Choice) -> str:
    """The outcome guards' arm a request of a class in a guarded stage counts in ('' for none):
    at slice, the slice's speculative requests and the requests outside the slice; at enabled,
    the controller's speculative decisions (not its probes, which may try a pool or K that does
    not pay) and its plain probes (drawn from the same decisions, so at the same load)."""
    if policy.mode == "slice":
        return PLAIN if choice.decision is Decision.SLICE else SPECULATING if choice.arm == "speculative" else ""
    if policy.mode == "enabled" and choice.decision is Decision.SPECULATE:
        if choice.arm == "speculative" and not choice.probe:
            return SPECULATING
        if choice.arm == "plain" and choice.probe:
            return PLAIN
    return ""
