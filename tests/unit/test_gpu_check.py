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
    """Every arm of issue 51's check: plain, the draft model host-driven and inside the
    target's round, the EAGLE head in the round with its trees, greedy identity of head rounds
    on the demo pair, the fused layers' plain decoding beside the layers as they are."""
    proc = _run("--smoke", "--device", "cpu", "--out", str(tmp_path), "--graphs", "auto,auto+fused",
                "--streams", "1,16")
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads((tmp_path / "gpu_check.json").read_text())
    assert (tmp_path / "gpu_check.png").stat().st_size > 0
    assert res["identity"]["ok"] and res["identity"]["tokens_compared"] >= 2
    assert res["identity"]["largest_logit_difference"] < 1e-3  # fp32 on the CPU: the runner is HF's forward
    assert [r["streams"] for r in res["speed"]] == [1, 16]
    for row in res["speed"]:
        assert row["plain"]["tok_s"] > 0
        for s in row["speculative"]:
            # synthetic drafts: the more of them kept, the more tokens a round emits (never more than K + 1)
            assert 1 <= s["tokens_per_round"] <= res["k"] + 1
    assert res["hf"]["plain_tok_s"] > 0 and res["hf"]["assisted_tok_s"] > 0
    head = res["modes"]["auto"]["head"]  # rounds drafted on the target's own head (ADR 0025)
    assert [r["streams"] for r in head["speed"]] == [1, 16]
    for row in head["speed"]:
        for r in row["rounds"]:
            # the synthetic drafts' rounds give the target's own tokens (its plain continuation)
            assert 1 <= r["tokens_per_round"] <= res["k"] + 1 and r["tok_s"] > 0 and r["exact"]
    assert head["counts"]["eager"] > 0  # (no graphs on the CPU: the rounds ran eagerly, the same function)
    tree = head["speed"][0]["rounds"][-1]["tree"]  # trees of two first candidates beside the chains, 1 stream
    assert tree["exact"] and 1 <= tree["tokens_per_round"] <= 2 * res["k"] + 1 and 1 < tree["bound"] < 1.2
    draft = res["modes"]["auto"]["draft_in_round"]  # the draft model inside the round (issue 51 item 3)
    assert [r["streams"] for r in draft["speed"]] == [1] and all(r["exact"] for r in draft["speed"][0]["rounds"])
    assert res["identity"]["rounds"]["ok"] and res["identity"]["rounds"]["trees"]["tokens_compared"] >= 2
    # the local:draft pool as a target builds it (device step forced), a round launched ahead
    pool = res["identity"]["local_draft"]
    assert pool["ok"] and pool["source"] == "DeviceDraftModelDrafts" and pool["tokens_compared"] >= 2
    assert pool["target_kv_bytes"] + pool["draft_kv_bytes"] <= 64 * 2**20 and sum(pool["rounds"].values()) >= 1
    fused = res["modes"]["auto+fused"]  # plain decoding only, side by side with the first arm
    assert [r["streams"] for r in fused["speed"]] == [1, 16] and "head" not in fused
    names = " ".join(res["targets"])
    for figure in ("plain TPOT at 1 stream", "EAGLE head in the round / plain at 16", "tree (2 first candidates",
                   "draft model in the round", "speculative rounds replayed", "greedy identity, eagle-local",
                   "the local:draft pool in the round",
                   "EAGLE head's cost a position", "auto+fused / auto plain tok/s at 1"):
        assert figure in names, (figure, names)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: gpu-check would run for real")
def test_without_cuda_it_says_so_and_exits_2(tmp_path):
    proc = _run("--out", str(tmp_path))
    assert proc.returncode == 2
    assert "needs a CUDA device" in proc.stderr and "--smoke --device cpu" in proc.stderr
    assert not (tmp_path / "gpu_check.json").exists()


def test_the_engine_loops_real_device_mode_runs_unpadded_on_the_cpu(tmp_path):
    """bench_engine_loop's `--profiles real` (what a GPU node runs with `--device cuda --model
    1b`): the target's steps are not padded to a profile, and device busy is their measured
    forward time over the wall. Here on the CPU with the tiny stand-in: the speculative arm's
    output is still the target's alone (the script asserts it), and its forward times are
    reported, where a simulated profile has none."""
    proc = subprocess.run([sys.executable, "bench/bench_engine_loop.py", "--profiles", "real,h100", "--streams", "1",
                           "--arms", "plain,K=2", "--tokens", "8", "--real-draft-ms", "0.5", "--out", str(tmp_path)],
                          cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads((tmp_path / "engine_loop.json").read_text())
    assert res["device"] == "cpu" and res["model"] == "tiny"
    real = [r for r in res["rows"] if r["profile"] == "real"]
    simulated = [r for r in res["rows"] if r["profile"] == "h100"]
    assert [r["arm"] for r in real] == ["plain", "K=2"]
    assert isinstance(res["targets"], list)  # issue 51's engine-loop figures, where their arms ran
    assert all(r["forward_ms_p50"] > 0 and 0 < r["device_busy"] <= 1.0 for r in real)
    assert all(r["forward_ms_p50"] is None for r in simulated)
    # the stand-in's real forward is far below the profile's 6.4 ms floor a pass: unpadded
    # (its fastest step; a median on a loaded machine has passed 6.4 ms, 7.2 once in CI)
    assert real[0]["forward_ms_min"] < 6.4
    # --real-draft-ms: the real arm's pool drafts at 0.5 ms a step and nothing more a token, the
    # h100 profile's as that profile says (the settings, not their measured wall time: a sleep of
    # 0.5 ms measured 6.2 ms a token once under make test's load)
    assert (real[1]["draft_step_ms"], real[1]["draft_token_ms"]) == (0.5, 0.0)
    assert (simulated[1]["draft_step_ms"], simulated[1]["draft_token_ms"]) != (0.5, 0.0)
    assert real[1]["draft_latency_ms_per_token"] > 0 and simulated[1]["draft_latency_ms_per_token"] > 0
