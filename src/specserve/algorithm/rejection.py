"""Rejection sampling: the verdict on one drafted block (Leviathan et al. 2023, DESIGN §2), and
the coupled verdict of a seeded row (ADR 0027).

Vocabulary: the target distribution is p, the draft distribution q. For each of the K draft
tokens x̂_i, in order, the token is **accepted** when u_i · q(x̂_i) < p(x̂_i) (u_i uniform in
[0, 1), i.e. with probability min(1, p/q)). At the first rejection a **recovered** token is
drawn from the residual norm(max(0, p - q)) and the block ends; when all K are accepted a
**bonus** token is drawn from p at position K+1. **emitted** = accepted + 1, always ≥ 1.

q comes in three forms: dense [K, V]; sparse (ids + probs, exact when the draft sampler
truncated with top-k/top-p); or absent, meaning one-hot at the draft tokens (deterministic
drafters such as n-gram). A draft token with q(x̂) = 0 (a drafter that misreports q) is
judged by the target alone: kept iff p(x̂) > 0. A token with p(x̂) = 0 is never kept.

Every random number comes from `rng.uniform(seed, absolute position, purpose)`, so a verdict is
a pure function of its inputs: the accept coins (ACCEPT) and the recovered draw (RECOVER, by
inverse CDF), and the position's noise (BONUS's key) for every token drawn fresh from p: the
bonus token, and a plain step's (a block of no drafts), by Gumbel-max (`sampling.coupled_tokens`).

**Coupled** rows (`SamplingParams.coupled`: a seed the client chose, ADR 0027) are judged
otherwise: the target's token at every position of the block is its Gumbel-max draw with the
position's noise, y_i; a draft token is accepted exactly when it equals y_i, and the block
ends with y at the first mismatch (or past the last draft). The emitted tokens are then those
of plain decoding with the seed whatever the drafts were: the drafts decide only how many
positions one pass settles. Exact: each y_i is a draw from p_i.

`rejection_sample` / `coupled_sample` are the fast batched paths; `rejection_sample_reference`
/ `coupled_sample_reference` the slow loops they must equal (tests/unit).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from specserve.algorithm.rng import Purpose, exponentials_reference, noise_keys, uniform
from specserve.algorithm.sampling import coupled_tokens, draw
from specserve.device import to_device


@dataclass(frozen=True)
class DenseQ:
    probs: torch.Tensor  # [K, V] float32


@dataclass(frozen=True)
class SparseQ:
    ids: torch.Tensor  # [K, S] int64, zero-probability padding allowed
    probs: torch.Tensor  # [K, S] float32


QProbs = DenseQ | SparseQ | None  # None: one-hot at the draft tokens


def q_to_dense(q: QProbs, draft_tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Any q form -> dense [K, V] float32 on `draft_tokens`' device (exact: sparse entries are
    scattered, not approximated; a host q is copied in, never read back)."""
    k, device = draft_tokens.shape[0], draft_tokens.device
    if q is None:
        return torch.nn.functional.one_hot(draft_tokens.long(), vocab_size).float()
    if isinstance(q, DenseQ):
        if q.probs.shape != (k, vocab_size):
            raise ValueError(f"dense q has shape {tuple(q.probs.shape)}, expected ({k}, {vocab_size})")
        return to_device(q.probs, device).float()
    dense = torch.zeros(k, vocab_size, dtype=torch.float32, device=device)
    return dense.scatter_add_(1, to_device(q.ids, device).long(), to_device(q.probs, device).float())


@dataclass
class Verdict:
    """The outcome of one block."""

    num_accepted: int
    tokens: list[int]  # emitted: accepted drafts, then the recovered or bonus token
    rejected_position: int | None  # index in the block of the first rejected draft; None = bonus
    p_draft: list[float] = field(default_factory=list)  # p(x̂_i) for each proposed position
    q_draft: list[float] = field(default_factory=list)  # q(x̂_i) for each proposed position

    @property
    def bonus(self) -> bool:
        return self.rejected_position is None


