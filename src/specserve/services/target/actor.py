"""The target as a named, detached Ray actor. Its constructor (re-run by Ray after every
restart) starts a grpc.aio Target server on its own event-loop thread and registers
host:port in Redis under a heartbeat TTL; routers discover targets there and talk to the
actor's port directly (DESIGN §4: the Serve proxy is not on the per-round path)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
import threading

from specserve.config import TargetSettings
from specserve.serving.grpc_server import configure_logging

log = logging.getLogger("specserve.target")
ENGINE_FAILED_EXIT = 70  # the process's status when its engine loop failed (EX_SOFTWARE)


def _ray_gpu_ids() -> list:
    """The GPUs Ray gave this actor (it sets CUDA_VISIBLE_DEVICES to them: they are cuda:0
    upwards here); empty outside Ray or without num_gpus. Outside a Ray worker (the plain
    process of `plain.py`) Ray is not asked: `ray.get_gpu_ids()` would start a local cluster."""
    ray = sys.modules.get("ray")  # a Ray worker has it imported
    if ray is None or not ray.is_initialized():
        return []
    try:
        return list(ray.get_gpu_ids())
    except Exception:  # noqa: BLE001 - not a worker after all
        return []


def registry_key(prefix: str, name: str) -> str:
    return f"{prefix}:target:{name}"


def registry_index(prefix: str) -> str:
    """The set of registered targets' names, so that routers find the entries without a SCAN of
    the keyspace (which grows with every session kept for its TTL; ADR 0028)."""
    return f"{prefix}:targets"


INDEX_TTL_S = 86_400  # the index outlives its targets' heartbeats; routers drop names whose entry expired


class TargetWorker:
    """Plain class (Ray wraps it with `ray.remote` in the launcher, options from settings)."""

    def __init__(self, settings_json: str, trace_carrier: dict[str, str] | None = None) -> None:
        configure_logging()
        self.settings = TargetSettings.model_validate_json(settings_json)
        self._carrier = trace_carrier or {}  # the launcher's span: context crosses into Ray explicitly
        self.metrics_port = -1
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self.address = ""
        self._loop = asyncio.new_event_loop()
        self.group = None  # a tensor-parallel target's LeaderTarget (ADR 0030)
        self._thread = threading.Thread(target=self._run, name="target-grpc", daemon=True)
        self._thread.start()

    def info(self, timeout_s: float = 300.0) -> dict:
        """Blocks until the server is SERVING; returns {"address", "pid"}."""
        if not self._ready.wait(timeout_s):
            raise TimeoutError(f"target not ready after {timeout_s} s")
        if self._error is not None:
            raise RuntimeError(f"target failed to start: {self._error!r}")
        return {"address": self.address, "pid": os.getpid(), "metrics_port": self.metrics_port}

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._serve())
        except BaseException as exc:  # surfaced through info()
            self._error = exc
            self._ready.set()
            log.exception("target worker stopped")

    async def _serve(self) -> None:
        import torch

        from specserve.device import resolve_device
        from specserve.services.target.server import TargetServicer
        from specserve.serving.grpc_server import GrpcServer
        from specserve.serving.metrics import WorkerMetrics
        from specserve.serving.telemetry import (
            TracingServerInterceptor,
            attach_carrier,
            setup_tracing,
            start_metrics_server,
            tracer,
        )
        from specserve.serving.tls import load as load_tls
        from specserve.state.store import SessionStore, connect
        from specserve.v1 import target_pb2, target_pb2_grpc
        from specserve.worker import threads

        s = self.settings
        setup_tracing("specserve-target")
        attach_carrier(self._carrier)
        redis = connect(s.redis_url)  # the registry heartbeat and the commits ride a Redis restart
        tls = load_tls(s.tls_dir, s.tls_server_name)
        with tracer().start_as_current_span("specserve.target.start") as span:
            span.set_attribute("specserve.target", s.name)
            torch.set_num_threads(s.torch_threads)
            model_thread = threads.ModelThread("engine")  # every model call, the engine loop's too

            target, engine = await asyncio.wrap_future(model_thread.submit(_build, s))
            self.group = engine if s.tensor_parallel > 1 else None
            device = str(resolve_device(s.device))  # where either path put the model
            span.set_attribute("specserve.device", device)
            log.info("target model on %s (Ray GPU ids %s, num_gpus %s)", device, _ray_gpu_ids(), s.num_gpus)
            metrics = WorkerMetrics("target")
            if self.group is not None:  # each rank's state (ADR 0030)
                from specserve.services.target.tp_group import GroupCollector

                metrics.registry.register(GroupCollector(self.group))
            store = SessionStore(redis, prefix=s.key_prefix, ttl_s=s.session_ttl_s, lease_s=s.lease_s)
            host = self.host = loop_host(s, engine, metrics, target, store, tls, model_thread)
            servicer = TargetServicer(host)
            server = GrpcServer([target_pb2.DESCRIPTOR.services_by_name["Target"].full_name], s.host, s.port,
                                s.grace_s, lambda srv: target_pb2_grpc.add_TargetServicer_to_server(servicer, srv),
                                interceptors=[TracingServerInterceptor()],
                                credentials=tls.server(require_client_cert=True) if tls else None)
            await server.start()
            host.start_loop()
            await host.adapters.load_at_start(s.adapters, redis, s.key_prefix)  # (ADR 0029)
            await server.set_serving()
            self.metrics_port = start_metrics_server(metrics.registry, s.metrics_port, s.host)
        self.address = f"{s.host}:{server.port}"
        await self._register_and_beat(redis, host)

    async def _register_and_beat(self, redis, host) -> None:
        """Registered under this target's name, the sessions it had adopted, then a heartbeat:
        the entry expires registry_ttl_s after this process dies."""
        s = self.settings
        key = registry_key(s.key_prefix, s.name)

        def entry() -> str:
            return json.dumps({"address": self.address, "pid": os.getpid(), "name": s.name,
                               "metrics_port": self.metrics_port, "incarnation": host.incarnation,
                               "sessions": host.load, "adapters": host.adapters.names(), **group_entry(self.group)})

        async def beat() -> None:
            async with redis.pipeline(transaction=False) as pipe:
                pipe.set(key, entry(), px=int(s.registry_ttl_s * 1000))
                pipe.sadd(registry_index(s.key_prefix), s.name)
                pipe.expire(registry_index(s.key_prefix), INDEX_TTL_S)
                await pipe.execute()

        await beat()
        host.adapters.on_change = beat  # a load or unload is in the registry at once (ADR 0029)
        log.info("target %s serving on %s (pid %d)", s.name, self.address, os.getpid())
        self._ready.set()
        try:  # a restarted incarnation drives its sessions on (they were in its index)
            await host.adopt_mine()
        except Exception:
            log.exception("adopting this target's sessions")
        while True:
            await asyncio.sleep(s.heartbeat_s)
            try:
                await beat()
            except Exception:  # Redis blips must not kill the worker; the next beat retries
                log.warning("heartbeat to Redis failed", exc_info=True)


def _build(s: TargetSettings):
    """(the target, its model step), warmed up; on the model thread. A tensor-parallel target:
    ranks 1..N-1 beside this one, each with its shard (ADR 0030)."""
    from specserve.worker.model_step import make_target_step, warm_up

    if s.tensor_parallel > 1:
        from specserve.services.target.tp_group import start_ranks

        engine = start_ranks(s, _group_lost)
        target = engine.local.target
    else:
        from specserve.models.loading import load_model
        from specserve.models.verifier import TargetModel
        from specserve.services.target.local_draft import target_batching

        target = TargetModel(load_model(s.model))
        engine = make_target_step(target, target_batching(s))  # (room for a draft model in its rounds)
    warm_up(engine)  # the batched step once, before the engine loop owns the model
    if s.tensor_parallel > 1:
        engine.check()  # every rank's pid and state, for the registry
    return target, engine


def group_entry(group) -> dict:
    """A tensor-parallel target's ranks in its registry entry (ADR 0030): each one's pid, step
    messages received and verdict digest at the last check (once a second while it steps)."""
    if group is None:
        return {}
    return {"tensor_parallel": group.tp.size,
            "ranks": [{"rank": r.rank, "pid": r.pid, "steps": r.messages.get("step", 0), "digest": r.digest}
                      for r in group.last_check]}


def loop_host(s: TargetSettings, engine, metrics, target, store, tls, model_thread=None):
    """The engine beside the target, with a draft source per configured pool (`draft_sources`)."""
    from specserve.algorithm.stops import StopChecker
    from specserve.control.controller import Controller, ShadowLog
    from specserve.engine.scheduler import Budget
    from specserve.engine.speculation import SpeculationSettings
    from specserve.model_info import ModelInfo
    from specserve.services.target.loop_host import LoopHost
    from specserve.serving.metrics import RoundMetrics

    loop = asyncio.get_running_loop()
    info = ModelInfo(s.model)  # the tokenizer: stop strings and EOS are settled here now

    def stops_for(params):
        return StopChecker(info.eos_token_ids, params.stop, info.decode)

    sources, fleets = draft_sources(s, engine, target, store, tls, loop)
    controller = Controller(store.client, s.key_prefix, s.controller_half_life_s, ttl_s=s.stats_ttl_s)
    loop.create_task(controller.start())

    def constrain(c):  # (xgrammar loads on the first constrained session)
        from specserve.structured.grammar import ConstrainedRow

        grammars = info.grammars(target.vocab_size)
        return ConstrainedRow(grammars.compile(c), grammars.vocab_size, target.vocab_size, encode=info.encode)

    host = LoopHost(engine, stops_for, store, s.name, sources, loop,
                    budget=Budget(max_batch=s.max_batch, max_batched_tokens=s.max_batched_tokens,
                                  prefill_chunk=s.prefill_chunk),
                    speculation=SpeculationSettings(block_wait_max_s=s.block_wait_ms / 1e3,
                                                    max_commit_lag=s.max_commit_lag, gather=s.gather_rows,
                                                    tree_width=s.tree_width),
                    redis_outage_s=s.redis_outage_s,
                    simulated_step_ms=s.simulated_pass_ms, simulated_row_ms=s.simulated_row_ms,
                    metrics=RoundMetrics(metrics.registry),
                    controller=controller, shadow_log=ShadowLog(store.client, s.key_prefix, s.stats_ttl_s),
                    kv_bytes_per_token=info.kv_bytes_per_token, heartbeat_s=s.heartbeat_s,
                    detached_idle_s=s.detached_idle_s, on_no_room=metrics.refused.inc,
                    worker_metrics=metrics, constrain=constrain, model_thread=model_thread,
                    on_loop_failure=_exit_for_a_restart)
    for fleet in fleets:  # what the fleet served before this incarnation, then what it serves
        fleet.register(metrics.registry)
        loop.create_task(fleet.start(host.incarnation))
    return host


def draft_sources(s: TargetSettings, engine, target, store, tls, loop) -> tuple[dict, list]:
    """One draft source per configured pool: remote replicas, or drafting in this process for
    a `local:ngram`, `local:eagle`, `local:suffix` or `local:draft` pool; and the suffix pools'
    links to the fleet's outputs (ADR 0026). One local pool's drafter runs inside the device
    step's rounds (`device_pool`: an EAGLE head before a draft model, ADR 0025)."""
    from specserve.config import LOCAL_DRAFT, LOCAL_EAGLE, LOCAL_NGRAM, LOCAL_SUFFIX
    from specserve.drafters.ngram import NgramDrafter
    from specserve.engine.drafting import LocalDrafts
    from specserve.engine.remote_drafts import RemoteDrafts
    from specserve.services.target.local_draft import device_pool, draft_local
    from specserve.services.target.suffix import SuffixFleet

    fleets: list[SuffixFleet] = []
    on_device = device_pool(s.draft_pools, engine)

    def source(name: str, addrs: list[str]):
        if addrs == [LOCAL_NGRAM]:  # drafted on the engine's thread at each outcome: no hop
            return LocalDrafts(NgramDrafter(target.vocab_size))
        if addrs == [LOCAL_SUFFIX]:  # the session's and its class's outputs, on the engine's thread
            fleets.append(SuffixFleet(target.vocab_size, store.client, s.key_prefix, loop, ttl_s=s.stats_ttl_s))
            return fleets[-1].source
        if addrs == [LOCAL_EAGLE]:  # the head beside the target, from its features (ADR 0020)
            return eagle_local(s, engine, target, on_device=name == on_device)
        if addrs == [LOCAL_DRAFT]:  # a draft model beside the target, in its round where it can (ADR 0025)
            return draft_local(s, engine, target, on_device=name == on_device)
        return RemoteDrafts(addrs, loop, target.vocab_size, s.predraft_branches, tls=tls,
                            wants_features=name in s.eagle_pools).start()

    if s.eagle_pools:  # remote heads: the target keeps their features (the head's layers) in every step
        engine.keep_features(eagle_head_config(s).feature_layers)
    return {name: source(name, addrs) for name, addrs in s.draft_pools.items()}, fleets


