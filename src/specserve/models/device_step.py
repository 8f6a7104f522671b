"""The device step (ADR 0019): decode, verify and draft rows run as one fixed-shape forward,
prepared on the host and run on the device, replayed from a CUDA graph per bucket.

A step of short rows (each at most `max_width` tokens: a plain token, the last token + K
drafts, a draft's new committed tokens or its own pick) is laid out as a bucket of
(rows R, width W, span S): every row padded to W tokens, the batch to R rows, and each row
attending to the first S positions of its KV slot, S at least its length after the step
(the ladders of sizes: `step_buckets.py`).

- `prepare(rows)` is the host's part (`step_inputs.py`): the bucket, then every number the
  forward needs (token ids, positions, the KV slot each token writes and each row reads, the
  rows' cached lengths, where each row's judged positions are) written into one host array and
  copied into persistent device buffers in one non-blocking copy (tokens already on the device,
  a draft's picks, are put in place there). Nothing on the device is read.
- `run(bucket)` is the device's part: a pure tensor function of those buffers whose shapes
  depend on the bucket alone (no `.item()`, no branch on data, no host tensor): embed, the
  layers with attention over the rows' slots under a mask built from the lengths and a per-row
  block mask (causal by default; a token tree's ancestor mask fits the same tensor), the LM
  head into a persistent logits buffer, and the greedy verdict of every row (argmax at its
  judged positions against the tokens after them) into a persistent verdict buffer.
- On CUDA (`graphs=True`), `run` is captured once per bucket into a CUDA graph (lazily, on
  the first step of that bucket, or up front by `capture`) and replayed; graphs share one
  memory pool (`step_graphs.py`). Elsewhere, or past `max_graphs`, `run` runs eagerly: the
  same function.

Padding never touches a session's KV: padding tokens write into a scratch slot the step keeps
for itself, and padding rows read it. `tests/unit/test_device_step.py` holds the graph-safety
audit (same buffers, no host read, no new shapes over steps of one bucket) on the fake CUDA
device, and the exactness checks against the eager forward.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from specserve.algorithm.rejection import greedy_judge
from specserve.algorithm.sampling import draft_heads
from specserve.device import to_device
from specserve.models.step_buckets import Bucket, bucket_ladders, round_up
from specserve.models.step_fusion import fused_layer, fused_layers
from specserve.models.step_graphs import StepCounts, StepGraphs
from specserve.models.step_inputs import StepInputs
from specserve.models.step_judge import NO_SAMPLING, SampledFlags, flags_of, judge_sampled

if TYPE_CHECKING:
    from specserve.drafters.eagle import EagleHead
    from specserve.models.round_drafter import RoundDrafter
    from specserve.models.runner import ModelRunner, Row

# a projection: F.linear, or the oneDNN-packed one (models/runner.py: onednn_linear)
Linear = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]
Reduce = Callable[[torch.Tensor], torch.Tensor]  # a tensor-parallel group's all-reduce (ADR 0030)

SCRATCH = "\0device-step-scratch"


def attention_in(h: torch.Tensor, norm: torch.Tensor | None, wqkv: torch.Tensor, bqkv: torch.Tensor | None,
                 q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                 eps: float, hq: int, hkv: int, d: int, linear: Linear) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer up to attention: h [T, H] -> q and k stacked, RoPE applied [T, Hq + Hkv, D],
    and v [T, Hkv, D]. The same ops as the eager forward's `_qkv` (q and k rotated in one
    pass: elementwise, the same values as apart). `norm` None: h is normed already (the
    layer before normed it, models/step_fusion.py)."""
    from specserve.models.runner import rms_norm, rotate

    x = h if norm is None else rms_norm(h, norm, eps)
    qkv = linear(x, wqkv, bqkv).view(h.shape[0], hq + 2 * hkv, d)
    if q_norm is not None and k_norm is not None:
        qk = torch.cat([rms_norm(qkv[:, :hq], q_norm, eps), rms_norm(qkv[:, hq:hq + hkv], k_norm, eps)], 1)
    else:
        qk = qkv[:, :hq + hkv]
    return rotate(qk, cos, sin), qkv[:, hq + hkv:]


