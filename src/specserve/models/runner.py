"""The batched model runner: one forward over rows of different sessions, batch-invariant.

Owns the weights of a Llama-family decoder (Llama, Qwen2, Qwen3) as plain tensors, the
forward over preallocated KV slots (`kv_slots.KVSlots`), and the rule that decides which
models it runs (`unsupported_reason`, `choose_path`); anything else stays on the per-session
HF path (`kvcache.CachedLM`).

A row is (session, new token ids) appended at that session's cached length: a prefill
chunk, one plain token, or the last token + K drafts. Batch invariance (DESIGN §3, inv. 5):
every per-token op (norms, projections, RoPE, MLP, LM head) runs on tiles of exactly `tile`
tokens, so each kernel is called with one shape whatever the batch, and attention runs per
row over that row's own slot. A row's logits are thus bitwise the same alone or in any
batch, at any place in it. `tile=None` is the plain batched forward (one call over all
tokens, shapes vary with the batch), kept for the benchmark. ADR 0008 has the measurements.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.nn.functional as F
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from specserve.device import to_device
from specserve.errors import InvalidRequest
from specserve.models.kv_slots import KVLayout, KVSlots
from specserve.models.row_attention import attend_row, attend_short_rows, row_mask
from specserve.params import SamplingParams

if TYPE_CHECKING:
    from specserve.models.device_step import DeviceStep
    from specserve.models.lora_set import LoraSet

log = logging.getLogger(__name__)

ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
# RoPE types whose frequencies do not depend on the sequence length ("dynamic" and
# "longrope" rescale with it, so a cached key would change meaning).
STATIC_ROPE = ("default", "linear", "llama3", "yarn")
DEFAULT_TILE = 4  # tokens per tile on CPU (ADR 0008 has the sweep); larger on a GPU
DEFAULT_FUSE_UPTO = 128  # tokens per fused GEMM call, where the start-up check allows it
GRAIN = 32768  # at::internal::GRAIN_SIZE: smaller elementwise calls run on one thread


def unsupported_reason(model: torch.nn.Module) -> str | None:
    """None when the runner can run `model` exactly, else why not (for the log line)."""
    cfg: Any = model.config
    name = type(model).__name__
    if name not in ARCHITECTURES:
        return f"architecture {name} is not one of {', '.join(ARCHITECTURES)}"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"activation {cfg.hidden_act}"
    if any(t != "full_attention" for t in getattr(cfg, "layer_types", None) or ()):
        return "sliding-window layers"
    rope = getattr(cfg, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") not in STATIC_ROPE:
        return f"rope_type {rope.get('rope_type')}"
    if float(rope.get("partial_rotary_factor", 1.0)) != 1.0:
        return "partial rotary embeddings"
    return None


def choose_path(model: torch.nn.Module) -> Literal["runner", "hf"]:
    """Which path serves `model`; a fallback logs one line naming the architecture."""
    reason = unsupported_reason(model)
    if reason is None:
        return "runner"
    log.warning("batched runner cannot serve %s (%s): using the per-session HF path",
                type(model).__name__, reason)
    return "hf"


@dataclass
class Layer:
    attn_norm: torch.Tensor  # [H]
    wqkv: torch.Tensor  # [(Hq + 2 Hkv) D, H]: q, k, v projections stacked
    bqkv: torch.Tensor | None  # [(Hq + 2 Hkv) D] (Qwen2; Llama with attention_bias)
    q_norm: torch.Tensor | None  # [D] (Qwen3)
    k_norm: torch.Tensor | None  # [D]
    wo: torch.Tensor  # [H, Hq D]
    bo: torch.Tensor | None  # [H]
    mlp_norm: torch.Tensor  # [H]
    w_gate_up: torch.Tensor  # [2 I, H]: gate and up stacked
    w_down: torch.Tensor  # [H, I]


@dataclass
class Weights:
    embed: torch.Tensor  # [V, H]
    layers: list[Layer]
    norm: torch.Tensor  # [H]
    lm_head: torch.Tensor  # [V, H] (the embedding itself when tied)
    cos: torch.Tensor  # [max_positions, D], attention scaling folded in
    sin: torch.Tensor  # [max_positions, D], first half negated (see `rotate`)
    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float
    vocab: int = 0  # the model's vocabulary where `lm_head` is one rank's slice of it (ADR 0030); 0: its rows

    @property
    def vocab_size(self) -> int:
        return self.vocab or int(self.lm_head.shape[0])


def rope_tables(config: Any, max_positions: int,
                device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin' [max_positions, D] float32 as HF's rotary embedding computes them, with the
    first half of sin negated for `rotate`; computed on `device` (no host tensor is copied)."""
    rope = dict(config.rope_parameters)
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if rope.get("rope_type", "default") == "default":
        exponents = torch.arange(0, dim, 2, dtype=torch.float, device=device) / dim
        inv_freq = 1.0 / (rope["rope_theta"] ** exponents)
        scaling = 1.0
    else:
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope["rope_type"]](config, torch.device(device))
    positions = torch.arange(max_positions, device=device).float()
    freqs = positions[:, None] * inv_freq.float()[None, :]  # [P, D/2]
    cos, sin = freqs.cos() * scaling, freqs.sin() * scaling
    return torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)


