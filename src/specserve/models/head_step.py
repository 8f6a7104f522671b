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

if TYPE_CHECKING:
    from specserve.drafters.eagle import EagleHead
    from specserve.models.device_step import DeviceStep
    from specserve.models.step_buckets import Bucket


class DeviceHead:
    """An `EagleHead`'s weights and per-slot state on a device step's device (its dtype), and
    its two parts of a round (`chain`, `feed`) as tensor functions of the step's buffers."""

    def __init__(self, ds: DeviceStep, head: EagleHead) -> None:
        r = ds.r
        cfg = head.cfg
        if cfg.hidden != r.w.embed.shape[1] or cfg.vocab_size != r.vocab_size:
            raise ValueError(f"the EAGLE head (hidden {cfg.hidden}, vocabulary {cfg.vocab_size}) is not this "
                             f"target's ({r.w.embed.shape[1]}, {r.vocab_size})")
        if any(not 0 <= i < len(r.w.layers) for i in cfg.feature_layers):
            raise ValueError(f"the head's feature layers {cfg.feature_layers} are outside the target's "
                             f"{len(r.w.layers)} layers")
        self.ds = ds
        dev, dt = ds.device, r.w.embed.dtype
        sd = {k: v.detach() for k, v in head.state_dict().items()}

        def put(x: torch.Tensor) -> torch.Tensor:
            return x.to(device=dev, dtype=dt).contiguous()

        self.fc = put(sd["fc.weight"])  # [H, 2H]: over [embed(next token); input]
        self.reduce = put(sd["reduce.weight"]) if "reduce.weight" in sd else None  # fused features -> H
        self.attn_norm, self.mlp_norm = put(sd["attn_norm"]), put(sd["mlp_norm"])
        self.wqkv = put(torch.cat([sd["wq.weight"], sd["wk.weight"], sd["wv.weight"]]))
        self.wo, self.w_gate_up, self.w_down = put(sd["wo.weight"]), put(sd["gate_up.weight"]), put(sd["down.weight"])
        self.hq, self.hkv, self.d, self.eps = cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.eps
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
        self.m = ds.max_width + 1
        self.hlast = torch.zeros(slots, self.m, cfg.hidden, dtype=dt, device=dev)
        self.drafts = torch.zeros(ds.max_rows, max(ds.max_width - 1, 1), dtype=torch.long, device=dev)
        self.lanes = torch.arange(ds.max_width, dtype=torch.long, device=dev)
        self.rows_at = torch.arange(ds.max_rows, dtype=torch.long, device=dev)
        self.path = torch.zeros(ds.max_rows, ds.max_width, dtype=torch.long, device=dev)  # a tree's accepted lanes
        self.q: torch.Tensor | None = None  # the sampled drafts' q (`keep_q`), where rows sample

    # ---- the head's layer over [R, W] queries -------------------------------------------------

    def _layer(self, x: torch.Tensor, pos: torch.Tensor, wslot: torch.Tensor, rslot: torch.Tensor,
               span: int) -> torch.Tensor:
        """x [R W, H] (fc's output) at positions pos [R, W] -> the head's output [R W, H]; each
        query sees its slot's keys at positions <= its own (its row's earlier lanes included:
        their keys are written first). Keys and values go to (wslot, pos) ([R, W]; positions
        past the slot clamped, the caller routes them to the scratch slot)."""
        from specserve.models.device_step import layer_forward

        r, w = pos.shape
        at = pos.clamp(max=self.keys.shape[2] - 1).reshape(-1)
        cos, sin = self.cos.index_select(0, at).unsqueeze(1), self.sin.index_select(0, at).unsqueeze(1)
        return layer_forward(x, self.attn_norm, self.wqkv, None, None, None, self.wo, None, self.mlp_norm,
                             self.w_gate_up, self.w_down, self.keys, self.values, wslot.reshape(-1), at, rslot,
                             self._mask(pos, span), cos, sin, self.eps, self.hq, self.hkv, self.d, F.linear)

    def _mask(self, pos: torch.Tensor, span: int) -> torch.Tensor:
        """[R, 1, G W, S] additive: query (r, j) sees key positions <= pos[r, j]."""
        r, w = pos.shape
        g = self.hq // self.hkv
        seen = self.ds.keys_at[:span].view(1, 1, span) <= pos.unsqueeze(2)  # [R, W, S]
        add = torch.zeros(r, w, span, dtype=self.keys.dtype, device=pos.device).masked_fill_(~seen, float("-inf"))
        return add.unsqueeze(1).expand(r, g, w, span).reshape(r, 1, g * w, span)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """The target's logits from predicted features [R, H] (its final norm, its LM head)."""
        from specserve.models.runner import rms_norm

        w = self.ds.r.w
        out: torch.Tensor = self.ds.r.linear(rms_norm(x, w.norm, w.eps), w.lm_head, None)
        return out

    def _pick(self, x: torch.Tensor) -> torch.Tensor:
        """The target's greedy token from predicted features [R, H]."""
        return self.logits(x).argmax(-1)

    def _draft(self, x: torch.Tensor, r: int, s: int, start: torch.Tensor) -> torch.Tensor:
        """Draft s of each row (at position start + 1 + s) from predicted features [R, H]: the
        argmax, or where the step samples (models/step_judge.py) each sampled row's draw from
        its q with the position's noise (as the host's head draws), q kept for the judge."""
        logits = self.logits(x)
        greedy = logits.argmax(-1)
        if not self.ds.sampled.any:
            return greedy
        from specserve.models.step_judge import sampled_picks

        tok, q = sampled_picks(self.ds, r, logits, start + 1 + s, greedy)
        assert self.q is not None
        self.q[:r, s].copy_(q)
        return tok

    def keep_q(self) -> None:
        """The sampled drafts' q [rows, W - 1, V] (float32), kept from now on (the judge reads it)."""
        if self.q is None:
            ds = self.ds
            with torch.inference_mode(False):  # (a buffer written in and out of inference mode)
                self.q = torch.zeros(ds.max_rows, max(ds.max_width - 1, 1), ds.r.vocab_size, device=ds.device)

    def q_of(self, b: Bucket, drafts: torch.Tensor) -> torch.Tensor | None:
        """The dense q [R, W - 1, V] of a sampled step's drafts: the head's where it drafted the
        row, one-hot at the drafts elsewhere; None where no sampled draft of the head is kept."""
        if self.q is None:
            return None
        r, w = b.rows, b.width
        mine = (self.ds.field("hdraft", r) > 0).view(r, 1, 1)
        return torch.where(mine, self.q[:r, :w - 1], F.one_hot(drafts, self.q.shape[2]).float())

    def _input(self, tokens: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
        """fc([embed(tokens); inputs]): the head's layer input [n, H]."""
        return F.linear(torch.cat([self.ds.r.w.embed.index_select(0, tokens), inputs], -1), self.fc)

    def project(self, feats: torch.Tensor) -> torch.Tensor:
        """The target's features [n, F] -> the head's input width (fused layers reduced)."""
        return feats if self.reduce is None else F.linear(feats, self.reduce)

    # ---- a round's two parts (tensor functions of the step's buffers) -------------------------

    def chain(self, b: Bucket, k: int) -> None:
        """The round's drafts, written into the step's token ids: row i's lanes 1..hdraft[i]
        (the rest keep what the host put there), k the most a row asks for. The first draft
        from `hlast` at position start - 1 (the committed length - 2), then one head position
        a further draft, each fed its own prediction and pick."""
        ds, r, w = self.ds, b.rows, b.width
        if w < 2 or k < 1:
            return
        rslot, start, hdraft = ds.field("rslot", r), ds.field("start", r), ds.field("hdraft", r)
        max_len = self.keys.shape[2]
        h = self.hlast.shape[2]
        x = self.hlast.view(-1, h).index_select(0, rslot * self.m + (start - 1).remainder(self.m))
        tok = self._draft(x, r, 0, start)
        self.drafts[:r, 0].copy_(tok)
        scratch = torch.full_like(rslot, ds.scratch)
        for s in range(1, min(k, w - 1)):
            p = start + (s - 1)  # the head position whose output gives draft s + 1
            live = (hdraft > s) & (p < max_len)
            wslot = torch.where(live, rslot, scratch).view(r, 1)
            x = self._layer(self._input(tok, x), p.view(r, 1), wslot, rslot, b.span)
            tok = self._draft(x, r, s, start)
            self.drafts[:r, s].copy_(tok)
        ids = ds.field("ids", b.tokens).view(r, w)
        take = self.lanes[1:w].view(1, w - 1) <= hdraft.view(r, 1)
        ids[:, 1:].copy_(torch.where(take, self.drafts[:r, :w - 1], ids[:, 1:]))

    def feed(self, b: Bucket, src: torch.Tensor | None = None) -> None:
        """The head over each feeding row's committed positions of this step ([start, start +
        a], a from the verdict just computed), with the target's features from the same run;
        `hlast` at position start + a takes its output. Rows that do not feed (`hfeed` 0)
        write to the scratch slot. `src` [R, W]: the lane whose feature and token each fed
        position takes (a token tree's accepted path, `head_trees.py`; None: lane j itself)."""
        ds, r, w = self.ds, b.rows, b.width
        rslot, start, hfeed = ds.field("rslot", r), ds.field("start", r), ds.field("hfeed", r)
        ids = ds.field("ids", b.tokens).view(r, w)
        jfirst = ds.field("jpos", b.tokens).view(r, w)[:, 0] - self.rows_at[:r] * w  # a row's first judged lane
        lstar = (jfirst + ds.verdicts[:r, 0].long()).clamp(0, w - 1)  # the last committed lane
        lanes = self.lanes[:w].view(1, w)
        feats = ds.features[:b.tokens]
        if src is None:
            nxt = torch.cat([ids[:, 1:], ids[:, :1]], 1)  # the token after each lane (the last: garbage)
        else:
            nxt = ids.gather(1, torch.cat([src[:, 1:], src[:, :1]], 1))
            feats = feats.view(r, w, -1).gather(1, src.unsqueeze(2).expand(r, w, feats.shape[1])).view(r * w, -1)
        nxt = torch.where(lanes == lstar.view(r, 1), ds.picks[:r].view(r, 1), nxt)
        pos = start.view(r, 1) + lanes
        keep = (hfeed.view(r, 1) > 0) & (lanes <= lstar.view(r, 1)) & (pos < self.keys.shape[2])
        wslot = torch.where(keep, rslot.view(r, 1), torch.full_like(pos, ds.scratch))
        out = self._layer(self._input(nxt.reshape(-1), self.project(feats)), pos, wslot, rslot, b.span)
        last = out.view(r, w, -1).gather(1, lstar.view(r, 1, 1).expand(r, 1, out.shape[1])).squeeze(1)
        dst = torch.where(hfeed > 0, rslot, torch.full_like(rslot, ds.scratch)) * self.m + \
            (start + lstar).remainder(self.m)
        self.hlast.view(-1, out.shape[1]).index_copy_(0, dst, last)

    def feed_eager(self, slot: int, start: int, feats: torch.Tensor, next_tokens: Sequence[int]) -> None:
        """One row fed outside the device step's shapes (a prefill chunk): positions start ..
        start + n - 1, each with the target's feature there and the token after it (all
        known to the host: the prompt's next token, or the verdict's final token)."""
        n = len(next_tokens)
        if n == 0:
            return
        dev = self.keys.device
        pos = torch.arange(start, start + n, device=dev).view(1, n)
        slot_t = torch.full((1,), slot, dtype=torch.long, device=dev)
        toks = to_device(list(next_tokens), dev, torch.long)
        out = self._layer(self._input(toks, self.project(feats[:n])), pos, slot_t.expand(1, n), slot_t, start + n)
        self.hlast[slot, (start + n - 1) % self.m].copy_(out[n - 1])

    # ---- the round, launched (a graph per bucket and variant) ----------------------------------

    def run_round(self, b: Bucket, k: int, w: int = 1) -> None:
        """One round in one run: the head's drafts (k: the most a row asks for, 0: none; w: the
        widest tree, 1: chains), the target's verify and verdicts, the head fed what the
        verdict committed."""
        if w > 1:
            from specserve.models.head_trees import run_tree_round

            run_tree_round(self, b, k, w)
            return
        self.chain(b, k)
        self.ds._run(b)
        self.feed(b)

    def advance(self, b: Bucket) -> None:
        """The step's buffers moved to the next round of the same rows, from the verdicts on
        the device (the round chained on the device, ADR 0025): each row starts a + 1
        positions further (a its accepted count), fed its final token first; its drafts come
        from the chain. Rows keep their slots, widths, judged lanes and head counts."""
        ds, r, w = self.ds, b.rows, b.width
        last = self.keys.shape[2] - 1
        start, shift = ds.field("start", r), ds.verdicts[:r, 0].long() + 1
        start.add_(shift)
        at = (start.view(r, 1) + self.lanes[:w].view(1, w)).clamp(max=last).reshape(-1)
        ds.field("at", b.tokens).copy_(at)
        pos = ds.field("pos", b.tokens)  # (rotary positions: a tree's by depth, kept)
        pos.copy_((pos.view(r, w) + shift.view(r, 1)).clamp(max=last).reshape(-1))
        ds.field("ids", b.tokens).view(r, w)[:, 0].copy_(ds.picks[:r])

    def run_chained(self, b: Bucket, k: int, w: int = 1) -> None:
        self.advance(b)
        self.run_round(b, k, w)

    def capture(self, k: int, budget_s: float) -> int:
        """Capture up front, within `budget_s` (logged), the rounds serving meets most: every
        row count, rows of K <= k drafts, spans up to 1024; a round with k drafts, chained and
        not, and a round that only feeds the head. The rest are captured when first met."""
        keys: list[tuple[tuple[object, ...], Bucket]] = []
        for b in self.ds.buckets([1 + k], 1024):
            keys += [(("round", k, 1), b), (("chained", k, 1), b), (("round", 0, 1), b)]

        def run(variant: tuple[object, ...], b: Bucket) -> None:
            kind, kk, ww = variant
            if kind == "chained":
                self.run_chained(b, int(kk), int(ww))  # type: ignore[call-overload]
            else:
                self.run_round(b, int(kk), int(ww))  # type: ignore[call-overload]

        return self.ds.step_graphs.capture_variants(keys, budget_s, self.ds.dummy, run)

    def launch(self, b: Bucket, k: int, w: int = 1, chained: bool = False) -> None:
        """`run_round` (or `run_chained`) of the prepared bucket, k the most drafts a row asks
        for and w its widest tree, replayed from its graph where graphs are on (one per bucket,
        k, w and variant)."""
        sampled = (self.ds.sampled.key(),) if self.ds.sampled.any else ()  # (a graph per what it samples)
        if chained:
            self.ds.step_graphs.launch_variant(("chained", k, w, *sampled), b, lambda: self.run_chained(b, k, w))
        else:
            self.ds.step_graphs.launch_variant(("round", k, w, *sampled), b, lambda: self.run_round(b, k, w))
