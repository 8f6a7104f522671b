"""The speculation controller (DESIGN §4): per (workload class, draft pool) statistics in
Redis with exponential time decay, the expected-speedup model, and the per-request choice.

Statistics, `{p}:stats:{class}:{pool}` (plain rounds under pool `none`), one hash:
  n:{K}, d:{K}, v:{K}, o:{K}   decayed rounds run with K drafts, and their summed draft,
                               verify and other (network, Redis, router) milliseconds
  pe:{i}, pa:{i}               decayed count of rounds that evaluated / accepted draft
                               position i (1-based); α_i = pa_i / pe_i is the acceptance rate
                               of position i given that positions < i were accepted
  _t                           time of the last update (the decay clock)
Routers add batches with one Lua script that first decays every field by
2^(-Δt / half_life), so all replicas feed and read one estimate, recent rounds weigh most,
and the hash forgets a class that changed.

The model: E(K) = 1 + Σ_{i≤K} Π_{j≤i} α_j tokens per round; T(K) = draft(K) + verify(K) +
other(K), each linear in K and fitted over the K values seen (one K seen: draft ∝ K,
verify interpolated from the plain step); plain step T0 from the class's plain rounds.
S(K) = E(K) · T0 / T(K). The class speculates while max S ≥ 1 + margin.

Each router re-reads the statistics from Redis every `refresh_s`, so replicas agree. What a
request runs given these estimates is decided by the pure functions of
`specserve.control.arms` (ADR 0006).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # annotations only: the engine's K choice imports this module without a Redis client
    from redis.asyncio import Redis

log = logging.getLogger("specserve.control.controller")

PLAIN_POOL = "none"

# KEYS[1] stats hash. ARGV: now, half-life s, ttl s, then field/increment pairs.
_ADD = """
local now = tonumber(ARGV[1])
local last = tonumber(redis.call('HGET', KEYS[1], '_t'))
if last and now > last then
  local f = math.pow(0.5, (now - last) / tonumber(ARGV[2]))
  local all = redis.call('HGETALL', KEYS[1])
  for i = 1, #all, 2 do
    if all[i] ~= '_t' then
      redis.call('HSET', KEYS[1], all[i], tostring(tonumber(all[i + 1]) * f))
    end
  end
end
for i = 4, #ARGV, 2 do
  redis.call('HINCRBYFLOAT', KEYS[1], ARGV[i], ARGV[i + 1])
