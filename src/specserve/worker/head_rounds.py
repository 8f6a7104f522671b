"""The host's side of the target's own EAGLE head (ADR 0025; the device's side is
models/head_step.py): which sessions' heads are current, the rows that draft on it, the
eager feeds of long prefill chunks, the drafts read back with the verdicts, and the rounds
chained on the device with the host one round behind (`ChainedRounds`).

A session of the `eagle-local` pool whose rows the device step judges (greedy, no banned
tokens, no constraint) sends rows marked `StepRow.head`: every row feeds the head its
committed positions (inside the round where the device step judged the row, here for the
rest), and a row asking for K drafts (`StepRow.k`) gets them from the head inside the same
run, where the head is current (true through the committed length - 2, `HeadRows.through`);
else the row runs plain, and says so (`RowResult.drafted` empty).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch

from specserve.algorithm.rejection import Verdict
from specserve.models.kv_slots import common_prefix
from specserve.models.runner import Row
from specserve.step import RowResult, Step, StepResult, StepRow, head_tree

if TYPE_CHECKING:
    from specserve.drafters.eagle import EagleHead
    from specserve.models.runner import ModelRunner
    from specserve.models.step_buckets import Bucket

log = logging.getLogger(__name__)


class HeadRows:
    """The head's host mirror and the rows and feeds that keep it current."""

    def __init__(self, runner: ModelRunner, head: EagleHead) -> None:
        ds = runner.device_step
        if ds is None:
            raise ValueError("the target's own head runs inside the device step: enable it first "
                             "(cuda_graphs on CUDA, or Batching.fixed_step)")
        self.runner = runner
        self.device = ds.enable_head(head)
        self.through: dict[int, int] = {}  # by KV slot: the head is true through this position (-1: none)

    def opened(self, handle: Any) -> None:
        self.through[self.runner.kv.slot(handle)] = -1

    def closed(self, handle: Any) -> None:
        slot = self.runner.kv.slot_of.get(handle)
        if slot is not None:
            self.through.pop(slot, None)

    def drafts_now(self, job: StepRow, start: int, last: bool) -> int:
        """The drafts (a tree: its depth) the head gives this row now: the row's K where the
        head is current for it (its row feeds the last committed token alone, the head is true
        through the position before it, and the drafts fit the device step's widest row), else 0."""
        ds = self.runner.device_step
        if not (last and job.k > 0 and ds is not None and start == len(job.ids) - 1
                and 1 + job.k * tree_width(job) <= ds.max_width and (job.sampling.greedy or tree_width(job) == 1)):
            return 0  # (a sampled row's drafts on the device are a chain: ADR 0025)
        return job.k if self.through.get(self.runner.kv.slot(job.slot), -1) == start - 1 else 0

    def row(self, job: StepRow, feed: list[int], last: bool, start: int) -> Row:
        """The forward's row for a head session's step row: the head's drafts as placeholders
        after the fed tokens (the round writes them; a tree's under its ancestor mask, rotary
        positions by depth), judged where it is the prompt's end."""
        from specserve.algorithm.tree import Tree
        from specserve.worker.model_step import _tree_row

        k = self.drafts_now(job, start, last)
        w = tree_width(job) if k and self.device.trees else 1
        if w > 1:
            return replace(_tree_row(job.slot, feed, [0] * (w * k), Tree(tuple(head_tree(w, k)))), head=k, head_width=w)
        sampling = None if job.sampling.greedy else job.sampling  # (judged on the device: models/step_judge.py)
        return Row(job.slot, feed + [0] * k, num_logits=k + 1 if last else 0, head=k, sampling=sampling, seed=job.seed)

    def settled(self, job: StepRow, row: Row, result: RowResult, verdict: Verdict, start: int, tail: int,
                drafted: list[int], ran_fixed: bool, feats: torch.Tensor | None) -> None:
        """A head row judged in a synchronous step: the head's drafts named in the KV's record
        (they were placeholders there; a tree's accepted path, which the round moved to follow
        the prefix) and reported, and the head fed what the verdict committed (inside the
        round where the device step ran and judged the row)."""
        if drafted:
            self.runner.kv.settle(job.slot, start + tail, drafted if row.head_width == 1
                                  else verdict.tokens[:verdict.num_accepted])
        result.drafted = drafted
        self.fed(job, start, len(row.tokens), verdict, ran_fixed and (row.num_logits or 0) > 0, feats)

    def fed(self, job: StepRow, start: int, fed: int, verdict: Verdict | None, in_round: bool,
            feats: torch.Tensor | None) -> None:
        """After the step: the head fed this row's committed positions (`in_round`: inside the
        device step's round, which judged it; else here, eagerly, from the row's features) and
        the mirror moved to the committed length - 2 (a prompt chunk not judged: its last
        position fed)."""
        slot = self.runner.kv.slot(job.slot)
        full = list(job.ids) + (verdict.tokens if verdict is not None else [])
        end = len(full) - 2 if verdict is not None else start + fed - 1  # the last position fed
        if start > self.through.get(slot, -1) + 1:  # a position the head never saw: it stays plain
            log.warning("the target's head missed positions of a session (through %d, fed from %d): its rounds "
                        "run plain", self.through.get(slot, -1), start)
            self.through[slot] = -(1 << 30)
            return
        if not in_round and end >= start:
            assert feats is not None or not self.device.uses_features
            self.device.feed_eager(slot, start, feats[:end - start + 1] if feats is not None else None,
                                   full[start:end + 2])
        self.through[slot] = end


