"""Workloads beyond the pair's held-out prompts, for the demo and the benchmarks.

`agent` (ADR 0026), a repeat-heavy class: an agent working through a small set of orders
looks each one up again and again, each time from another rendering of it (the tool's
record view, a prose note, a key=value log line), and extracts it as JSON. So its outputs
recur across requests while its prompts do not: the suffix pool's class index learns the
outputs from the `warm` requests, and the `held_out` ones are renderings it has never seen
verbatim (another style of the same records). The records are generated as the pair's
extraction corpus generates its own (`modelbuild/corpus.py`), with a seed of their own: none
is in the pair's training data or its held-out prompts.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from specserve.tooling.modelbuild.corpus import _record, render_record

AGENT = "agent"
AGENT_SEED = 20_261_128
INSTRUCTION = "Extract the record as JSON.\nText: {source}\nJSON:"


@dataclass(frozen=True)
class Workload:
    workload_class: str
    warm: list[str]  # requests served first: what the class index learns from
    held_out: list[str]  # prompts the index has not seen verbatim


def agent_workload(records: int = 8, first: int = 0, seed: int = AGENT_SEED) -> Workload:
    """Orders `first` to `first + records` of the seed's; warm: each in the record view
    (style 0); held out: each in prose (style 1), then each as a key=value line (style 2)."""
    rng = random.Random(seed)
    recs = [_record(rng)[1] for _ in range(first + records)][first:]
    warm = [INSTRUCTION.format(source=render_record(r, 0)) for r in recs]
    held_out = [INSTRUCTION.format(source=render_record(r, style)) for style in (1, 2) for r in recs]
    return Workload(AGENT, warm, held_out)
