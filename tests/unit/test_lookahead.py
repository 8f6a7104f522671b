"""The target's lookahead steps (ADR 0019, async steps): a step of greedy plain rows launches
the next step of the same rows, fed its own picks on the device, before it returns; the next
call takes that step's results when it asks for exactly that step, and throws it away when
not. Proven here on the CPU (where the device step runs eagerly, so the lookahead only adds a
forward): the tokens are those of the engine without it, whatever the steps in between do,
and a taken lookahead launches the one after it before reading its own verdicts."""

from __future__ import annotations

import random

import torch
from test_runner_exactness import RANDOM_MODELS

from specserve.algorithm.sampling import SamplingParams
from specserve.models.verifier import TargetModel
from specserve.step import Step, StepRow
from specserve.worker import lookahead as lookahead_module
from specserve.worker.model_step import BatchedTarget, Batching

GREEDY = SamplingParams()


def _engine(model, lookahead: bool) -> BatchedTarget:
    return BatchedTarget(TargetModel(model), Batching(max_sessions=8, max_len=96, tile=None, fuse_upto=0,
                                                      prefill_chunk=16, fixed_step=True, lookahead=lookahead))


def _script(engine: BatchedTarget, seed: int = 0) -> tuple[list[list[int]], list]:
    """One fixed schedule of steps: plain runs (the lookahead's case), a session joining with
    its prompt, a verify row with drafts, a sampled row, the rows in another order, a session
    closed, a prompt fed in chunks. Returns every step's tokens per row, and the sessions'."""
    rng = random.Random(seed)
    vocab = engine.runner.vocab_size
    seqs = {n: [rng.randrange(vocab) for _ in range(ln)] for n, ln in (("a", 7), ("b", 20), ("c", 3))}
    handles = {n: engine.open(n) for n in "abc"}
    sampled = SamplingParams(temperature=0.8)
    plan: list[list[tuple[str, list[int], SamplingParams]]] = (
        [[("a", [], GREEDY), ("b", [], GREEDY)]] * 6  # b's 20-token prompt: two chunks, then plain
        + [[("a", [], GREEDY), ("b", [], GREEDY), ("c", [], GREEDY)]] * 5  # c joins
        + [[("a", [], GREEDY), ("b", [5, 7, 9], GREEDY), ("c", [], GREEDY)]]  # a verify row
        + [[("a", [], GREEDY), ("b", [], sampled), ("c", [], GREEDY)]]  # a sampled row
        + [[("c", [], GREEDY), ("a", [], GREEDY), ("b", [], GREEDY)]] * 4  # another order
        + [[("a", [], GREEDY), ("c", [], GREEDY)]] * 6  # b gone (closed): a part of the lookahead
    )
    out = []
    for i, rows in enumerate(plan):
        if i == 17:
            engine.close(handles.pop("b"))
        step = Step([StepRow.verify(handles[n], list(seqs[n]), d, None, sp, 11) for n, d, sp in rows])
        res = engine.step(step)
        got = []
        for (n, _, _), r in zip(rows, res.rows, strict=True):
            assert r.error is None, r.error
            if r.verdict is not None:
                seqs[n].extend(r.verdict.tokens)
                assert r.cached_len == len(seqs[n]) - 1  # the last token is fed next step
            got.append(None if r.verdict is None else list(r.verdict.tokens))
        out.append(got)
    return out, [seqs[n] for n in "abc"]


def test_lookahead_steps_give_the_tokens_of_the_engine_without_them(one_thread):
    torch.manual_seed(0)
    model = RANDOM_MODELS["qwen3"]()
    plain_steps, plain_seqs = _script(_engine(model, lookahead=False))
    engine = _engine(model, lookahead=True)
    ahead_steps, ahead_seqs = _script(engine)
    assert ahead_steps == plain_steps and ahead_seqs == plain_seqs
    # the plain steps after a plain step were taken from its lookahead, also those in another
    # order; c joining, the verify row and b's session ending (two rows of three left: a
    # smaller bucket) each threw one away (its KV position dropped, the tokens unchanged);
    # after the verify (no lookahead launched) the next ran as it came; the sampled step, judged
    # on the device (ADR 0025), launched one, thrown away when b asked greedy again
    assert engine.ahead_counts == {"hit": 16, "missed": 4}, engine.ahead_counts


def test_a_part_of_the_lookahead_is_taken_only_in_the_bucket_the_step_would_run_in(one_thread):
    """A row's bits follow its bucket (ADR 0019): when a session ends, the rest of the
    lookahead stands for the next step only where that step's rows still fill the same bucket
    (4 rows -> 3: the bucket of 4; 3 -> 2: a bucket of 2, run as it comes)."""
    model = RANDOM_MODELS["qwen3"]()
    out = {}
    for lookahead in (False, True):
        engine = _engine(model, lookahead)
        names = ["a", "b", "c", "d"]
        handles = {n: engine.open(n) for n in names}
        seqs = {n: [3 + i, 5, 8] for i, n in enumerate(names)}
        for t in range(12):
            if t in (5, 9):  # d, then c, ends
                engine.close(handles.pop(names.pop()))
            res = engine.step(Step([StepRow.verify(handles[n], list(seqs[n]), [], None, GREEDY, 0) for n in names]))
            for n, r in zip(names, res.rows, strict=True):
                seqs[n].extend(r.verdict.tokens)
        out[lookahead] = seqs
        if lookahead:
            # steps 2-12 followed a plain step; the step after c ended (3 -> 2 rows) was run
            assert engine.ahead_counts == {"hit": 10, "missed": 1}, engine.ahead_counts
    assert out[True] == out[False]


