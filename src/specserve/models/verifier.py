"""The target side of a round: one forward pass over the last committed token plus the K
drafts, with the target's KV cache, and rollback of rejected positions."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from transformers import PreTrainedModel

from specserve.algorithm.rejection import (
    QProbs,
    StepUniforms,
    Verdict,
    coupled_judge,
    greedy_judge,
    q_to_dense,
    rejection_judge,
    verdicts_from_host,
)
from specserve.algorithm.sampling import greedy_masked, logits_to_probs
from specserve.device import to_device, to_host
from specserve.models.kvcache import CachedLM
from specserve.params import SamplingParams


class TargetModel:
    """Holds the target weights; sessions hold per-sequence caches."""

    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model.eval()
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.max_positions = int(getattr(model.config, "max_position_embeddings", 1 << 30))
        eos = getattr(model.generation_config, "eos_token_id", None)
        if eos is None:  # not `or`: EOS is often token id 0
            eos = model.config.eos_token_id
        self.eos_token_ids: frozenset[int] = frozenset(
            [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        )

    def start(self) -> TargetSession:
        return TargetSession(self)


class TargetSession:
    def __init__(self, target: TargetModel) -> None:
        self.target = target
        self.lm = CachedLM(target.model)
        self.dropped_positions = 0  # KV positions dropped so far: to reconcile, and rejected drafts

    def verify(self, token_ids: Sequence[int], draft_tokens: Sequence[int]) -> torch.Tensor:
        """Logits [K+1, V]: row i is the target's distribution for the token after
        token_ids + draft_tokens[:i]. The first call also prefills the prompt."""
        self.dropped_positions += self.lm.reconcile(token_ids)
        feed = list(token_ids[self.lm.length :]) + list(draft_tokens)
        logits = self.lm.extend(feed)
        return logits[-(len(draft_tokens) + 1) :]

    def rollback(self, keep: int) -> None:
        """Drop positions past `keep` (the rejected drafts of the last verify)."""
        self.dropped_positions += max(self.lm.length - keep, 0)
        self.lm.crop(keep)

    def release(self) -> None:
        self.lm.reset()


def verify_block(session: TargetSession, ids: Sequence[int], drafts: Sequence[int], q: QProbs,
                 sampling: SamplingParams, seed: int, allowed: torch.Tensor | None = None) -> Verdict:
    """One block: the target's forward pass over the last committed token + the drafts, the
    verdict, and rollback of the rejected positions (they leave the KV cache). `ids` is the
    committed sequence (prompt + generated)."""
    logits = session.verify(ids, drafts)  # [k+1, V]
    verdict = judge(logits, drafts, q, sampling, seed, len(ids), allowed)
    session.rollback(len(ids) + verdict.num_accepted)
    return verdict


def judge(logits: torch.Tensor, draft_tokens: Sequence[int], q: QProbs, sampling: SamplingParams,
          seed: int, start: int, allowed: torch.Tensor | None = None) -> Verdict:
    """Logits [k+1, V] of the target over the k drafts -> the verdict (greedy fast path at
    T = 0). `start` is the absolute position of the first draft token."""
    return judge_rows([JudgeRow(logits, list(draft_tokens), q, sampling, seed, start, allowed)])[0]


@dataclass(frozen=True)
class JudgeRow:
    logits: torch.Tensor  # [k+1, V]
    drafts: list[int]
    q: QProbs
    sampling: SamplingParams
    seed: int
    start: int  # absolute position of the first draft
    # [k+1, V] bool, a constraint's legal tokens at each position (ADR 0017): the others are
    # -inf before the sampling transform, so p is the target's renormalised over them
    allowed: torch.Tensor | None = None

    @property
    def masked_logits(self) -> torch.Tensor:
        if self.allowed is None:
            return self.logits
        return self.logits.masked_fill(~self.allowed.to(self.logits.device), float("-inf"))


def judge_rows(rows: Sequence[JudgeRow]) -> list[Verdict]:
    """Verdicts of several blocks (a batch of sessions, or one), judged on the logits' device
    (`judge_on_device`) and read back in the one copy of `models/device.to_host`. The same
    code alone and in a batch, so a session's verdict does not depend on who shares its batch."""
    if not rows:
        return []
    groups, packed = judge_on_device(rows)
    return verdicts_of(rows, groups, to_host([packed])[0].tolist())


