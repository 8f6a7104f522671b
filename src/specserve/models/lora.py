"""LoRA adapters in PEFT's format, read without PEFT (ADR 0029): `adapter_config.json` and
`adapter_model.safetensors` (or `adapter_model.bin` refused: a pickle), checked against the
base model they are loaded on, and laid out for the runner's projections.

An adapter adds (alpha / r) B A x to a projection W x. The runner fuses q/k/v into one
projection and gate/up into another (models/runner.py: `Layer`), so an adapter's parts of a
fused projection sit side by side: A is their A's stacked ([parts * R, in], each part's rank
padded to R, the adapter's largest, with zero rows), B is block-diagonal ([out, parts * R]),
with the scaling folded into B. A part the adapter leaves alone is zeros. `models/lora_set.py`
holds the loaded adapters' slots and the products.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from specserve.errors import InvalidRequest

# the runner's fused projections and the HF modules that make them, in their stacking order
PROJECTIONS: dict[str, tuple[str, ...]] = {
    "qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "o": ("self_attn.o_proj",),
    "gate_up": ("mlp.gate_proj", "mlp.up_proj"),
    "down": ("mlp.down_proj",),
}
MODULE_NAMES = {m.split(".")[-1]: (proj, i) for proj, mods in PROJECTIONS.items() for i, m in enumerate(mods)}
CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
FINGERPRINT_KEY = "specserve.base_sha256"


class InvalidAdapter(InvalidRequest):
    """An adapter that cannot be loaded on this model (gRPC INVALID_ARGUMENT): not PEFT's LoRA
    format, a corrupt file, another base, shapes or a rank that do not fit."""


def base_fingerprint(model_dir: str | Path) -> str:
    """A cheap identity of a model's weights: sha256 over each safetensors file's size, its first
    and its last MiB (16 hex digits). Adapters built here carry their base's in their file's
    metadata; a target whose fingerprint differs refuses them."""
    h = hashlib.sha256()
    files = sorted(Path(model_dir).glob("*.safetensors"))
    for f in files:
        size = f.stat().st_size
        h.update(f"{f.name}:{size}".encode())
        with f.open("rb") as fh:
            h.update(fh.read(1 << 20))
            fh.seek(max(size - (1 << 20), 0))
            h.update(fh.read(1 << 20))
    return h.hexdigest()[:16] if files else ""


@dataclass(frozen=True)
class Shapes:
    """What a base model's projections look like: layers, and per HF module (out, in)."""

    layers: int
    modules: dict[str, tuple[int, int]]

    @classmethod
    def of(cls, config: Any) -> Shapes:
        h = int(config.hidden_size)
        d = int(getattr(config, "head_dim", None) or h // config.num_attention_heads)
        q, kv, i = config.num_attention_heads * d, config.num_key_value_heads * d, int(config.intermediate_size)
        return cls(int(config.num_hidden_layers), {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h),
                                                   "o_proj": (h, q), "gate_proj": (i, h), "up_proj": (i, h),
                                                   "down_proj": (h, i)})

    def out_features(self, proj: str) -> list[int]:
        return [self.modules[m.split(".")[-1]][0] for m in PROJECTIONS[proj]]

    def in_features(self, proj: str) -> int:
        return self.modules[PROJECTIONS[proj][0].split(".")[-1]][1]


@dataclass
class Adapter:
    """One adapter as read: per (layer, HF module name) its A [r, in] and its B [out, r] with the
    scaling folded in, float32 on the host."""

    name: str
    path: str
    rank: int  # the largest rank of its modules
    base: str  # its config's base_model_name_or_path
    base_fingerprint: str  # from its weights' metadata ("" when it has none)
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @property
    def modules(self) -> list[str]:
        return sorted({m for _, m in self.weights})

    def nbytes(self) -> int:
        return sum(a.numel() + b.numel() for a, b in self.weights.values()) * 4


