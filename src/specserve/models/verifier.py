"""The target side of a round: one forward pass over the last committed token plus the K
drafts, with the target's KV cache, and rollback of rejected positions."""

from __future__ import annotations

from collections.abc import Sequence

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
        self.rollback_tokens = 0  # provisional positions dropped so far (stats)

    def verify(self, token_ids: Sequence[int], draft_tokens: Sequence[int]) -> torch.Tensor:
        """Logits [K+1, V]: row i is the target's distribution for the token after
        token_ids + draft_tokens[:i]. The first call also prefills the prompt."""
        self.rollback_tokens += self.lm.reconcile(token_ids)
        feed = list(token_ids[self.lm.length :]) + list(draft_tokens)
        logits = self.lm.extend(feed)
        return logits[-(len(draft_tokens) + 1) :]

    def rollback(self, keep: int) -> None:
        """Drop positions past `keep` (the rejected drafts of the last verify)."""
        self.rollback_tokens += max(self.lm.length - keep, 0)
        self.lm.crop(keep)

    def release(self) -> None:
        self.lm.reset()


def verify_block(session: TargetSession, ids: Sequence[int], drafts: Sequence[int], q: QProbs,
                 sampling: SamplingParams, seed: int) -> Verdict:
    """One block: the target's forward pass over the last committed token + the drafts, the
    verdict, and rollback of the rejected positions (they leave the KV cache). `ids` is the
    committed sequence (prompt + generated)."""
    logits = session.verify(ids, drafts)  # [k+1, V]
    verdict = judge(logits, drafts, q, sampling, seed, len(ids))
    session.rollback(len(ids) + verdict.num_accepted)
    return verdict


def judge(logits: torch.Tensor, draft_tokens: Sequence[int], q: QProbs, sampling: SamplingParams,
          seed: int, start: int) -> Verdict:
    """Logits [k+1, V] of the target over the k drafts -> the verdict (greedy fast path at
    T = 0). `start` is the absolute position of the first draft token."""
    k = len(draft_tokens)
    draft_t = torch.tensor([list(draft_tokens)], dtype=torch.long).reshape(1, k)
    n = torch.tensor([k])
    if sampling.greedy:
        return greedy_verify(greedy_tokens(logits, sampling).unsqueeze(0), draft_t, n)[0]
    p = logits_to_probs(logits, sampling).unsqueeze(0)  # [1, k+1, V]
    q_dense = q_to_dense(q, draft_t[0], p.shape[-1]).unsqueeze(0) if q is not None else None
    return rejection_sample(p, draft_t, n, q_dense, np.array([seed], dtype=np.uint64),
                            np.array([start], dtype=np.int64))[0]
