"""How busy a worker's device is (issue 42, ADR 0021): `specserve_device_busy_ratio` against
a simulated device whose busy share is known, on the draft worker's batches and the target's
engine steps, and the NVML series absent (not zero) where there is no NVML."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from specserve.serving.busy import BusyMeter, DeviceCollector
from specserve.serving.metrics import WorkerMetrics
from specserve.step import RowResult, StepResult
from specserve.worker.core import WorkerCore


def _scrape(registry) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(generate_latest(registry).decode()) for s in fam.samples}


def test_the_meter_is_the_computed_share_of_its_window():
    now = [100.0]
    m = BusyMeter(window_s=10.0, clock=lambda: now[0])
    now[0] = 104.0
    m.add(1.0)  # 103-104
    assert m.ratio() == pytest.approx(1.0 / 4.0)  # 4 s since start
    now[0] = 112.0
    m.add(2.0)  # 110-112
    assert m.ratio() == pytest.approx(3.0 / 10.0)  # window 102-112
    now[0] = 113.5
    assert m.ratio() == pytest.approx(2.5 / 10.0)  # window 103.5-113.5: half of the first span left
    now[0] = 125.0
    assert m.ratio() == 0.0 and not m.spans  # idle for a whole window; the old spans are dropped


class _Model:
    """A model step that computes nothing (the simulated device's time is the batch's)."""

    max_batch = 8
    slots = None

    def open(self, session_id):
        return session_id

    def close(self, handle):
        pass

    def step(self, step):
        return StepResult([RowResult(fed=1) for _ in step.rows])


def test_a_draft_workers_busy_ratio_is_its_simulated_devices_share():
    """Batches of 20 ms on the simulated device, one every 50 ms for 2 s: 40 % busy. The
    metric, scraped, is within 5 points of it."""
    metrics = WorkerMetrics("draft")
    period_s, device_s = 0.05, 0.02

    async def go() -> float:
        core = WorkerCore(_Model(), metrics, max_sessions=4, extra_s=lambda batch: device_s)
        seq = core.session("s")
        t0 = time.monotonic()
        metrics.busy.started = t0
        for i in range(40):
            t = time.monotonic()
            await core.run(seq, SimpleNamespace(kind=None), 1)
            calls.append(time.monotonic() - t)
            await asyncio.sleep(max(t0 + (i + 1) * period_s - time.monotonic(), 0.0))
        return time.monotonic() - t0

    calls: list[float] = []
    wall = asyncio.run(go())
    assert all(c >= device_s for c in calls)
    expected = sum(calls) / wall  # each call waited for its batch: the device's time, and a loaded machine's more
    got = _scrape(metrics.registry)[("specserve_device_busy_ratio", (("service", "draft"),))]
    assert got == pytest.approx(expected, abs=0.05), (got, expected)
    assert got >= 0.3  # at least the simulated device's 20 ms in every 50


def test_a_targets_busy_ratio_is_its_simulated_devices_share(micro_llama):
    """The engine's steps padded to 20 ms each (a simulated device), sessions of 10 steps with
    200 ms idle between them: the metric is the steps' share of the wall within 5 points."""
    from specserve.algorithm.stops import StopChecker
    from specserve.engine.loop import EngineLoop
    from specserve.engine.session import EnginePlan
    from specserve.models.verifier import TargetModel
    from specserve.params import GenerationParams
    from specserve.worker.model_step import Batching, make_target_step

    metrics = WorkerMetrics("target")
    model = make_target_step(TargetModel(micro_llama(2, 64, 0)), Batching(kv_budget_mb=4, max_sessions=4))
    steps: list[float] = []
    loop = EngineLoop(model, lambda p: StopChecker(frozenset(), p.stop, lambda ids: ""),
                      simulated_step_ms=lambda step, out: 20.0,
                      on_step=lambda r: (steps.append(r.forward_ms), metrics.busy.add(r.forward_ms / 1e3)))
    t0 = time.monotonic()
    metrics.busy.started = t0
    for i in range(4):
        loop.add(f"s{i}", [1, 2, 3, 4], EnginePlan(GenerationParams(max_tokens=10, num_draft_tokens=0, seed=1)))
        loop.run_until_idle()
        time.sleep(0.2)
    wall = time.monotonic() - t0
    assert len(steps) == 40 and all(ms >= 20.0 for ms in steps)
    # the device's share: each step is the real forward padded up to 20 ms, longer where a
    # loaded machine made the forward itself slower (what the device would then have computed)
    expected = sum(steps) / 1e3 / wall
    got = _scrape(metrics.registry)[("specserve_device_busy_ratio", (("service", "target"),))]
    assert got == pytest.approx(expected, abs=0.05), (got, expected)


def test_without_nvml_its_series_are_absent_not_zero():
    metrics = WorkerMetrics("target")
    names = {name for name, _ in _scrape(metrics.registry)}
    assert "specserve_device_busy_ratio" in names
    assert not any(n.startswith(("specserve_device_utilization", "specserve_device_memory")) for n in names)


def test_with_nvml_each_gpu_reports_its_utilisation_and_memory():
    """NVML's answers as the collector reads them (a stand-in for the driver: no GPU here)."""
    handles = {0: (37, 10 * 2**30, 80 * 2**30), 1: (90, 70 * 2**30, 80 * 2**30)}
    nvml = SimpleNamespace(
        nvmlDeviceGetCount=lambda: 2, nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetUtilizationRates=lambda h: SimpleNamespace(gpu=handles[h][0]),
        nvmlDeviceGetMemoryInfo=lambda h: SimpleNamespace(used=handles[h][1], total=handles[h][2]))
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    registry.register(DeviceCollector("draft", BusyMeter(), nvml=nvml))
    got = _scrape(registry)
    assert got[("specserve_device_utilization_ratio", (("gpu", "1"), ("service", "draft")))] == 0.9
    assert got[("specserve_device_memory_bytes", (("gpu", "0"), ("service", "draft"), ("state", "used")))] == 10 * 2**30
    # a driver that stops answering: those series go absent, the busy ratio stays
    nvml.nvmlDeviceGetCount = lambda: (_ for _ in ()).throw(RuntimeError("NVML gone"))
    names = {n for n, _ in _scrape(registry)}
    assert names == {"specserve_device_busy_ratio"}
