"""What the benchmark scripts share: their common arguments, the load check before a run
and the clients' threads. The scripts run from the repository root as
`python bench/<name>.py`, so this directory is on their import path."""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable


def parser(doc: str | None) -> argparse.ArgumentParser:
    """A script's parser with the arguments every benchmark takes: --models (the directory
    holding the shipped pair) and --out (where the JSON and PNG go)."""
    ap = argparse.ArgumentParser(description=(doc or "").split("\n")[0])
    ap.add_argument("--models", default="models")
    ap.add_argument("--out", default="bench/results")
    return ap


def warn_if_busy(advice: str = "run on an idle machine for numbers to publish") -> tuple[float, float, float]:
    """The load average before a run (for the report), with a warning on stderr when the
    machine is already busy: timings taken beside other work are noisy."""
    load = os.getloadavg()
    if load[0] > 0.5:
        print(f"[bench] warning: load average {load[0]:.2f} before the run: timings will be noisy; {advice}",
              file=sys.stderr)
    return load


@contextlib.contextmanager
def engine_running(loop, model_thread):
    """An in-process engine loop running on its model thread for the block; stopped, joined and
    its thread shut down however the block ends."""
    stop = threading.Event()
    running = model_thread.submit(loop.run_forever, stop)
    try:
        yield
    finally:
        stop.set()
        loop.wake()
        running.result(10)
        model_thread.shutdown()


def run_threads(client: Callable[[int], None], n: int) -> float:
    """Run `client(i)` for i in 0..n-1 on n threads at once; the wall seconds until all end."""
    threads = [threading.Thread(target=client, args=(i,)) for i in range(n)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


def cell_summary(done: list[dict], streams: int, wall_s: float, texts: dict) -> dict:
    """One load's cell from its requests (each with tokens, ttft_ms, tpot_ms): tok/s over
    the wall time, TTFT and TPOT p50 and p90, and the greedy texts by prompt."""
    def p90(key: str) -> float:
        return float(statistics.quantiles([r[key] for r in done], n=10)[8]) if len(done) > 1 else done[0][key]

    tokens = sum(r["tokens"] for r in done)
    return {"streams": streams, "requests": len(done), "tokens": tokens, "wall_s": wall_s, "tok_s": tokens / wall_s,
            "ttft_ms_p50": statistics.median(r["ttft_ms"] for r in done), "ttft_ms_p90": p90("ttft_ms"),
            "tpot_ms_p50": statistics.median(r["tpot_ms"] for r in done), "tpot_ms_p90": p90("tpot_ms"),
            "texts": texts}