def _config(path: Path) -> dict[str, Any]:
    try:
        cfg = json.loads((path / CONFIG).read_text())
    except FileNotFoundError:
        raise InvalidAdapter(f"{path}: no {CONFIG} (a PEFT LoRA adapter directory has {CONFIG} and {WEIGHTS})") \
            from None
    except (OSError, ValueError) as exc:
        raise InvalidAdapter(f"{path / CONFIG}: not readable JSON ({exc})") from None
    if not isinstance(cfg, dict):
        raise InvalidAdapter(f"{path / CONFIG}: not a JSON object")
    kind = str(cfg.get("peft_type", "LORA")).upper()
    refused = [(kind != "LORA", f"peft_type {kind} (only LORA)"),
               (cfg.get("bias", "none") != "none", f"bias {cfg.get('bias')!r} (only 'none')"),
               (bool(cfg.get("use_dora")), "DoRA (use_dora)"),
               (bool(cfg.get("modules_to_save")), f"modules_to_save {cfg.get('modules_to_save')}"),
               (bool(cfg.get("fan_in_fan_out")), "fan_in_fan_out (Conv1D layers)")]
    for bad, what in refused:
        if bad:
            raise InvalidAdapter(f"{path}: {what} is not supported")
    return cfg


def _scaling(cfg: Mapping[str, Any], module: str, rank: int) -> float:
    """PEFT's scaling for one module: alpha / r (alpha / sqrt(r) with rsLoRA), with its patterns."""
    def pattern(key: str, default: Any) -> Any:
        for k, v in (cfg.get(key) or {}).items():
            if module == k or module.endswith("." + k) or module.split(".")[-1] == k:
                return v
        return default

    alpha = float(pattern("alpha_pattern", cfg.get("lora_alpha", 8)))
    return alpha / (math.sqrt(rank) if cfg.get("use_rslora") else rank)


