"""LoRA adapters in the runner (ADR 0029), against PEFT's own merged models.

1. PEFT's files, read without PEFT (`models/lora.py`): three adapters PEFT itself made on the
   demo target (every projection; q and v only with rsLoRA; the MLP of three layers with rank
   and alpha patterns), their logits through the runner equal to the merged model's in
   transformers, and greedy decoding through the runner (eager and device step) gives the
   merged model's `generate` tokens. `merge_adapter` (a draft replica's) gives PEFT's weights.
2. A bad adapter is refused with its reason, and nothing changes: a corrupt file, missing files,
   another base (shapes, layers, fingerprint), DoRA, biases, NaN, a rank over the limit.
3. Mixed-adapter steps: rows of three adapters and of the base in one forward each get the logits
   they get alone, bitwise on the batch-invariant eager path (the segmented products), and the
   same tokens through the device step (the masked products). A session's KV slot keeps its
   adapter; an unloaded adapter's slot is freed only when its last session closes.
4. The device step with adapter rows is graph-safe on the fake CUDA device (the audit of
   test_device_step): the same ops on the same buffers whatever the mix of adapters.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from fakedevice import audit_runs, fake_cuda, storages
from test_device_audit import ARCHITECTURES
from test_device_step import _record_runs, _step_buffers
from torch._subclasses.fake_tensor import unset_fake_temporarily

import specserve.device as device_module
from specserve.errors import AdapterNotFound, ResourceExhausted
from specserve.models.lora import InvalidAdapter, merge_adapter, read_adapter
from specserve.models.lora_set import Prepared, enable_lora
from specserve.models.runner import ModelRunner, Row
from specserve.models.step_buckets import Bucket

peft = pytest.importorskip("peft")

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
CONFIGS = {
    "every": dict(r=4, lora_alpha=8, target_modules=ALL),
    "qv-rslora": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], use_rslora=True),
    "mlp-patterns": dict(r=2, lora_alpha=4, target_modules=["gate_proj", "up_proj", "down_proj"],
                         layers_to_transform=[0, 2, 5], rank_pattern={"down_proj": 4}, alpha_pattern={"up_proj": 3}),
}
PROMPT = list(range(7, 40))


@pytest.fixture(scope="module")
def adapters(demo_pair, tmp_path_factory):
    """name -> (directory, PEFT's merged model), each adapter with random A and B (PEFT's
    `init_lora_weights=False`) so that it moves the target's outputs."""
    torch.manual_seed(0)
    out = {}
    for name, cfg in CONFIGS.items():
        model = peft.get_peft_model(copy.deepcopy(demo_pair.target), peft.LoraConfig(init_lora_weights=False, **cfg))
        d = tmp_path_factory.mktemp(name)
        model.save_pretrained(d)
        out[name] = (d, model.merge_and_unload().eval())
    return out


def _runner(model, adapters, tile: int | None = 4, device_step: bool = False, max_loras: int = 4) -> ModelRunner:
    runner = ModelRunner.from_hf(model, max_sessions=16, max_len=256, tile=tile)
    lora = enable_lora(runner, model.config, max_loras, 8)
    for name, (d, _) in adapters.items():
        lora.install(lora.prepare(read_adapter(d, name)))
    if device_step:
        runner.enable_device_step(max_rows=8)
    return runner


def _greedy(runner: ModelRunner, session: str, prompt: list[int], n: int) -> list[int]:
    logits = runner.forward([Row(session, prompt, num_logits=1)])[0]
    out = []
    for _ in range(n):
        out.append(int(logits[-1].argmax()))
        logits = runner.forward([Row(session, out[-1:], num_logits=1)])[0]
    return out


# ---- 1. PEFT's format, PEFT's outputs ------------------------------------------------------------