def load_weights(config: Any, state: Mapping[str, torch.Tensor], device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32) -> Weights:
    """Weights from an HF config and state dict (`model.state_dict()` or a safetensors
    file's tensors). Biases and q/k norms are taken when the state dict has them."""
    def get(name: str) -> torch.Tensor:
        return state[name].to(device=device, dtype=dtype)

    def opt(name: str) -> torch.Tensor | None:
        return get(name) if name in state else None

    layers = []
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        biases = [b for b in (opt(a + f"{x}_proj.bias") for x in "qkv") if b is not None]
        layers.append(Layer(
            attn_norm=get(p + "input_layernorm.weight"),
            wqkv=torch.cat([get(a + f"{x}_proj.weight") for x in "qkv"]),
            bqkv=torch.cat(biases) if len(biases) == 3 else None,
            q_norm=opt(a + "q_norm.weight"), k_norm=opt(a + "k_norm.weight"),
            wo=get(a + "o_proj.weight"), bo=opt(a + "o_proj.bias"),
            mlp_norm=get(p + "post_attention_layernorm.weight"),
            w_gate_up=torch.cat([get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")]),
            w_down=get(p + "mlp.down_proj.weight"),
        ))
    embed = get("model.embed_tokens.weight")
    tied = getattr(config, "tie_word_embeddings", False) or "lm_head.weight" not in state
    max_positions = int(config.max_position_embeddings)
    cos, sin = rope_tables(config, max_positions, device)
    return Weights(
        embed=embed, layers=layers, norm=get("model.norm.weight"),
        lm_head=embed if tied else get("lm_head.weight"),
        cos=cos.to(device=device, dtype=dtype), sin=sin.to(device=device, dtype=dtype),
        num_heads=config.num_attention_heads, num_kv_heads=config.num_key_value_heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
        eps=float(config.rms_norm_eps),
    )


SHORT_ROW = 16  # rows of at most this many tokens (decode, verify) share one attention call in "fast"


@dataclass(frozen=True)
class ShortRows:
    """The short rows of a batch laid out for one padded attention call (exact_batching
    "fast": one call instead of one per row; its last bits then depend on the batch)."""

    slots: torch.Tensor  # [B] the rows' KV slots
    keys: int  # L: the longest row's length after this step
    width: int  # W: the most new tokens of a short row
    tokens: torch.Tensor  # [T] positions of the short rows' tokens in the batch
    padded: torch.Tensor  # [T] the same tokens' places in the [B * W] padded layout
    mask: torch.Tensor  # [B, 1, W, L] bool: query i of row b sees keys 0 .. start_b + i

    @classmethod
    def of(cls, slots: list[int], starts: list[int], offsets: list[int], sizes: list[int],
           device: torch.device) -> ShortRows | None:
        picked = [i for i, n in enumerate(sizes) if n <= SHORT_ROW]
        if not picked:
            return None
        width = max(sizes[i] for i in picked)
        keys = max(starts[i] + sizes[i] for i in picked)
        tokens = [offsets[i] + j for i in picked for j in range(sizes[i])]
        padded = [b * width + j for b, i in enumerate(picked) for j in range(sizes[i])]
        # a padding query sees key 0 only (its output is dropped; a row of -inf would give NaN)
        last = [[starts[i] + min(j, sizes[i] - 1) if j < sizes[i] else 0 for j in range(width)] for i in picked]
        mask = torch.arange(keys, device=device)[None, None, :] <= to_device(last, device)[:, :, None]
        return cls(to_device([slots[i] for i in picked], device), keys, width,
                   to_device(tokens, device), to_device(padded, device), mask.unsqueeze(1))


@dataclass(frozen=True)
class Row:
    """New tokens of one session, appended at its cached length. `num_logits`: logits for
    the last n of them (1 for a decode step, K+1 for a verify, 0 for a prefill chunk that is
    not the last); None = all."""

    session: Hashable
    tokens: Sequence[int] | torch.Tensor  # a 1-D int64 tensor on the device: a draft's own picks
    num_logits: int | None = None
    # a token tree (ADR 0020): [n, n] bool, which of the row's new tokens each one sees (None:
    # causal), and each token's position after the row's start (None: 0, 1, 2, ...). Token i's
    # KV still goes to slot position start + i; its rotary position is start + depths[i].
    mask: torch.Tensor | None = None
    depths: Sequence[int] | None = None
    # a row of a session drafting on the target's own head (ADR 0025, models/head_step.py): the
    # head drafts this many of the row's tokens after its first (the row holds placeholders
    # there) and, where the row is judged, is fed its committed positions; None: not such a row
    head: int | None = None
    head_width: int = 1  # a head row's tree: this many first candidates, each with its chain of `head` (1: a chain)
    # a row the device step judges at T > 0 (models/step_judge.py): its sampling and seed; None: greedy
    sampling: SamplingParams | None = None
    seed: int = 0


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., H] -> [..., H], as HF's LlamaRMSNorm (float32 statistics, cast, then weight)."""
    return weight * F.rms_norm(x.float(), x.shape[-1:], None, eps).to(x.dtype)


def silu_rows(gate: torch.Tensor) -> torch.Tensor:
    """SiLU of gate [T, I] (a row-strided view) with every row computed alike. CPU kernels
    split a large tensor across threads by flat index and finish each piece's odd end with
    scalar code whose exp differs from the vector code in the last bit, so a row cut by a
    split would depend on its place in the tile. Calls of at most GRAIN elements stay on one
    thread, and a row-strided view runs one inner loop per row."""
    rows = max(1, GRAIN // gate.shape[1])
    if gate.shape[0] <= rows:
        return F.silu(gate)
    return torch.cat([F.silu(gate[i:i + rows]) for i in range(0, gate.shape[0], rows)])


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D], cos/sin [T, 1, D] -> RoPE applied. HF's x*cos + rotate_half(x)*sin
    with rotate_half(x) = cat(-x2, x1) is x*cos + roll(x, D/2)*sin', sin' = cat(-s, s)."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin


Linear = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]