def tree_width(job: StepRow) -> int:
    """A head row's first candidates: its tree's roots (ADR 0025: `step.head_tree`), 1 for a chain."""
    return 1 if job.parents is None else sum(1 for p in job.parents if p < 0)


def head_verdict(packed: Sequence[float], k: int, w: int, width: int) -> tuple[Verdict, list[int]]:
    """A head row's verdict from its packed row (`verdict_rows`: accepted, final token, the
    bucket's lanes 1.. (`width` - 1 of them: the drafts), then a tree's accepted lanes by depth),
    and the drafts it verified."""
    a, final = int(packed[0]), int(packed[1])
    nodes = [int(x) for x in packed[2:2 + w * k]]
    path = list(range(a)) if w == 1 else [int(x) - 1 for x in packed[1 + width:1 + width + a]]
    return Verdict(a, [nodes[i] for i in path] + [final], a if a < k else None), nodes


def device_drafts(judged_ids: torch.Tensor, width: int) -> torch.Tensor:
    """The drafts the head wrote into the step's token ids: lanes 1.. of each row [R, W - 1]."""
    return judged_ids.view(-1, width)[:, 1:]


def verdict_rows(ds: Any, at: list[int], drafts: bool) -> torch.Tensor:
    """The device step's verdicts [n, 2] of its rows `at` (accepted, final token), each
    followed, where `drafts`, by the head's drafts of its row and a tree's accepted lanes
    (ADR 0025: read in the same copy; `head_verdict` reads them)."""
    from specserve.device import to_device

    done = ds.verdicts
    if drafts and ds.last is not None:
        b = ds.last
        done = torch.cat([done[:b.rows], device_drafts(ds.field("ids", b.tokens), b.width).double(),
                          ds.head.path[:b.rows, :b.width].double()], 1)
    out: torch.Tensor = done[:len(at)] if at == list(range(len(at))) else done.index_select(0, to_device(at, ds.device))
    return out


@dataclass
class _Round:
    """A round launched ahead (`ChainedRounds`): its rows' sessions in the device step's order,
    each one's committed length and head drafts when it was launched from, the round before's
    tokens (None until that round is read), and its verdicts' copy."""

    slots: list[Any]
    ks: list[int]
    ws: list[int]  # each row's tree width (1: a chain)
    base: list[int]  # each row's committed length the round before started from
    before: list[list[int]] | None  # the round before's emitted tokens, per row
    host: torch.Tensor  # [R, 2 + 2W - 1] float64: accepted, final token, the head's drafts, a tree's path
    done: Any
    bucket: Bucket
    clock: Any = None
    sampled: list[tuple[Any, int]] = field(default_factory=list)  # each row's (sampling, seed): judged on the device