@torch.no_grad()
def test_the_runners_logits_with_an_adapter_are_peft_merged_models(demo_pair, adapters, one_thread):
    runner = _runner(demo_pair.target, adapters)
    base = demo_pair.target(torch.tensor([PROMPT])).logits[0]
    for name, (_, merged) in adapters.items():
        runner.allocate(name, name)
        got = runner.forward([Row(name, PROMPT)])[0]
        ref = merged(torch.tensor([PROMPT])).logits[0]
        assert (ref - base).abs().max() > 0.5, f"{name} does not move the outputs: the test would prove nothing"
        assert torch.allclose(got, ref, atol=2e-4, rtol=0), (name, float((got - ref).abs().max()))


@pytest.mark.parametrize("device_step", [False, True], ids=["eager", "device-step"])
@torch.no_grad()
def test_greedy_tokens_with_an_adapter_are_peft_merged_models_generate(demo_pair, adapters, device_step, one_thread):
    runner = _runner(demo_pair.target, adapters, tile=None if device_step else 4, device_step=device_step)
    for name, (_, merged) in adapters.items():
        runner.allocate(name, name)
        ref = merged.generate(torch.tensor([PROMPT]), attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long),
                              max_new_tokens=12, do_sample=False)[0, len(PROMPT):].tolist()
        assert _greedy(runner, name, PROMPT, len(ref)) == ref, name
    if device_step:
        assert runner.device_step is not None and runner.device_step.last is not None
        assert runner.device_step.last.lora  # the decode steps ran there, with the products


def test_merge_adapter_gives_peft_merged_weights(demo_pair, adapters):
    for name, (d, merged) in adapters.items():
        model = copy.deepcopy(demo_pair.target)
        merge_adapter(model, d, name)
        ours, theirs = model.state_dict(), merged.state_dict()
        assert all(torch.allclose(ours[k], theirs[k], atol=1e-6) for k in theirs), name


# ---- 2. refusals ---------------------------------------------------------------------------------


def _copy_of(src, dst):
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_bad_adapters_are_refused_with_their_reason_and_change_nothing(demo_pair, adapters, tmp_path, one_thread):
    runner = _runner(demo_pair.target, {}, max_loras=2)
    lora = runner.lora
    good = adapters["every"][0]
    corrupt = _copy_of(good, tmp_path / "corrupt")
    data = (corrupt / "adapter_model.safetensors").read_bytes()
    (corrupt / "adapter_model.safetensors").write_bytes(data[: len(data) // 2])
    dora = _copy_of(good, tmp_path / "dora")
    cfg = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**cfg, "use_dora": True}))
    bias = _copy_of(good, tmp_path / "bias")
    (bias / "adapter_config.json").write_text(json.dumps({**cfg, "bias": "all"}))
    empty = tmp_path / "empty"
    empty.mkdir()
    # an adapter of the draft model (hidden 128, 1 layer): another base
    draft = peft.get_peft_model(copy.deepcopy(demo_pair.draft), peft.LoraConfig(r=4, target_modules=ALL))
    draft.save_pretrained(tmp_path / "draft")
    nan = _copy_of(good, tmp_path / "nan")
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(nan / "adapter_model.safetensors"))
    first = next(iter(tensors))
    tensors[first] = torch.full_like(tensors[first], float("nan"))
    save_file(tensors, str(nan / "adapter_model.safetensors"))
    cases = {corrupt: "not a readable safetensors file", dora: "DoRA", bias: "bias", empty: "no adapter_config.json",
             tmp_path / "draft": "another base model", nan: "NaN", tmp_path / "nowhere": "is not a directory"}
    for path, reason in cases.items():
        with pytest.raises(InvalidAdapter, match=reason):
            lora.prepare(read_adapter(path, "bad"))
    with pytest.raises(InvalidAdapter, match="max LoRA rank"):  # rank 8 over a limit of 4
        enable_lora(runner, demo_pair.target.config, 2, 4).prepare(read_adapter(adapters["qv-rslora"][0], "big"))
    lora = enable_lora(runner, demo_pair.target.config, 2, 8, fingerprint="0123456789abcdef")
    theirs = copy.deepcopy(demo_pair.target)
    from specserve.tooling.modelbuild.adapter import inject, save_peft

    save_peft(inject(theirs, 2, 4.0, 0), tmp_path / "other-base", 2, 4.0, "elsewhere", "fedcba9876543210")
    with pytest.raises(InvalidAdapter, match="trained for another base model"):
        lora.prepare(read_adapter(tmp_path / "other-base", "other"))
    assert lora.loaded() == [] and not any(t.any() for ts in lora.a.values() for t in ts)
    # and the runner serves on, base and a good adapter alike
    lora.install(lora.prepare(read_adapter(good, "every")))
    runner.allocate("s", "every")
    assert torch.isfinite(runner.forward([Row("s", PROMPT, num_logits=1)])[0]).all()