def onednn_linear(x: torch.Tensor, m: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """F.linear on a weight packed by `pack_weights`."""
    out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, m, b, "none", [], "")
    return out


def pack_weights(w: Weights) -> Weights | None:
    """`w` with every projection and the LM head packed once for oneDNN (`onednn_linear`),
    on a float32 CPU model where torch has oneDNN; else None (F.linear on `w`). ATen's CPU
    GEMM packs the weight again at every call, which for the few rows of a decode or verify
    step costs more than the product (the demo target's gate/up at 4 rows: 360 µs, packed 141;
    ADR 0008, "Packed weights"). The packed copies replace the plain ones (the embedding
    stays; a tied LM head gets a packed copy). SPECSERVE_ONEDNN_LINEAR=0 keeps F.linear."""
    if (w.embed.device.type != "cpu" or w.embed.dtype != torch.float32 or not torch.backends.mkldnn.is_available()
            or os.environ.get("SPECSERVE_ONEDNN_LINEAR", "1") == "0"):
        return None

    def pack(m: torch.Tensor) -> torch.Tensor:
        packed: torch.Tensor = torch.ops.mkldnn._reorder_linear_weight(m, DEFAULT_TILE)
        return packed

    try:
        layers = [replace(lay, wqkv=pack(lay.wqkv), wo=pack(lay.wo), w_gate_up=pack(lay.w_gate_up),
                          w_down=pack(lay.w_down)) for lay in w.layers]
        return replace(w, layers=layers, lm_head=pack(w.lm_head))
    except (RuntimeError, AttributeError) as exc:  # a torch built without these ops
        log.info("oneDNN packed weights unavailable (%s): F.linear", exc)
        return None


