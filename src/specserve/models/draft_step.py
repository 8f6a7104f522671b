"""A draft model on the target's device, inside the device step's round (ADR 0025, issue 51
item 3): the draft's K positions are part of the round's one run (one CUDA graph with the
verify and the verdict), its layers compiled whole as the target's are where the target's
step compiles them (compile "layer"), and rounds chain on the device as the head's do.

The draft model (a Llama-family decoder with the target's vocabulary) is loaded as the runner
loads the target (`runner.load_weights`: its own weights on the target's device, in its dtype).
Its state per session sits beside the target's KV slot, indexed by the same slot:
- `keys[l]`, `values[l]` [slots, kv_heads, max_len, head_dim]: the draft's KV, every layer;
- `hlast[slot, p mod M]`: its last layer's output at position p, whose logits give the token
  at p + 1 (`RoundDrafter`).

The invariant (c the committed length after a step): the draft's KV is true through position
c - 1 (the last committed token fed), and `hlast` holds position c - 1's output, from which
the next round's first draft comes. `feed` keeps it for a judged row: the draft runs over the
row's lanes 0 .. a (the accepted drafts, their KV written again with the committed tokens)
and the verdict's final token at lane a + 1, one forward of W + 1 lanes (positions start ..
c - 1); `chain` drafts from it: the first draft from `hlast`, then K - 1 positions, each fed
its own pick. So a round costs the draft K forwards: the feed and K - 1 chain positions (the
host-driven draft step ran K, its first feeding the new committed tokens). The host's mirror
(`worker/head_rounds.py: HeadRows.through`) is the head's: "current for committed length
through + 2". Chains only (no trees); sampled rows draw from the draft's q with the position's
noise (ADR 0027), q kept for the judge.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from specserve.device import to_device
from specserve.models.round_drafter import RoundDrafter

if TYPE_CHECKING:
    from specserve.models.device_step import DeviceStep
    from specserve.models.step_buckets import Bucket


class DeviceDraft(RoundDrafter):
    """A draft model's weights and per-slot KV on a device step's device, and its parts of a
    round (a chain position, `feed`) as tensor functions of the step's buffers."""

    offset = 1  # hlast at position start (the row's first token's) gives its first draft

    def __init__(self, ds: DeviceStep, model: Any) -> None:
        from specserve.models.runner import load_weights, unsupported_reason

        r = ds.r
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"the draft model cannot run inside the target's step: {reason}")
        dt = r.w.embed.dtype
        self.w = load_weights(model.config, {k: v.detach() for k, v in model.state_dict().items()}, ds.device, dt)
        if self.w.vocab_size != r.vocab_size:
            raise ValueError(f"the draft model's vocabulary ({self.w.vocab_size}) is not the target's ({r.vocab_size})")
        if self.w.cos.shape[0] < r.kv.max_len:
            raise ValueError(f"the draft model has {self.w.cos.shape[0]} positions, the target's slots "
                             f"{r.kv.max_len}: lower max_len")
        super().__init__(ds, self.w.embed.shape[1], self.w.num_heads, self.w.num_kv_heads, dt)
        shape = (r.kv.num_slots, self.w.num_kv_heads, r.kv.max_len, self.w.head_dim)
        self.keys = [torch.zeros(shape, dtype=dt, device=ds.device) for _ in self.w.layers]
        self.values = [torch.zeros_like(k) for k in self.keys]

    @property
    def kv_bytes(self) -> int:
        """The draft's KV over every slot (beside the target's budget, not in it)."""
        return sum(2 * k.numel() * k.element_size() for k in self.keys)

    def _forward(self, tokens: torch.Tensor, pos: torch.Tensor, wslot: torch.Tensor, rslot: torch.Tensor,
                 span: int) -> torch.Tensor:
        """The draft over tokens [R W] at positions pos [R, W] -> its last layer's outputs
        [R W, H]; each query sees its slot's keys at positions <= its own (its row's earlier
        lanes included). Keys and values go to (wslot, pos) (positions past the slot clamped;
        the caller routes those to the scratch slot)."""
        w = self.w
        at = pos.clamp(max=self.max_len - 1).reshape(-1)
        cos, sin = w.cos.index_select(0, at).unsqueeze(1), w.sin.index_select(0, at).unsqueeze(1)
        mask = self._mask(pos, span)
        h = w.embed.index_select(0, tokens)
        layer = self.layer_fn
        for li, lay in enumerate(w.layers):
            h = layer(h, lay.attn_norm, lay.wqkv, lay.bqkv, lay.q_norm, lay.k_norm, lay.wo, lay.bo, lay.mlp_norm,
                      lay.w_gate_up, lay.w_down, self.keys[li], self.values[li], wslot.reshape(-1), at, rslot, mask,
                      cos, sin, w.eps, w.num_heads, w.num_kv_heads, w.head_dim, F.linear)
        return h

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        from specserve.models.runner import rms_norm

        out: torch.Tensor = F.linear(rms_norm(x, self.w.norm, self.w.eps), self.w.lm_head)
        return out

    def _position(self, tok: torch.Tensor, x: torch.Tensor, p: torch.Tensor, wslot: torch.Tensor,
                  rslot: torch.Tensor, span: int) -> torch.Tensor:
        return self._forward(tok, p.view(-1, 1), wslot, rslot, span)

    def feed(self, b: Bucket, src: torch.Tensor | None = None) -> None:
        """The draft over each feeding row's committed positions of this step (lanes 0 .. a,
        then the final token at lane a + 1: positions start .. c - 1), one forward of W + 1
        lanes; `hlast` at c - 1 takes its output. Rows that do not feed write to the scratch slot."""
        ds, r, w = self.ds, b.rows, b.width
        rslot, start, hfeed = ds.field("rslot", r), ds.field("start", r), ds.field("hfeed", r)
        ids = ds.field("ids", b.tokens).view(r, w)
        end = (self.committed_lane(b) + 1).view(r, 1)  # the lane of the final token
        lanes = self.lanes[:w + 1].view(1, w + 1)
        toks = torch.where(lanes == end, ds.picks[:r].view(r, 1), torch.cat([ids, ids[:, :1]], 1))
        pos = start.view(r, 1) + lanes
        keep = (hfeed.view(r, 1) > 0) & (lanes <= end) & (pos < self.max_len)
        wslot = torch.where(keep, rslot.view(r, 1), torch.full_like(pos, ds.scratch))
        # (one more key position than the bucket's span: the final token's own)
        out = self._forward(toks.reshape(-1), pos, wslot, rslot, min(b.span + 1, self.max_len))
        last = out.view(r, w + 1, -1).gather(1, end.view(r, 1, 1).expand(r, 1, out.shape[1])).squeeze(1)
        dst = torch.where(hfeed > 0, rslot, torch.full_like(rslot, ds.scratch)) * self.m + \
            (start + end.view(r)).remainder(self.m)
        self.hlast.view(-1, out.shape[1]).index_copy_(0, dst, last)

    def feed_eager(self, slot: int, start: int, feats: torch.Tensor | None, tokens: Sequence[int]) -> None:
        """One row's positions start .. start + n - 1 (`tokens`, n of them) fed outside the
        device step's shapes (a prefill chunk and the token after it)."""
        n = len(tokens)
        if n == 0:
            return
        dev = self.hlast.device
        pos = torch.arange(start, start + n, device=dev).view(1, n)
        slot_t = torch.full((1,), slot, dtype=torch.long, device=dev)
        out = self._forward(to_device(list(tokens), dev, torch.long), pos, slot_t.expand(1, n), slot_t,
                            min(start + n, self.max_len))
        self.hlast[slot, (start + n - 1) % self.m].copy_(out[n - 1])
