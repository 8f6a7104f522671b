"""Per workload class speculation policies, stored in Redis (DESIGN §4, §5).

  {p}:policy:{class}     hash: body (the policy as JSON), version, updated_by, updated_at
  {p}:policies           set: the classes that have a policy (listing never scans the keyspace)
  {p}:policy-audit       stream, capped: who, peer, at, action, class, old/new body + version
  {p}:policy-updates     pub/sub channel: "{class} {version}" after every change

A write is one Lua script: compare the stored version with the caller's expected version,
write, append the audit entry and publish, so a policy never changes without its audit
record and every router hears of it. Policies are configuration, not state: they carry no
TTL (there is one key per class); the audit stream is capped (ADR 0006).

Routers keep a `PolicyCache`: a full load at start, then the pub/sub channel (a change is
visible everywhere within milliseconds) and a periodic reload as a safety net for messages
lost while a connection was down.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import json
import logging
import math
import re
import time
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:  # annotations only: the engine (control.arms) imports this module without a Redis client
    from redis.asyncio import Redis

from specserve.errors import InvalidRequest
from specserve.params import MAX_K, check_k

log = logging.getLogger("specserve.control.policy")

MODES = ("enabled", "shadow", "off", "slice")  # slice: a rollout stage between shadow and enabled (ADR 0022)
DEFAULT_CLASS = "default"
CLASS_NAME = re.compile(r"^[a-z][a-z0-9_-]{0,63}$")
# a LoRA adapter's name (ADR 0029), and a policy's key: a class, or a class and an adapter
ADAPTER_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]{0,63}$")
POLICY_KEY = re.compile(r"^[a-z][a-z0-9_-]{0,63}(@[a-z0-9][a-z0-9._-]{0,63})?$")
ADAPTER_SEP = "@"
AUDIT_MAXLEN = 10_000
MAX_MARGIN = 10.0
MAX_PROBE = 0.5
MAX_DRAFT_PRIORITY = 9  # a class's draft_priority: 0 (the default, shed first) .. 9
OUTPUT_FORMATS = ("text", "json_object")  # a class's default output (schema-free JSON: ADR 0017)
# a class's suffix index (ADR 0026): the most outputs and tokens a target keeps of it (the
# index costs about 60 bytes a token), and the most a Redis stream of it holds
MAX_SUFFIX_REQUESTS = 1 << 16
MAX_SUFFIX_TOKENS = 1 << 21


class PolicyConflict(Exception):
    """The stored version is not the one the caller expected (compare-and-set lost)."""

    def __init__(self, workload_class: str, expected: int, current: int) -> None:
        super().__init__(f"policy {workload_class!r} is at version {current}, not {expected}: "
                         "read it again and retry")
        self.current = current


@dataclass(frozen=True)
class Policy:
    workload_class: str
    mode: str = "enabled"
    draft_pool: str = "small"  # the preferred pool (learned first, wins ties)
    draft_pools: tuple[str, ...] = ()  # more pools the controller may move the class to
    k: int = 4
    adaptive_k: bool = False
    k_min: int = 1
    k_max: int = 8
    temperature_ceiling: float | None = None  # None = no ceiling
    max_prompt_tokens: int = 0  # 0 = no limit
    safety_margin: float = 0.1
    probe_fraction: float = 0.05
    # what the class's requests produce when they name no constraint (ADR 0017)
    output_format: str = "text"
    # mode "slice": the share of the class's requests that speculate, in (0, 100), by a stable
    # hash of the request id (control/arms.py: in_slice)
    slice_percent: float = 0.0
    # rollout guards (ADR 0022, control/guards.py): back one stage by itself (slice -> shadow,
    # enabled -> a slice) when the slice's S falls below guard_min_speedup (at slice only), or
    # its accepted drafts a round below guard_min_accepted; 0 = that guard off
    guard_min_speedup: float = 1.0
    guard_min_accepted: float = 0.0
    # stage slice: promoted to enabled by itself once it has been clean this long since the
    # policy was last written (its guards measured and none tripped); 0 = promotion is explicit
    promote_after_s: float = 0.0
    # guards against the class's plain requests of the same window (control/guards.py:
    # ArmOutcomes), at slice and enabled: the speculating requests' TPOT p90 over plain's above
    # guard_max_tpot_ratio, or their error rate above plain's by more than guard_max_error_rate;
    # 0 = that guard off
    guard_max_tpot_ratio: float = 0.0
    guard_max_error_rate: float = 0.0
    # draft capacity (ADR 0021): on a saturated draft replica, a higher priority's sessions are
    # admitted and keep their drafts before a lower one's; in [0, MAX_DRAFT_PRIORITY]
    draft_priority: int = 0
    # the suffix pool (ADR 0026): the class's index of recent committed outputs, on every
    # target and shared through Redis, keeps at most suffix_max_requests outputs and
    # suffix_max_tokens tokens (least recently used out; 0 requests: the class keeps none);
    # its drafts stop below suffix_min_prob (a token's share of the matches' votes) and at
    # suffix_spec_factor x the match's length
    suffix_max_requests: int = 256
    suffix_max_tokens: int = 65536
    suffix_min_prob: float = 0.1
    suffix_spec_factor: float = 1.0
    version: int = 0
    updated_by: str = ""
    updated_at: float = 0.0

    def validate(self, pools: set[str] | None = None) -> Policy:
        """Raise InvalidRequest naming the first bad field; return self."""
        def bad(msg: str) -> InvalidRequest:
            return InvalidRequest(f"invalid policy for {self.workload_class!r}: {msg}")

        if not POLICY_KEY.match(self.workload_class):
            raise InvalidRequest(f"invalid workload class name {self.workload_class!r}: use lower-case letters, "
                                 "digits, '_' or '-', starting with a letter, at most 64 characters; for one LoRA "
                                 "adapter's requests of the class, CLASS@ADAPTER (ADR 0029)")
        if self.mode not in MODES:
            raise bad(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.mode != "off":
            if not self.draft_pool:
                raise bad("draft_pool is required unless mode is off")
            unknown = [p for p in self.pools if pools is not None and p not in pools]
            if unknown:
                raise bad(f"unknown draft_pool {unknown[0]!r}; "
                          f"this router has: {', '.join(sorted(pools or ())) or 'none'}")
        if self.adaptive_k:
            if not 1 <= self.k_min <= self.k_max <= MAX_K:
                raise bad(f"adaptive K needs 1 <= k_min <= k_max <= {MAX_K}, got [{self.k_min}, {self.k_max}]")
        else:
            try:
                check_k(self.k, "k", low=1)
            except InvalidRequest as exc:
                raise bad(f"{exc} (or use adaptive_k)") from None
        if self.temperature_ceiling is not None and not (0 <= self.temperature_ceiling <= 100
                                                         and math.isfinite(self.temperature_ceiling)):
            raise bad(f"temperature_ceiling must be in [0, 100], got {self.temperature_ceiling}")
        if self.max_prompt_tokens < 0:
            raise bad(f"max_prompt_tokens must be >= 0 (0 = no limit), got {self.max_prompt_tokens}")
        if not (0 <= self.safety_margin <= MAX_MARGIN):
            raise bad(f"safety_margin must be in [0, {MAX_MARGIN}], got {self.safety_margin}")
        if not (0 <= self.probe_fraction <= MAX_PROBE):
            raise bad(f"probe_fraction must be in [0, {MAX_PROBE}], got {self.probe_fraction}")
        if self.mode == "slice" and not (0 < self.slice_percent < 100 and math.isfinite(self.slice_percent)):
            raise bad(f"mode slice needs slice_percent in (0, 100), got {self.slice_percent}")
        if self.mode != "slice" and self.slice_percent:
            raise bad(f"slice_percent is for mode slice only (mode is {self.mode}); set it to 0")
        if not (0 <= self.guard_min_speedup <= MAX_MARGIN + 1 and math.isfinite(self.guard_min_speedup)):
            raise bad(f"guard_min_speedup must be in [0, {MAX_MARGIN + 1}] (0 = off), got {self.guard_min_speedup}")
        if not (0 <= self.promote_after_s <= 7 * 86400 and math.isfinite(self.promote_after_s)):
            raise bad(f"promote_after_s must be in [0, 604800] (0 = promotion is explicit), got {self.promote_after_s}")
        if not (0 <= self.guard_min_accepted <= MAX_K and math.isfinite(self.guard_min_accepted)):
            raise bad(f"guard_min_accepted must be in [0, {MAX_K}] (0 = off), got {self.guard_min_accepted}")
        if not (self.guard_max_tpot_ratio == 0 or 1 <= self.guard_max_tpot_ratio <= 100) \
                or not math.isfinite(self.guard_max_tpot_ratio):
            raise bad(f"guard_max_tpot_ratio must be 0 (off) or in [1, 100], got {self.guard_max_tpot_ratio}")
        if not (0 <= self.guard_max_error_rate <= 1 and math.isfinite(self.guard_max_error_rate)):
            raise bad(f"guard_max_error_rate must be in [0, 1] (0 = off), got {self.guard_max_error_rate}")
        if not (isinstance(self.draft_priority, int) and 0 <= self.draft_priority <= MAX_DRAFT_PRIORITY):
            raise bad(f"draft_priority must be an integer in [0, {MAX_DRAFT_PRIORITY}], got {self.draft_priority}")
        if self.output_format not in OUTPUT_FORMATS:
            raise bad(f"output_format must be one of {', '.join(OUTPUT_FORMATS)}, got {self.output_format!r}")
        self._validate_suffix(bad)
        return self

    def _validate_suffix(self, bad: Any) -> None:
        if not (isinstance(self.suffix_max_requests, int) and 0 <= self.suffix_max_requests <= MAX_SUFFIX_REQUESTS):
            raise bad(f"suffix_max_requests must be an integer in [0, {MAX_SUFFIX_REQUESTS}] (0: no index), "
                      f"got {self.suffix_max_requests}")
        if not (isinstance(self.suffix_max_tokens, int) and 0 <= self.suffix_max_tokens <= MAX_SUFFIX_TOKENS):
            raise bad(f"suffix_max_tokens must be an integer in [0, {MAX_SUFFIX_TOKENS}], got {self.suffix_max_tokens}")
        if not (0 <= self.suffix_min_prob <= 1 and math.isfinite(self.suffix_min_prob)):
            raise bad(f"suffix_min_prob must be in [0, 1], got {self.suffix_min_prob}")
        if not (0 < self.suffix_spec_factor <= MAX_K and math.isfinite(self.suffix_spec_factor)):
            raise bad(f"suffix_spec_factor must be in (0, {MAX_K}], got {self.suffix_spec_factor}")

    def suffix(self) -> dict[str, float | int]:
        """The class's suffix settings as the session's plan carries them to the engine."""
        return {"max_requests": self.suffix_max_requests, "max_tokens": self.suffix_max_tokens,
                "min_prob": self.suffix_min_prob, "spec_factor": self.suffix_spec_factor}

    @property
    def pools(self) -> tuple[str, ...]:
        """Every pool the class may speculate with, the preferred one first."""
        return tuple(dict.fromkeys(p for p in (self.draft_pool, *self.draft_pools) if p))

    @property
    def k_range(self) -> tuple[int, int]:
        return (self.k_min, self.k_max) if self.adaptive_k else (self.k, self.k)

    def body(self) -> str:
        """The stored JSON: everything but the server-set fields."""
        d = asdict(self)
        for f in ("version", "updated_by", "updated_at"):
            d.pop(f)
        return json.dumps(d, sort_keys=True)

    @classmethod
    def from_body(cls, body: str | bytes, version: int = 0, updated_by: str = "", updated_at: float = 0.0) -> Policy:
        d = json.loads(body)
        known = {f for f in cls.__dataclass_fields__}
        d = {k: v for k, v in d.items() if k in known}  # fields from a newer router are ignored
        d["draft_pools"] = tuple(d.get("draft_pools", ()))
        return cls(**d, version=version, updated_by=updated_by, updated_at=updated_at)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Policy:
        """From user input (CLI file, Helm values): unknown keys are an error, not ignored."""
        known = set(cls.__dataclass_fields__)
        extra = set(d) - known
        if extra:
            raise InvalidRequest(f"unknown policy field(s): {', '.join(sorted(extra))}; "
                                 f"known: {', '.join(sorted(known))}")
        try:
            return cls(**{**d, "draft_pools": tuple(d.get("draft_pools", ()))})
        except TypeError as exc:
            raise InvalidRequest(f"bad policy: {exc}") from exc


@dataclass(frozen=True)
class AuditEntry:
    at: float
    who: str
    peer: str
    action: str
    workload_class: str
    old: Policy | None
    new: Policy | None
    comment: str = ""


# KEYS: policy hash, audit stream, class index. ARGV: class, body ("" = delete), expected version ("" = any),
# who, peer, now, comment, channel, audit maxlen, action
_WRITE = """
local cur = redis.call('HMGET', KEYS[1], 'body', 'version', 'updated_by', 'updated_at')
local curver = tonumber(cur[2]) or 0
if ARGV[3] ~= '' and tonumber(ARGV[3]) ~= curver then
  return {'conflict', curver}
