"""The worker's scheduler and session table, torch-free: batches take every queued item (one
per session, at most max_batch, background only when no real call waits), a chunked item
comes back first, a batch's time is split by tokens, and admission evicts only idle sessions."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from specserve.errors import KVBudgetExhausted, NeedsFullPrefix
from specserve.step import RowResult, Step, StepResult
from specserve.v1 import common_pb2
from specserve.worker.batcher import BACKGROUND, FOREGROUND, Scheduler, Work
from specserve.worker.cost import CostModel
from specserve.worker.session_table import SessionTable


def _queue(sched: Scheduler, *items: tuple[str, int]) -> list[Work]:
    works = [Work(s, i, priority=p) for i, (s, p) in enumerate(items)]
    for w in works:
        sched.submit(w)
    return works


def test_a_batch_takes_every_queued_item_once_per_session_up_to_max_batch():
    async def go():
        sched = Scheduler(max_batch=3)
        _queue(sched, ("a", FOREGROUND), ("b", FOREGROUND), ("a", FOREGROUND), ("c", FOREGROUND),
               ("d", FOREGROUND))
        first = [w.payload for w in sched.take()]
        second = [w.payload for w in sched.take()]
        return first, second, sched.take()

    first, second, third = asyncio.run(go())
    assert first == [0, 1, 3]  # a's second item waits: a session is never twice in a batch
    assert second == [2, 4]
    assert third == []


def test_a_batch_stops_at_its_token_budget_in_arrival_order_and_always_takes_one_item():
    async def go():
        sched = Scheduler(max_batch=8, max_batched_tokens=10)
        for i, (s, tokens) in enumerate((("a", 4), ("b", 5), ("c", 3), ("d", 1), ("e", 30), ("f", 2))):
            sched.submit(Work(s, i, tokens=tokens))
        return [[w.payload for w in sched.take()] for _ in range(4)]

    first, second, third, fourth = asyncio.run(go())
    assert first == [0, 1]  # 4 + 5; c's 3 would make 12: the batch ends there, d does not jump it
    assert second == [2, 3]  # 3 + 1; e's 30 would pass the budget
    assert third == [4]  # alone over the budget: a batch always takes its first item
    assert fourth == [5]
    with pytest.raises(ValueError, match="max_batched_tokens"):
        Scheduler(max_batched_tokens=0)


def test_background_items_run_only_when_no_call_waits_and_cancelled_items_are_dropped():
    async def go():
        sched = Scheduler(max_batch=8)
        works = _queue(sched, ("a", BACKGROUND), ("b", FOREGROUND), ("c", BACKGROUND), ("d", FOREGROUND))
        works[3].future.cancel()
        fg = [w.payload for w in sched.take()]
        bg = [w.payload for w in sched.take()]
        return fg, bg, sched.depth()

    fg, bg, depth = asyncio.run(go())
    assert fg == [1]
    assert bg == [0, 2]
    assert depth == 0


def test_the_loop_resolves_items_splits_the_batch_time_by_tokens_and_requeues_again_items_first():
    seen: list[list[int]] = []
    passes: dict[int, int] = {}

    def step(batch: Step) -> StepResult:
        seen.append(list(batch.rows))
        time.sleep(0.01)
        out = []
        for row in batch.rows:
            passes[row] = passes.get(row, 0) + 1
            if row == 0 and passes[0] < 3:  # a prompt fed in three chunks
                out.append(RowResult.later())
            elif row == 2:
                out.append(RowResult.of_error(ValueError("bad row")))
            else:
                out.append(RowResult(proposal=f"r{row}"))
        return StepResult(out)

    async def go():
        sched = Scheduler(max_batch=2)
        loop = asyncio.create_task(sched.run(ThreadPoolExecutor(1), step))
        futs = [sched.submit(Work(s, i, tokens=t)) for i, (s, t) in enumerate([("a", 3), ("b", 1), ("c", 1)])]
        results = await asyncio.gather(*futs, return_exceptions=True)
        loop.cancel()
        return results

    r0, r1, r2 = asyncio.run(go())
    assert seen[0] == [0, 1]
    assert seen[1][0] == 0 and seen[2][0] == 0  # the chunked item goes first in the next batches
    assert r0.value.proposal == "r0" and r1.value.proposal == "r1"
    assert isinstance(r2, ValueError)  # one item's error fails that call only
    assert r0.batch_size == len(seen[2])
    # r0 fed 3 of the first batch's 4 tokens, then shared two more batches
    first_batch_s = r1.share_s * 4  # r1 fed 1 of the first batch's 4 tokens
    assert r1.batch_s == pytest.approx(first_batch_s)
    # r0: 3/4 of the first batch, 3/4 of the second (beside c), all of the third
    assert r0.share_s > 0.75 * first_batch_s + 0.99 * r0.batch_s


def test_the_cost_model_prices_a_row_as_a_batch_of_rows_like_it():
    cost = CostModel(min_batches=4)
    assert cost.row_cost(4, 5, batch_s=0.02) == 0.02  # not fitted yet: the batch's own time
    a, r, b = 0.009, 0.0008, 0.0003  # the CPU figures, roughly
    for rows, tokens in [(1, 1), (1, 5), (4, 4), (4, 20), (16, 16), (16, 80), (8, 30), (2, 9)]:
        cost.observe(rows, tokens, a + r * rows + b * tokens)
    plain16, verify16 = cost.row_cost(16, 1, 0.0), cost.row_cost(16, 5, 0.0)
    assert plain16 == pytest.approx(a + r * 16 + b * 16)
    assert verify16 == pytest.approx(a + r * 16 + b * 80)
    # the price of K = 4 over a plain step grows with the batch: the controller sees load
    assert verify16 / plain16 > 1.4 > cost.row_cost(1, 5, 0.0) / cost.row_cost(1, 1, 0.0)


def test_the_cost_model_drops_a_negative_term():
    cost = CostModel(min_batches=2)
    for rows, tokens in [(1, 1), (2, 2), (4, 4), (8, 8), (3, 30)]:
        cost.observe(rows, tokens, 0.01 + 0.001 * tokens - 0.0001 * rows)
    # the rows term came out negative: dropped, and the others refitted (a clamp alone would
    # leave the constant at 0.01; the refit moves it to absorb the rows term)
    assert cost.coef is not None and cost.coef[1] == 0
    assert cost.coef[0] < 0.0099 and cost.coef[2] == pytest.approx(0.001, rel=0.01)


def test_one_session_alone_still_fits_the_cost_of_its_tokens():
    """Rows never vary (one session): the rows' term cannot be told from the constant, so
    the fit is a + b N (it was none, and a lone session's K and tree width were priced by the
    prior). Where the tokens do not vary either, still none."""
    cost = CostModel(min_batches=2)
    for tokens in (1, 5, 9, 1, 5):
        cost.observe(1, tokens, 0.010 + 0.0004 * tokens)
    assert cost.coef is not None
    assert cost.coef[0] == pytest.approx(0.010, rel=1e-6) and cost.coef[1] == 0
    assert cost.coef[2] == pytest.approx(0.0004, rel=1e-6)
    flat = CostModel(min_batches=2)
    for _ in range(5):
        flat.observe(1, 1, 0.01)
    assert flat.coef is None


def test_max_wait_is_bounded_by_one_millisecond():
    with pytest.raises(ValueError, match="max_wait_s"):
        Scheduler(max_wait_s=0.005)
    with pytest.raises(ValueError, match="max_batch"):
        Scheduler(max_batch=0)


class FakeKV:
    """A backend with `slots` KV slots."""

    def __init__(self, slots: int) -> None:
        self.free = slots
        self.closed: list[str] = []

    def open(self, session_id: str) -> str:
        if not self.free:
            raise KVBudgetExhausted("all KV slots are in use")
        self.free -= 1
        return session_id

    def close(self, handle: str, busy: bool = False) -> None:
        self.free += 1
        self.closed.append(handle)


def test_admission_evicts_the_least_recently_used_idle_session_and_refuses_when_all_are_running():
    kv = FakeKV(2)
    table = SessionTable(kv.open, kv.close, max_sessions=10, evict_idle_s=0.0)
    a = table.get("a")
    table.get("b")
    a.busy = 1  # a call of a is queued or running: it keeps its slot
    table.get("c")  # b was idle: evicted
    assert kv.closed == ["b"] and set(table.sessions) == {"a", "c"}
    table.sessions["c"].busy = 1
    with pytest.raises(KVBudgetExhausted, match="none has been idle"):
        table.get("d")
    assert set(table.sessions) == {"a", "c"}  # nothing lost


def test_recently_used_sessions_keep_their_slots_until_idle_long_enough():
    kv = FakeKV(1)
    table = SessionTable(kv.open, kv.close, max_sessions=10, evict_idle_s=60.0)
    table.get("a")
    with pytest.raises(KVBudgetExhausted):
        table.get("b")
    table.sessions["a"].last_used -= 61
    table.get("b")
    assert kv.closed == ["a"]


def test_the_session_count_is_a_budget_evicted_like_an_lru():
    kv = FakeKV(10)
    table = SessionTable(kv.open, kv.close, max_sessions=2, evict_idle_s=0.0)
    table.get("a"), table.get("b"), table.get("a"), table.get("c")
    assert list(table.sessions) == ["a", "c"] and kv.closed == ["b"]
    assert table.release("a") and not table.release("a")
    busy = SessionTable(kv.open, kv.close, max_sessions=1, evict_idle_s=0.0)
    busy.get("x").busy = 1
    with pytest.raises(KVBudgetExhausted, match="all 1 sessions"):
        busy.get("y")


def test_a_sequence_reconciles_to_the_committed_prefix():
    kv = FakeKV(1)
    seq = SessionTable(kv.open, kv.close, max_sessions=1).get("a")
    assert seq.reconcile(common_pb2.Prefix(tokens=[5, 6, 7])) == [5, 6, 7]
    with pytest.raises(NeedsFullPrefix):
        seq.reconcile(common_pb2.Prefix(base_len=5, base_hash=1, tokens=[8]))


def _controller_at(batch: int, alpha: float):
    """The controller's estimate (ADR 0006) from rounds priced by the cost model at `batch`
    rows (the issue's CPU figures), K in {2, 4, 6} seen, draft cost per token growing with
    the draft's batch too."""
    from specserve.control.controller import estimate

    a, r, b = 0.009, 0.0008, 0.00033
    cost = CostModel(min_batches=4)
    for rows, tokens in [(1, 1), (1, 5), (4, 4), (4, 20), (16, 16), (16, 80), (8, 30), (64, 320)]:
        cost.observe(rows, tokens, a + r * rows + b * tokens)
    plain = {"n:0": 10.0, "v:0": 10 * cost.row_cost(batch, 1, 0.0) * 1e3, "o:0": 0.0}
    spec = {"o:2": 0.0, "o:4": 0.0, "o:6": 0.0}
    for k in (2, 4, 6):
        spec |= {f"n:{k}": 10.0, f"v:{k}": 10 * cost.row_cost(batch, k + 1, 0.0) * 1e3,
                 f"d:{k}": 10 * k * (0.5 + 0.05 * batch)}
    for i in range(1, 7):
        spec |= {f"pe:{i}": 100.0, f"pa:{i}": 100.0 * alpha}
    return estimate(spec, plain, 8)


def test_the_controller_fed_load_priced_costs_shortens_k_as_load_grows():
    """Part 5's mechanism: the same acceptance, priced at a larger batch, gives a shorter best
    K and a smaller speedup (at alpha 0.4 heading for plain)."""
    k1, s1 = _controller_at(1, 0.8).best(1, 8)
    k16, s16 = _controller_at(16, 0.8).best(1, 8)
    assert k1 >= 5 and k16 <= 3 and s16 < s1
    low1 = _controller_at(1, 0.4).best(1, 8)[1]
    low64 = _controller_at(64, 0.4)
    assert low64.best(1, 8)[0] == 1 and low64.best(1, 8)[1] < 0.85 * low1
    assert low64.speedup[4] < 1.0 < _controller_at(1, 0.4).speedup[4]  # K=4 stops paying under load


def test_an_item_stays_busy_until_its_batch_is_over_even_when_its_caller_goes_away():
    """A caller cancelled (deadline, disconnect) while its item runs must not free the
    session's KV under the model thread: `release` comes when the item leaves the scheduler.
    A queued item whose caller went away is released when the next batch drops it."""
    import threading

    running, go_on = threading.Event(), threading.Event()
    released: list[str] = []

    def step(batch):
        running.set()
        go_on.wait(5)
        return StepResult([RowResult(proposal=row) for row in batch.rows])

    async def go():
        sched = Scheduler(max_batch=1)
        loop_task = asyncio.create_task(sched.run(ThreadPoolExecutor(1), step))
        first = asyncio.ensure_future(sched.submit(Work("a", 1, release=lambda: released.append("a"))))
        queued = sched.submit(Work("b", 2, release=lambda: released.append("b")))
        await asyncio.to_thread(running.wait, 5)
        first.cancel()  # the caller of "a" goes away while "a" is in the running batch
        queued.cancel()  # the caller of "b" goes away while "b" waits
        await asyncio.sleep(0.05)
        during = list(released)
        go_on.set()
        for _ in range(100):  # the batch ends; the next take drops "b"
            if len(released) == 2:
                break
            await asyncio.sleep(0.01)
        loop_task.cancel()
        return during, released

    during, after = asyncio.run(go())
    assert during == []  # nothing released while "a" still ran, nor before "b" was dropped
    assert sorted(after) == ["a", "b"]


def test_a_session_released_while_its_item_waits_keeps_its_kv_until_the_item_leaves():
    """A router's Release can arrive while a Verify of the session still waits for a batch
    (soak, 64 streams: "holds no KV slot" on the model thread). The session leaves the table
    at once; its slot is freed only when its last item leaves the scheduler."""
    kv = FakeKV(2)
    table = SessionTable(kv.open, kv.close, max_sessions=10)
    seq = table.get("a")
    seq.busy = 2  # two items queued
    assert table.release("a") and "a" not in table.sessions
    assert kv.closed == []  # the queued items still use the slot
    seq.leave()
    assert kv.closed == []
    seq.leave()
    assert kv.closed == ["a"] and kv.free == 2
    table.get("b").busy = 0
    assert table.release("b") and kv.closed == ["a", "b"]  # idle: freed at once


def test_no_new_item_runs_on_a_released_session():
    """Drafting ahead awaits between blocks; a Release in between must stop it, not hand the
    freed handle to the model thread (the draft's "holds no KV slot" in the soak)."""
    import asyncio

    from specserve.errors import SessionNotFound
    from specserve.serving.metrics import WorkerMetrics
    from specserve.worker.core import WorkerCore

    class Engine(FakeKV):
        max_batch = 4
        slots = None

        def step(self, batch):
            return StepResult([RowResult(proposal=row) for row in batch.rows])

    async def body():
        engine = Engine(1)
        core = WorkerCore(engine, WorkerMetrics("test_released"), max_sessions=4)
        seq = core.session("a")
        assert (await core.run(seq, "first", 1)).value.proposal == "first"
        core.sessions.release("a")
        with pytest.raises(SessionNotFound, match="released"):
            await core.run(seq, "after", 1)
        assert engine.closed == ["a"] and seq.busy == 0

    asyncio.run(body())
