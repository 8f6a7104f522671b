"""Tensor-parallel shards of the batched runner (ADR 0030): which slice of each weight a rank
loads, read from the safetensors files slice by slice, and the collectives its forward calls.

Megatron's layout over N ranks (rank r):
- attention: query heads [r Hq/N, (r+1) Hq/N) and KV heads [r Hkv/N, (r+1) Hkv/N): the rows of
  q, k, v (and their biases) column-parallel; the rank's KV slots hold its KV heads only. The
  output projection is row-parallel: its columns of those query heads, its bias on rank 0 only
  (added once in the sum);
- MLP: gate and up column-parallel (rows [r I/N, (r+1) I/N)), down row-parallel (those columns);
- LM head: split by vocabulary, V padded up to a multiple of N with zero rows (their logits are
  cut off after the gather);
- the embedding, the norms, q/k norms and the RoPE tables: whole on every rank.

The runner's forward then runs unchanged on the rank's heads (`Weights.num_heads` is the
rank's), with `runner.tp` (`GroupCollectives`) summing the two row-parallel projections of
each layer and gathering the logits' vocabulary slices. A rank never holds another rank's
slice: `get_slice` reads only the rows or columns asked for.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from specserve.models.kv_slots import KVLayout, KVSlots
from specserve.models.runner import ARCHITECTURES, STATIC_ROPE, Collectives, Layer, ModelRunner, Weights, rope_tables

DEGREES = (1, 2, 4, 8)


def degree_problem(config: Any, size: int) -> str | None:
    """None where `size` ranks can split this model, else why not (a clear start-up error)."""
    if size not in DEGREES:
        return f"tensor_parallel must be one of {', '.join(map(str, DEGREES))}, got {size}"
    hq, hkv = int(config.num_attention_heads), int(config.num_key_value_heads)
    inter = int(config.intermediate_size)
    for what, n in (("attention heads", hq), ("KV heads", hkv), ("MLP width (intermediate_size)", inter)):
        if n % size:
            return f"tensor_parallel {size} does not divide the model's {n} {what}"
    return None


def config_problem(config: Any) -> str | None:
    """What `runner.unsupported_reason` checks, from the config alone (no model is built)."""
    arch = (getattr(config, "architectures", None) or ["?"])[0]
    if arch not in ARCHITECTURES:
        return f"architecture {arch} is not one of {', '.join(ARCHITECTURES)}"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act}"
    if any(t != "full_attention" for t in getattr(config, "layer_types", None) or ()):
        return "sliding-window layers"
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") not in STATIC_ROPE or float(rope.get("partial_rotary_factor", 1.0)) != 1.0:
        return f"rope {rope}"
    return None


def weight_files(directory: str | Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it (one file, or a sharded checkpoint's index)."""
    d = Path(directory)
    index = d / "model.safetensors.index.json"
    if index.exists():
        return {name: d / f for name, f in json.loads(index.read_text())["weight_map"].items()}
    single = d / "model.safetensors"
    if not single.exists():
        raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {d}")
    from safetensors import safe_open

    with safe_open(str(single), framework="pt") as f:
        return dict.fromkeys(f.keys(), single)


class ShardReader:
    """Slices of named tensors, each file opened once (memory-mapped: only the slices read are
    paged in), converted to the device and dtype."""

    def __init__(self, directory: str | Path, device: torch.device | str, dtype: torch.dtype,
                 stack: ExitStack) -> None:
        from safetensors import safe_open

        self.where = weight_files(directory)
        self.device, self.dtype = device, dtype
        self._files = {p: stack.enter_context(safe_open(str(p), framework="pt"))
                       for p in sorted(set(self.where.values()))}

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def shape(self, name: str) -> list[int]:
        return list(self._files[self.where[name]].get_slice(name).get_shape())

    def get(self, name: str, rows: slice | None = None, cols: slice | None = None) -> torch.Tensor:
        sl = self._files[self.where[name]].get_slice(name)
        if cols is not None:
            t = sl[:, cols] if rows is None else sl[rows, cols]
        else:
            t = sl[rows] if rows is not None else sl[:]
        out: torch.Tensor = t.to(device=self.device, dtype=self.dtype).contiguous()
        return out

    def opt(self, name: str, rows: slice | None = None) -> torch.Tensor | None:
        return self.get(name, rows) if name in self else None


