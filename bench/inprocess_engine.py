"""The engine loop in process: what the stack would serve with no network, no Redis and no
other process beside it.

The target worker's `EngineLoop` on the real target (the runner mode named), plain rounds,
driven by the same closed loop as bench_peer's client: `streams` threads each start
`requests` sessions one after another, cycling through the prompts, greedy, `max_tokens`
each, prefill included. Between the decode-only bound (bench_batching.py: the batched
forward alone) and the stack through its API, it splits what the stack loses into the
engine's own cost (prefill, judging, bookkeeping) and what the services and their processes
cost beside it (ADR 0014, "Status (third wave, session 9)").
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

from common import cell_summary, run_threads


class _Watch:
    """An engine observer: each session's first emitted token and its end."""

    def __init__(self) -> None:
        self.first: dict[str, float] = {}
        self.done: dict[str, threading.Event] = {}

    def round(self, session, stats) -> None:
        if session.n_generated and session.id not in self.first:
            self.first[session.id] = time.perf_counter()

    def finished(self, session) -> None:
        self.done[session.id].set()


class _NoCommits:
    def submit(self, records) -> None:
        pass


def measure(pair: Path, prompts: list[str], loads: list[int], requests: int, max_tokens: int, mode: str,
            threads: int) -> list[dict]:
    """One cell per load, shaped as bench_peer's (tok/s, TTFT and TPOT p50/p90, texts)."""
    import torch

    from specserve.algorithm.stops import StopChecker
    from specserve.engine.loop import EngineLoop
    from specserve.models.loading import load_pair
    from specserve.models.verifier import TargetModel
    from specserve.worker.model_step import Batching, make_target_step
    from specserve.worker.threads import ModelThread

    torch.set_num_threads(threads)
    model_thread = ModelThread("engine")  # the model loads, warms and steps on one thread, as in the target

    def build():
        lp = load_pair(str(pair / "target"), None)
        target = TargetModel(lp.target)
        return lp, target, make_target_step(target, Batching(tile=None if mode == "fast" else Batching.tile))

    lp, target, model = model_thread.submit(build).result()
    watch = _Watch()
    loop = EngineLoop(model, lambda p: StopChecker(target.eos_token_ids, p.stop, lp.tokenizer.decode), {},
                      _NoCommits(), observers=[watch])
    stop = threading.Event()
    engine = model_thread.submit(loop.run_forever, stop)
    ids = [lp.tokenizer.encode(p) for p in prompts]
    try:
        # the text a client gets: the served arms leave an EOS token out of it too
        def text(ids: list[int]) -> str:
            return lp.tokenizer.decode(ids, skip_special_tokens=True)

        _cell(loop, watch, ids, 1, 1, 8, text)  # warm-up
        return [_cell(loop, watch, ids, s, requests, max_tokens, text) for s in loads]
    finally:
        stop.set()
        loop.wake()
        engine.result(10)
        model_thread.shutdown()


def _cell(loop, watch: _Watch, ids: list[list[int]], streams: int, requests: int, max_tokens: int,
          decode) -> dict:
    from specserve.engine.session import EnginePlan
    from specserve.params import GenerationParams

    done: list[dict] = []
    texts: dict[int, str] = {}

    def stream(i: int) -> None:
        for j in range(requests):
            n = (i * requests + j) % len(ids)
            sid = f"c{streams}-{i}-{j}-{time.monotonic_ns()}"
            watch.done[sid] = threading.Event()
            t0 = time.perf_counter()
            session = loop.add(sid, ids[n], EnginePlan(GenerationParams(max_tokens=max_tokens, seed=0))).result()
            watch.done[sid].wait(600)
            end = time.perf_counter()
            first = watch.first.get(sid, end)
            tokens = session.n_generated
            done.append({"ttft_ms": (first - t0) * 1e3, "tpot_ms": (end - first) * 1e3 / max(tokens - 1, 1),
                         "tokens": tokens})
            texts[n] = decode(list(session.generated))

    wall = run_threads(stream, streams)
    return cell_summary(done, streams, wall, texts)
