"""A small Hugging Face causal LM as drafter, with its own KV cache and rollback."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import PreTrainedModel

from specserve.drafters.base import DraftProposal
from specserve.kvcache import CachedLM
from specserve.rejection import DenseQ, SparseQ
from specserve.rng import Purpose, uniform
from specserve.sampling import SamplingParams, draw, greedy_tokens, logits_to_probs

# Send q sparse when the draft sampler truncated it to at most this share of the vocabulary.
SPARSE_MAX_SHARE = 0.25


class HFDrafter:
    def __init__(self, model: PreTrainedModel, name: str = "small") -> None:
        self.model = model.eval()
        self.name = name
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.max_positions = int(getattr(model.config, "max_position_embeddings", 1 << 30))

    def start(self) -> HFDraftSession:
        return HFDraftSession(self)


class HFDraftSession:
    def __init__(self, drafter: HFDrafter) -> None:
        self.drafter = drafter
        self.lm = CachedLM(drafter.model)

    @torch.inference_mode()
    def propose(
        self, token_ids: Sequence[int], k: int, sampling: SamplingParams, seed: int
    ) -> DraftProposal:
        k = min(k, self.drafter.max_positions - len(token_ids))
        if k <= 0:
            return DraftProposal([], None)
        dropped = self.lm.reconcile(token_ids)
        logits = self.lm.extend(token_ids[self.lm.length :])[-1]
        start = len(token_ids)
        tokens: list[int] = []
        qs: list[torch.Tensor] = []
        for i in range(k):
            if sampling.greedy:
                tok = int(greedy_tokens(logits, sampling))
            else:
                probs = logits_to_probs(logits, sampling)  # [V]
                u = torch.from_numpy(uniform(seed, [start + i], Purpose.DRAFT))
                tok = int(draw(probs.unsqueeze(0), u)[0])
                qs.append(probs)
            tokens.append(tok)
            if i + 1 < k:
                logits = self.lm.extend([tok])[-1]
        q = None if sampling.greedy else _pack_q(torch.stack(qs))
        return DraftProposal(tokens, q, rollback_tokens=dropped)

    def observe(self, proposal: DraftProposal, num_accepted: int) -> None:
        # The rejected tail is dropped by the next reconcile, which compares ids; nothing
        # to learn for a fixed-K model drafter.
        return None

    def release(self) -> None:
        self.lm.reset()


def _pack_q(q: torch.Tensor) -> DenseQ | SparseQ:
    """q [K, V] -> sparse when truncation left few tokens with mass, else dense. Exact."""
    support = int((q > 0).sum(-1).max())
    if support <= SPARSE_MAX_SHARE * q.shape[-1]:
        probs, ids = torch.topk(q, support, dim=-1)
        return SparseQ(ids=ids, probs=probs)
    return DenseQ(probs=q)


