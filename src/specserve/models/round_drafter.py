"""A drafter inside the device step's round (ADR 0025): the parts the target's own EAGLE head
(models/head_step.py) and a draft model on the target's device (models/draft_step.py) share.

A round is one run of the device step: the drafter's `chain` writes the round's drafts into
the step's token ids (lanes 1..K of each row that asks, `hdraft`), the target verifies and
judges them, and the drafter's `feed` takes what the verdict committed. Its state per session
sits beside the target's KV slot, indexed by the same slot; `hlast[slot, p mod M]` holds the
drafter's output at position p (M = the widest row + 1), from which the next round's first
draft comes (position `start - 1 + offset`: the head's output at p predicts the token at
p + 2, a draft model's the token at p + 1). Keyed by position, so that a round launched ahead
and thrown away (it writes only past the committed positions) never overwrites what the next
real round reads.

The round's variants are graphs of their own (one per bucket, K, tree width, chained or not,
and what its sampled rows need, models/step_judge.py); `capture` takes the common ones up
front within a budget.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from specserve.models.device_step import DeviceStep
    from specserve.models.step_buckets import Bucket


class RoundDrafter:
    """The round's mechanics over a drafter's `logits`, `_position`, `feed` (subclasses)."""

    offset = 0  # hlast at position start - 1 + offset gives a row's first draft
    trees = False  # whether it drafts token trees in the round (the head: models/head_trees.py)
    uses_features = False  # whether it reads the target's features (the head)

    def __init__(self, ds: DeviceStep, hidden: int, hq: int, hkv: int, dtype: torch.dtype) -> None:
        dev = ds.device
        self.ds = ds
        self.hq, self.hkv = hq, hkv
        self.max_len, slots = ds.r.kv.max_len, ds.r.kv.num_slots
        self.m = ds.max_width + 1
        self.hlast = torch.zeros(slots, self.m, hidden, dtype=dtype, device=dev)
        self.drafts = torch.zeros(ds.max_rows, max(ds.max_width - 1, 1), dtype=torch.long, device=dev)
        self.lanes = torch.arange(ds.max_width + 1, dtype=torch.long, device=dev)
        self.rows_at = torch.arange(ds.max_rows, dtype=torch.long, device=dev)
        self.path = torch.zeros(ds.max_rows, ds.max_width, dtype=torch.long, device=dev)  # a tree's accepted lanes
        self.q: torch.Tensor | None = None  # the sampled drafts' q (`keep_q`), where rows sample

    # ---- what a drafter defines ----------------------------------------------------------------

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """The next token's logits [R, V] from the drafter's outputs [R, H]."""
        raise NotImplementedError

    def _position(self, tok: torch.Tensor, x: torch.Tensor, p: torch.Tensor, wslot: torch.Tensor,
                  rslot: torch.Tensor, span: int) -> torch.Tensor:
        """One chain position for R rows: the draft `tok` [R] (after the output x [R, H]) at
        positions p [R], keys to wslot [R, 1] -> the drafter's output there [R, H]."""
        raise NotImplementedError

    def feed(self, b: Bucket, src: torch.Tensor | None = None) -> None:
        raise NotImplementedError

    def feed_eager(self, slot: int, start: int, feats: torch.Tensor | None, tokens: Sequence[int]) -> None:
        """Positions start.. of one row fed outside the device step's shapes (a prefill
        chunk): `tokens` are the ones at start, start + 1, ... (all known to the host)."""
        raise NotImplementedError

    # ---- shared parts ----------------------------------------------------------------------------

    @property
    def layer_fn(self) -> Callable[..., Any]:
        """A decoder layer (`device_step.layer_forward`): the target step's compiled one where it
        compiles one (compile "layer"), so the drafter's layers are compiled whole too."""
        from specserve.models.device_step import layer_forward

        return self.ds._layer or layer_forward

    def _mask(self, pos: torch.Tensor, span: int) -> torch.Tensor:
        """[R, 1, G W, S] additive: query (r, j) sees key positions <= pos[r, j]."""
        r, w = pos.shape
        g = self.hq // self.hkv
        seen = self.ds.keys_at[:span].view(1, 1, span) <= pos.unsqueeze(2)  # [R, W, S]
        add = torch.zeros(r, w, span, dtype=self.hlast.dtype, device=pos.device).masked_fill_(~seen, float("-inf"))
        return add.unsqueeze(1).expand(r, g, w, span).reshape(r, 1, g * w, span)

    def _pick(self, x: torch.Tensor) -> torch.Tensor:
        """The greedy token from the drafter's outputs [R, H]."""
        return self.logits(x).argmax(-1)

    def _draft(self, x: torch.Tensor, r: int, s: int, start: torch.Tensor) -> torch.Tensor:
        """Draft s of each row (at position start + 1 + s) from the drafter's outputs [R, H]:
        the argmax, or where the step samples (models/step_judge.py) each sampled row's draw
        from its q with the position's noise (ADR 0027), q kept for the judge."""
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
        """The dense q [R, W - 1, V] of a sampled step's drafts: the drafter's where it drafted
        the row, one-hot at the drafts elsewhere; None where no sampled draft is kept."""
        if self.q is None:
            return None
        r, w = b.rows, b.width
        mine = (self.ds.field("hdraft", r) > 0).view(r, 1, 1)
        return torch.where(mine, self.q[:r, :w - 1], F.one_hot(drafts, self.q.shape[2]).float())

    def chain(self, b: Bucket, k: int) -> None:
        """The round's drafts, written into the step's token ids: row i's lanes 1..hdraft[i]
        (the rest keep what the host put there), k the most a row asks for. The first draft
        from `hlast`, then one drafter position a further draft, each fed its own pick."""
        ds, r, w = self.ds, b.rows, b.width
        if w < 2 or k < 1:
            return
        rslot, start, hdraft = ds.field("rslot", r), ds.field("start", r), ds.field("hdraft", r)
        h = self.hlast.shape[2]
        x = self.hlast.view(-1, h).index_select(0, rslot * self.m + (start - 1 + self.offset).remainder(self.m))
        tok = self._draft(x, r, 0, start)
        self.drafts[:r, 0].copy_(tok)
        scratch = torch.full_like(rslot, ds.scratch)
        for s in range(1, min(k, w - 1)):
            p = start + (s - 1 + self.offset)  # the position whose output gives draft s + 1
            live = (hdraft > s) & (p < self.max_len)
            x = self._position(tok, x, p, torch.where(live, rslot, scratch).view(r, 1), rslot, b.span)
            tok = self._draft(x, r, s, start)
            self.drafts[:r, s].copy_(tok)
        ids = ds.field("ids", b.tokens).view(r, w)
        take = self.lanes[1:w].view(1, w - 1) <= hdraft.view(r, 1)
        ids[:, 1:].copy_(torch.where(take, self.drafts[:r, :w - 1], ids[:, 1:]))

    def committed_lane(self, b: Bucket) -> torch.Tensor:
        """[R]: each row's last committed lane after the verdict just computed (its first
        judged lane + the accepted count)."""
        ds, r, w = self.ds, b.rows, b.width
        jfirst = ds.field("jpos", b.tokens).view(r, w)[:, 0] - self.rows_at[:r] * w
        return (jfirst + ds.verdicts[:r, 0].long()).clamp(0, w - 1)

    # ---- the round, launched (a graph per bucket and variant) ----------------------------------

    def run_round(self, b: Bucket, k: int, w: int = 1) -> None:
        """One round in one run: the drafts (k: the most a row asks for, 0: none; w: the widest
        tree, 1: chains), the target's verify and verdicts, the drafter fed what the verdict
        committed."""
        if w > 1:
            from specserve.models.head_trees import run_tree_round

            run_tree_round(self, b, k, w)  # type: ignore[arg-type]
            return
        self.chain(b, k)
        self.ds._run(b)
        self.feed(b)

    def advance(self, b: Bucket) -> None:
        """The step's buffers moved to the next round of the same rows, from the verdicts on
        the device (the round chained on the device, ADR 0025): each row starts a + 1
        positions further (a its accepted count), fed its final token first; its drafts come
        from the chain. Rows keep their slots, widths, judged lanes, head counts and sampling."""
        ds, r, w = self.ds, b.rows, b.width
        last = self.max_len - 1
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

    def capture(self, max_k: int, budget_s: float, tree_width: int = 1) -> int:
        """Capture up front, within `budget_s` (logged), the rounds the engine's K choice meets
        (issue 51 item 6): every row count and span up to 1024, for each width a chain of K
        <= max_k needs, the round of its drafts and the round that only feeds the drafter,
        chained and not (K is data: one round a width, `launch`); the head's trees of up to
        `tree_width` first candidates, each shape in its own width. A K, a tree or speculation
        off chosen per step then replays a graph captured already; the rest (a tree beside
        wider rows) are captured when first met."""
        ds = self.ds
        # (a round that only feeds: every width, a prompt's chunk in the step included)
        keys: list[tuple[tuple[object, ...], Bucket]] = [(("round", 0, 1), b)
                                                          for b in ds.buckets(range(1, ds.max_width + 1), 1024)]
        for b in ds.buckets(range(1, max_k + 2), 1024):
            for kind in ("round", "chained"):
                keys += [((kind, b.width - 1, 1), b), ((kind, 0, 1), b)]
        for w in range(2, (tree_width if self.trees else 1) + 1):
            for k in range(1, max_k + 1):
                if 1 + w * k <= ds.max_width:
                    keys += [((kind, k, w), b) for b in ds.buckets([1 + w * k], 1024) for kind in ("round", "chained")]

        def run(variant: tuple[object, ...], b: Bucket) -> None:
            kind, kk, ww = variant
            if kind == "chained":
                self.run_chained(b, int(kk), int(ww))  # type: ignore[call-overload]
            else:
                self.run_round(b, int(kk), int(ww))  # type: ignore[call-overload]

        return ds.step_graphs.capture_variants(keys, budget_s, ds.dummy, run)

    def launch(self, b: Bucket, k: int, w: int = 1, chained: bool = False) -> None:
        """`run_round` (or `run_chained`) of the prepared bucket, k the most drafts a row asks
        for and w its widest tree, replayed from its graph where graphs are on (one per bucket,
        k, w, variant and what its sampled rows need). A round of chains drafts as many as its
        bucket's width holds (K is data: each row's `hdraft` says how many it takes, the
        others go to the scratch slot), so a K chosen per step meets the width's one graph."""
        if w == 1 and k:
            k = b.width - 1
        sampled = (self.ds.sampled.key(),) if self.ds.sampled.any else ()
        if chained:
            self.ds.step_graphs.launch_variant(("chained", k, w, *sampled), b, lambda: self.run_chained(b, k, w))
        else:
            self.ds.step_graphs.launch_variant(("round", k, w, *sampled), b, lambda: self.run_round(b, k, w))


def drafter_for(ds: DeviceStep, drafter: Any) -> RoundDrafter:
    """The round's drafter on `ds`'s device: an EagleHead's (models/head_step.py; the runner
    keeps its feature layers) or a draft model's (an HF causal LM: models/draft_step.py)."""
    if hasattr(drafter, "cfg") and hasattr(drafter.cfg, "feature_layers"):  # an EagleHead
        from specserve.models.head_step import DeviceHead

        ds.r.keep_features(drafter.cfg.feature_layers)
        return DeviceHead(ds, drafter)
    from specserve.models.draft_step import DeviceDraft

    return DeviceDraft(ds, drafter)