end
if not last or now > last then redis.call('HSET', KEYS[1], '_t', ARGV[1]) end
redis.call('EXPIRE', KEYS[1], ARGV[3])
return 1
"""


@dataclass
class Batch:
    """Increments for one stats hash, accumulated by a router between flushes."""

    inc: dict[str, float] = field(default_factory=lambda: defaultdict(float))

    def add_round(self, k: int, accepted: int, draft_ms: float, verify_ms: float, other_ms: float,
                  wait_ms: float = 0.0) -> None:
        self.inc[f"n:{k}"] += 1
        self.inc[f"d:{k}"] += draft_ms
        self.inc[f"v:{k}"] += verify_ms
        self.inc[f"o:{k}"] += other_ms
        if wait_ms:
            self.inc[f"w:{k}"] += wait_ms
        for i in range(1, min(accepted + 1, k) + 1):
            self.inc[f"pe:{i}"] += 1
        for i in range(1, accepted + 1):
            self.inc[f"pa:{i}"] += 1


@dataclass
class Estimate:
    spec_rounds: float = 0.0
    plain_rounds: float = 0.0
    seen: float = 0.0  # every speculative round ever recorded, decayed (> 0: measured once, maybe long ago)
    held: float = 0.0  # rounds of sessions on this pool the engine held plain (speculation not paying at its load)
    plain_from_pool: bool = False  # no plain statistics: plain_step_ms is this pool's step without its drafts
    acceptance: list[float] = field(default_factory=list)
    plain_step_ms: float = 0.0
    speedup: dict[int, float] = field(default_factory=dict)  # K -> S(K)
    round_ms: dict[int, float] = field(default_factory=dict)
    emitted: dict[int, float] = field(default_factory=dict)

    def realized(self, k_min: int, k_max: int) -> float:
        """S at the best K, where the engine speculated: its sessions' rounds held plain (S = 1)
        weigh in. A pool whose blocks the engine mostly declines at its loads (a slow draft)
        is worth little to the class, however well its few verified rounds did."""
        s = self.best(k_min, k_max)[1]
        share = self.spec_rounds / (self.spec_rounds + self.held) if self.spec_rounds + self.held > 0 else 1.0
        return 1.0 + (s - 1.0) * share if s else 0.0

    def best(self, k_min: int, k_max: int) -> tuple[int, float]:
        cands = [(s, -k) for k, s in self.speedup.items() if k_min <= k <= k_max]
        if not cands:
            return k_min, 0.0
        s, negk = max(cands)  # ties go to the smaller K (less wasted target work)
        return -negk, s


def _fields(raw: dict) -> dict[str, float]:
    out = {}
    for k, v in raw.items():
        k = k.decode() if isinstance(k, bytes) else k
        try:
            out[k] = float(v)
        except (TypeError, ValueError):
            continue
    return out


def _fit(points: list[tuple[float, float, float]]) -> tuple[float, float] | None:
    """Weighted least squares y = a + b·x over (x, y, weight); None with < 2 distinct x."""
    w = sum(p[2] for p in points)
    if w <= 0 or len({p[0] for p in points}) < 2:
        return None
    mx = sum(x * wt for x, _, wt in points) / w
    my = sum(y * wt for _, y, wt in points) / w
    sxx = sum(wt * (x - mx) ** 2 for x, _, wt in points)
    sxy = sum(wt * (x - mx) * (y - my) for x, y, wt in points)
    b = sxy / sxx if sxx > 0 else 0.0
    return my - b * mx, b


def _plain_step(spec: dict[str, float], plain: dict[str, float], ks: list[int], min_weight: float,
                est: Estimate) -> dict[str, float]:
    """A plain round's mean step, overhead and wait ({"v", "o", "w"}), from the class's plain
    statistics or, without them, from this pool's rounds at their smallest K (`estimate`);
    sets est.plain_rounds, plain_step_ms and plain_from_pool."""
    n0 = plain.get("n:0", 0.0)
    est.plain_rounds = n0
    if n0 >= min_weight:
        means = {c: plain.get(f"{c}:0", 0.0) / n0 for c in ("v", "o", "w")}
    elif ks:
        n = spec[f"n:{ks[0]}"]
        means = {"v": spec.get(f"v:{ks[0]}", 0.0) / n, "o": spec.get(f"o:{ks[0]}", 0.0) / n, "w": 0.0}
        est.plain_from_pool = True
    else:
        return {"v": 0.0, "o": 0.0, "w": 0.0}
    est.plain_step_ms = sum(means.values())  # a plain session's time a token: its step, and any wait for one
    return means


def estimate(spec: dict[str, float], plain: dict[str, float], k_max: int, min_weight: float = 0.5) -> Estimate:
    """S(K) for K in 1..k_max from a (class, pool) hash and the class's plain hash.

    Without plain statistics (an adaptive class speculates on every request, and the engine's
    plain rounds may be few), a plain step is priced as this pool's rounds at their smallest K
    without their drafting: the verify step is the batch's step at that load, one row a few
    tokens longer. That prices plain a little low, so S errs low; it is the same for every
    pool of the class, so it ranks pools as the plain statistics would (`plain_from_pool`)."""
    est = Estimate()
    ks = sorted({int(f[2:]) for f in spec if f.startswith("n:") and spec[f] >= min_weight and f[2:] != "0"})
    est.spec_rounds = sum(spec.get(f"n:{k}", 0.0) for k in ks)
    est.seen = sum(v for f, v in spec.items() if f.startswith("n:") and f != "n:0")
    est.held = spec.get("h:0", 0.0)
    per_plain = _plain_step(spec, plain, ks, min_weight, est)
    alphas: list[float] = []
    i = 1
    while spec.get(f"pe:{i}", 0.0) >= min_weight:
        alphas.append(min(max(spec.get(f"pa:{i}", 0.0) / spec[f"pe:{i}"], 0.0), 1.0))
        i += 1
    est.acceptance = alphas
    if not ks or not alphas or est.plain_step_ms <= 0:
        return est

    def mean(prefix: str, k: int) -> float:
        return spec.get(f"{prefix}:{k}", 0.0) / spec[f"n:{k}"]

    comps = {}
    for prefix in ("d", "v", "o", "w"):
        comps[prefix] = _fit([(k, mean(prefix, k), spec[f"n:{k}"]) for k in ks])
    k0 = ks[0]
    at_zero = {"d": 0.0, **per_plain}  # K = 0 is a plain step: no draft

    def component(prefix: str, k: int) -> float:
        fit = comps[prefix]
        if fit is not None and k >= k0:  # within and above the K values seen: the fitted line
            return max(fit[0] + fit[1] * k, 0.0)
        # one K seen, or below the smallest seen: between the plain step (K = 0) and what K0
        # cost, never the fitted line's intercept (a line through K = 4 and 8 can run below a
        # plain step at K = 1, and priced K = 1 rounds at 2 ms beside a 31 ms plain step)
        m = max(fit[0] + fit[1] * k0, 0.0) if fit is not None else mean(prefix, k0)
        if prefix in ("o", "w") and fit is None:
            return m
        return max(at_zero[prefix] + (m - at_zero[prefix]) * k / k0, 0.0)

    waited = any(f.startswith("w:") and f != "w:0" for f in spec)
    prod, emitted = 1.0, 1.0
    for k in range(1, k_max + 1):
        prod *= alphas[min(k, len(alphas)) - 1]  # unseen positions: the last rate seen
        emitted += prod
        # Where the engine measured the sessions' waits, they are the drafting on the critical
        # path (a block drafted ahead costs none; a late one its wait): the draft's compute is
        # then not added again. Statistics recorded before waits were measured keep it.
        t = (0.0 if waited else component("d", k)) + component("v", k) + component("o", k) + component("w", k)
        est.emitted[k] = emitted
        est.round_ms[k] = t
        # A round verifies at least a plain step, so S(K) <= E(K): one measured cheaper than the
        # plain step shows drift between their minutes (a dead pool once read S = 1.28, E = 1.01)
        est.speedup[k] = emitted * est.plain_step_ms / max(t, est.plain_step_ms) if t > 0 else 0.0
    return est


class Controller:
    def __init__(self, redis: Redis, prefix: str, half_life_s: float = 30.0, refresh_s: float = 0.5,
                 min_rounds: float = 8.0, ttl_s: int = 7 * 86400) -> None:
        self.redis = redis
        self.prefix = prefix
        self.half_life_s = half_life_s
        self.refresh_s = refresh_s
        self.min_rounds = min_rounds
        self.ttl_s = ttl_s
        self._add: Any = redis.register_script(_ADD)
        self._pending: dict[tuple[str, str], Batch] = {}
        self._stats: dict[tuple[str, str], dict[str, float]] = {}  # last read, by (class, pool)
        self._watch: set[tuple[str, str]] = set()
        self._task: asyncio.Task | None = None

    def key(self, workload_class: str, pool: str) -> str:
        return f"{self.prefix}:stats:{workload_class}:{pool}"

    # -- feeding ---------------------------------------------------------------------------
    def record_held(self, workload_class: str, pool: str) -> None:
        """A round of a session on `pool` that the engine held plain: speculation did not pay."""
        self._pending.setdefault((workload_class, pool), Batch()).inc["h:0"] += 1

    def record(self, workload_class: str, pool: str | None, k: int, accepted: int, draft_ms: float,
               verify_ms: float, other_ms: float, wait_ms: float = 0.0) -> None:
        key = (workload_class, pool or PLAIN_POOL)
        self._pending.setdefault(key, Batch()).add_round(k if pool else 0, accepted, draft_ms, verify_ms, other_ms,
                                                         wait_ms)

    async def flush(self) -> None:
        pending, self._pending = self._pending, {}
        now = repr(time.time())
        for (cls, pool), batch in pending.items():
            args: list[Any] = [now, self.half_life_s, self.ttl_s]
            for f, v in batch.inc.items():
                args += [f, repr(v)]
            try:
                await self._add(keys=[self.key(cls, pool)], args=args)
            except Exception as exc:  # statistics are best effort; serving goes on
                log.warning("stats flush for %s/%s failed: %s", cls, pool, exc)

    # -- reading ---------------------------------------------------------------------------
    async def refresh(self, keys: set[tuple[str, str]] | None = None) -> None:
        keys = set(self._watch) if keys is None else keys
        wanted = sorted(keys | {(c, PLAIN_POOL) for c, _ in keys})
        if not wanted:
            return
        async with self.redis.pipeline(transaction=False) as pipe:
            for cls, pool in wanted:
                pipe.hgetall(self.key(cls, pool))
            raws = await pipe.execute()
        for key, raw in zip(wanted, raws, strict=True):
            self._stats[key] = _decayed(_fields(raw), self.half_life_s)

    async def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self.flush()

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.refresh_s)
            try:
                await self.flush()
                await self.refresh()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("controller refresh failed: %s", exc)

    async def watch(self, workload_class: str, pools: Iterable[str]) -> None:
        """Keep (class, pool) statistics fresh from now on; the first time, read them now."""
        new = {(workload_class, p) for p in pools} - self._watch
        if new:
            self._watch |= new
            with contextlib.suppress(Exception):
                await self.refresh(new)

    def estimates(self, workload_class: str, pools: Iterable[str], k_max: int,
                  plain_from_pools: bool = False) -> dict[str, Estimate]:
        """S(K) for K in 1..k_max per pool, from the statistics last read (no I/O).

        `plain_from_pools` (an adaptive class): each pool's plain step is priced from its own
        rounds (`estimate`), not from the class's plain statistics. The class's rounds ran at
        whatever loads it met, and each pool's at different ones (a pool measured at 16
        streams has 16-row steps); against one plain figure, the pool measured at the lighter
        load would look faster. Against its own steps, a pool's S is its tokens a round times
        the share of its sessions' time spent in steps: what differs between pools at any
        load (acceptance, drafting, blocks that come late). Plain is the engine's to decide."""
        plain = {} if plain_from_pools else self._stats.get((workload_class, PLAIN_POOL), {})
        return {p: estimate(self._stats.get((workload_class, p), {}), plain, k_max) for p in pools}


