"""`make test`: the whole suite as three pytest processes at once (ADR 0018).

Most of the suite's wall time is spent waiting, not computing: the policy tests' target sleeps
a cost model's time per pass, the Prometheus tests wait for rule windows, the fault matrix
for kills, restarts and drains. Run one after another on 2 cores, one core idles through
those waits. Here each group is its own pytest process (its own session fixtures, its own
stacks on free ports, its own temporary directories), started together:

- `timed`: the policy and Prometheus tests (stacks whose target sleeps, real rule windows);
- `services`: the other integration tests and the fault matrix (real stacks, real models);
- `units`: the unit tests and the Helm chart's (CPU-bound).

Every line a group prints is prefixed with its name, as it comes; at the end each group's
result line and wall time, and the exit status is the first failing group's (0 if all
passed). Extra arguments go to every group's pytest (e.g. `-x`, `-k name`).

    python tests/groups.py [pytest args...]
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TIMED = ["tests/integration/test_policies.py", "tests/integration/test_prometheus.py"]
GROUPS: dict[str, list[str]] = {
    "timed": TIMED,
    "services": ["tests/integration", "tests/faults"] + [f"--ignore={p}" for p in TIMED],
    "units": ["tests/unit", "tests/helm"],
}


def _pump(name: str, proc: subprocess.Popen, last: dict[str, str]) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        sys.stdout.write(f"[{name}] {line}")
        sys.stdout.flush()
        if line.strip():
            last[name] = line.strip()


def main(extra: list[str]) -> int:
    t0 = time.monotonic()
    procs, pumps, last = {}, [], {}
    for name, paths in GROUPS.items():
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--durations=8", *paths, *extra]
        procs[name] = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                       bufsize=1)
        pumps.append(threading.Thread(target=_pump, args=(name, procs[name], last), daemon=True))
        pumps[-1].start()
    try:
        for proc in procs.values():
            proc.wait()
    except KeyboardInterrupt:
        for proc in procs.values():
            proc.terminate()
        raise
    for t in pumps:
        t.join(timeout=10)
    print(f"\n== make test: {len(procs)} groups at once, {time.monotonic() - t0:.0f} s in all ==")
    for name, proc in procs.items():
        print(f"  {name:9s} rc {proc.returncode}  {last.get(name, '')}")
    return next((p.returncode for p in procs.values() if p.returncode), 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
