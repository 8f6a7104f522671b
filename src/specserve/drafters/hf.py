"""A small Hugging Face causal LM as drafter, with its own KV cache and rollback."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedModel

from specserve.algorithm.rejection import DenseQ, SparseQ
from specserve.algorithm.rng import Purpose, uniform
from specserve.algorithm.sampling import (
    SamplingParams,
    draw,
    greedy_tokens,
    logits_to_probs,
    truncate_mass,
)
from specserve.drafters.base import DraftProposal
from specserve.models.kvcache import CachedLM

# Send q sparse when the draft sampler truncated it to at most this share of the vocabulary.
SPARSE_MAX_SHARE = 0.25
Q_MASS = 0.999  # the draft samples from the most likely tokens covering this mass ...
Q_MAX_ENTRIES = 256  # ... at most this many per position (measured in ADR 0010)


class HFDrafter:
    """`q_mass`/`q_max_entries`: the draft samples from its distribution truncated to the most
    likely tokens covering q_mass (at most q_max_entries), and sends that q sparse (ADR 0010).
    The in-process engine and the draft worker must use the same values, or a seeded request
    drafts differently in the two (its output distribution is exact either way)."""

    def __init__(self, model: PreTrainedModel, name: str = "small", q_mass: float = Q_MASS,
                 q_max_entries: int = Q_MAX_ENTRIES) -> None:
        self.model = model.eval()
        self.name = name
        self.q_mass = q_mass
        self.q_max_entries = q_max_entries
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
        self, token_ids: Sequence[int], k: int, sampling: SamplingParams, seed: int, grammar: Any = None
    ) -> DraftProposal:
        """`grammar` (structured/grammar.py: DraftGrammar): the draft samples from its q
        masked to the constraint's legal tokens (ADR 0017)."""
        k = min(k, self.drafter.max_positions - len(token_ids))
        if k <= 0:
            return DraftProposal([], None)
        dropped = self.lm.reconcile(token_ids)
        logits = self.lm.extend(token_ids[self.lm.length :])[-1]
        masks = grammar.start(token_ids) if grammar is not None else None
        steps = []
        for i in range(k):
            if masks is not None:
                logits = masks.apply(logits)
            steps.append(draft_step(logits, sampling, seed, len(token_ids) + i, self.drafter.q_mass,
                                    self.drafter.q_max_entries))
            if masks is not None:
                masks.push(steps[-1].token)
            if i + 1 < k:
                logits = self.lm.extend([steps[-1].token])[-1]
        return make_proposal(steps, sampling, dropped)

    @torch.inference_mode()
    def guess_next(self, token_ids: Sequence[int], sampling: SamplingParams, seed: int) -> int | None:
        """At T = 0 the draft's argmax; at T > 0 a draw from q with the uniform the target
        draws its bonus token with, uniform(seed, position, BONUS): when q is close to p the
        two inverse-CDF draws agree (a coupling), so the guess is right as often as possible."""
        if len(token_ids) >= self.drafter.max_positions:
            return None
        self.lm.reconcile(token_ids)
        logits = self.lm.extend(token_ids[self.lm.length :])[-1]
        return bonus_guess(logits, sampling, seed, len(token_ids))

    def release(self) -> None:
        self.lm.reset()


@dataclass
class DraftStep:
    """One drafted position: the token, its truncated q (None at T = 0), the runner-up and
    the draft's (p(token), p(runner-up))."""

    token: int
    q: torch.Tensor | None
    runner_up: int | None
    confidence: tuple[float, float]


def draft_step(logits: torch.Tensor, sampling: SamplingParams, seed: int, pos: int, q_mass: float,
               q_max_entries: int) -> DraftStep:
    """The draft token at absolute position `pos` from the draft's logits [V] there: argmax
    at T = 0, else a draw from q truncated to q_mass with uniform(seed, pos, DRAFT). Shared by
    the per-session path and the batched draft worker, so both draft the same from the same
    logits."""
    probs = None if sampling.greedy else truncate_mass(logits_to_probs(logits, sampling), q_mass, q_max_entries)
    if probs is None:
        tok = int(greedy_tokens(logits, sampling))
    else:
        tok = int(draw(probs.unsqueeze(0), torch.from_numpy(uniform(seed, [pos], Purpose.DRAFT)))[0])
    alt = _runner_up(logits, tok, sampling)
    return DraftStep(tok, probs, alt, _confidence(logits if probs is None else probs, probs is None, tok, alt))


def make_proposal(steps: Sequence[DraftStep], sampling: SamplingParams, dropped: int) -> DraftProposal:
    if not steps:
        return DraftProposal([], None, dropped_on_reconcile=dropped)
    q = None if sampling.greedy else _pack_q(torch.stack([s.q for s in steps if s.q is not None]))
    return DraftProposal([s.token for s in steps], q, dropped_on_reconcile=dropped,
                         runner_up=[s.runner_up for s in steps], confidence=[s.confidence for s in steps])


def bonus_guess(logits: torch.Tensor, sampling: SamplingParams, seed: int, pos: int) -> int:
    """The draft's guess of the target's token at `pos` (see HFDraftSession.guess_next)."""
    if sampling.greedy:
        return int(greedy_tokens(logits, sampling))
    probs = logits_to_probs(logits, sampling)
    return int(draw(probs.unsqueeze(0), torch.from_numpy(uniform(seed, [pos], Purpose.BONUS)))[0])


def _confidence(scores: torch.Tensor, are_logits: bool, drafted: int, alt: int | None) -> tuple[float, float]:
    """(probability of the drafted token, of the runner-up) under the draft; at T = 0 the
    softmax of its logits."""
    probs = torch.softmax(scores.float(), -1) if are_logits else scores
    return float(probs[drafted]), float(probs[alt]) if alt is not None else 0.0


def _runner_up(logits: torch.Tensor, drafted: int, sampling: SamplingParams) -> int | None:
    """The most likely token other than the drafted one (banned tokens excluded)."""
    top = torch.topk(logits if not sampling.banned_token_ids else logits.index_fill(
        0, torch.tensor(sampling.banned_token_ids), float("-inf")), 2)
    for value, idx in zip(top.values.tolist(), top.indices.tolist(), strict=True):
        if idx != drafted and value != float("-inf"):
            return int(idx)
    return None


def _pack_q(q: torch.Tensor) -> DenseQ | SparseQ:
    """q [K, V] -> sparse when truncation left few tokens with mass, else dense. Exact."""
    support = int((q > 0).sum(-1).max())
    if support <= SPARSE_MAX_SHARE * q.shape[-1]:
        probs, ids = torch.topk(q, support, dim=-1)
        return SparseQ(ids=ids, probs=probs)
    return DenseQ(probs=q)


