"""The arm a request runs: plain decoding, speculation with one of its class's draft pools at
some K, or shadow (DESIGN §4, ADR 0006). Pure functions over facts, torch- and Redis-free:

- `assess(policy, estimates, min_rounds)`: the class's decision from the controller's
  estimates of every pool the policy allows (the one `GetEffectivePolicy` reports);
- `request_reason(choice, assessment)`: the reason a request's stats report for its arm;
- `choose_arm(facts, policy, pools_here, estimates, rng, min_rounds)`: one request's arm, by
  the precedence rules of ADR 0006, highest first:
    1. the request opts out (`draft_pool="none"` or K = 0)            -> plain, speculation_off
    2. the policy is off                                              -> plain, policy_off
    3. temperature above the ceiling / prompt above the limit         -> plain
    3b. rollout stage `slice`, the request outside the slice (ADR 0022) -> plain, rollout_outside_slice
        (as policy off does, it beats a pinned pool: a class being rolled out speculates in its slice only)
    4. no allowed pool exists on this router                          -> plain, pool_unknown
    5. shadow                                                         -> plain served, pool beside it
    6. a pool or K pinned by the request                              -> that pool / K
    7. the controller's decision, with randomised probes across plain, K and pools.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from specserve.control.controller import Estimate
from specserve.control.policy import Policy

NO_SPECULATION = "none"  # a request's draft_pool that opts out of speculation


class Decision(StrEnum):
    PINNED = "pinned"  # the request chose (pool, K or opt-out)
    OFF = "off"  # policy mode off
    PLAIN = "plain"  # speculation does not pay (or cannot run) for this request
    SPECULATE = "speculate"
    LEARN = "learn"  # too few statistics: both arms are tried
    SHADOW = "shadow"
    SLICE = "slice"  # a rollout slice's policy, and the request is outside the slice


class Fallback(StrEnum):
    """Why a request runs plain: its rounds' `fallback_reason`."""

    NONE = ""
    SPECULATION_OFF = "speculation_off"
    POLICY_OFF = "policy_off"
    TEMPERATURE = "temperature_above_ceiling"
    PROMPT = "prompt_above_limit"
    POOL_UNKNOWN = "pool_unknown"
    CONTROLLER_PLAIN = "controller_plain"
    CONTROLLER_PROBE = "controller_probe"
    SHADOW = "shadow"
    ROLLOUT = "rollout_outside_slice"


@dataclass(frozen=True)
class RequestFacts:
    temperature: float
    prompt_tokens: int
    pinned_pool: str | None = None  # the request's draft_pool (NO_SPECULATION = opt out)
    pinned_k: int | None = None  # the request's num_draft_tokens
    # the request names a seed (its tokens are then fixed by the seed whatever arm it gets:
    # the coupled sampler, ADR 0027, so its arm is chosen as any other request's)
    seeded: bool = False
    request_id: str | None = None  # the client's id: a rollout slice keeps its retries in their arm


@dataclass(frozen=True)
class Assessment:
    """The controller's decision for a class: speculate on `pool` at `k`, or not, and why."""

    decision: Decision
    reason: str
    pool: str  # the pool the decision is about ("" when no pool is allowed)
    k: int
    estimates: Mapping[str, Estimate] = field(default_factory=dict)  # every allowed pool

    @property
    def estimate(self) -> Estimate:
        return self.estimates.get(self.pool) or Estimate()

    @property
    def speedup(self) -> float:
        return self.estimate.speedup.get(self.k, 0.0)


@dataclass(frozen=True)
class Choice:
    """What one request runs. pool None = plain decoding; shadow = serve plain and run `pool`
    at `k` beside it."""

    pool: str | None
    k: int
    shadow: bool
    decision: Decision
    reason: Fallback
    probe: bool = False

    @property
    def arm(self) -> str:
        return "shadow" if self.shadow else "speculative" if self.pool else "plain"


def _plain(decision: Decision, reason: Fallback, probe: bool = False) -> Choice:
    return Choice(None, 0, False, decision, reason, probe)


def _ready(est: Estimate, min_rounds: float) -> bool:
    return est.spec_rounds >= min_rounds and bool(est.speedup)


