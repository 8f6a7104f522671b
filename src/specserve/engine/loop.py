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

import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Protocol

from specserve.algorithm.round import RoundStats, Settled, settle
from specserve.algorithm.stops import StopChecker
from specserve.engine.drafting import DRAFT_UNAVAILABLE, DraftPools, DraftSource, clip
from specserve.engine.scheduler import Budget, Row, Schedule, schedule
from specserve.engine.session import CommitRecord, DraftBlock, EnginePlan, EngineSession, Outcome, Status
from specserve.engine.speculation import Speculation, SpeculationSettings
from specserve.params import GenerationParams
from specserve.step import ModelStep, RowResult, Step, StepResult, StepRow, first_branch, q_rows, tree_depth
from specserve.structured.constraint import Constraint

if TYPE_CHECKING:  # (an annotation only)
    from specserve.algorithm.rejection import Verdict

NOT_PAYING = "speculation_not_paying"  # the engine's K choice held the session plain at this load


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
    unseated: int = 0  # sessions waiting for a seat at this step (scheduler.py)
    # the device's time for the step where the model says it differs from forward_ms (a
    # lookahead step ran while the engine did its bookkeeping: ADR 0019); None: forward_ms
    device_ms: float | None = None
    # the engine thread's CPU time in the step: in the model's step (on a CPU, the forward; on a
    # device, preparing and launching it) and in its own bookkeeping; what the target's host
    # costs beside the forward (ADR 0028)
    forward_cpu_ms: float = 0.0
    bookkeeping_cpu_ms: float = 0.0

    @property
    def busy_ms(self) -> float:
        """The device's time for this step: what the busy share counts (ADR 0021)."""
        return self.forward_ms if self.device_ms is None else self.device_ms


class Inbox:
    """What other threads post to the loop thread (a new session, a draft block, the
    committer's answer, a cancel), applied at its step boundaries: posting takes a lock and
    wakes the loop; taking does not block."""

    def __init__(self) -> None:
        self._messages: deque[tuple[str, Any]] = deque()
        self._wake = threading.Condition()

    def __bool__(self) -> bool:
        return bool(self._messages)

    def post(self, kind: str, payload: Any) -> None:
        with self._wake:
            self._messages.append((kind, payload))
            self._wake.notify()

    def take(self) -> tuple[str, Any] | None:
        return self._messages.popleft() if self._messages else None

    def wake(self) -> None:
        with self._wake:
            self._wake.notify()

    def wait(self, timeout_s: float, stop: threading.Event | None) -> None:
        """Sleep up to `timeout_s`, unless a message is in or `stop` is set."""
        with self._wake:
            if self._messages or (stop is not None and stop.is_set()):
                return
            self._wake.wait(timeout=timeout_s)


