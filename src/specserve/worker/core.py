"""What the draft and target servicers share: a model step (worker/model_step.py), its one
model thread, the session table and the scheduler, wired together. A servicer validates a
call, queues one work item for its session (`run`) and answers from the result."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import Executor
from typing import TYPE_CHECKING, Any

from specserve.errors import KVBudgetExhausted, SessionNotFound
from specserve.serving.metrics import WorkerMetrics
from specserve.worker import threads
from specserve.worker.batcher import FOREGROUND, Done, Scheduler, Work
from specserve.worker.session_table import SessionTable, WorkerSession

if TYPE_CHECKING:  # (the model steps import torch; the protocol is for the type checker)
    from specserve.step import ModelStep


class WorkerCore:
    def __init__(self, model: ModelStep, metrics: WorkerMetrics, max_sessions: int, max_batch: int = 32,
                 max_wait_ms: float = 0.0, evict_idle_s: float = 1.0, max_batched_tokens: int = 2048,
                 extra_s: Callable[[list[Work]], float] | None = None,
                 on_close: Callable[[WorkerSession], None] | None = None, name: str = "worker",
                 executor: Executor | None = None) -> None:
        self.model = model
        self.metrics = metrics
        self.extra_s = extra_s
        # One model thread runs every batch (the one that loaded the model where the worker
        # gives it, with the torch threads set here: threads.py); KV slots are taken and freed
        # on the event loop, a session's only once none of its items is queued or running
        # (SessionTable).
        self.executor = executor or threads.ModelThread(name)
        self.sessions = SessionTable(model.open, model.close, max_sessions, evict_idle_s, on_close)
        # a per-session model step runs items one by one: batches of one answer each call at once
        self.scheduler = Scheduler(min(max_batch, model.max_batch or max_batch), max_wait_ms / 1e3,
                                   on_batch=self._observe, max_batched_tokens=max_batched_tokens)
        self._loop: asyncio.Task | None = None

    def _observe(self, size: int, seconds: float) -> None:
        m = self.metrics
        m.busy.add(seconds)  # the batch's model time (with a simulated device's, where one is set)
        m.batch_size.observe(size)
        m.queue_depth.set(self.scheduler.depth())
        m.sessions.set(len(self.sessions))
        if self.model.slots is not None:
            used, free = self.model.slots
            m.kv_slots.labels("used").set(used)
            m.kv_slots.labels("free").set(free)
        m.device_step(getattr(getattr(self.model, "runner", None), "device_step", None))

    def session(self, session_id: str) -> WorkerSession:
        """The session's entry (KVBudgetExhausted, counted, when there is no room for it)."""
        try:
            return self.sessions.get(session_id)
        except KVBudgetExhausted:
            self.metrics.refused.inc()
            raise

    async def run(self, seq: WorkerSession, job: Any, tokens: int, priority: int = FOREGROUND) -> Done:
        """Queue one item for `seq` and wait for its batch (the session is not evicted meanwhile)."""
        if self._loop is None or self._loop.done():
            self._loop = asyncio.create_task(self.scheduler.run(self.executor, self.model.step, self.extra_s))
        if not self.sessions.holds(seq):  # work that outlived its session (drafting ahead after a Release)
            raise SessionNotFound(f"session {seq.id} was released on this worker")
        seq.busy += 1  # until the item leaves the scheduler, even if this caller goes away first
        return await self.scheduler.submit(Work(seq.id, job, tokens, priority, release=seq.leave))
