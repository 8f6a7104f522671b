"""The one thread that runs a process's model, with the torch threads the worker set.

Two faults of OpenMP (torch's CPU threads), both measured on the target worker:
- `torch.set_num_threads` reaches OpenMP in the calling thread only. A thread started later
  begins at `OMP_NUM_THREADS` (Ray sets 1 in an actor with `num_cpus: 1`; a plain process
  gets every core) and its matrix products keep that until some op large enough to re-read
  torch's setting runs there.
- Every thread that runs parallel work keeps a team of its own. With two teams (the target
  loaded and warmed its model on the gRPC thread, then stepped it on the engine thread) the
  process manages more OpenMP threads than the machine has cores, and the runtime's workers
  stop spinning between parallel regions: a 4-row decode forward took 17.4 ms on the second
  thread against 13.8 ms on the first, 16 rows 28–33 ms against 22.5 (2 cores, 2 threads;
  with 1 thread there was no difference). Loaded, warmed and stepped on one thread, it ran
  as fast as on the first.
So a worker runs every model call (load, warm-up, steps) on one `ModelThread`, made after it
set the thread count.
"""

from __future__ import annotations

import queue
import sys
import threading
from concurrent.futures import Executor, Future


class ModelThread(Executor):
    """One daemon thread that runs the calls submitted to it in order, with torch's thread
    count as the creating thread has it (nothing to set where torch is not imported: an
    n-gram replica never loads it). A daemon like the engine thread it replaced: the engine
    loop is a call that runs until its stop event, and a ThreadPoolExecutor's worker would
    hold the interpreter's exit until it returned."""

    def __init__(self, name: str) -> None:
        torch = sys.modules.get("torch")
        self._threads = torch.get_num_threads() if torch is not None else None
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn, /, *args, **kwargs) -> Future:
        if self._closed:
            raise RuntimeError("the model thread is shut down")
        future: Future = Future()
        self._calls.put((future, fn, args, kwargs))
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self._closed = True
        self._calls.put(None)
        if wait:
            self._thread.join()

    def _run(self) -> None:
        if self._threads is not None:
            sys.modules["torch"].set_num_threads(self._threads)
        while (call := self._calls.get()) is not None:
            future, fn, args, kwargs = call
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as exc:  # handed to the caller
                future.set_exception(exc)