class EngineLoop:
    """The loop thread's engine: its `step` is schedule -> run -> settle -> hand over. The
    speculation decisions are `self.speculation`'s (engine/speculation.py); the loop applies
    them and tells it what each round did."""

    def __init__(self, model: ModelStep, stops_for: Callable[[GenerationParams], StopChecker],
                 sources: Mapping[str, DraftSource] | None = None, committer: Committer | None = None, *,
                 observers: Sequence[EngineObserver] = (), budget: Budget | None = None,
                 speculation: SpeculationSettings | None = None, clock: Callable[[], float] = time.monotonic,
                 keep_ended: int = 1024, simulated_step_ms: Callable[[Step, StepResult], float] | None = None,
                 on_step: Callable[[StepReport], None] | None = None,
                 summarize: Callable[[EngineSession], str] | None = None,
                 constrain: Callable[[Constraint], Any] | None = None) -> None:
        self.model = model
        self.stops_for = stops_for
        self.pools = DraftPools(sources or {}, self.offer)
        self.committer = committer
        self.observers = list(observers)
        self.budget = budget or Budget()
        self.clock = clock
        settings = speculation or SpeculationSettings()
        if not getattr(model, "verifies_trees", False):  # a step that judges rows as chains only: no trees
            settings = replace(settings, tree_width=1)
        self.speculation = Speculation(settings, clock, self.pools.serial_pools)
        # a simulated device (benchmarks, tests): a step takes this long, the real forward of a
        # small model padded up to it (ADR 0014's device profiles)
        self.simulated_step_ms = simulated_step_ms
        self.on_step = on_step  # each step's report (benchmarks, metrics)
        self.summarize = summarize  # a finished session's statistics, stored with its last commit
        # a constraint -> its session's matcher (structured/grammar.py: ConstrainedRow); None:
        # this engine refuses constrained sessions
        self.constrain = constrain
        self.mask_ms = 0.0  # the masks' host time in the last step (ADR 0017)
        self.sessions: dict[str, EngineSession] = {}  # by arrival: the schedule's order
        self.last: StepReport | None = None
        self.ended: dict[str, EngineSession] = {}  # the last `keep_ended` sessions that ended
        self.keep_ended = keep_ended
        self._wake_at: float | None = None
        self._held_for: list[EngineSession] = []  # the sessions whose blocks the step is held for
        self._inbox = Inbox()
        self._just_ended: list[EngineSession] = []

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
        self._inbox.wake()

    def _post(self, kind: str, payload: Any) -> None:
        self._inbox.post(kind, payload)

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
        """Until `until`, or new work in the inbox. A held step (`Speculation.hold`) sleeps
        until the blocks it holds for are all in, applying them as they come (outside the lock
        the posting threads take), or its deadline: scheduling again at each arrival would cost
        the engine thread a schedule per block."""
        while self._held_for and until is not None and not (stop is not None and stop.is_set()):
            self._drain()
            left = until - self.clock()
            if left <= 0 or all(s.block is not None or not s.running for s in self._held_for):
                return
            self._inbox.wait(left, stop)
        self._inbox.wait(0.05 if until is None else max(until - self.clock(), 0.0), stop)

    def step(self) -> StepReport | None:
        """One step: schedule -> one forward -> settle each row -> hand the commits over.
        None: nothing to run (or the step is held for blocks about to land)."""
        t0, c0 = time.perf_counter(), time.thread_time()
        self.pools.serial_s = 0.0
        plan = self._schedule()
        if plan is None:
            self._notify_ended()  # cancelled from the inbox
            return None
        rows = [step_row(r, self.pools.wants_features(r.session), self.pools.on_device(r.session)) for r in plan.rows]
        self.mask_ms = sum(ms for _, ms in rows)
        step = Step([row for row, _ in rows])
        t1, c1 = time.perf_counter(), time.thread_time()
        out = self.model.step(step)
        c2 = time.thread_time()
        if self.simulated_step_ms is not None:  # the device's time: the real forward padded up to it
            time.sleep(max(self.simulated_step_ms(step, out) / 1e3 - (time.perf_counter() - t1), 0.0))
        t2 = time.perf_counter()
        forward_ms = (t2 - t1) * 1e3
        self.speculation.new_step(forward_ms)
        commits: list[CommitRecord] = []
        rounds = [self._settle(r, res, forward_ms, commits) for r, res in zip(plan.rows, out.rows, strict=True)]
        bookkeeping_ms = (t1 - t0 + time.perf_counter() - t2) * 1e3
        fed = sum(max(r.fed, 1) for r in out.rows)
        # (drafting on the engine's thread is priced by the K choice itself, not by the fit)
        self.speculation.observe_step(len(out.rows), fed, (forward_ms + bookkeeping_ms) / 1e3 - self.pools.serial_s)
        record_rounds(rounds, t0, bookkeeping_ms, self.observers)
        self._notify_ended()
        self._hand_over(commits)
        self._forget_ended()
        c3 = time.thread_time()
        self.last = StepReport(len(plan.rows), fed, forward_ms, bookkeeping_ms, plan.unseated,
                               None if self.simulated_step_ms is not None else out.device_ms,
                               forward_cpu_ms=(c2 - c1) * 1e3, bookkeeping_cpu_ms=(c1 - c0 + c3 - c2) * 1e3)
        if self.on_step is not None:
            self.on_step(self.last)
        return self.last

    def _schedule(self) -> Schedule | None:
        """Apply the inbox and pick the step's rows (scheduler.py); None when there are none,
        or when the step is held for blocks about to land (`Speculation.hold`)."""
        self._drain()
        self._forget_ended()
        spec = self.speculation
        plan = schedule(self.sessions.values(), self.clock(), self.budget, spec.block_wait_s, self.pools.can_draft,
                        spec.commit_held)
        self._wake_at = plan.wake_at
        self._held_for = []
        if plan.rows and plan.waiting:
            self._held_for, until = spec.hold(plan.rows, plan.waiting, self.clock())
            if until is not None:
                self._wake_at = until if self._wake_at is None else min(self._wake_at, until)
        return plan if plan.rows and not self._held_for else None

    def _hand_over(self, commits: list[CommitRecord]) -> None:
        """The step's commits to the committer (off this thread); a session's last round
        carries its statistics."""
        if not commits or self.committer is None:
            return
        if self.summarize is not None:
            commits = [replace(c, stats=self.summarize(self.sessions[c.session_id])) if c.finish_reason
                       else c for c in commits]
        self.committer.submit(commits)
        for c in commits:
            if (owner := self.sessions.get(c.session_id)) is not None:
                owner.unacked += 1

    def _drain(self) -> None:
        while (message := self._inbox.take()) is not None:
            kind, payload = message
            if kind == "add":
                self._open(*payload)
            elif kind == "block":
                block, arrived = payload
                if (s := self.sessions.get(block.session_id)) is not None:
                    self.speculation.block_arrived(s, block, arrived)
                    s.offer(block)  # a stale block (another prefix) is dropped here
            elif kind == "acked":
                for sid in payload:
                    if (s := self.sessions.get(sid)) is not None and s.unacked > 0:
                        s.unacked -= 1
            elif kind == "cancel" and (s := self.sessions.get(payload[0])) is not None and s.running:
                self._end(s, Status.CANCELLED, payload[1])
            elif kind == "call":  # (`on_loop`)
                _run(*payload)

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
                                  self.clock() if old is None else old.arrived)  # (driven again: its seat kept)
            if plan.constraint is not None:
                if self.constrain is None:
                    raise ValueError("this engine has no grammar compiler: constrained output is off")
                s.grammar = self.constrain(plan.constraint)
                s.grammar.advance(s.generated)  # adopted: the matcher picks up where the commits are
            s.handle = self.model.open(session_id, plan.adapter) if plan.adapter else self.model.open(session_id)
        except Exception as exc:
            done.set_exception(exc)
            return
        self.sessions[session_id] = s
        self.speculation.start_k(s)
        source = self.pools.of(s)
        if source is not None and (s.k_next > 0 or plan.adaptive):  # (held plain, it still probes)
            self.speculation.asked(s)
            self.pools.open(s, source)
        done.set_result(s)

    def _settle(self, row: Row, result: RowResult, forward_ms: float,
                commits: list[CommitRecord]) -> tuple[EngineSession, RoundStats | None]:
        """A row's result: a prefill chunk's progress, an error, or a verified round (its
        tokens committed, its lesson learnt, its next round asked for)."""
        s = row.session
        if result.features is not None:  # the target's features, for a pool that drafts from them (ADR 0020)
            self.pools.features(s, result.features_start, result.features)
        if result.again:  # a prefill chunk that did not reach the end of the prompt
            s.cached = min(s.cached + row.tokens, len(s.committed) - 1)
            return s, None
        if result.error is not None:
            self._end(s, Status.FAILED, "error", f"{type(result.error).__name__}: {result.error}")
            return s, None
        verdict = result.verdict
        assert verdict is not None
        row = drafted_on_device(row, result)
        s.cached = result.cached_len
        k_asked = s.k_next
        settled = commit_round(s, verdict, commits)
        k = self.speculation.learn(s, row, verdict, k_asked)
        block = row.block
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
        if s.plan.adaptive:  # (the engine picks K for these only)
            self.speculation.choose_k(s, self._batch(), forward_ms / 1e3, verified=k > 0)
        self._next_round(s, settled)
        return s, stats

    def _next_round(self, s: EngineSession, settled: Settled) -> None:
        """After a round: the session ends, or its draft source hears the outcome and is asked
        for the next block (a block it drafted ahead for this prefix is taken at once)."""
        s.block, s.waiting_since = None, None
        s.promote()
        k_next = s.k_next
        if settled.finish_reason is not None:
            self._end(s, Status.FINISHED, settled.finish_reason)
        elif (source := self.pools.of(s)) is not None and (k_next > 0 or s.plan.adaptive):
            self.speculation.asked_again(s)
            width = self.speculation.width(s, k_next, self._batch())
            self.pools.outcome(s, source, Outcome(s.id, len(s.committed), tuple(settled.tokens), k_next, width))

    def _batch(self) -> int:
        """The rows a step holds now: the running sessions, at most the seats (scheduler.py)."""
        return min(len(self.sessions), self.budget.max_batch)

    def _plain_reason(self, s: EngineSession, row: Row, k_asked: int) -> str:
        if not s.plan.pool:
            return s.plan.plain_reason
        if k_asked == 0:  # the engine held it plain, or the token budget left no room for drafts
            return NOT_PAYING if s.k_choice == 0 else ""
        if not self.pools.live(s):
            return DRAFT_UNAVAILABLE
        return NOT_PAYING if s.probing else row.fallback  # (a probe's block not there yet: it never waits)

    def _end(self, s: EngineSession, status: Status, reason: str, error: str = "") -> None:
        s.finish(status, reason, error)
        self.pools.close(s)
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


