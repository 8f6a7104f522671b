"""`specserve.v1.PolicyAdmin`: per class policies in Redis, behind an admin token.

Every call needs `authorization: Bearer <token>`: none -> UNAUTHENTICATED, a token this
router does not know -> PERMISSION_DENIED. The token's name is the audit log's "who".
Writes go through PolicyStore (CAS + audit + publish in one script); every router replica,
this one included, applies a change from the pub/sub message.
"""

from __future__ import annotations

import hmac
import math
from typing import Any

import grpc

from specserve.control.controller import ShadowLog
from specserve.control.policy import (
    POLICY_KEY,
    AuditEntry,
    Policy,
    PolicyCache,
    PolicyConflict,
    PolicyStore,
)
from specserve.errors import InvalidRequest
from specserve.services.router.planner import Planner
from specserve.v1 import policy_pb2, policy_pb2_grpc

MODE_TO_PB = {"enabled": policy_pb2.POLICY_MODE_ENABLED, "shadow": policy_pb2.POLICY_MODE_SHADOW,
              "off": policy_pb2.POLICY_MODE_OFF, "slice": policy_pb2.POLICY_MODE_SLICE}
PB_TO_MODE = {v: k for k, v in MODE_TO_PB.items()}


def policy_to_pb(p: Policy) -> policy_pb2.Policy:
    msg = policy_pb2.Policy(
        workload_class=p.workload_class, mode=MODE_TO_PB[p.mode], draft_pool=p.draft_pool,
        draft_pools=list(p.draft_pools), k=p.k,
        adaptive_k=p.adaptive_k, k_min=p.k_min, k_max=p.k_max, max_prompt_tokens=p.max_prompt_tokens,
        safety_margin=p.safety_margin, probe_fraction=p.probe_fraction, output_format=p.output_format,
        slice_percent=p.slice_percent, guard_min_speedup=p.guard_min_speedup,
        guard_min_accepted=p.guard_min_accepted, promote_after_s=p.promote_after_s,
        guard_max_tpot_ratio=p.guard_max_tpot_ratio, guard_max_error_rate=p.guard_max_error_rate,
        draft_priority=p.draft_priority, suffix_max_requests=p.suffix_max_requests,
        suffix_max_tokens=p.suffix_max_tokens, suffix_min_prob=p.suffix_min_prob,
        suffix_spec_factor=p.suffix_spec_factor, version=p.version,
        updated_by=p.updated_by, updated_at=p.updated_at)
    if p.temperature_ceiling is not None:
        msg.temperature_ceiling = p.temperature_ceiling
    return msg


def policy_from_pb(msg: policy_pb2.Policy) -> Policy:
    if msg.mode not in PB_TO_MODE:
        raise InvalidRequest(f"policy mode is required: one of {', '.join(MODE_TO_PB)}")
    for name in ("safety_margin", "probe_fraction", "temperature_ceiling", "slice_percent", "guard_min_speedup",
                 "guard_min_accepted", "promote_after_s", "guard_max_tpot_ratio", "guard_max_error_rate",
                 "suffix_min_prob", "suffix_spec_factor"):
        value = getattr(msg, name)
        if not math.isfinite(value):
            raise InvalidRequest(f"{name} must be a finite number")
    return Policy(workload_class=msg.workload_class, mode=PB_TO_MODE[msg.mode], draft_pool=msg.draft_pool,
                  draft_pools=tuple(msg.draft_pools),
                  k=msg.k, adaptive_k=msg.adaptive_k, k_min=msg.k_min, k_max=msg.k_max,
                  temperature_ceiling=msg.temperature_ceiling if msg.HasField("temperature_ceiling") else None,
                  max_prompt_tokens=msg.max_prompt_tokens, safety_margin=msg.safety_margin,
                  probe_fraction=msg.probe_fraction, output_format=msg.output_format or "text",
                  slice_percent=msg.slice_percent,
                  guard_min_speedup=msg.guard_min_speedup if msg.HasField("guard_min_speedup") else 1.0,
                  guard_min_accepted=msg.guard_min_accepted, promote_after_s=msg.promote_after_s,
                  guard_max_tpot_ratio=msg.guard_max_tpot_ratio, guard_max_error_rate=msg.guard_max_error_rate,
                  draft_priority=msg.draft_priority, **_suffix_from_pb(msg))


def _suffix_from_pb(msg: policy_pb2.Policy) -> dict[str, Any]:
    """The suffix fields a message sets (unset: the policy's defaults)."""
    return {name: getattr(msg, name) for name in ("suffix_max_requests", "suffix_max_tokens", "suffix_min_prob",
                                                  "suffix_spec_factor") if msg.HasField(name)}