def attention_out(h: torch.Tensor, o: torch.Tensor, wo: torch.Tensor, bo: torch.Tensor | None,
                  norm: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, eps: float,
                  linear: Linear, reduce: Reduce | None = None) -> torch.Tensor:
    """A layer after attention: the output projection and residual, then the MLP and its
    residual; h [T, H], o [T, Hq D] -> the next h. `reduce`: a tensor-parallel rank's sum of
    the two row-parallel projections over its group (ADR 0030); None on one device."""
    from specserve.models.runner import rms_norm

    def summed(x: torch.Tensor) -> torch.Tensor:
        return x if reduce is None else reduce(x)

    h = h + summed(linear(o, wo, bo))
    gate, up = linear(rms_norm(h, norm, eps), w_gate_up, None).chunk(2, dim=-1)
    out: torch.Tensor = h + summed(linear(F.silu(gate) * up, w_down, None))
    return out


def startup_widths(max_k: int, tree_width: int, max_width: int) -> list[int]:
    """The row widths start-up captures (issue 51 item 6): plain rows, verify rows of each
    K <= max_k, trees of w first candidates with chains of K (1 + w K), within `max_width`."""
    chains = [1 + k for k in range(max_k + 1)]
    trees = [1 + w * k for w in range(2, tree_width + 1) for k in range(1, max_k + 1)]
    return sorted({x for x in chains + trees if x <= max_width})


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, rslot: torch.Tensor,
           mask: torch.Tensor) -> torch.Tensor:
    """q [R W, Hq, D] -> [R W, Hq D]: each row over the first S positions of its slot
    (keys, values: one layer's [slots, Hkv, S, D] views), in one SDPA call under the additive
    mask [R, 1, G W, S]. GQA without copying keys: the G query heads of a KV head are one axis."""
    r, s = rslot.shape[0], mask.shape[-1]
    t, hq, d = q.shape
    w, hkv = t // r, keys.shape[1]
    g = hq // hkv
    k = keys[:, :, :s].index_select(0, rslot)  # [R, Hkv, S, D]
    v = values[:, :, :s].index_select(0, rslot)
    qf = q.view(r, w, hkv, g, d).permute(0, 2, 3, 1, 4).reshape(r, hkv, g * w, d)
    out = F.scaled_dot_product_attention(qf, k, v, attn_mask=mask, scale=d ** -0.5)  # [R, Hkv, G W, D]
    return out.view(r, hkv, g, w, d).permute(0, 3, 1, 2, 4).reshape(r * w, hq * d)


def layer_forward(h: torch.Tensor, attn_norm: torch.Tensor, wqkv: torch.Tensor, bqkv: torch.Tensor | None,
                  q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, wo: torch.Tensor,
                  bo: torch.Tensor | None, mlp_norm: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                  keys: torch.Tensor, values: torch.Tensor, wslot: torch.Tensor, at: torch.Tensor,
                  rslot: torch.Tensor, mask: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float,
                  hq: int, hkv: int, d: int, linear: Linear, reduce: Reduce | None = None) -> torch.Tensor:
    """One decoder layer of the device step, whole: `attention_in`, the new keys and values
    written into the KV (`KVSlots.write`'s scatter), `attend`, `attention_out`. Compiled as one
    program (compile "layer"), its KV scatter, gathers and layout copies fuse around the GEMMs
    and SDPA; the same ops as `run`'s uncompiled loop. (Attention written out as reductions for
    the compiler to fuse lost on the H200: 0.48 against 0.27 ms a one-row graph, 1.0 against
    0.3 ms a verify graph; ADR 0019, run 7.)"""
    qk, v = attention_in(h, attn_norm, wqkv, bqkv, q_norm, k_norm, cos, sin, eps, hq, hkv, d, linear)
    keys[wslot, :, at] = qk[:, hq:]
    values[wslot, :, at] = v
    return attention_out(h, attend(qk[:, :hq], keys, values, rslot, mask), wo, bo, mlp_norm, w_gate_up, w_down,
                         eps, linear, reduce)