# ---- 3. mixed-adapter steps ------------------------------------------------------------------------


def _rows(names: list[str]) -> list[tuple[str, str, list[int]]]:
    """(session, adapter, prompt) for each adapter name twice and the base twice."""
    out = []
    for i, name in enumerate(names * 2 + ["", ""]):
        out.append((f"s{i}", name, [(11 * i + 3 * j) % 4000 + 5 for j in range(9 + 3 * i)]))
    return out


@torch.no_grad()
def test_a_step_mixing_three_adapters_and_base_rows_gives_each_row_its_logits_alone(demo_pair, adapters,
                                                                                 one_thread):
    """Eager (batch invariant): bitwise; prefill rows, then one step of decode and verify rows."""
    rows = _rows(sorted(adapters))
    alone = _runner(demo_pair.target, adapters)
    mixed = _runner(demo_pair.target, adapters)
    for sid, name, _ in rows:
        alone.allocate(sid, name)
        mixed.allocate(sid, name)
    firsts = mixed.forward([Row(sid, p) for sid, _, p in rows])
    for (sid, _, p), lg in zip(rows, firsts, strict=True):
        assert torch.equal(alone.forward([Row(sid, p)])[0], lg), sid
    nxt = [Row(sid, [int(lg[-1].argmax())] + ([5, 6, 7] if i % 2 else []), num_logits=None)
           for i, ((sid, _, _), lg) in enumerate(zip(rows, firsts, strict=True))]
    together = mixed.forward(nxt)
    for r, lg in zip(nxt, together, strict=True):
        assert torch.equal(alone.forward([r])[0], lg), r.session


@torch.no_grad()
def test_through_the_device_step_a_mixed_step_gives_each_row_its_tokens_alone(demo_pair, adapters, one_thread):
    names = sorted(adapters)
    rows = _rows(names)
    ref = _runner(demo_pair.target, adapters)  # each row alone, eager
    dev = _runner(demo_pair.target, adapters, tile=None, device_step=True)
    for sid, name, _ in rows:
        ref.allocate(sid, name)
        dev.allocate(sid, name)
    want = {sid: _greedy(ref, sid, p, 6) for sid, _, p in rows}
    got: dict[str, list[int]] = {sid: [] for sid, _, _ in rows}
    logits = dev.forward([Row(sid, p, num_logits=1) for sid, _, p in rows])
    for _ in range(6):
        picks = [int(lg[-1].argmax()) for lg in logits]
        for (sid, _, _), t in zip(rows, picks, strict=True):
            got[sid].append(t)
        logits = dev.forward([Row(sid, [t], num_logits=1) for (sid, _, _), t in zip(rows, picks, strict=True)])
        assert dev.device_step.last == Bucket(8, 1, dev.device_step.last.span, True)
    assert got == want
    assert len({tuple(v) for v in want.values()}) > len(names)  # the adapters answer differently


