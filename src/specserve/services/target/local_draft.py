"""The `local:draft` pool (ADR 0025): a draft model with the target's tokenizer and vocabulary,
drafting inside the target's process: where the target runs the device step (CUDA graphs, or
`fixed_step` in tests) inside the target's round (`BatchedTarget.enable_head(model)`, the
engine's `DeviceDraftModelDrafts`), chained on the device; elsewhere (the CPU default) on the
engine's thread (`LocalDrafts` over an `HFDrafter`).

The device step holds one drafter (`device_pool`): where a target has both a `local:eagle` and a
`local:draft` pool, the EAGLE head takes the device (issue 51 item 2: the GPU's default local
drafter where a head exists) and the draft model drafts on the engine's thread.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from specserve.config import LOCAL_DRAFT, LOCAL_EAGLE, TargetSettings


def local_draft_dir(s: TargetSettings) -> Path:
    """`local_draft_model`, or `draft/` beside the target's model directory."""
    return Path(s.local_draft_model) if s.local_draft_model else Path(s.model).parent / "draft"


def has_device_step(engine: Any) -> bool:
    """The target runs the device step (its rounds can hold a drafter, ADR 0025)."""
    runner = getattr(engine, "runner", None)
    return runner is not None and getattr(runner, "device_step", None) is not None and hasattr(engine, "enable_head")


def device_local(pools: dict[str, list[str]]) -> str | None:
    """The one pool whose drafter runs inside the device step's rounds where there is one: the
    first `local:eagle` pool, else the first `local:draft` pool."""
    for local in (LOCAL_EAGLE, LOCAL_DRAFT):
        for name, addrs in pools.items():
            if addrs == [local]:
                return name
    return None


def device_pool(pools: dict[str, list[str]], engine: Any) -> str | None:
    """`device_local`, where the target runs the device step; else None."""
    return device_local(pools) if has_device_step(engine) else None


def _kv_per_position(config: dict) -> int:
    """Keys and values a position, every layer (elements; the same dtype on both sides)."""
    heads = int(config.get("num_attention_heads", 1))
    head_dim = int(config.get("head_dim") or int(config.get("hidden_size", 0)) // max(heads, 1))
    return int(config.get("num_hidden_layers", 0)) * int(config.get("num_key_value_heads") or heads) * head_dim


def target_batching(s: TargetSettings, fixed_step: bool | None = None) -> Any:
    """The target's batching settings (`fixed_step`: forced, as tests do); where its `local:draft`
    pool will draft inside the device step's rounds, the KV budget holds the draft's KV beside
    the target's and the reserve the draft's weights (`Batching.drafter_kv_share`), so the draft
    takes no memory the budget gave the target's slots (on a GPU: no out-of-memory at start)."""
    import json
    from dataclasses import replace

    from safetensors import safe_open

    from specserve.worker.model_step import Batching, runs_device_step

    b = Batching.from_settings(s)
    b = b if fixed_step is None else replace(b, fixed_step=fixed_step)
    holder = device_local(s.draft_pools)
    directory = local_draft_dir(s)
    if holder is None or s.draft_pools[holder] != [LOCAL_DRAFT] or s.tensor_parallel > 1 or \
            not runs_device_step(b) or not (directory / "config.json").is_file():
        return b  # (a missing draft model is refused with its message when the pool is built)
    draft = json.loads((directory / "config.json").read_text())
    target = json.loads((Path(s.model) / "config.json").read_text())
    params = 0
    for f in directory.glob("*.safetensors"):
        with safe_open(str(f), "pt") as weights:
            for name in weights.keys():  # noqa: SIM118 - safe_open is no mapping
                n = 1
                for d in weights.get_slice(name).get_shape():
                    n *= d
                params += n
    return replace(b, drafter_kv_share=_kv_per_position(draft) / max(_kv_per_position(target), 1),
                   drafter_params=params)


def load_local_draft(s: TargetSettings, target_vocab: int) -> Any:
    """The draft model of `local_draft_dir`, refused (IncompatiblePair, a ValueError) unless it
    exists and shares the target's tokenizer (the same ids for the same strings, the same
    special tokens) and the target's output size."""
    from specserve.errors import IncompatiblePair
    from specserve.models.loading import check_pair, load_model, load_tokenizer

    directory = local_draft_dir(s)
    if not (directory / "config.json").is_file():
        raise ValueError(f"a local:draft pool needs a draft model: none at {directory} (local_draft_model; "
                         "empty = draft/ beside the target's model directory)")
    try:
        draft_tok = load_tokenizer(str(directory))
    except Exception as exc:  # noqa: BLE001 - no tokenizer files, or unreadable ones
        raise IncompatiblePair(f"the local:draft model at {directory} has no tokenizer to compare with the "
                               f"target's ({type(exc).__name__}: {exc}): it must share the target's tokenizer") from exc
    model = load_model(str(directory))
    out = int(model.get_output_embeddings().weight.shape[0])
    try:
        check_pair(load_tokenizer(s.model), draft_tok, target_vocab, out)
    except IncompatiblePair as exc:
        raise IncompatiblePair(f"the local:draft model at {directory} does not share the target's vocabulary: "
                               f"{exc}") from exc
    return model


def draft_local(s: TargetSettings, engine: Any, target: Any, on_device: bool) -> Any:
    """The `local:draft` pool's source: inside the device step's rounds where `on_device` (the
    pool holds the device, `device_pool`) and the target runs the device step on one rank; else
    drafting on the engine's thread, the model on the target's device and in its dtype (a
    tensor-parallel target's ranks hold no draft model: it drafts on rank 0's engine thread)."""
    from specserve.drafters.hf import HFDrafter
    from specserve.engine.device_drafts import DeviceDraftModelDrafts
    from specserve.engine.drafting import LocalDrafts
    from specserve.worker.model_step import Batching, place_hf_model

    model = load_local_draft(s, target.vocab_size)
    if on_device and s.tensor_parallel == 1 and has_device_step(engine):
        engine.enable_head(model)  # its K positions, the verify and the verdict in one run (ADR 0025)
        source: LocalDrafts = DeviceDraftModelDrafts(HFDrafter(model))  # (the host's: banned tokens, grammars)
    else:
        source = LocalDrafts(HFDrafter(model))
    place_hf_model(model, Batching.from_settings(s))
    return source
