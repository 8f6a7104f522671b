"""gpu_check's check of the `local:draft` pool as a target builds it (ADR 0025): the settings
(`draft_pools: {"draft-local": ["local:draft"]}`, the demo pair's `draft/` beside its target),
`target_batching` (the KV budget holding the draft's KV beside the target's: on CUDA, what
`gpu_memory_utilization` leaves) and the actor's `draft_sources` (the draft model inside the
round where the target runs the device step), then greedy sessions through the engine loop
against transformers' greedy on the same device and dtype (a token may differ only at a
near-tie). Reports where it drafted, the rounds chained, the slots and the memory it took.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch
from gpu_head import agreement, hf_greedy

from specserve.algorithm.stops import StopChecker
from specserve.config import LOCAL_DRAFT, TargetSettings
from specserve.engine.loop import EngineLoop
from specserve.engine.session import EnginePlan
from specserve.models.verifier import TargetModel
from specserve.params import GenerationParams
from specserve.services.target.actor import draft_sources
from specserve.services.target.local_draft import target_batching
from specserve.worker.model_step import make_target_step


def local_draft_identity(pair: Path, model, device: torch.device, dtype_setting: str, prompts: list[list[int]],
                         new_tokens: int, k: int, tolerance: float) -> dict:
    cuda = device.type == "cuda"
    s = TargetSettings(model=str(pair / "target"), draft_pools={"draft-local": [LOCAL_DRAFT]}, device=str(device),
                       dtype=dtype_setting, num_gpus=1 if cuda else 0, max_len=512, max_sessions=64, max_batch=4,
                       kv_budget_mb=64)
    b = target_batching(s, fixed_step=True)  # (as on CUDA with the graphs; forced for the CPU's smoke run)
    # (a short start-up capture, the rest on first use; on the CPU the lookahead forced as the graphs turn it on)
    b = replace(b, capture_budget_s=10.0, capture_k=k, lookahead=None if cuda else True)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    engine = make_target_step(TargetModel(model), b)
    sources, _ = draft_sources(s, engine, engine.target, None, None, None)
    stops = StopChecker(frozenset(), (), lambda ids: "")
    loop = EngineLoop(engine, lambda p: stops, sources)
    for i, ids in enumerate(prompts):
        loop.add(str(i), ids, EnginePlan(GenerationParams(max_tokens=new_tokens, num_draft_tokens=k, seed=1),
                                         pool="draft-local"))
    loop.run_until_idle()
    got = [loop.ended[str(i)].generated for i in range(len(prompts))]
    kv, heads = engine.runner.kv, getattr(engine, "heads", None)
    out = {**agreement(got, hf_greedy(model, device, prompts, new_tokens), tolerance),
           "source": type(sources["draft-local"]).__name__, "drafter_kv_share": b.drafter_kv_share,
           "slots": kv.num_slots, "target_kv_bytes": sum(2 * x.numel() * x.element_size() for x in kv.keys),
           "draft_kv_bytes": heads.device.kv_bytes if heads is not None else 0,
           "accepted": sum(r.accepted for i in range(len(prompts)) for r in loop.ended[str(i)].rounds),
           "rounds": dict(engine.rounds.counts) if getattr(engine, "rounds", None) is not None else {}}
    if cuda:
        free, total = torch.cuda.mem_get_info(device)
        out.update(peak_allocated_bytes=torch.cuda.max_memory_allocated(device), device_total_bytes=total)
    return out
