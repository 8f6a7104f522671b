"""Torch's CPU thread count in the threads that run a model.

`torch.set_num_threads` reaches OpenMP in the thread that calls it. A thread started later
starts from the process's `OMP_NUM_THREADS` (Ray sets 1 in an actor with `num_cpus: 1`), and
its matrix products keep that count until some large elementwise op happens to re-read
torch's setting: a decode step's tensors are too small for that. Measured on the target
worker: one core busy with `torch_threads: 2`. A thread that runs forwards starts with
`initializer()`, taken where the count was set.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable


def initializer() -> Callable[[], None]:
    """Run first in a new model thread: torch's thread count as the calling thread has it
    now (nothing where torch is not imported: an n-gram replica never loads it)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return lambda: None
    n = torch.get_num_threads()
    return lambda: torch.set_num_threads(n)


def model_thread(run: Callable[..., object], *args: object, name: str) -> threading.Thread:
    """A daemon thread that runs a model (`run(*args)`) with torch's thread count as the
    calling thread has it now (the target's engine thread)."""
    init = initializer()

    def main() -> None:
        init()
        run(*args)

    return threading.Thread(target=main, name=name, daemon=True)
