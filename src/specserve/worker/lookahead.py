"""The target's lookahead steps (ADR 0019, item 5; ADR 0025 for sampled rows): after a step
of plain rows whose verdicts the device step computed, the next step of the same rows is
launched before the step returns, each row fed the token the step left on the device; the
next call takes it where it asks for exactly that step. Plain rows at T > 0 are judged on the
device too (models/step_judge.py), so sampled sessions look ahead as greedy ones do.

Also here: the timing of a launched step on the device (`StepClock`) and the copy of a
step's verdicts to the host behind an event (`snapshot`), which the chained rounds share.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from specserve.algorithm.rejection import verdicts_from_host
from specserve.models.kv_slots import common_prefix
from specserve.models.runner import Row
from specserve.step import Kind, RowResult, Step, StepResult, StepRow

if TYPE_CHECKING:
    from specserve.params import SamplingParams


def device_judged(job: StepRow) -> bool:
    """Whether the device step can compute this row's verdict in its own run: no banned
    tokens, no constraint, no host tree, and greedy or without a q from the host (one-hot
    drafts, or none; models/step_judge.py)."""
    s = job.sampling
    return not s.banned_token_ids and job.allowed is None and job.parents is None and (s.greedy or job.q is None)


def row_sampling(job: StepRow) -> SamplingParams | None:
    """The sampling a forward's row carries to the device step's judge: a sampled row's the
    device judges; None for greedy rows (their verdict needs no parameters) and the rest."""
    return None if job.sampling.greedy or not device_judged(job) else job.sampling


def judged_in_step(job: StepRow, row: Row) -> bool:
    """Whether the device step computed the verdict of a row it ran (`row`: its forward's row):
    no banned tokens or constraint; greedy, or sampled where the row carried its sampling
    (models/step_judge.py); a host tree is judged on the host, a tree the device drafted there."""
    return (row.head is not None or device_judged(job)) and (job.sampling.greedy or row.sampling is not None) \
        and not job.sampling.banned_token_ids and job.allowed is None


def plain_only(step: Step) -> bool:
    """Every row a plain row whose verdict the device step computes (no drafts, banned
    tokens, constraint, tree or features; greedy or sampled): what a lookahead can run."""
    return bool(step.rows) and all(
        j.kind is Kind.VERIFY and not j.drafts and device_judged(j) and not j.features and not j.head
        for j in step.rows)


@dataclass
class _Ahead:
    """A lookahead step on the device (`PlainLookahead.launch`): its rows' sessions in the
    device step's order, each one's cached length before it (the lookahead fed one token
    there), the tokens fed (None until the step before is read), and its verdicts' copy."""

    slots: list[Any]
    lengths: list[int]
    tokens: list[int] | None
    host: torch.Tensor  # [R, 2] float64: accepted, final token (pinned on CUDA)
    done: Any  # a CUDA event recorded after the copy, or None (the CPU: copied already)
    bucket: Any = None  # the device step's bucket it ran in
    clock: StepClock | None = None  # its own time on the device
    sampled: list[tuple[Any, int]] = field(default_factory=list)  # each row's (sampling or None, seed)

    def read(self) -> list[list[float]]:
        if self.done is not None:
            self.done.synchronize()  # this step's copy only: the lookahead after it runs on
        out: list[list[float]] = self.host.tolist()
        return out


def snapshot(verdicts: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """The step's verdicts copied to the host once the device is done with them, without
    waiting now (pinned memory and an event on CUDA); read with `_Ahead.read`."""
    if verdicts.device.type != "cuda":
        return verdicts.to("cpu", copy=True), None
    host = torch.empty(verdicts.shape, dtype=verdicts.dtype, pin_memory=True)
    host.copy_(verdicts, non_blocking=True)
    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream(verdicts.device))  # (the verdicts' device: cuda:N, not the current one)
    return host, done


class StepClock:
    """A launched step's own time on the device: CUDA events on the device's stream before
    and after its launch (the stream runs in order, so the time between them is the step's,
    not the host's or another step's); on the CPU, where a launch runs the step, the call's
    wall time."""

    def __init__(self, device: torch.device) -> None:
        self.t0 = time.perf_counter()
        self.t1 = self.t0
        self.events: tuple[Any, Any] | None = None
        if device.type == "cuda":
            stream = torch.cuda.current_stream(device)
            self.events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self.events[0].record(stream)
            self.stream = stream

    def stop(self) -> None:
        self.t1 = time.perf_counter()
        if self.events is not None:
            self.events[1].record(self.stream)

    def ms(self) -> float:
        """Once the step is done (its verdicts read)."""
        if self.events is not None:
            return float(self.events[0].elapsed_time(self.events[1]))
        return (self.t1 - self.t0) * 1e3

    def gap_to(self, after: StepClock) -> float:
        """ms from this step's end to the start of the step launched `after` it, both done: on
        CUDA the device's idle time between them (an event runs when the stream reaches it, so
        a step launched while this one ran starts as it ends: 0); on the CPU the host's."""
        if self.events is not None and after.events is not None:
            return max(float(self.events[1].elapsed_time(after.events[0])), 0.0)
        return max((after.t0 - self.t1) * 1e3, 0.0)

class PlainLookahead:
    """One target's lookahead steps: the one on the device (`ahead`), the counts of steps
    taken and thrown away (`counts`), and the device's idle time between taken ones (`gaps_ms`)."""

    def __init__(self, target: Any) -> None:
        self.t = target  # the BatchedTarget (its runner and its `lookahead` setting)
        self.ahead: _Ahead | None = None
        self.counts = {"hit": 0, "missed": 0}  # lookahead steps taken / thrown away
        # between consecutive taken lookahead steps: the device's idle ms (`StepClock.gap_to`)
        self.gaps_ms: deque[float] = deque(maxlen=4096)
        self.last_clock: StepClock | None = None

    def take(self, step: Step) -> StepResult | None:
        """The step's results from the lookahead on the device, where it ran exactly this
        step (counted as taken), else None (counted as thrown away where there was one)."""
        ahead, self.ahead = self.ahead, None
        if ahead is None:
            return None
        taken = self._from_ahead(ahead, step)
        self.counts["hit" if taken is not None else "missed"] += 1  # (thrown: its KV position is UNKNOWN)
        return taken

    def after(self, step: Step, out: StepResult) -> bool:
        """After a synchronous step: launch the next where every row is a plain row the device
        step judged; whether it did."""
        if not (plain_only(step) and all(r.verdict is not None for r in out.rows)
                and len(self.t.runner.fixed_rows) == len(step.rows)):
            return False
        self.launch([job.slot for job in step.rows], [len(job.ids) for job in step.rows],
                    [r.verdict.tokens[-1] for r in out.rows if r.verdict is not None], list(range(len(step.rows))),
                    [(row_sampling(job), job.seed) for job in step.rows])
        return True

    def launch(self, slots: list[Any], lengths: list[int], tokens: list[int] | None, picks_at: list[int],
               sampled: list[tuple[SamplingParams | None, int]]) -> None:
        """Launch the next step of these plain rows, each fed the pick the last step left in
        `picks[picks_at[i]]` (the device step's rows are the rows here, in this order), and copy
        its verdicts to the host as soon as it is done, without waiting. `tokens`: the picks
        fed, where known (else filled in by `_from_ahead` once read); `sampled`: each row's
        sampling and seed, judged on the device."""
        runner = self.t.runner
        ds = runner.device_step
        assert ds is not None
        try:
            for h, n in zip(slots, lengths, strict=True):
                # the room the step it stands for asks (`_feed`): the token fed and the one it adds
                runner.kv.check_room(h, 2)
                if runner.length(h) != n:
                    return  # (not where the step left it)
        except Exception:
            return  # a full slot: the next step finds out, synchronously
        rows = [Row(h, ds.picks[j:j + 1], num_logits=1, sampling=s, seed=seed)
                for j, h, (s, seed) in zip(picks_at, slots, sampled, strict=True)]
        clock = StepClock(ds.device)
        runner.forward(rows)
        clock.stop()
        if len(runner.fixed_rows) != len(rows):  # (not bucketed: it ran eagerly; nothing to gain)
            for h, n in zip(slots, lengths, strict=True):
                runner.rollback(h, n)
            return
        assert ds.last is not None
        self.ahead = _Ahead(slots, lengths, tokens, *snapshot(ds.verdicts[:len(rows)]), bucket=ds.last,
                            clock=clock, sampled=sampled)

    def _order(self, ahead: _Ahead, step: Step) -> list[int] | None:
        """Each step row's row in the lookahead, where the step asks for exactly it: sessions it
        ran (in any order), each with the same sampling, asking for the next token after the
        one the lookahead fed (which the step before judged). Else None."""
        if len(step.rows) > len(ahead.slots) or not plain_only(step) or ahead.tokens is None:
            return None
        where = {h: j for j, h in enumerate(ahead.slots)}
        if len(where) != len(ahead.slots) or len({job.slot for job in step.rows}) != len(step.rows):
            return None
        kv, order = self.t.runner.kv, []
        for job in step.rows:
            j, slot = where.get(job.slot), kv.slot_of.get(job.slot)
            if j is None or slot is None or len(job.ids) != ahead.lengths[j] + 1 or job.ids[-1] != ahead.tokens[j] \
                    or ahead.sampled[j] != (row_sampling(job), job.seed):
                return None
            cached = kv.ids[slot]
            if len(cached) != ahead.lengths[j] + 1 or common_prefix(cached, job.ids) < ahead.lengths[j]:
                return None
            order.append(j)
        return order

    def _from_ahead(self, ahead: _Ahead, step: Step) -> StepResult | None:
        """This step's results from the lookahead, where it is the step that lookahead ran, or
        a part of it (a session it ran may have ended) in the bucket that step would run in.
        Else None (the caller runs the step). The result's `device_ms`: the lookahead's own
        time on the device (`StepClock`)."""
        order = self._order(ahead, step)
        if order is None:
            return None
        runner, tokens = self.t.runner, ahead.tokens
        assert tokens is not None and runner.device_step is not None
        # a row's bits follow its bucket: a part of the lookahead stands for the step only where
        # that step would run in the same bucket (the same row count and key span buckets)
        if len(order) != len(ahead.slots) and runner.device_step.bucket_for(
                [Row(job.slot, [tokens[j]], num_logits=1) for job, j in zip(step.rows, order, strict=True)],
                [ahead.lengths[j] for j in order]) != ahead.bucket:
            return None
        for job, j in zip(step.rows, order, strict=True):
            runner.kv.settle(job.slot, ahead.lengths[j], [tokens[j]])
        # the step after, launched before this one is read: the device is never left idle
        if self.t.lookahead:
            self.launch([job.slot for job in step.rows], [ahead.lengths[j] + 1 for j in order], None, order,
                        [ahead.sampled[j] for j in order])
        packed = ahead.read()
        device_ms = ahead.clock.ms() if ahead.clock is not None else None
        if self.last_clock is not None and ahead.clock is not None:
            self.gaps_ms.append(self.last_clock.gap_to(ahead.clock))
        self.last_clock = ahead.clock
        if self.ahead is not None:
            self.ahead.tokens = [int(packed[j][1]) for j in order]
        results = []
        for job, v in zip(step.rows, verdicts_from_host([packed[j][:2] for j in order], [[] for _ in order], False),
                          strict=True):
            r = RowResult(fed=1)
            r.verdict, r.cached_len, r.rolled_back = v, len(job.ids), 0
            results.append(r)
        return StepResult(results, device_ms=device_ms)