def test_a_sessions_slot_keeps_its_adapter_and_an_unloaded_one_goes_with_its_last_session(demo_pair, adapters,
                                                                                      one_thread):
    runner = _runner(demo_pair.target, {}, max_loras=2)
    lora = runner.lora
    for name in ("every", "qv-rslora"):
        lora.install(lora.prepare(read_adapter(adapters[name][0], name)))
    with pytest.raises(ResourceExhausted, match="adapter slots"):
        lora.install(lora.prepare(read_adapter(adapters["mlp-patterns"][0], "mlp-patterns")))
    runner.allocate("x", "every")
    with pytest.raises(AdapterNotFound):
        runner.allocate("y", "nope")
    assert runner.kv.free_slots == 15  # the refused session's KV slot went back
    before = runner.forward([Row("x", PROMPT, num_logits=1)])[0]
    assert lora.unload("every") is False  # in use: its name goes, its weights stay for x
    with pytest.raises(AdapterNotFound):
        runner.allocate("z", "every")
    runner.rollback("x", 0)
    assert torch.equal(runner.forward([Row("x", PROMPT, num_logits=1)])[0], before)
    slot = lora.slot_of("x")
    runner.free("x")
    assert slot not in lora.slots and not any(t.any() for t in lora.of_slot("qkv", 0, slot))
    lora.install(lora.prepare(read_adapter(adapters["mlp-patterns"][0], "mlp-patterns")))  # the room is back


# ---- 4. graph safety with adapter rows ------------------------------------------------------------


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_device_step_rows_of_different_adapters_are_graph_safe_on_a_fake_cuda_device(arch, monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (2**30 - 2**20, 2**30))
    monkeypatch.setattr(device_module, "_can_pin", lambda: True)
    with fake_cuda() as (_, host_copies):
        model = ARCHITECTURES[arch]().eval()
        runner = ModelRunner.from_hf(model, max_sessions=8, max_len=64, device="cuda", dtype=torch.bfloat16,
                                     tile=None, fuse_upto=0)
        lora = enable_lora(runner, model.config, 3, 4)
        for name in ("a", "b"):  # weights made on the device (what a load copies in)
            adapter = read_adapter_stub(name)
            lora.install(Prepared(adapter, {k: (torch.randn(a.shape, device="cuda", dtype=torch.bfloat16),
                                                torch.randn(b.shape, device="cuda", dtype=torch.bfloat16))
                                            for k, (a, b) in _shapes(lora).items()}))
        ds = runner.enable_device_step(max_rows=4, graphs=False)
        traces = _record_runs(ds)
        with unset_fake_temporarily():
            pick = torch.tensor([9])
        for s, name, n in (("p", "a", 5), ("q", "b", 11), ("r", "", 17), ("u", "a", 23)):
            runner.allocate(s, name)
            runner.forward([Row(s, [(7 * n + i) % 200 for i in range(n)], num_logits=0)])
        steps = [  # one bucket, three mixes of adapters: (a, b, base), (a, a, base), (b, base, a)
            [Row("p", [1]), Row("q", [2, 3, 4, 5], num_logits=4), Row("r", [6, 7])],
            [Row("u", [8, 9, 10], num_logits=3), Row("p", [11]), Row("r", [12, 13, 14, 15], num_logits=4)],
            [Row("q", pick.to("cuda")), Row("r", [16, 17]), Row("p", [18, 19, 20, 21], num_logits=1)],
        ]
        host_copies.copies.clear()
        host_copies.blocking_in.clear()
        traces.clear()
        buckets = []
        for rows in steps:
            runner.forward(rows)
            buckets.append(ds.last)
        assert buckets == [Bucket(4, 4, 64, True)] * 3 and len(traces) == 3
        allowed = _step_buffers(ds) | storages(lora.a, lora.b, lora.col_slot)
        assert audit_runs(traces, allowed) == []
        assert host_copies.copies == [] and host_copies.blocking_in == []
        assert traces[0].read <= allowed
        base_only = [Row("r", [22])]
        runner.forward(base_only)
        assert ds.last is not None and not ds.last.lora  # a step of base rows runs without the products


def read_adapter_stub(name: str):
    from specserve.models.lora import Adapter

    return Adapter(name=name, path=f"/fake/{name}", rank=4, base="", base_fingerprint="")


