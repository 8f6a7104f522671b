"""`make gpu-check` (bench/gpu_check.py) cannot measure anything here, but it must not rot:
its smoke mode runs every part (identity against transformers, plain and speculative steps
through the batched workers, transformers' plain and assisted generate) with tiny shapes on
the CPU, and without CUDA the real mode says so and exits 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "bench/gpu_check.py", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)


def test_the_smoke_mode_runs_every_part_on_the_cpu(tmp_path):
    proc = _run("--smoke", "--device", "cpu", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads((tmp_path / "gpu_check.json").read_text())
    assert (tmp_path / "gpu_check.png").stat().st_size > 0
    assert res["identity"]["ok"] and res["identity"]["tokens_compared"] >= 2
    assert res["identity"]["largest_logit_difference"] < 1e-3  # fp32 on the CPU: the runner is HF's forward
    assert [r["streams"] for r in res["speed"]] == [1, 4, 16]
    for row in res["speed"]:
        assert row["plain"]["tok_s"] > 0
        for s in row["speculative"]:
            # synthetic drafts: the more of them kept, the more tokens a round emits (never more than K + 1)
            assert 1 <= s["tokens_per_round"] <= res["k"] + 1
    assert res["hf"]["plain_tok_s"] > 0 and res["hf"]["assisted_tok_s"] > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: gpu-check would run for real")
def test_without_cuda_it_says_so_and_exits_2(tmp_path):
    proc = _run("--out", str(tmp_path))
    assert proc.returncode == 2
    assert "needs a CUDA device" in proc.stderr and "--smoke --device cpu" in proc.stderr
    assert not (tmp_path / "gpu_check.json").exists()
