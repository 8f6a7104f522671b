"""The engine's speculation decisions, in one object beside the loop (ADR 0014): how long a
row waits for its block, whether a step is held for blocks about to land, each session's K
and tree width, commit back-pressure, and what the engine learns from every round to make
them. The loop (engine/loop.py) schedules, runs and settles; it asks this object and tells
it what happened. Torch-free.

K, one name throughout: the number of drafts a round verifies.
- `EnginePlan.k`: its ceiling for the session; `EnginePlan.k_min`: its floor for an adaptive
  session (a speculative round verifies at least this many);
- `GenerationParams.num_draft_tokens`: the request's K, where an adaptive session starts;
- `EngineSession.k_choice`: the K this object chose for the session's next round;
  `EngineSession.k_next`: that K within the plan's ceiling and the tokens left to generate;
- `RoundStats.k`: the drafts a round verified; `RoundStats.k_asked`: the K it asked for.

Every measured average is an exponential moving average (`ema`) with its weight named below,
and every tuning knob is in `SpeculationSettings`, so a reader finds them in one place.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from specserve.engine.kchoice import (
    PRIOR_ALPHA,
    PROBE_EVERY,
    PROBE_ROUNDS,
    Acceptance,
    Siblings,
    choose_k,
    expected_emitted,
    prior_cost,
    speedups,
)
from specserve.engine.scheduler import DRAFT_LATE, Row, gather_wait
from specserve.engine.session import PRIOR_EMITTED, DraftBlock, EngineSession
from specserve.step import tree_depth
from specserve.worker.cost import CostModel

if TYPE_CHECKING:  # (an annotation only)
    from specserve.algorithm.rejection import Verdict

# The weights a new sample gets in the engine's averages. Short memories, because load and
# acceptance move within seconds: about the last 5 samples at 0.2, 3 at 0.3, 10 at 0.1.
STEP_WEIGHT = 0.2  # the recent forward time: prices a late block's wait and the gather-hold
EMITTED_WEIGHT = 0.3  # a session's tokens a verified round: what waiting for its next block is worth
AHEAD_WEIGHT = 0.1  # per pool, the share of blocks drafted ahead (there when the round starts)
LATENCY_WEIGHT = 0.2  # per pool, drafting time per position, from the ask to the block's arrival

HOLD_SLACK = 0.2  # a gather-hold lasts this share of a step past the last block it waits for
TREE_MARGIN = 0.05  # a tree replaces the chain only if it emits this much more per second
TREE_PROBE_EVERY = 8  # while the engine cannot price trees yet: one block in this many is one
TREE_TRIALS = 4.0  # sibling trials of a class before its rate is trusted over the prior
MAX_ASKS = 8  # asks remembered per session, by committed length, until their block arrives

ClassPool = tuple[str, str]  # (workload class, draft pool): what acceptance and estimates are kept by


def ema(average: float, sample: float, weight: float) -> float:
    """An exponential moving average's next value: `weight` of the new sample."""
    return average + weight * (sample - average)


@dataclass(frozen=True)
class SpeculationSettings:
    """The engine's speculation knobs (the target service's settings set them)."""

    # the longest a row waits for its late block; also the step time assumed before any step
    block_wait_max_s: float = 0.005
    # how long an exact session (plan.exact) waits for its block before it runs plain anyway:
    # longer than a draft source's failover (engine/remote_drafts.py, 1 s). Kept from before the
    # coupled sampler (ADR 0027), under which a plain round no longer changes an exact session's
    # tokens, only its speed: ADR 0027 leaves its removal to a later change
    exact_wait_s: float = 5.0
    # commit back-pressure: a session with this many rounds handed to the committer and not yet
    # answered by Redis runs no further round until one is (0 = unbounded). Through a Redis
    # outage its provisional work stays bounded, not max_tokens long.
    max_commit_lag: int = 0
    gather: bool = True  # hold a step for blocks due within it when that pays (`hold`)
    # token trees (ADR 0020): at most this many candidates at a block's first position, for
    # greedy sessions, where the cost model says the wider verify pays (`width`); 1: chains.
    tree_width: int = 1
    tree_always: bool = False  # a tree wherever one may be drafted, whatever it costs (benchmarks, tests)


