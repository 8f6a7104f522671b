"""The device step (ADR 0019): fixed-shape decode, verify and draft rows, prepared on the host
and run on the device as one function a CUDA graph can replay.

1. The graph-safety audit, on the fake CUDA device (`tests/fakedevice.py`): over three steps
   of one bucket with different sessions, lengths, positions and tokens (one fed from the
   device), `run` performs the same ops on the same buffers (same storage, shapes, strides)
   with the same intermediate shapes, reads nothing made for one step, copies nothing from or
   to the host, and reads no value back (on the fake device that raises). The same for the
   K positions of one draft step. The same audit fails on the eager forward (the control: it
   is what the runner ran before).
2. Exactness: the runner's logits through the device step equal HF's own forward on each
   sequence (fp32, the exactness scenario of test_runner_exactness); greedy and seeded
   speculative decoding of the held-out prompts through device-step runners gives exactly
   the tokens of the batch-invariant runners alone (which equal HF's greedy generation:
   test_runner_invariance); a step of mixed row kinds (prefill chunk, plain, greedy K = 3,
   K = 1 with banned tokens, sampled with and without q) gives the eager step's verdicts; the
   sampled rows' first token follows the target's distribution (chi-squared, with a control
   that fails).
3. What runs where: buckets, the rows past the largest bucket (eager, counted), rows longer
   than the widest (eager), the scratch slot, and a block mask (a token tree's) on the row.
"""

from __future__ import annotations

import contextlib
import random

import numpy as np
import pytest
import torch
from fakedevice import OpTrace, audit_runs, fake_cuda, storages
from test_device_audit import ARCHITECTURES, DesignatedCopy
from test_runner_exactness import RANDOM_MODELS, SMALL, run_scenario
from test_runner_invariance import MAX_NEW, SAMPLINGS, spec_generate
from torch._subclasses.fake_tensor import unset_fake_temporarily

import specserve.device as device_module
import specserve.worker.model_step as model_step_module
from specserve.algorithm.rejection import SparseQ
from specserve.drafters.hf import HFDrafter
from specserve.models.device_step import DeviceStep
from specserve.models.runner import ModelRunner, Row
from specserve.models.step_buckets import Bucket
from specserve.models.verifier import TargetModel
from specserve.params import SamplingParams
from specserve.step import Step, StepRow
from specserve.worker.batcher import Work
from specserve.worker.model_step import BatchedDraft, BatchedTarget, Batching

# ---- 1. the graph-safety audit ----------------------------------------------------------------


def _fake_runner(arch: str, monkeypatch) -> ModelRunner:
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (2**30 - 2**20, 2**30))
    monkeypatch.setattr(device_module, "_can_pin", lambda: True)  # to_device's CUDA path: pinned, non-blocking
    model = ARCHITECTURES[arch]().eval()
    return ModelRunner.from_hf(model, max_sessions=8, max_len=64, device="cuda", dtype=torch.bfloat16, tile=None,
                               fuse_upto=0)


def _three_steps(runner: ModelRunner) -> list[list[Row]]:
    """Three steps of one bucket (3 rows -> 4, at most 4 tokens, span 64) over sessions of
    different lengths: the rows, sessions, positions and tokens all differ, and the third
    step feeds one row's token from the device (a draft's pick)."""
    with unset_fake_temporarily():
        pick = torch.tensor([9])
    for s, n in (("a", 5), ("b", 11), ("c", 17), ("d", 23)):
        runner.allocate(s)
        runner.forward([Row(s, [(7 * n + i) % 200 for i in range(n)], num_logits=0)])
    return [
        [Row("a", [1]), Row("b", [2, 3, 4, 5], num_logits=4), Row("c", [6, 7])],
        [Row("d", [8, 9, 10], num_logits=3), Row("a", [11]), Row("c", [12, 13, 14, 15], num_logits=4)],
        [Row("b", pick.to("cuda")), Row("d", [16, 17]), Row("a", [18, 19, 20, 21], num_logits=1)],
    ]


