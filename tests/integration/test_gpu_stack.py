"""`bench/gpu_stack.py` (issue 52 item 5, ADR 0028) cannot measure a GPU here, but it must not
rot: its smoke mode runs the whole path on the CPU, the target in a plain process without Ray
(`services/target/plain.py`, what the GPU node runs), Redis and a router, both APIs and both arms
(plain and eagle-local), then the engine loop alone on the same device, and writes what the GPU
run will. And without CUDA its real mode says so and exits 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(300)


def _run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "bench/gpu_stack.py", "--out", str(tmp_path), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=280)


def test_the_smoke_run_serves_both_arms_through_a_stack_without_ray(tmp_path):
    done = _run(tmp_path, "--smoke", "--device", "cpu")
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads((tmp_path / "gpu_stack.json").read_text())
    assert (tmp_path / "gpu_stack.png").stat().st_size > 0
    assert result["meta"]["target_launcher"] == "plain (no Ray)"
    cells = result["cells"]
    assert sorted((c["api"], c["arm"]) for c in cells) == [("grpc", "eagle-local"), ("grpc", "plain"),
                                                           ("http", "eagle-local"), ("http", "plain")]
    for c in cells:
        where = f"{c['api']} {c['arm']}"
        assert c["errors"] == 0 and c["tokens"] > 0 and c["tok_s"] > 0, where
        assert c["ray_ms"] == 0, where  # no Ray process beside the target
        assert c["engine_steps"] > 0 and c["engine_tpot_ms"] > 0, where
        for key in ("router_ms", "redis_ms", "target_ms"):
            assert 0 < c[key] < 100, (where, key, c[key])
    alone = result["engine_alone"]
    assert set(alone) == {"plain/2", "eagle-local/2"}
    for key, cell in alone.items():
        assert cell["tok_s"] > 0 and cell["tpot_ms_p50"] > 0, key
    for row in result["summary"]:
        assert row["share_of_engine"] is not None and row["share_of_engine"] > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: the real mode would run")
def test_without_cuda_it_says_so_and_exits_2(tmp_path):
    done = _run(tmp_path)
    assert done.returncode == 2
    assert "needs a CUDA device" in done.stderr and "--smoke --device cpu" in done.stderr
    assert not (tmp_path / "gpu_stack.json").exists()
