"""The engine loop that drives rounds beside the target (ADR 0014): schedule -> run ->
postprocess, one batched forward per step, nano-vllm's `LLMEngine.step` shape.

The loop thread owns every session and the model. Other threads (the gRPC event loop, the
draft links) only post messages: a new session, a draft block, a cancel. They go through a
thread-safe inbox that the loop drains at the start of each step, so the step itself takes
no locks. The step never waits for Redis, a client or a draft replica:
- commits go to the committer, which sends them off this thread;
- outcomes go to the draft sources, which push their next blocks back through the inbox;
- a session whose block is late waits at most `block_wait_s()`, then runs plain.

Example (in process, a local drafter):
    loop = EngineLoop(make_target_step(target, Batching()), stops_for, {"small": LocalDrafts(drafter)})
    loop.add("s1", prompt_ids, EnginePlan(params, pool="small"))
    loop.run_until_idle()
    loop.sessions["s1"].generated
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Protocol

from specserve.algorithm.round import RoundStats, settle
from specserve.algorithm.stops import StopChecker
from specserve.engine.drafting import DRAFT_UNAVAILABLE, DraftSource, clip
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
from specserve.engine.scheduler import DRAFT_LATE, Budget, Row, gather_wait, schedule
from specserve.engine.session import (
    PRIOR_EMITTED,
    CommitRecord,
    DraftBlock,
    EnginePlan,
    EngineSession,
    Outcome,
    Status,
)
from specserve.params import GenerationParams
from specserve.step import ModelStep, RowResult, Step, StepResult, StepRow, first_branch, tree_depth
from specserve.structured.constraint import Constraint
from specserve.worker.cost import CostModel

if TYPE_CHECKING:  # (an annotation only)
    from specserve.algorithm.rejection import Verdict

# The engine's measured averages: each is an exponential moving average, and these are the
# weights a new sample gets (`ema`). Short memories, because load and acceptance move within
# seconds: about the last 5 samples at 0.2, 3 at 0.3, 10 at 0.1.
STEP_WEIGHT = 0.2  # the recent forward time: prices a late block's wait and the gather-hold
EMITTED_WEIGHT = 0.3  # a session's tokens a verified round: what waiting for its next block is worth
AHEAD_WEIGHT = 0.1  # per pool, the share of blocks drafted ahead (there when the round starts)
LATENCY_WEIGHT = 0.2  # per pool, drafting time per position, from the ask to the block's arrival
HOLD_SLACK = 0.2  # a gather-hold lasts this share of a step past the last block it waits for

NOT_PAYING = "speculation_not_paying"  # the engine's K choice held the session plain at this load
TREE_MARGIN = 0.05  # a tree replaces the chain only if it emits this much more per second
TREE_PROBE_EVERY = 8  # while the engine cannot price trees yet: one block in this many is one
TREE_TRIALS = 4.0  # sibling trials of a class before its rate is trusted over the prior
MAX_ASKS = 8  # asks remembered per session, by committed length, until their block arrives


class Committer(Protocol):
    def submit(self, records: Sequence[CommitRecord]) -> None:
        """Take one step's commits; must not block the loop."""
        ...


class EngineObserver(Protocol):
    def round(self, session: EngineSession, stats: RoundStats) -> None: ...
    def finished(self, session: EngineSession) -> None: ...


@dataclass(frozen=True)
class StepReport:
    rows: int
    tokens: int  # tokens fed
    forward_ms: float  # the model step (forward + rejection sampling)
    bookkeeping_ms: float  # schedule + postprocess: the engine's own Python per step