def assess(policy: Policy, estimates: Mapping[str, Estimate], min_rounds: float,
           pools: Sequence[str] | None = None) -> Assessment:
    """The class's decision over `pools` (default: every pool the policy allows), each judged
    by its estimated S at its best K; ties go to the earlier pool in the policy's order."""
    pools = list(policy.pools if pools is None else pools)
    k_min, k_max = policy.k_range
    ests = {p: estimates.get(p) or Estimate() for p in pools}
    if policy.mode == "off" or not pools:
        return Assessment(Decision.OFF, "policy mode is off", "", 0, ests)
    ready = [p for p in pools if _ready(ests[p], min_rounds)]
    known = [p for p in pools if ests[p].speedup]  # ready, or statistics decayed below min_rounds
    # an adaptive class ranks its pools by what they did with the engine deciding each round
    # (Estimate.realized); a fixed-K class runs its K on every round, as its S says
    def worth(p: str) -> float:
        return ests[p].realized(k_min, k_max) if policy.adaptive_k else ests[p].best(k_min, k_max)[1]

    best = max(known, key=lambda p: (worth(p), -pools.index(p))) if ready else pools[0]
    k, s = ests[best].best(k_min, k_max)
    if policy.mode == "shadow":
        return Assessment(Decision.SHADOW, f"shadow mode: serving plain, speculating beside it on {best} at K={k}",
                          best, k, ests)
    plain_rounds = max((e.plain_rounds for e in ests.values()), default=0.0)
    unmeasured = [p for p in pools if p not in ready]
    # Learn until plain and at least one pool have statistics. Then decide on every pool with
    # an estimate (a decayed one too: probes refresh it); a pool with none is explored by half
    # the requests (choose_arm), so the class reaches its best pool within a bounded number
    # of requests.
    # An adaptive class needs no plain statistics to choose its pool: the engine decides plain
    # per round at its own load, and pools are ranked alike with or without them (estimate).
    if not ready or (plain_rounds < min_rounds and not policy.adaptive_k):
        learn = unmeasured[0] if unmeasured else best
        e = ests[learn]
        k = e.best(k_min, k_max)[0] if e.speedup else (k_min + k_max + 1) // 2
        return Assessment(Decision.LEARN, f"too few statistics ({e.spec_rounds:.1f} speculative rounds on {learn}, "
                                          f"{plain_rounds:.1f} plain; need {min_rounds:g} each): trying both arms",
                          learn, k, ests)
    est, threshold = ests[best], 1 + policy.safety_margin
    acc = ", ".join(f"{a:.2f}" for a in est.acceptance[:k])
    held = {p: f" (held plain {ests[p].held / (ests[p].held + ests[p].spec_rounds):.0%}: {worth(p):.2f})"
            for p in known if policy.adaptive_k and ests[p].held}
    others = "".join(f"; {p} S={ests[p].best(k_min, k_max)[1]:.2f}{held.get(p, '')}"
                     for p in known if p != best) + "".join(
        f"; exploring {p} (no statistics)" for p in pools if p not in known)
    plain_of = " (priced from the pool's rounds)" if est.plain_from_pool else ""
    costs = (f"(acceptance {acc}; round {est.round_ms[k]:.2f} ms vs plain step {est.plain_step_ms:.2f} ms{plain_of}"
             f"{others})")
    if s >= threshold:
        return Assessment(Decision.SPECULATE, f"S={s:.2f} >= {threshold:.2f} on {best} at K={k} {costs}",
                          best, k, ests)
    if policy.adaptive_k:
        # The statistics mix every load the class ran at (decayed over the half-life), and
        # whether speculation pays depends on the load (kchoice.py). The engine measures the
        # step cost at the load each round runs at and holds a session plain, probing, where
        # no K pays: so an adaptive class speculates on its best pool, and the engine turns
        # it off per load (ADR 0014, session 12).
        return Assessment(Decision.SPECULATE, f"S={s:.2f} < {threshold:.2f} on {best} at K={k} {costs} over the "
                                              f"loads measured: adaptive K, so the engine runs each round plain "
                                              f"or at K in [{k_min}, {k_max}] at its own load", best, k, ests)
    return Assessment(Decision.PLAIN, f"S={s:.2f} < {threshold:.2f} at the best arm, {best} K={k} {costs}: plain "
                                      f"decoding, probing {policy.probe_fraction:.0%}", best, k, ests)


def request_reason(choice: Choice, a: Assessment | None) -> str:
    """Why this request runs its arm, in words that agree with the arm: the class's reason,
    or, for a probe (an arm the class did not choose, measured again), that it is one."""
    if a is None:
        return ""
    if not choice.probe:
        return a.reason
    ran = "plain decoding" if choice.pool is None else f"{choice.pool} at K={choice.k}"
    return f"a probe of {ran}, measured again beside the class's decision ({a.decision.value}: {a.reason})"


