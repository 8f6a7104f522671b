"""The CUDA graphs of the device step (ADR 0019, `device_step.py`): which prepared buckets run
from a graph's replay and which eagerly, capture on first use or up front within a time
budget, one memory pool shared by every graph, and the counts of what ran how.

The step itself stays a pure tensor function of its buffers; this module only decides how a
call of it is launched. A graph is captured from a function that recomputes the prepared
step (its warm-up run computes the step, the replay computes it again), so the functions
given here must be idempotent.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from specserve.models.step_buckets import Bucket

log = logging.getLogger(__name__)


@dataclass
class StepCounts:
    """What ran how: decode/verify steps replayed from a graph, run eagerly through the same
    fixed shapes (no graphs: the CPU, `cuda_graphs: off`, or past `max_graphs`), or through
    the eager variable-shape forward because they fit no bucket (more rows than the largest)."""

    replayed: int = 0
    eager: int = 0
    unbucketed: int = 0
    captured: int = 0
    capture_s: float = 0.0
    chains: int = 0  # a draft's positions run as one chain (`run_chain`; its positions count above too)
    by_bucket: dict[Bucket, int] = field(default_factory=dict)


class StepGraphs:
    """The graphs of one device step: one per bucket (`graphs`) and one per bucket and chain
    length (`chain_graphs`), at most `max_graphs` in all; with graphs off (`on` False: not
    CUDA, or `cuda_graphs: off`) every launch runs eagerly."""

    def __init__(self, device: torch.device, on: bool, max_graphs: int) -> None:
        self.device = device
        self.on = on
        self.max_graphs = max_graphs
        self.counts = StepCounts()
        self.graphs: dict[Bucket, torch.cuda.CUDAGraph] = {}
        self.chain_graphs: dict[tuple[Bucket, int], torch.cuda.CUDAGraph] = {}
        # a step's variants by (variant, bucket): the rounds with the target's own head (ADR 0025)
        self.variant_graphs: dict[tuple[tuple[object, ...], Bucket], torch.cuda.CUDAGraph] = {}
        self._pool: Any = None  # the graphs' shared memory pool

    def launch(self, b: Bucket, run: Callable[[], object]) -> None:
        """Run the prepared bucket: its graph's replay where graphs are on (captured from `run`
        now if this is the bucket's first step), else `run` eagerly."""
        self.counts.by_bucket[b] = self.counts.by_bucket.get(b, 0) + 1
        graph = self._graph(b, run) if self.on else None
        if graph is None:
            self.counts.eager += 1
            run()
            return
        self.counts.replayed += 1
        graph.replay()

    def launch_chain(self, b: Bucket, steps: int, run_chain: Callable[[], object]) -> None:
        """A draft's chain of `steps` positions (`run_chain`), replayed from its graph (one per
        bucket and length) where graphs are on."""
        self.counts.by_bucket[b] = self.counts.by_bucket.get(b, 0) + steps
        self.counts.chains += 1
        graph = self._chain_graph(b, steps, run_chain) if self.on else None
        if graph is None:
            self.counts.eager += steps
            run_chain()
            return
        self.counts.replayed += steps
        graph.replay()

    def launch_variant(self, variant: tuple[object, ...], b: Bucket, run: Callable[[], object]) -> None:
        """A variant of the prepared bucket's step (a round with the target's own head, ADR
        0025), replayed from its graph (one per variant and bucket) where graphs are on."""
        self.counts.by_bucket[b] = self.counts.by_bucket.get(b, 0) + 1
        graph = self._captured(self.variant_graphs, (variant, b), run) if self.on else None
        if graph is None:
            self.counts.eager += 1
            run()
            return
        self.counts.replayed += 1
        graph.replay()

    def capture(self, buckets: Sequence[Bucket], budget_s: float, prepare: Callable[[Bucket], object],
                run: Callable[[Bucket], object]) -> int:
        """Capture graphs for `buckets` (the shortest spans and narrowest rows first: what
        serving meets most), each from `run` after `prepare` (a step of padding rows), until
        `budget_s` is spent; returns how many were captured. Logged. The rest are captured
        when a step first needs them."""
        if not self.on:
            return 0
        gc.collect()
        torch.cuda.synchronize(self.device)
        t0 = time.perf_counter()
        done = 0
        for b in sorted(set(buckets), key=lambda x: (x.span, x.width, x.rows)):  # the common ones first
            if time.perf_counter() - t0 > budget_s or self._full():
                break
            if b in self.graphs:
                continue
            prepare(b)
            self._graph(b, partial(run, b))
            done += 1
        torch.cuda.synchronize(self.device)
        log.info("captured %d CUDA graphs in %.1f s (budget %.0f s; %d buckets asked)", done,
                 time.perf_counter() - t0, budget_s, len(set(buckets)))
        return done

    def capture_variants(self, keys: Sequence[tuple[tuple[object, ...], Bucket]], budget_s: float,
                         prepare: Callable[[Bucket], object],
                         run: Callable[[tuple[object, ...], Bucket], object]) -> int:
        """`capture` for a step's variants (the rounds with the target's own head, ADR 0025):
        each (variant, bucket) captured from `run` after `prepare`, within `budget_s`. Logged."""
        if not self.on:
            return 0
        torch.cuda.synchronize(self.device)
        t0 = time.perf_counter()
        done = 0
        for variant, b in sorted(set(keys), key=lambda x: (x[1].span, x[1].width, x[1].rows, str(x[0]))):
            if time.perf_counter() - t0 > budget_s or self._full():
                break
            if (variant, b) in self.variant_graphs:
                continue
            prepare(b)
            self._captured(self.variant_graphs, (variant, b), partial(run, variant, b))
            done += 1
        torch.cuda.synchronize(self.device)
        log.info("captured %d CUDA graphs of the head's rounds in %.1f s (budget %.0f s; %d asked)", done,
                 time.perf_counter() - t0, budget_s, len(set(keys)))
        return done

    def _graph(self, b: Bucket, run: Callable[[], object]) -> torch.cuda.CUDAGraph | None:
        return self._captured(self.graphs, b, run)

    def _chain_graph(self, b: Bucket, steps: int, run_chain: Callable[[], object]) -> torch.cuda.CUDAGraph | None:
        return self._captured(self.chain_graphs, (b, steps), run_chain)

    def _captured(self, table: dict[Any, torch.cuda.CUDAGraph], key: Any,
                  run: Callable[[], object]) -> torch.cuda.CUDAGraph | None:
        """The graph of `key` in `table`, captured from `run` on its first use while there is
        room (`_full`); None: run it eagerly. The capture's warm-up run computes the prepared
        step, which the replay then computes again."""
        graph = table.get(key)
        if graph is not None or self._full():
            return graph
        graph = table[key] = self._timed_capture(run)
        return graph

    def _full(self) -> bool:
        """`max_graphs` bounds the graphs of both kinds together (their memory is one pool's)."""
        return len(self.graphs) + len(self.chain_graphs) + len(self.variant_graphs) >= self.max_graphs

    def _timed_capture(self, fn: Callable[[], object]) -> torch.cuda.CUDAGraph:
        t0 = time.perf_counter()
        graph = self._capture(fn)
        self.counts.captured += 1
        self.counts.capture_s += time.perf_counter() - t0
        return graph

    def _capture(self, fn: Callable[[], object]) -> torch.cuda.CUDAGraph:
        """`fn` captured into a CUDA graph in the shared pool, after one warm-up run of it on a
        side stream (lazy initialisation stays out of the graph; `fn` must be idempotent: the
        replay computes the prepared step again)."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream(self.device).wait_stream(side)
        # capture_begin/end, not `torch.cuda.graph`: that context collects Python's garbage and
        # empties the allocator's cache at every capture (tens of ms each); `capture` does it once
        graph = torch.cuda.CUDAGraph()
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
            try:
                fn()
            finally:
                graph.capture_end()
        torch.cuda.current_stream(self.device).wait_stream(side)
        if self._pool is None:
            self._pool = graph.pool()
        return graph