end
local newver = 0
if ARGV[2] == '' then
  if curver == 0 then return {'absent', 0} end
  redis.call('DEL', KEYS[1])
  redis.call('SREM', KEYS[3], ARGV[1])
else
  newver = curver + 1
  redis.call('HSET', KEYS[1], 'body', ARGV[2], 'version', newver, 'updated_by', ARGV[4], 'updated_at', ARGV[6])
  redis.call('SADD', KEYS[3], ARGV[1])
end
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[9], '*',
  'at', ARGV[6], 'who', ARGV[4], 'peer', ARGV[5], 'action', ARGV[10], 'class', ARGV[1],
  'old_body', cur[1] or '', 'old_version', curver, 'old_by', cur[3] or '', 'old_at', cur[4] or '0',
  'new_body', ARGV[2], 'new_version', newver, 'comment', ARGV[7])
redis.call('PUBLISH', ARGV[8], ARGV[1] .. ' ' .. newver)
return {'ok', newver}
"""


def _s(v: bytes | str | None) -> str:
    return v.decode() if isinstance(v, bytes) else (v or "")


class PolicyStore:
    def __init__(self, redis: Redis, prefix: str = "specserve") -> None:
        self.redis = redis
        self.prefix = prefix
        self.channel = f"{prefix}:policy-updates"  # (a pub/sub channel, not a key)
        # one hash tag for every policy key: the write script's three keys share a Redis
        # Cluster slot (ADR 0023)
        self.index_key = f"{prefix}:{{policies}}"
        self.audit_key = f"{prefix}:{{policies}}:audit"
        self._write: Any = redis.register_script(_WRITE)

    def key(self, workload_class: str) -> str:
        return f"{self.prefix}:{{policies}}:class:{workload_class}"

    async def migrate_layout(self) -> int:
        """Policies stored under the keys before ADR 0023 (`{p}:policies`, `{p}:policy:{class}`,
        `{p}:policy-audit`) copied to today's, once (only while today's index is empty, and by one
        router of several starting together: the first to set the marker): an upgraded router
        keeps the policies set at run time. Returns how many were copied."""
        old_index, r = f"{self.prefix}:policies", cast(Any, self.redis)
        if await r.exists(self.index_key) or not await r.exists(old_index):
            return 0
        if not await r.set(f"{self.index_key}:migrated", "1", nx=True):
            return 0  # another router is copying them
        classes = sorted(_s(c) for c in await r.smembers(old_index))
        for c in classes:
            raw = await r.hgetall(f"{self.prefix}:policy:{c}")
            if raw:
                await r.hset(self.key(c), mapping=raw)
                await r.sadd(self.index_key, c)
        for _entry_id, fields in await r.xrange(f"{self.prefix}:policy-audit", count=AUDIT_MAXLEN):
            await r.xadd(self.audit_key, fields)
        return len(classes)

    async def get(self, workload_class: str) -> Policy | None:
        raw = await self.redis.hgetall(self.key(workload_class))
        return _from_hash(raw)

    async def list(self) -> list[Policy]:  # noqa: A003
        classes = sorted(_s(c) for c in await self.redis.smembers(self.index_key))
        if not classes:
            return []
        async with self.redis.pipeline(transaction=False) as pipe:
            for c in classes:
                pipe.hgetall(self.key(c))
            raws = await pipe.execute()
        return [p for p in (_from_hash(r) for r in raws) if p is not None]

    async def set(self, policy: Policy, who: str, peer: str = "", expected_version: int | None = None,
                  comment: str = "", action: str = "set") -> Policy:
        now = time.time()
        status, version = await self._write(
            keys=[self.key(policy.workload_class), self.audit_key, self.index_key],
            args=[policy.workload_class, policy.body(), "" if expected_version is None else expected_version,
                  who, peer, repr(now), comment, self.channel, AUDIT_MAXLEN, action])
        if _s(status) == "conflict":
            raise PolicyConflict(policy.workload_class, int(expected_version or 0), int(version))
        return replace(policy, version=int(version), updated_by=who, updated_at=now)

    async def delete(self, workload_class: str, who: str, peer: str = "", expected_version: int | None = None,
                     comment: str = "") -> bool:
        status, version = await self._write(
            keys=[self.key(workload_class), self.audit_key, self.index_key],
            args=[workload_class, "", "" if expected_version is None else expected_version, who, peer,
                  repr(time.time()), comment, self.channel, AUDIT_MAXLEN, "delete"])
        if _s(status) == "conflict":
            raise PolicyConflict(workload_class, int(expected_version or 0), int(version))
        return _s(status) == "ok"

    async def audit(self, workload_class: str = "", limit: int = 50) -> builtins.list[AuditEntry]:
        """Newest first."""
        out: list[AuditEntry] = []
        last = "+"
        while len(out) < limit:
            batch = await self.redis.xrevrange(self.audit_key, max=last, count=200)
            if not batch:
                break
            for _entry_id, fields in batch:
                f = {_s(k): _s(v) for k, v in (fields or {}).items()}
                if not workload_class or f["class"] == workload_class:
                    out.append(_audit(f))
                    if len(out) >= limit:
                        break
            last = "(" + _s(batch[-1][0])
            if len(batch) < 200:
                break
        return out


def _from_hash(raw: dict) -> Policy | None:
    if not raw:
        return None
    f = {_s(k): _s(v) for k, v in raw.items()}
    if "body" not in f:
        return None
    return Policy.from_body(f["body"], int(f.get("version") or 0), f.get("updated_by", ""),
                            float(f.get("updated_at") or 0))


def _audit(f: dict[str, str]) -> AuditEntry:
    old = Policy.from_body(f["old_body"], int(f["old_version"]), f.get("old_by", ""), float(f.get("old_at") or 0)) \
        if f.get("old_body") else None
    new = Policy.from_body(f["new_body"], int(f["new_version"]), f["who"], float(f["at"])) \
        if f.get("new_body") else None
    return AuditEntry(at=float(f["at"]), who=f["who"], peer=f.get("peer", ""), action=f["action"],
                      workload_class=f["class"], old=old, new=new, comment=f.get("comment", ""))


@dataclass
class PolicyCache:
    """A router's view of every stored policy, kept current by pub/sub."""

    store: PolicyStore
    builtin: Policy  # what `default` means while no `default` policy is stored
    reload_s: float = 5.0
    policies: dict[str, Policy] = field(default_factory=dict)
    _task: asyncio.Task | None = None

    async def start(self) -> None:
        await self.reload()
        self._task = asyncio.create_task(self._follow())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def reload(self) -> None:
        self.policies = {p.workload_class: p for p in await self.store.list()}

    async def apply(self, message: str) -> None:
        """Apply one update message ("{class} {version}"); the admin calls it for its own writes."""
        cls, _, version = message.partition(" ")
        have = self.policies.get(cls)
        if have is not None and version.isdigit() and int(version) != 0 and have.version >= int(version):
            return
        policy = await self.store.get(cls)
        if policy is None:
            self.policies.pop(cls, None)
        else:
            self.policies[cls] = policy

    async def _follow(self) -> None:
        """Subscribe; after each (re)subscription reload everything (messages sent while
        disconnected are lost); reload every `reload_s` regardless."""
        while True:
            pubsub = self.store.redis.pubsub()
            try:
                await pubsub.subscribe(self.store.channel)
                await self.reload()
                next_reload = time.monotonic() + self.reload_s
                while True:
                    msg = await pubsub.get_message(ignore_subscribe_messages=True,
                                                   timeout=max(next_reload - time.monotonic(), 0.01))
                    if msg is not None and msg.get("type") == "message":
                        await self.apply(_s(msg["data"]))
                    if time.monotonic() >= next_reload:
                        await self.reload()
                        next_reload = time.monotonic() + self.reload_s
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis restarting: try again shortly
                log.warning("policy updates: %s; resubscribing", exc)
                await asyncio.sleep(0.5)
            finally:
                with contextlib.suppress(Exception):
                    await pubsub.aclose()

    def effective(self, workload_class: str) -> tuple[Policy, str]:
        """(policy, source): the class's own, else `default`, else the built-in default. A key
        CLASS@ADAPTER (ADR 0029) takes its own policy, else its class's (source "class" both)."""
        own = self.policies.get(workload_class)
        if own is None and ADAPTER_SEP in workload_class:
            own = self.policies.get(workload_class.partition(ADAPTER_SEP)[0])
        if own is not None:
            return own, "class"
        default = self.policies.get(DEFAULT_CLASS)
        if default is not None:
            return default, "default"
        return self.builtin, "builtin"

    def known(self, workload_class: str) -> bool:
        return workload_class in self.policies
