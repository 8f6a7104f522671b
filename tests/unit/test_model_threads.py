"""The torch thread count a worker sets reaches the thread that runs its model.

`torch.set_num_threads` sets OpenMP's count for the calling thread; a thread started later
begins at `OMP_NUM_THREADS` (1 in a Ray actor with `num_cpus: 1`, the machine's cores in a
plain process) and its matrix products keep that until an op large enough to re-read torch's
setting runs there. A GEMM team of n threads shows as n - 1 OpenMP worker threads in
/proc/self/task, so the probe counts them (in a fresh interpreter: the environment must be
set before torch loads)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

PROBE = """
import os, sys, torch
from specserve.serving.metrics import WorkerMetrics
from specserve.worker.core import WorkerCore

torch.set_num_threads(int(sys.argv[1]))
a = torch.randn(256, 256)

class Engine:  # what WorkerCore needs of an engine, and a step that runs a GEMM
    max_batch = 1
    slots = None
    def open(self, sid): return sid
    def close(self, handle): pass

def gemm():
    for _ in range(20):
        a @ a
    return len(os.listdir("/proc/self/task"))

before = len(os.listdir("/proc/self/task"))
core = WorkerCore(Engine(), WorkerMetrics("probe"), max_sessions=1)  # its model thread: a threads.ModelThread
print(core.executor.submit(gemm).result() - before - 1)  # the OpenMP workers the model thread started
"""


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads in /proc")
@pytest.mark.parametrize(("omp_env", "threads"), [("1", 2), ("2", 1)])
def test_the_model_thread_runs_with_the_workers_torch_threads(omp_env, threads):
    if threads > (os.cpu_count() or 1) or int(omp_env) > (os.cpu_count() or 1):
        pytest.skip("needs 2 cores")
    env = {**os.environ, "OMP_NUM_THREADS": omp_env, "PYTHONPATH": str(ROOT / "src")}
    out = subprocess.run([sys.executable, "-c", PROBE, str(threads)], env=env, capture_output=True, text=True,
                         timeout=120, check=True)
    # ("1", 2): a Ray actor with torch_threads 2 ran its GEMMs on one thread;
    # ("2", 1): a draft replica with torch_threads 1 on a 2-core machine ran them on two
    assert int(out.stdout.split()[-1]) == threads - 1, out.stderr[-2000:]


def test_the_model_thread_runs_calls_in_order_hands_back_errors_and_does_not_hold_the_exit():
    from specserve.worker.threads import ModelThread

    thread = ModelThread("model")
    seen: list[int] = []
    futures = [thread.submit(seen.append, i) for i in range(5)]
    assert [f.result(10) for f in futures] == [None] * 5 and seen == [0, 1, 2, 3, 4]
    with pytest.raises(ZeroDivisionError):
        thread.submit(lambda: 1 / 0).result(10)
    # a call that never returns (the engine loop until its stop) leaves the interpreter free to exit
    code = ("from specserve.worker.threads import ModelThread\nimport threading\n"
            "ModelThread('engine').submit(threading.Event().wait)\nprint('exiting')")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "exiting", out.stderr[-2000:]
