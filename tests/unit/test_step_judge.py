"""Sampled verdicts inside the device step's run (ADR 0025, models/step_judge.py): rows at
T > 0 judged on the device with their parameters as device data and the uniforms computed
there.

1. The same logits give the host judge's verdicts exactly (rejection sampling with and without
   drafts, the coupled verdict of a seeded row; temperature, top-k, top-p), seed by seed.
2. Chi-squared at the first sampled position: the device judge's first emitted token (a block
   of drafts, rejection sampling and its residual draw; one-hot drafts, and the head's drafts
   with its dense q) follows the target's distribution; a judge that draws the rejected position
   from p instead of the residual (the control) fails.
3. The graph-safety audit on the fake CUDA device: three runs of a sampled bucket (different
   rows, seeds, positions and parameters) and three chained rounds of sampled rows on the
   target's own head run the same ops on the same buffers, copy nothing from or to the host,
   read nothing made for one call.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from fakedevice import OpTrace, audit_runs, fake_cuda, storages
from test_chained_rounds import _fake_head_runner, _head_rows, audited_rounds
from test_device_audit import ARCHITECTURES
from test_device_step import pooled_chi2
from test_runner_exactness import RANDOM_MODELS

import specserve.models.step_judge as step_judge
from specserve.algorithm.rejection import rejection_judge
from specserve.algorithm.sampling import draw
from specserve.models.runner import ModelRunner, Row
from specserve.models.verifier import JudgeRow, judge_on_device, verdicts_of
from specserve.params import SamplingParams

SAMPLINGS = {
    "t0.8-p0.9-k50": SamplingParams(temperature=0.8, top_p=0.9, top_k=50),
    "t1.3": SamplingParams(temperature=1.3),
    "t0.7-k5": SamplingParams(temperature=0.7, top_k=5),
    "t1.0-p0.5": SamplingParams(temperature=1.0, top_p=0.5),
}


def _runner(max_rows: int = 8) -> ModelRunner:
    torch.manual_seed(0)
    runner = ModelRunner.from_hf(RANDOM_MODELS["qwen3"](), max_sessions=max_rows + 2, max_len=96, tile=None,
                                 fuse_upto=0)
    runner.enable_device_step(max_rows=max_rows)
    return runner


def _judged_step(runner: ModelRunner, rows: list[tuple[list[int], list[int], SamplingParams, int]]) -> list:
    """Each row (committed ids, drafts, sampling, seed) in a fresh session, prefilled, then one
    device step of them all: the device's verdicts, and the host judge's on the same logits."""
    for i, (ids, _, _, _) in enumerate(rows):
        runner.free(i)
        runner.allocate(i)
        runner.forward([Row(i, ids[:-1], num_logits=0)])
    fwd = [Row(i, [ids[-1], *drafts], num_logits=len(drafts) + 1, sampling=sp, seed=seed)
           for i, (ids, drafts, sp, seed) in enumerate(rows)]
    logits = runner.forward(fwd)
    ds = runner.device_step
    device = [(int(a), int(f)) for a, f in ds.verdicts[:len(rows)].tolist()]
    judge_rows = [JudgeRow(lg, drafts, None, sp, seed, len(ids)) for lg, (ids, drafts, sp, seed) in zip(logits, rows,
                                                                                                        strict=True)]
    groups, packed = judge_on_device(judge_rows)
    host = [(v.num_accepted, v.tokens[-1]) for v in verdicts_of(judge_rows, groups, packed.tolist())]
    return device, host


@pytest.mark.parametrize("coupled", [False, True], ids=["rejection", "coupled"])
@pytest.mark.parametrize("name", sorted(SAMPLINGS))
def test_the_device_judge_gives_the_host_judges_verdicts_on_the_same_logits(name, coupled, one_thread):
    """Eight rows a step (K 0 to 4, drafts the target's likely tokens or random ones, so some
    are accepted and some rejected), 12 steps of other seeds: every verdict equal."""
    from dataclasses import replace

    runner = _runner()
    sp = replace(SAMPLINGS[name], coupled=coupled)
    rng = np.random.default_rng(1)
    vocab = runner.vocab_size
    rejected = 0
    for step in range(12):
        rows = []
        for i in range(8):
            ids = rng.integers(0, vocab, size=5 + i).tolist()
            k = (i + step) % 5
            drafts = [int(x) for x in rng.integers(0, vocab, size=k)]
            rows.append((ids, drafts, sp, 1000 * step + i))
        device, host = _judged_step(runner, rows)
        assert device == host, (step, device, host)
        rejected += sum(a < len(r[1]) for (a, _), r in zip(device, rows, strict=True))
    assert rejected > 10  # (random drafts: mostly rejected, so the residual draw ran)
    # rows the device step judged as a sampled step (a graph per what they need, on CUDA)
    assert runner.device_step.sampled.any


def _first_tokens(runner: ModelRunner, ids: list[int], drafts: list[int], sp: SamplingParams,
                  n: int) -> np.ndarray:
    """The first emitted token of a row (ids, drafts), judged on the device over n seeds (8
    rows a step, each its own session prefilled once and rolled back after), as counts."""
    counts = np.zeros(runner.vocab_size)
    for i in range(8):
        runner.free(f"x{i}")
        runner.allocate(f"x{i}")
        runner.forward([Row(f"x{i}", ids[:-1], num_logits=0)])
    for start in range(0, n, 8):
        runner.forward([Row(f"x{i}", [ids[-1], *drafts], num_logits=len(drafts) + 1, sampling=sp,
                            seed=50_000 + start + i) for i in range(8)])
        for i, (a, final) in enumerate(runner.device_step.verdicts[:8].tolist()):
            counts[drafts[0] if a > 0 else int(final)] += 1
            runner.rollback(f"x{i}", len(ids) - 1)
    return counts


def _no_residual(p, draft, num, q, u):
    """The control: rejection sampling whose rejected position is drawn from p itself, not
    from the residual max(0, p - q) (a judge that over-weights the draft)."""
    j = rejection_judge(p, draft, num, q, u)
    rows = torch.arange(p.shape[0])
    fresh = draw(p[rows, j.num_accepted], torch.as_tensor(u.recover).gather(1, j.num_accepted.view(-1, 1)).view(-1))
    j.final = torch.where(j.num_accepted < num, fresh, j.final)
    return j


def test_the_device_judges_first_sampled_token_follows_the_targets_distribution(monkeypatch, one_thread):
    """2400 seeds, a block of 3 drafts whose first is the target's second likeliest token
    (p 0.13 at T = 0.1: the residual draw carries the other seven eighths): chi-squared against
    the target's p at that position (softmax(logits / T)), pooled to bins of expected count
    >= 5; the threshold is its 0.999 quantile, the seeds fixed (p < 0.001 fails). The control
    judge (the rejected position drawn from p) must fail the same test on the same seeds."""
    runner = _runner()
    sp = SamplingParams(temperature=0.1)  # (a random model's logits are flat: sharpened)
    ids = [7, 3, 11, 5, 2]
    runner.allocate("probe")
    logits = runner.forward([Row("probe", ids)])[0][-1].double()
    p = torch.softmax(logits / sp.temperature, -1).numpy()
    second = int(np.argsort(-p)[1])
    assert 0.05 < p[second] < 0.5, p[second]
    runner.free("probe")
    drafts = [second, 4, 9]
    stat, limit = pooled_chi2(_first_tokens(runner, ids, drafts, sp, 2400), p)
    assert stat < limit, (stat, limit)
    monkeypatch.setattr(step_judge, "rejection_judge", _no_residual)
    control, control_limit = pooled_chi2(_first_tokens(runner, ids, drafts, sp, 2400), p)
    assert control > control_limit, (control, control_limit)


def _sampled_rows(step: int) -> list[Row]:
    """Three sampled rows of one bucket (4 rows, width 5, span 64), their seeds, parameters and
    modes changing with the step: rejection with drafts, coupled, rejection without drafts."""
    temps = (0.7, 1.0, 1.3)
    return [Row("a", [1 + step, 5, 6, 7, 8], num_logits=5,
                sampling=SamplingParams(temperature=temps[step], top_p=0.9, top_k=20), seed=11 + step),
            Row("b", [2, 3 + step], num_logits=2,
                sampling=SamplingParams(temperature=temps[2 - step], top_k=7, coupled=True), seed=2**62 + step),
            Row("c", [4 + step], num_logits=1, sampling=SamplingParams(temperature=0.9, top_p=0.5), seed=step)]


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_a_sampled_step_is_graph_safe_on_a_fake_cuda_device(arch, monkeypatch):
    with fake_cuda() as (_, host_copies):
        runner, _ = _fake_head_runner(arch, monkeypatch)
        ds = runner.device_step
        _head_rows(runner)  # (its sessions, prefilled)
        traces = []
        for step in range(3):
            rows = _sampled_rows(step)
            starts = [runner.length(r.session) for r in rows]
            b = ds.bucket_for(rows, starts)
            ds.prepare(rows, [runner.kv.slot(r.session) for r in rows], starts, b)
            assert ds.sampled.key() == (True, True, True, True)
            host_copies.copies.clear()
            host_copies.blocking_in.clear()
            with OpTrace() as t:
                ds.run(b)
            traces.append(t)
            assert host_copies.copies == [] and host_copies.blocking_in == []
        allowed = storages(runner.w, runner.kv.keys, runner.kv.values, ds.ints, ds.keys_at, ds.causal, ds.within,
                           ds.logits, ds.verdicts, ds.picks, ds.heads)
        assert audit_runs(traces, allowed) == []
        greedy_rows = [Row(r.session, list(r.tokens), num_logits=r.num_logits) for r in _sampled_rows(0)]
        starts = [runner.length(r.session) for r in greedy_rows]
        ds.prepare(greedy_rows, [runner.kv.slot(r.session) for r in greedy_rows], starts, b)
        with OpTrace() as greedy:
            ds.run(b)
        assert len(traces[0].ops) > len(greedy.ops) + 100  # the sampled verdicts ran inside the run


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_chained_rounds_of_sampled_rows_are_graph_safe_on_a_fake_cuda_device(arch, monkeypatch):
    """Head rows at T > 0 (one seeded: the coupled verdict): the head's draws from its q with
    the positions' noise, the verify, the sampled verdicts, the feed, over three chained rounds."""
    with fake_cuda() as (_, host_copies):
        runner, eagle = _fake_head_runner(arch, monkeypatch)
        ds = runner.device_step
        head = ds.enable_head(eagle)
        sampled = [SamplingParams(temperature=0.8, top_p=0.9), SamplingParams(temperature=1.0, coupled=True), None]
        rows = [Row(r.session, r.tokens, num_logits=r.num_logits, head=r.head, sampling=s, seed=5 + i)
                for i, (r, s) in enumerate(zip(_head_rows(runner), sampled, strict=True))]
        starts = [runner.length(r.session) for r in rows]
        b = ds.bucket_for(rows, starts)
        ds.prepare(rows, [runner.kv.slot(r.session) for r in rows], starts, b)
        assert head.q is not None
        audited_rounds(runner, head, b, 4, host_copies)


