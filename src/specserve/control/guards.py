"""Rollout guards (ADR 0022): what moves a class in stage `slice` back to `shadow` by itself,
and what promotes it to `enabled` after a clean window when its policy asks for that.

A pure function of the class's policy and the controller's assessment, evaluated by every
router as it plans the class's requests (services/router/planner.py); the rollback itself is a
compare-and-set policy write by "controller", so of several routers that see the same
statistics one writes it, and it is in the audit log. Torch- and Redis-free.
"""

from __future__ import annotations

from dataclasses import dataclass

from specserve.control.arms import Assessment
from specserve.control.policy import Policy


@dataclass(frozen=True)
class Tripped:
    guard: str  # "speedup" | "acceptance": the metric's label
    reason: str  # what the audit log and the log line say


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