def _record_runs(ds: DeviceStep) -> list[OpTrace]:
    """Every later `run` of the step recorded (OpTrace), in order, into the returned list."""
    traces: list[OpTrace] = []

    def traced(b: Bucket) -> None:
        with OpTrace() as t:
            ds.run(b)
        traces.append(t)

    ds._run = traced
    return traces


def _step_buffers(ds: DeviceStep) -> set[int]:
    r = ds.r
    return storages(r.w, r.kv.keys, r.kv.values, ds.ints, ds.keys_at, ds.causal, ds.within, ds.logits,
                    ds.verdicts, ds.picks, ds.heads)


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_the_device_steps_run_is_graph_safe_on_a_fake_cuda_device(arch, monkeypatch):
    with fake_cuda() as (_, host_copies):
        runner = _fake_runner(arch, monkeypatch)
        ds = runner.enable_device_step(max_rows=4, graphs=False)
        traces = _record_runs(ds)
        steps = _three_steps(runner)  # (their prefill runs too: rows of up to 16 tokens fit the step)
        host_copies.copies.clear()
        host_copies.blocking_in.clear()
        traces.clear()
        before = ds.counts.eager
        buckets = []
        for rows in steps:
            runner.forward(rows)
            buckets.append(ds.last)
        assert buckets == [Bucket(4, 4, 64)] * 3 and ds.counts.eager - before == 3
        assert len(traces) == 3 and len(traces[0].ops) > 50
        assert audit_runs(traces, _step_buffers(ds)) == []
        assert host_copies.copies == [] and host_copies.blocking_in == []
        # what the graph reads: weights, KV and the step's buffers, nothing else
        assert traces[0].read <= _step_buffers(ds)


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_the_audit_fails_on_the_eager_forward(arch, monkeypatch):
    """The control (the runner before ADR 0019): its forward's shapes follow the rows'
    lengths, it copies each step's positions and ids in, and it reads them."""
    with fake_cuda():
        runner = _fake_runner(arch, monkeypatch)
        traces = []
        for rows in _three_steps(runner):
            with OpTrace() as t:
                runner._forward_eager(rows)
            traces.append(t)
        allowed = storages(runner.w, runner.kv.keys, runner.kv.values)
        problems = audit_runs(traces, allowed)
        assert any("differs from call 0" in p for p in problems), problems
        assert any("copies from the host" in p for p in problems), problems
        assert any("made for this call alone" in p for p in problems), problems


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_a_draft_steps_positions_are_one_graph_on_a_fake_cuda_device(arch, monkeypatch):
    """K = 4 for three greedy sessions: after the committed tokens' forward, positions 2..4 run
    as one chain (`run_chain`: each position's picks fed to the next inside it), and the chain
    is graph-safe: over three draft steps it runs the same ops on the same buffers, reads
    nothing made for one step, copies nothing from or to the host."""
    copy = DesignatedCopy(max_width=4)
    monkeypatch.setattr(model_step_module, "to_host", copy)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (2**30 - 2**20, 2**30))
    monkeypatch.setattr(device_module, "_can_pin", lambda: True)
    with fake_cuda() as (_, host_copies):
        model = ARCHITECTURES[arch]().eval()
        engine = BatchedDraft(HFDrafter(model), Batching(kv_budget_mb=1, max_sessions=8, max_len=64, prefill_chunk=8,
                                                         device="cuda", dtype="bf16", fuse_upto=0, cuda_graphs="off",
                                                         fixed_step=True, max_batch=4))
        ds = engine.runner.device_step
        assert ds is not None and ds.with_heads and not ds.graphs_on
        chains: list[OpTrace] = []
        plain_chain = ds.run_chain

        def traced_chain(b: Bucket, steps: int) -> None:
            with OpTrace() as t:
                plain_chain(b, steps)
            chains.append(t)

        ds.run_chain = traced_chain
        jobs = [Work(f"s{i}", StepRow.draft(engine.open(f"s{i}"), [3 * i + j for j in range(5 + i)], 4,
                                            SamplingParams(), i), 4) for i in range(3)]
        for _ in range(3):
            host_copies.copies.clear()
            results = engine.step(Step([w.payload for w in jobs])).rows
            assert all(r.proposal is not None and len(r.proposal.tokens) == 4 for r in results), results
            assert host_copies.copies == [] and len(copy.calls) == 1  # the step's one designated copy
            copy.calls.clear()
            for w in jobs:
                w.payload.ids = w.payload.ids + [1]
        assert len(chains) == 3 and ds.counts.chains == 3
        allowed = _step_buffers(ds) | storages(ds.chain_picks, ds.chain_heads, ds.chain_base)
        assert audit_runs(chains, allowed) == []
        assert len(chains[0].ops) > 3 * 50  # three positions' forwards in the one chain