class DeviceStep:
    """The fixed-shape step of one `ModelRunner` (which owns the weights and KV): its buckets,
    its device buffers and run (here), its host-written inputs (`StepInputs`) and its CUDA
    graphs (`StepGraphs`)."""

    def __init__(self, runner: ModelRunner, max_rows: int, max_width: int = 16, graphs: bool = False,
                 max_graphs: int = 2048, compile: bool | str = False, heads: bool = False, fuse: bool = False) -> None:
        """`compile`: False; True or "whole" (torch.compile the whole run, dynamic shapes);
        "pieces" (compile a layer's two pieces around attention, `attention_in` and
        `attention_out`: one program serves every layer and bucket); or "layer" (compile
        `layer_forward`, a whole layer with its KV scatter and attention: one program too).
        `fuse`: each layer's program ends with the next layer's norm (models/step_fusion.py)."""
        self.r = runner
        self.device = runner.device
        # compiled (torch.compile, dynamic shapes): no bucket of 1 row or 1 token, so one compiled
        # program serves every bucket (a size of 1 would be specialised: a compile of its own)
        least = 2 if compile and compile not in ("pieces", "layer") else 1
        max_len = runner.kv.max_len
        self.row_buckets, self.width_buckets, self.span_buckets = bucket_ladders(max_rows, max_width, max_len, least)
        self.max_rows, self.max_width = max_rows, max_width
        self.step_graphs = StepGraphs(self.device, graphs and self.device.type == "cuda", max_graphs)
        self.scratch = runner.kv.allocate(SCRATCH)  # padding writes here (one slot of the budget)
        # one int64 buffer, its fields at fixed offsets: one copy in per step, fixed addresses
        self.inputs = StepInputs(max_rows, max_width, self.scratch, max_len, runner.vocab_size, self.device)
        t, r, w = max_rows * max_width, max_rows, max_width
        self.keys_at = torch.arange(max_len, dtype=torch.long, device=self.device)  # key positions
        # the rows' block masks: [R, W, W] bool, query i sees new token j; causal unless a step says otherwise
        self.causal = torch.ones(w, w, dtype=torch.bool, device=self.device).tril()
        self.within = self.causal.expand(r, w, w).clone()
        self._custom_mask = False
        self.logits = torch.zeros(t, runner.vocab_size, dtype=torch.float32, device=self.device)
        self.verdicts = torch.zeros(r, 2, dtype=torch.float64, device=self.device)  # accepted, final token
        self.picks = torch.zeros(r, dtype=torch.long, device=self.device)  # the final token, as an id
        self.features = torch.zeros(0, device=self.device)  # [T, F]: the runner's feature layers' outputs
        # a draft's greedy picks with their heads (`algorithm.sampling.draft_heads`: token, runner-up, and both
        # their probabilities), at each row's last position, computed in the same run
        self.with_heads = heads
        self.heads = torch.zeros(r, 4, dtype=torch.float64, device=self.device)
        # a draft's chain of positions in one run (`run_chain`): each position's picks and heads,
        # and the prepared numbers it starts from (restored at its end, so a replay starts there too)
        self.max_chain = max_width
        self.chain_picks = torch.zeros(self.max_chain, r, dtype=torch.long, device=self.device)
        self.chain_heads = torch.zeros(self.max_chain, r, 4, dtype=torch.float64, device=self.device)
        self.chain_base = torch.zeros(5, r, dtype=torch.long, device=self.device)
        self._run = self.run
        self._whole = False  # the run compiled whole (compile True or "whole")
        self._pre, self._post = attention_in, attention_out
        self._layer: Callable[..., torch.Tensor] | None = None
        self._fused: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = fused_layer if fuse else None
        if compile:
            self._compile(compile)
        if runner.feature_layers:
            self.keep_features()
        self.last: Bucket | None = None
        # the drafter run inside the step's rounds: the target's own EAGLE head or a draft model
        # (ADR 0025; `enable_head`)
        self.head: RoundDrafter | None = None
        # the prepared step: (the most drafts a row asks of the head, any row feeds it, its widest tree)
        self._head_rows = (0, False, 1)
        self.sampled: SampledFlags = NO_SAMPLING  # what its rows at T > 0 need (models/step_judge.py)

    def enable_head(self, drafter: EagleHead | Any) -> RoundDrafter:
        """Run a drafter inside this step's rounds (ADR 0025): the target's own EAGLE head
        (models/head_step.py; the runner keeps the head's feature layers, and graphs captured
        before are dropped: the features change them), or a draft model with the target's
        vocabulary (an HF model the runner supports: models/draft_step.py)."""
        from specserve.models.round_drafter import drafter_for

        self.head = drafter_for(self, drafter)
        return self.head

    def _compile(self, how: bool | str) -> None:
        """torch.compile the run whole, or a layer's two pieces around attention ("pieces")."""
        import torch._dynamo as dynamo

        # one compiled program per step object (its buffers are guarded): room for several
        dynamo.config.cache_size_limit = max(dynamo.config.cache_size_limit, 64)
        if how == "pieces":  # a layer's two pointwise-heavy pieces, one program for every layer
            self._pre = torch.compile(attention_in, dynamic=True)
            self._post = torch.compile(attention_out, dynamic=True)
        elif how == "layer":  # a whole layer, KV scatter and attention in: one program for every layer
            self._layer = torch.compile(layer_forward, dynamic=True)
            if self._fused is not None:  # (and the next layer's norm)
                self._fused = torch.compile(fused_layer, dynamic=True)
        else:
            self._run, self._whole = torch.compile(self.run, dynamic=True), True

    @property
    def ints(self) -> torch.Tensor:
        """The step's int buffer (`StepInputs.buffer`): every number a run reads but the masks."""
        return self.inputs.buffer

    @property
    def counts(self) -> StepCounts:
        return self.step_graphs.counts

    @property
    def graphs(self) -> dict[Bucket, torch.cuda.CUDAGraph]:
        """The captured graphs of plain steps, by bucket (a draft's chains have their own)."""
        return self.step_graphs.graphs

    @property
    def graphs_on(self) -> bool:
        return self.step_graphs.on

    def keep_features(self) -> None:
        """Write the runner's `feature_layers` outputs of every token to `features` in each
        run (ADR 0020); graphs captured before did not, and are dropped."""
        w = self.r.w
        t = self.max_rows * self.max_width
        self.features = torch.zeros(t, w.embed.shape[1] * len(self.r.feature_layers), dtype=w.embed.dtype,
                                    device=self.device)
        self.graphs.clear()

    def field(self, name: str, n: int) -> torch.Tensor:
        """The first `n` entries of one field of the int buffer (a view: a fixed address)."""
        return self.inputs.field(name, n)

    # ---- the host's part -------------------------------------------------------------------

    def bucket_for(self, rows: Sequence[Row], starts: Sequence[int]) -> Bucket | None:
        """The smallest bucket that holds these rows, or None (then the eager forward runs)."""
        r = round_up(len(rows), self.row_buckets)
        w = round_up(max(len(row.tokens) for row in rows), self.width_buckets)
        if r is None or w is None:
            return None
        s = round_up(max(st + len(row.tokens) for row, st in zip(rows, starts, strict=True)), self.span_buckets)
        lora = self.r.lora is not None and any(self.r.lora.slot_of(row.session) for row in rows)  # (ADR 0029)
        return None if s is None else Bucket(r, w, s, lora)

    def prepare(self, rows: Sequence[Row], slots: Sequence[int], starts: Sequence[int], b: Bucket,
                masks: Sequence[torch.Tensor | None] | None = None,
                depths: Sequence[Sequence[int] | None] | None = None,
                chain: Sequence[int] | None = None) -> None:
        """Write the step's numbers into the device buffers (one copy in, no wait: `StepInputs`).
        `masks`: per row an [n, n] bool block mask over its new tokens (a token tree), None =
        causal; `depths`: per row its tokens' positions after the row's start (a tree's depths;
        None: 0, 1, 2, ...). Token i still takes slot position start + i: the mask says who
        sees it. `chain`: per row, the chain positions it drafts (`run_chain`)."""
        lora = [self.r.lora.slot_of(r.session) for r in rows] if b.lora and self.r.lora is not None else None
        self.inputs.write(rows, slots, starts, b, depths, chain, lora)
        self._head_rows = (max((r.head or 0 for r in rows), default=0), any(r.head is not None for r in rows),
                           max((r.head_width for r in rows if r.head), default=1))
        self.sampled = flags_of([r.sampling for r in rows], self.r.vocab_size)
        if self.sampled.any and self.head is not None and self._head_rows[0]:
            self.head.keep_q()  # (its sampled drafts' q, for the judge: allocated once)
        self._set_block_masks(masks)
        self.last = b

    def _set_block_masks(self, masks: Sequence[torch.Tensor | None] | None) -> None:
        """The rows' block masks into `within`: written only where this step or the one before
        had a custom one (a causal step after a causal step copies nothing)."""
        custom = masks is not None and any(m is not None for m in masks)
        if custom or self._custom_mask:
            within = self.causal.expand(self.max_rows, self.max_width, self.max_width).clone()
            for i, m in enumerate(masks or ()):
                if m is not None:
                    n = m.shape[0]
                    within[i, :n, :n] = to_device(m, self.device, torch.bool)
            self.within.copy_(within)
            self._custom_mask = custom

    # ---- the device's part -----------------------------------------------------------------

    def run(self, b: Bucket) -> None:
        """The forward of a prepared bucket: a tensor function of the step buffers, the
        weights and the KV; writes `logits[:T]` and `verdicts[:R]`."""
        w, linear = self.r.w, self.r.linear
        t = b.tokens
        ids, pos, at, wslot = self.field("ids", t), self.field("pos", t), self.field("at", t), self.field("wslot", t)
        cos, sin = w.cos.index_select(0, pos).unsqueeze(1), w.sin.index_select(0, pos).unsqueeze(1)
        mask = self._mask(b)
        h = w.embed.index_select(0, ids)  # [T, H]
        rslot = self.field("rslot", b.rows)
        tp = None if self.r.tp.size == 1 else self.r.tp.reduce  # (ADR 0030: a rank's all-reduce)
        x = decoder_layers(self, b, h, wslot, at, rslot, mask, cos, sin, tp)
        logits = self.logits[:t]
        logits.copy_(self.r.tp.gather(linear(x, w.lm_head, None)))
        jpos = self.field("jpos", t).view(b.rows, b.width)
        top = logits.argmax(-1)  # the first index on ties, as greedy_tokens
        judged_drafts = ids.index_select(0, jpos[:, 1:].reshape(-1)).view(b.rows, b.width - 1)
        judged = greedy_judge(top.index_select(0, jpos.reshape(-1)).view(b.rows, b.width), judged_drafts,
                              self.field("ndraft", b.rows))
        self.verdicts[:b.rows].copy_(judged.packed())
        self.picks[:b.rows].copy_(judged.final)
        if self.sampled.any:  # rows at T > 0, judged here too (models/step_judge.py)
            q = self.head.q_of(b, judged_drafts) if self.head is not None and self._head_rows[0] else None
            judge_sampled(self, b, logits.index_select(0, jpos.reshape(-1)).view(b.rows, b.width, -1), judged_drafts,
                          self.field("ndraft", b.rows), q)
        if self.with_heads:
            last = logits.index_select(0, jpos[:, -1])  # [R, V]: a draft row's one logit position
            self.heads[:b.rows].copy_(draft_heads(last, judged.final, torch.softmax(last, -1)))

    def run_chain(self, b: Bucket, steps: int) -> None:
        """A draft's next `steps` positions in one run (ADR 0019: its K-position loop in one
        graph), from a prepared bucket of one-token rows: each position runs the forward, then
        feeds every row's greedy pick to the next in place (ids), one position further (rotary
        and slot positions, cached lengths). A row whose own chain (`kleft`) is shorter keeps its
        place and writes its extra positions to the scratch slot. Each position's picks and
        heads go to `chain_picks[s]`, `chain_heads[s]`; the prepared numbers are restored at the
        end, so a replay (or a capture's warm-up run) starts from them again."""
        r, max_len = b.rows, self.r.kv.max_len
        ids, pos, at = self.field("ids", r), self.field("pos", r), self.field("at", r)
        start, wslot, kleft = self.field("start", r), self.field("wslot", r), self.field("kleft", r)
        base = self.chain_base[:, :r]
        for i, f in enumerate((ids, pos, at, start, wslot)):
            base[i].copy_(f)
        scratch = self.field("rslot", r).new_full((r,), self.scratch)
        for s in range(steps):
            if s:
                ids.copy_(self.picks[:r])
                pos.copy_((base[1] + s).clamp(max=max_len - 1))
                at.copy_((base[2] + s).clamp(max=max_len - 1))
                start.copy_(base[3] + s)
                wslot.copy_(torch.where(kleft > s, base[4], scratch))
            self.run(b)
            self.chain_picks[s, :r].copy_(self.picks[:r])
            self.chain_heads[s, :r].copy_(self.heads[:r])
        for i, f in enumerate((ids, pos, at, start, wslot)):
            f.copy_(base[i])

    def _mask(self, b: Bucket) -> torch.Tensor:
        """[R, 1, G W, S] additive, in the model's dtype (0 where seen, -inf elsewhere, made
        once a step rather than converted from bool by every layer's attention): query i of
        row r sees the keys before the row's start, and the row's new tokens its block mask
        allows (causal: j <= i). The queries of the G heads that share a KV head are folded
        into one axis (`attend`)."""
        r, w, s = b.rows, b.width, b.span
        g = self.r.w.num_heads // self.r.w.num_kv_heads
        rel = self.keys_at[:s].unsqueeze(0) - self.field("start", r).unsqueeze(1)  # [R, S]
        block = self.within[:r, :w, :w].gather(2, rel.clamp(0, w - 1).unsqueeze(1).expand(r, w, s))  # [R, W, S]
        seen = (rel < 0).unsqueeze(1) | (block & (rel < w).unsqueeze(1))  # [R, W, S]
        # a Python float, not a device scalar: CUDA's masked_fill with a tensor value reads it
        # back to the host (`.item()`), which a graph's capture refuses
        add = torch.zeros(r, w, s, dtype=self.r.w.embed.dtype, device=self.device).masked_fill_(~seen, float("-inf"))
        return add.unsqueeze(1).expand(r, g, w, s).reshape(r, 1, g * w, s)

    # ---- graphs ----------------------------------------------------------------------------

    def launch(self, b: Bucket) -> None:
        """Run the prepared bucket: its graph's replay where graphs are on (captured now if
        this is the bucket's first step), else `run` eagerly. A step with rows of sessions
        that draft on the target's own head runs as its round (`RoundDrafter.launch`)."""
        if self.head is not None and self._head_rows[1]:
            self.head.launch(b, self._head_rows[0], self._head_rows[2])
            return
        # (adapter rows run the uncompiled function: the whole-run program does not take them)
        run = self.run if b.lora and self._whole else self._run
        if self.sampled.any:  # (a graph per bucket and what its sampled rows need)
            self.step_graphs.launch_variant(("sampled", *self.sampled.key()), b, lambda: run(b))
            return
        self.step_graphs.launch(b, lambda: run(b))

    def launch_chain(self, b: Bucket, steps: int) -> None:
        """`run_chain`, replayed from its graph (one per bucket and length) where graphs are on."""
        if steps > self.max_chain:
            raise ValueError(f"a chain of {steps} positions: at most {self.max_chain}")
        self.step_graphs.launch_chain(b, steps, lambda: self.run_chain(b, steps))

    def dummy(self, b: Bucket) -> None:
        """Prepare a step of padding rows only (the scratch slot): for capturing up front."""
        self.prepare([], [], [], b)

    def capture(self, buckets: Sequence[Bucket], budget_s: float) -> int:
        """Capture graphs for `buckets` (the shortest spans and narrowest rows first: what
        serving meets most) until `budget_s` is spent; returns how many were captured. Logged.
        The rest are captured when a step first needs them."""
        return self.step_graphs.capture(buckets, budget_s, self.dummy, lambda b: self._run(b))

    def startup_buckets(self, max_k: int = 4, tree_width: int = 1) -> list[Bucket]:
        """What start-up captures: every row count, plain and verify rows of K <= max_k (the
        engine's K range: a K chosen per step then meets a graph captured already), token
        trees of up to `tree_width` first candidates (1 + w K tokens), spans up to 1024."""
        return self.buckets(startup_widths(max_k, tree_width, self.max_width), 1024)

    def buckets(self, widths: Sequence[int], max_span: int | None = None) -> list[Bucket]:
        """Every (rows, width, span) bucket for these widths, spans up to `max_span`."""
        ws = sorted({round_up(x, self.width_buckets) or self.max_width for x in widths})
        spans = [s for s in self.span_buckets if max_span is None or s <= max(max_span, self.span_buckets[0])]
        return [Bucket(r, w, s) for r in self.row_buckets for w in ws for s in spans]