def verdicts_of(rows: Sequence[JudgeRow], groups: dict[tuple[bool, bool, bool], list[int]],
                host: list[list[float]]) -> list[Verdict]:
    """`judge_on_device`'s packed rows, copied to the host as lists, -> one Verdict per row."""
    out: list[Verdict | None] = [None] * len(rows)
    offset = 0
    for (greedy, _, _), idx in groups.items():
        width = 2 if greedy else 2 + 2 * max(len(rows[i].drafts) for i in idx)
        part = [r[:width] for r in host[offset:offset + len(idx)]]
        offset += len(idx)
        for i, v in zip(idx, verdicts_from_host(part, [rows[i].drafts for i in idx], not greedy), strict=True):
            out[i] = v
    return out  # type: ignore[return-value]


def judge_on_device(rows: Sequence[JudgeRow]) -> tuple[dict[tuple[bool, bool, bool], list[int]], torch.Tensor]:
    """The rows grouped by kind (greedy; sampled with a q or without; coupled, ADR 0027), one
    `greedy_judge`, `rejection_judge` or `coupled_judge` per group on the logits' device, and
    every group's `Judged.packed()` in one [B, W] float64 tensor there, in group order (ADR
    0016: the step reads nothing back before this tensor's one copy)."""
    device = rows[0].logits.device
    groups: dict[tuple[bool, bool, bool], list[int]] = {}
    for i, r in enumerate(rows):
        greedy = r.sampling.greedy
        groups.setdefault((greedy, r.q is None, r.sampling.coupled and not greedy), []).append(i)
    parts = []
    for (greedy, no_q, coupled), idx in groups.items():
        rs = [rows[i] for i in idx]
        kmax = max(len(r.drafts) for r in rs)
        draft_t = to_device([r.drafts + [0] * (kmax - len(r.drafts)) for r in rs], device,
                            torch.long).reshape(len(rs), kmax)
        num = to_device([len(r.drafts) for r in rs], device)
        if greedy:
            parts.append(greedy_judge(greedy_targets(rs, kmax), draft_t, num).packed())
            continue
        p = torch.stack([_pad_rows(logits_to_probs(r.masked_logits, r.sampling), kmax + 1) for r in rs])
        q = None if no_q else torch.stack([
            _pad_rows(q_to_dense(r.q, draft_t[b, :len(r.drafts)], p.shape[-1]), kmax) for b, r in enumerate(rs)])
        uniforms = StepUniforms.draw(np.array([r.seed for r in rs], dtype=np.uint64),
                                     np.array([r.start for r in rs], dtype=np.int64), kmax)
        parts.append((coupled_judge if coupled else rejection_judge)(p, draft_t, num, q, uniforms).packed())
    width = max(t.shape[1] for t in parts)
    return groups, torch.cat([torch.nn.functional.pad(t, (0, width - t.shape[1])) for t in parts])


def greedy_targets(rows: Sequence[JudgeRow], kmax: int) -> torch.Tensor:
    """[B, kmax + 1] int64: each row's greedy token at each of its positions (after its banned
    tokens and its constraint), zero past its own. One argmax over all the rows' positions,
    where there was one a row: the argmax is row-wise, so a row's tokens are those it gets
    alone (ties to the first index either way). The runner's logits lie back to back in one
    buffer, so the rows without a mask are read in place (`joined`)."""
    logits = [greedy_masked(r.masked_logits, r.sampling) for r in rows]
    top = joined(logits).argmax(dim=-1)  # [sum of the rows' positions]
    sizes = [lg.shape[0] for lg in logits]
    if all(n == kmax + 1 for n in sizes):
        return top.view(len(rows), kmax + 1)
    at = [b * (kmax + 1) + j for b, n in enumerate(sizes) for j in range(n)]
    out = torch.zeros(len(rows) * (kmax + 1), dtype=torch.long, device=top.device)
    return out.index_copy_(0, to_device(at, top.device, torch.long), top).view(len(rows), kmax + 1)


def joined(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """[sum n, V]: 2-D tensors of one width stacked by rows; a view where they already lie back
    to back in one buffer, in order (the runner's `split` of its logits), else a copy."""
    first = parts[0]
    at = first.storage_offset()
    for t in parts:
        if (t.dtype != first.dtype or not t.is_contiguous() or t.storage_offset() != at
                or t.untyped_storage()._cdata != first.untyped_storage()._cdata):
            return torch.cat(list(parts))
        at += t.numel()
    return first.as_strided((sum(t.shape[0] for t in parts), first.shape[1]), (first.shape[1], 1),
                            first.storage_offset())


def _pad_rows(x: torch.Tensor, n: int) -> torch.Tensor:
    """x [m, ...] -> [n, ...], zero rows appended (a row with fewer drafts than the group's K)."""
    return torch.nn.functional.pad(x, (0, 0) * (x.dim() - 1) + (0, n - x.shape[0])) if x.shape[0] < n else x
