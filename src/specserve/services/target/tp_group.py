"""A tensor-parallel target under Ray (ADR 0030): its placement group, and its ranks.

- The launcher places the group (`place`): N bundles, one per rank, STRICT_PACK on one node,
  detached and named after the target, so a restarted rank 0 finds its bundles again. A group
  Ray cannot place within `tp_placement_timeout_s` is removed and refused with what it asked
  for and what the cluster has (`PlacementRefused`), not left pending.
- Rank 0 is the target actor itself, in bundle 0. At every start (`start_ranks`, Ray re-runs it
  after each restart) it creates ranks 1..N-1 as `RankWorker` actors in bundles 1..N-1; they
  are owned by it (they die with it) and never restarted alone. It then joins them in one
  torch.distributed group and drives them (worker/tp_step.py).
- A rank that dies takes the group down: rank 0 sees it in its next collective (the step
  fails, the engine loop exits the process) or, between steps, through `watch` (the ranks'
  `serve` calls return only when they fail). Either way rank 0 exits, Ray restarts it, and the
  new group adopts the sessions from Redis.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from specserve.config import TargetSettings

log = logging.getLogger("specserve.target.tp")


class PlacementRefused(RuntimeError):
    """The cluster cannot place the group's bundles (not enough GPUs or CPUs on one node)."""


def group_name(s: TargetSettings) -> str:
    return f"{s.name}-tp{s.tensor_parallel}"


def bundle(s: TargetSettings) -> dict[str, float]:
    """One rank's share of the node: what the one-device target asks for, per rank."""
    out = {"CPU": float(s.num_cpus), "GPU": float(s.num_gpus), **{k: float(v) for k, v in s.resources.items()}}
    return {k: v for k, v in out.items() if v > 0} or {"CPU": 0.001}


def place(s: TargetSettings) -> Any:
    """The group's placement group, placed (the existing one where a launcher restarted);
    PlacementRefused where Ray cannot place it in time."""
    import ray
    from ray.util.placement_group import get_placement_group, placement_group, remove_placement_group

    name = group_name(s)
    try:
        pg = get_placement_group(name)
    except ValueError:
        pg = placement_group([bundle(s)] * s.tensor_parallel, strategy="STRICT_PACK", name=name,
                             lifetime="detached")
    if pg.wait(timeout_seconds=s.tp_placement_timeout_s):
        return pg
    remove_placement_group(pg)
    raise PlacementRefused(
        f"tensor_parallel {s.tensor_parallel}: Ray could not place {s.tensor_parallel} bundles of {bundle(s)} "
        f"on one node (STRICT_PACK) within {s.tp_placement_timeout_s:.0f} s; the cluster has "
        f"{ray.cluster_resources()}, of which {ray.available_resources()} are free. Lower tensor_parallel "
        f"or num_gpus/num_cpus per rank, or add a node with enough of them")


def unplace(s: TargetSettings) -> None:
    from ray.util.placement_group import get_placement_group, remove_placement_group

    with contextlib.suppress(ValueError):  # (none placed)
        remove_placement_group(get_placement_group(group_name(s)))


def in_bundle(pg: Any, index: int) -> Any:
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=index,
                                            placement_group_capture_child_tasks=False)


class RankWorker:
    """A rank > 0 (Ray wraps it in `start_ranks`): its whole life is one `serve` call."""

    def __init__(self, settings_json: str, rank: int) -> None:
        from specserve.serving.grpc_server import configure_logging

        configure_logging()
        self.settings = TargetSettings.model_validate_json(settings_json)
        self.rank = rank

    def serve(self, spec: Any) -> dict:
        """Join the group, load this rank's shard, follow rank 0 until it stops (returns its
        state) or fails (raises): either ends the group (rank 0's `watch`)."""
        from specserve.worker.tp_step import run_follower

        log.info("rank %d of %s joining %s", self.rank, self.settings.name, spec.init_method)
        return asdict(run_follower(spec, self.rank, self.settings.torch_threads))