@dataclass
class Measured:
    """The engine's measured averages, each an `ema`."""

    step_ms: float  # the recent forward time: prices a late block
    # per pool: seconds from asking for a block to its arrival, per draft position, over the
    # blocks not drafted ahead: what a round waits for its drafts, beside the verify
    draft_latency: dict[str, float] = field(default_factory=dict)
    # per pool: the share of rounds whose block was drafted ahead, ready at the commit (no wait)
    ahead_share: dict[str, float] = field(default_factory=dict)

    def forward(self, ms: float) -> None:
        self.step_ms = ema(self.step_ms, ms, STEP_WEIGHT)

    def drafted(self, pool: str, seconds_per_position: float) -> None:
        old = self.draft_latency.get(pool, seconds_per_position)
        self.draft_latency[pool] = ema(old, seconds_per_position, LATENCY_WEIGHT)

    def ahead(self, pool: str, ready: bool) -> None:
        self.ahead_share[pool] = ema(self.ahead_share.get(pool, 0.0), float(ready), AHEAD_WEIGHT)


class Speculation:
    """What the engine decides about speculation, and what it has learnt to decide it: the
    step cost fit, per (class, pool) acceptance and tree siblings, and the averages."""

    def __init__(self, settings: SpeculationSettings, clock: Callable[[], float],
                 serial_pools: Collection[str] = ()) -> None:
        self.settings = settings
        self.clock = clock
        # pools drafted on the engine's thread between steps (LocalDrafts): their drafting
        # lengthens every session's step, so it is priced by the step's sessions, not as a wait
        self.serial_pools = frozenset(serial_pools)
        self.measured = Measured(step_ms=settings.block_wait_max_s * 1e3)
        self.cost = CostModel()  # step time by rows and tokens: prices K at the current load
        self.acceptance: dict[ClassPool, Acceptance] = {}
        # how often a tree's other first candidates held the target's token where its first did
        # not (prices a tree's extra candidates)
        self.siblings: dict[ClassPool, Siblings] = {}
        self.estimates: dict[ClassPool, dict[int, float]] = {}  # S(K), last computed
        self._k_this_step: dict[tuple[str, str, int, int], int] = {}
        # the last K chosen per (class, pool, K bounds): a new adaptive session starts there
        self._k_last: dict[tuple[str, str, int, int], int] = {}

    # ---- a step ----
    def new_step(self, forward_ms: float) -> None:
        """A forward ran: its time joins the average, and K is chosen afresh this step."""
        self.measured.forward(forward_ms)
        self._k_this_step = {}

    def observe_step(self, rows: int, fed: int, wall_s: float) -> None:
        """The step's wall prices K: the engine's own Python per row counts as the forward does."""
        self.cost.observe(rows, fed, wall_s)

    def commit_held(self, s: EngineSession) -> bool:
        """Back-pressure: the session waits for Redis to answer its rounds (`max_commit_lag`)."""
        return 0 < self.settings.max_commit_lag <= s.unacked

    # ---- waits ----
    def block_wait_s(self, s: EngineSession) -> float:
        """How long a row waits for its late block, by cost: a block worth E emitted tokens
        in one step is worth waiting for up to E - 1 plain steps (in that time plain rounds
        would emit as many), and never longer than `block_wait_max_s`."""
        if s.plan.exact:  # (ADR 0014; since ADR 0027 its tokens no longer depend on it: see there)
            return self.settings.exact_wait_s
        if s.probing:  # held plain: a block that is not there yet is not waited for
            return 0.0
        worth = max(s.expected_emitted - 1.0, 0.0) * self.measured.step_ms / 1e3
        return min(self.settings.block_wait_max_s, worth)

    def hold(self, rows: list[Row], waiting: list[EngineSession],
             now: float) -> tuple[list[EngineSession], float | None]:
        """The waiting sessions whose blocks this step is held for (none: run now), and until
        when, by scheduler.gather_wait: each block is due when it was asked for plus its pool's
        drafting time per token times its K, if that is within the session's own wait
        (`block_wait_s`). A verify row is worth the session's recent tokens per round, any
        other row one token. The hold lasts until those blocks are in, or a fifth of a step
        past the last one's due time (drafting times vary: a hold until the mean arrival
        would catch half of them). Never while a plain request's row is ready: draft capacity
        is speculation's to wait for, and a request that does not speculate must not pay for
        it (ADR 0021; bench_overload measured plain TPOT p90 1.45x no-draft's with such holds)."""
        if not self.settings.gather or any(not r.session.plan.pool for r in rows):
            return [], None
        due: list[tuple[float, EngineSession]] = []
        for s in waiting:
            per_token = self.measured.draft_latency.get(s.plan.pool or "")
            asked = s.asks.get(len(s.committed))
            if per_token is not None and asked is not None and s.waiting_since is not None:
                at = asked + per_token * s.k_next
                if at <= s.waiting_since + self.block_wait_s(s):  # past its own bound it runs plain
                    due.append((at - now, s))
        if not due:
            return [], None
        ready = sum(r.session.expected_emitted if r.block is not None else 1.0 for r in rows)
        per_row = sum(r.tokens for r in rows) / len(rows)
        last_s = self.measured.step_ms / 1e3

        def step(n: int) -> float:
            return self.cost.row_cost(n, per_row, last_s)

        hold = gather_wait(ready, [(d, s.expected_emitted) for d, s in due], step, len(rows),
                           horizon_s=step(len(rows)))
        if hold <= 0.0:
            return [], None
        return [s for d, s in due if d <= hold], now + hold + HOLD_SLACK * step(len(rows))

    # ---- drafts asked for and arrived ----
    def asked(self, s: EngineSession) -> None:
        """The session's source was asked for a block for its committed prefix, now."""
        s.asks[len(s.committed)] = self.clock()
        while len(s.asks) > MAX_ASKS:  # blocks that never came (a replica lost)
            s.asks.pop(next(iter(s.asks)))

    def block_arrived(self, s: EngineSession, block: DraftBlock, arrived: float) -> None:
        """The pool's drafting time per token, from the ask for this block's prefix to its
        arrival; a late block counts too (timing only those that came in time would learn
        that drafting is fast). Blocks drafted ahead were not asked for. Per position: a token
        tree's candidates at one depth are one position (the wait for the next block is priced
        by its depth, as a chain's by its length). A pool drafted on the engine's thread: its
        own drafting time per draft (from the ask, the other sessions' drafting before it would
        count too; a tree's every draft was computed there)."""
        asked = s.asks.pop(block.base_len, None)
        if asked is None or block.predrafted or not block.tokens:
            return
        if (s.plan.pool or "") in self.serial_pools:  # its compute, per draft it computed (a tree's all)
            if block.draft_ms > 0:
                self.measured.drafted(s.plan.pool or "", block.draft_ms / 1e3 / len(block.tokens))
            return
        positions = tree_depth(block.parents) if block.parents is not None else len(block.tokens)
        self.measured.drafted(s.plan.pool or "", max(arrived - asked, 0.0) / max(positions, 1))

    # ---- what a round teaches ----
    def learn(self, s: EngineSession, row: Row, verdict: Verdict, k_asked: int) -> int:
        """Update the session's worth and its class's acceptance from a settled round; returns
        K, the drafts the round verified."""
        if row.tree is not None:
            k = tree_depth(row.tree[1])
        else:
            k = min(len(row.block.tokens) - row.offset, k_asked) if row.block is not None else 0
        if k:  # what a block is worth to this session (prices the wait for its next one)
            s.expected_emitted = ema(s.expected_emitted, verdict.num_accepted + 1, EMITTED_WEIGHT)
            self.acceptance_of(s).observe(k, self.observe_tree(s, row.tree[0], row.tree[1], verdict)
                                          if row.tree is not None else verdict.num_accepted)
        elif k_asked and row.fallback == DRAFT_LATE and not s.probing:
            # Nothing verified, so nothing learned about the blocks: relax the estimate toward
            # the prior. Otherwise a few rejected blocks shrink the wait below the draft's
            # latency, every later block is late, and the estimate never hears otherwise.
            # The prior: what the class's blocks of this K are worth by its acceptance table,
            # at least PRIOR_EMITTED (a constant alone held a good pool's sessions under its
            # latency for good: bench_engine_loop's h100 profile, α 0.7, K 4 trees)
            prior = max(PRIOR_EMITTED, expected_emitted(self.acceptance_of(s).alphas(), k_asked))
            s.expected_emitted = ema(s.expected_emitted, prior, EMITTED_WEIGHT)
        return k

    def observe_tree(self, s: EngineSession, tokens: Sequence[int], parents: Sequence[int], verdict: Verdict) -> int:
        """A tree round's lesson: whether another first candidate held the target's token
        where the first did not (the siblings' rate), and, for the chain's table, what the
        first candidate's own chain got (its drafts accepted if the walk went through it, else
        none). Returns the latter."""
        through_first = verdict.num_accepted > 0 and verdict.tokens[0] == tokens[0]
        if not through_first and sum(1 for p in parents if p < 0) > 1:
            self.siblings_of(s).observe(verdict.num_accepted > 0)
        return verdict.num_accepted if through_first else 0

    def asked_again(self, s: EngineSession) -> None:
        """After a round, the session's source is asked for its next block (`asked`); count
        whether that block came ahead (drafted during this verify: its round waits for nothing)."""
        if s.k_next > 0 and not s.probing:
            self.measured.ahead(s.plan.pool or "", s.block is not None)
        self.asked(s)

    def acceptance_of(self, s: EngineSession) -> Acceptance:
        return self.acceptance.setdefault(_class_pool(s), Acceptance())

    def siblings_of(self, s: EngineSession) -> Siblings:
        return self.siblings.setdefault(_class_pool(s), Siblings())

    # ---- K and width ----
    def start_k(self, s: EngineSession) -> None:
        """A new adaptive session starts where its class's sessions are now."""
        if s.plan.adaptive:
            s.k_choice = self._k_last.get(_k_key(s), s.plan.params.num_draft_tokens)

    def choose_k(self, s: EngineSession, batch: int, step_s: float, verified: bool) -> None:
        """The session's K for its next round (adaptive plans). A session
        held plain probes every PROBE_EVERY rounds: for up to PROBE_ROUNDS rounds it asks for
        blocks without waiting for them, until one was there to verify (`verified`: this round
        verified drafts)."""
        key = _k_key(s)
        k = self._k_this_step.get(key)
        if k is None:  # every session of a (class, pool) shares its inputs: once per step
            k = self._k_this_step[key] = self._k_last[key] = self.best_k(s, batch, step_s)
        s.held_plain = s.held_plain + 1 if k == 0 else 0
        if k > 0 or verified:
            s.probing = 0
        elif s.probing:
            s.probing -= 1
        elif s.held_plain % PROBE_EVERY == 0:
            s.probing = PROBE_ROUNDS
        s.k_choice = max(s.plan.k_min, min(2, s.plan.k)) if s.probing else k

    def best_k(self, s: EngineSession, batch: int, step_s: float) -> int:
        """K from the class's acceptance and the step cost at this batch size (kchoice.py)."""
        alphas = self.acceptance_of(s).alphas()
        step = self._step_cost(batch, step_s)
        per_token = self.measured.draft_latency.get(s.plan.pool or "", 0.0)
        drafted_after = 1.0 - self.measured.ahead_share.get(s.plan.pool or "", 0.0)
        serial = (s.plan.pool or "") in self.serial_pools

        def cost(n: int) -> float:
            """A round with n - 1 drafts: the wait for them, then the verify. Alone, or with
            gathering (a step held for blocks due within it), the next step starts when the
            block lands; among others without it, a row joins only at a step boundary, so a
            block that lands mid-step costs the session whole steps. A block drafted ahead
            (during the previous verify) costs no wait at all. A pool drafted on the engine's
            thread is never waited for, but each of the step's sessions drafts there in turn
            before the next step: n - 1 drafts of every session lengthen every step."""
            if serial:
                return step(n) + max(batch, 1) * per_token * (n - 1)
            wait = per_token * (n - 1)
            if batch > 1 and wait > 0 and not self.settings.gather:
                wait = math.ceil(wait / step(n)) * step(n)
            return step(n) + drafted_after * wait

        estimates = speedups(alphas, s.plan.k, cost)
        self.estimates[_class_pool(s)] = estimates
        return choose_k({k: v for k, v in estimates.items() if k == 0 or k >= s.plan.k_min})

    def width(self, s: EngineSession, k: int, batch: int) -> int:
        """How many first candidates the session's next block may have: `tree_width` where the
        cost model says a tree emits more per second than the chain at this load (`batch`
        sessions), else 1. A tree of w first candidates, each with its chain to K, verifies
        1 + w K tokens and is expected to emit E(K) + (1 - α_1) β E(K - 1) (β: how often
        another first candidate held the target's token where the first did not). At low load
        a memory-bound step verifies the extra tokens nearly free; as the batch grows they
        cost what the fit says. Any session: greedy, sampled (a tree's candidates drawn from
        the drafter's q, algorithm/tree.py), or seeded (its tokens are plain decoding's with
        its seed, a tree or not: the coupled sampler, ADR 0027)."""
        wide = self.settings.tree_width
        if wide <= 1 or k <= 0:
            return 1
        if self.settings.tree_always:
            return wide
        alphas = self.acceptance_of(s).alphas()
        beta = self.siblings_of(s).rate()
        chain = expected_emitted(alphas, k)
        tree = chain + (1.0 - (alphas[0] if alphas else PRIOR_ALPHA)) * beta * expected_emitted(alphas, k - 1)
        step = self._step_cost(max(batch, 1), self.measured.step_ms / 1e3)
        drafting = max(batch, 1) * self.measured.draft_latency.get(s.plan.pool or "", 0.0) \
            if (s.plan.pool or "") in self.serial_pools else 0.0  # (per draft: as in best_k)
        pays = tree / (step(1 + wide * k) + drafting * wide * k) > \
            (1.0 + TREE_MARGIN) * chain / (step(1 + k) + drafting * k)
        # Until it can price a tree (a cost fit, which needs verify rows of more than one
        # width, and a few trials of the class's siblings), one block in TREE_PROBE_EVERY is
        # a tree anyway: chains alone would never teach it either.
        learning = self.cost.coef is None or self.siblings_of(s).trials < TREE_TRIALS
        return wide if pays or (learning and len(s.rounds) % TREE_PROBE_EVERY == 0) else 1

    def _step_cost(self, batch: int, step_s: float) -> Callable[[int], float]:
        """Step time by tokens per row at this batch: the fit, or the prior before one."""
        if self.cost.coef is None:
            return prior_cost(step_s)
        return lambda n: self.cost.row_cost(batch, n, step_s)


def _class_pool(s: EngineSession) -> ClassPool:
    """The statistics' key: the class (and its LoRA adapter, ADR 0029: CLASS@ADAPTER) and the pool."""
    cls = f"{s.plan.workload_class}@{s.plan.adapter}" if s.plan.adapter else s.plan.workload_class
    return cls, s.plan.pool or ""


def _k_key(s: EngineSession) -> tuple[str, str, int, int]:
    return *_class_pool(s), s.plan.k_min, s.plan.k
