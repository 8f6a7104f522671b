"""The Generation servicer: validate, create or join the session in Redis, drive its rounds
(or follow the owner's), and serve every reader from the session's committed stream."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import time
import uuid
from dataclasses import replace
from typing import Any

from services.router.pools import DraftPool
from services.router.requests import CLASSES, NO_SPECULATION, Classifier, ModelInfo, Spec, parse
from services.router.rounds import RoundLoop, Run
from specserve.config import RouterSettings
from specserve.controller import Choice, Controller, Decision, ShadowLog
from specserve.errors import SpecserveError
from specserve.metrics import RouterMetrics
from specserve.params import GenerationParams, SamplingParams
from specserve.policy import PolicyCache
from specserve.prefix import CommittedPrefix
from specserve.rng import fresh_seed
from specserve.stops import IncrementalText, StopChecker
from specserve.store import SessionStatus, SessionStore
from specserve.telemetry import tracer
from specserve.v1 import generation_pb2, generation_pb2_grpc

log = logging.getLogger("specserve.router")

OWNER_LEASE_S = 15.0  # a running session not updated for this long has lost its router
STREAM_BLOCK_MS = 250


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    def __init__(self, settings: RouterSettings, model: ModelInfo, store: SessionStore,
                 pools: dict[str, DraftPool], loop: RoundLoop, policies: PolicyCache, controller: Controller,
                 classifier: Classifier, metrics: RouterMetrics, shadow_log: ShadowLog) -> None:
        self.settings = settings
        self.model = model
        self.store = store
        self.pools = pools
        self.loop = loop
        self.policies = policies
        self.controller = controller
        self.classifier = classifier
        self.metrics = metrics
        self.shadow_log = shadow_log
        self._warned_pools: set[str] = set()
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
        self.tasks: set[asyncio.Task] = set()

    def stops_for(self, params: GenerationParams) -> StopChecker:
        return StopChecker(self.model.eos_token_ids, params.stop, self.model.decode)

    # -- RPCs ------------------------------------------------------------------------------
    async def Generate(self, request, context) -> generation_pb2.GenerateResponse:
        spec = self._parse(request)
        run, joined, session_id = await self._open(spec, context)
        if run is not None:
            reason = await self._drive(run)
            return generation_pb2.GenerateResponse(
                session_id=run.session_id, text=run.text.published, token_ids=run.generated,
                finish_reason=reason, stats=self._stats(run, joined))
        tokens: list[int] = []
        text: list[str] = []
        reason = ""
        async for chunk in self.store.read_chunks(session_id, 0, STREAM_BLOCK_MS):
            tokens.extend(chunk.tokens)
            text.append(chunk.text)
            reason = chunk.finish_reason or reason
        info = await self.store.get(session_id)
        return generation_pb2.GenerateResponse(session_id=session_id, text="".join(text), token_ids=tokens,
                                               finish_reason=reason, stats=self._joined_stats(info))

    async def GenerateStream(self, request, context):
        spec = self._parse(request)
        run, joined, session_id = await self._open(spec, context)
        task = asyncio.create_task(self._drive(run)) if run is not None else None
        try:
            async for chunk in self.store.read_chunks(session_id, 0, STREAM_BLOCK_MS):
                msg = generation_pb2.GenerateChunk(session_id=session_id, offset=chunk.offset,
                                                   token_ids=chunk.tokens, text=chunk.text,
                                                   finish_reason=chunk.finish_reason or "")
                if chunk.finish_reason:
                    if task is not None:
                        await task  # raises what the owner raised (the chunk says "error")
                        msg.stats.CopyFrom(self._stats(run, joined))
                    else:
                        msg.stats.CopyFrom(self._joined_stats(await self.store.get(session_id)))
                yield msg
        finally:
            if task is not None and not task.done():
                task.cancel()

    async def Cancel(self, request, context) -> generation_pb2.CancelResponse:
        return generation_pb2.CancelResponse(cancelled=await self.store.cancel(request.session_id))

    async def Resume(self, request, context):
        async for chunk in self.store.read_chunks(request.session_id, request.from_offset, STREAM_BLOCK_MS):
            text = self.model.decode(chunk.tokens) if chunk.partial else chunk.text
            yield generation_pb2.GenerateChunk(session_id=request.session_id, offset=chunk.offset,
                                               token_ids=chunk.tokens, text=text,
                                               finish_reason=chunk.finish_reason or "")

    # -- sessions --------------------------------------------------------------------------
    def _parse(self, request) -> Spec:
        s = self.settings
        return parse(request, self.model, list(self.pools), self.classifier, s.max_tokens_limit, s.max_prompt_tokens)

    def stats_class(self, workload_class: str) -> str:
        """Statistics and metrics labels per known class; unknown ones share `other`, so a
        client cannot grow Redis or Prometheus without bound."""
        return workload_class if workload_class in CLASSES or self.policies.known(workload_class) else "other"

    async def choose(self, spec: Spec) -> tuple[Choice, dict[str, Any]]:
        """The request's arm under its class's policy (DESIGN §4) and what to record of it.
        The choice is stored with the session, so a request keeps the policy it started with."""
        policy, source = self.policies.effective(spec.workload_class)
        info: dict[str, Any] = {"policy_class": policy.workload_class, "policy_version": policy.version, "policy_source": source,
                "stats_class": self.stats_class(spec.workload_class)}

        def plain(decision: str, reason: str) -> tuple[Choice, dict[str, Any]]:
            return Choice(None, 0, False, decision, reason), info

        if spec.pinned_pool == NO_SPECULATION or spec.pinned_k == 0:
            return plain("pinned", "speculation_off")  # the request opted out
        if policy.mode == "off":
            return plain("off", "policy_off")
        temperature = spec.params.sampling.temperature
        if policy.temperature_ceiling is not None and temperature > policy.temperature_ceiling:
            return plain("plain", "temperature_above_ceiling")
        if policy.max_prompt_tokens and len(spec.prompt_ids) > policy.max_prompt_tokens:
            return plain("plain", "prompt_above_limit")
        pool = spec.pinned_pool or policy.draft_pool
        if pool not in self.pools:
            if pool not in self._warned_pools:
                self._warned_pools.add(pool)
                log.warning("policy %r names draft pool %r, which this router does not have: plain decoding",
                            policy.workload_class, pool)
            return plain("plain", "pool_unknown")
        policy = replace(policy, draft_pool=pool)
        decision = await self.controller.decide(info["stats_class"], policy)
        self._gauges(info["stats_class"], pool, decision)
        info["decision_reason"] = decision.reason
        if spec.pinned_pool is not None or spec.pinned_k is not None:
            k = spec.pinned_k if spec.pinned_k is not None else decision.k or policy.k_range[0]
            if policy.mode == "shadow":
                return Choice(pool, k, True, "shadow", "shadow"), info
            return Choice(pool, k, False, "pinned", ""), info
        return self.controller.choose(decision, policy), info

    def _gauges(self, stats_class: str, pool: str, d: Decision) -> None:
        m = self.metrics
        m.expected_speedup.labels(stats_class, pool).set(d.estimate.speedup.get(d.k, 0.0))
        m.speculating.labels(stats_class, pool).set(1 if d.decision in ("speculate", "learn") else 0)
        m.chosen_k.labels(stats_class, pool).set(d.k)

    async def _open(self, spec: Spec, context) -> tuple[Run | None, bool, str]:
        """(run to drive or None to follow, joined?, session id)."""
        seed = spec.params.seed if spec.params.seed is not None else fresh_seed()
        p = spec.params
        choice, info = await self.choose(spec)
        arm = "shadow" if choice.shadow else "speculative" if choice.pool else "plain"
        self.metrics.classified.labels(info["stats_class"], spec.class_reason.split(":")[0]).inc()
        self.metrics.decisions.labels(info["stats_class"], choice.pool or "none", choice.decision, arm).inc()
        self.metrics.policy_version.labels(info["stats_class"]).set(info["policy_version"])
        stored = {"max_tokens": p.max_tokens, "temperature": p.sampling.temperature, "top_k": p.sampling.top_k,
                  "top_p": p.sampling.top_p, "banned": list(p.sampling.banned_token_ids), "k": choice.k,
                  "stop": list(p.stop), "seed": seed, "workload_class": spec.workload_class,
                  "class_reason": spec.class_reason, "pool": None if choice.shadow else choice.pool,
                  "shadow_pool": choice.pool if choice.shadow else None, "decision": choice.decision,
                  "plain_reason": choice.reason, "probe": choice.probe, **info}
        handle = await self.store.create_or_join(spec.request_id, stored, spec.prompt_ids, self.owner)
        remaining = context.time_remaining() if context is not None else None
        deadline = asyncio.get_running_loop().time() + (remaining if remaining is not None else 3600.0)
        if handle.created:
            return self._run(handle.session_id, handle.epoch, spec.prompt_ids, stored, [], deadline), False, handle.session_id
        sess = await self.store.get(handle.session_id)
        if sess is not None and sess.status is SessionStatus.RUNNING and time.time() - sess.updated > OWNER_LEASE_S:
            epoch = await self.store.take_over(handle.session_id, self.owner)  # its router is gone
            generated = await self.store.committed_tokens(handle.session_id)
            run = self._run(handle.session_id, epoch, sess.prompt_ids, sess.params, generated, deadline)
            return run, True, handle.session_id
        return None, True, handle.session_id

    def _run(self, session_id: str, epoch: int, prompt_ids: list[int], stored: dict, generated: list[int],
             deadline: float) -> Run:
        params = GenerationParams(
            max_tokens=stored["max_tokens"], num_draft_tokens=stored["k"], stop=tuple(stored["stop"]),
            seed=stored["seed"], sampling=SamplingParams(stored["temperature"], stored["top_k"], stored["top_p"],
                                                          tuple(stored["banned"])))
        text = IncrementalText(self.stops_for(params))
        text.advance(list(generated), None)  # what earlier owners already published
        pool = self.pools.get(stored["pool"]) if stored.get("pool") else None
        run = Run(session_id=session_id, epoch=epoch, prompt_len=len(prompt_ids), params=params,
                  seed=stored["seed"], pool=pool, workload_class=stored["workload_class"],
                  committed=CommittedPrefix([*prompt_ids, *generated]), text=text, deadline=deadline,
                  stats_class=stored.get("stats_class", ""),
                  plain_reason=stored.get("plain_reason", "") or ("" if pool else "speculation_off"))
        run.stored = stored
        return run

    def _shadow_run(self, run: Run, pool: DraftPool) -> Run:
        params = replace(run.params, num_draft_tokens=int(run.stored["k"]))
        return Run(session_id=f"{run.session_id}-shadow", epoch=run.epoch, prompt_len=run.prompt_len,
                   params=params, seed=run.seed, pool=pool, workload_class=run.workload_class,
                   committed=CommittedPrefix(list(run.committed.ids)), text=IncrementalText(self.stops_for(params)),
                   deadline=asyncio.get_running_loop().time() + self.settings.shadow_timeout_s,
                   stats_class=run.stats_class, shadow=True)

    async def _drive(self, run: Run) -> str:
        stored = run.stored
        shadow_pool = self.pools.get(stored.get("shadow_pool") or "")
        shadow_task = None
        try:
            with tracer().start_as_current_span("specserve.generate") as span:
                span.set_attributes({"specserve.session_id": run.session_id,
                                     "specserve.workload_class": run.workload_class,
                                     "specserve.class_reason": stored.get("class_reason", ""),
                                     "specserve.policy_class": stored.get("policy_class", ""),
                                     "specserve.policy_version": int(stored.get("policy_version", 0)),
                                     "specserve.decision": stored.get("decision", ""),
                                     "specserve.decision_reason": stored.get("decision_reason", ""),
                                     "specserve.draft_pool": run.pool.name if run.pool else "none",
                                     "specserve.shadow_pool": shadow_pool.name if shadow_pool else "",
                                     "specserve.k": run.params.num_draft_tokens, "specserve.seed": str(run.seed)})
                if shadow_pool is not None and not run.generated:  # not again after a take-over
                    shadow = self._shadow_run(run, shadow_pool)
                    shadow_task = asyncio.create_task(self._run_shadow(shadow))
                    self._track(shadow_task)
                reason = await self.loop.run(run)
                if shadow_task is not None:
                    self._track(asyncio.create_task(self._record_shadow(run, shadow, shadow_task)))
                    shadow_task = None
                span.set_attributes({"specserve.finish_reason": reason, "specserve.rounds": len(run.rounds),
                                     "specserve.num_accepted": sum(r.accepted for r in run.rounds),
                                     "specserve.emitted": len(run.generated)})
        except asyncio.CancelledError:
            if shadow_task is not None:
                shadow_task.cancel()
            raise  # the client went away: the session stays running and can be taken over
        except SpecserveError as exc:
            if shadow_task is not None:
                shadow_task.cancel()
            await self.store.fail(run.session_id, run.epoch, str(exc))
            raise
        except Exception as exc:
            log.exception("session %s failed", run.session_id)
            if shadow_task is not None:
                shadow_task.cancel()
            await self.store.fail(run.session_id, run.epoch, f"{type(exc).__name__}: {exc}")
            raise
        self._release_workers(run)
        return reason

    def _release_workers(self, run: Run) -> None:
        async def release() -> None:
            if run.pool is not None:
                for replica in list(run.draft_held):
                    await run.pool.release(run.session_id, replica)
            await self.loop.targets.release(run.session_id, list(run.target_held))

        self._track(asyncio.create_task(release()))

    def _track(self, task: asyncio.Task) -> None:
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    # -- shadow mode -----------------------------------------------------------------------
    async def _run_shadow(self, shadow: Run) -> str | None:
        """The speculative path beside a served plain run. It commits nothing, and whatever
        happens to it never reaches the served output."""
        try:
            with tracer().start_as_current_span("specserve.shadow") as span:
                span.set_attributes({"specserve.session_id": shadow.session_id,
                                     "specserve.workload_class": shadow.workload_class,
                                     "specserve.draft_pool": shadow.pool.name if shadow.pool else "none",
                                     "specserve.k": shadow.params.num_draft_tokens})
                return await asyncio.wait_for(self.loop.run(shadow), self.settings.shadow_timeout_s)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.warning("shadow run %s failed: %s", shadow.session_id, exc)
            return None
        finally:
            self._release_workers(shadow)

    async def _record_shadow(self, run: Run, shadow: Run, task: asyncio.Task) -> None:
        """Once both finished: agreement (temperature 0: identical tokens) and the would-be
        speedup, on the session (`shadow` field) and in the per-class totals."""
        try:
            result = await task
        except asyncio.CancelledError:
            return
        pool = shadow.pool.name if shadow.pool else "none"
        greedy = run.params.sampling.temperature == 0
        served, spec = run.generated, shadow.generated
        if result is None or run.finished is None:
            outcome = "failed"
        elif greedy:
            outcome = "agree" if served == spec and run.finish_reason == shadow.finish_reason else "disagree"
        else:
            outcome = "sampled"
        divergence = next((i for i, (a, b) in enumerate(zip(served, spec, strict=False)) if a != b),
                          None if len(served) == len(spec) else min(len(served), len(spec)))
        plain_s = (run.finished - run.started) if run.finished else 0.0
        shadow_s = (shadow.finished - shadow.started) if shadow.finished else 0.0
        rounds = list(shadow.rounds)
        record: dict[str, Any] = {"outcome": outcome, "greedy": greedy, "pool": pool, "k": shadow.params.num_draft_tokens,
                  "served_tokens": len(served), "shadow_tokens": len(spec), "first_divergence": divergence,
                  "rounds": len(rounds), "drafted": sum(r.k for r in rounds),
                  "accepted": sum(r.accepted for r in rounds),
                  "acceptance_rate": sum(r.accepted for r in rounds) / max(sum(r.k for r in rounds), 1),
                  "plain_seconds": plain_s, "shadow_seconds": shadow_s,
                  "would_be_speedup": plain_s / shadow_s if shadow_s > 0 and plain_s > 0 else 0.0}
        labels = (shadow.stats_class or shadow.workload_class, pool)
        self.metrics.shadow_requests.labels(*labels, outcome).inc()
        if record["would_be_speedup"]:
            self.metrics.shadow_speedup.labels(*labels).observe(record["would_be_speedup"])
        if outcome == "disagree":
            log.error("shadow run of %s disagrees with the served output at token %s", run.session_id, divergence)
        try:
            await self.store.annotate(run.session_id, {"shadow": json.dumps(record)})
            await self.shadow_log.add(*labels, {
                "requests": 1, {"agree": "agreed", "disagree": "disagreed"}.get(outcome, outcome): 1,
                "rounds": record["rounds"], "drafted": record["drafted"], "accepted": record["accepted"],
                "tokens": len(spec), "plain_seconds": plain_s, "shadow_seconds": shadow_s})
        except Exception as exc:
            log.warning("could not record shadow outcome of %s: %s", run.session_id, exc)

    def _stats(self, run: Run, joined: bool) -> generation_pb2.GenerationStats:
        return generation_pb2.GenerationStats(
            seed=run.seed, workload_class=run.workload_class, draft_pool=run.pool.name if run.pool else "",
            rounds=len(run.rounds), draft_tokens=sum(r.k for r in run.rounds),
            accepted_tokens=sum(r.accepted for r in run.rounds), round=run.rounds, joined=joined)

    def _joined_stats(self, info) -> generation_pb2.GenerationStats:
        p = info.params if info is not None else {}
        return generation_pb2.GenerationStats(seed=p.get("seed", 0), workload_class=p.get("workload_class", ""),
                                              draft_pool=p.get("pool") or "", joined=True)