def _free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def start_ranks(s: TargetSettings, on_lost: Callable[[BaseException], None]) -> Any:
    """Rank 0's model step (a LeaderTarget) over ranks 1..N-1 created now in this actor's
    placement group; `on_lost` is called (on a thread of its own) when a rank's `serve` ends."""
    import ray
    from ray.util import get_current_placement_group

    from specserve.worker.model_step import Batching
    from specserve.worker.tp_step import RankSpec, leader

    pg = get_current_placement_group()
    if pg is None:
        raise RuntimeError(f"tensor_parallel {s.tensor_parallel}: the target actor runs outside its placement "
                           "group (the launcher, python -m specserve.services.target, places it there)")
    host = ray.util.get_node_ip_address()
    spec = RankSpec(s.model, Batching.from_settings(s), s.tensor_parallel, f"tcp://{host}:{_free_port(host)}")
    worker: Any = ray.remote(RankWorker)
    ranks: list[Any] = [worker.options(num_cpus=s.num_cpus, num_gpus=s.num_gpus, resources=s.resources or None,
                            scheduling_strategy=in_bundle(pg, i), max_restarts=0,
                            max_task_retries=0).remote(s.model_dump_json(), i)
             for i in range(1, s.tensor_parallel)]
    serving = [r.serve.remote(spec) for r in ranks]
    engine = leader(spec)  # blocks until every rank joined
    engine.keep.extend(ranks)  # (an actor whose last handle is dropped is stopped)
    threading.Thread(target=watch, args=(serving, on_lost), name="tp-watch", daemon=True).start()
    log.info("tensor-parallel group of %d ranks up (%s)", s.tensor_parallel, spec.init_method)
    return engine


def watch(serving: list, on_lost: Callable[[BaseException], None]) -> None:
    """Wait for the first rank's `serve` to end (it fails, or its process died) and call
    `on_lost` with why."""
    import ray

    done, _ = ray.wait(serving, num_returns=1, timeout=None)
    try:
        ray.get(done[0])
        why: BaseException = RuntimeError("a rank of the tensor-parallel group stopped")
    except Exception as exc:  # noqa: BLE001 - the rank's own failure, or Ray's news of its death
        why = exc
    on_lost(why)


class GroupCollector:
    """A tensor-parallel target's ranks in its Prometheus registry, from rank 0's last check
    (once a second while it steps): each rank's step messages, time in the collectives and
    device memory, and whether the ranks' verdicts agree. (The ranks run every step in
    lockstep: rank 0's device busy time is every rank's.)"""

    def __init__(self, group: Any) -> None:
        self.group = group

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        states = list(self.group.last_check)
        steps = CounterMetricFamily("specserve_target_tp_step_messages", "Step messages each rank of the "
                                    "tensor-parallel target received (rank 0: sent), at the last check.",
                                    labels=("rank",))
        coll = CounterMetricFamily("specserve_target_tp_collective_seconds", "Time each rank spent in the "
                                   "all-reduces and the logits' gather (waiting for the other ranks included).",
                                   labels=("rank", "op"))
        mem = GaugeMetricFamily("specserve_target_tp_memory_bytes", "Each rank's device memory in use (CUDA: "
                                "allocated by torch; the CPU: the process's resident memory).", labels=("rank",))
        for st in states:
            steps.add_metric([str(st.rank)], st.messages.get("step", 0))
            for op, sec in st.collective_s.items():
                coll.add_metric([str(st.rank), op], sec)
            mem.add_metric([str(st.rank)], st.memory_bytes)
        agree = GaugeMetricFamily("specserve_target_tp_ranks_agree", "1 while every rank's verdicts equal rank "
                                  "0's at the last check.")
        agree.add_metric([], float(len({st.digest for st in states}) <= 1))
        yield from (steps, coll, mem, agree)
