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
    Verdict,
    greedy_verify,
    q_to_dense,
    rejection_sample,
)
from specserve.algorithm.sampling import greedy_tokens, logits_to_probs
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
    """Verdicts of several blocks (a batch of sessions, or one): one greedy_verify over the
    greedy rows, one rejection_sample over the sampled rows with a q and one over those
    without. The same code alone and in a batch, so a session's verdict does not depend on
    who shares its batch."""
    out: list[Verdict | None] = [None] * len(rows)
    groups: dict[tuple[bool, bool], list[int]] = {}
    for i, r in enumerate(rows):
        groups.setdefault((r.sampling.greedy, r.q is None), []).append(i)
    for (greedy, no_q), idx in groups.items():
        rs = [rows[i] for i in idx]
        kmax = max(len(r.drafts) for r in rs)
        draft_t = torch.tensor([r.drafts + [0] * (kmax - len(r.drafts)) for r in rs], dtype=torch.long)
        draft_t = draft_t.reshape(len(rs), kmax)
        num = torch.tensor([len(r.drafts) for r in rs])
        if greedy:
            tgt = torch.zeros(len(rs), kmax + 1, dtype=torch.long)
            for b, r in enumerate(rs):
                tgt[b, :len(r.drafts) + 1] = greedy_tokens(r.masked_logits, r.sampling)
            verdicts = greedy_verify(tgt, draft_t, num)
        else:
            vocab = rs[0].logits.shape[-1]
            p = torch.zeros(len(rs), kmax + 1, vocab)
            q = None if no_q else torch.zeros(len(rs), kmax, vocab)
            for b, r in enumerate(rs):
                k = len(r.drafts)
                p[b, :k + 1] = logits_to_probs(r.masked_logits, r.sampling)
                if q is not None and k:
                    q[b, :k] = q_to_dense(r.q, draft_t[b, :k], vocab)
            verdicts = rejection_sample(p, draft_t, num, q, np.array([r.seed for r in rs], dtype=np.uint64),
                                        np.array([r.start for r in rs], dtype=np.int64))
        for i, v in zip(idx, verdicts, strict=True):
            out[i] = v
    return out  # type: ignore[return-value]
