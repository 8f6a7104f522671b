"""`python -m specserve.services.target.plain`: the target worker in this process, without Ray.

For a node that has no Ray (a GPU node that can be given only a few MiB of wheels: Ray's is
79 MB; ADR 0028): the same `TargetWorker` the Ray actor runs, its gRPC server, engine loop,
registry heartbeat and commits, started here. What Ray adds is not there: nobody restarts the
process when it dies (a restarted one still adopts its sessions from Redis, as an actor's next
incarnation does), and `num_cpus`/`num_gpus` place nothing (the process sees the devices it is
started with). It writes the same info file as the Ray launcher, and stops on SIGTERM.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
from pathlib import Path

from specserve.config import TargetSettings
from specserve.serving.grpc_server import configure_logging

log = logging.getLogger("specserve.target.plain")


def serve(settings: TargetSettings, info_file: str = "") -> None:
    from specserve.services.target.actor import TargetWorker

    if settings.tensor_parallel > 1:  # its ranks are Ray actors (ADR 0030)
        raise SystemExit("a plain-process target serves tensor_parallel 1 only; the ranks need Ray")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    worker = TargetWorker(settings.model_dump_json())
    info = worker.info()
    log.info("target %s ready at %s (pid %s, no Ray)", settings.name, info["address"], info["pid"])
    if info_file:
        Path(info_file).write_text(json.dumps({**info, "ray_gcs": ""}))
    stop.wait()
    log.info("stopping target %s", settings.name)


if __name__ == "__main__":
    configure_logging()
    serve(TargetSettings(), os.environ.get("SPECSERVE_TARGET_INFO_FILE", ""))
