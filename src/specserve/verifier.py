"""The target side of a round: one forward pass over the last committed token plus the K
drafts, with the target's KV cache, and rollback of rejected positions."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import PreTrainedModel

from specserve.kvcache import CachedLM


class TargetModel:
    """Holds the target weights; sessions hold per-sequence caches."""

    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model.eval()
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.max_positions = int(getattr(model.config, "max_position_embeddings", 1 << 30))
        eos = getattr(model.generation_config, "eos_token_id", None) or model.config.eos_token_id
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