def fused_tiles_agree(w: Weights, tile: int, upto: int, linear: Linear) -> bool:
    """Whether one `linear` call (the runner's: F.linear or `onednn_linear`) over k tiles
    gives each row the bits that k calls of one tile give, for every weight shape and every k
    with k * tile <= upto, at this thread count.

    Reduction order in a BLAS kernel depends on the call's shape, not on the data, so random
    inputs show any difference. The runner then calls one GEMM per run of at most `upto`
    tokens, a multiple of the tile. MKL on the development CPU passes (ADR 0008).
    """
    g = torch.Generator().manual_seed(0)
    lay = w.layers[0]
    mats = [(lay.wqkv, lay.bqkv), (lay.wo, lay.bo), (lay.w_gate_up, None), (lay.w_down, None),
            (w.lm_head, None)]
    n = upto // tile * tile
    for m, b in mats:
        x = torch.randn(n, m.shape[1], generator=g).to(m.device, m.dtype)
        ref = torch.cat([linear(x[i:i + tile], m, b) for i in range(0, n, tile)])
        if not all(torch.equal(linear(x[:k], m, b), ref[:k]) for k in range(2 * tile, n + 1, tile)):
            log.info("tile GEMMs are not fused: one call over several tiles changes a row's bits")
            return False
    return True


def token_ids(rows: Sequence[Row], pad: int, vocab: int, device: torch.device) -> torch.Tensor:
    """The rows' tokens and `pad` zeros as one [Mp] tensor on the device. Host tokens are
    checked against the vocabulary and go in as runs; device ones (picked from this
    model's logits) are spliced in where they stand, never read back."""
    parts: list[torch.Tensor] = []
    run: list[int] = []
    for r in rows:
        if isinstance(r.tokens, torch.Tensor):
            if run:
                parts.append(to_device(run, device))
                run = []
            parts.append(r.tokens.to(device=device, dtype=torch.long).view(-1))
            continue
        ids = [int(t) for t in r.tokens]
        if min(ids) < 0 or max(ids) >= vocab:
            raise InvalidRequest(f"a token id is outside the vocabulary (size {vocab})")
        run.extend(ids)
    if run or pad:
        parts.append(to_device(run + [0] * pad, device, torch.long))
    return torch.cat(parts) if len(parts) > 1 else parts[0]


class Collectives:
    """What a forward asks of its tensor-parallel group (ADR 0030): on one device, nothing.
    `reduce` sums a row-parallel projection's partial outputs over the ranks (after the
    attention output projection and after the MLP's down projection); `gather` joins the
    ranks' vocabulary slices of the logits. models/sharding.py has the group's."""

    size = 1  # ranks
    rank = 0

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        return x


