"""A target's LoRA adapters (ADR 0029): loaded at start (`SPECSERVE_TARGET_ADAPTERS` and the
fleet's registry in Redis), loaded and unloaded at run time (the Target RPCs the routers'
AdapterAdmin calls), listed in the target's registry entry so that routers place an adapter's
sessions on the targets that have it.

A load reads, checks and stacks the adapter on a thread of its own (the engine's thread keeps
stepping), then copies it into a free slot on the engine's thread between two steps
(`engine.loop.on_loop`). A bad adapter raises `InvalidAdapter` with its reason and changes nothing.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from specserve.control.policy import ADAPTER_NAME
from specserve.engine.loop import EngineLoop, on_loop
from specserve.errors import InvalidRequest
from specserve.state.adapters import AdapterRegistry

log = logging.getLogger("specserve.target.adapters")


class TargetAdapters:
    def __init__(self, engine: EngineLoop, name: str) -> None:
        self.engine = engine
        self.target = name
        self.lora: Any = getattr(engine.model, "adapters", None)  # models/lora_set.py: LoraSet, or None
        # what a change is announced by: the target's registry entry written again (the actor's heartbeat)
        self.on_change: Callable[[], Awaitable[None]] | None = None

    def names(self) -> list[str]:
        return sorted(self.lora.names) if self.lora is not None else []

    async def load(self, name: str, path: str) -> dict[str, Any]:
        """Read, check and install an adapter; its info (InvalidAdapter, ResourceExhausted)."""
        from specserve.models.lora import read_adapter

        if not ADAPTER_NAME.match(name):
            raise InvalidRequest(f"invalid adapter name {name!r}: lower-case letters, digits, '.', '_' or '-' (at "
                                 "most 64), starting with a letter or digit")
        if self.lora is None:
            raise InvalidRequest("this target serves no LoRA adapters (max_loras 0, tensor parallelism, or the "
                                 "per-session path)")
        if name in self.lora.names:
            raise InvalidRequest(f"adapter {name!r} is already loaded here: unload it first")
        adapter = await asyncio.to_thread(read_adapter, path, name)
        prepared = await asyncio.to_thread(self.lora.prepare, adapter)
        slot = await asyncio.wrap_future(on_loop(self.engine, lambda: self.lora.install(prepared)))
        log.info("adapter %s loaded from %s (rank %d, slot %d)", name, path, adapter.rank, slot)
        await self._changed()
        return self.info(name)

    async def unload(self, name: str) -> bool:
        """Unload `name` (AdapterNotFound); False while sessions still run on it."""
        if self.lora is None:
            from specserve.errors import AdapterNotFound

            raise AdapterNotFound(f"no adapter {name!r}: this target serves no LoRA adapters")
        freed: bool = await asyncio.wrap_future(on_loop(self.engine, lambda: self.lora.unload(name)))
        log.info("adapter %s unloaded%s", name, "" if freed else " (its slot is freed when its sessions end)")
        await self._changed()
        return freed

    async def _changed(self) -> None:
        if self.on_change is not None:
            try:
                await self.on_change()
            except Exception:  # noqa: BLE001 (Redis away: the next heartbeat says it)
                log.warning("could not announce the adapters' change", exc_info=True)

    def info(self, name: str) -> dict[str, Any]:
        slot = self.lora.names[name]
        s = self.lora.slots[slot]
        return {"name": name, "path": s.path, "rank": s.rank, "sessions": s.users, "target": self.target}

    def listing(self) -> dict[str, Any]:
        if self.lora is None:
            return {"adapters": [], "max_loras": 0, "max_lora_rank": 0}
        return {"adapters": [self.info(n) for n in self.names()], "max_loras": self.lora.max_loras,
                "max_lora_rank": self.lora.max_rank}

    async def load_at_start(self, configured: dict[str, str], redis: Any, prefix: str) -> None:
        """The configured adapters (a failure stops the start: the operator asked for them), then
        the fleet's registry (a failure is logged: the router that registered it saw it load)."""
        for name, path in configured.items():
            await self.load(name, path)
        if self.lora is None:
            return
        try:
            registered = await AdapterRegistry(redis, prefix).all()
        except Exception:  # noqa: BLE001 (Redis away at start: an operator loads them again)
            log.warning("could not read the fleet's adapters from Redis", exc_info=True)
            return
        for name, path in registered.items():
            if name in self.lora.names:
                continue
            try:
                await self.load(name, path)
            except Exception as exc:  # noqa: BLE001
                log.error("registered adapter %s (%s) did not load here: %s", name, path, exc)