def test_the_chained_positions_draft_what_the_position_by_position_loop_does(demo_pair, one_thread):
    """Greedy draft steps of mixed K (1 to 4) over twelve rounds: the same tokens and
    runner-ups with the chain as position by position (the eager forward)."""
    from specserve.worker.model_step import BatchedTarget

    runs = []
    for fixed in (False, True):
        b = Batching(max_sessions=8, max_len=256, fixed_step=fixed, tile=None, fuse_upto=0)
        target, draft = BatchedTarget(TargetModel(demo_pair.target), b), BatchedDraft(HFDrafter(demo_pair.draft), b)
        seqs = [[(97 * i + 13 * j) % 4000 + 10 for j in range(20 + 7 * i)] for i in range(3)]
        th, dh = [target.open(f"t{i}") for i in range(3)], [draft.open(f"d{i}") for i in range(3)]
        got = []
        for st in range(12):
            ks = [3 if i != st % 3 else 1 + st % 4 for i in range(3)]
            while (res := draft.step(Step([StepRow.draft(dh[i], seqs[i], ks[i], SamplingParams(), i)
                                           for i in range(3)])).rows) and any(r.again for r in res):
                pass
            got.append([(r.proposal.tokens, r.proposal.runner_up) for r in res])
            rows = [StepRow.verify(th[i], seqs[i], res[i].proposal.tokens, None, SamplingParams(), i) for i in range(3)]
            while (out := target.step(Step(rows)).rows) and any(r.again for r in out):
                pass
            for i, r in enumerate(out):
                seqs[i].extend(r.verdict.tokens)
        runs.append(got)
        if fixed:
            assert draft.runner.device_step.counts.chains >= 10
    assert runs[0] == runs[1]


# ---- 2. exactness -------------------------------------------------------------------------------


def _with_device_step(monkeypatch, max_rows: int = 4) -> None:
    original = ModelRunner.from_hf

    def build(*args, **kwargs):
        runner = original(*args, **kwargs)
        runner.enable_device_step(max_rows=max_rows)
        return runner

    monkeypatch.setattr(ModelRunner, "from_hf", build)


def test_demo_pair_through_the_device_step_matches_hf_per_sequence(demo_pair, monkeypatch, one_thread):
    """The exactness scenario (prefill chunks, decode, verify, rollbacks; rows of up to 16
    tokens run in the device step, the 20-token one eagerly beside them) at fp32, atol 1e-4."""
    _with_device_step(monkeypatch)
    for model in (demo_pair.target, demo_pair.draft):
        run_scenario(model, None, model.config.vocab_size)


@pytest.mark.parametrize("name", sorted(RANDOM_MODELS))
def test_random_configs_through_the_device_step_match_hf_per_sequence(name, monkeypatch, one_thread):
    _with_device_step(monkeypatch)
    run_scenario(RANDOM_MODELS[name](), None, SMALL["vocab_size"], seed=1)