def choose_arm(facts: RequestFacts, policy: Policy, pools_here: Collection[str],
               estimates: Mapping[str, Estimate], rng: random.Random,
               min_rounds: float) -> tuple[Choice, Assessment | None]:
    """One request's arm (the module docstring has the precedence) and the assessment it
    came from (None when a rule above the controller decided)."""
    if facts.pinned_pool == NO_SPECULATION or facts.pinned_k == 0:
        return _plain(Decision.PINNED, Fallback.SPECULATION_OFF), None
    if policy.mode == "off":
        return _plain(Decision.OFF, Fallback.POLICY_OFF), None
    if policy.temperature_ceiling is not None and facts.temperature > policy.temperature_ceiling:
        return _plain(Decision.PLAIN, Fallback.TEMPERATURE), None
    if policy.max_prompt_tokens and facts.prompt_tokens > policy.max_prompt_tokens:
        return _plain(Decision.PLAIN, Fallback.PROMPT), None
    if policy.mode == "slice" and not in_slice(policy, facts.request_id, rng):
        return _plain(Decision.SLICE, Fallback.ROLLOUT), None
    pools = [facts.pinned_pool] if facts.pinned_pool else [p for p in policy.pools if p in pools_here]
    if not pools or pools[0] not in pools_here:
        return _plain(Decision.PLAIN, Fallback.POOL_UNKNOWN), None
    a = assess(policy, estimates, min_rounds, pools)
    if facts.pinned_pool is not None or facts.pinned_k is not None:
        pool = pools[0] if facts.pinned_pool else a.pool
        k = facts.pinned_k if facts.pinned_k is not None else a.k or policy.k_range[0]
        if policy.mode == "shadow":
            return Choice(pool, k, True, Decision.SHADOW, Fallback.SHADOW), a
        return Choice(pool, k, False, Decision.PINNED, Fallback.NONE), a
    return _by_assessment(a, policy, pools, rng, min_rounds), a


def _by_assessment(a: Assessment, policy: Policy, pools: list[str], rng: random.Random,
                   min_rounds: float) -> Choice:
    k_min, k_max = policy.k_range
    if a.decision is Decision.SHADOW:  # pool = the shadow run's; the served run is plain
        return Choice(a.pool, a.k, True, Decision.SHADOW, Fallback.SHADOW)
    unready = [p for p in pools if not _ready(a.estimates[p], min_rounds)]  # probes go there first
    # Never measured: explored by half the requests. A pool measured before whose statistics
    # have decayed is measured again by the probes (unready pools first), not by half the
    # traffic: a pool found slow minutes ago would otherwise get half of every cell again.
    unknown = [p for p in pools if not a.estimates[p].speedup and not a.estimates[p].seen]

    def pool_arm(pool: str, decision: Decision, probe: bool) -> Choice:
        e = a.estimates[pool]
        k = e.best(k_min, k_max)[0] if (e.speedup and pool != a.pool) else a.k
        return Choice(pool, k, False, decision, Fallback.NONE, probe)

    if a.decision is Decision.LEARN:  # plain or one of the pools without statistics, at random
        # (an adaptive class learns its pools only: plain is the engine's to decide, per round)
        pool = rng.choice([*([] if policy.adaptive_k else [None]), *(unready or pools)])
        if pool is None:
            return _plain(Decision.LEARN, Fallback.CONTROLLER_PROBE, probe=True)
        k = a.k if k_min == k_max else rng.randint(k_min, k_max)
        return Choice(pool, k, False, Decision.LEARN, Fallback.NONE)
    if unknown and rng.random() < 0.5:  # a pool without any statistics: explore it
        return pool_arm(rng.choice(unknown), a.decision, True)
    probe = rng.random() < policy.probe_fraction
    if a.decision is Decision.PLAIN:
        if not probe:
            return _plain(Decision.PLAIN, Fallback.CONTROLLER_PLAIN)
        return pool_arm(rng.choice(unready or pools), Decision.PLAIN, True)
    if not probe:
        return Choice(a.pool, a.k, False, Decision.SPECULATE, Fallback.NONE)
    # speculating: measure plain again, a neighbouring K (adaptive), or another pool
    options = ["plain"] + (["k"] if k_min < k_max else []) + (["pool"] if len(pools) > 1 else [])
    which = rng.choice(options)
    if which == "k":
        k = min(max(a.k + rng.choice((-1, 1)), k_min), k_max)
        return Choice(a.pool, k, False, Decision.SPECULATE, Fallback.NONE, probe=True)
    if which == "pool":
        return pool_arm(rng.choice([p for p in (unready or pools) if p != a.pool] or pools), Decision.SPECULATE,
                        True)
    return _plain(Decision.SPECULATE, Fallback.CONTROLLER_PROBE, probe=True)


def in_slice(policy: Policy, request_id: str | None, rng: random.Random) -> bool:
    """Whether a request of a class in rollout stage `slice` speculates: a stable hash of its
    class and request id below `slice_percent` (of 10,000 buckets), so a retried request (the
    same id) lands in the same arm on any router; a request without an id draws at random."""
    if not request_id:
        return rng.random() * 100.0 < policy.slice_percent
    digest = hashlib.sha256(f"{policy.workload_class}\0{request_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % 10_000 < policy.slice_percent * 100.0

