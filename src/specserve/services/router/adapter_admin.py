"""`specserve.v1.AdapterAdmin` (ADR 0029): LoRA adapters on every live target, behind the
admin token (as PolicyAdmin).

A load goes to every target at once. Where one refuses it (a wrong base, wrong shapes, a corrupt
file: INVALID_ARGUMENT; no free slot: RESOURCE_EXHAUSTED), the targets that took it unload it
again and the call fails with that target's reason, so the fleet never serves an adapter on
part of it by accident. A load that every target took is recorded in Redis (`AdapterRegistry`),
so that a target started or restarted later loads it at its start. The targets serve on
throughout: a load is checked off their engine's thread and swapped in between two steps.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import grpc

from specserve.control.policy import ADAPTER_NAME
from specserve.errors import AdapterNotFound, InvalidRequest, ResourceExhausted, Unavailable
from specserve.services.router.admin import authorize
from specserve.services.router.targets import Target, TargetDirectory
from specserve.state.adapters import AdapterRegistry
from specserve.v1 import adapter_pb2, adapter_pb2_grpc, target_pb2

log = logging.getLogger("specserve.router.adapters")
CALL_TIMEOUT_S = 120.0  # a target reads, checks and stacks the adapter (a large one: seconds)


def _refusal(t: Target, err: grpc.aio.AioRpcError) -> Exception:
    msg = f"target {t.name}: {err.details()}"
    code = err.code()
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return InvalidRequest(msg)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return ResourceExhausted(msg)
    if code == grpc.StatusCode.NOT_FOUND:
        return AdapterNotFound(msg)
    return Unavailable(f"{msg} ({code.name})")


class AdapterAdminServicer(adapter_pb2_grpc.AdapterAdminServicer):
    def __init__(self, targets: TargetDirectory, registry: AdapterRegistry, tokens: dict[str, str]) -> None:
        self.targets = targets
        self.registry = registry
        self.tokens = {name: tok for name, tok in tokens.items() if tok}

    async def _live(self) -> list[Target]:
        live = await self.targets.refresh()
        if not live:
            raise Unavailable("no target worker is registered; retry later")
        return live

    async def _each(self, targets: list[Target], call) -> list[tuple[Target, object]]:
        """`call(stub)` on every target at once: (target, its answer or its error)."""
        async def one(t: Target):
            try:
                return t, await call(self.targets.stubs[t.address])
            except grpc.aio.AioRpcError as err:
                return t, err

        return list(await asyncio.gather(*(one(t) for t in targets)))

    async def LoadAdapter(self, request: target_pb2.LoadAdapterRequest, context):
        who = await authorize(self.tokens, context, "AdapterAdmin", "adapter administration")
        if not ADAPTER_NAME.match(request.name):
            raise InvalidRequest(f"invalid adapter name {request.name!r}: lower-case letters, digits, '.', '_' or "
                                 "'-' (at most 64), starting with a letter or digit")
        if not request.path:
            raise InvalidRequest("LoadAdapter needs the adapter's path (a directory the targets can read)")
        live = await self._live()
        answers = await self._each(live, lambda stub: stub.LoadAdapter(request, timeout=CALL_TIMEOUT_S))
        failed = [(t, a) for t, a in answers if isinstance(a, grpc.aio.AioRpcError)]
        if failed:
            took = [t for t, a in answers if not isinstance(a, grpc.aio.AioRpcError)]
            undo = target_pb2.UnloadAdapterRequest(name=request.name)
            await self._each(took, lambda stub: stub.UnloadAdapter(undo, timeout=CALL_TIMEOUT_S))
            log.warning("adapter %s (%s) refused by %d of %d targets, unloaded from the rest: %s", request.name,
                        request.path, len(failed), len(live), failed[0][1].details())
            raise _refusal(*failed[0])
        await self.registry.add(request.name, request.path)
        log.info("adapter %s loaded from %s on %d targets by %s", request.name, request.path, len(live), who)
        return await self._fleet(live)

    async def UnloadAdapter(self, request: target_pb2.UnloadAdapterRequest, context):
        who = await authorize(self.tokens, context, "AdapterAdmin", "adapter administration")
        registered = await self.registry.remove(request.name)
        live = await self._live()
        answers = await self._each(live, lambda stub: stub.UnloadAdapter(request, timeout=CALL_TIMEOUT_S))
        held = [t for t, a in answers if not isinstance(a, grpc.aio.AioRpcError)]
        if not held and not registered:
            raise AdapterNotFound(f"no target has adapter {request.name!r} loaded")
        log.info("adapter %s unloaded from %d targets by %s", request.name, len(held), who)
        return await self._fleet(live)

    async def ListAdapters(self, request, context):
        await authorize(self.tokens, context, "AdapterAdmin", "adapter administration")
        return await self._fleet(await self._live())

    async def _fleet(self, live: list[Target]) -> adapter_pb2.FleetAdapters:
        out = adapter_pb2.FleetAdapters(registered=await self.registry.all())
        for _, a in await self._each(live, lambda stub: stub.ListAdapters(target_pb2.ListAdaptersRequest(),
                                                                          timeout=CALL_TIMEOUT_S)):
            if not isinstance(a, grpc.aio.AioRpcError):
                out.adapters.extend(a.adapters)  # type: ignore[attr-defined]
        with contextlib.suppress(Exception):
            await self.targets.refresh()  # (the targets wrote their entries: placement sees the change now)
        return out
