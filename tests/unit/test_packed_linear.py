"""A float32 CPU runner packs its projection and LM-head weights once for oneDNN (ADR 0008,
"Packed weights"): the logits stay F.linear's (atol as in test_runner_exactness against HF),
rows stay bitwise batch-invariant (test_runner_invariance runs on the packed runner; whether
runs of tiles share one GEMM is its start-up check's to say on each CPU), and the opt-out and
other dtypes keep F.linear (the device audits cover CUDA)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specserve.models.runner import ModelRunner, Row, onednn_linear, pack_weights

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch without oneDNN")


def _runner(model, **kw) -> ModelRunner:
    return ModelRunner.from_hf(model, max_sessions=2, max_len=128, **kw)


def _logits(runner: ModelRunner) -> torch.Tensor:
    runner.allocate("s")
    prefill = runner.forward([Row("s", list(range(3, 40)), num_logits=None)])[0]
    verify = runner.forward([Row("s", [5, 9, 11, 2, 7], num_logits=None)])[0]
    return torch.cat([prefill, verify])


def test_a_float32_cpu_runner_packs_its_weights_and_keeps_the_logits(micro_llama, monkeypatch):
    model = micro_llama(2, 64, 0)
    packed = _runner(model)
    assert packed.linear is onednn_linear
    assert all(m.is_mkldnn for lay in packed.w.layers for m in (lay.wqkv, lay.wo, lay.w_gate_up, lay.w_down))
    assert packed.w.lm_head.is_mkldnn and not packed.w.embed.is_mkldnn  # the lookup stays a plain tensor
    monkeypatch.setenv("SPECSERVE_ONEDNN_LINEAR", "0")
    plain = _runner(model)
    assert plain.linear is F.linear and not plain.w.lm_head.is_mkldnn
    a, b = _logits(packed), _logits(plain)
    assert torch.allclose(a, b, atol=1e-4, rtol=0), (a - b).abs().max()


def test_other_dtypes_keep_f_linear(micro_llama):
    model = micro_llama(2, 64, 0)
    runner = _runner(model, dtype=torch.bfloat16)
    assert runner.linear is F.linear and pack_weights(runner.w) is None
