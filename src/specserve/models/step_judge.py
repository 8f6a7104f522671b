"""Sampled verdicts inside the device step's run (ADR 0025): rows at T > 0 judged on the
device, in the same run (the same CUDA graph) as their forward, with the counter-based
uniforms computed there from the row's seed and the positions the device knows.

A row's sampling is data in the step's int buffer (`StepInputs`): its mode (0 greedy, 1
rejection sampling, 2 the coupled verdict of a seeded row, ADR 0027), seed, top-k, and its
temperature and top-p as float64 bit patterns. The run:
- `row_probs`: each judged position's p, the host's `logits_to_probs` (temperature, top-k,
  top-p, softmax) with the row's parameters as tensors, op for op the host's, so the same
  logits give the same p;
- `device_uniforms`: `StepUniforms` of the row's positions (start + the judged lane + 1 ..),
  drawn by `rng.uniform_on_device`, the host stream's numbers bit for bit;
- `rejection_judge` or `coupled_judge` (algorithm/rejection.py, the host's own functions) on
  them, their verdicts written over the greedy ones for the sampled rows.
q is one-hot at the drafts (plain rows, n-gram or suffix drafts), or the target's own head's
(or draft model's) dense q where it drafted the row on the device (`DeviceHead.q`). A row
whose q comes from the host (a draft model's block) stays host-judged (`BatchedTarget._judge`).

What a step needs is chosen on the host from its rows (`SampledFlags`: which verdicts, top-k,
top-p), so a greedy step runs none of it and each combination is a graph of its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from specserve.algorithm.rejection import StepUniforms, coupled_judge, rejection_judge
from specserve.algorithm.rng import Purpose, signed64, uniform_on_device
from specserve.algorithm.sampling import keys_of

if TYPE_CHECKING:
    from specserve.models.device_step import DeviceStep
    from specserve.models.step_buckets import Bucket
    from specserve.params import SamplingParams

GREEDY, REJECTION, COUPLED = 0, 1, 2


@dataclass(frozen=True)
class SampledFlags:
    """What a prepared step's sampled rows need (Python flags: a graph per combination)."""

    rejection: bool = False
    coupled: bool = False
    top_k: bool = False
    top_p: bool = False

    @property
    def any(self) -> bool:
        return self.rejection or self.coupled

    def key(self) -> tuple[bool, ...]:
        return (self.rejection, self.coupled, self.top_k, self.top_p)


NO_SAMPLING = SampledFlags()


def mode_of(sampling: SamplingParams | None) -> int:
    """A row's verdict on the device: greedy (also no sampling given), rejection, coupled."""
    if sampling is None or sampling.greedy:
        return GREEDY
    return COUPLED if sampling.coupled else REJECTION


def row_fields(sampling: SamplingParams | None, seed: int, vocab: int) -> tuple[int, int, int, float, float]:
    """(mode, seed, top_k, temperature, top_p) of a row as the int buffer stores them (top-k 0:
    none; a greedy row's temperature 1 and top-p 1, so its unused p stays finite)."""
    mode = mode_of(sampling)
    if mode == GREEDY or sampling is None:
        return GREEDY, 0, 0, 1.0, 1.0
    k = sampling.top_k if 0 < sampling.top_k < vocab else 0
    return mode, signed64(seed), k, float(sampling.temperature), float(sampling.top_p)


def flags_of(rows_sampling: list[SamplingParams | None], vocab: int) -> SampledFlags:
    modes = [mode_of(s) for s in rows_sampling]
    sampled = [s for s, m in zip(rows_sampling, modes, strict=True) if m != GREEDY and s is not None]
    return SampledFlags(REJECTION in modes, COUPLED in modes, any(0 < s.top_k < vocab for s in sampled),
                        any(s.top_p < 1.0 for s in sampled))