def decoder_layers(ds: DeviceStep, b: Bucket, h: torch.Tensor, wslot: torch.Tensor, at: torch.Tensor,
                   rslot: torch.Tensor, mask: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   tp: Any) -> torch.Tensor:
    """The decoder layers over the bucket's tokens `h` [T, H], the kept features copied out;
    the final norm's output. Rows of LoRA adapters (ADR 0029) run the masked products,
    uncompiled and unfused; otherwise the fused layers where on (models/step_fusion.py)."""
    from specserve.models.runner import rms_norm

    w, linear, t = ds.r.w, ds.r.linear, b.tokens
    lora = ds.r.lora if b.lora else None
    if ds._fused is not None and lora is None:  # each layer ends with the next one's norm
        return fused_layers(ds, ds._fused, h, wslot, at, rslot, mask, cos, sin, tp)
    hq, hkv, d, kept, width = w.num_heads, w.num_kv_heads, w.head_dim, ds.r.feature_layers, w.embed.shape[1]
    pre, post = (attention_in, attention_out) if lora is not None else (ds._pre, ds._post)
    for li, layer in enumerate(w.layers):
        if ds._layer is not None and lora is None:
            h = ds._layer(h, layer.attn_norm, layer.wqkv, layer.bqkv, layer.q_norm, layer.k_norm, layer.wo,
                          layer.bo, layer.mlp_norm, layer.w_gate_up, layer.w_down, ds.r.kv.keys[li],
                          ds.r.kv.values[li], wslot, at, rslot, mask, cos, sin, w.eps, hq, hkv, d, linear, tp)
        else:
            lin = linear if lora is None else lora.linear(linear, li, layer, ds.field("lora", t))
            qk, v = pre(h, layer.attn_norm, layer.wqkv, layer.bqkv, layer.q_norm, layer.k_norm, cos, sin,
                        w.eps, hq, hkv, d, lin)
            ds.r.kv.write(li, wslot, at, qk[:, hq:], v)
            o = attend(qk[:, :hq], ds.r.kv.keys[li], ds.r.kv.values[li], rslot, mask)
            h = post(h, o, layer.wo, layer.bo, layer.mlp_norm, layer.w_gate_up, layer.w_down, w.eps, lin, tp)
        if li in kept:
            j = kept.index(li)
            ds.features[:t, j * width:(j + 1) * width].copy_(h)
    return rms_norm(h, w.norm, w.eps)