def audit_to_pb(e: AuditEntry) -> policy_pb2.AuditEntry:
    msg = policy_pb2.AuditEntry(at=e.at, who=e.who, peer=e.peer, action=e.action, workload_class=e.workload_class,
                                comment=e.comment)
    if e.old is not None:
        msg.old.CopyFrom(policy_to_pb(e.old))
    if e.new is not None:
        msg.new.CopyFrom(policy_to_pb(e.new))
    return msg


async def authorize(tokens: dict[str, str], context, service: str, what: str) -> str:
    """The admin token's name (the audit log's "who"), or the call aborted: no token ->
    UNAUTHENTICATED, one this router does not know -> PERMISSION_DENIED."""
    header = next((v for k, v in (context.invocation_metadata() or ()) if k == "authorization"), "")
    if not header:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                            f"{service} needs an admin token: metadata 'authorization: Bearer <token>'")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "malformed authorization: use 'Bearer <token>'")
    if not tokens:
        await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                            f"{what} is disabled on this router: no admin token is configured")
    for name, expected in tokens.items():
        if hmac.compare_digest(token.encode(), expected.encode()):
            return name
    await context.abort(grpc.StatusCode.PERMISSION_DENIED, "the admin token is not valid")
    raise AssertionError("unreachable")


def _class_name(name: str) -> str:
    if not POLICY_KEY.match(name):
        raise InvalidRequest(f"invalid workload class name {name!r}")
    return name


class PolicyAdminServicer(policy_pb2_grpc.PolicyAdminServicer):
    def __init__(self, store: PolicyStore, cache: PolicyCache, planner: Planner, tokens: dict[str, str],
                 shadow_log: ShadowLog) -> None:
        self.store = store
        self.cache = cache
        self.planner = planner  # the pools this router has, and the controller's assessment
        self.tokens = {name: tok for name, tok in tokens.items() if tok}
        self.shadow_log = shadow_log

    async def _who(self, context) -> str:
        return await authorize(self.tokens, context, "PolicyAdmin", "policy administration")

    async def GetPolicy(self, request, context):
        await self._who(context)
        policy = await self.store.get(_class_name(request.workload_class))
        if policy is None:
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"no policy for class {request.workload_class!r}; it falls under 'default'")
        return policy_to_pb(policy)

    async def ListPolicies(self, request, context):
        await self._who(context)
        return policy_pb2.ListPoliciesResponse(policies=[policy_to_pb(p) for p in await self.store.list()])

    async def SetPolicy(self, request, context):
        who = await self._who(context)
        if not request.HasField("policy"):
            raise InvalidRequest("SetPolicy needs a policy")
        policy = policy_from_pb(request.policy).validate(self.planner.pools)
        expected = request.expected_version if request.HasField("expected_version") else None
        try:
            stored = await self.store.set(policy, who, context.peer() or "", expected, request.comment)
        except PolicyConflict as exc:
            await context.abort(grpc.StatusCode.ABORTED, str(exc))
        await self.cache.apply(f"{stored.workload_class} {stored.version}")  # this replica at once
        return policy_to_pb(stored)

    async def DeletePolicy(self, request, context):
        who = await self._who(context)
        cls = _class_name(request.workload_class)
        expected = request.expected_version if request.HasField("expected_version") else None
        try:
            deleted = await self.store.delete(cls, who, context.peer() or "", expected, request.comment)
        except PolicyConflict as exc:
            await context.abort(grpc.StatusCode.ABORTED, str(exc))
        await self.cache.apply(f"{cls} 0")
        return policy_pb2.DeletePolicyResponse(deleted=deleted)

    async def GetEffectivePolicy(self, request, context):
        await self._who(context)
        policy, source, stats_class, a = await self.planner.effective(_class_name(request.workload_class))
        est = a.estimate
        d = policy_pb2.ControllerDecision(
            decision=a.decision.value, reason=a.reason, k=a.k, expected_speedup=a.speedup,
            spec_rounds=est.spec_rounds, plain_rounds=est.plain_rounds, acceptance=est.acceptance,
            plain_step_ms=est.plain_step_ms, draft_pool=a.pool)
        for k, s in est.speedup.items():
            d.speedup_by_k[k] = s
        for pool, e in a.estimates.items():
            d.speedup_by_pool[pool] = e.best(*policy.k_range)[1]
        shadow = await self.shadow_log.summary(stats_class, a.pool or policy.draft_pool)
        return policy_pb2.EffectivePolicy(policy=policy_to_pb(policy), source=source, decision=d,
                                          stats_class=stats_class, shadow=policy_pb2.ShadowSummary(**shadow))

    async def ListAudit(self, request, context):
        await self._who(context)
        cls = _class_name(request.workload_class) if request.workload_class else ""
        limit = request.limit or 50
        if limit > 1000:
            raise InvalidRequest("limit must be at most 1000")
        entries = await self.store.audit(cls, limit)
        return policy_pb2.ListAuditResponse(entries=[audit_to_pb(e) for e in entries])