def _part(n: int, rank: int, size: int) -> slice:
    k = n // size
    return slice(rank * k, (rank + 1) * k)


def _layer(r: ShardReader, i: int, config: Any, rank: int, size: int, d: int) -> Layer:
    p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
    hq, hkv, inter = config.num_attention_heads, config.num_key_value_heads, config.intermediate_size
    qs, ks, ms = _part(hq * d, rank, size), _part(hkv * d, rank, size), _part(inter, rank, size)
    rows = {"q": qs, "k": ks, "v": ks}
    biases = [b for b in (r.opt(a + f"{x}_proj.bias", rows[x]) for x in "qkv") if b is not None]
    return Layer(
        attn_norm=r.get(p + "input_layernorm.weight"),
        wqkv=torch.cat([r.get(a + f"{x}_proj.weight", rows[x]) for x in "qkv"]),
        bqkv=torch.cat(biases) if len(biases) == 3 else None,
        q_norm=r.opt(a + "q_norm.weight"), k_norm=r.opt(a + "k_norm.weight"),
        wo=r.get(a + "o_proj.weight", cols=qs), bo=r.opt(a + "o_proj.bias") if rank == 0 else None,
        mlp_norm=r.get(p + "post_attention_layernorm.weight"),
        w_gate_up=torch.cat([r.get(p + "mlp.gate_proj.weight", ms), r.get(p + "mlp.up_proj.weight", ms)]),
        w_down=r.get(p + "mlp.down_proj.weight", cols=ms),
    )


def load_shard(directory: str | Path, config: Any, rank: int, size: int, device: torch.device | str = "cpu",
               dtype: torch.dtype = torch.float32) -> Weights:
    """Rank `rank` of `size`'s weights (the module's docstring has the layout)."""
    problem = config_problem(config) or degree_problem(config, size)
    if problem is not None:
        raise ValueError(f"cannot shard {directory}: {problem}")
    d = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    with ExitStack() as stack:
        r = ShardReader(directory, device, dtype, stack)
        layers = [_layer(r, i, config, rank, size, d) for i in range(config.num_hidden_layers)]
        embed = r.get("model.embed_tokens.weight")
        head = "lm_head.weight" if "lm_head.weight" in r and not getattr(config, "tie_word_embeddings", False) \
            else "model.embed_tokens.weight"
        vocab = r.shape(head)[0]
        per = -(-vocab // size)  # the vocabulary padded to a multiple of the ranks
        lo, hi = min(rank * per, vocab), min((rank + 1) * per, vocab)
        lm_head = torch.zeros(per, embed.shape[1], device=device, dtype=dtype)
        lm_head[:hi - lo] = embed[lo:hi] if head == "model.embed_tokens.weight" else r.get(head, slice(lo, hi))
        norm = r.get("model.norm.weight")
    cos, sin = rope_tables(config, int(config.max_position_embeddings), device)
    return Weights(embed=embed, layers=layers, norm=norm, lm_head=lm_head,
                   cos=cos.to(device=device, dtype=dtype), sin=sin.to(device=device, dtype=dtype),
                   num_heads=config.num_attention_heads // size, num_kv_heads=config.num_key_value_heads // size,
                   head_dim=d, eps=float(config.rms_norm_eps), vocab=vocab)


class GroupCollectives(Collectives):
    """A rank's collectives over its tensor-parallel group (torch.distributed: NCCL on CUDA,
    gloo on the CPU). Keeps the time spent in them (`seconds`, `calls`): the benchmark's
    all-reduce share."""

    def __init__(self, rank: int, size: int, vocab: int = 0) -> None:
        self.rank, self.size = rank, size
        self.vocab = vocab  # set by the loader: the gathered logits are cut to it
        self.seconds = {"reduce": 0.0, "gather": 0.0}
        self.calls = {"reduce": 0, "gather": 0}

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        dist.all_reduce(x)
        self._count("reduce", t0)
        return x

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous())
        out = torch.cat(parts, dim=-1)[..., :self.vocab] if self.vocab else torch.cat(parts, dim=-1)
        self._count("gather", t0)
        return out

    def least(self, n: int) -> int:
        """The smallest `n` over the ranks (the KV budget, agreed decisions)."""
        t = torch.tensor([n], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=control_group())
        return int(t.item())

    def _count(self, what: str, t0: float) -> None:
        self.seconds[what] += time.perf_counter() - t0
        self.calls[what] += 1