def _tensors(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    from safetensors import SafetensorError, safe_open

    file = path / WEIGHTS
    if not file.exists():
        other = " (adapter_model.bin is a pickle: convert it to safetensors)" if (path / "adapter_model.bin").exists() \
            else ""
        raise InvalidAdapter(f"{path}: no {WEIGHTS}{other}")
    try:
        with safe_open(str(file), framework="pt") as f:
            meta = dict(f.metadata() or {})
            return {k: f.get_tensor(k) for k in f.keys()}, meta  # noqa: SIM118 (safe_open has no __iter__)
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise InvalidAdapter(f"{file}: not a readable safetensors file ({exc})") from None


def _module_of(key: str) -> tuple[int, str, str]:
    """(layer, module, "A" | "B") of a PEFT key such as
    base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight (an adapter name may sit
    before `.weight`, as `lora_A.default.weight`)."""
    parts = key.split(".")
    try:
        which = next(p for p in parts if p in ("lora_A", "lora_B"))
        li = parts.index("layers")
        layer = int(parts[li + 1])
        module = parts[parts.index(which) - 1]
    except (StopIteration, ValueError, IndexError):
        raise InvalidAdapter(f"tensor {key!r} is not a LoRA weight of a decoder layer's projection") from None
    if module not in MODULE_NAMES:
        raise InvalidAdapter(f"tensor {key!r}: module {module!r} is not one of {sorted(MODULE_NAMES)}")
    return layer, module, which[-1]


def read_adapter(path: str | Path, name: str) -> Adapter:
    """Read and check an adapter's files (a clear `InvalidAdapter` for anything else)."""
    p = Path(path)
    if not p.is_dir():
        raise InvalidAdapter(f"adapter {name!r}: {p} is not a directory")
    cfg = _config(p)
    tensors, meta = _tensors(p)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        layer, module, which = _module_of(key)
        if t.dim() != 2 or not t.is_floating_point():
            raise InvalidAdapter(f"tensor {key!r}: a 2-D float matrix expected, got {tuple(t.shape)} {t.dtype}")
        if not torch.isfinite(t).all():
            raise InvalidAdapter(f"tensor {key!r} holds NaN or infinite values")
        pairs.setdefault((layer, module), {})[which] = t.float()
    if not pairs:
        raise InvalidAdapter(f"{p / WEIGHTS}: no LoRA weights")
    adapter = Adapter(name=name, path=str(p), rank=0, base=str(cfg.get("base_model_name_or_path") or ""),
                      base_fingerprint=meta.get(FINGERPRINT_KEY, ""))
    for (layer, module), ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise InvalidAdapter(f"layer {layer} {module}: lora_A and lora_B must both be present")
        a, b = ab["A"], ab["B"]
        if a.shape[0] != b.shape[1]:
            raise InvalidAdapter(f"layer {layer} {module}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} "
                                 "disagree on the rank")
        r = a.shape[0]
        adapter.weights[(layer, module)] = (a.contiguous(), (b * _scaling(cfg, f"layers.{layer}.{module}", r))
                                            .contiguous())
        adapter.rank = max(adapter.rank, r)
    return adapter


def check_fits(adapter: Adapter, shapes: Shapes, max_rank: int, fingerprint: str = "") -> None:
    """Raise InvalidAdapter unless the adapter fits this base: its fingerprint (where both are
    known), every layer and module's shapes, and a rank within `max_rank`."""
    if adapter.base_fingerprint and fingerprint and adapter.base_fingerprint != fingerprint:
        raise InvalidAdapter(f"adapter {adapter.name!r} was trained for another base model "
                             f"({adapter.base or 'unnamed'}, weights fingerprint {adapter.base_fingerprint}; "
                             f"this model's is {fingerprint})")
    if adapter.rank > max_rank:
        raise InvalidAdapter(f"adapter {adapter.name!r} has rank {adapter.rank}, over this server's max LoRA rank "
                             f"{max_rank} (the setting *_MAX_LORA_RANK)")
    for (layer, module), (a, b) in adapter.weights.items():
        if layer >= shapes.layers:
            raise InvalidAdapter(f"adapter {adapter.name!r}: layer {layer}, but the base model has {shapes.layers} "
                                 "layers (another base model?)")
        out, inp = shapes.modules[module]
        if a.shape[1] != inp or b.shape[0] != out:
            raise InvalidAdapter(
                f"adapter {adapter.name!r}: layer {layer} {module} maps {a.shape[1]} -> {b.shape[0]}, the base "
                f"model's {inp} -> {out} (another base model?)")


def stacked(adapter: Adapter, layer: int, proj: str, shapes: Shapes, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One fused projection's A [parts * rank, in] and block-diagonal B [out, parts * rank] for an
    adapter (zeros where it leaves a part alone)."""
    mods = PROJECTIONS[proj]
    outs = shapes.out_features(proj)
    a_all = torch.zeros(len(mods) * rank, shapes.in_features(proj))
    b_all = torch.zeros(sum(outs), len(mods) * rank)
    row = 0
    for i, (mod, out) in enumerate(zip(mods, outs, strict=True)):
        ab = adapter.weights.get((layer, mod.split(".")[-1]))
        if ab is not None:
            a, b = ab
            r = a.shape[0]
            a_all[i * rank:i * rank + r] = a
            b_all[row:row + out, i * rank:i * rank + r] = b
        row += out
    return a_all, b_all


@torch.no_grad()
def merge_adapter(model: torch.nn.Module, path: str | Path, name: str = "merged") -> Adapter:
    """Add an adapter's B A into an HF Llama-family model's projections in place (a draft
    replica serving an adapter's own drafter, ADR 0029); checked as a load is. Returns it."""
    adapter = read_adapter(path, name)
    cfg: Any = getattr(model, "config", None)
    check_fits(adapter, Shapes.of(cfg), max(adapter.rank, 1),
               base_fingerprint(str(getattr(model, "name_or_path", "") or "")))
    layers: Any = model.model.layers  # type: ignore[union-attr]
    for (layer, module), (a, b) in adapter.weights.items():
        proj, _ = MODULE_NAMES[module]
        parent = layers[layer].self_attn if proj in ("qkv", "o") else layers[layer].mlp
        weight = getattr(parent, module).weight
        weight += (b @ a).to(weight.dtype)
    return adapter
