"""The eager forward's attention (`runner.ModelRunner._forward_eager`): each row attends over
its own KV slot, alone (one call per row, exact whatever the batch) or, for the short rows
under exact_batching "fast", all in one padded call (`runner.ShortRows`). The fixed-shape
device step has its own (`device_step.attend`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from specserve.device import to_device

if TYPE_CHECKING:
    from specserve.models.kv_slots import KVSlots
    from specserve.models.runner import ShortRows


def row_mask(start: int, n: int, block: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    """[n, start + n] bool: query i sees keys 0 .. start + i, or, with a `block` mask over
    the row's new tokens [n, n], the keys before the row and the new ones it allows (None:
    no mask needed)."""
    if block is not None:
        seen = torch.ones(n, start + n, dtype=torch.bool, device=device)
        seen[:, start:] = to_device(block, device, torch.bool)
        return seen
    if n == 1 or start == 0:
        return None
    keys = torch.arange(start + n, device=device)
    return keys[None, :] <= (start + torch.arange(n, device=device))[:, None]


def attend_row(kv: KVSlots, layer: int, slot: int, length: int, q: torch.Tensor,
               mask: torch.Tensor | None) -> torch.Tensor:
    """One row's attention over its own slot: q [n, Hq, D] -> [n, Hq D]."""
    n, hq, d = q.shape
    keys, values = kv.read(layer, slot, length)  # [Hkv, L, D] each
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], keys[None], values[None], attn_mask=mask,
        is_causal=n > 1 and mask is None, scale=d ** -0.5, enable_gqa=hq != keys.shape[0],
    )  # [1, Hq, n, D]
    return out[0].transpose(0, 1).reshape(n, hq * d)


def attend_short_rows(kv: KVSlots, layer: int, rows: ShortRows, q: torch.Tensor) -> torch.Tensor:
    """The short rows' attention in one call (exact_batching "fast"): each row's queries
    padded to the longest short row, its keys to the longest slot length among them,
    masked. q [Mp, Hq, D] -> [len(rows.tokens), Hq D], in `rows.tokens` order."""
    hq, d = q.shape[1], q.shape[2]
    keys, values = kv.read_many(layer, rows.slots, rows.keys)  # [B, Hkv, L, D]
    qp = q.new_zeros(rows.slots.shape[0] * rows.width, hq, d)
    qp.index_copy_(0, rows.padded, q.index_select(0, rows.tokens))
    qp = qp.view(-1, rows.width, hq, d).transpose(1, 2)  # [B, Hq, W, D]
    out = F.scaled_dot_product_attention(qp, keys, values, attn_mask=rows.mask, scale=d ** -0.5,
                                         enable_gqa=hq != keys.shape[1])  # [B, Hq, W, D]
    return out.transpose(1, 2).reshape(-1, hq * d).index_select(0, rows.padded)
