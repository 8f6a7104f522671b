"""One typed record per request: the `SessionPlan`, decided once when the request arrives and
stored with the session; the target's engine drives the session by it (its part is
`specserve.engine.session.EnginePlan.from_stored`), and a target that adopts the session
continues it exactly."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from specserve.control.arms import Choice, Decision, Fallback
from specserve.params import GenerationParams, SamplingParams
from specserve.structured.constraint import Constraint


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
    seeded: bool = False  # the client chose the seed (its sampled output must reproduce)
    # adaptive K (the policy's adaptive_k, a speculate decision): the engine picks each round's
    # K in [k_min, k_max] or plain, from its measured step cost (ADR 0014); choice.k starts it
    k_bounds: tuple[int, int] | None = None
    constraint: Constraint | None = None  # structured output (ADR 0017)
    # a class in rollout stage slice (ADR 0022): "slice" for a request that speculates in the
    # slice, "plain" for one outside it; its TPOT and outcome feed the outcome guards
    guard_arm: str = ""
    draft_priority: int = 0  # the class's (ADR 0021): a saturated draft replica sheds the lowest first
    # the class's suffix index and drafting settings (ADR 0026: its policy's suffix_*), where
    # they are not the defaults: the target's suffix pool keeps and drafts the class's index by them
    suffix: dict[str, Any] | None = None
    adapter: str = ""  # the LoRA adapter it runs on (ADR 0029; "" = the base)

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
                "prediction": list(self.prediction), "seeded": self.seeded,
                **({"adaptive": True, "k_min": self.k_bounds[0], "k_max": self.k_bounds[1]} if self.k_bounds else {}),
                **({"constraint": self.constraint.encode()} if self.constraint else {}),
                **({"draft_priority": self.draft_priority} if self.draft_priority else {}),
                **({"suffix": self.suffix} if self.suffix else {}),
                **({"adapter": self.adapter} if self.adapter else {})}

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
                   d.get("decision_reason", ""), tuple(d.get("prediction") or ()), bool(d.get("seeded")),
                   (int(d["k_min"]), int(d["k_max"])) if d.get("adaptive") else None,
                   Constraint.decode(d.get("constraint")), draft_priority=int(d.get("draft_priority") or 0),
                   suffix=d.get("suffix") or None, adapter=str(d.get("adapter") or ""))

    def span_attributes(self) -> dict[str, Any]:
        return {"specserve.workload_class": self.workload_class, "specserve.class_reason": self.class_reason,
                "specserve.policy_class": self.policy_class, "specserve.policy_version": self.policy_version,
                "specserve.decision": self.choice.decision.value, "specserve.decision_reason": self.decision_reason,
                "specserve.draft_pool": self.pool or "none", "specserve.shadow_pool": self.shadow_pool or "",
                "specserve.k": self.params.num_draft_tokens, "specserve.seed": str(self.seed),
                "specserve.adapter": self.adapter}
