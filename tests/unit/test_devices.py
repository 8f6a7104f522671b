"""The device and dtype settings (device.py): how they resolve, that the worker
settings carry them into the runner, and that a runner built in bf16 keeps its weights, KV
slots and RoPE tables in bf16 and still returns float32 logits."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from pydantic import ValidationError
from transformers import LlamaConfig, LlamaForCausalLM

from specserve.config import DraftSettings, TargetSettings
from specserve.device import (
    activation_reserve_bytes,
    kv_budget_bytes,
    resolve_device,
    resolve_dtype,
    to_host,
)
from specserve.models.runner import Row
from specserve.worker.model_step import Batching, make_runner


@pytest.mark.parametrize(("setting", "expected"), [("cpu", "cpu"), ("cuda", "cuda"), ("cuda:1", "cuda:1")])
def test_explicit_devices_resolve_to_themselves(setting, expected):
    assert resolve_device(setting) == torch.device(expected)


def test_auto_device_is_cuda_only_when_torch_sees_one():
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").type == expected


@pytest.mark.parametrize("bad", ["gpu", "cuda:", "mps", "CUDA:0", ""])
def test_unknown_devices_are_refused(bad):
    with pytest.raises(ValueError, match="device must be"):
        resolve_device(bad)
    with pytest.raises(ValidationError):
        TargetSettings(device=bad)


@pytest.mark.parametrize(("setting", "device", "expected"), [
    ("auto", "cpu", torch.float32), ("auto", "cuda", torch.bfloat16),
    ("bf16", "cpu", torch.bfloat16), ("fp16", "cuda", torch.float16), ("fp32", "cuda", torch.float32),
])
def test_dtypes_resolve_per_device(setting, device, expected):
    assert resolve_dtype(setting, torch.device(device)) is expected


def test_unknown_dtype_is_refused():
    with pytest.raises(ValueError, match="dtype must be"):
        resolve_dtype("float8", torch.device("cpu"))
    with pytest.raises(ValidationError):
        DraftSettings(dtype="float8")


def test_settings_reach_batching():
    b = Batching.from_settings(DraftSettings(device="cpu", dtype="bf16"))
    assert (b.device, b.dtype) == ("cpu", "bf16")
    assert (Batching().device, Batching().dtype) == ("auto", "auto")


def test_exact_batching_chooses_the_runner_tiling():
    assert Batching.from_settings(TargetSettings()).tile == Batching().tile == 4  # invariant by default
    fast = Batching.from_settings(TargetSettings(exact_batching="fast"))
    assert fast.tile is None
    assert make_runner(_tiny_llama(), fast).tile is None  # the plain batched forward
    with pytest.raises(ValidationError):
        TargetSettings(exact_batching="sometimes")


def _tiny_llama():
    torch.manual_seed(5)
    cfg = LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(cfg).eval()


def test_a_bf16_runner_holds_everything_in_bf16_and_returns_float32_logits():
    model = _tiny_llama()
    runner = make_runner(model, Batching(kv_budget_mb=1, max_sessions=2, device="cpu", dtype="bf16"))
    w = runner.w
    assert {w.embed.dtype, w.cos.dtype, w.sin.dtype, w.layers[0].wqkv.dtype,
            w.layers[1].w_down.dtype} == {torch.bfloat16}
    assert runner.kv.keys[0].dtype is torch.bfloat16 and runner.kv.values[1].dtype is torch.bfloat16
    runner.allocate("a")
    prompt = [3, 14, 15, 9, 26, 5]
    (logits,) = runner.forward([Row("a", prompt, num_logits=2)])
    assert logits.dtype is torch.float32 and logits.shape == (2, 61)
    with torch.no_grad():
        ref = model(torch.tensor([prompt])).logits[0, -2:].float()
    # bf16 keeps 8 mantissa bits: logits of a random model (|x| < 1) agree with fp32 to ~1e-2
    assert torch.allclose(logits, ref, atol=5e-2), (logits - ref).abs().max()


def test_to_host_keeps_rows_and_host_rows_pass_through():
    rows = [torch.arange(6.0).view(2, 3), torch.ones(1, 3)]
    assert to_host(rows) is rows  # already on the host: no copy
    assert to_host([]) == []


def test_to_host_copies_device_rows_to_the_host_with_their_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():  # fake CUDA tensors on a CPU-only build: shapes and devices only
        rows = [torch.empty(2, 5, device="cuda:0"), torch.empty(3, 5, device="cuda:0")]
        out = to_host(rows)
    assert [(o.device.type, tuple(o.shape)) for o in out] == [("cpu", (2, 5)), ("cpu", (3, 5))]


GIB = 2**30


def test_the_cpu_kv_budget_is_kv_budget_mb_and_so_is_cudas_at_utilization_zero():
    def untouched(device):
        raise AssertionError("the CPU budget must not ask CUDA for its memory")

    assert kv_budget_bytes(torch.device("cpu"), 256, 0.9, mem_get_info=untouched) == 256 * 2**20
    assert kv_budget_bytes(torch.device("cuda:0"), 64, 0.0, mem_get_info=untouched) == 64 * 2**20


def test_the_cuda_kv_budget_is_the_utilization_share_left_after_what_is_in_use():
    # 80 GiB device, 18 GiB in use after the weights and the context: 0.9 x 80 - 18 - 2 = 52 GiB
    got = kv_budget_bytes(torch.device("cuda:0"), 256, 0.9, reserve_bytes=2 * GIB,
                          mem_get_info=lambda d: (62 * GIB, 80 * GIB))
    assert got == int(0.9 * 80 * GIB) - 18 * GIB - 2 * GIB


def test_a_cuda_device_too_full_for_any_kv_says_what_to_change():
    with pytest.raises(ValueError, match="gpu_memory_utilization") as err:
        kv_budget_bytes(torch.device("cuda:0"), 256, 0.5, reserve_bytes=GIB,
                        mem_get_info=lambda d: (40 * GIB, 80 * GIB))
    assert "40.0 GiB in use" in str(err.value)


def test_the_activation_reserve_grows_with_the_step_and_the_logit_rows():
    cfg = _tiny_llama().config
    one = activation_reserve_bytes(cfg, 1, 0, torch.bfloat16)
    assert one == 2 * (3 * 48 + 12 * 32)
    assert activation_reserve_bytes(cfg, 10, 0, torch.bfloat16) == 10 * one
    assert activation_reserve_bytes(cfg, 1, 3, torch.bfloat16) == one + 3 * 4 * 61
    assert activation_reserve_bytes(cfg, 1, 0, torch.float32) == 2 * one


def test_a_runner_on_cuda_sizes_its_kv_from_the_memory_its_weights_leave(monkeypatch):
    """make_runner asks for the free memory after the weights are on the device (the fake
    device's memory query below sees them there) and sizes the slots from it."""
    from fakedevice import fake_cuda

    import specserve.models.runner as runner_module

    seen = []
    load_weights = runner_module.load_weights

    def loading(*args, **kwargs):
        seen.append("weights")
        return load_weights(*args, **kwargs)

    def mem_get_info(device):
        seen.append(f"memory of {torch.device(device).type}")
        return 30 * 2**20 + 8 * 2**20, 40 * 2**20  # 40 MiB device, 2 MiB in use

    monkeypatch.setattr(runner_module, "load_weights", loading)
    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    with fake_cuda():
        model = _tiny_llama()
        b = Batching(kv_budget_mb=1, max_sessions=10_000, max_len=64, device="cuda", dtype="bf16",
                     gpu_memory_utilization=0.5, max_batch=4, prefill_chunk=8, fuse_upto=0, cuda_graphs="off")
        runner = make_runner(model, b)
    assert runner.tile == 4  # graphs off: the invariant tiles stay (exact_batching invariant)
    assert seen == ["weights", "memory of cuda"]
    reserve = activation_reserve_bytes(model.config, 4 * 8, 4 * 16, torch.bfloat16)
    budget = int(0.5 * 40 * 2**20) - 2 * 2**20 - reserve
    slot = runner.kv.layout.bytes_per_token * 64
    assert runner.kv.num_slots == budget // slot > 1 * 2**20 // slot  # not kv_budget_mb's 1 MiB


def test_with_cuda_graphs_on_the_prefill_is_one_batched_forward(monkeypatch):
    """With the graphs on, the eager forward (prefill chunks) runs untiled: a row's bits follow
    its bucket there anyway (ADR 0019), and tiles of 4 tokens made the H200's prefill of 16
    prompts of 128 tokens take 3.2 s. The graphs off keep the invariant tiles."""
    from fakedevice import fake_cuda

    import specserve.models.runner as runner_module
    from specserve.worker.model_step import eager_tile

    assert eager_tile(Batching(), graphs=True) is None and eager_tile(Batching(), graphs=False) == 4
    asked = []

    class NoCapture:  # (this build cannot capture a CUDA graph: the step's own tests audit it)
        def startup_buckets(self, *widths):
            return []

        def capture(self, buckets, budget_s):
            asked.append(budget_s)

    monkeypatch.setattr(runner_module.ModelRunner, "enable_device_step", lambda self, **kw: NoCapture())
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (2**30, 2**30))
    with fake_cuda():
        b = Batching(kv_budget_mb=1, max_sessions=4, max_len=64, device="cuda", dtype="bf16", max_batch=4,
                     prefill_chunk=8, cuda_graphs="auto")
        runner = make_runner(_tiny_llama(), b)
        # graphs on but the fixed step forced off: everything is eager, and the tiles keep it invariant
        eager = make_runner(_tiny_llama(), replace(b, fixed_step=False, fuse_upto=0))  # (no start-up check here)
    assert asked == [b.capture_budget_s] and b.tile == 4 and runner.tile is None
    assert eager.tile == 4 and len(asked) == 1


