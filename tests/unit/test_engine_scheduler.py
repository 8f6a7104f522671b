"""The engine's schedule (ADR 0014), one rule per case, with literal sessions and no model:
which row each session gets, how long a speculating session waits for its block, and the
step's budget."""

from __future__ import annotations

from dataclasses import replace

import pytest

from specserve.algorithm.stops import StopChecker
from specserve.engine.scheduler import DRAFT_LATE, Budget, gather_wait, schedule
from specserve.engine.session import DraftBlock, EnginePlan, EngineSession, Status
from specserve.params import GenerationParams

STOPS = StopChecker(frozenset(), (), lambda ids: "")
WAIT = 0.002


def wait(s) -> float:
    return WAIT


def _session(sid: str, prompt_len: int = 4, k: int = 0, cached: int | None = None, max_tokens: int = 16,
             generated: tuple[int, ...] = ()) -> EngineSession:
    plan = EnginePlan(GenerationParams(max_tokens=max_tokens, num_draft_tokens=k, seed=1), pool="small" if k else None)
    s = EngineSession.new(sid, list(range(1, prompt_len + 1)), plan, STOPS, generated)
    s.cached = len(s.committed) - 1 if cached is None else cached
    return s


def _block(s: EngineSession, tokens=(9, 9, 9), base_len: int | None = None) -> DraftBlock:
    n = len(s.committed) if base_len is None else base_len
    return DraftBlock(s.id, n, s.committed.hash_at(min(n, len(s.committed))), tuple(tokens))


def test_a_plain_session_gets_a_plain_row():
    s = _session("a")
    plan = schedule([s], 0.0, Budget(), wait)
    assert [(r.session.id, r.block, r.tokens, r.fallback) for r in plan.rows] == [("a", None, 1, "")]
    assert plan.wake_at is None


def test_a_speculating_session_with_its_block_gets_a_verify_row_of_last_token_plus_drafts():
    s = _session("a", k=3)
    assert s.offer(_block(s))
    (row,) = schedule([s], 0.0, Budget(), wait).rows
    assert row.block is s.block and row.tokens == 1 + 3


def test_a_block_for_another_prefix_is_refused_on_arrival():
    s = _session("a", k=3)
    assert not s.offer(_block(s, base_len=len(s.committed) - 1))  # one token behind: stale
    assert s.block is None


def test_a_block_whose_first_drafts_were_since_committed_verifies_the_rest():
    s = _session("a", k=3, generated=(7,))  # a plain round just committed 7
    n = len(s.committed) - 1
    assert s.offer(DraftBlock("a", n, s.committed.hash_at(n), (7, 8, 9)))  # drafted before 7 came
    (row,) = schedule([s], 0.0, Budget(), wait).rows
    assert row.offset == 1 and row.tokens == 1 + 2  # the last token, then drafts 8 and 9
    assert not s.offer(DraftBlock("a", n, s.committed.hash_at(n), (6, 8, 9)))  # guessed wrong: stale


def test_a_block_longer_than_the_budget_allows_counts_only_the_drafts_the_round_can_use():
    s = _session("a", k=4, max_tokens=3, generated=(5,))  # 2 tokens left -> K = 1
    s.offer(_block(s, tokens=(9, 9, 9, 9)))
    (row,) = schedule([s], 0.0, Budget(), wait).rows
    assert s.k_next == 1 and row.tokens == 2


def test_a_session_waits_for_its_late_block_within_the_bound_then_runs_plain():
    s = _session("a", k=3)
    first = schedule([s], 10.0, Budget(), wait)
    assert first.rows == [] and first.wake_at == pytest.approx(10.0 + WAIT)
    assert schedule([s], 10.0 + WAIT / 2, Budget(), wait).rows == []  # still within the bound
    (row,) = schedule([s], 10.0 + WAIT, Budget(), wait).rows
    assert row.block is None and row.fallback == DRAFT_LATE and row.tokens == 1


def test_a_session_whose_pool_cannot_draft_runs_plain_at_once():
    s = _session("a", k=3)
    (row,) = schedule([s], 0.0, Budget(), wait, can_draft=lambda s: False).rows
    assert row.block is None and s.waiting_since is None


def test_a_waiting_session_does_not_hold_back_the_others():
    late, plain = _session("late", k=2), _session("plain")
    plan = schedule([late, plain], 0.0, Budget(), wait)
    assert [r.session.id for r in plan.rows] == ["plain"] and plan.wake_at == WAIT
    assert plan.waiting == [late]  # what the engine may hold the step for (Speculation.hold)


def test_a_long_prompt_is_fed_in_chunks_without_logits_until_its_last_chunk():
    s = _session("long", prompt_len=300, cached=0)
    (row,) = schedule([s], 0.0, Budget(prefill_chunk=128), wait).rows
    assert row.tokens == 128 and row.block is None and row.fallback == ""
    s.cached = 256
    (row,) = schedule([s], 0.0, Budget(prefill_chunk=128), wait).rows
    assert row.tokens == 44  # the rest of the prompt, and this row samples


def test_the_token_budget_cuts_the_step_but_always_takes_the_first_row():
    long, a, b = _session("long", prompt_len=300, cached=0), _session("a"), _session("b")
    rows = schedule([long, a, b], 0.0, Budget(max_batched_tokens=100, prefill_chunk=128), wait).rows
    assert [r.session.id for r in rows] == ["long"]  # over budget alone, still taken
    rows = schedule([a, long, b], 0.0, Budget(max_batched_tokens=120, prefill_chunk=128), wait).rows
    assert [r.session.id for r in rows] == ["a"]  # the chunk does not fit after a; b waits its turn


