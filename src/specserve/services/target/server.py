"""Target servicer: the gRPC face of the engine beside the target (ADR 0014). `Start` hands a
session (created in Redis by a router) to this worker's engine, which drives its rounds and
commits them; `Stop` ends one now. Drafts reach the engine over `Draft.Link`, not through
this service."""

from __future__ import annotations

from specserve.errors import Unavailable
from specserve.v1 import target_pb2, target_pb2_grpc


def adapter_info(d: dict) -> target_pb2.AdapterInfo:
    return target_pb2.AdapterInfo(name=d["name"], path=d["path"], rank=d["rank"], sessions=d["sessions"],
                                  target=d["target"])


class TargetServicer(target_pb2_grpc.TargetServicer):
    def __init__(self, host=None) -> None:
        self.host = host  # specserve.services.target.loop_host.LoopHost, set once the engine is up

    async def Start(self, request: target_pb2.StartRequest, context) -> target_pb2.StartResponse:
        if self.host is None:
            raise Unavailable("this target's engine is not up yet")
        epoch, committed = await self.host.start(request.session_id)
        return target_pb2.StartResponse(epoch=epoch, committed=committed)

    async def Stop(self, request: target_pb2.StopRequest, context) -> target_pb2.StopResponse:
        return target_pb2.StopResponse(stopped=self.host is not None and self.host.stop(request.session_id))

    # LoRA adapters (ADR 0029; services/target/adapters.py)
    def _adapters(self):
        if self.host is None:
            raise Unavailable("this target's engine is not up yet")
        return self.host.adapters

    async def LoadAdapter(self, request: target_pb2.LoadAdapterRequest, context) -> target_pb2.AdapterInfo:
        return adapter_info(await self._adapters().load(request.name, request.path))

    async def UnloadAdapter(self, request: target_pb2.UnloadAdapterRequest, context):
        return target_pb2.UnloadAdapterResponse(freed=await self._adapters().unload(request.name))

    async def ListAdapters(self, request: target_pb2.ListAdaptersRequest, context):
        listing = self._adapters().listing()
        return target_pb2.ListAdaptersResponse(adapters=[adapter_info(a) for a in listing["adapters"]],
                                               max_loras=listing["max_loras"], max_lora_rank=listing["max_lora_rank"])