_CONTROL: list[Any] = []  # this process's gloo group for step messages and start-up agreement


def control_group() -> Any:
    if not _CONTROL:
        raise RuntimeError("the tensor-parallel group is not started (sharding.start_group)")
    return _CONTROL[0]


def start_group(rank: int, size: int, init_method: str, backend: str = "gloo",
                timeout_s: float = 600.0, idle_timeout_s: float = 365 * 86400.0) -> GroupCollectives:
    """Join this process to its group: the data collectives on `backend` (gloo, or nccl on
    CUDA), the step messages on a gloo group of their own whose timeout is `idle_timeout_s`
    (a rank waits there for the next step however long the target is idle; a dead peer's
    closed connection ends the wait at once)."""
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size,
                            timeout=timedelta(seconds=timeout_s))
    _CONTROL[:] = [dist.new_group(backend="gloo", timeout=timedelta(seconds=idle_timeout_s))]
    return GroupCollectives(rank, size)


def stop_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
    _CONTROL.clear()


@contextmanager
def group(rank: int, size: int, init_method: str, backend: str = "gloo") -> Iterator[GroupCollectives]:
    """`start_group`, then `stop_group` however the block ends (tests, benchmarks)."""
    tp = start_group(rank, size, init_method, backend)
    try:
        yield tp
    finally:
        stop_group()


class ConfigModel:
    """The model where the runner is built from shards (make_runner reads its `config`); no
    weight of it is ever loaded."""

    def __init__(self, directory: str | Path) -> None:
        from transformers import AutoConfig

        self.directory = str(directory)
        self.config = AutoConfig.from_pretrained(self.directory)


class ShardedTarget:
    """What the target's model step and engine read of the target (`verifier.TargetModel`'s
    fields), from its config and files: vocabulary, context length, EOS."""

    def __init__(self, directory: str | Path) -> None:
        self.model = ConfigModel(directory)
        cfg = self.model.config
        problem = config_problem(cfg)
        if problem is not None:
            raise ValueError(f"tensor parallelism runs on the batched runner, which cannot serve {directory}: "
                             f"{problem}")
        self.vocab_size = int(cfg.vocab_size)
        self.max_positions = int(getattr(cfg, "max_position_embeddings", 1 << 30))
        eos = None
        gen = Path(directory) / "generation_config.json"
        if gen.exists():
            eos = json.loads(gen.read_text()).get("eos_token_id")
        if eos is None:
            eos = getattr(cfg, "eos_token_id", None)
        self.eos_token_ids: frozenset[int] = frozenset(
            [] if eos is None else ([eos] if isinstance(eos, int) else list(eos)))


class ShardLoader:
    """`ModelRunner.from_hf`'s part for a rank (worker/model_step.py: make_runner's `load`):
    its shard, its KV slots (the smallest budget any rank has: every rank has the same slots),
    the group's collectives, and the tile GEMMs fused only where every rank fuses them (the
    fusing sets how many all-reduces a layer makes)."""

    def __init__(self, directory: str | Path, tp: GroupCollectives) -> None:
        self.directory = str(directory)
        self.tp = tp

    def __call__(self, model: Any, *, kv_budget_bytes: int | Callable[[], int] | None = None,
                 max_sessions: int | None = None, max_len: int | None = None, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32, tile: int | None = 4, fuse_upto: int = 0,
                 short_rows: bool | None = None) -> ModelRunner:
        cfg = model.config
        w = load_shard(self.directory, cfg, self.tp.rank, self.tp.size, device, dtype)
        self.tp.vocab = w.vocab_size
        max_len = int(max_len or cfg.max_position_embeddings)
        if max_len > w.cos.shape[0]:
            raise ValueError(f"max_len {max_len} exceeds the model's {w.cos.shape[0]} positions")
        layout = KVLayout(cfg.num_hidden_layers, w.num_kv_heads, w.head_dim, dtype)
        budget = kv_budget_bytes() if callable(kv_budget_bytes) else kv_budget_bytes
        if budget is not None:
            budget = self.tp.least(budget)
        kv = KVSlots(layout, max_len, budget, max_sessions, device)
        runner = ModelRunner(w, kv, tile, fuse_upto, short_rows)
        runner.tp = self.tp
        if self.tp.least(runner.fuse_upto) != runner.fuse_upto:
            runner.fuse_upto, runner.fused_threads = 0, 0
        return runner