@dataclass
class Judged:
    """A batch's verdicts as tensors on the device (ADR 0016): what crosses to the host in the
    step's one copy. Rows past a row's own number of drafts are padding."""

    num_accepted: torch.Tensor  # [B] int64
    final: torch.Tensor  # [B] int64: the recovered or bonus token
    p_draft: torch.Tensor | None  # [B, K] float32: p(x̂_i); None on the greedy path
    q_draft: torch.Tensor | None  # [B, K] float32: q(x̂_i)

    def packed(self) -> torch.Tensor:
        """[B, 2 + 2K] float64 (token ids are exact in float64): one tensor for one copy."""
        cols = [self.num_accepted.unsqueeze(1), self.final.unsqueeze(1)]
        if self.p_draft is not None and self.q_draft is not None:
            cols += [self.p_draft, self.q_draft]
        return torch.cat([c.double() for c in cols], dim=1)


def verdicts_from_host(packed: list[list[float]], drafts: list[list[int]], with_probs: bool) -> list[Verdict]:
    """`Judged.packed()` copied to the host (as lists) -> one Verdict per row."""
    out = []
    for row, d in zip(packed, drafts, strict=True):
        a, n, k = int(row[0]), len(d), (len(row) - 2) // 2
        p_x, q_x = (row[2:2 + n], row[2 + k:2 + k + n]) if with_probs else ([], [])
        out.append(Verdict(a, d[:a] + [int(row[1])], a if a < n else None, p_x, q_x))
    return out


def greedy_judge(
    target_ids: torch.Tensor,  # [B, K+1] int64: argmax of the target at each block position
    draft: torch.Tensor,  # [B, K] int64, padded past num_draft
    num_draft: torch.Tensor,  # [B] int64
) -> Judged:
    """Greedy fast path on the tensors' device: accept while the draft equals the target's
    argmax; no randomness."""
    k = draft.shape[1]
    valid = torch.arange(k, device=draft.device).unsqueeze(0) < num_draft.unsqueeze(1)
    match = (draft == target_ids[:, :k]) & valid
    num_acc = torch.cumprod(match.long(), dim=1).sum(dim=1)
    return Judged(num_acc, target_ids.gather(1, num_acc.unsqueeze(1)).squeeze(1), None, None)


def greedy_verify(target_ids: torch.Tensor, draft: torch.Tensor, num_draft: torch.Tensor) -> list[Verdict]:
    """`greedy_judge`, read back as Verdicts."""
    judged = greedy_judge(target_ids, draft, num_draft)
    return verdicts_from_host(judged.packed().cpu().tolist(), _draft_lists(draft, num_draft), False)


def _draft_lists(draft: torch.Tensor, num_draft: torch.Tensor) -> list[list[int]]:
    return [row[:n] for row, n in zip(draft.cpu().tolist(), num_draft.cpu().tolist(), strict=True)]


@dataclass(frozen=True)
class StepUniforms:
    """Every random number a batch's verdicts may use, drawn on the host in one go (ADR 0001
    counters, so identical on every device) and copied in with the step: accept draws at the
    K draft positions, recover draws and the noise keys (rng.noise_keys) at each of the K+1
    places the block may end. Which of those are used depends on the verdict, which stays on
    the device. (A coupled verdict uses the keys alone.)"""

    accept: np.ndarray  # [B, K] float64
    recover: np.ndarray  # [B, K+1]
    keys: np.ndarray  # [B, K+1] int64

    @classmethod
    def draw(cls, seeds: np.ndarray, start: np.ndarray, k: int) -> StepUniforms:
        pos = start[:, None] + np.arange(k + 1)[None, :]  # [B, K+1]
        s = seeds[:, None]
        return cls(uniform(s, pos[:, :k], Purpose.ACCEPT), uniform(s, pos, Purpose.RECOVER), noise_keys(s, pos))