def test_cuda_compile_auto_compiles_the_pieces_only_with_the_graphs_on_and_triton(monkeypatch):
    """cuda_compile auto (the default) reaches the device step as the layer's compiled pieces
    where the graphs are on and torch has Triton for the device (the H200: 2.24 -> 1.87 ms a
    plain step, ADR 0019); never on the CPU, never with cuda_compile off."""
    import torch.utils._triton as triton_module

    from specserve.worker.model_step import step_compile

    auto = Batching.from_settings(TargetSettings())
    assert auto.compile_step == "auto" and Batching.from_settings(TargetSettings(cuda_compile="off")).compile_step \
        is False
    with pytest.raises(ValidationError):
        TargetSettings(cuda_compile="always")
    monkeypatch.setattr(triton_module, "has_triton", lambda: True)
    assert step_compile(auto, graphs=True) == "layer" and step_compile(auto, graphs=False) is False
    assert step_compile(Batching(compile_step="whole"), graphs=False) == "whole"  # (gpu_check's arms)
    monkeypatch.setattr(triton_module, "has_triton", lambda: False)
    assert step_compile(auto, graphs=True) is False


@pytest.mark.parametrize(("device", "num_gpus"), [("cuda", 0), ("cuda:1", 0.5), ("cuda:1", 1)])
def test_a_target_on_cuda_asks_ray_for_the_gpus_it_uses(device, num_gpus):
    with pytest.raises(ValidationError, match="needs num_gpus"):
        TargetSettings(device=device, num_gpus=num_gpus)