def row_probs(logits: torch.Tensor, temp: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
              flags: SampledFlags) -> torch.Tensor:
    """logits [R, W, V] -> p [R, W, V] float32 under each row's temperature [R] (float32),
    top-k [R] (0: none) and top-p [R]: `sampling.mask_logits` then softmax, the same ops in
    the same order (the k-th value from a sort is top-k's; top-p 1 drops nothing)."""
    r, _, v = logits.shape
    x = logits.float() / temp.view(r, 1, 1)
    if flags.top_k:
        srt = torch.sort(x, dim=-1, descending=True).values
        kth = srt.gather(-1, (top_k - 1).clamp(0, v - 1).view(r, 1, 1).expand(r, x.shape[1], 1))
        kth = torch.where((top_k > 0).view(r, 1, 1), kth, float("-inf"))
        x = x.masked_fill(x < kth, float("-inf"))  # ties with the k-th value are kept
    if flags.top_p:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        sorted_p = torch.softmax(sorted_x, dim=-1)
        mass_before = torch.cumsum(sorted_p, dim=-1) - sorted_p
        drop_sorted = (mass_before >= top_p.view(r, 1, 1)) & (top_p < 1.0).view(r, 1, 1)
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return torch.softmax(x, dim=-1)


def device_uniforms(seed: torch.Tensor, first: torch.Tensor, k: int) -> StepUniforms:
    """The block's numbers (`StepUniforms.draw`), computed on the device: seed [R] int64 (the
    64-bit patterns), first [R] the absolute position of each row's first draft."""
    pos = first.view(-1, 1) + torch.arange(k + 1, device=first.device).view(1, -1)  # [R, K+1]
    s = seed.view(-1, 1)
    return StepUniforms(uniform_on_device(s, pos[:, :k], Purpose.ACCEPT),  # type: ignore[arg-type]
                        uniform_on_device(s, pos, Purpose.RECOVER),  # type: ignore[arg-type]
                        keys_of(uniform_on_device(s, pos, Purpose.BONUS)))  # type: ignore[arg-type]


class SamplingFields:
    """A prepared step's per-row sampling, read from the step's int buffer."""

    def __init__(self, ds: DeviceStep, r: int) -> None:
        self.mode, self.seed, self.top_k = ds.field("mode", r), ds.field("seed", r), ds.field("topk", r)
        self.temp = ds.field("temp", r).view(torch.float64).float()
        self.top_p = ds.field("topp", r).view(torch.float64)


def judge_sampled(ds: DeviceStep, b: Bucket, logits: torch.Tensor, drafts: torch.Tensor, ndraft: torch.Tensor,
                  q: torch.Tensor | None) -> None:
    """The sampled rows' verdicts over the verify's logits at their judged lanes ([R, W, V]),
    drafts [R, W - 1] and their counts [R], written over the greedy ones in `ds.verdicts`
    and `ds.picks`. q [R, W - 1, V] dense (the device drafter's), or None: one-hot."""
    flags: SampledFlags = ds.sampled
    r, w = b.rows, b.width
    f = SamplingFields(ds, r)
    p = row_probs(logits, f.temp, f.top_k, f.top_p, flags)
    jfirst = ds.field("jpos", b.tokens).view(r, w)[:, 0] - torch.arange(r, device=p.device) * w
    u = device_uniforms(f.seed, ds.field("start", r) + jfirst + 1, w - 1)
    accepted, final = ds.verdicts[:r, 0].long(), ds.picks[:r]
    if flags.rejection:
        j = rejection_judge(p, drafts, ndraft, q, u)
        on = f.mode == REJECTION
        accepted, final = torch.where(on, j.num_accepted, accepted), torch.where(on, j.final, final)
    if flags.coupled:
        j = coupled_judge(p, drafts, ndraft, None, u)
        on = f.mode == COUPLED
        accepted, final = torch.where(on, j.num_accepted, accepted), torch.where(on, j.final, final)
    ds.verdicts[:r, 0].copy_(accepted.double())
    ds.verdicts[:r, 1].copy_(final.double())
    ds.picks[:r].copy_(final)


def sampled_picks(ds: DeviceStep, r: int, logits: torch.Tensor, positions: torch.Tensor,
                  greedy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A device drafter's pick at one position for each of r rows (ADR 0027: a sampled draft
    is the Gumbel-max draw from q with the position's noise): logits [R, V], positions [R]
    (absolute), the greedy picks [R] -> (picks [R], q [R, V] float32; a greedy row's q unused)."""
    from specserve.algorithm.sampling import coupled_tokens

    f = SamplingFields(ds, r)
    q = row_probs(logits.view(r, 1, -1), f.temp, f.top_k, f.top_p, ds.sampled).view(r, -1)
    drawn = coupled_tokens(q, keys_of(uniform_on_device(f.seed, positions, Purpose.BONUS)))
    return torch.where(f.mode != GREEDY, drawn, greedy), q