def eagle_head_config(s: TargetSettings):
    """The head's config (its feature layers), from `eagle_head` or `eagle/` beside the target."""
    from pathlib import Path

    from specserve.drafters.eagle import EagleConfig

    directory = Path(s.eagle_head) if s.eagle_head else Path(s.model).parent / "eagle"
    if not (directory / "config.json").exists():
        raise ValueError(f"an EAGLE pool needs its head: none at {directory} (eagle_head; "
                         "`specserve models eagle --target DIR` trains one)")
    return EagleConfig.from_json((directory / "config.json").read_text())


def eagle_local(s: TargetSettings, engine, target, on_device: bool = True):
    """The `local:eagle` pool: the head (`eagle_head`, or `eagle/` beside the target's model
    directory) drafting on the engine's thread from the features the target's step hands out;
    where the target runs the device step (CUDA graphs) and `on_device` (the pool holds the
    step's one drafter), inside it (ADR 0025) for the sessions it judges there."""
    from pathlib import Path

    from specserve.drafters.eagle import TargetParts, load_head
    from specserve.engine.eagle_local import DeviceHeadDrafts, EagleLocalDrafts

    directory = Path(s.eagle_head) if s.eagle_head else Path(s.model).parent / "eagle"
    if not (directory / "config.json").exists():
        raise ValueError(f"a local:eagle pool needs an EAGLE head: none at {directory} (eagle_head; "
                         "`specserve models eagle --target DIR` trains one)")
    head = load_head(directory)
    if not hasattr(engine, "keep_features"):
        raise ValueError("a local:eagle pool needs the batched runner (the target's features): this target "
                         "runs on the per-session path")
    engine.keep_features(head.cfg.feature_layers)
    if s.tensor_parallel > 1:  # no rank holds the whole model: the head's parts from the files (ADR 0030)
        parts = TargetParts.from_weights(s.model, head.cfg.feature_layers)
    else:
        parts = TargetParts(target.model, head.cfg.feature_layers)
    if on_device and getattr(engine, "runner", None) is not None and engine.runner.device_step is not None:
        engine.enable_head(head)  # the head's rounds in the device step, chained where the lookahead is on
        return DeviceHeadDrafts(head, parts)
    return EagleLocalDrafts(head, parts)


def _group_lost(exc: BaseException) -> None:
    """A rank of this tensor-parallel target died or failed (ADR 0030): the group is one unit,
    so rank 0 exits and Ray restarts the group, which adopts the sessions from Redis."""
    log.critical("a rank of this tensor-parallel target is lost (%r): exiting so that Ray restarts the group", exc)
    logging.shutdown()
    os._exit(ENGINE_FAILED_EXIT)


def _exit_for_a_restart(exc: BaseException) -> None:
    """The engine loop failed (logged with its traceback). Every session of this target
    stalls without it, and the process would stay up serving nothing: exit, so that Ray
    restarts the actor and the next incarnation adopts them from Redis (ADR 0014), as after
    a kill -9."""
    log.critical("the engine loop failed (%r): exiting so that Ray restarts this target", exc)
    logging.shutdown()
    os._exit(ENGINE_FAILED_EXIT)