def on_loop(engine: EngineLoop, fn: Callable[[], Any]) -> Future[Any]:
    """Run `fn` on the engine's loop thread between two steps (the model's thread: a LoRA
    adapter's weights copied in, ADR 0029); the future gives its result or its error."""
    done: Future[Any] = Future()
    engine._post("call", (fn, done))
    return done


def _run(fn: Callable[[], Any], done: Future[Any]) -> None:
    try:
        done.set_result(fn())
    except Exception as exc:  # handed to the caller: the loop steps on
        done.set_exception(exc)


def drafted_on_device(row: Row, result: RowResult) -> Row:
    """A row whose drafts the target's own head gave in the step (ADR 0025): its block (and
    tree) with the drafts the step reports, or none where the head gave none (it ran plain)."""
    if row.block is None or not row.block.on_device:
        return row
    drafted = tuple(result.drafted or ())
    return replace(row, block=replace(row.block, tokens=drafted) if drafted else None,
                   tree=(list(drafted), list(row.tree[1]), None) if drafted and row.tree else None)


def step_row(row: Row, features: bool, head: bool = False) -> tuple[StepRow, float]:
    """The model step's row for a scheduled row: its drafts (a chain clipped to the
    session's K, or a tree), under the grammar's masks where the session has one; and the
    masks' host time (ms). `features`: the row returns the target's features (ADR 0020);
    `head`: the session drafts on the target's own head (ADR 0025): K drafts from it, none here."""
    s = row.session
    p = s.plan.params
    parents = None
    allowed = None
    t0 = time.perf_counter()
    if row.tree is not None:  # a tree: all its nodes below the committed path
        drafts, parents, q = list(row.tree[0]), list(row.tree[1]), row.tree[2]
        if s.grammar is not None and q is not None:  # (sampled trees are drawn unconstrained): its first branch
            drafts = first_branch(drafts, parents)
            q, parents = q_rows(q, slice(0, len(drafts))), None
        elif s.grammar is not None:  # its nodes the grammar allows, and each node's mask
            pruned = s.grammar.constrain_tree(drafts, parents)
            if pruned is not None:
                drafts, parents, allowed = pruned
                parents = parents or None  # (no node left: a plain row under the root's mask)
            else:  # the grammar forces the next token: its first branch as a chain (jump-forward)
                drafts, parents = first_branch(drafts, parents), None
    else:
        drafts, q = clip(row.block, s.k_next, row.offset) if row.block is not None else ([], None)
    if s.grammar is not None and allowed is None:  # (a prefill chunk short of the prompt's end ignores it)
        room = p.max_tokens - s.n_generated - 1  # drafts past the budget would never commit
        drafts, q, allowed = s.grammar.constrain(drafts, q, p.sampling.greedy, min(s.k_next, room), room)
    mask_ms = (time.perf_counter() - t0) * 1e3 if s.grammar is not None else 0.0
    out = StepRow.verify(s.handle, s.committed.ids, drafts, q, p.sampling, s.plan.seed, allowed, features=features)
    out.parents = parents
    if head:  # (a tree: the head's one shape, `step.head_tree`; K is its depth)
        out.head, out.k, out.drafts = True, tree_depth(parents) if parents else len(drafts), []
    return out, mask_ms