class ChainedRounds:
    """Rounds chained on the device (ADR 0025): after a step of head rows and plain greedy
    rows that all ran in the device step, the next round of the same rows is launched before
    the host reads this one (`launch`); the next call takes it where it asks for exactly that
    round (`take`), launching the one after first. Counts: rounds taken and thrown away."""

    def __init__(self, target: Any) -> None:
        self.t = target  # the BatchedTarget (its runner, heads, snapshot and clock)
        self.ahead: _Round | None = None
        self.counts = {"taken": 0, "thrown": 0}
        # rounds taken, and of them parts ("parts": sessions that ended left the round, whose
        # rows the device runs on, unread, until a synchronous step prepares the rows afresh);
        # why rounds were thrown away: "ended" (a session it ran is not in the step and the rest
        # do not fill its bucket: it finished, was cancelled or its row is held), "joined" (the
        # step has a session it did not run), "changed" (a row asks for something else: drafts of
        # its own, another K, sampling, a grammar, other tokens), "bucket" (the step would run in
        # another bucket)
        self.thrown_by: dict[str, int] = {}

    @staticmethod
    def chainable(step: Step, rows: Sequence[Row]) -> bool:
        """Rows a round can be chained from: each a head row or a plain greedy row without
        host drafts, banned tokens, a constraint or a tree of its own, feeding one committed
        token (its drafts, or the head's tree, after it); `rows` the forward's."""
        return bool(step.rows) and len(rows) == len(step.rows) and all(
            (j.sampling.greedy or r.sampling is not None) and not j.sampling.banned_token_ids and j.allowed is None
            and (j.parents is None or bool(r.head)) and not j.drafts and not j.features
            and len(r.tokens) == 1 + (r.head or 0) * r.head_width for j, r in zip(step.rows, rows, strict=True))

    def launch(self, step: Step, rows: Sequence[Row], results: Sequence[RowResult]) -> None:
        """After a synchronous step: the next round of the same rows, where every row ran in
        the device step and fits another round."""
        t, kv = self.t, self.t.runner.kv
        ds = t.runner.device_step
        if ds is None or len(t.runner.fixed_rows) != len(rows) or not self.chainable(step, rows):
            return
        if any(r.verdict is None for r in results):
            return
        starts = [kv.length(j.slot) for j in step.rows]
        nxt = [Row(j.slot, [0] * len(r.tokens), num_logits=len(r.tokens)) for j, r in zip(step.rows, rows, strict=True)]
        bucket = ds.bucket_for(nxt, starts)
        if bucket is None or bucket.rows != ds.last.rows or bucket.width != ds.last.width:  # type: ignore[union-attr]
            return
        try:
            for j, r in zip(step.rows, rows, strict=True):
                kv.check_room(j.slot, len(r.tokens))
        except Exception:
            return
        for j, r in zip(step.rows, rows, strict=True):
            kv.append(j.slot, torch.empty(len(r.tokens)))  # UNKNOWN until read
        before = [list(res.verdict.tokens) for res in results]  # type: ignore[union-attr]
        self.ahead = self._launch(bucket, [j.slot for j in step.rows], [r.head or 0 for r in rows],
                                  [r.head_width for r in rows], [len(j.ids) for j in step.rows], before,
                                  [(j.sampling, j.seed) for j in step.rows])

    def _launch(self, bucket: Bucket, slots: list[Any], ks: list[int], ws: list[int], base: list[int],
                before: list[list[int]] | None, sampled: list[tuple[Any, int]]) -> _Round:
        from specserve.worker.lookahead import StepClock, snapshot

        ds = self.t.runner.device_step
        assert ds is not None and ds.head is not None
        clock = StepClock(ds.device)
        ds.head.launch(bucket, max(ks), max(ws), chained=True)
        clock.stop()
        ds.last = bucket
        host, done = snapshot(verdict_rows(ds, list(range(bucket.rows)), True))
        return _Round(slots, ks, ws, base, before, host, done, bucket, clock, sampled)

    def take(self, step: Step) -> StepResult | None:
        """This step's results from the round launched ahead, where the step asks for exactly
        that round: its sessions (in any order), each with the committed tokens the device
        assumed (the round before's, read now) and the same head drafts, in the bucket a
        synchronous step would run. The round after is launched before this one is read.
        Else None: the round is thrown away (its positions are UNKNOWN on the host, and the
        head's writes sit past the committed ones) and the caller runs the step."""
        ahead, self.ahead = self.ahead, None
        if ahead is None:
            return None
        order = self._order(ahead, step)
        if isinstance(order, str):
            self.counts["thrown"] += 1
            self.thrown_by[order] = self.thrown_by.get(order, 0) + 1
            return None
        self.counts["taken"] += 1
        if len(order) < len(ahead.slots):  # a part: sessions that ended left it (their rows run on, unread)
            self.counts["parts"] = self.counts.get("parts", 0) + 1
        kv = self.t.runner.kv
        by_row = {i: j for i, j in zip(order, step.rows, strict=True)}  # the device's row i -> its step row
        # the round after, before this one is read: the bucket's span for the most the rows can
        # have grown (every draft accepted), the slots' room for that
        nxt = self._room_after(ahead, {i: len(j.ids) - 1 for i, j in by_row.items()})
        if nxt is not None:
            self.ahead = self._launch(nxt, ahead.slots, ahead.ks, ahead.ws,
                                      [len(by_row[i].ids) if i in by_row else -1 for i in range(len(ahead.slots))],
                                      None, ahead.sampled)
        packed = _read(ahead)
        results = [self._settled(j, ahead.ks[i], ahead.ws[i], packed[i], ahead.bucket.width)
                   for j, i in zip(step.rows, order, strict=True)]
        if self.ahead is not None:  # the round after: its rows' positions, now that this one's are known
            self.ahead.before = [list(results[order.index(i)].verdict.tokens) if i in by_row  # type: ignore[union-attr]
                                 else [] for i in range(len(ahead.slots))]
            for i, j in by_row.items():
                kv.append(j.slot, torch.empty(1 + ahead.ks[i] * ahead.ws[i]))  # UNKNOWN until read
        return StepResult(results, device_ms=ahead.clock.ms() if ahead.clock is not None else None)

    def _settled(self, job: StepRow, k: int, w: int, packed: Sequence[float], width: int) -> RowResult:
        """A row of a round read back: its verdict, the head's drafts (a tree's accepted path,
        which the round moved to follow the prefix) named in the KV's record, the rejected ones
        dropped, the head's mirror moved."""
        kv = self.t.runner.kv
        start = len(job.ids) - 1
        verdict, drafts = head_verdict(packed, k, w, width)
        a = verdict.num_accepted
        kv.settle(job.slot, start, [job.ids[-1]] + (drafts if w == 1 else verdict.tokens[:a]))
        kv.rollback(job.slot, start + 1 + a)
        self.t.heads.through[kv.slot(job.slot)] = start + a
        res = RowResult(fed=1 + k * w)
        res.verdict, res.cached_len, res.rolled_back = verdict, start + 1 + a, k * w - a
        res.drafted = drafts if job.head else None
        return res

    def _order(self, ahead: _Round, step: Step) -> list[int] | str:
        """Each step row's row in the round launched ahead, where the step asks for exactly it;
        else why not (`thrown_by`)."""
        where = {h: i for i, h in enumerate(ahead.slots)}
        mine = {j.slot for j in step.rows}
        if any(j.slot not in where for j in step.rows):
            return "joined"
        if len(mine) != len(step.rows) or len(where) != len(ahead.slots) or ahead.before is None:
            return "changed"
        order = [where[j.slot] for j in step.rows]
        if not all(self._asks_for(j, ahead, i) for j, i in zip(step.rows, order, strict=True)):
            return "changed"
        ds = self.t.runner.device_step
        rows = [Row(j.slot, [0] * (1 + ahead.ks[i] * ahead.ws[i]), num_logits=1 + ahead.ks[i] * ahead.ws[i])
                for j, i in zip(step.rows, order, strict=True)]
        if ds is None or ds.bucket_for(rows, [len(j.ids) - 1 for j in step.rows]) != ahead.bucket:
            # (a row's bits follow its bucket: the step would run in another; a part that no
            # longer fills the bucket's rows, after sessions ended, counts as their end)
            return "ended" if len(step.rows) < len(ahead.slots) else "bucket"
        return order

    def _asks_for(self, j: StepRow, ahead: _Round, i: int) -> bool:
        """Whether step row `j` asks for exactly the device's row i of the round launched ahead."""
        if (j.sampling, j.seed) != ahead.sampled[i] or j.sampling.banned_token_ids or j.allowed is not None \
                or (j.parents is not None and not j.head) or j.drafts or j.features:
            return False
        k, before = ahead.ks[i], ahead.before[i]  # type: ignore[index]
        if (k > 0 and not j.head) or (j.head and (j.k != k or tree_width(j) != ahead.ws[i])) \
                or len(j.ids) != ahead.base[i] + len(before) or list(j.ids[ahead.base[i]:]) != before:
            return False
        kv = self.t.runner.kv
        slot = kv.slot_of.get(j.slot)
        if slot is None:
            return False
        start = len(j.ids) - 1
        if len(kv.ids[slot]) != start + 1 + k * ahead.ws[i] or common_prefix(kv.ids[slot], j.ids) < start:
            return False
        return not k or self.t.heads.through.get(slot, -1) == start - 1

    def _room_after(self, ahead: _Round, starts: dict[int, int]) -> Bucket | None:
        """The bucket of the round after this one (`starts`: this round's, by the device's row,
        of the rows still asked for), for the most the rows can have grown, or None where a slot
        has no room for it (the next step finds out, synchronously)."""
        ds = self.t.runner.device_step
        assert ds is not None
        w = ahead.bucket.width
        furthest = [st + w for st in starts.values()]  # this round accepts at most K: the next starts by then
        rows = [Row(ahead.slots[i], [0] * w, num_logits=w) for i in starts]
        if any(f + w > self.t.runner.kv.max_len for f in furthest):
            return None
        b = ds.bucket_for(rows, furthest)
        if b is None or b.rows != ahead.bucket.rows or b.width != w:
            return None
        return b


def _read(r: _Round) -> list[list[float]]:
    if r.done is not None:
        r.done.synchronize()  # this round's copy only: the round after runs on
    out: list[list[float]] = r.host.tolist()
    return out
