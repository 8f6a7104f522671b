"""`python -m specserve.services.target`: place the target actor with Ray and keep it there.

With RAY_ADDRESS set (a KubeRay cluster) it joins that cluster; otherwise it starts a local
Ray head on loopback (no dashboard) and owns it: on SIGTERM it kills the actor and calls
ray.shutdown(), which stops exactly the Ray processes it started (DESIGN §10: never `ray stop`).
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import threading
import uuid
from pathlib import Path
from typing import Any

from specserve.config import TargetSettings
from specserve.serving.grpc_server import configure_logging

log = logging.getLogger("specserve.target.launcher")


def _ray_environment() -> None:
    """The environment Ray reads at init (and passes to every process it starts here)."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # ray.shutdown() waits up to this long to flush Ray's task events (about 6 s on a local head,
    # where the flush never went idle): a stopping launcher should not sit out a pod's grace
    # period for telemetry specserve does not read
    os.environ.setdefault("RAY_task_events_shutdown_flush_timeout_ms", "500")
    if not os.environ.get("RAY_ADDRESS"):
        # A local, single-node cluster: Ray resolves "127.0.0.1" to the host's outward address
        # unless it believes clusters are off, in which case every Ray process (raylet, GCS,
        # workers, inherited through the environment) uses the loopback address.
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
        # Ray nices its workers (15) by default: the target is the critical path of every
        # round, and a niced target starves behind routers and drafts on a busy node
        os.environ.setdefault("RAY_worker_niceness", "0")
        # Ray's token authentication (Ray >= 2.52; this venv has 2.60): every process of the
        # cluster started here (GCS, raylet, workers inherit the environment) demands the token,
        # so another local user cannot submit work to it. RAY_AUTH_MODE=disabled opts out.
        if os.environ.setdefault("RAY_AUTH_MODE", "token") == "token":
            os.environ.setdefault("RAY_AUTH_TOKEN", uuid.uuid4().hex)


def launch(settings: TargetSettings, info_file: str = "") -> None:
    _ray_environment()
    import ray

    from specserve.services.target.actor import TargetWorker

    if os.environ.get("RAY_ADDRESS"):
        ray.init(namespace=settings.namespace, logging_level=logging.WARNING)
    else:
        # (a tensor-parallel target's ranks each take num_cpus: room for all of them, ADR 0030)
        cpus = max(2, math.ceil(settings.num_cpus * settings.tensor_parallel) + 1)
        ray.init(namespace=settings.namespace, include_dashboard=False, num_cpus=cpus,
                 _node_ip_address="127.0.0.1", logging_level=logging.WARNING)
    from specserve.serving.telemetry import (
        carrier,
        setup_tracing,
        shutdown_tracing,
        tracer,
        tracing_env,
    )

    setup_tracing("specserve-target-launcher")
    options = dict(name=settings.name, lifetime="detached", get_if_exists=True,
                   runtime_env={"env_vars": tracing_env()} if tracing_env() else None,
                   num_cpus=settings.num_cpus, num_gpus=settings.num_gpus,
                   resources=settings.resources or None, max_restarts=settings.max_restarts,
                   max_task_retries=0)
    with tracer().start_as_current_span("specserve.target.launch"):
        if settings.tensor_parallel > 1:  # rank 0 in bundle 0 of the group's placement (ADR 0030)
            from specserve.services.target.tp_group import PlacementRefused, in_bundle, place

            try:
                options["scheduling_strategy"] = in_bundle(place(settings), 0)
            except PlacementRefused as exc:  # a clear error at start, not a pending actor
                log.critical("%s", exc)
                ray.shutdown()
                shutdown_tracing()
                raise SystemExit(2) from exc
        actor: Any = ray.remote(TargetWorker).options(**options).remote(settings.model_dump_json(), carrier())
        info = ray.get(actor.info.remote())
    log.info("target actor %s ready at %s (pid %s)", settings.name, info["address"], info["pid"])
    if info_file:  # for launchers and tests: where the actor serves, and the Ray cluster's GCS
        Path(info_file).write_text(json.dumps({**info, "ray_gcs": ray.get_runtime_context().gcs_address}))
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    log.info("stopping target actor %s", settings.name)
    ray.kill(actor, no_restart=True)
    if settings.tensor_parallel > 1:
        from specserve.services.target.tp_group import unplace

        unplace(settings)
    ray.shutdown()
    shutdown_tracing()


if __name__ == "__main__":
    configure_logging()
    launch(TargetSettings(), os.environ.get("SPECSERVE_TARGET_INFO_FILE", ""))
