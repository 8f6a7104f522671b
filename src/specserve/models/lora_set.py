"""The adapters a runner holds (ADR 0029): slots, their stacked weights, and the LoRA products
of a step whose rows belong to different adapters (and to none).

Per decoder layer and fused projection (q/k/v, o, gate/up, down: `lora.PROJECTIONS`), `a[p][l]`
is [slots x parts x R, in] and `b[p][l]` [out, slots x parts x R]: slot s (1-based; 0 is the base)
owns rows (s - 1) C .. s C - 1 of A and those columns of B, C = parts x R (`lora.stacked`'s
layout for one adapter). Two ways to add the products, each exact for every row whatever
the others hold:

- `add_segmented` (the eager forward): the tokens of one GEMM run grouped by slot, each group's
  shrink and expand one pair of GEMMs over its own tokens only (S-LoRA's segmented products),
  padded to whole tiles so every call has a shape the runner's batch-invariance check covered;
- `masked` (the device step): every token's shrink against all slots side by side (`a_all`),
  the columns of other slots zeroed by a mask from the token's slot (a tensor), the expand
  against `b_all`: shapes fixed by the capacity alone, no host read, so a CUDA graph of a
  bucket serves every mix of adapters.

Loading is in two halves: `prepare` reads, checks and stacks on the host (any thread), and
`install` copies into a free slot (the model's thread, between steps). A slot in use is never
written: an unloaded adapter's name goes at once, its slot when its last session closes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from specserve.errors import AdapterNotFound, ResourceExhausted
from specserve.models.lora import PROJECTIONS, Adapter, Shapes, check_fits, stacked

PAD = -1  # a padding token's slot in the eager forward (its outputs are dropped)


@dataclass(frozen=True)
class Prepared:
    """An adapter checked and stacked on the host, ready to install."""

    adapter: Adapter
    weights: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]]  # (projection, layer) -> (A, B)


@dataclass
class SlotInfo:
    name: str
    path: str
    rank: int
    users: int = 0
    retired: bool = False  # unloaded while in use: freed at its last session's close


class LoraSet:
    def __init__(self, shapes: Shapes, max_loras: int, max_rank: int, device: torch.device,
                 dtype: torch.dtype, fingerprint: str = "", tile: int | None = 4, fuse_upto: int = 0) -> None:
        if max_loras < 1 or max_rank < 1:
            raise ValueError(f"max_loras and max_lora_rank must be >= 1, got {max_loras}, {max_rank}")
        self.shapes = shapes
        self.max_loras, self.max_rank = max_loras, max_rank
        self.device, self.dtype, self.fingerprint = device, dtype, fingerprint
        self.slots: dict[int, SlotInfo] = {}
        self.names: dict[str, int] = {}
        self.session_slot: dict[Hashable, int] = {}  # an open session's adapter slot (its KV is tied to it)
        self._lock = threading.Lock()
        self.a: dict[str, list[torch.Tensor]] = {}
        self.b: dict[str, list[torch.Tensor]] = {}
        self.cols: dict[str, int] = {}  # C: a slot's columns in a projection
        self.col_slot: dict[str, torch.Tensor] = {}  # each column's slot
        for p, mods in PROJECTIONS.items():
            cols = self.cols[p] = len(mods) * max_rank
            self.a[p] = [torch.zeros(max_loras * cols, self.shapes.in_features(p), device=device, dtype=dtype)
                         for _ in range(self.shapes.layers)]
            self.b[p] = [torch.zeros(sum(self.shapes.out_features(p)), max_loras * cols, device=device, dtype=dtype)
                         for _ in range(self.shapes.layers)]
            self.col_slot[p] = torch.arange(max_loras * cols, device=device) // cols + 1
        # segmented GEMMs over several tiles at once where that keeps each row's bits (as the runner's),
        # checked for each rank an installed adapter has (`_group_of`)
        self.tile, self.fuse_upto = tile, fuse_upto
        self.groups: dict[int, int | None] = {}
        self._plans: dict[tuple[int, ...], list[tuple[int, torch.Tensor | None, int]]] = {}

    # ---- the table ----------------------------------------------------------------------------

    def prepare(self, adapter: Adapter) -> Prepared:
        """Check `adapter` against this base and stack it (host; raises InvalidAdapter)."""
        check_fits(adapter, self.shapes, self.max_rank, self.fingerprint)
        weights = {(p, layer): stacked(adapter, layer, p, self.shapes, adapter.rank)
                   for p in PROJECTIONS for layer in range(self.shapes.layers)}
        self._group_of(adapter.rank)
        return Prepared(adapter, weights)

    def install(self, prepared: Prepared) -> int:
        """Copy a prepared adapter into a free slot (the model's thread); its slot. A name already
        loaded is replaced only once its sessions are done: here it is refused."""
        name = prepared.adapter.name
        with self._lock:
            if name in self.names:
                raise ValueError(f"adapter {name!r} is already loaded: unload it first")
            free = [s for s in range(1, self.max_loras + 1) if s not in self.slots]
            if not free:
                raise ResourceExhausted(f"all {self.max_loras} adapter slots are taken (max_loras): unload one first")
            slot = free[0]
            self.slots[slot] = SlotInfo(name, prepared.adapter.path, prepared.adapter.rank)
        for (p, layer), (a, b) in prepared.weights.items():  # (packed at the adapter's rank: the slot's first columns)
            a_s, b_s = self.of_slot(p, layer, slot)
            a_s[:a.shape[0]].copy_(a)
            b_s[:, :b.shape[1]].copy_(b)
        with self._lock:
            self.names[name] = slot
        return slot

    def unload(self, name: str) -> bool:
        """Forget `name` now (new sessions cannot open on it); its slot is freed at once if no
        session holds it, else when the last one closes. False: it was still in use."""
        with self._lock:
            slot = self.names.pop(name, None)
            if slot is None:
                raise AdapterNotFound(f"no adapter {name!r} is loaded")
            info = self.slots[slot]
            if info.users:
                info.retired = True
                return False
            self._free(slot)
            return True

    def acquire(self, name: str) -> int:
        """A new session's slot for adapter `name` (AdapterNotFound if it is not loaded)."""
        with self._lock:
            slot = self.names.get(name)
            if slot is None:
                raise AdapterNotFound(f"no adapter {name!r} is loaded on this target")
            self.slots[slot].users += 1
            return slot

    def release(self, slot: int) -> None:
        with self._lock:
            info = self.slots.get(slot)
            if info is None:
                return
            info.users = max(info.users - 1, 0)
            if info.retired and info.users == 0:
                self._free(slot)

    def _free(self, slot: int) -> None:
        """Zero a slot's weights (a freed slot is the base's again) and forget it."""
        for p in PROJECTIONS:
            for layer in range(self.shapes.layers):
                for t in self.of_slot(p, layer, slot):
                    t.zero_()
        del self.slots[slot]

    def of_slot(self, proj: str, layer: int, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A slot's A [C, in] and B [out, C] in one layer's projection (views of the stacks)."""
        c = self.cols[proj]
        return self.a[proj][layer][(slot - 1) * c:slot * c], self.b[proj][layer][:, (slot - 1) * c:slot * c]

    def bind(self, session: Hashable, name: str) -> None:
        """Open `session` on adapter `name`: every row of it runs with its products."""
        self.session_slot[session] = self.acquire(name)

    def unbind(self, session: Hashable) -> None:
        slot = self.session_slot.pop(session, 0)
        if slot:
            self.release(slot)

    def slot_of(self, session: Hashable) -> int:
        return self.session_slot.get(session, 0)

    def token_slots(self, sessions: Sequence[Hashable], sizes: Sequence[int], total: int) -> list[int] | None:
        """Each token's slot (rows of `sizes` tokens: 0 for the base; then padding to `total`:
        PAD); None when no row has an adapter (the forward then runs no products)."""
        per_row = [self.session_slot.get(s, 0) for s in sessions]
        if not any(per_row):
            return None
        out = [s for s, n in zip(per_row, sizes, strict=True) for _ in range(n)]
        return out + [PAD] * (total - len(out))

    def loaded(self) -> list[SlotInfo]:
        with self._lock:
            return [self.slots[s] for s in sorted(self.names.values())]

    # ---- the products -------------------------------------------------------------------------

    def add_segmented(self, y: torch.Tensor, x: torch.Tensor, layer: int, proj: str, slots: Sequence[int]) -> None:
        """y [n, out] += each token's adapter's product on x [n, in]; `slots` per token (0: the
        base, PAD: padding, whose outputs are dropped)."""
        for s, at, n in self._groups(slots, y.device):
            a, b = self.of_slot(proj, layer, s)
            rank = self.slots[s].rank  # (its columns: the parts packed at its own rank, then zeros)
            c = len(PROJECTIONS[proj]) * rank
            a, b = a[:c], b[:, :c]
            group = self._group_of(rank)
            xg = x if at is None else x.index_select(0, at)
            m = xg.shape[0]
            step = m if group is None else group
            d = torch.cat([F.linear(F.linear(xg[i:i + step], a), b) for i in range(0, m, step)]) if m > step \
                else F.linear(F.linear(xg, a), b)
            if at is None:
                y += d
            else:
                y.index_add_(0, at[:n], d[:n])

    def _groups(self, slots: Sequence[int], device: torch.device) -> list[tuple[int, torch.Tensor | None, int]]:
        """A GEMM run's segments, one per adapter: (slot, its tokens' places padded to whole tiles,
        how many are its), or (slot, None, n) where the run holds one adapter's tokens and padding
        only (its products then run over the whole run, with no gather). Kept per run of slots:
        every layer and projection of a forward asks the same."""
        key = tuple(slots)
        plan = self._plans.get(key)
        if plan is not None:
            return plan
        groups: dict[int, list[int]] = {}
        for i, s in enumerate(slots):
            if s > 0:
                groups.setdefault(s, []).append(i)
        whole = len(groups) == 1 and 0 not in key
        plan = []
        for s, idx in groups.items():
            n = len(idx)
            pad = n if self.tile is None else -(-n // self.tile) * self.tile
            plan.append((s, None, len(slots)) if whole else
                        (s, torch.tensor(idx + [idx[0]] * (pad - n), device=device), n))
        if len(self._plans) >= 256:
            self._plans.clear()
        self._plans[key] = plan
        return plan

    def masked(self, x: torch.Tensor, layer: int, proj: str, token_slots: torch.Tensor) -> torch.Tensor:
        """Every token's adapter's product on x [T, in] -> [T, out], token_slots [T] a tensor
        (0: none): fixed shapes, no host read (the device step's)."""
        mask = (self.col_slot[proj].unsqueeze(0) == token_slots.unsqueeze(1)).to(x.dtype)
        return F.linear(F.linear(x, self.a[proj][layer]) * mask, self.b[proj][layer])

    def linear(self, base: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor], index: int,
               layer: Any, token_slots: torch.Tensor) -> LoraLinear:
        """Layer `index`'s projections with the masked products of tokens whose slots are `token_slots`."""
        return LoraLinear(base, self, index, layer, token_slots=token_slots)

    def _group_of(self, rank: int) -> int | None:
        """Tokens per segmented GEMM call for adapters of `rank`: a run of several tiles where
        `_fused_agree` says that keeps each row's bits, else one tile (None: the plain forward)."""
        if rank not in self.groups:
            tile, upto = self.tile, self.fuse_upto
            fused = tile is not None and upto >= 2 * tile and self._fused_agree(tile, upto, rank)
            self.groups[rank] = upto // tile * tile if fused and tile is not None else tile
        return self.groups[rank]

    def _fused_agree(self, tile: int, upto: int, rank: int) -> bool:
        """The runner's `fused_tiles_agree` for the LoRA shapes of one rank: one call over k tiles
        gives each row the bits of k one-tile calls, for every k (then a group's GEMMs run as one)."""
        g = torch.Generator().manual_seed(0)
        n = upto // tile * tile
        for p in PROJECTIONS:
            c = len(PROJECTIONS[p]) * rank
            a = torch.randn(self.a[p][0].shape, generator=g).to(self.device, self.dtype)[:c]
            b = torch.randn(self.b[p][0].shape, generator=g).to(self.device, self.dtype)[:, :c]
            for w in (a, b):  # (views laid out as the slots' are)
                x = torch.randn(n, w.shape[1], generator=g).to(self.device, self.dtype)
                ref = torch.cat([F.linear(x[i:i + tile], w) for i in range(0, n, tile)])
                if not all(torch.equal(F.linear(x[:k], w), ref[:k]) for k in range(2 * tile, n + 1, tile)):
                    return False
        return True


