"""How busy a worker's device is (ADR 0021), torch-free.

`BusyMeter` keeps the spans a worker's device computed (the engine's steps on the target, the
batches on a draft worker: timings they already take) and gives their share of the last
`window_s` of wall time. `DeviceCollector` exports it as `specserve_device_busy_ratio{service}`
and, where NVML answers (`nvidia-ml-py` on a GPU node), the device's own utilisation and
memory per GPU. Without NVML those series are absent, not zero: a dashboard shows no data
rather than an idle GPU that is not there.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

WINDOW_S = 10.0  # the share is over this much recent wall time (a scrape every 15 s sees most of it)


class BusyMeter:
    def __init__(self, window_s: float = WINDOW_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s
        self.clock = clock
        self.started = clock()
        self.spans: deque[tuple[float, float]] = deque()  # (start, end) of each computed span, in order
        self.lock = threading.Lock()  # spans come from the model thread, reads from the scrape's

    def add(self, seconds: float, end: float | None = None) -> None:
        """The device computed for `seconds`, ending now (or at `end`)."""
        end = self.clock() if end is None else end
        with self.lock:
            self.spans.append((end - max(seconds, 0.0), end))

    def ratio(self, now: float | None = None) -> float:
        """The computed share of the last `window_s` (of the time since start, if shorter)."""
        now = self.clock() if now is None else now
        lo = max(now - self.window_s, self.started)
        with self.lock:
            while self.spans and self.spans[0][1] <= lo:
                self.spans.popleft()
            busy = sum(min(e, now) - max(s, lo) for s, e in self.spans if e > lo and s < now)
        wall = now - lo
        return min(max(busy / wall, 0.0), 1.0) if wall > 0 else 0.0


class DeviceCollector(Collector):
    """`specserve_device_busy_ratio{service}` from a BusyMeter; with NVML, per GPU:
    `specserve_device_utilization_ratio{service,gpu}` (the driver's share of the last sample
    period a kernel ran) and `specserve_device_memory_bytes{service,gpu,state="used"|"total"}`."""

    def __init__(self, service: str, meter: BusyMeter, nvml: Any = None) -> None:
        self.service, self.meter = service, meter
        self.nvml = nvml if nvml is not None else _nvml()

    def describe(self) -> Iterator[GaugeMetricFamily]:
        return iter([self._busy(0.0)])  # (registered without a scrape: the NVML families come with collect)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        yield self._busy(self.meter.ratio())
        if self.nvml is None:
            return
        try:
            util = GaugeMetricFamily("specserve_device_utilization_ratio",
                                     "The device's own utilisation (NVML: share of the last sample period a kernel "
                                     "ran), per GPU.", labels=["service", "gpu"])
            mem = GaugeMetricFamily("specserve_device_memory_bytes", "The device's memory (NVML), used and total.",
                                    labels=["service", "gpu", "state"])
            for i in range(self.nvml.nvmlDeviceGetCount()):
                h = self.nvml.nvmlDeviceGetHandleByIndex(i)
                util.add_metric([self.service, str(i)], self.nvml.nvmlDeviceGetUtilizationRates(h).gpu / 100.0)
                info = self.nvml.nvmlDeviceGetMemoryInfo(h)
                mem.add_metric([self.service, str(i), "used"], float(info.used))
                mem.add_metric([self.service, str(i), "total"], float(info.total))
        except Exception:  # noqa: BLE001 (a driver that stopped answering: the series go absent, the scrape goes on)
            return
        yield util
        yield mem

    def _busy(self, value: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily("specserve_device_busy_ratio",
                              "Share of the last 10 s of wall time the worker's device computed (the engine's "
                              "steps on the target, the batches on a draft worker).", labels=["service"])
        g.add_metric([self.service], value)
        return g


def _nvml() -> Any:
    """NVML where the package and a driver are there; None otherwise (a CPU node)."""
    try:
        import pynvml  # nvidia-ml-py
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 (no driver, no GPU: NVMLError's subclasses)
        return None
    return pynvml
