"""Prometheus metrics (DESIGN §6), names prefixed `specserve_`, labelled by workload class,
draft pool and LoRA adapter (ADR 0029: bounded by `AdapterLabels`). Each service owns a
registry (no global state); the Grafana dashboard in deploy/grafana/ queries exactly these
names (a test parses it)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from specserve.serving.busy import BusyMeter, DeviceCollector

LABELS = ("workload_class", "draft_pool", "adapter")
NO_ADAPTER, OTHER_ADAPTERS = "none", "other"


class AdapterLabels:
    """The `adapter` label's values (ADR 0029), bounded: the `top` adapters with the most
    traffic (sessions counted as they start, halved at each re-ranking, every `every` of them)
    keep their names, the rest share `other`; the base is `none`. A session takes its label
    once, so its series' increments and decrements meet."""

    def __init__(self, top: int = 8, every: int = 256) -> None:
        self.top, self.every = top, every
        self.counts: dict[str, float] = {}
        self.kept: set[str] = set()
        self._seen = 0

    def label(self, adapter: str, count: bool = True) -> str:
        if not adapter:
            return NO_ADAPTER
        if count:
            self.counts[adapter] = self.counts.get(adapter, 0.0) + 1
            self._seen += 1
            if self._seen % self.every == 0:
                ranked = sorted(self.counts.items(), key=lambda kv: (-kv[1], kv[0]))
                self.kept = {a for a, _ in ranked[:self.top]}
                self.counts = {a: n / 2 for a, n in ranked[:4 * self.top]}
        if adapter not in self.kept and len(self.kept) < self.top and count:
            self.kept.add(adapter)
        return adapter if adapter in self.kept else OTHER_ADAPTERS

    def of_class(self, stats_class: str, count: bool = False) -> tuple[str, str]:
        """(class, adapter label) of a statistics class `CLASS@ADAPTER[+suffix]` (ADR 0029)."""
        cls, adapter = split_class(stats_class)
        return cls, self.label(adapter, count)


def split_class(stats_class: str) -> tuple[str, str]:
    """A statistics class `CLASS@ADAPTER[+suffix]` (ADR 0029) as (`CLASS[+suffix]`, `ADAPTER`)."""
    head, plus, suffix = stats_class.partition("+")
    cls, _, adapter = head.partition("@")
    return cls + plus + suffix, adapter
_MS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)