def enable_lora(runner: Any, config: Any, max_loras: int, max_rank: int, fingerprint: str = "") -> LoraSet:
    """Give a `ModelRunner` of a model with this HF `config` room for `max_loras` adapters of
    rank up to `max_rank` (ADR 0029); `fingerprint`: its weights' (`lora.base_fingerprint`)."""
    if runner.tp.size > 1:
        raise ValueError("LoRA adapters are not supported with tensor parallelism (ADR 0029)")
    lora = LoraSet(Shapes.of(config), max_loras, max_rank, runner.device, runner.w.embed.dtype, fingerprint,
                   runner.tile, runner.fuse_upto)
    runner.lora = lora
    if runner.device_step is not None:
        runner.device_step.graphs.clear()  # (the step's graphs now read the adapters' inputs too)
    return lora


def bind_adapter(runner: Any, session: Hashable, name: str) -> None:
    """Tie a just-allocated session's KV slot to adapter `name`; the slot is freed if it is not loaded."""
    try:
        if runner.lora is None:
            raise AdapterNotFound(f"no adapter {name!r}: this model serves no adapters (SPECSERVE_TARGET_ADAPTERS)")
        runner.lora.bind(session, name)
    except Exception:
        runner.kv.free(session)
        raise


class LoraLinear:
    """A runner's projection (its `linear`) with the LoRA products of the tokens it runs on
    added, for one decoder layer: the projections are known by their weights (`Layer`'s wqkv,
    wo, w_gate_up, w_down); any other weight runs plain. Either the host's slots of the run's
    tokens (`slots`: the eager forward's segmented products) or a tensor of them on the device
    (`token_slots`, read to the call's length: the device step's masked products)."""

    def __init__(self, base: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor],
                 lora: LoraSet, index: int, layer: Any, slots: Sequence[int] | None = None,
                 token_slots: torch.Tensor | None = None) -> None:
        self.base, self.lora, self.index = base, lora, index
        self.slots, self.token_slots = slots, token_slots
        self.proj = {id(layer.wqkv): "qkv", id(layer.wo): "o", id(layer.w_gate_up): "gate_up",
                     id(layer.w_down): "down"}

    def __call__(self, x: torch.Tensor, m: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        y = self.base(x, m, b)
        proj = self.proj.get(id(m))
        if proj is None:
            return y
        if self.slots is not None:
            self.lora.add_segmented(y, x, self.index, proj, self.slots)
            return y
        assert self.token_slots is not None
        return y + self.lora.masked(x, self.index, proj, self.token_slots[:x.shape[0]])