class EngineLoop:
    def __init__(self, model: ModelStep, stops_for: Callable[[GenerationParams], StopChecker],
                 sources: Mapping[str, DraftSource] | None = None, committer: Committer | None = None,
                 observers: Sequence[EngineObserver] = (), budget: Budget | None = None,
                 block_wait_max_s: float = 0.005, wait_factor: float = 1.0,
                 clock: Callable[[], float] = time.monotonic, keep_ended: int = 1024,
                 simulated_step_ms: Callable[[Step, StepResult], float] | None = None,
                 on_step: Callable[[StepReport], None] | None = None,
                 summarize: Callable[[EngineSession], str] | None = None, exact_wait_s: float = 5.0,
                 constrain: Callable[[Constraint], Any] | None = None, max_commit_lag: int = 0,
                 gather: bool = True, tree_width: int = 1, tree_always: bool = False) -> None:
        self.model = model
        # token trees (ADR 0020): at most this many candidates at a block's first position, for
        # greedy sessions, where the cost model says the wider verify pays (`_width`); 1: chains.
        # `tree_always`: wherever a tree may be drafted, whatever it costs (benchmarks, tests)
        self.tree_width, self.tree_always = tree_width, tree_always
        self.stops_for = stops_for
        self.sources = dict(sources or {})
        self.committer = committer
        self.observers = list(observers)
        self.budget = budget or Budget()
        self.block_wait_max_s = block_wait_max_s
        self.wait_factor = wait_factor
        self.clock = clock
        # a simulated device (benchmarks, tests): a step takes this long, the real forward of a
        # small model padded up to it (ADR 0014's device profiles)
        self.simulated_step_ms = simulated_step_ms
        self.on_step = on_step  # each step's report (benchmarks, metrics)
        self.summarize = summarize  # a finished session's statistics, stored with its last commit
        # how long an exact session (plan.exact) waits for its block before it runs plain
        # anyway: longer than a draft source's failover (engine/link.py, 1 s), so only a
        # pool with no replica left can change its sample path
        self.exact_wait_s = exact_wait_s
        # a constraint -> its session's matcher (structured/grammar.py: ConstrainedRow); None:
        # this engine refuses constrained sessions
        self.constrain = constrain
        self.mask_ms = 0.0  # the masks' host time in the last step (ADR 0017)
        # commit back-pressure: a session with this many rounds handed to the committer and not
        # yet answered by Redis runs no further round until one is (0 = unbounded). Through a
        # Redis outage its provisional work stays bounded, not max_tokens long.
        self.max_commit_lag = max_commit_lag
        self.gather = gather  # hold a step for blocks due within it when that pays (`_hold`)
        self.sessions: dict[str, EngineSession] = {}  # by arrival: the schedule's order
        self.step_ms = block_wait_max_s * 1e3  # recent forward time (EMA): prices a late block
        self.last: StepReport | None = None
        self.cost = CostModel()  # step time by rows and tokens: prices K at the current load
        self.acceptance: dict[tuple[str, str], Acceptance] = {}  # per (class, pool)
        # per (class, pool): how often a tree's other first candidates held the target's token
        # where its first did not (prices a tree's extra candidates)
        self.siblings: dict[tuple[str, str], Siblings] = {}
        self.estimates: dict[tuple[str, str], dict[int, float]] = {}  # S(K) per (class, pool), last computed
        # per pool: seconds from asking for a block to its arrival, per draft token, over the
        # blocks not drafted ahead: what a round waits for its drafts, beside the verify
        self.draft_latency: dict[str, float] = {}
        # per pool: the share of rounds whose block was drafted ahead, ready at the commit (no wait)
        self.ahead_share: dict[str, float] = {}
        self.ended: dict[str, EngineSession] = {}  # the last `keep_ended` sessions that ended
        self.keep_ended = keep_ended
        self._wake_at: float | None = None
        self._held_for: list[EngineSession] = []  # the sessions whose blocks the step is held for
        self._k_this_step: dict[tuple[str, str, int, int], int] = {}
        # the last K chosen per (class, pool, K bounds): a new adaptive session starts there
        self._k_last: dict[tuple[str, str, int, int], int] = {}
        self._inbox: deque[tuple[str, Any]] = deque()
        self._just_ended: list[EngineSession] = []
        self._wake = threading.Condition()
        for source in self.sources.values():
            source.attach(self.offer)

    # ---- what other threads call (posted; applied by the loop thread) ----
    def add(self, session_id: str, prompt_ids: list[int], plan: EnginePlan, generated: Sequence[int] = (),
            epoch: int = 0) -> Future[EngineSession]:
        """Start (or adopt, after `generated` committed tokens) a session. The future gives
        the EngineSession once the loop has opened its KV, or the error (no KV room)."""
        done: Future[EngineSession] = Future()
        self._post("add", (session_id, list(prompt_ids), plan, list(generated), epoch, done))
        return done

    def offer(self, block: DraftBlock) -> None:
        # stamped on arrival: the loop applies it at its next step boundary, and that wait
        # is the step's, not the draft's (the K choice prices step boundaries itself)
        self._post("block", (block, self.clock()))

    def acked(self, session_ids: Sequence[str]) -> None:
        """The committer's answer for rounds it was handed: one id per round (applied or
        refused alike; a refusal ends the session through `cancel`)."""
        self._post("acked", list(session_ids))

    def cancel(self, session_id: str, reason: str = "cancelled") -> None:
        self._post("cancel", (session_id, reason))

    def wake(self) -> None:
        """Wake a sleeping loop (to see a stop request)."""
        with self._wake:
            self._wake.notify()

    def _post(self, kind: str, payload: Any) -> None:
        with self._wake:
            self._inbox.append((kind, payload))
            self._wake.notify()

    # ---- the loop thread ----
    def run_forever(self, stop: threading.Event) -> None:
        while not stop.is_set():
            if self.step() is None:
                self._sleep(self._wake_at, stop)

    def run_until_idle(self, timeout_s: float = 600.0) -> None:
        """Step until no session runs (in process: tests, the benchmark's bound)."""
        end = self.clock() + timeout_s
        while self._inbox or any(s.running for s in self.sessions.values()):
            if self.clock() > end:
                raise TimeoutError("engine sessions still running")
            if self.step() is None:
                self._sleep(self._wake_at, None)

    def _sleep(self, until: float | None, stop: threading.Event | None) -> None:
        """Until `until`, or new work in the inbox. A held step (`_hold`) sleeps until the
        blocks it holds for are all in, applying them as they come (outside the lock the
        posting threads take), or its deadline: scheduling again at each arrival would cost
        the engine thread a schedule per block."""
        while self._held_for and until is not None and not (stop is not None and stop.is_set()):
            self._drain()
            left = until - self.clock()
            if left <= 0 or all(s.block is not None or not s.running for s in self._held_for):
                return
            with self._wake:
                if not self._inbox:
                    self._wake.wait(timeout=left)
        with self._wake:
            if self._inbox or (stop is not None and stop.is_set()):
                return
            self._wake.wait(timeout=0.05 if until is None else max(until - self.clock(), 0.0))

    def step(self) -> StepReport | None:
        """One step: inbox -> schedule -> one forward -> postprocess. None: nothing to run."""
        t0 = time.perf_counter()
        self._drain()
        self._forget_ended()
        plan = schedule(self.sessions.values(), self.clock(), self.budget, self.block_wait_s, self._can_draft,
                        self._held)
        self._wake_at = plan.wake_at
        self._held_for = self._hold(plan.rows, plan.waiting, self.clock()) if plan.rows and plan.waiting else []
        if not plan.rows or self._held_for:
            self._notify_ended()  # cancelled from the inbox
            return None
        self.mask_ms = 0.0
        step = Step([self._row(r) for r in plan.rows])
        t1 = time.perf_counter()
        out = self.model.step(step)
        results = out.rows
        fed = sum(max(r.fed, 1) for r in results)
        if self.simulated_step_ms is not None:  # the device's time: the real forward padded up to it
            time.sleep(max(self.simulated_step_ms(step, out) / 1e3 - (time.perf_counter() - t1), 0.0))
        t2 = time.perf_counter()
        forward_ms = (t2 - t1) * 1e3
        self.step_ms = ema(self.step_ms, forward_ms, STEP_WEIGHT)
        commits: list[CommitRecord] = []
        self._k_this_step = {}  # K choices made in this step, per (class, pool, K bound)
        rounds = [self._settle(r, res, forward_ms, commits) for r, res in zip(plan.rows, results, strict=True)]
        bookkeeping_ms = (t1 - t0 + time.perf_counter() - t2) * 1e3
        # the step's wall prices K: the engine's own Python per row counts as the forward does
        self.cost.observe(len(results), fed, (forward_ms + bookkeeping_ms) / 1e3)
        ended = time.perf_counter()
        for s, stats in rounds:
            if stats is not None:
                # the session's time between its previous round and this step: a row left out
                # of steps (its block late, or the budget) waited that long for its tokens
                wait_ms = (t0 - s.last_round_end) * 1e3 if s.last_round_end is not None else 0.0
                s.last_round_end = ended
                stats_final = replace(stats, overhead_ms=bookkeeping_ms, wait_ms=max(wait_ms, 0.0))
                s.rounds.append(stats_final)
                for o in self.observers:
                    o.round(s, stats_final)
        self._notify_ended()
        if commits and self.committer is not None:
            if self.summarize is not None:  # a session's last round carries its statistics
                commits = [replace(c, stats=self.summarize(self.sessions[c.session_id])) if c.finish_reason
                           else c for c in commits]
            self.committer.submit(commits)
            for c in commits:
                if (owner := self.sessions.get(c.session_id)) is not None:
                    owner.unacked += 1
        self._forget_ended()
        self.last = StepReport(len(plan.rows), fed, forward_ms, bookkeeping_ms)
        if self.on_step is not None:
            self.on_step(self.last)
        return self.last

    def block_wait_s(self, s: EngineSession) -> float:
        """How long a row waits for its late block, by cost: a block worth E emitted tokens
        in one step is worth waiting for up to E - 1 plain steps (in that time plain rounds
        would emit as many), and never longer than `block_wait_max_s`."""
        if s.plan.exact:  # a late block would change its sample path: wait for it
            return self.exact_wait_s
        if s.probing:  # held plain: a block that is not there yet is not waited for
            return 0.0
        worth = self.wait_factor * max(s.expected_emitted - 1.0, 0.0) * self.step_ms / 1e3
        return min(self.block_wait_max_s, worth)

    def _hold(self, rows: list[Row], waiting: list[EngineSession], now: float) -> list[EngineSession]:
        """The waiting sessions whose blocks this step is held for (none: run now), by
        scheduler.gather_wait: each block is due when it was asked for plus its pool's
        drafting time per token times its K, if that is within the session's own wait
        (`block_wait_s`). A verify row is worth the session's recent tokens per round, any
        other row one token. The hold lasts until those blocks are in, or a fifth of a step
        past the last one's due time (drafting times vary: a hold until the mean arrival
        would catch half of them). Never while a plain request's row is ready: draft capacity
        is speculation's to wait for, and a request that does not speculate must not pay for
        it (ADR 0021; bench_overload measured plain TPOT p90 1.45x no-draft's with such holds)."""
        if not self.gather or any(not r.session.plan.pool for r in rows):
            return []
        due: list[tuple[float, EngineSession]] = []
        for s in waiting:
            per_token = self.draft_latency.get(s.plan.pool or "")
            asked = s.asks.get(len(s.committed))
            if per_token is not None and asked is not None and s.waiting_since is not None:
                at = asked + per_token * s.k_wanted
                if at <= s.waiting_since + self.block_wait_s(s):  # past its own bound it runs plain
                    due.append((at - now, s))
        if not due:
            return []
        ready = sum(r.session.expected_emitted if r.block is not None else 1.0 for r in rows)
        per_row = sum(r.tokens for r in rows) / len(rows)
        last_s = self.step_ms / 1e3

        def step(n: int) -> float:
            return self.cost.row_cost(n, per_row, last_s)

        hold = gather_wait(ready, [(d, s.expected_emitted) for d, s in due], step, len(rows),
                           horizon_s=step(len(rows)))
        if hold <= 0.0:
            return []
        until = now + hold + HOLD_SLACK * step(len(rows))
        self._wake_at = until if self._wake_at is None else min(self._wake_at, until)
        return [s for d, s in due if d <= hold]

    def _drain(self) -> None:
        while self._inbox:
            kind, payload = self._inbox.popleft()
            if kind == "add":
                self._open(*payload)
            elif kind == "block":
                block, arrived = payload
                if (s := self.sessions.get(block.session_id)) is not None:
                    self._block_arrived(s, block, arrived)
                    s.offer(block)  # a stale block (another prefix) is dropped here
            elif kind == "acked":
                for sid in payload:
                    if (s := self.sessions.get(sid)) is not None and s.unacked > 0:
                        s.unacked -= 1
            elif kind == "cancel":
                s = self.sessions.get(payload[0])
                if s is not None and s.running:
                    self._end(s, Status.CANCELLED, payload[1])

    def _open(self, session_id: str, prompt_ids: list[int], plan: EnginePlan, generated: list[int], epoch: int,
              done: Future[EngineSession]) -> None:
        if not done.set_running_or_notify_cancel():  # its caller gave up (a Start whose RPC was cancelled)
            return
        old = self.sessions.get(session_id)
        if old is not None:  # adopted again (a new epoch): the old run ends here
            if old.running:
                self._end(old, Status.CANCELLED, "adopted")
            self._forget_ended()
        try:
            s = EngineSession.new(session_id, prompt_ids, plan, self.stops_for(plan.params), generated, epoch,
                                  self.clock())
            if plan.constraint is not None:
                if self.constrain is None:
                    raise ValueError("this engine has no grammar compiler: constrained output is off")
                s.grammar = self.constrain(plan.constraint)
                s.grammar.advance(s.generated)  # adopted: the matcher picks up where the commits are
            s.handle = self.model.open(session_id)
        except Exception as exc:
            done.set_exception(exc)
            return
        self.sessions[session_id] = s
        if plan.adaptive and not plan.exact:  # start where the class's sessions are now
            s.k_choice = self._k_last.get(self._k_key(s), plan.params.num_draft_tokens)
        source = self.sources.get(plan.pool or "")
        if source is not None and (s.k_wanted > 0 or plan.adaptive):  # (held plain, it still probes)
            self._ask(s)
            source.open(s)
        done.set_result(s)

    def _row(self, row: Row) -> StepRow:
        s = row.session
        p = s.plan.params
        parents = None
        allowed = None
        t0 = time.perf_counter()
        if row.tree is not None:  # a tree: all its nodes below the committed path
            drafts, q, parents = list(row.tree[0]), None, list(row.tree[1])
            if s.grammar is not None:  # its nodes the grammar allows, and each node's mask
                pruned = s.grammar.constrain_tree(drafts, parents)
                if pruned is not None:
                    drafts, parents, allowed = pruned
                    parents = parents or None  # (no node left: a plain row under the root's mask)
                else:  # the grammar forces the next token: its first branch as a chain (jump-forward)
                    drafts, parents = first_branch(drafts, parents), None
        else:
            drafts, q = clip(row.block, s.k_wanted, row.offset) if row.block is not None else ([], None)
        if s.grammar is not None and allowed is None:  # (a prefill chunk short of the prompt's end ignores it)
            room = p.max_tokens - s.n_generated - 1  # drafts past the budget would never commit
            drafts, q, allowed = s.grammar.constrain(drafts, q, p.sampling.greedy, min(s.k_wanted, room), room)
        if s.grammar is not None:
            self.mask_ms += (time.perf_counter() - t0) * 1e3
        source = self.sources.get(s.plan.pool or "")
        out = StepRow.verify(s.handle, s.committed.ids, drafts, q, p.sampling, s.plan.seed, allowed,
                             features=bool(getattr(source, "wants_features", False)))
        out.parents = parents
        return out

    def _settle(self, row: Row, result: RowResult, forward_ms: float,
                commits: list[CommitRecord]) -> tuple[EngineSession, RoundStats | None]:
        s = row.session
        if result.features is not None:  # the target's features, for a pool that drafts from them (ADR 0020)
            source = self.sources.get(s.plan.pool or "")
            if source is not None and hasattr(source, "features"):
                source.features(s.id, result.features_start, result.features)
        if result.again:  # a prefill chunk that did not reach the end of the prompt
            s.cached = min(s.cached + row.tokens, len(s.committed) - 1)
            return s, None
        if result.error is not None:
            self._end(s, Status.FAILED, "error", f"{type(result.error).__name__}: {result.error}")
            return s, None
        verdict = result.verdict
        assert verdict is not None
        s.cached = result.cached_len
        k_asked = s.k_wanted
        expected = s.n_generated
        settled = settle(s.generated, verdict.tokens, s.text.stops, s.plan.params.max_tokens)
        s.committed.extend(settled.tokens)
        if s.grammar is not None:
            s.grammar.advance(settled.tokens)
        text = s.text.advance(s.generated, settled.finish_reason)
        if not s.plan.shadow:  # a shadow twin commits nothing
            commits.append(CommitRecord(s.id, s.epoch, expected, tuple(settled.tokens), text, settled.finish_reason))
        block = row.block
        if row.tree is not None:
            k = tree_depth(row.tree[1])
        else:
            k = min(len(block.tokens) - row.offset, k_asked) if block is not None else 0
        if k:  # what a block is worth to this session (prices the wait for its next one)
            s.expected_emitted = ema(s.expected_emitted, verdict.num_accepted + 1, EMITTED_WEIGHT)
            self._acceptance(s).observe(k, self._observe_tree(s, *row.tree, verdict)
                                        if row.tree is not None else verdict.num_accepted)
        elif k_asked and row.fallback == DRAFT_LATE and not s.probing:
            # Nothing verified, so nothing learned about the blocks: relax the estimate toward
            # the prior. Otherwise a few rejected blocks shrink the wait below the draft's
            # latency, every later block is late, and the estimate never hears otherwise.
            # The prior: what the class's blocks of this K are worth by its acceptance table,
            # at least PRIOR_EMITTED (a constant alone held a good pool's sessions under its
            # latency for good: bench_engine_loop's h100 profile, α 0.7, K 4 trees)
            prior = max(PRIOR_EMITTED, expected_emitted(self._acceptance(s).alphas(), k_asked))
            s.expected_emitted = ema(s.expected_emitted, prior, EMITTED_WEIGHT)
        stats = RoundStats(
            k=k, accepted=verdict.num_accepted, emitted=len(settled.tokens),
            rejected_position=verdict.rejected_position, draft_ms=block.draft_ms if block else 0.0,
            verify_ms=forward_ms, fallback_reason="" if block else self._plain_reason(s, row, k_asked),
            k_asked=k_asked,
            predraft="pushed" if block is not None and block.predrafted else "",
            tree_size=len(row.tree[0]) if row.tree is not None else 0,
            feature_bytes=int(result.features.numel() * result.features.element_size())
            if result.features is not None else 0,
            probe=bool(k_asked and s.probing))
        # after the record: its fallback reason is this round's, not the next's
        if s.plan.adaptive and not s.plan.exact:
            self._choose_k(s, len(self.sessions), forward_ms / 1e3, verified=k > 0)
        s.block, s.waiting_since = None, None
        s.promote()  # a block drafted ahead for the prefix just committed is ready at once
        k_next = s.k_wanted
        if settled.finish_reason is not None:
            self._end(s, Status.FINISHED, settled.finish_reason)
        elif (source := self.sources.get(s.plan.pool or "")) is not None and (k_next > 0 or s.plan.adaptive):
            if k_next > 0 and not s.probing:  # its next round waits for nothing when its block came ahead
                pool = s.plan.pool or ""
                self.ahead_share[pool] = ema(self.ahead_share.get(pool, 0.0), float(s.block is not None), AHEAD_WEIGHT)
            self._ask(s)
            source.outcome(Outcome(s.id, len(s.committed), tuple(settled.tokens), k_next, self._width(s, k_next)))
        return s, stats

    def _width(self, s: EngineSession, k: int) -> int:
        """How many first candidates the session's next block may have: `tree_width` where the
        cost model says a tree emits more per second than the chain at this load, else 1. A
        tree of w first candidates, each with its chain to K, verifies 1 + w K tokens and is
        expected to emit E(K) + (1 - α_1) β E(K - 1) (β: how often another first candidate
        held the target's token where the first did not). At low load a memory-bound step
        verifies the extra tokens nearly free; as the batch grows they cost what the fit says.
        Greedy sessions only: a tree's candidates are one-hot (a sampled session's chain
        carries its draft's q, which a tree would lose) and its coins differ from a chain's
        (a seeded session's sample path would depend on the load)."""
        if self.tree_width <= 1 or k <= 0 or not s.plan.params.sampling.greedy:
            return 1
        if self.tree_always:
            return self.tree_width
        alphas = self._acceptance(s).alphas()
        beta = self._siblings(s).rate()
        chain = expected_emitted(alphas, k)
        tree = chain + (1.0 - (alphas[0] if alphas else PRIOR_ALPHA)) * beta * expected_emitted(alphas, k - 1)
        batch, step_s = max(len(self.sessions), 1), self.step_ms / 1e3
        step = prior_cost(step_s) if self.cost.coef is None else (lambda n: self.cost.row_cost(batch, n, step_s))
        pays = tree / step(1 + self.tree_width * k) > (1.0 + TREE_MARGIN) * chain / step(1 + k)
        # Until it can price a tree (a cost fit, which needs verify rows of more than one
        # width, and a few trials of the class's siblings), one block in TREE_PROBE_EVERY is
        # a tree anyway: chains alone would never teach it either.
        learning = self.cost.coef is None or self._siblings(s).trials < TREE_TRIALS
        return self.tree_width if pays or (learning and len(s.rounds) % TREE_PROBE_EVERY == 0) else 1

    def _observe_tree(self, s: EngineSession, tokens: Sequence[int], parents: Sequence[int], verdict: Verdict) -> int:
        """A tree round's lesson: whether another first candidate held the target's token
        where the first did not (the siblings' rate), and, for the chain's table, what the
        first candidate's own chain got (its drafts accepted if the walk went through it, else
        none). Returns the latter."""
        through_first = verdict.num_accepted > 0 and verdict.tokens[0] == tokens[0]
        if not through_first and sum(1 for p in parents if p < 0) > 1:
            self._siblings(s).observe(verdict.num_accepted > 0)
        return verdict.num_accepted if through_first else 0

    def _siblings(self, s: EngineSession) -> Siblings:
        return self.siblings.setdefault((s.plan.workload_class, s.plan.pool or ""), Siblings())

    def _ask(self, s: EngineSession) -> None:
        s.asks[len(s.committed)] = self.clock()
        while len(s.asks) > MAX_ASKS:  # blocks that never came (a replica lost)
            s.asks.pop(next(iter(s.asks)))

    def _block_arrived(self, s: EngineSession, block: DraftBlock, arrived: float) -> None:
        """The pool's drafting time per token, from the ask for this block's prefix to its
        arrival; a late block counts too (timing only those that came in time would learn
        that drafting is fast). Blocks drafted ahead were not asked for. Per position: a token
        tree's candidates at one depth are one position (the wait for the next block is priced
        by its depth, as a chain's by its length)."""
        asked = s.asks.pop(block.base_len, None)
        if asked is None or block.predrafted or not block.tokens:
            return
        pool = s.plan.pool or ""
        positions = tree_depth(block.parents) if block.parents is not None else len(block.tokens)
        per_token = max(arrived - asked, 0.0) / max(positions, 1)
        self.draft_latency[pool] = ema(self.draft_latency.get(pool, per_token), per_token, LATENCY_WEIGHT)

    def _acceptance(self, s: EngineSession) -> Acceptance:
        return self.acceptance.setdefault((s.plan.workload_class, s.plan.pool or ""), Acceptance())

    def _choose_k(self, s: EngineSession, batch: int, step_s: float, verified: bool) -> None:
        """The session's K for its next round. A session held plain probes every PROBE_EVERY
        rounds: for up to PROBE_ROUNDS rounds it asks for blocks without waiting for them,
        until one was there to verify (`verified`: this round verified drafts)."""
        key = self._k_key(s)
        k = self._k_this_step.get(key)
        if k is None:  # every session of a (class, pool) shares its inputs: once per step
            k = self._k_this_step[key] = self._k_last[key] = self._best_k(s, batch, step_s)
        s.held_plain = s.held_plain + 1 if k == 0 else 0
        if k > 0 or verified:
            s.probing = 0
        elif s.probing:
            s.probing -= 1
        elif s.held_plain % PROBE_EVERY == 0:
            s.probing = PROBE_ROUNDS
        s.k_choice = max(s.plan.k_min, min(2, s.plan.k)) if s.probing else k

    @staticmethod
    def _k_key(s: EngineSession) -> tuple[str, str, int, int]:
        return s.plan.workload_class, s.plan.pool or "", s.plan.k_min, s.plan.k

    def _best_k(self, s: EngineSession, batch: int, step_s: float) -> int:
        """K from the class's acceptance and the step cost at this batch size (kchoice.py)."""
        alphas = self._acceptance(s).alphas()
        step = prior_cost(step_s) if self.cost.coef is None else (lambda n: self.cost.row_cost(batch, n, step_s))
        per_token = self.draft_latency.get(s.plan.pool or "", 0.0)
        drafted_after = 1.0 - self.ahead_share.get(s.plan.pool or "", 0.0)

        def cost(n: int) -> float:
            """A round with n - 1 drafts: the wait for them, then the verify. Alone, or with
            gathering (a step held for blocks due within it), the next step starts when the
            block lands; among others without it, a row joins only at a step boundary, so a
            block that lands mid-step costs the session whole steps. A block drafted ahead
            (during the previous verify) costs no wait at all."""
            wait = per_token * (n - 1)
            if batch > 1 and wait > 0 and not self.gather:
                wait = math.ceil(wait / step(n)) * step(n)
            return step(n) + drafted_after * wait

        estimates = speedups(alphas, s.plan.k, cost)
        self.estimates[(s.plan.workload_class, s.plan.pool or "")] = estimates
        return choose_k({k: v for k, v in estimates.items() if k == 0 or k >= s.plan.k_min})

    def _held(self, s: EngineSession) -> bool:
        return 0 < self.max_commit_lag <= s.unacked

    def _can_draft(self, s: EngineSession) -> bool:
        """Whether a row of the session may wait for a block. An exact session also waits
        while its pool has no live replica (a restarted target's links still connecting, a
        failover), up to `exact_wait_s`: a plain round would change its sample path. It waits
        once per outage (not when its last round already ran plain for want of a replica),
        and not for a pool that refused it."""
        source = self.sources.get(s.plan.pool or "")
        if source is None:
            return False
        if source.drafts_for(s.id):
            return True
        waited = bool(s.rounds) and s.rounds[-1].fallback_reason == DRAFT_UNAVAILABLE
        return s.plan.exact and not waited and not source.refused(s.id)

    def _live(self, s: EngineSession) -> bool:
        source = self.sources.get(s.plan.pool or "")
        return source is not None and source.drafts_for(s.id)

    def _plain_reason(self, s: EngineSession, row: Row, k_asked: int) -> str:
        if not s.plan.pool:
            return s.plan.plain_reason
        if k_asked == 0:  # the engine held it plain, or the token budget left no room for drafts
            return NOT_PAYING if s.k_choice == 0 else ""
        if not self._live(s):
            return DRAFT_UNAVAILABLE
        return NOT_PAYING if s.probing else row.fallback  # (a probe's block not there yet: it never waits)

    def _end(self, s: EngineSession, status: Status, reason: str, error: str = "") -> None:
        s.finish(status, reason, error)
        source = self.sources.get(s.plan.pool or "")
        if source is not None:
            source.close(s.id)
        self._just_ended.append(s)  # observers hear of it after its last round (end of step)

    def _notify_ended(self) -> None:
        ended, self._just_ended = self._just_ended, []
        for s in ended:
            for o in self.observers:
                o.finished(s)

    def _forget_ended(self) -> None:
        """Sessions that ended free their KV and leave the table (the last few stay readable
        in `ended`)."""
        gone = [s for s in self.sessions.values() if not s.running]
        for s in gone:
            if s.handle is not None:
                self.model.close(s.handle)
                s.handle = None
            del self.sessions[s.id]
            self.ended[s.id] = s
        while len(self.ended) > self.keep_ended:
            self.ended.pop(next(iter(self.ended)))


def ema(average: float, sample: float, weight: float) -> float:
    """An exponential moving average's next value: `weight` of the new sample."""
    return average + weight * (sample - average)