@pytest.fixture(scope="module")
def heldout_runs(demo_pair, eval_prompts):
    """Greedy and seeded speculative decoding of the held-out prompts (K 0-4 by prompt):
    each prompt alone through the batch-invariant runners (the reference), and all at once,
    then staggered in groups of 3, through runners with the device step."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        prompts = [demo_pair.tokenizer.encode(p["prompt"]) for p in eval_prompts]
        ks = [(0, 1, 2, 4, 3)[i % 5] for i in range(len(prompts))]
        eos = frozenset([demo_pair.target.generation_config.eos_token_id or 0])
        n = len(prompts)
        ref_t = ModelRunner.from_hf(demo_pair.target, max_sessions=n + 1, max_len=512)
        ref_d = ModelRunner.from_hf(demo_pair.draft, max_sessions=n + 1, max_len=512)
        dev_t = ModelRunner.from_hf(demo_pair.target, max_sessions=n + 1, max_len=512, tile=None)
        dev_d = ModelRunner.from_hf(demo_pair.draft, max_sessions=n + 1, max_len=512, tile=None)
        dev_t.enable_device_step(max_rows=n)
        dev_d.enable_device_step(max_rows=n)
        out = {}
        for name, sp in SAMPLINGS.items():
            alone = spec_generate(ref_t, ref_d, prompts, ks, sp, [[i] for i in range(n)], 0, eos)
            together = spec_generate(dev_t, dev_d, prompts, ks, sp, [list(range(n))], 0, eos)
            groups = spec_generate(dev_t, dev_d, prompts, ks, sp, [list(range(i, min(i + 3, n)))
                                                                   for i in range(0, n, 3)], 1, eos)
            out[name] = (alone, together, groups)
        return out, (dev_t.device_step.counts, dev_d.device_step.counts)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("sampling", sorted(SAMPLINGS))
def test_heldout_tokens_through_the_device_step_equal_the_invariant_runners_alone(heldout_runs, sampling):
    runs, (target_counts, draft_counts) = heldout_runs
    alone, together, groups = runs[sampling]
    for i in alone:
        assert together[i] == alone[i], f"all at once: prompt {i} diverged"
        assert groups[i] == alone[i], f"groups of 3: prompt {i} diverged"
    assert sum(len(t) for t in alone.values()) >= len(alone) * MAX_NEW // 2
    # the device step ran the decode and verify rows (prefill chunks of 16 fit it too)
    assert target_counts.eager > 100 and draft_counts.eager > 100 and target_counts.unbucketed == 0


def _mixed_jobs(engine: BatchedTarget, vocab: int, seed: int = 0) -> list[Work]:
    greedy, sampled = SamplingParams(), SamplingParams(temperature=0.8, top_p=0.9, top_k=50)
    q = SparseQ(torch.tensor([[5, 6, 0], [7, 8, 0]]), torch.tensor([[0.6, 0.4, 0.0], [0.9, 0.1, 0.0]]))
    prompt = [(3 * i + seed) % vocab for i in range(1, 41)]
    jobs = {
        "prefill": StepRow.verify(None, prompt, [], None, greedy, 1),  # 40 tokens, chunks of 16: again twice
        "plain": StepRow.verify(None, [1, 2, 3 + seed], [], None, greedy, 2),
        "greedy-k3": StepRow.verify(None, [4, 5, 6, 7], [8, 9, 10], None, greedy, 3),
        "greedy-k1-banned": StepRow.verify(None, [4, 5], [6], None, SamplingParams(banned_token_ids=(0, 7)), 4),
        "sampled-sparse-q": StepRow.verify(None, [9, 8, 7], [5, 7], q, sampled, 5 + seed),
        "sampled-one-hot": StepRow.verify(None, [11, 12], [13, 14, 15, 16], None, sampled, 6 + seed),
    }
    out = []
    for name, job in jobs.items():
        job.slot = engine.open(name)
        out.append(Work(name, job, 1))
    return out


def test_a_step_of_mixed_rows_gives_the_eager_steps_verdicts(demo_pair, one_thread):
    """Every kind of row in one step, three steps running (the prompt's chunks beside the
    others' next rows): the device step's verdicts, greedy ones from its own run, equal the
    eager step's."""
    vocab = demo_pair.target.config.vocab_size
    runs = []
    for fixed in (False, True):
        engine = BatchedTarget(TargetModel(demo_pair.target), Batching(max_sessions=8, max_len=128, prefill_chunk=16,
                                                                       tile=None, fuse_upto=0, fixed_step=fixed))
        batch = _mixed_jobs(engine, vocab)
        got = []
        for _ in range(3):
            results = engine.step(Step([w.payload for w in batch])).rows
            got.append(["again" if r.again else (r.verdict.num_accepted, r.verdict.tokens, r.cached_len)
                        for r in results])
            for w, r in zip(batch, results, strict=True):
                if r.verdict is not None:
                    w.payload.ids = w.payload.ids + r.verdict.tokens
        runs.append(got)
        if fixed:
            assert engine.runner.device_step.counts.eager == 3
    assert runs[0] == runs[1]
    assert runs[0][2][0] != "again"  # the prompt's last chunk was judged in the third step


def _first_token_counts(engine: BatchedTarget, ids: list[int], sampling: SamplingParams, n: int) -> np.ndarray:
    """The emitted token of a plain sampled row, over n seeds, as counts over the vocabulary."""
    counts = np.zeros(engine.runner.vocab_size)
    handles = [engine.open(f"x{i}") for i in range(4)]
    for start in range(0, n, 4):
        rows = [StepRow.verify(h, ids, [], None, sampling, 10_000 + start + i) for i, h in enumerate(handles)]
        for r in engine.step(Step(rows)).rows:
            counts[r.verdict.tokens[0]] += 1
    return counts


def pooled_chi2(counts: np.ndarray, p: np.ndarray) -> tuple[float, float]:
    """Chi-squared of draws `counts` against p, the tail pooled into bins of expected count
    >= 5 (likeliest first), and its 0.999 quantile."""
    from scipy.stats import chi2

    exp, obs = [], []
    acc_e = acc_o = 0.0
    for t in np.argsort(-p):
        acc_e += p[t] * counts.sum()
        acc_o += counts[t]
        if acc_e >= 5:
            exp.append(acc_e)
            obs.append(acc_o)
            acc_e = acc_o = 0.0
    exp[-1] += acc_e
    obs[-1] += acc_o
    return float(sum((o - e) ** 2 / e for o, e in zip(obs, exp, strict=True))), float(chi2.ppf(0.999, len(exp) - 1))


def test_sampled_rows_through_the_device_step_follow_the_targets_distribution(demo_pair, one_thread):
    """Chi-squared at the first position, 2000 draws (4 rows a step): the device step's
    sampled rows against the target's own softmax(logits / T) from HF, pooled to bins of
    expected count >= 5. Threshold: the 0.999 quantile of chi-squared (p < 0.001 fails),
    with the seeds fixed. The control, the same draws against the distribution at another
    temperature, must fail."""

    sampling = SamplingParams(temperature=1.3)
    ids = demo_pair.tokenizer.encode("def add(a, b):\n    return")
    engine = BatchedTarget(TargetModel(demo_pair.target), Batching(max_sessions=8, max_len=128, tile=None, fuse_upto=0,
                                                                   fixed_step=True))
    counts = _first_token_counts(engine, ids, sampling, 2000)
    assert engine.runner.device_step.counts.eager > 0
    with torch.inference_mode():
        logits = demo_pair.target(input_ids=torch.tensor([ids])).logits[0, -1].double()

    def statistic(temperature: float) -> tuple[float, float]:
        return pooled_chi2(counts, torch.softmax(logits / temperature, -1).numpy())

    stat, limit = statistic(1.3)
    assert stat < limit, (stat, limit)
    control, control_limit = statistic(0.9)
    assert control > control_limit, (control, control_limit)


# ---- 3. what runs where ------------------------------------------------------------------------


def test_buckets_round_up_and_rows_past_the_largest_run_eagerly(one_thread):
    from test_runner_exactness import _random
    from transformers import Qwen3Config, Qwen3ForCausalLM

    model = _random(Qwen3ForCausalLM, Qwen3Config, head_dim=16, max_position_embeddings=512)
    runner = ModelRunner.from_hf(model, max_sessions=8, max_len=300, tile=None, fuse_upto=0)
    ds = runner.enable_device_step(max_rows=4, max_width=8)
    assert ds.row_buckets == (1, 2, 4) and ds.width_buckets == (1, 2, 3, 4, 5, 6, 7, 8)
    assert ds.span_buckets == (128, 256, 300)
    assert runner.kv.free_slots == 7  # the scratch slot
    for s in "abcde":
        runner.allocate(s)
    runner.forward([Row("a", list(range(20)))])  # 20 tokens > 8: the eager forward
    assert ds.counts.eager == 0 and ds.counts.unbucketed == 0
    runner.forward([Row("a", [1, 2, 3]), Row("b", [4])])
    assert ds.last == Bucket(2, 3, 128)
    runner.forward([Row("a", [i % 90 for i in range(110)], num_logits=0)])
    runner.forward([Row("a", [5] * 6), Row("b", [6]), Row("c", [7])])  # a reaches 139: span 256
    assert ds.last == Bucket(4, 6, 256) and ds.counts.eager == 2
    out = runner.forward([Row(s, [8]) for s in "abcde"])  # 5 rows > 4: eagerly, counted
    assert ds.counts.unbucketed == 1 and ds.counts.eager == 2 and len(out) == 5
    assert runner.fixed_rows == {}


def test_a_block_mask_on_a_row_verifies_a_token_tree(one_thread):
    """A row [a, b1, b2] where b2 is a sibling of b1 (both follow a; b2 at b1's depth, not
    seeing it): b2's logits equal those of a session fed [a, b2]. The block mask and the
    positions by depth are what tree verification will give the step (issue 40)."""
    model = RANDOM_MODELS["llama-llama3-bias"]()
    runner = ModelRunner.from_hf(model, max_sessions=4, max_len=64, tile=None, fuse_upto=0)
    ds = runner.enable_device_step(max_rows=2)
    prompt = [3, 14, 15, 92, 65]
    for s in ("tree", "chain"):
        runner.allocate(s)
        runner.forward([Row(s, prompt, num_logits=0)])
    start = runner.length("tree")
    rows = [Row("tree", [35, 89, 79])]
    b = ds.bucket_for(rows, [start])
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    ds.prepare(rows, [runner.kv.slot("tree")], [start], b, masks=[tree], depths=[[0, 1, 1]])
    ds.launch(b)
    got = ds.logits[:3].clone()
    chain = runner.forward([Row("chain", [35, 79])])[0]
    assert torch.allclose(got[2], chain[1], atol=1e-5), (got[2] - chain[1]).abs().max()
    assert torch.allclose(got[0], chain[0], atol=1e-5)
    # the next step (no mask given) is causal again
    runner.allocate("other")
    runner.forward([Row("other", prompt, num_logits=0)])
    plain = runner.forward([Row("other", [35, 89, 79])])[0]
    fresh = ModelRunner.from_hf(model, max_sessions=2, max_len=64, tile=None, fuse_upto=0)
    fresh.allocate(0)
    assert torch.allclose(plain, fresh.forward([Row(0, prompt + [35, 89, 79])])[0][-3:], atol=1e-5)


def test_bad_rows_change_nothing_through_the_device_step(one_thread):
    from specserve.errors import InvalidRequest

    model = RANDOM_MODELS["qwen2"]()
    runner = ModelRunner.from_hf(model, max_sessions=4, max_len=32, tile=None, fuse_upto=0)
    ds = runner.enable_device_step(max_rows=2)
    runner.allocate("a")
    runner.forward([Row("a", [5, 6, 7])])
    before = ds.ints.clone()
    with pytest.raises(InvalidRequest, match="outside the vocabulary"):
        runner.forward([Row("a", [SMALL["vocab_size"]])])
    assert runner.length("a") == 3 and torch.equal(ds.ints, before)


def test_cuda_graphs_setting_reaches_the_runner():
    from specserve.config import DraftSettings, TargetSettings

    assert Batching.from_settings(TargetSettings()).cuda_graphs == "auto"
    assert Batching.from_settings(DraftSettings(cuda_graphs="off")).cuda_graphs == "off"
    with pytest.raises(ValueError):
        TargetSettings(cuda_graphs="sometimes")
    # on the CPU "auto" keeps the eager forward (graphs are CUDA's); fixed_step forces the shapes
    model = RANDOM_MODELS["qwen3"]()
    assert model_step_module.make_runner(model, Batching(max_sessions=2, max_len=32)).device_step is None
    forced = model_step_module.make_runner(model, Batching(max_sessions=2, max_len=32, fixed_step=True))
    assert forced.device_step is not None and not forced.device_step.graphs_on
    assert forced.kv.num_slots == 3  # two sessions and the scratch slot


@pytest.mark.parametrize("name", ["qwen3", "llama-llama3-bias"])
def test_a_rows_logits_depend_on_its_bucket_not_on_its_companions(name, one_thread):
    """What batch invariance means through the device step (ADR 0019): inside one bucket a
    row's logits are bitwise the same whatever the other rows hold and wherever it sits."""
    model = RANDOM_MODELS[name]()
    runner = ModelRunner.from_hf(model, max_sessions=8, max_len=96, tile=None, fuse_upto=0)
    ds = runner.enable_device_step(max_rows=4)
    rng = random.Random(0)
    outs = []
    for trial in range(3):
        for s in list(runner.kv.slot_of):
            if s != "\0device-step-scratch":
                runner.free(s)
        runner.allocate("probe")
        runner.forward([Row("probe", [5, 9, 2, 7, 1, 8], num_logits=0)])
        others = []
        for j in range(3):
            runner.allocate(j)
            runner.forward([Row(j, [rng.randrange(97) for _ in range(rng.randrange(1, 40))], num_logits=0)])
            others.append(Row(j, [rng.randrange(97) for _ in range(rng.randrange(1, 5))]))
        rows = others[:trial] + [Row("probe", [3, 4, 6, 2])] + others[trial:]
        logits = runner.forward(rows)[trial]
        assert ds.last == Bucket(4, 4, 96)
        outs.append(logits.clone())
    assert all(torch.equal(outs[0], o) for o in outs[1:])


def test_the_workers_count_how_their_device_steps_ran():
    """specserve_{service}_device_steps_total{how} follows the step's counters by their
    increase since the last look; specserve_{service}_cuda_graphs is the graphs captured."""
    from specserve.serving.metrics import WorkerMetrics

    m = WorkerMetrics("target")
    model = RANDOM_MODELS["qwen2"]()
    runner = ModelRunner.from_hf(model, max_sessions=8, max_len=64, tile=None, fuse_upto=0)
    ds = runner.enable_device_step(max_rows=2)
    for s in "abc":
        runner.allocate(s)
    runner.forward([Row("a", [1, 2]), Row("b", [3])])
    m.device_step(ds)
    runner.forward([Row("a", [4]), Row("b", [5]), Row("c", [6])])  # 3 rows > 2: unbucketed
    runner.forward([Row("c", [7])])
    m.device_step(ds)
    m.device_step(None)  # a model step without one (the per-session path)

    def value(how: str) -> float:
        return m.registry.get_sample_value("specserve_target_device_steps_total", {"how": how}) or 0.0

    assert (value("eager"), value("unbucketed"), value("replayed")) == (2.0, 1.0, 0.0)
    assert m.registry.get_sample_value("specserve_target_cuda_graphs") == 0.0


def _three_forwards(model, compile: bool | str, fuse: bool = False) -> list[torch.Tensor]:
    """The logits of three steps of two sessions (each step reads the KV the one before wrote)
    through a device step compiled so (and fused so)."""
    runner = ModelRunner.from_hf(model, max_sessions=4, max_len=64, tile=None, fuse_upto=0)
    runner.enable_device_step(max_rows=4, compile=compile, fuse=fuse)
    for s in "ab":
        runner.allocate(s)
    got = [runner.forward([Row("a", [5, 6, 7]), Row("b", [8, 9])]),
           runner.forward([Row("a", [10, 11, 12, 13]), Row("b", [14])]),
           runner.forward([Row("b", [15, 16]), Row("a", [17])])]
    return [lg.clone() for step in got for lg in step]


def test_the_compiled_pieces_compute_what_the_plain_ones_do(one_thread, monkeypatch):
    """compile_step "pieces" and "layer" (ADR 0019: off on the CPU, measured on a GPU): a
    layer's two pieces around attention, or the whole layer with its KV scatter and attention,
    through torch.compile (C++ on this CPU, Triton on CUDA) give the plain pieces' logits
    within float32 rounding, for every layer and bucket from one program, and write the same
    KV (the next steps read it)."""
    monkeypatch.setenv("SPECSERVE_ONEDNN_LINEAR", "0")  # (oneDNN's packed GEMM does not compile)
    model = RANDOM_MODELS["qwen3"]()
    runs = [_three_forwards(model, compile) for compile in (False, "pieces", "layer")]
    for plain, pieces, layer in zip(*runs, strict=True):
        for compiled in (pieces, layer):
            assert torch.allclose(plain, compiled, atol=1e-5), (plain - compiled).abs().max()


def test_the_audit_names_the_ops_that_synchronise_on_cuda():
    """What a capture refuses but the fake device runs without complaint: a tensor-valued
    masked_fill (its kernel reads the value back: the H200's capture failed on it), a
    boolean-mask index or assignment (a nonzero inside), a nonzero; plain indexing is fine."""
    with fake_cuda():
        x = torch.zeros(4, 8, device="cuda")
        m = x > 0
        idx = torch.arange(2, device="cuda")
        cases = {
            "masked_fill with a 0-dim tensor": lambda: x.masked_fill(m, torch.full((), 1.0, device="cuda")),
            "boolean index": lambda: x[m],
            "boolean assignment": lambda: x.__setitem__(m, 0.0),
            "nonzero": lambda: torch.ops.aten.nonzero.default(m),  # (the method takes a CUDA guard here)
        }
        for name, fn in cases.items():
            # (the fake device cannot size a data-dependent output: the op is still seen)
            with OpTrace() as t, contextlib.suppress(Exception):
                fn()
            assert audit_runs([t], set(storages(x, m, idx))) != [], name
        with OpTrace() as t:
            x.masked_fill(m, float("-inf"))
            x.index_select(0, idx)
            x[idx]
        assert audit_runs([t], set(storages(x, m, idx))) == []


def test_the_fused_layers_compute_what_the_layers_do(one_thread, monkeypatch):
    """issue 51 item 7 (models/step_fusion.py): each layer's program ending with the next
    layer's norm gives, uncompiled, bitwise the logits of the layers as they are (the same ops
    in the same order) and the same KV (the next steps read it); compiled whole ("layer"),
    within float32 rounding of them."""
    monkeypatch.setenv("SPECSERVE_ONEDNN_LINEAR", "0")  # (oneDNN's packed GEMM does not compile)
    model = RANDOM_MODELS["qwen3"]()
    runs = [_three_forwards(model, compile, fuse) for compile, fuse in ((False, False), (False, True), ("layer", True))]
    for plain, fused, compiled in zip(*runs, strict=True):
        assert torch.equal(plain, fused)
        assert torch.allclose(plain, compiled, atol=1e-5), (plain - compiled).abs().max()


def test_the_fused_layers_keep_the_targets_greedy_tokens_and_are_graph_safe(demo_pair, monkeypatch, one_thread):
    """The demo target's greedy tokens through the fused step equal the step's as it is (and
    HF's); on the fake CUDA device the fused run is graph-safe over three steps of a bucket."""
    ids = demo_pair.tokenizer.encode("def parse(self, text):\n")
    out = {}
    for fuse in (False, True):
        t = BatchedTarget(TargetModel(demo_pair.target), Batching(max_sessions=4, max_len=128, tile=None, fuse_upto=0,
                                                                  fixed_step=True, fuse_step=fuse))
        assert (t.runner.device_step._fused is not None) == fuse
        h, seq = t.open("s"), list(ids)
        for _ in range(16):
            seq += t.step(Step([StepRow.verify(h, seq, [], None, SamplingParams(), 0)])).rows[0].verdict.tokens
        out[fuse] = seq[len(ids):]
    with torch.inference_mode():
        want = demo_pair.target.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)[0, len(ids):]
    assert out[True] == out[False] == want.tolist()
    with fake_cuda():
        runner = _fake_runner("qwen3", monkeypatch)
        ds = runner.enable_device_step(max_rows=4, graphs=False, fuse=True)
        traces = _record_runs(ds)
        steps = _three_steps(runner)
        traces.clear()
        for rows in steps:
            runner.forward(rows)
        assert audit_runs(traces, _step_buffers(ds)) == []
