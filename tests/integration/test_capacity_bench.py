"""`bench/bench_capacity.py --smoke` in the suite (ADR 0028): the capacity benchmark starts its
stack (Redis, the Ray target on its tiny stand-in padded to an H200's step, a router), streams
over gRPC and HTTP, and reports every process's CPU a token. Speeds are the benchmark's, not the
suite's: this checks that the figures are there and could be true."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
H200_ONE_ROW_MS = 1.61  # the simulated step at one row (bench/profiles.py: H200_STEP)

pytestmark = pytest.mark.timeout(300)


def test_the_capacity_benchmarks_smoke_run_reports_every_process(tmp_path):
    done = subprocess.run([sys.executable, "bench/bench_capacity.py", "--smoke", "--out", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads((tmp_path / "capacity" / "capacity.json").read_text())
    assert (tmp_path / "capacity" / "capacity.png").stat().st_size > 0
    cells = result["cells"]
    assert [(c["api"], c["streams"]) for c in cells] == [("grpc", 1), ("grpc", 4), ("http", 4)]
    for c in cells:
        where = f"{c['api']} {c['streams']}"
        assert c["errors"] == 0 and c["tokens"] > 0 and c["tok_s"] > 0, where
        if c["api"] == "grpc":  # EOS banned: every request runs to its max_tokens
            assert c["tokens_per_request"] == 16, where
        # the engine's steps are padded to the device's time, and tokens cannot come faster than
        # they do (a reader that fell behind sends several in one chunk: half a step is the floor
        # that leaves; an HTTP event's tokens are counted from the usage, spread over the events)
        assert c["engine_step_ms"] >= 0.9 * H200_ONE_ROW_MS, where
        assert c["engine_tpot_ms"] > c["engine_step_ms"], where  # and the engine's own bookkeeping on top
        assert c["tpot_ms_p50"] >= (0.5 * H200_ONE_ROW_MS if c["api"] == "grpc" else 0.0), where
        assert c["engine_steps"] > 0 and 1 <= c["engine_rows_per_step"] <= c["streams"], where
        for key in ("router_ms", "redis_ms", "target_ms", "target_forward_ms", "target_engine_ms", "client_ms"):
            assert 0 < c[key] < 50, (where, key, c[key])  # CPU ms a token: positive, and not absurd
        assert abs(c["target_forward_ms"] + c["target_host_ms"] - c["target_ms"]) < 1e-6, where
        assert c["redis_calls_per_token"] > 1 and "evalsha" in c["redis_commands"], where
    assert result["engine_alone"]["1"]["tpot_ms_p50"] >= 0.9 * H200_ONE_ROW_MS
    commit = result["parts"]["commit"]  # the commit path alone: a step's rounds in a script call
    assert 0 < commit["redis_us_a_round"] < 10_000 and 0 < commit["client_us_a_round"] < 10_000
    assert 1 < commit["redis_calls_a_round"] < 12  # the script's own calls a round, and its share of one EVALSHA
    assert result["targets"]["grpc_tpot_added_1"]["ms"] is not None
