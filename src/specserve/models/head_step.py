"""The EAGLE head on the target's device, inside the device step's round (ADR 0025).

`drafters/eagle.py` defines the head (one Llama decoder layer over fc([embed(next token);
the target's feature])) and drafts with it on the host, session by session. Here the same
head runs on the target's device over fixed shapes, as part of one run of the device step:

    chain (the round's drafts) -> the target's verify and verdict -> feed (the accepted features)

Its state per session sits beside the target's KV slot, indexed by the same slot:
- `keys`, `values` [slots, kv_heads, max_len, head_dim]: the head's own KV (one layer);
- `hlast` [slots, M, H]: the head's output at position p in row p mod M (M = the widest row
  + 1), the predicted feature the next round's first draft comes from. A round launched
  ahead and thrown away writes only at positions past the committed ones (at most K + 1 past
  the last read one), so the row the next real round reads is never overwritten.

The invariant (with c the committed length after a step): the head's keys and values are
true through position c - 2 and `hlast` holds position c - 2's output. `feed` keeps it for a
judged row: the head runs over the row's committed positions [start, start + a] (a: the
accepted count the verdict just computed), each fed the target's feature there and the token
after it (the accepted drafts, then the final token). `chain` drafts from it: the first draft
from `hlast` through the target's final norm and LM head, then K - 1 head positions fed their
own predictions. Every position a query reads was written by a chain or feed of the same
round or is true, so lanes computed past a row's own count (padding, K smaller than the
bucket's) never matter; their writes go to the scratch slot where they could.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from specserve.device import to_device
from specserve.models.round_drafter import RoundDrafter

if TYPE_CHECKING:
    from specserve.drafters.eagle import EagleHead
    from specserve.models.device_step import DeviceStep
    from specserve.models.step_buckets import Bucket


class DeviceHead(RoundDrafter):
    """An `EagleHead`'s weights and per-slot state on a device step's device (its dtype), and
    its parts of a round (a chain position, `feed`) as tensor functions of the step's buffers
    (the round's mechanics: `RoundDrafter`)."""

    trees = True  # (models/head_trees.py)
    uses_features = True

    def __init__(self, ds: DeviceStep, head: EagleHead) -> None:
        r = ds.r
        cfg = head.cfg
        if cfg.hidden != r.w.embed.shape[1] or cfg.vocab_size != r.vocab_size:
            raise ValueError(f"the EAGLE head (hidden {cfg.hidden}, vocabulary {cfg.vocab_size}) is not this "
                             f"target's ({r.w.embed.shape[1]}, {r.vocab_size})")
        if any(not 0 <= i < len(r.w.layers) for i in cfg.feature_layers):
            raise ValueError(f"the head's feature layers {cfg.feature_layers} are outside the target's "
                             f"{len(r.w.layers)} layers")
        dev, dt = ds.device, r.w.embed.dtype
        sd = {k: v.detach() for k, v in head.state_dict().items()}

        def put(x: torch.Tensor) -> torch.Tensor:
            return x.to(device=dev, dtype=dt).contiguous()

        self.fc = put(sd["fc.weight"])  # [H, 2H]: over [embed(next token); input]
        self.reduce = put(sd["reduce.weight"]) if "reduce.weight" in sd else None  # fused features -> H
        self.attn_norm, self.mlp_norm = put(sd["attn_norm"]), put(sd["mlp_norm"])
        self.wqkv = put(torch.cat([sd["wq.weight"], sd["wk.weight"], sd["wv.weight"]]))
        self.wo, self.w_gate_up, self.w_down = put(sd["wo.weight"]), put(sd["gate_up.weight"]), put(sd["down.weight"])
        super().__init__(ds, cfg.hidden, cfg.heads, cfg.kv_heads, dt)
        self.d, self.eps = cfg.head_dim, cfg.eps
        self.feature_layers = tuple(cfg.feature_layers)
        max_len, slots = r.kv.max_len, r.kv.num_slots
        inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float32, device=dev)
                                        / cfg.head_dim))
        freqs = torch.arange(max_len, dtype=torch.float32, device=dev)[:, None] * inv[None]
        # the runner's `rotate` convention: sin with its first half negated
        self.cos = torch.cat([freqs.cos(), freqs.cos()], -1).to(dt)
        self.sin = torch.cat([-freqs.sin(), freqs.sin()], -1).to(dt)
        self.keys = torch.zeros(slots, self.hkv, max_len, self.d, dtype=dt, device=dev)
        self.values = torch.zeros_like(self.keys)

    # ---- the head's layer over [R, W] queries -------------------------------------------------

    def _layer(self, x: torch.Tensor, pos: torch.Tensor, wslot: torch.Tensor, rslot: torch.Tensor,
               span: int) -> torch.Tensor:
        """x [R W, H] (fc's output) at positions pos [R, W] -> the head's output [R W, H]; each
        query sees its slot's keys at positions <= its own (its row's earlier lanes included:
        their keys are written first). Keys and values go to (wslot, pos) ([R, W]; positions
        past the slot clamped, the caller routes them to the scratch slot)."""
        at = pos.clamp(max=self.max_len - 1).reshape(-1)
        cos, sin = self.cos.index_select(0, at).unsqueeze(1), self.sin.index_select(0, at).unsqueeze(1)
        out: torch.Tensor = self.layer_fn(x, self.attn_norm, self.wqkv, None, None, None, self.wo, None,
                                          self.mlp_norm, self.w_gate_up, self.w_down, self.keys, self.values,
                                          wslot.reshape(-1), at, rslot, self._mask(pos, span), cos, sin, self.eps,
                                          self.hq, self.hkv, self.d, F.linear)
        return out

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """The target's logits from predicted features [R, H] (its final norm, its LM head)."""
        from specserve.models.runner import rms_norm

        r = self.ds.r  # under tensor parallelism each rank's LM head is a vocabulary slice (ADR 0030)
        out: torch.Tensor = r.tp.gather(r.linear(rms_norm(x, r.w.norm, r.w.eps), r.w.lm_head, None))
        return out

    def _position(self, tok: torch.Tensor, x: torch.Tensor, p: torch.Tensor, wslot: torch.Tensor,
                  rslot: torch.Tensor, span: int) -> torch.Tensor:
        """A chain position: the head over fc([embed(tok); x]) at p (its keys to wslot)."""
        return self._layer(self._input(tok, x), p.view(-1, 1), wslot, rslot, span)

    def _input(self, tokens: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
        """fc([embed(tokens); inputs]): the head's layer input [n, H]."""
        return F.linear(torch.cat([self.ds.r.w.embed.index_select(0, tokens), inputs], -1), self.fc)

    def project(self, feats: torch.Tensor) -> torch.Tensor:
        """The target's features [n, F] -> the head's input width (fused layers reduced)."""
        return feats if self.reduce is None else F.linear(feats, self.reduce)

    def feed(self, b: Bucket, src: torch.Tensor | None = None) -> None:
        """The head over each feeding row's committed positions of this step ([start, start +
        a], a from the verdict just computed), with the target's features from the same run;
        `hlast` at position start + a takes its output. Rows that do not feed (`hfeed` 0)
        write to the scratch slot. `src` [R, W]: the lane whose feature and token each fed
        position takes (a token tree's accepted path, `head_trees.py`; None: lane j itself)."""
        ds, r, w = self.ds, b.rows, b.width
        rslot, start, hfeed = ds.field("rslot", r), ds.field("start", r), ds.field("hfeed", r)
        ids = ds.field("ids", b.tokens).view(r, w)
        lstar = self.committed_lane(b)
        lanes = self.lanes[:w].view(1, w)
        feats = ds.features[:b.tokens]
        if src is None:
            nxt = torch.cat([ids[:, 1:], ids[:, :1]], 1)  # the token after each lane (the last: garbage)
        else:
            nxt = ids.gather(1, torch.cat([src[:, 1:], src[:, :1]], 1))
            feats = feats.view(r, w, -1).gather(1, src.unsqueeze(2).expand(r, w, feats.shape[1])).view(r * w, -1)
        nxt = torch.where(lanes == lstar.view(r, 1), ds.picks[:r].view(r, 1), nxt)
        pos = start.view(r, 1) + lanes
        keep = (hfeed.view(r, 1) > 0) & (lanes <= lstar.view(r, 1)) & (pos < self.max_len)
        wslot = torch.where(keep, rslot.view(r, 1), torch.full_like(pos, ds.scratch))
        out = self._layer(self._input(nxt.reshape(-1), self.project(feats)), pos, wslot, rslot, b.span)
        last = out.view(r, w, -1).gather(1, lstar.view(r, 1, 1).expand(r, 1, out.shape[1])).squeeze(1)
        dst = torch.where(hfeed > 0, rslot, torch.full_like(rslot, ds.scratch)) * self.m + \
            (start + lstar).remainder(self.m)
        self.hlast.view(-1, out.shape[1]).index_copy_(0, dst, last)

    def feed_eager(self, slot: int, start: int, feats: torch.Tensor | None, tokens: Sequence[int]) -> None:
        """One row fed outside the device step's shapes (a prefill chunk): positions start ..
        start + n - 1 (`tokens`: those at start .. start + n, all known to the host: the prompt,
        and its next token or the verdict's final token), each with the target's feature there
        and the token after it."""
        next_tokens = tokens[1:]
        n = len(next_tokens)
        if n == 0 or feats is None:
            return
        dev = self.keys.device
        pos = torch.arange(start, start + n, device=dev).view(1, n)
        slot_t = torch.full((1,), slot, dtype=torch.long, device=dev)
        toks = to_device(list(next_tokens), dev, torch.long)
        out = self._layer(self._input(toks, self.project(feats[:n])), pos, slot_t.expand(1, n), slot_t, start + n)
        self.hlast[slot, (start + n - 1) % self.m].copy_(out[n - 1])
