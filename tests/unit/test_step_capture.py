"""The K choice as data (issue 51 item 6, ADR 0025): start-up captures the graphs of every
width the engine's K choice meets (1 + K for K <= capture_k, trees of 1 + w K tokens) and the
rounds with the target's own drafter for each K, within the logged budget; after that a K, a
tree or speculation off chosen per step replays a graph captured already, never captures.

There are no CUDA graphs on this CPU: the step's graph table runs as on a GPU (`on`), each
"graph" a stand-in whose replay runs the captured function, so what is captured when, and
what replays, are the real decisions of `StepGraphs`.
"""

from __future__ import annotations

import logging
import random

import torch
from test_runner_exactness import RANDOM_MODELS

from specserve.drafters.eagle import EagleConfig, EagleHead
from specserve.models.device_step import startup_widths
from specserve.models.step_graphs import StepGraphs
from specserve.models.verifier import TargetModel
from specserve.params import SamplingParams
from specserve.step import Step, StepRow, head_tree
from specserve.worker.model_step import BatchedTarget, Batching


class _Replays:
    """A captured graph's stand-in: its replay runs the function it was captured from."""

    def __init__(self, fn) -> None:
        self.fn = fn

    def replay(self) -> None:
        self.fn()


def _graphs_on(monkeypatch) -> None:
    init = StepGraphs.__init__
    monkeypatch.setattr(StepGraphs, "__init__", lambda self, device, on, most: init(self, device, True, most))
    monkeypatch.setattr(StepGraphs, "_capture", lambda self, fn: _Replays(fn))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)


def test_start_up_widths_cover_every_k_and_the_trees():
    assert startup_widths(8, 1, 16) == list(range(1, 10))
    assert startup_widths(4, 2, 16) == [1, 2, 3, 4, 5, 7, 9]
    assert startup_widths(8, 2, 16) == sorted(set(range(1, 10)) | {3, 5, 7, 9, 11, 13, 15})


def test_k_and_speculation_change_per_step_without_a_capture(monkeypatch, caplog, one_thread):
    """A target with its own head: start-up captures within the budget (logged), then 60 steps
    of three sessions, two drafting on the head and one with host drafts, whose K (0:
    speculation off, 1..8) changes every step, every fourth step with a head tree of some depth
    (its companions' rows no wider: a tree beside wider rows is a combination of its own,
    captured on first use), chained where they can: every step replays, nothing is captured."""
    _graphs_on(monkeypatch)
    torch.manual_seed(0)
    model = RANDOM_MODELS["qwen3"]()
    caplog.set_level(logging.INFO, logger="specserve.models.step_graphs")
    t = BatchedTarget(TargetModel(model), Batching(max_sessions=4, max_len=128, tile=None, fuse_upto=0, max_batch=4,
                                                   prefill_chunk=16, fixed_step=True, lookahead=True,
                                                   capture_budget_s=600.0, capture_k=8, capture_tree_width=2))
    t.enable_head(EagleHead(EagleConfig.for_target(model.config)).eval())
    ds = t.runner.device_step
    logs = [r.getMessage() for r in caplog.records if "captured" in r.getMessage()]
    assert len(logs) >= 2 and all("budget 600 s" in m for m in logs), logs  # the plain graphs, the rounds'
    # 3 row counts x 1 span x 10 widths (1 + K for K <= 8, trees of 2 x K: 12 and 16) plain
    # (captured again once the head's features changed the step); the head's rounds: 3 x 9
    # widths x (chains, only fed; one at width 1) x (chained or not), the round only fed at
    # width 16 too (a prompt's chunk), and 7 tree shapes x 3 x 2
    assert (len(ds.graphs), len(ds.step_graphs.variant_graphs)) == (30, 3 * (8 * 4 + 2 + 1) + 7 * 3 * 2)
    captured = ds.counts.captured
    rng = random.Random(3)
    vocab = t.runner.vocab_size
    seqs = [[rng.randrange(vocab) for _ in range(6 + 5 * i)] for i in range(3)]
    handles = [t.open(f"s{i}") for i in range(3)]
    replayed = ds.counts.replayed
    before_v = set(ds.step_graphs.variant_graphs)
    for n in range(60):
        rows = []
        depth = rng.choice([1, 2, 3, 4, 5, 6, 7]) if n % 4 == 0 else 0  # a step with a tree of this depth
        for i in range(3):
            k = rng.choice([0, 1, 2, 3, 4, 5, 6, 7, 8])
            if i == 2:  # host drafts of K (another pool's blocks), beside the head's rows
                row = StepRow.verify(handles[i], seqs[i], [rng.randrange(vocab) for _ in range(0 if depth else k)],
                                     None, SamplingParams(), 0)
            else:
                row = StepRow.verify(handles[i], seqs[i], [], None, SamplingParams(), 0)
                row.head, row.k = True, min(k, depth) if depth else k
                if depth and i == n % 2:  # a tree of two first candidates
                    row.k, row.parents = depth, head_tree(2, depth)
            rows.append(row)
        for i, res in enumerate(t.step(Step(rows)).rows):
            assert res.error is None, res.error
            if not res.again:
                seqs[i] = seqs[i] + res.verdict.tokens
    assert ds.counts.captured == captured, [k for k in ds.step_graphs.variant_graphs if k not in before_v]
    assert ds.counts.eager == 0 and ds.counts.unbucketed == 0
    assert ds.counts.replayed - replayed >= 60
    # (the head stayed current for its sessions: it drafted all along)
    assert all(t.heads.through[t.runner.kv.slot(handles[i])] > 40 for i in (0, 1)), t.heads.through