def _decayed(stats: dict[str, float], half_life_s: float) -> dict[str, float]:
    """Bring a hash read from Redis to the present (the script decays only on writes)."""
    last = stats.pop("_t", None)
    if last is None:
        return stats
    f = 0.5 ** (max(time.time() - last, 0.0) / half_life_s)
    return {k: v * f for k, v in stats.items()}


SHADOW_FIELDS = ("requests", "agreed", "disagreed", "sampled", "failed", "rounds", "drafted", "accepted", "tokens",
                 "plain_seconds", "shadow_seconds")


class ShadowLog:
    """Cumulative shadow-mode outcomes per (class, pool): `{p}:shadow:{class}:{pool}` hash."""

    def __init__(self, redis: Redis, prefix: str, ttl_s: int) -> None:
        self.redis = redis
        self.prefix = prefix
        self.ttl_s = ttl_s

    def key(self, workload_class: str, pool: str) -> str:
        return f"{self.prefix}:shadow:{workload_class}:{pool}"

    async def add(self, workload_class: str, pool: str, inc: dict[str, float]) -> None:
        key = self.key(workload_class, pool)
        async with self.redis.pipeline(transaction=True) as pipe:
            for f, v in inc.items():
                pipe.hincrbyfloat(key, f, v)
            pipe.expire(key, self.ttl_s)
            await pipe.execute()

    async def summary(self, workload_class: str, pool: str) -> dict[str, float]:
        raw = _fields(await self.redis.hgetall(self.key(workload_class, pool)))
        return {f: raw.get(f, 0.0) for f in SHADOW_FIELDS}
