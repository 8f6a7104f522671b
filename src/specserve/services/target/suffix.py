"""The target's side of the suffix pool (ADR 0026): the pool's source on the engine's thread,
and on the event loop its link to the fleet through Redis. At start the target reads every
class's stream (what the fleet served, before this incarnation) into its indexes, then
follows the streams; each output it serves goes to its class's stream. The indexes' figures
are Prometheus metrics (serving/metrics.py SuffixCollector)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from specserve.drafters.suffix import SuffixSettings
from specserve.engine.suffix_pool import SuffixDrafts, conf_of
from specserve.serving.metrics import SuffixCollector
from specserve.state.connection import REDIS_DOWN
from specserve.state.suffix_share import SharedOutput, SuffixShare

log = logging.getLogger("specserve.target")


class SuffixFleet:
    """A `local:suffix` pool's source, fed by the fleet and feeding it."""

    def __init__(self, vocab_size: int, redis: Any, prefix: str, loop: asyncio.AbstractEventLoop,
                 ttl_s: int = 7 * 86400) -> None:
        self.loop = loop
        self.share = SuffixShare(redis, prefix, origin="", ttl_s=ttl_s)  # origin: the incarnation, at start
        self.source = SuffixDrafts(vocab_size, share=self._publish)
        self.loaded = asyncio.Event()  # the fleet's outputs as they stood at start are in the queue
        self._tasks: set[asyncio.Task] = set()

    def register(self, registry: Any) -> None:
        registry.register(SuffixCollector(self.source.snapshot))

    def _publish(self, cls: str, tokens: list[int], settings: SuffixSettings) -> None:
        """(the engine's thread) an output this target served, to the class's stream."""
        def post() -> None:
            task = self.loop.create_task(self.share.publish(cls, tokens, settings.max_requests, conf_of(settings)))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

        try:
            self.loop.call_soon_threadsafe(post)
        except RuntimeError:  # the event loop is closed (the worker is stopping): not shared, nothing more
            self.share.lost += 1

    def _deliver(self, out: SharedOutput) -> None:
        settings = SuffixSettings(**out.conf) if out.conf else None
        self.source.receive(out.workload_class, out.tokens, out.at, settings)

    async def start(self, origin: str) -> None:
        """The fleet's outputs so far into the indexes, then follow the streams (a task)."""
        self.share.origin = origin
        try:
            for out in await self.share.load():
                self._deliver(out)
        except REDIS_DOWN:
            log.warning("the suffix indexes start empty: Redis is down (the streams are followed once it is back)")
        except Exception:  # noqa: BLE001 - a bad entry or a setting never keeps the target from serving
            log.exception("loading the suffix indexes")
        self.loaded.set()
        task = self.loop.create_task(self.share.follow(self._deliver))
        self._tasks.add(task)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