def test_the_lookahead_asks_the_room_its_step_would_ask():
    """At the end of a KV slot a session fails where it fails without the lookahead (the step
    it stands for needs room for the token it feeds and the one it adds)."""
    model = RANDOM_MODELS["qwen3"]()
    ends = {}
    for lookahead in (False, True):
        engine = BatchedTarget(TargetModel(model), Batching(max_sessions=2, max_len=32, tile=None, fuse_upto=0,
                                                            prefill_chunk=16, fixed_step=True, lookahead=lookahead))
        h = engine.open("a")
        seq = list(range(1, 9))
        for _ in range(40):
            r = engine.step(Step([StepRow.verify(h, list(seq), [], None, GREEDY, 0)])).rows[0]
            if r.error is not None:
                ends[lookahead] = (len(seq), type(r.error).__name__)
                break
            seq.extend(r.verdict.tokens)
    assert ends[True] == ends[False] == (32, "ContextTooLong")


def test_a_taken_steps_device_time_is_its_own_not_the_wall_between_calls(one_thread):
    """The busy share must not count the host's idle time: with 50 ms between calls, a taken
    step reports its own time (on the CPU, its forward's; on CUDA, events around its launch)."""
    import time

    engine = _engine(RANDOM_MODELS["qwen3"](), lookahead=True)
    h = engine.open("a")
    seq = list(range(1, 9))
    times = []
    for _ in range(5):
        res = engine.step(Step([StepRow.verify(h, list(seq), [], None, GREEDY, 0)]))
        seq.extend(res.rows[0].verdict.tokens)
        times.append(res.device_ms)
        time.sleep(0.05)
    assert times[0] is None and all(t is not None and 0 < t < 40 for t in times[1:]), times
    # and between two taken steps, the time nothing ran (here the host's 50 ms sleep and its work)
    assert len(engine.gaps_ms) == 3 and all(45 < g < 500 for g in engine.gaps_ms), engine.gaps_ms


def test_a_taken_lookahead_launches_the_next_before_it_reads_its_own(one_thread, monkeypatch):
    """The point of it: while the host reads step N's verdicts and the engine does its
    bookkeeping, step N + 1 is already on the device."""
    model = RANDOM_MODELS["qwen3"]()
    engine = _engine(model, lookahead=True)
    ds = engine.runner.device_step
    calls: list[str] = []
    launch, read = ds.launch, lookahead_module._Ahead.read
    monkeypatch.setattr(ds, "launch", lambda b: (calls.append("launch"), launch(b))[1])
    monkeypatch.setattr(lookahead_module._Ahead, "read", lambda self: (calls.append("read"), read(self))[1])
    h = engine.open("a")
    seq = list(range(1, 9))
    for _ in range(6):
        seq.extend(engine.step(Step([StepRow.verify(h, list(seq), [], None, GREEDY, 0)])).rows[0].verdict.tokens)
    assert engine.ahead_counts["hit"] == 5
    # step 1: its own launch, then the lookahead's; each step after: the next launch, then its read
    assert calls == ["launch", "launch"] + ["launch", "read"] * 5
    # and nothing it fed is left UNKNOWN but the lookahead in flight
    cached = engine.runner.kv.ids[engine.runner.kv.slot(h)]
    assert cached[:-1] == seq[:len(cached) - 1] and len(cached) == len(seq)


def test_lookahead_follows_the_graphs_unless_the_setting_turns_it_off():
    from specserve.config import TargetSettings

    model = RANDOM_MODELS["qwen3"]()
    cpu = BatchedTarget(TargetModel(model), Batching(max_sessions=2, max_len=32, fixed_step=True))
    assert not cpu.lookahead  # (the CPU has no graphs: a lookahead there would only add forwards)
    assert Batching.from_settings(TargetSettings()).lookahead is None  # auto: with the graphs
    assert Batching.from_settings(TargetSettings(async_steps="off")).lookahead is False


def test_the_engine_loop_over_lookahead_steps_generates_the_same_and_counts_the_device_time(one_thread):
    """The engine loop as the target worker runs it, sessions of different lengths (each
    ending leaves a part of the lookahead, which is still taken): the same tokens as without
    the lookahead, and a taken step reports its own device time (ADR 0021's busy share)."""
    from specserve.algorithm.stops import StopChecker
    from specserve.engine.loop import EngineLoop
    from specserve.engine.session import EnginePlan
    from specserve.params import GenerationParams

    model = RANDOM_MODELS["qwen3"]()
    out = {}
    for lookahead in (False, True):
        engine = _engine(model, lookahead)
        reports = []
        loop = EngineLoop(engine, lambda p: StopChecker(frozenset(), p.stop, lambda ids: ""),
                          on_step=reports.append)
        for i in range(3):
            loop.add(f"s{i}", [3 + i, 5, 7, 11 + i], EnginePlan(GenerationParams(max_tokens=6 + 4 * i, seed=1)))
        loop.run_until_idle()
        out[lookahead] = {f"s{i}": loop.ended[f"s{i}"].generated for i in range(3)}
        taken = [r for r in reports if r.device_ms is not None]
        if lookahead:
            assert engine.ahead_counts["hit"] >= 10 and len(taken) == engine.ahead_counts["hit"]
            assert all(r.busy_ms == r.device_ms > 0 for r in taken)
        else:
            assert not taken and all(r.busy_ms == r.forward_ms for r in reports)
    assert out[True] == out[False] and [len(v) for v in out[True].values()] == [6, 10, 14]
