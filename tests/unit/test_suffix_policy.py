"""The suffix pool under the control plane (ADR 0026): its settings are a class's policy fields,
checked, carried on the admin API (unset on the wire = the defaults) and in the session's plan
to the engine; the pool is an address like the other in-target pools; and the controller
chooses it per class, by the same rules and rollout stages as any pool."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from pydantic import ValidationError

from specserve.config import LOCAL_SUFFIX, RouterSettings, TargetSettings
from specserve.control.arms import Decision, RequestFacts, choose_arm
from specserve.control.controller import Estimate
from specserve.control.policy import Policy
from specserve.engine.session import EnginePlan
from specserve.engine.suffix_pool import settings_of
from specserve.errors import InvalidRequest
from specserve.params import GenerationParams
from specserve.services.router.admin import policy_from_pb, policy_to_pb
from specserve.services.router.plan import SessionPlan
from specserve.services.router.planner import suffix_settings
from specserve.v1 import policy_pb2


def test_a_classs_suffix_settings_are_checked_and_travel_to_the_engine():
    p = Policy("agent", draft_pool="suffix", suffix_max_requests=64, suffix_min_prob=0.25)
    assert policy_from_pb(policy_to_pb(p)) == p and Policy.from_body(p.body()) == p
    for bad in ({"suffix_max_requests": -1}, {"suffix_max_requests": 1 << 20}, {"suffix_max_tokens": 1 << 30},
                {"suffix_min_prob": 1.5}, {"suffix_spec_factor": 0.0}, {"suffix_spec_factor": float("nan")}):
        with pytest.raises(InvalidRequest, match=next(iter(bad))):
            replace(p, **bad).validate()
    # a client that does not know the fields sends none: the defaults, not zeros (no index)
    msg = policy_to_pb(p)
    for name in ("suffix_max_requests", "suffix_max_tokens", "suffix_min_prob", "suffix_spec_factor"):
        msg.ClearField(name)
    old = policy_from_pb(msg)
    assert (old.suffix_max_requests, old.suffix_max_tokens, old.suffix_min_prob) == (256, 65536, 0.1)
    with pytest.raises(InvalidRequest, match="finite"):
        policy_from_pb(policy_pb2.Policy(workload_class="x", mode=policy_pb2.POLICY_MODE_ENABLED,
                                         suffix_min_prob=float("inf")))
    # the router writes them into the session's plan where they are not the defaults
    assert suffix_settings(Policy("agent")) is None
    stored = suffix_settings(p)
    assert stored == {"max_requests": 64, "max_tokens": 65536, "min_prob": 0.25, "spec_factor": 1.0}
    from specserve.control.arms import Choice, Fallback

    plan = SessionPlan(GenerationParams(max_tokens=8, seed=1), "agent", "explicit", "agent",
                       Choice("suffix", 32, False, Decision.PINNED, Fallback.NONE), suffix=stored)
    encoded = plan.encode()
    assert SessionPlan.decode(encoded).suffix == stored
    engine_plan = EnginePlan.from_stored(encoded)
    assert settings_of(engine_plan).max_requests == 64 and settings_of(engine_plan).min_prob == 0.25
    # the index is the statistics' class (bounded: `other` for a class no policy names), constrained or not
    assert replace(engine_plan, stats_class="extraction+json_object").index_class == "extraction"


@pytest.mark.parametrize("settings", [RouterSettings, TargetSettings])
def test_local_suffix_is_a_pools_only_address(settings):
    assert settings(draft_pools={"suffix": [LOCAL_SUFFIX]}).draft_pools["suffix"] == [LOCAL_SUFFIX]
    for bad in ([LOCAL_SUFFIX, "127.0.0.1:1"], [LOCAL_SUFFIX, "local:ngram"], ["local:suffixes"]):
        with pytest.raises(ValidationError, match="only address"):
            settings(draft_pools={"suffix": bad})


def _est(s: float, rounds: float = 50.0) -> Estimate:
    return Estimate(spec_rounds=rounds, plain_rounds=rounds, seen=rounds, acceptance=[0.9],
                    plain_step_ms=10.0, speedup={32: s}, round_ms={32: 10.0})


def test_the_controller_chooses_the_suffix_pool_per_class_where_it_pays():
    """Two classes allowing the same pools: the repeat-heavy one's statistics put the suffix
    pool first, the other's the model pool; a class where nothing pays runs plain; and a class
    in a rollout slice keeps the suffix pool to its slice (controlled inputs)."""
    pools = {"small", "ngram", "suffix"}
    policy = Policy("agent", draft_pool="small", draft_pools=("ngram", "suffix"), k=32, probe_fraction=0.0)
    rng = random.Random(1)
    facts = RequestFacts(temperature=0.0, prompt_tokens=100, request_id="r1")
    agent = {"small": _est(1.6), "ngram": _est(1.1), "suffix": _est(3.2)}
    chat = {"small": _est(1.5), "ngram": _est(1.0), "suffix": _est(1.2)}
    choice, a = choose_arm(facts, policy, pools, agent, rng, 8.0)
    assert (choice.pool, choice.decision, a.pool) == ("suffix", Decision.SPECULATE, "suffix")
    choice, _ = choose_arm(facts, replace(policy, workload_class="chat"), pools, chat, rng, 8.0)
    assert choice.pool == "small"
    slow = {p: _est(0.8) for p in pools}
    choice, a = choose_arm(facts, policy, pools, slow, rng, 8.0)
    assert choice.pool is None and a.decision is Decision.PLAIN
    sliced = replace(policy, mode="slice", slice_percent=50.0)
    arms = [choose_arm(replace(facts, request_id=f"r{i}"), sliced, pools, agent, rng, 8.0)[0] for i in range(200)]
    inside = [c for c in arms if c.pool is not None]
    assert 60 < len(inside) < 140 and {c.pool for c in inside} == {"suffix"}