def _draft_probs(p: torch.Tensor, draft: torch.Tensor, q: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """p(x̂_i) and q(x̂_i) [B, K] (q one-hot where None): the statistics every verdict reports."""
    k = draft.shape[1]
    if k == 0:
        empty = torch.zeros(draft.shape[0], 0, device=p.device)
        return empty, empty
    px = p[:, :k].gather(-1, draft.unsqueeze(-1)).squeeze(-1)
    qx = q.gather(-1, draft.unsqueeze(-1)).squeeze(-1) if q is not None else torch.ones_like(px)
    return px, qx


def rejection_judge(
    p: torch.Tensor,  # [B, K+1, V] float32 target probabilities (logits_to_probs)
    draft: torch.Tensor,  # [B, K] int64 draft tokens, padded past num_draft
    num_draft: torch.Tensor,  # [B] int64, 0 <= num_draft <= K
    q: torch.Tensor | None,  # [B, K, V] float32 dense draft probabilities; None = one-hot
    u: StepUniforms,
) -> Judged:
    """Batched rejection sampling on p's device, with no value read back to the host; see
    the module docstring for the rule."""
    bsz, k = draft.shape
    dev = p.device
    rows = torch.arange(bsz, device=dev)
    valid = torch.arange(k, device=dev).unsqueeze(0) < num_draft.unsqueeze(1)  # [B, K]
    px, qx = _draft_probs(p, draft, q)
    if k > 0:
        u_acc = to_device(u.accept, dev)
        accept = (u_acc * qx.double() < px.double()) & valid
        num_acc = torch.cumprod(accept.long(), dim=1).sum(dim=1)  # [B]
    else:
        num_acc = torch.zeros(bsz, dtype=torch.long, device=dev)
    rejected = num_acc < num_draft  # [B]

    p_final = p[rows, num_acc]  # [B, V]
    dist = p_final
    if k > 0:
        j = num_acc.clamp(max=k - 1)
        q_rej = q[rows, j] if q is not None else torch.nn.functional.one_hot(draft[rows, j], p.shape[-1]).float()
        residual = torch.clamp(p_final - q_rej, min=0.0)
        # p == q exactly leaves no residual; a rejection is then impossible in exact
        # arithmetic, so fall back to p rather than divide by zero.
        usable = rejected & (residual.sum(-1) > 0)
        dist = torch.where(usable.unsqueeze(-1), residual, p_final)
    at_end = num_acc.unsqueeze(1)
    recovered = draw(dist, to_device(u.recover, dev).gather(1, at_end).squeeze(1))
    bonus = coupled_tokens(p_final, to_device(u.keys, dev).gather(1, at_end).squeeze(1))
    return Judged(num_acc, torch.where(rejected, recovered, bonus), px, qx)


def coupled_judge(
    p: torch.Tensor,  # [B, K+1, V] float32 target probabilities (logits_to_probs)
    draft: torch.Tensor,  # [B, K] int64 draft tokens, padded past num_draft
    num_draft: torch.Tensor,  # [B] int64, 0 <= num_draft <= K
    q: torch.Tensor | None,  # [B, K, V] float32 (statistics only: the verdict does not read q)
    u: StepUniforms,
) -> Judged:
    """Batched coupled verdicts on p's device (module docstring): the target's own draw at
    every position with the position's noise, drafts kept while they equal it. As pure a
    function as `rejection_judge` (a fixed-shape argmax over p / noise), graph-friendly."""
    k = draft.shape[1]
    own = coupled_tokens(p, to_device(u.keys, p.device))  # [B, K+1]
    valid = torch.arange(k, device=p.device).unsqueeze(0) < num_draft.unsqueeze(1)
    num_acc = torch.cumprod(((draft == own[:, :k]) & valid).long(), dim=1).sum(dim=1)
    px, qx = _draft_probs(p, draft, q)
    return Judged(num_acc, own.gather(1, num_acc.unsqueeze(1)).squeeze(1), px, qx)


def rejection_sample(
    p: torch.Tensor,  # [B, K+1, V] float32 target probabilities (logits_to_probs)
    draft: torch.Tensor,  # [B, K] int64 draft tokens, padded past num_draft
    num_draft: torch.Tensor,  # [B] int64, 0 <= num_draft <= K
    q: torch.Tensor | None,  # [B, K, V] float32 dense draft probabilities; None = one-hot
    seeds: np.ndarray,  # [B] uint64 request seeds
    start: np.ndarray,  # [B] int64 absolute position of draft[:, 0]
    coupled: bool = False,
) -> list[Verdict]:
    """`rejection_judge` (or `coupled_judge`) with the numbers of (seeds, start), read back as
    Verdicts."""
    judge = coupled_judge if coupled else rejection_judge
    judged = judge(p, draft, num_draft, q, StepUniforms.draw(seeds, start, draft.shape[1]))
    return verdicts_from_host(judged.packed().cpu().tolist(), _draft_lists(draft, num_draft), True)


def coupled_sample(p: torch.Tensor, draft: torch.Tensor, num_draft: torch.Tensor, q: torch.Tensor | None,
                   seeds: np.ndarray, start: np.ndarray) -> list[Verdict]:
    """`coupled_judge` read back as Verdicts (`rejection_sample`'s arguments)."""
    return rejection_sample(p, draft, num_draft, q, seeds, start, coupled=True)


def rejection_sample_reference(
    p: torch.Tensor,  # [K+1, V]
    draft: list[int],  # [K]
    q: torch.Tensor | None,  # [K, V] dense, or None = one-hot
    seed: int,
    start: int,
) -> Verdict:
    """The slow, obvious implementation: one position at a time with Python floats.
    The fast path must equal it exactly."""
    p32 = p.float().numpy()
    q32 = None if q is None else q.float().numpy()
    # p(x̂)/q(x̂) are reported for every proposed position (statistics), not only up to
    # the first rejection.
    p_list = [float(p32[i, x]) for i, x in enumerate(draft)]
    q_list = [1.0 if q32 is None else float(q32[i, x]) for i, x in enumerate(draft)]
    for i, x in enumerate(draft):
        px, qx = p_list[i], q_list[i]
        u = float(uniform(seed, start + i, Purpose.ACCEPT))
        if u * qx < px:
            continue
        q_row = np.zeros_like(p32[i]) if q32 is None else q32[i]
        if q32 is None:
            q_row[x] = 1.0
        residual = np.maximum(p32[i] - q_row, np.float32(0.0))
        dist = residual if float(residual.astype(np.float64).sum()) > 0 else p32[i]
        tok = _draw_reference(dist, float(uniform(seed, start + i, Purpose.RECOVER)))
        return Verdict(i, list(draft[:i]) + [tok], i, p_list, q_list)
    kk = len(draft)
    return Verdict(kk, list(draft) + [_coupled_reference(p32[kk], seed, start + kk)], None, p_list, q_list)


def coupled_sample_reference(p: torch.Tensor, draft: list[int], q: torch.Tensor | None, seed: int,
                             start: int) -> Verdict:
    """The slow, obvious coupled verdict: the target's own draw at each position in turn, the
    draft kept while it equals it. The fast path must equal it exactly."""
    p32 = p.float().numpy()
    p_list = [float(p32[i, x]) for i, x in enumerate(draft)]
    q_list = [1.0 if q is None else float(q.float().numpy()[i, x]) for i, x in enumerate(draft)]
    for i, x in enumerate(draft):
        own = _coupled_reference(p32[i], seed, start + i)
        if own != x:
            return Verdict(i, list(draft[:i]) + [own], i, p_list, q_list)
    kk = len(draft)
    return Verdict(kk, list(draft) + [_coupled_reference(p32[kk], seed, start + kk)], None, p_list, q_list)


def _coupled_reference(probs: np.ndarray, seed: int, position: int) -> int:
    """argmax p / E with numpy's exponentials of the position's key: Gumbel-max, written out."""
    noise = exponentials_reference(noise_keys(seed, [position]), np.arange(probs.shape[-1]))[0]
    return int(np.argmax(probs.astype(np.float64) / noise))


def _draw_reference(probs: np.ndarray, u: float) -> int:
    cdf, total = [], 0.0
    for v in probs:
        total += float(v)
        cdf.append(total)
    target = u * total
    last = max(i for i, v in enumerate(probs) if v > 0)
    for i, c in enumerate(cdf):
        if c > target:
            return min(i, last)
    return last