def commit_round(s: EngineSession, verdict: Verdict, commits: list[CommitRecord]) -> Settled:
    """The round's tokens, settled against the stops and the budget, into the session and
    (unless it is a shadow twin, which commits nothing) the step's commits."""
    expected = s.n_generated
    settled = settle(s.generated, verdict.tokens, s.text.stops, s.plan.params.max_tokens)
    s.committed.extend(settled.tokens)
    if s.grammar is not None:
        s.grammar.advance(settled.tokens)
    text = s.text.advance(s.generated, settled.finish_reason)
    if not s.plan.shadow:
        commits.append(CommitRecord(s.id, s.epoch, expected, tuple(settled.tokens), text, settled.finish_reason))
    return settled


def record_rounds(rounds: list[tuple[EngineSession, RoundStats | None]], t0: float, bookkeeping_ms: float,
                  observers: Sequence[EngineObserver]) -> None:
    """Each settled round's statistics, with the step's overhead and the session's wait,
    to the session and the observers."""
    ended = time.perf_counter()
    for s, stats in rounds:
        if stats is None:
            continue
        # the session's time between its previous round and this step: a row left out
        # of steps (its block late, or the budget) waited that long for its tokens
        wait_ms = (t0 - s.last_round_end) * 1e3 if s.last_round_end is not None else 0.0
        s.last_round_end = ended
        stats_final = replace(stats, overhead_ms=bookkeeping_ms, wait_ms=max(wait_ms, 0.0))
        s.rounds.append(stats_final)
        for o in observers:
            o.round(s, stats_final)