def _head_first_tokens(t, slots: list, start: int, last: int, sp: SamplingParams, n: int) -> np.ndarray:
    """The first emitted token of a round of K 3 drafted on the device's head at T > 0 (its
    drafts the head's draws from its q, judged with that dense q), over n seeds, 8 rows a round,
    every round from the same committed state (a round writes only past it)."""
    ds = t.runner.device_step
    counts = np.zeros(t.runner.vocab_size)
    for s0 in range(0, n, 8):
        rows = [Row(h, [last, 0, 0, 0], num_logits=4, head=3, sampling=sp, seed=70_000 + s0 + i)
                for i, h in enumerate(slots)]
        b = ds.bucket_for(rows, [start] * len(rows))
        ds.prepare(rows, [t.runner.kv.slot(h) for h in slots], [start] * len(rows), b)
        ds.head.run_round(b, 3)
        drafts = ds.field("ids", b.tokens).view(b.rows, b.width)[:, 1]
        for i in range(len(rows)):
            a, final = ds.verdicts[i].tolist()
            counts[int(drafts[i]) if a > 0 else int(final)] += 1
    return counts


def test_the_heads_sampled_rounds_first_token_follows_the_targets_distribution(monkeypatch, one_thread):
    """The dense-q path: rounds drafted on the target's own head at T > 0 (a random head on
    a random target, T = 0.1 so both are peaked: the head's first draft is kept 39 % of the
    time, the residual of its q carries the rest), 2400 seeds: the first emitted token against
    the target's p there, chi-squared as above (76 against a limit of 125 on these seeds); the
    control judge (the rejected position drawn from p) fails it (360)."""
    from specserve.drafters.eagle import EagleConfig, EagleHead
    from specserve.models.verifier import TargetModel
    from specserve.step import Step, StepRow
    from specserve.worker.model_step import BatchedTarget, Batching

    torch.manual_seed(0)
    model = RANDOM_MODELS["qwen3"]()
    t = BatchedTarget(TargetModel(model), Batching(max_sessions=10, max_len=64, tile=None, fuse_upto=0, max_batch=8,
                                                   fixed_step=True, lookahead=False))
    t.enable_head(EagleHead(EagleConfig.for_target(model.config)).eval())
    ids = [7, 3, 11, 5, 2, 9]
    slots = [t.open(f"s{i}") for i in range(8)]
    rows = [StepRow.verify(h, ids, [], None, SamplingParams(), 0) for h in slots]
    for r in rows:
        r.head = True  # the prompt fed to the head too: it is current for the round after
    y = t.step(Step(rows)).rows[0].verdict.tokens[0]  # the committed prefix is ids + [y]
    sp = SamplingParams(temperature=0.1)
    t.runner.allocate("probe")
    p = torch.softmax(t.runner.forward([Row("probe", ids + [y])])[0][-1].double() / sp.temperature, -1).numpy()
    stat, limit = pooled_chi2(_head_first_tokens(t, slots, len(ids), y, sp, 2400), p)
    assert stat < limit, (stat, limit)
    monkeypatch.setattr(step_judge, "rejection_judge", _no_residual)
    control, control_limit = pooled_chi2(_head_first_tokens(t, slots, len(ids), y, sp, 2400), p)
    assert control > control_limit, (control, control_limit)
