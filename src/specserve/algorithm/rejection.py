"""Rejection sampling: the verdict on one drafted block (Leviathan et al. 2023, DESIGN §2).

Vocabulary: the target distribution is p, the draft distribution q. For each of the K draft
tokens x̂_i, in order, the token is **accepted** when u_i · q(x̂_i) < p(x̂_i) (u_i uniform in
[0, 1), i.e. with probability min(1, p/q)). At the first rejection a **recovered** token is
drawn from the residual norm(max(0, p - q)) and the block ends; when all K are accepted a
**bonus** token is drawn from p at position K+1. **emitted** = accepted + 1, always ≥ 1.

q comes in three forms: dense [K, V]; sparse (ids + probs, exact when the draft sampler
truncated with top-k/top-p); or absent, meaning one-hot at the draft tokens (deterministic
drafters such as n-gram). A draft token with q(x̂) = 0 (a drafter that misreports q) is
judged by the target alone: kept iff p(x̂) > 0. A token with p(x̂) = 0 is never kept.

Every uniform comes from `rng.uniform(seed, absolute position, purpose)`, so a verdict is a
pure function of its inputs. `rejection_sample` is the fast batched path;
`rejection_sample_reference` is the slow loop it must equal exactly (tests/unit).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from specserve.algorithm.rng import Purpose, uniform
from specserve.algorithm.sampling import draw


@dataclass(frozen=True)
class DenseQ:
    probs: torch.Tensor  # [K, V] float32


@dataclass(frozen=True)
class SparseQ:
    ids: torch.Tensor  # [K, S] int64, zero-probability padding allowed
    probs: torch.Tensor  # [K, S] float32


QProbs = DenseQ | SparseQ | None  # None: one-hot at the draft tokens


def q_to_dense(q: QProbs, draft_tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Any q form -> dense [K, V] float32 (exact: sparse entries are scattered, not approximated)."""
    k = draft_tokens.shape[0]
    if q is None:
        return torch.nn.functional.one_hot(draft_tokens.long(), vocab_size).float()
    if isinstance(q, DenseQ):
        if q.probs.shape != (k, vocab_size):
            raise ValueError(f"dense q has shape {tuple(q.probs.shape)}, expected ({k}, {vocab_size})")
        return q.probs.float()
    dense = torch.zeros(k, vocab_size, dtype=torch.float32)
    return dense.scatter_add_(1, q.ids.long(), q.probs.float())


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


def greedy_verify(
    target_ids: torch.Tensor,  # [B, K+1] int64: argmax of the target at each block position
    draft: torch.Tensor,  # [B, K] int64, padded past num_draft
    num_draft: torch.Tensor,  # [B] int64
) -> list[Verdict]:
    """Greedy fast path: accept while the draft equals the target's argmax; no randomness."""
    k = draft.shape[1]
    valid = torch.arange(k).unsqueeze(0) < num_draft.unsqueeze(1)
    match = (draft == target_ids[:, :k]) & valid
    num_acc = torch.cumprod(match.long(), dim=1).sum(dim=1)
    out = []
    for b in range(draft.shape[0]):
        a, n = int(num_acc[b]), int(num_draft[b])
        tokens = draft[b, :a].tolist() + [int(target_ids[b, a])]
        out.append(Verdict(a, tokens, a if a < n else None))
    return out


def rejection_sample(
    p: torch.Tensor,  # [B, K+1, V] float32 target probabilities (logits_to_probs)
    draft: torch.Tensor,  # [B, K] int64 draft tokens, padded past num_draft
    num_draft: torch.Tensor,  # [B] int64, 0 <= num_draft <= K
    q: torch.Tensor | None,  # [B, K, V] float32 dense draft probabilities; None = one-hot
    seeds: np.ndarray,  # [B] uint64 request seeds
    start: np.ndarray,  # [B] int64 absolute position of draft[:, 0]
) -> list[Verdict]:
    """Batched rejection sampling; see the module docstring for the rule."""
    bsz, k = draft.shape
    vocab = p.shape[-1]
    rows = torch.arange(bsz)
    ar = torch.arange(k)
    valid = ar.unsqueeze(0) < num_draft.unsqueeze(1)  # [B, K]
    if k > 0:
        px = p[:, :k].gather(-1, draft.unsqueeze(-1)).squeeze(-1)  # [B, K]
        qx = q.gather(-1, draft.unsqueeze(-1)).squeeze(-1) if q is not None else torch.ones_like(px)
        u_acc = torch.from_numpy(
            uniform(seeds[:, None], start[:, None] + ar.numpy()[None, :], Purpose.ACCEPT)
        )
        accept = (u_acc * qx.double() < px.double()) & valid
        num_acc = torch.cumprod(accept.long(), dim=1).sum(dim=1)  # [B]
    else:
        px = qx = torch.zeros(bsz, 0)
        num_acc = torch.zeros(bsz, dtype=torch.long)
    rejected = num_acc < num_draft  # [B]

    p_final = p[rows, num_acc]  # [B, V]
    dist = p_final
    if bool(rejected.any()):
        j = num_acc.clamp(max=max(k - 1, 0))
        if q is not None:
            q_rej = q[rows, j]  # [B, V]
        else:
            q_rej = torch.nn.functional.one_hot(draft[rows, j], vocab).float()
        residual = torch.clamp(p_final - q_rej, min=0.0)
        # p == q exactly leaves no residual; a rejection is then impossible in exact
        # arithmetic, so fall back to p rather than divide by zero.
        usable = rejected & (residual.sum(-1) > 0)
        dist = torch.where(usable.unsqueeze(-1), residual, p_final)

    final_pos = start + num_acc.numpy()
    u_rec = uniform(seeds, final_pos, Purpose.RECOVER)
    u_bonus = uniform(seeds, final_pos, Purpose.BONUS)
    u_final = torch.from_numpy(np.where(rejected.numpy(), u_rec, u_bonus))
    final = draw(dist, u_final)  # [B]

    out = []
    for b in range(bsz):
        a, n = int(num_acc[b]), int(num_draft[b])
        tokens = draft[b, :a].tolist() + [int(final[b])]
        out.append(
            Verdict(a, tokens, a if a < n else None, px[b, :n].tolist(), qx[b, :n].tolist())
        )
    return out


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
    tok = _draw_reference(p32[kk], float(uniform(seed, start + kk, Purpose.BONUS)))
    return Verdict(kk, list(draft) + [tok], None, p_list, q_list)


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