def _shapes(lora) -> dict:
    """(projection, layer) -> (A, B) of one slot's shapes."""
    return {(p, layer): lora.of_slot(p, layer, 1) for p in lora.a for layer in range(lora.shapes.layers)}


# ---- 5. sampling: the adapter's distribution ----------------------------------------------------


def _emitted_counts(engine, adapter: str, ids: list[int], draft: int, n: int):
    """The first emitted token of a sampled verify row (T = 1, one draft `draft` with a one-hot
    q: rejection sampling's accept-or-resample) over n fixed seeds, as counts over the vocabulary."""
    import numpy as np

    from specserve.params import SamplingParams
    from specserve.step import Step, StepRow

    counts = np.zeros(engine.runner.vocab_size)
    handles = [engine.open(f"{adapter}-{i}", adapter) for i in range(8)]
    for start in range(0, n, 8):
        rows = [StepRow.verify(h, ids, [draft], None, SamplingParams(temperature=1.0), 20_000 + start + i)
                for i, h in enumerate(handles)]
        for r in engine.step(Step(rows)).rows:
            counts[r.verdict.tokens[0]] += 1
    for h in handles:
        engine.close(h)
    return counts


def _chi2(counts, p) -> tuple[float, float]:
    """Pearson's statistic and chi-squared's 0.999 quantile, over bins of expected count >= 5:
    the tokens in decreasing p, each bin the tokens whose cumulative expected count before them
    falls in one band of 5 (so every bin but the last holds >= 5; the last joins the one before)."""
    import numpy as np
    from scipy.stats import chi2

    order = np.argsort(-p)
    expected, observed = p[order] * counts.sum(), counts[order]
    group = np.floor((np.cumsum(expected) - expected) / 5).astype(int)
    e, o = np.bincount(group, expected), np.bincount(group, observed)
    keep = e > 0
    e, o = e[keep], o[keep]
    if e[-1] < 5:
        e, o = np.append(e[:-2], e[-2:].sum()), np.append(o[:-2], o[-2:].sum())
    return float(((o - e) ** 2 / e).sum()), float(chi2.ppf(0.999, len(e) - 1))


@pytest.mark.parametrize("fixed_step", [False, True], ids=["eager", "device-step"])
def test_sampled_rows_with_an_adapter_follow_its_merged_models_distribution(demo_pair, adapters, fixed_step,
                                                                            one_thread):
    """Chi-squared at T = 1, 2000 draws (8 rows a step, seeds fixed): the emitted token of
    speculative rows of adapter `every` against softmax of PEFT's merged model's logits, the
    draft being the base model's greedy token (which the adapter's distribution often rejects).
    Threshold: the 0.999 quantile (p < 0.001 fails). The control, the same draws against the
    base model's distribution, must fail: the adapter moved it and the test sees that."""
    from specserve.models.verifier import TargetModel
    from specserve.worker.model_step import BatchedTarget, Batching

    engine = BatchedTarget(TargetModel(demo_pair.target), Batching(max_sessions=12, max_len=128, tile=None,
                                                                   fuse_upto=0, fixed_step=fixed_step, max_loras=2,
                                                                   max_lora_rank=8))
    d, merged = adapters["every"]
    engine.adapters.install(engine.adapters.prepare(read_adapter(d, "every")))
    ids = demo_pair.tokenizer.encode("Extract the record as JSON.\nText: name: Ada, age: 36\nJSON:")
    with torch.inference_mode():
        base = demo_pair.target(input_ids=torch.tensor([ids])).logits[0, -1].double()
        mine = merged(input_ids=torch.tensor([ids])).logits[0, -1].double()
    counts = _emitted_counts(engine, "every", ids, int(base.argmax()), 2000)
    stat, limit = _chi2(counts, torch.softmax(mine, -1).numpy())
    assert stat < limit, (stat, limit)
    control, control_limit = _chi2(counts, torch.softmax(base, -1).numpy())
    assert control > control_limit, (control, control_limit)