@pytest.mark.parametrize(("device", "num_gpus"), [("cuda", 1), ("cuda:1", 2), ("cuda:0", 0.5), ("auto", 0),
                                                  ("cpu", 0)])
def test_devices_within_the_actors_gpus_are_accepted(device, num_gpus):
    assert TargetSettings(device=device, num_gpus=num_gpus).device == device


def test_the_per_session_path_runs_the_hf_model_on_the_workers_device_and_dtype():
    """An architecture the batched runner does not serve (GPT-2 here) takes the per-session
    HF path: the model itself moves to the worker's device and dtype, and still verifies."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from specserve.drafters.hf import HFDrafter
    from specserve.models.verifier import TargetModel
    from specserve.params import SamplingParams
    from specserve.step import Step, StepRow
    from specserve.worker.model_step import (
        SessionDraft,
        SessionTarget,
        make_draft_step,
        make_target_step,
    )

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=61, n_embd=32, n_layer=2, n_head=4, n_positions=64)
    target, draft = GPT2LMHeadModel(cfg).eval(), GPT2LMHeadModel(cfg).eval()
    b = Batching(device="cpu", dtype="bf16")
    engine = make_target_step(TargetModel(target), b)
    assert isinstance(engine, SessionTarget)
    assert {p.dtype for p in target.parameters()} == {torch.bfloat16}
    assert isinstance(make_draft_step(HFDrafter(draft), b), SessionDraft)
    assert {p.dtype for p in draft.parameters()} == {torch.bfloat16}
    handle = engine.open("s")
    (result,) = engine.step(Step([StepRow.verify(handle, [1, 2, 3], [4], None, SamplingParams(), 0)])).rows
    assert result.error is None, result
    assert 1 <= len(result.verdict.tokens) <= 2


def test_greedy_picks_for_many_rows_are_each_rows_own_pick():
    """BatchedDraft picks its unconstrained greedy rows together (one kernel per op), and
    the per-session path through the same function one row at a time. Against a plain
    reference per row: the token is `greedy_tokens`' (the first index on ties, banned tokens
    never), the runner-up a most likely other unbanned token (none when all others are
    banned), the confidences their softmax probabilities; a row's pick is the same alone."""
    from specserve.algorithm.sampling import greedy_tokens
    from specserve.drafters.hf import greedy_picks_on_device
    from specserve.params import SamplingParams

    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 50, generator=g)
    logits[1, [4, 9]] = 10.0  # a tie for first: the first index wins
    logits[2, [7, 30]] = 9.0  # a tie for first, the first of them banned
    logits[3, :] = 0.0  # all equal
    samplings = [SamplingParams(), SamplingParams(), SamplingParams(banned_token_ids=(7,)), SamplingParams(),
                 SamplingParams(banned_token_ids=tuple(range(1, 50))), SamplingParams()]
    toks, heads = greedy_picks_on_device(logits, samplings)
    for i, sp in enumerate(samplings):
        tok = int(greedy_tokens(logits[i], sp))
        others = [t for t in sorted(range(50), key=lambda t: -float(logits[i, t]))
                  if t != tok and t not in sp.banned_token_ids]
        alt = int(heads[i, 1])
        # the runner-up: among the others, one with the largest logit (topk picks among ties)
        assert (alt in others and logits[i, alt] == logits[i, others[0]]) if others else alt == -1, (i, alt)
        probs = torch.softmax(logits[i], -1)
        assert int(toks[i]) == tok == int(heads[i, 0]), i
        assert heads[i, 2:].tolist() == pytest.approx([float(probs[tok]), float(probs[alt]) if others else 0.0]), i
        _, alone = greedy_picks_on_device(logits[i:i + 1], [sp])
        assert torch.equal(alone[0], heads[i]), i
    assert int(toks[1]) == 4 and int(toks[2]) == 30 and int(toks[3]) == 0 and int(heads[4, 1]) == -1
