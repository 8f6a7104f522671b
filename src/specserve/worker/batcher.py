"""The draft worker's micro-batcher (torch-free): calls queue work items, and whenever the
model is free the loop takes every queued item (one per session, at most `max_batch`) and
runs them as one batch on the model thread. (The target's engine loop, engine/loop.py,
builds its own steps under a token budget; this batcher has none: a draft item is K
one-token steps.)

Two priorities: foreground (a block a round waits for) and background (drafting ahead, ADR
0010). A batch holds foreground items only while any are queued; background items run only
when the model would otherwise idle, so a real call never waits behind more than the one
background batch already running.

An item the model could not finish in one pass (a long prompt prefilled chunk by chunk)
answers `again` (specserve/step.py: RowResult) and is queued again at the front: its next
chunk shares the next batch with the running sessions instead of stalling them.

Cost attribution (ADR 0013): each item's `Done.cost_s` is what a batch of rows like it takes
at the current batch size (worker/cost.py, fitted on the recent batches); a reply reports it
as its compute. `Done.share_s` is its share of the batch's wall time by tokens fed.

Example:
    sched = Scheduler(max_batch=32)
    loop_task = asyncio.create_task(sched.run(executor, model.step))  # step(Step) -> StepResult
    done = await sched.submit(Work("s1", StepRow.draft(slot, ids, 4, sampling, seed), tokens=4))
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

from specserve.step import RowResult, Step, StepResult, StepRow
from specserve.worker.cost import CostModel

FOREGROUND, BACKGROUND = 0, 1
MAX_WAIT_LIMIT_S = 0.001


@dataclass(eq=False)
class Work:
    session: Hashable
    payload: StepRow
    tokens: int = 1  # tokens the item feeds this pass: its share of the batch's cost
    priority: int = FOREGROUND
    spent_s: float = 0.0  # its share of earlier passes (a chunked prefill)
    future: asyncio.Future | None = field(default=None, repr=False)
    # called once when the item leaves the scheduler for good (finished, failed, or dropped
    # after its caller went away): not when the caller stops waiting, since a running item
    # still uses its session's KV until its batch is over
    release: Callable[[], None] | None = field(default=None, repr=False)

    def leave(self) -> None:
        if self.release is not None:
            self.release()
            self.release = None


@dataclass(frozen=True)
class Done:
    """A finished item: its row's result and what its batch cost."""

    value: RowResult
    batch_s: float  # the batch's wall time (and simulated device time)
    share_s: float  # this item's share of it (and of its earlier passes), by tokens fed
    batch_size: int
    cost_s: float = 0.0  # what a batch of rows like it takes at this batch size (worker/cost.py)


class Scheduler:
    def __init__(self, max_batch: int = 32, max_wait_s: float = 0.0,
                 on_batch: Callable[[int, float], None] | None = None, max_batched_tokens: int = 2048) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if max_batched_tokens < 1:
            raise ValueError(f"max_batched_tokens must be >= 1, got {max_batched_tokens}")
        if not 0 <= max_wait_s <= MAX_WAIT_LIMIT_S:
            raise ValueError(f"max_wait_s must be within 0..{MAX_WAIT_LIMIT_S}, got {max_wait_s}")
        self.max_batch = max_batch
        self.max_batched_tokens = max_batched_tokens
        self.max_wait_s = max_wait_s
        self.on_batch = on_batch  # (batch size, seconds) after every batch
        self.queue: list[Work] = []
        self.cost = CostModel()
        self._wake: asyncio.Event | None = None

    def _event(self) -> asyncio.Event:
        if self._wake is None:
            self._wake = asyncio.Event()
        return self._wake

    def submit(self, work: Work) -> asyncio.Future:
        """Queue `work`; the future resolves to a Done (or the item's exception)."""
        work.future = asyncio.get_running_loop().create_future()
        self.queue.append(work)
        self._event().set()
        return work.future

    def depth(self, priority: int | None = None) -> int:
        """Queued items not yet cancelled (of one priority, or all)."""
        return sum(1 for w in self.queue if not _dead(w) and (priority is None or w.priority == priority))

    def take(self) -> list[Work]:
        """The next batch: foreground items in arrival order, one per session, at most
        max_batch items and max_batched_tokens tokens fed (the first item always goes, and
        the batch stops at the first that would pass the budget, so arrival order is kept);
        background items only when no foreground item is queued."""
        self._prune()
        fg = any(w.priority == FOREGROUND for w in self.queue)
        batch: list[Work] = []
        seen: set[Hashable] = set()
        fed = 0
        for w in self.queue:
            if len(batch) == self.max_batch:
                break
            if (fg and w.priority != FOREGROUND) or w.session in seen:
                continue
            if batch and fed + max(w.tokens, 1) > self.max_batched_tokens:
                break
            seen.add(w.session)
            batch.append(w)
            fed += max(w.tokens, 1)
        taken = set(map(id, batch))
        self.queue = [w for w in self.queue if id(w) not in taken]
        return batch

    def _prune(self) -> None:
        """Drop the items whose callers went away (their futures are done), releasing them."""
        live = []
        for w in self.queue:
            if _dead(w):
                w.leave()
            else:
                live.append(w)
        self.queue = live

    async def next_batch(self) -> list[Work]:
        wake = self._event()
        self._prune()
        while not self.depth():
            wake.clear()
            await wake.wait()
        if self.max_wait_s and self.depth(FOREGROUND) < self.max_batch:
            await asyncio.sleep(self.max_wait_s)  # let the calls of this instant join
        return self.take()

    async def run(self, executor, step: Callable[[Step], StepResult],
                  extra_s: Callable[[list[Work]], float] | None = None) -> None:
        """The batching loop (one task per worker): take a batch, run `step` on the model
        thread over its items' rows, resolve the items. `extra_s(batch)`: simulated device
        time (benchmarks)."""
        loop = asyncio.get_running_loop()
        while True:
            batch = await self.next_batch()
            if not batch:
                continue
            t0 = time.perf_counter()
            try:
                out = await loop.run_in_executor(executor, step, Step([w.payload for w in batch]))
                results = out.rows
                for w, r in zip(batch, results, strict=True):
                    w.tokens = r.fed or w.tokens
            except Exception as exc:  # the whole batch failed (a bug or a bad shape): tell every caller
                results = [RowResult.of_error(exc)] * len(batch)
            extra = extra_s(batch) if extra_s is not None else 0.0
            if extra > 0:
                await asyncio.sleep(extra)
            elapsed = time.perf_counter() - t0
            self._finish(batch, results, elapsed)

    def _finish(self, batch: list[Work], results: list[RowResult], elapsed: float) -> None:
        if self.on_batch is not None:
            self.on_batch(len(batch), elapsed)
        total = sum(max(w.tokens, 1) for w in batch)
        self.cost.observe(len(batch), total, elapsed)
        again = []
        for w, r in zip(batch, results, strict=True):
            earlier = w.spent_s
            w.spent_s += elapsed * max(w.tokens, 1) / total
            if r.again:
                again.append(w)
                continue
            w.leave()
            if w.future is None or w.future.done():
                continue
            if r.error is not None:
                w.future.set_exception(r.error)
            else:
                cost = earlier + self.cost.row_cost(len(batch), max(w.tokens, 1), elapsed)
                w.future.set_result(Done(r, elapsed, w.spent_s, len(batch), cost))
        if again:
            self.queue[:0] = again
            self._event().set()


def _dead(w: Work) -> bool:
    return w.future is not None and w.future.done()
