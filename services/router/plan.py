"""One typed record per request: the `SessionPlan`, decided once when the request arrives and
stored with the session (so a router that takes the session over continues it exactly), and
the `Run`: the plan plus what this router has done of it so far."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from services.router.pools import DraftPool
from services.router.prediction import PredictionPool
from specserve.algorithm.round import RoundStats
from specserve.algorithm.stops import IncrementalText
from specserve.control.arms import Choice, Decision, Fallback
from specserve.params import GenerationParams, SamplingParams
from specserve.state.prefix import CommittedPrefix


@dataclass(frozen=True)
class SessionPlan:
    params: GenerationParams  # seed resolved; num_draft_tokens = the chosen K
    workload_class: str
    class_reason: str  # "explicit", or the classifier's rules
    stats_class: str  # the class statistics and metrics count it under (`other` for unknown)
    choice: Choice  # the arm: pool and K, or plain and why, or shadow
    policy_class: str = ""  # the policy that applied (the class's own or `default`)
    policy_version: int = 0
    policy_source: str = ""
    decision_reason: str = ""  # the controller's reason, when it decided
    prediction: tuple[int, ...] = ()  # Predicted Outputs: the request's expected output (tokens)

    @property
    def seed(self) -> int:
        assert self.params.seed is not None, "a plan's seed is resolved"
        return self.params.seed

    @property
    def pool(self) -> str | None:
        """The pool the served run speculates with (None: plain)."""
        return None if self.choice.shadow else self.choice.pool

    @property
    def shadow_pool(self) -> str | None:
        return self.choice.pool if self.choice.shadow else None

    def encode(self) -> dict[str, Any]:
        """The session's `params` field in Redis (one flat JSON object)."""
        p, s, c = self.params, self.params.sampling, self.choice
        return {"max_tokens": p.max_tokens, "temperature": s.temperature, "top_k": s.top_k, "top_p": s.top_p,
                "banned": list(s.banned_token_ids), "stop": list(p.stop), "seed": p.seed, "k": c.k,
                "workload_class": self.workload_class, "class_reason": self.class_reason,
                "stats_class": self.stats_class, "pool": self.pool, "shadow_pool": self.shadow_pool,
                "decision": c.decision.value, "plain_reason": c.reason.value, "probe": c.probe,
                "policy_class": self.policy_class, "policy_version": self.policy_version,
                "policy_source": self.policy_source, "decision_reason": self.decision_reason,
                "prediction": list(self.prediction)}

    @classmethod
    def decode(cls, d: dict[str, Any]) -> SessionPlan:
        sampling = SamplingParams(d["temperature"], d["top_k"], d["top_p"], tuple(d["banned"]))
        params = GenerationParams(max_tokens=d["max_tokens"], sampling=sampling, num_draft_tokens=d["k"],
                                  stop=tuple(d["stop"]), seed=d["seed"])
        choice = Choice(d.get("pool") or d.get("shadow_pool"), int(d["k"]), bool(d.get("shadow_pool")),
                        Decision(d.get("decision") or Decision.PINNED), Fallback(d.get("plain_reason", "")),
                        bool(d.get("probe")))
        return cls(params, d["workload_class"], d.get("class_reason", ""), d.get("stats_class", ""), choice,
                   d.get("policy_class", ""), int(d.get("policy_version", 0)), d.get("policy_source", ""),
                   d.get("decision_reason", ""), tuple(d.get("prediction") or ()))

    def span_attributes(self) -> dict[str, Any]:
        return {"specserve.workload_class": self.workload_class, "specserve.class_reason": self.class_reason,
                "specserve.policy_class": self.policy_class, "specserve.policy_version": self.policy_version,
                "specserve.decision": self.choice.decision.value, "specserve.decision_reason": self.decision_reason,
                "specserve.draft_pool": self.pool or "none", "specserve.shadow_pool": self.shadow_pool or "",
                "specserve.k": self.params.num_draft_tokens, "specserve.seed": str(self.seed)}


@dataclass
class Run:
    """A session as this router drives it: the plan plus progress."""

    session_id: str
    epoch: int
    plan: SessionPlan
    prompt_len: int
    committed: CommittedPrefix  # prompt + committed generated tokens
    text: IncrementalText
    deadline: float  # event-loop time
    pool: DraftPool | PredictionPool | None  # the plan's pool, resolved on this router
    shadow: bool = False  # a shadow run: speculates beside a plain run, commits nothing
    draft_held: dict[str, int] = field(default_factory=dict)  # replica -> committed len it holds
    target_held: dict[str, int] = field(default_factory=dict)
    rounds: list[RoundStats] = field(default_factory=list)
    started: float = field(default_factory=time.perf_counter)
    first_commit: float | None = None
    finished: float | None = None
    finish_reason: str = ""

    @property
    def params(self) -> GenerationParams:
        return self.plan.params

    @property
    def labels(self) -> tuple[str, str]:
        return self.plan.workload_class, self.pool.name if self.pool else "none"

    @property
    def stats_labels(self) -> tuple[str, str | None]:
        """(class, pool) the controller's statistics count this run's rounds under."""
        return self.plan.stats_class or self.plan.workload_class, self.pool.name if self.pool else None

    @property
    def plain_reason(self) -> str:
        """Why a run without a pool runs plain (its rounds' fallback_reason)."""
        return self.plan.choice.reason.value or Fallback.SPECULATION_OFF.value

    @property
    def generated(self) -> list[int]:
        return self.committed.ids[self.prompt_len :]