def test_max_batch_caps_the_rows():
    sessions = [_session(str(i)) for i in range(5)]
    assert len(schedule(sessions, 0.0, Budget(max_batch=3), wait).rows) == 3


def test_a_newer_session_waits_for_a_seat_and_is_not_preempted_once_started():
    """max_batch seats, by arrival: a session past them gets no row even where a seated one
    waits for its block, so that once started, a plain session's tokens come every step
    (before: it took the waiting session's row, then lost it when the block landed)."""
    spec, a, b, newer = _session("spec", k=2), _session("a"), _session("b"), _session("newer")
    budget = Budget(max_batch=3)
    first = schedule([spec, a, b, newer], 0.0, budget, wait)
    assert [r.session.id for r in first.rows] == ["a", "b"] and first.waiting == [spec]  # newer: no seat
    spec.offer(_block(spec, tokens=(9, 9)))
    assert [r.session.id for r in schedule([spec, a, b, newer], 0.001, budget, wait).rows] == ["spec", "a", "b"]
    a.finish(Status.FINISHED, "length")  # a seat frees: the next by arrival takes it, for good
    assert [r.session.id for r in schedule([spec, a, b, newer], 0.002, budget, wait).rows] == ["spec", "b", "newer"]
    held = schedule([spec, a, b, newer], 0.002, budget, wait, held=lambda s: s.id == "b").rows
    assert [r.session.id for r in held] == ["spec", "newer"]  # a held session keeps its seat, no row


def test_seats_go_by_arrival_and_free_rows_to_twins_then_to_prompt_chunks_that_emit_nothing():
    """The second review's cases. A session driven again keeps its `arrived`, so its seat,
    wherever it stands in the engine's table; a shadow twin (commits nothing) gets a row only
    where the served sessions leave one; a session waiting for a seat may feed a prompt chunk
    that stops short of its prompt's end (it emits nothing), never its last."""
    again, a = _session("again", k=2), _session("a")
    again.arrived, a.arrived = 1.0, 2.0
    assert [r.session.id for r in schedule([a, again], 0.0, Budget(max_batch=1), wait).rows] == []  # again waits
    twin = _session("twin", k=0)
    twin.plan = replace(twin.plan, shadow=True)
    rows = schedule([again, twin, a], 0.0, Budget(max_batch=2), wait).rows
    assert [r.session.id for r in rows] == ["a", "twin"]  # again waits for its block: its free row to the twin
    assert [r.session.id for r in schedule([twin, a], 0.0, Budget(max_batch=1), wait).rows] == ["a"]
    long, last = _session("long", prompt_len=300, cached=0), _session("last", prompt_len=300, cached=250)
    long.arrived, last.arrived = 3.0, 4.0
    rows = schedule([again, a, long, last], 0.0, Budget(max_batch=2, prefill_chunk=128), wait).rows
    assert [(r.session.id, r.tokens) for r in rows] == [("a", 1), ("long", 128)]  # last's chunk would emit


def test_sessions_that_ended_get_no_row():
    s = _session("a")
    s.finish(Status.CANCELLED, "cancelled")
    assert schedule([s], 0.0, Budget(), wait).rows == []


def test_a_bad_budget_is_refused():
    with pytest.raises(ValueError, match="positive"):
        Budget(max_batch=0)


FLAT = 0.007  # a memory-bound step: the same 7 ms for 1 row or 64


def test_a_step_holds_for_blocks_due_within_it_when_that_emits_more_per_second():
    """2 rows ready worth 2.1 tokens each, 2 blocks due in 5 ms worth as much, 7 ms steps:
    now 4.2 / 7 = 0.60 tokens/ms; after 5 ms 8.4 / 12 = 0.70. Hold until they are due."""
    assert gather_wait(4.2, [(0.005, 2.1), (0.005, 2.1)], lambda n: FLAT, 2, FLAT) == 0.005
    # one block due in 1 ms and one in 6 ms: 2 rows + 1 after 1 ms is best (6.3 / 8 > 8.4 / 13)
    assert gather_wait(4.2, [(0.006, 2.1), (0.001, 2.1)], lambda n: FLAT, 2, FLAT) == 0.001


def test_a_step_does_not_hold_its_rows_for_a_few_blocks_or_when_rows_cost_time():
    # 60 plain rows and 4 speculating sessions whose blocks are due in 5 ms: run now
    assert gather_wait(60.0, [(0.005, 2.2)] * 4, lambda n: FLAT, 60, FLAT) == 0.0
    # a step that grows with its rows (a CPU: 1 ms + 1 ms a row): 4.2 / 3 ms beats 8.4 / 10 ms
    assert gather_wait(4.2, [(0.005, 2.1)] * 2, lambda n: 0.001 * (1 + n), 2, FLAT) == 0.0
    # blocks due past the horizon, or overdue (their time passed: no telling when): run now
    assert gather_wait(2.1, [(0.009, 2.1)] * 3, lambda n: FLAT, 1, FLAT) == 0.0
    assert gather_wait(2.1, [(-0.001, 2.1)] * 3, lambda n: FLAT, 1, FLAT) == 0.0


def test_the_schedule_counts_the_sessions_waiting_for_a_seat():
    """What `specserve_target_queue_depth` exports for the engine (its StepReport carries it):
    served sessions past the seats; shadow twins and ended sessions are not counted."""
    sessions = [_session(str(i)) for i in range(5)]
    twin = _session("twin")
    twin.plan = replace(twin.plan, shadow=True)
    sessions[0].finish(Status.FINISHED, "length")
    assert schedule([*sessions, twin], 0.0, Budget(max_batch=3), wait).unseated == 1
    assert schedule(sessions, 0.0, Budget(max_batch=4), wait).unseated == 0