class RouterMetrics:
    """The control plane: classification, policies, the controller's decisions, API calls."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry or CollectorRegistry()
        self.takeovers = Counter("specserve_session_takeovers",
                                 "Sessions this router re-placed on a target after their driver's lease lapsed "
                                 "(ADR 0014).",
                                 registry=r)
        self.unreplicated = Counter(
            "specserve_unreplicated_reads",
            "Stream reads served although no replica acknowledged them within redis_replica_wait_s (ADR 0023): "
            "a failover then could take those tokens back.", registry=r)
        self.serving = Gauge("specserve_router_serving", "1 while the router's health is SERVING (Redis answers).",
                             registry=r)
        self.pool_healthy = Gauge("specserve_draft_pool_healthy_replicas",
                                  "Draft replicas answering SERVING to the router's health check.",
                                  ("draft_pool",), registry=r)
        self.api_requests = Counter("specserve_api_requests", "Client requests by API (grpc|http), route and status.",
                                    ("api", "route", "status"), registry=r)
        # classification, policies, the controller, shadow mode (DESIGN §4)
        self.classified = Counter("specserve_classified_requests", "Requests by workload class and how it was chosen.",
                                  ("workload_class", "reason"), registry=r)
        self.decisions = Counter(
            "specserve_controller_decisions",
            "Requests by the controller's decision (speculate|plain|learn|shadow|off|pinned) and the arm they ran "
            "(speculative|plain|shadow).", (*LABELS, "decision", "arm"), registry=r)
        self.expected_speedup = Gauge("specserve_controller_expected_speedup",
                                      "The controller's expected speedup S at its chosen K (0 = not enough data).",
                                      LABELS, registry=r)
        self.speculating = Gauge("specserve_controller_speculating",
                                 "1 while the controller lets the class speculate, 0 while it runs plain.",
                                 LABELS, registry=r)
        self.chosen_k = Gauge("specserve_controller_k", "The K the controller uses for the class.", LABELS,
                              registry=r)
        self.policy_version = Gauge("specserve_policy_version", "Version of the policy this router applies.",
                                    ("workload_class",), registry=r)
        # rollout guards (ADR 0022): a class in stage slice moved back to shadow by this router
        self.rollbacks = Counter("specserve_rollout_rollbacks",
                                 "Classes a rollout guard moved back from slice to shadow, by guard (speedup, "
                                 "acceptance); each is a policy write by `controller` in the audit log.",
                                 ("workload_class", "guard"), registry=r)
        self.promotions = Counter("specserve_rollout_promotions",
                                  "Classes promoted from slice to enabled by this router after a clean window "
                                  "(the policy's promote_after_s); each is a policy write by `controller`.",
                                  ("workload_class",), registry=r)


class RoundMetrics:
    """The rounds, where they run (the target's engine, ADR 0014): one `RoundStats` each."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry or CollectorRegistry()
        self._round_metrics(r)
        self._latency_metrics(r)
        self._engine_metrics(r)
        self._tree_and_shadow_metrics(r)

    def _round_metrics(self, r: CollectorRegistry) -> None:
        """What the rounds yield: drafts proposed and accepted, target passes, output tokens."""
        self.accepted_drafts = Histogram(
            "specserve_accepted_drafts", "Draft tokens accepted per speculative round.", LABELS,
            buckets=(0, 1, 2, 3, 4, 5, 6, 8, 12, 16, 32), registry=r)
        self.proposed = Counter("specserve_proposed_tokens", "Draft tokens proposed, by position in the block.",
                                (*LABELS, "position"), registry=r)
        self.accepted = Counter("specserve_accepted_tokens", "Draft tokens accepted, by position in the block.",
                                (*LABELS, "position"), registry=r)
        self.target_passes = Counter("specserve_target_passes", "Target forward passes (rounds).", LABELS, registry=r)
        self.output_tokens = Counter("specserve_output_tokens", "Committed output tokens.", LABELS, registry=r)
        self.passes_per_token = Histogram(
            "specserve_target_passes_per_token", "Target passes per output token, per request.", LABELS,
            buckets=(0.1, 0.15, 0.2, 0.25, 0.33, 0.5, 0.67, 0.8, 1.0), registry=r)

    def _latency_metrics(self, r: CollectorRegistry) -> None:
        """Where a request's and a round's time goes."""
        self.tpot = Histogram("specserve_tpot_seconds", "Time per output token after the first, per request.",
                              LABELS, buckets=_MS, registry=r)
        self.ttft = Histogram("specserve_ttft_seconds", "Time to the first committed token.", LABELS,
                              buckets=_MS, registry=r)
        self.draft_latency = Histogram("specserve_draft_latency_seconds",
                                       "Wait for a round's draft block, from asking to its arrival.",
                                       LABELS, buckets=_MS, registry=r)
        self.verify_latency = Histogram("specserve_verify_latency_seconds",
                                        "The engine step (forward + rejection sampling) a round ran in.",
                                        LABELS, buckets=_MS, registry=r)
        self.round_overhead = Histogram(
            "specserve_round_overhead_seconds",
            "The engine's own Python per step (schedule + settle), beside the forward.",
            LABELS, buckets=_MS, registry=r)

    def _engine_metrics(self, r: CollectorRegistry) -> None:
        """The engine's waste and fallbacks, the sessions it drives, its K choice, finished requests."""
        self.rollback_tokens = Counter("specserve_rollback_tokens", "Rejected draft positions rolled back.",
                                       LABELS, registry=r)
        self.rejected_kv_bytes = Counter("specserve_rejected_kv_bytes", "Target KV bytes computed for rejected drafts.",
                                         LABELS, registry=r)
        self.fallbacks = Counter("specserve_fallbacks", "Rounds run without a draft, by reason.", (*LABELS, "reason"),
                                 registry=r)
        self.sessions_active = Gauge("specserve_sessions_active", "Sessions this target's engine is driving.", LABELS,
                                     registry=r)
        # the engine's K choice (ADR 0014, kchoice.py): its estimated S(K) = E[emitted] x plain
        # step / round cost, per (class, pool) at the current load; k="0" is plain (1.0)
        self.arm_estimate = Gauge("specserve_engine_arm_estimate",
                                  "The engine's estimated speedup over plain of each K, at the current load.",
                                  (*LABELS, "k"), registry=r)
        self.requests = Counter("specserve_requests", "Finished requests by finish reason.", (*LABELS, "finish_reason"),
                                registry=r)

    def _tree_and_shadow_metrics(self, r: CollectorRegistry) -> None:
        """Token trees and feature-level drafters (ADR 0020), drafting ahead, and shadow twins."""
        self.tree_size = Histogram(
            "specserve_tree_size", "Draft tokens of a round's token tree (0: a chain).", LABELS,
            buckets=(0, 2, 4, 6, 8, 12, 16, 24, 32), registry=r)
        self.feature_bytes = Counter(
            "specserve_feature_bytes", "Bytes of target features handed to a feature-level draft pool (eagle).",
            LABELS, registry=r)
        # alerting signal (deploy/prometheus): drafting-ahead hits
        self.predraft_rounds = Counter(
            "specserve_predraft_rounds", "Speculative rounds whose block was drafted ahead (source: pushed|cached).",
            (*LABELS, "source"), registry=r)
        self.shadow_active = Gauge("specserve_shadow_sessions_active", "Shadow twins this target's engine is driving.",
                                   LABELS, registry=r)
        self.shadow_requests = Counter(
            "specserve_shadow_requests",
            "Finished shadow runs by outcome (agree|disagree at temperature 0, sampled, failed).",
            (*LABELS, "outcome"), registry=r)
        self.shadow_speedup = Histogram("specserve_shadow_would_be_speedup",
                                        "Plain wall time / speculative wall time of shadowed requests.", LABELS,
                                        buckets=(0.25, 0.5, 0.75, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 3.0, 4.0),
                                        registry=r)



class WorkerMetrics:
    """Draft and target workers: call latency, cached sessions, rolled-back positions."""

    def __init__(self, service: str, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry or CollectorRegistry()
        self.call_latency = Histogram(f"specserve_{service}_call_seconds", f"{service} worker compute per call.",
                                      ("method",), buckets=_MS, registry=r)
        self.sessions = Gauge(f"specserve_{service}_sessions", f"Sessions cached by the {service} worker.",
                              registry=r)
        self.dropped_on_reconcile = Counter(
            f"specserve_{service}_reconcile_dropped_tokens",
            f"Provisional KV positions the {service} worker dropped to reconcile a session to its committed "
            "prefix (the target's rejected drafts are specserve_rollback_tokens).", registry=r)
        # the target's engine thread, its CPU a step: in the model's step and in its own bookkeeping
        # (ADR 0028: the host's share beside the forward)
        self.step_cpu = Counter(f"specserve_{service}_step_cpu_seconds",
                                "CPU time of the engine thread's steps: part forward (the model's step: on a CPU "
                                "the forward itself, on a device its preparation and launch) or engine (schedule, "
                                "settle, hand-over).", ("part",), registry=r)
        # continuous batching (ADR 0013)
        self.batch_size = Histogram(f"specserve_{service}_batch_size", "Work items per batch the model ran.",
                                    buckets=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64), registry=r)
        self.queue_depth = Gauge(f"specserve_{service}_queue_depth", "Work items waiting for the model.",
                                 registry=r)
        self.kv_slots = Gauge(f"specserve_{service}_kv_slots", "KV slots of the batched runner, used or free.",
                              ("state",), registry=r)
        self.refused = Counter(f"specserve_{service}_refused_sessions",
                               "New sessions answered RESOURCE_EXHAUSTED: no KV room.", registry=r)
        self.predrafts = Counter(f"specserve_{service}_predrafts", "Blocks drafted ahead while the target verified.",
                                 registry=r)
        # draft capacity (ADR 0021): sessions a saturated replica refused at their open, or shed
        # later, to plain decoding
        self.shed = Counter(f"specserve_{service}_shed_sessions",
                            "Sessions a saturated worker sent to plain decoding: refused at their open (admission) "
                            "or shed while running (saturated), those its drafts helped least first.",
                            ("reason",), registry=r)
        for reason in ("admission", "saturated"):
            self.shed.labels(reason)
        # the device step (ADR 0019): how its short-row steps ran
        self.device_steps = Counter(
            f"specserve_{service}_device_steps",
            "Decode, verify and draft steps of the device step, by how they ran: replayed (a CUDA graph), eager "
            "(its fixed shapes without a graph), unbucketed (more rows than the largest bucket: the eager forward).",
            ("how",), registry=r)
        self.cuda_graphs = Gauge(f"specserve_{service}_cuda_graphs", "CUDA graphs the device step has captured.",
                                 registry=r)
        for how in ("replayed", "eager", "unbucketed"):  # exported at 0 where no device step runs (the CPU)
            self.device_steps.labels(how)
        self._device_seen: dict[str, int] = {}
        # how busy the device is (ADR 0021): the worker adds each step's or batch's compute time
        self.busy = BusyMeter()
        r.register(DeviceCollector(service, self.busy))

    def device_step(self, step) -> None:
        """Count what a model step's device step (`models/device_step.py`, or None) ran since
        the last call."""
        if step is None:
            return
        counts = step.counts
        for how in ("replayed", "eager", "unbucketed"):
            now = getattr(counts, how)
            if now > self._device_seen.get(how, 0):
                self.device_steps.labels(how).inc(now - self._device_seen.get(how, 0))
            self._device_seen[how] = now
        self.cuda_graphs.set(len(step.graphs))


class SuffixCollector(Collector):
    """The suffix pool's class indexes (ADR 0026), read at each scrape from the pool's
    `snapshot()` (class -> its figures: outputs, tokens, nbytes, oldest, added by origin,
    proposals by source), so the engine's thread only counts. The hit rate is
    `specserve_suffix_proposals_total{source="index"}` over all its sources."""

    def __init__(self, snapshot: Callable[[], Mapping[str, Any]], clock: Callable[[], float] = time.time) -> None:
        self.snapshot, self.clock = snapshot, clock

    def describe(self) -> Iterator[Metric]:
        return iter(())  # (the families come with collect: their classes are known at a scrape)

    def collect(self) -> Iterator[Metric]:
        now, stats = self.clock(), self.snapshot()
        gauges = {
            "outputs": GaugeMetricFamily("specserve_suffix_index_outputs", "Committed outputs in the class's suffix "
                                         "index on this target (ADR 0026).", labels=["workload_class"]),
            "tokens": GaugeMetricFamily("specserve_suffix_index_tokens", "Tokens in the class's suffix index.",
                                        labels=["workload_class"]),
            "nbytes": GaugeMetricFamily("specserve_suffix_index_bytes", "Memory the class's suffix index holds "
                                        "(its buffers and sorted keys).", labels=["workload_class"]),
            "age": GaugeMetricFamily("specserve_suffix_index_age_seconds", "Since the oldest output in the class's "
                                     "suffix index was added: how far back it remembers.", labels=["workload_class"]),
        }
        added = CounterMetricFamily("specserve_suffix_index_added", "Outputs added to the class's suffix index, by "
                                    "origin: served here (local) or by another target (fleet, through Redis).",
                                    labels=["workload_class", "origin"])
        proposals = CounterMetricFamily("specserve_suffix_proposals", "Blocks the suffix pool drafted, by where they "
                                        "came from: the class's index, the session's own sequence, or none (no "
                                        "match); index over all is the index's hit rate.",
                                        labels=["workload_class", "source"])
        for cls, s in sorted(stats.items()):
            gauges["outputs"].add_metric([cls], s.outputs)
            gauges["tokens"].add_metric([cls], s.tokens)
            gauges["nbytes"].add_metric([cls], s.nbytes)
            gauges["age"].add_metric([cls], max(now - s.oldest, 0.0) if s.oldest else 0.0)
            for origin, n in s.added.items():
                added.add_metric([cls, origin], n)
            for source, n in s.proposals.items():
                proposals.add_metric([cls, source], n)
        yield from (*gauges.values(), added, proposals)
