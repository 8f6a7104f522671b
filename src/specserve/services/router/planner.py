"""A validated request -> its SessionPlan: the class's policy, the controller's estimates for
every pool the policy allows, and the pure arm choice of `specserve.control.arms`."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Collection
from dataclasses import replace

from specserve.algorithm.rng import fresh_seed
from specserve.control.arms import (
    Assessment,
    Choice,
    Decision,
    Fallback,
    assess,
    choose_arm,
    request_reason,
)
from specserve.control.controller import Controller
from specserve.control.guards import (
    GUARDED_STAGES,
    PLAIN,
    SPECULATING,
    ArmOutcomes,
    Tripped,
    check_guards,
    check_outcomes,
    guard_arm,
    promotion_due,
    rolled_back,
    settling,
)
from specserve.control.policy import ADAPTER_SEP, Policy, PolicyCache, PolicyConflict
from specserve.drafters.prediction import PREDICTION_K, PREDICTION_POOL, drafts_from_prediction
from specserve.services.router.classifier import CLASSES
from specserve.services.router.plan import SessionPlan
from specserve.services.router.validation import ValidRequest
from specserve.serving.metrics import AdapterLabels, RouterMetrics, split_class
from specserve.structured.constraint import Constraint

log = logging.getLogger("specserve.router")


class Planner:
    def __init__(self, policies: PolicyCache, controller: Controller, pools: Collection[str],
                 metrics: RouterMetrics, rng: random.Random | None = None) -> None:
        self.policies = policies
        self.controller = controller
        self.pools = set(pools)
        self.metrics = metrics
        self.rng = rng or random.Random()
        self.outcomes = ArmOutcomes()  # the outcome guards' window of this router's requests
        self._warned: set[str] = set()
        self._moving: set[str] = set()  # classes whose stage change (rollback, promotion) is being written
        self._tasks: set[asyncio.Task] = set()
        self.adapter_labels = AdapterLabels()  # the metrics' adapter label (ADR 0029)

    def stats_class(self, workload_class: str, adapter: str = "") -> str:
        """Statistics and metrics labels per known class; unknown ones share `other`, so a
        client cannot grow Redis or Prometheus without bound. A LoRA adapter's requests count
        apart, as CLASS@ADAPTER (ADR 0029; adapters are the operators' to load: bounded too)."""
        cls = workload_class if workload_class in CLASSES or self.policies.known(workload_class) else "other"
        return f"{cls}{ADAPTER_SEP}{adapter}" if adapter else cls

    async def plan(self, req: ValidRequest) -> SessionPlan:
        key = f"{req.workload_class}{ADAPTER_SEP}{req.adapter}" if req.adapter else req.workload_class
        policy, source = self.policies.effective(key)  # CLASS@ADAPTER's own, else the class's (ADR 0029)
        stats_class = self.stats_class(req.workload_class, req.adapter)
        if req.constraint is None and not req.free_text and policy.output_format == "json_object":
            req = replace(req, constraint=Constraint.json_object())  # the class's default output (ADR 0017)
        if req.constraint is not None:  # acceptance under a constraint is its own statistic (ADR 0017)
            stats_class += req.constraint.stats_suffix
        choice: Choice
        assessment: Assessment | None
        if drafts_from_prediction(req.prediction_ids, req.pinned_pool, req.pinned_k):
            choice, assessment = prediction_choice(req.pinned_k), None  # no statistics to read
        else:
            pools = [req.pinned_pool] if req.pinned_pool in self.pools else [p for p in policy.pools if p in self.pools]
            await self.controller.watch(stats_class, pools)
            estimates = self.controller.estimates(stats_class, pools, policy.k_range[1], policy.adaptive_k)
            choice, assessment = choose_arm(req.facts, policy, self.pools, estimates, self.rng,
                                            self.controller.min_rounds)
        if choice.reason is Fallback.POOL_UNKNOWN and policy.draft_pool not in self._warned:
            self._warned.add(policy.draft_pool)
            log.warning("policy %r names draft pool(s) %s, none of which this router has: plain decoding",
                        policy.workload_class, ", ".join(policy.pools))
        if assessment is not None:
            self._gauges(stats_class, assessment)
            if source == "class" and policy.mode in GUARDED_STAGES and policy.workload_class == key:
                self._stage(policy, stats_class, assessment)  # a rollout stage: its guards (ADR 0022), per adapter
        seed = req.params.seed if req.params.seed is not None else fresh_seed()
        params = replace(req.params, num_draft_tokens=choice.k, seed=seed)
        self.metrics.classified.labels(split_class(stats_class)[0], req.class_reason.split(":")[0]).inc()
        self.metrics.decisions.labels(*self._labels(stats_class, choice.pool or "none", True), choice.decision.value,
                                      choice.arm).inc()
        self.metrics.policy_version.labels(stats_class).set(policy.version)
        # the engine picks K where the policy lets it (not for a pinned K or a probe; a seeded
        # request too: its tokens do not depend on K, ADR 0027)
        adaptive = policy.adaptive_k and choice.decision is Decision.SPECULATE and not choice.probe \
            and not choice.shadow
        arm = guard_arm(policy, choice) if source == "class" and policy.workload_class == key else ""
        return SessionPlan(params, req.workload_class, req.class_reason, stats_class, choice, policy.workload_class,
                           policy.version, source, request_reason(choice, assessment),
                           req.prediction_ids if choice.pool == PREDICTION_POOL else (),
                           seeded=req.params.seed is not None, k_bounds=policy.k_range if adaptive else None,
                           constraint=req.constraint, guard_arm=arm,
                           draft_priority=policy.draft_priority, suffix=suffix_settings(policy), adapter=req.adapter)

    def outcome(self, plan: SessionPlan, tpot_s: float | None, failed: bool) -> None:
        """How a request of a class in a guarded stage ended (the service reports it): its TPOT
        (None below two tokens) and whether it failed, for the outcome guards."""
        if plan.guard_arm:
            self.outcomes.record(plan.policy_class, plan.guard_arm, time.monotonic(), tpot_s, failed,
                                 plan.policy_version)

    def _stage(self, policy: Policy, stats_class: str, assessment: Assessment) -> None:
        """A class in a guarded stage: back one stage if a guard trips, else (a slice) to enabled
        if its clean window has run."""
        if settling(policy, self.controller.half_life_s, time.time()):
            return
        tripped = check_guards(policy, assessment, self.controller.min_rounds)
        if tripped is None and (policy.guard_max_tpot_ratio or policy.guard_max_error_rate):
            now = time.monotonic()
            cls, v = policy.workload_class, policy.version
            tripped = check_outcomes(policy, self.outcomes.window(cls, SPECULATING, now, v),
                                     self.outcomes.window(cls, PLAIN, now, v))
        if tripped is not None:
            self._roll_back(policy, stats_class, tripped)
        elif why := promotion_due(policy, assessment, self.controller.min_rounds, time.time()):
            self._promote(policy, stats_class, why)

    def _labels(self, stats_class: str, pool: str, count: bool = False) -> tuple[str, str, str]:
        """(class, pool, adapter) of the metrics (ADR 0029: the adapter label bounded)."""
        cls, adapter = self.adapter_labels.of_class(stats_class, count)
        return cls, pool, adapter

    async def effective(self, workload_class: str) -> tuple[Policy, str, str, Assessment]:
        """(policy, source, stats class, the controller's assessment from fresh statistics);
        `workload_class`: a class, or CLASS@ADAPTER (ADR 0029)."""
        policy, source = self.policies.effective(workload_class)
        cls, _, adapter = workload_class.partition(ADAPTER_SEP)
        stats_class = self.stats_class(cls, adapter)
        pools = [p for p in policy.pools if p in self.pools] or list(policy.pools)
        await self.controller.refresh({(stats_class, p) for p in pools})
        estimates = self.controller.estimates(stats_class, pools, policy.k_range[1], policy.adaptive_k)
        return policy, source, stats_class, assess(policy, estimates, self.controller.min_rounds, pools)

    def _roll_back(self, policy: Policy, stats_class: str, tripped: Tripped) -> None:
        """A rollout guard tripped (ADR 0022): the class goes back one stage."""
        to = rolled_back(policy)

        def done() -> None:
            self.metrics.rollbacks.labels(stats_class, tripped.guard).inc()
            log.warning("policy %r rolled back from %s to %s: %s", policy.workload_class, policy.mode, to.mode,
                        tripped.reason)

        self._move(policy, to, "rollback", tripped.reason, done)

    def _promote(self, policy: Policy, stats_class: str, why: str) -> None:
        """A slice clean for its policy's window (ADR 0022): the class is promoted to enabled."""
        def done() -> None:
            self.metrics.promotions.labels(stats_class).inc()
            log.info("policy %r promoted from slice to enabled: %s", policy.workload_class, why)

        self._move(policy, replace(policy, mode="enabled", slice_percent=0.0), "promote", why, done)

    def _move(self, policy: Policy, to: Policy, action: str, reason: str, done) -> None:
        """The controller's stage change: a compare-and-set write as `controller` (of several
        routers that see it, one writes it; a change an operator made meanwhile wins), in the
        audit log with its reason; this router applies it at once (the others by pub/sub)."""
        if policy.workload_class in self._moving:
            return
        self._moving.add(policy.workload_class)

        async def write() -> None:
            try:
                await self.policies.store.set(to, "controller", expected_version=policy.version, comment=reason,
                                              action=action)
                done()
                await self.policies.reload()
            except PolicyConflict:
                pass  # another router wrote it, or an operator changed the policy: theirs stands
            except Exception:  # noqa: BLE001 (Redis away: the next request of the class tries again)
                log.exception("the %s of policy %r could not be written", action, policy.workload_class)
            finally:
                self._moving.discard(policy.workload_class)

        task = asyncio.get_running_loop().create_task(write())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _gauges(self, stats_class: str, a: Assessment) -> None:
        m = self.metrics
        speculating = a.decision in (Decision.SPECULATE, Decision.LEARN)
        for pool, est in a.estimates.items():
            k, s = (a.k, a.speedup) if pool == a.pool else est.best(1, max(est.speedup, default=1))
            labels = self._labels(stats_class, pool)
            m.expected_speedup.labels(*labels).set(s)
            m.speculating.labels(*labels).set(1 if speculating and pool == a.pool else 0)
            m.chosen_k.labels(*labels).set(k if pool == a.pool else 0)


def prediction_choice(pinned_k: int | None) -> Choice:
    """The arm of a request that drafts from its prediction (`drafts_from_prediction`)."""
    return Choice(PREDICTION_POOL, pinned_k if pinned_k is not None else PREDICTION_K, False, Decision.PINNED,
                  Fallback.NONE)


_SUFFIX_DEFAULTS = Policy("default").suffix()


def suffix_settings(policy: Policy) -> dict[str, float | int] | None:
    """The class's suffix settings for the session's plan (ADR 0026), where they are not the
    defaults (the engine assumes those): no bytes added to a plan that changes nothing."""
    mine = policy.suffix()
    return mine if mine != _SUFFIX_DEFAULTS else None