class ModelRunner:
    """Weights + KV slots + the batched forward. Sessions are allocated, rolled back and
    freed through the runner; `forward` appends rows and returns their logits."""

    def __init__(self, weights: Weights, kv: KVSlots, tile: int | None = DEFAULT_TILE,
                 fuse_upto: int = 0, short_rows: bool | None = None) -> None:
        if tile is not None and tile <= 0:
            raise ValueError(f"tile must be >= 1 or None, got {tile}")
        packed = pack_weights(weights)
        self.w = packed or weights
        self.linear: Linear = onednn_linear if packed is not None else F.linear
        self.kv = kv
        self.tile = tile
        self.device_step: DeviceStep | None = None
        self.fixed_rows: dict[int, int] = {}  # the last forward's rows run by the device step -> their row there
        # the decoder layers whose outputs a forward keeps per token (an EAGLE head's features,
        # ADR 0020): `last_features[i]` [len(rows[i].tokens), H x len(layers)] after each forward
        self.feature_layers: tuple[int, ...] = ()
        self.last_features: list[torch.Tensor] = []
        self.device = weights.embed.device
        self.tp = Collectives()  # a tensor-parallel rank's group (ADR 0030; models/sharding.py)
        self.lora: LoraSet | None = None  # the LoRA adapters it holds (ADR 0029; `enable_lora`)
        # tile=None ("fast"): the short rows attend in one padded call where that pays, on CUDA
        # (one kernel launch, not one per row); on the CPU gathering every row's keys into one
        # padded tensor costs more than the calls it saves (ADR 0016), so rows attend alone
        self.short_rows = tile is None and (self.device.type == "cuda" if short_rows is None else short_rows)
        # One GEMM over several tiles instead of one per tile, where a start-up check shows
        # that it gives every row the same bits (ADR 0008); else tile by tile.
        self.fuse_upto, self.fused_threads = 0, 0
        if tile is not None and fuse_upto >= 2 * tile and fused_tiles_agree(self.w, tile, fuse_upto, self.linear):
            self.fuse_upto, self.fused_threads = fuse_upto // tile * tile, torch.get_num_threads()

    @classmethod
    def from_hf(cls, model: torch.nn.Module, *, kv_budget_bytes: int | Callable[[], int] | None = None,
                max_sessions: int | None = None, max_len: int | None = None,
                device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                tile: int | None = DEFAULT_TILE,
                fuse_upto: int = DEFAULT_FUSE_UPTO, short_rows: bool | None = None) -> ModelRunner:
        """A runner for an HF model (check `unsupported_reason(model)` first). KV capacity: a byte
        budget (or a function giving it, called once the weights are on the device: the CUDA
        budget is what they leave, `device.kv_budget_bytes`) or a session count; each session
        holds up to `max_len` positions (default: the model's context length). `fuse_upto`:
        see `fused_tiles_agree`."""
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"the batched runner cannot serve this model: {reason}")
        cfg: Any = model.config
        weights = load_weights(cfg, model.state_dict(), device, dtype)
        max_len = int(max_len or cfg.max_position_embeddings)
        if max_len > weights.cos.shape[0]:
            raise ValueError(f"max_len {max_len} exceeds the model's {weights.cos.shape[0]} positions")
        layout = KVLayout(cfg.num_hidden_layers, weights.num_kv_heads, weights.head_dim, dtype)
        budget = kv_budget_bytes() if callable(kv_budget_bytes) else kv_budget_bytes
        kv = KVSlots(layout, max_len, budget, max_sessions, device)
        return cls(weights, kv, tile, fuse_upto, short_rows)

    @property
    def vocab_size(self) -> int:
        return self.w.vocab_size

    def allocate(self, session: Hashable, adapter: str = "") -> None:
        """A KV slot for `session`, tied to `adapter` (ADR 0029; "" = the base) for its life."""
        self.kv.allocate(session)
        if adapter:
            from specserve.models.lora_set import bind_adapter

            bind_adapter(self, session, adapter)

    def free(self, session: Hashable) -> bool:
        if self.lora is not None:
            self.lora.unbind(session)
        return self.kv.free(session)

    def length(self, session: Hashable) -> int:
        return self.kv.length(session)

    def rollback(self, session: Hashable, length: int) -> int:
        return self.kv.rollback(session, length)

    def reconcile(self, session: Hashable, token_ids: Sequence[int]) -> int:
        return self.kv.reconcile(session, token_ids)

    def _tiles(self, n: int) -> list[slice]:
        """Slices of the padded tokens, one kernel call each: tiles, runs of at most
        `fuse_upto` tokens when fused (checked shapes only), or everything (tile=None)."""
        if self.tile is None:
            t = max(n, 1)
        elif self.fused_threads == torch.get_num_threads():
            t = self.fuse_upto
        else:
            t = self.tile
        return [slice(i, i + t) for i in range(0, n, t)]

    def _padded(self, n: int) -> int:
        return n if self.tile is None else -(-n // self.tile) * self.tile

    def enable_device_step(self, max_rows: int, max_width: int = SHORT_ROW, graphs: bool = False,
                           max_graphs: int = 2048, compile: bool | str = False, fuse: bool = False) -> DeviceStep:
        """Run short rows (at most `max_width` tokens) as the fixed-shape device step (ADR
        0019), replayed from CUDA graphs where `graphs` is set and the runner is on CUDA. It
        keeps one KV slot of the budget as its scratch slot. `fuse`: models/step_fusion.py."""
        from specserve.models.device_step import DeviceStep

        self.device_step = DeviceStep(self, max_rows, max_width, graphs, max_graphs, compile, fuse=fuse)
        return self.device_step

    def keep_features(self, layers: Sequence[int]) -> None:
        """Keep, per token of every later forward, the outputs of these decoder layers
        (`last_features`): an EAGLE head's features (ADR 0020), from the same forward."""
        n = len(self.w.layers)
        if any(not 0 <= i < n for i in layers):
            raise ValueError(f"feature layers {list(layers)} outside the model's {n} layers")
        self.feature_layers = tuple(layers)
        if self.device_step is not None:
            self.device_step.keep_features()

    @torch.inference_mode()
    def forward(self, rows: Sequence[Row]) -> list[torch.Tensor]:
        """Append each row's tokens to its session; logits [num_logits, V] float32 per row.
        With the device step on, short rows run there (`fixed_rows` then maps each such row's
        index to its row in the step's verdicts) and longer ones through the eager forward."""
        self.fixed_rows = {}
        self.last_features = []
        if not rows:
            return []
        sessions = [r.session for r in rows]
        if len(set(sessions)) != len(sessions):
            raise ValueError("a session appears twice in one batch")
        for r in rows:
            if len(r.tokens) == 0:
                raise ValueError(f"row for session {r.session!r} has no tokens")
            self.kv.check_room(r.session, len(r.tokens))
            if not isinstance(r.tokens, torch.Tensor) and (min(r.tokens) < 0 or max(r.tokens) >= self.vocab_size):
                raise InvalidRequest(f"a token id is outside the vocabulary (size {self.vocab_size})")
        ds = self.device_step
        if ds is None:
            out_eager = self._forward_eager(rows)
            self.last_features = self._eager_features
            return out_eager
        feats: list[Any] = [None] * len(rows)  # every row is filled below (bucketed or eager)
        short = [i for i, r in enumerate(rows) if len(r.tokens) <= ds.max_width]
        bucket = None
        if short:
            starts = [self.length(rows[i].session) for i in short]
            bucket = ds.bucket_for([rows[i] for i in short], starts)
            if bucket is None:
                ds.counts.unbucketed += 1
        fixed = short if bucket is not None else []
        out: list[torch.Tensor | None] = [None] * len(rows)
        rest = [i for i in range(len(rows)) if i not in set(fixed)]
        if rest:
            for k, (i, lg) in enumerate(zip(rest, self._forward_eager([rows[i] for i in rest]), strict=True)):
                out[i] = lg
                if self.feature_layers:
                    feats[i] = self._eager_features[k]
        if bucket is not None:
            srows = [rows[i] for i in fixed]
            ds.prepare(srows, [self.kv.slot(r.session) for r in srows], starts, bucket,
                       masks=[r.mask for r in srows] if any(r.mask is not None for r in srows) else None,
                       depths=[r.depths for r in srows] if any(r.depths is not None for r in srows) else None)
            ds.launch(bucket)
            w = bucket.width
            for j, (i, r) in enumerate(zip(fixed, srows, strict=True)):
                self.kv.append(r.session, r.tokens)
                n = len(r.tokens)
                c = n if r.num_logits is None else max(0, min(r.num_logits, n))
                out[i] = ds.logits[j * w + n - c:j * w + n]
                self.fixed_rows[i] = j
                if self.feature_layers:
                    feats[i] = ds.features[j * w:j * w + n]  # (a view: the next step writes over it)
        if self.feature_layers:
            self.last_features = feats
        return out  # type: ignore[return-value]

    @torch.inference_mode()
    def forward_chain(self, rows: Sequence[Row], chain: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A draft's next positions in one device run (ADR 0019): `rows` are one token each
        (the picks of the position before, on the device); row i drafts `chain[i]` more
        positions, each fed its own greedy pick. Returns views of the picks [S, R] and their
        heads [S, R, 4] (S = max(chain); valid until the next step), or None where the device
        step cannot take them (the caller then runs position by position)."""
        ds = self.device_step
        if ds is None or not rows or any(len(r.tokens) != 1 for r in rows) or max(chain) > ds.max_chain:
            return None
        for r, n in zip(rows, chain, strict=True):
            self.kv.check_room(r.session, n)
        starts = [self.length(r.session) for r in rows]
        bucket = ds.bucket_for(rows, starts)
        if bucket is None:
            return None
        steps = max(chain)
        ds.prepare(rows, [self.kv.slot(r.session) for r in rows], starts, bucket, chain=chain)
        ds.launch_chain(bucket, steps)
        for r, n in zip(rows, chain, strict=True):
            self.kv.append(r.session, torch.empty(n))  # (device picks: recorded as unknown until settled)
        return ds.chain_picks[:steps, :len(rows)], ds.chain_heads[:steps, :len(rows)]

    def _forward_eager(self, rows: Sequence[Row]) -> list[torch.Tensor]:
        """The variable-shape forward (checked rows): prefill chunks, and every row where the
        device step is off."""
        sessions = [r.session for r in rows]
        slots = [self.kv.slot(s) for s in sessions]
        starts = [len(self.kv.ids[s]) for s in slots]
        sizes = [len(r.tokens) for r in rows]
        offsets = [sum(sizes[:i]) for i in range(len(rows))]
        m = sum(sizes)
        mp = self._padded(m)
        # Padding tokens (id 0 at position 0) fill the last tile; their KV is never written.
        ids = token_ids(rows, mp - m, self.vocab_size, self.device)  # [Mp]
        at_host = [p for s, n in zip(starts, sizes, strict=True) for p in range(s, s + n)]
        rot = list(at_host)
        for r, s, off in zip(rows, starts, offsets, strict=True):
            if r.depths is not None:  # a tree: rotary positions by depth, slot positions in order
                rot[off:off + len(r.tokens)] = [s + d for d in r.depths]
        pos = to_device(rot + [0] * (mp - m), self.device)  # [Mp]: rotary positions
        at = pos if rot == at_host else to_device(at_host, self.device)  # [M]: where each token's KV goes
        slot_of_token = to_device([s for s, n in zip(slots, sizes, strict=True) for _ in range(n)], self.device)  # [M]
        cos, sin = self.w.cos[pos].unsqueeze(1), self.w.sin[pos].unsqueeze(1)  # [Mp, 1, D]
        short = ShortRows.of(slots, starts, offsets, sizes, self.device) if self.short_rows else None
        if any(r.mask is not None for r in rows):  # a token tree attends alone, under its block mask
            short = None
        masks = [None if short is not None and n <= SHORT_ROW else row_mask(start, n, r.mask, self.device)
                 for r, start, n in zip(rows, starts, sizes, strict=True)]
        hq, hkv = self.w.num_heads, self.w.num_kv_heads

        h = self.w.embed[ids]  # [Mp, H]
        kept: dict[int, torch.Tensor] = {}
        lora = None if self.lora is None else self.lora.token_slots(sessions, sizes, mp)  # (ADR 0029)
        for li, layer in enumerate(self.w.layers):
            qkv = self._qkv(layer, h, cos, sin, li, lora)  # [Mp, Hq + 2 Hkv, D], RoPE applied
            q, k, v = qkv.split([hq, hkv, hkv], dim=1)
            self.kv.write(li, slot_of_token, at[:m], k[:m], v[:m])
            o = torch.zeros(mp, hq * self.w.head_dim, dtype=h.dtype, device=self.device)
            for slot, start, off, n, mask in zip(slots, starts, offsets, sizes, masks, strict=True):
                if short is None or n > SHORT_ROW:
                    o[off:off + n] = attend_row(self.kv, li, slot, start + n, q[off:off + n], mask)
            if short is not None:
                o.index_copy_(0, short.tokens, attend_short_rows(self.kv, li, short, q))
            for t in self._tiles(mp):
                self._mlp_block(layer, h[t], o[t], self._linear(li, lora, t))
            if li in self.feature_layers:
                kept[li] = h[:m].clone()

        for r in rows:
            self.kv.append(r.session, r.tokens)
        self._eager_features = list(torch.cat([kept[i] for i in self.feature_layers], -1).split(sizes)) \
            if self.feature_layers else []
        return self._logits(h, rows, offsets, sizes)

    def _linear(self, li: int, lora: list[int] | None, t: slice) -> Linear:
        """The projection for layer `li`'s GEMM run `t`: with its tokens' LoRA products (ADR 0029)."""
        if lora is None or self.lora is None:
            return self.linear
        from specserve.models.lora_set import LoraLinear

        return LoraLinear(self.linear, self.lora, li, self.w.layers[li], slots=lora[t])

    def _qkv(self, layer: Layer, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, li: int = 0,
             lora: list[int] | None = None) -> torch.Tensor:
        """h [Mp, H] -> q, k, v stacked [Mp, Hq + 2 Hkv, D], tile by tile; `lora`: each token's
        adapter slot (ADR 0029; None: none has one)."""
        w, hq, hkv = self.w, self.w.num_heads, self.w.num_kv_heads
        out = torch.empty(h.shape[0], hq + 2 * hkv, w.head_dim, dtype=h.dtype, device=self.device)
        for t in self._tiles(h.shape[0]):
            x = rms_norm(h[t], layer.attn_norm, w.eps)
            qkv = self._linear(li, lora, t)(x, layer.wqkv, layer.bqkv).view(x.shape[0], hq + 2 * hkv, w.head_dim)
            if layer.q_norm is not None and layer.k_norm is not None:
                qkv = torch.cat([rms_norm(qkv[:, :hq], layer.q_norm, w.eps),
                                 rms_norm(qkv[:, hq:hq + hkv], layer.k_norm, w.eps), qkv[:, hq + hkv:]], 1)
            out[t, :hq + hkv] = rotate(qkv[:, :hq + hkv], cos[t], sin[t])
            out[t, hq + hkv:] = qkv[:, hq + hkv:]
        return out

    def _mlp_block(self, layer: Layer, h: torch.Tensor, o: torch.Tensor, linear: Linear | None = None) -> None:
        """h [T, H] (a view of the residual stream, updated in place), o [T, Hq D]."""
        linear = linear or self.linear
        h += self.tp.reduce(linear(o, layer.wo, layer.bo))
        x = rms_norm(h, layer.mlp_norm, self.w.eps)
        gate, up = linear(x, layer.w_gate_up, None).chunk(2, dim=-1)
        act = silu_rows(gate) if self.tile else F.silu(gate)
        h += self.tp.reduce(linear(act * up, layer.w_down, None))

    def _logits(self, h: torch.Tensor, rows: Sequence[Row], offsets: list[int],
                sizes: list[int]) -> list[torch.Tensor]:
        """Final norm + LM head on the positions whose logits were asked for, in tiles."""
        wanted: list[int] = []
        counts: list[int] = []
        for r, off, n in zip(rows, offsets, sizes, strict=True):
            c = n if r.num_logits is None else max(0, min(r.num_logits, n))
            wanted.extend(range(off + n - c, off + n))
            counts.append(c)
        r_total = len(wanted)
        hs = h[to_device(wanted + [0] * (self._padded(r_total) - r_total), self.device, torch.long)]  # [Rp, H]
        out = torch.empty(hs.shape[0], self.vocab_size, dtype=torch.float32, device=self.device)
        for t in self._tiles(hs.shape[0]):
            out[t] = self.tp.gather(self.linear(rms_norm(hs[t], self.w.norm, self.w.eps), self.w.lm_head, None)).float()
        return list(out[:r_total].split(counts))
