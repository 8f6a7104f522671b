"""Which rows the next engine step runs (torch-free; nano-vllm's `Scheduler.schedule`).

Per running session, oldest first, at most one row:
- prefilling (its committed prefix is not all in KV): a prefill chunk. The model step feeds
  the next `prefill_chunk` tokens; the chunk that reaches the end of the prompt also
  verifies, like any other row;
- speculating, with a block for its committed prefix (or one whose first drafts were since
  committed, `EngineSession.usable`): a verify row (K + 1 logits);
- speculating without one: it waits for its block, at most `block_wait_s(session)` (chosen
  by cost in the loop: what the block is worth against plain steps), then runs a plain row
  (`draft_late`);
- plain: a plain row (1 logit).
A session held back (`held`: too many of its rounds not yet committed, the commit
back-pressure of ADR 0014) gets no row until its commits are answered.

The step holds at most `max_batch` rows and `max_batched_tokens` tokens fed. The first row
is always taken, so one long chunk cannot stall the engine. Sessions left out this step go
first next step, because the order is by arrival.

**Seats** (ADR 0021): the `max_batch` oldest served sessions (by `arrived`, which a session
driven again keeps) decode; each holds its seat until it ends, held or waiting for its block
included, and the rest wait for a seat. Before, a newer session took the row of an older one
waiting for its block and lost it when the block landed: under overload a plain request
started, then sat out steps while speculative ones reclaimed them, and its TPOT went up by a
third (bench_overload: 1.21-1.37x the all-plain run at p90). Rows the seated sessions leave
free go to shadow twins, then to prompt chunks of unseated sessions that emit nothing. A
started session is not preempted by another's block; it can still sit out a step when held
(commit back-pressure) or cut by the token budget.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from specserve.engine.session import DraftBlock, EngineSession
from specserve.step import q_rows, reparented, subtree_nodes

if TYPE_CHECKING:
    from specserve.algorithm.rejection import QProbs

DRAFT_LATE = "draft_late"


@dataclass(frozen=True)
class Row:
    session: EngineSession
    block: DraftBlock | None  # the drafts this row verifies (None: a plain row)
    tokens: int  # tokens the row feeds (its share of the budget)
    fallback: str = ""  # why a speculating session runs without drafts this step
    offset: int = 0  # the block's drafts already committed (the row verifies the rest)
    # a token tree's drafts, parents and q as this row verifies them (below the committed path); None: a chain
    tree: tuple[list[int], list[int], QProbs] | None = None


@dataclass(frozen=True)
class Schedule:
    rows: list[Row]
    wake_at: float | None  # the earliest block deadline of a waiting session (None: none waits)
    waiting: list[EngineSession] = field(default_factory=list)  # the sessions waiting for their block
    unseated: int = 0  # served sessions waiting for a seat (past the max_batch oldest)


@dataclass(frozen=True)
class Budget:
    max_batch: int = 32
    max_batched_tokens: int = 2048
    prefill_chunk: int = 128

    def __post_init__(self) -> None:
        if self.max_batch < 1 or self.max_batched_tokens < 1 or self.prefill_chunk < 1:
            raise ValueError(f"engine budget must be positive: {self}")


def schedule(sessions: Iterable[EngineSession], now: float, budget: Budget,
             block_wait_s: Callable[[EngineSession], float],
             can_draft: Callable[[EngineSession], bool] = lambda s: True,
             held: Callable[[EngineSession], bool] = lambda s: False) -> Schedule:
    """The rows of the next step and when to look again for sessions waiting for a block.
    `can_draft(session)` is False when no block can come for it (no live replica of its
    pool; for an exact session, only a pool that refused it): it runs plain at once.

    Example: a plain session, a speculating one whose block has arrived and one whose block
    is 1 ms late with a 2 ms bound -> rows [plain, verify], wake_at = its wait start + 2 ms.
    """
    running = sorted((s for s in sessions if s.running), key=lambda s: s.arrived)  # (stable: ties by order)
    served = [s for s in running if not s.plan.shadow]
    seated, unseated = served[:budget.max_batch], served[budget.max_batch:]
    waits_for_seat = {id(s) for s in unseated}
    rows: list[Row] = []
    waiting: list[EngineSession] = []
    used = 0
    wake_at: float | None = None
    # the seated sessions first; then, in rows they leave free, shadow twins (they commit
    # nothing and yield to served requests) and the prompt chunks of sessions still waiting
    # for a seat that stop short of the prompt's end (they emit nothing, so no one's tokens
    # wait on them: a seat, once given, is then closer to the first token)
    for s in [*seated, *(t for t in running if t.plan.shadow), *unseated]:
        if held(s):
            continue
        if id(s) in waits_for_seat and len(s.committed) - s.cached <= budget.prefill_chunk:
            continue  # (its next row would emit a token: that waits for its seat)
        row = _row(s, now, budget.prefill_chunk, block_wait_s, can_draft)
        if row is None:  # waiting for its block
            deadline = (s.waiting_since or now) + block_wait_s(s)
            wake_at = deadline if wake_at is None else min(wake_at, deadline)
            waiting.append(s)
            continue
        if rows and (len(rows) >= budget.max_batch or used + row.tokens > budget.max_batched_tokens):
            break
        rows.append(row)
        used += row.tokens
    return Schedule(rows, wake_at, waiting, len(unseated))


def _row(s: EngineSession, now: float, chunk: int, block_wait_s: Callable[[EngineSession], float],
         can_draft: Callable[[EngineSession], bool]) -> Row | None:
    pending = len(s.committed) - s.cached  # tokens not yet in KV (at least the last one)
    if pending > chunk:  # a chunk that does not reach the end of the prompt: no logits needed
        return Row(s, None, chunk)
    feed = max(pending, 1)
    k = s.k_next
    if k == 0 or not can_draft(s):
        return Row(s, None, feed)
    if s.declined(s.block):
        return Row(s, None, feed)
    if s.block is not None and (offset := s.usable(s.block)) is not None:
        if s.block.parents is not None:  # a tree verifies all its nodes below the committed path
            return tree_row(s, s.block, feed, offset)
        return Row(s, s.block, feed + min(len(s.block.tokens) - offset, k), offset=offset)
    if s.waiting_since is None:
        s.waiting_since = now
    if now - s.waiting_since < block_wait_s(s):
        return None
    return Row(s, None, feed, DRAFT_LATE)


def tree_row(s: EngineSession, block: DraftBlock, feed: int, offset: int) -> Row:
    """A tree block's row: all its nodes below the path the committed tokens took into it
    (`offset` of them since it was drafted), re-rooted there, with their q rows."""
    assert block.parents is not None
    if not offset:  # the whole tree, as drafted
        return Row(s, block, feed + len(block.tokens), tree=(list(block.tokens), list(block.parents), block.q))
    nodes = subtree_nodes(block.tokens, block.parents, s.committed.ids[block.base_len:])
    assert nodes is not None  # (`usable` kept the block: the path is in it)
    view = ([int(block.tokens[n]) for n in nodes], reparented(block.parents, nodes), q_rows(block.q, nodes))
    return Row(s, block, feed + len(nodes), offset=offset, tree=view)


def gather_wait(ready: float, waiting: Iterable[tuple[float, float]], step_s: Callable[[int], float],
                rows: int, horizon_s: float) -> float:
    """How long to hold a step for blocks about to land: 0 (run now) or the wait until one
    of them is due, whichever gives the most tokens per second over the hold and the step.

    A memory-bound step costs nearly the same for 4 rows as for 2, so running the rows ready
    now and verifying the rest one step later (their blocks landed mid-step) can emit fewer
    tokens per second than waiting a little for them and verifying all in one step. `ready`
    is the tokens the ready rows are expected to emit (`rows` of them); `waiting` gives, per
    session waiting for its block, (seconds until it is due, tokens its round is expected to
    emit); `step_s(n)` is a step of n rows. Only blocks due within `horizon_s` count.

    Example: 2 ready rows worth 2.1 tokens each, 2 blocks due in 5 ms worth 2.1 each, steps of
    7 ms: now 4.2 / 7 = 0.6 tokens/ms; after 5 ms 8.4 / 12 = 0.7: hold 5 ms.
    """
    due = sorted((d, v) for d, v in waiting if 0.0 < d <= horizon_s)
    best_w, best_rate = 0.0, ready / step_s(rows) if rows else 0.0
    value, n = ready, rows
    for d, v in due:
        value, n = value + v, n + 1
        rate = value / (d + step_s(n))
        if rate > best_rate:
            best_w, best_rate = d, rate
    return best_w
