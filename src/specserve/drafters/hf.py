"""A small Hugging Face causal LM as drafter, with its own KV cache and rollback."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
from transformers import PreTrainedModel

from specserve.algorithm.rejection import DenseQ, SparseQ, q_to_dense
from specserve.algorithm.rng import Purpose, uniform
from specserve.algorithm.sampling import (
    SamplingParams,
    coupled_among,
    coupled_tokens,
    draft_heads,
    greedy_tokens,
    keys_of,
    logits_to_probs,
    truncate_mass,
)
from specserve.device import to_device
from specserve.drafters.base import SURE, DraftProposal, DraftTree
from specserve.models.kvcache import CachedLM

# Send q sparse when the draft sampler truncated it to at most this share of the vocabulary.
SPARSE_MAX_SHARE = 0.25
Q_MASS = 0.999  # the draft samples from the most likely tokens covering this mass ...
Q_MAX_ENTRIES = 256  # ... at most this many per position (measured in ADR 0010)


class HFDrafter:
    """`q_mass`/`q_max_entries`: the draft samples from its distribution truncated to the most
    likely tokens covering q_mass (at most q_max_entries), and sends that q sparse (ADR 0010).
    The in-process reference decoder and the draft worker must use the same values, or a seeded request
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
    def propose_tree(self, token_ids: Sequence[int], k: int, sampling: SamplingParams, seed: int,
                     width: int, sure: float = SURE, grammar: Any = None) -> DraftTree | None:
        """A token tree (ADR 0020) where the draft is unsure of the next token (its top
        probability under `sure`): its `width` likeliest next tokens (banned ones left out),
        each followed by its greedy chain to depth k, depth-first; None where it is sure. The
        candidates are chosen without draws, so the target verifies them exactly at any T.
        Under a constraint (`grammar`: structured/grammar.py DraftGrammar) every position's
        logits are masked to what it allows along the branch (a branch's own matcher).
        Sampled (T > 0, no constraint): `_sampled_tree`, drawn from q."""
        k = min(k, self.drafter.max_positions - len(token_ids))
        if k <= 0:
            return None
        if not sampling.greedy:
            return self._sampled_tree(token_ids, k, sampling, seed, width, sure) if grammar is None else None
        self.lm.reconcile(token_ids)
        logits = self.lm.extend(token_ids[self.lm.length:])[-1].float()
        root = grammar.start(token_ids) if grammar is not None else None
        if root is not None:
            logits = root.apply(logits)
        if sampling.banned_token_ids:
            logits = logits.index_fill(0, torch.tensor(list(sampling.banned_token_ids)), float("-inf"))
        top = torch.softmax(logits, -1).topk(width)
        if float(top.values[0]) >= sure:
            return None
        base = self.lm.length
        tokens: list[int] = []
        parents: list[int] = []
        for cand, prob in zip(top.indices.tolist(), top.values.tolist(), strict=True):
            if prob <= 0.0:  # fewer legal tokens than candidates wanted
                break
            masks = grammar.start(token_ids) if grammar is not None else None
            if masks is not None:
                masks.push(cand)
            tokens.append(cand)
            parents.append(-1)
            tok = cand
            for _ in range(k - 1):
                nxt = self.lm.extend([tok])[-1].float()
                if masks is not None:
                    nxt = masks.apply(nxt)
                if sampling.banned_token_ids:
                    nxt = nxt.index_fill(0, torch.tensor(list(sampling.banned_token_ids)), float("-inf"))
                tok = int(nxt.argmax())
                if masks is not None:
                    masks.push(tok)
                parents.append(len(tokens) - 1)
                tokens.append(tok)
            self.lm.crop(base)
        return DraftTree(tokens, parents)

    def _sampled_tree(self, token_ids: Sequence[int], k: int, sampling: SamplingParams, seed: int, width: int,
                      sure: float) -> DraftTree | None:
        """A sampled session's tree: the chain's own first draw from q (the truncated q the
        chain samples from, with the position's noise), then up to `width` - 1 more first
        candidates drawn from that q without replacement (algorithm/tree.py: draw_siblings),
        each followed by draws from q to depth k as a chain's; every node's q row goes with it,
        so the target judges them by recursive rejection sampling. None where the draw is sure."""
        from specserve.algorithm.tree import draw_siblings

        self.lm.reconcile(token_ids)
        logits = self.lm.extend(token_ids[self.lm.length:])[-1]
        n, d = len(token_ids), self.drafter
        root = draft_step(logits, sampling, seed, n, d.q_mass, d.q_max_entries)
        q0 = q_to_dense(_pack_q([root]), torch.tensor([root.token]), logits.shape[-1])[0].cpu()
        if float(q0[root.token]) >= sure:
            return None
        base = self.lm.length
        steps: list[DraftStep] = []
        parents: list[int] = []
        for cand in draw_siblings(q0, width, seed, n, root.token):
            steps.append(replace(root, token=cand))
            parents.append(-1)
            tok = cand
            for i in range(1, k):
                nxt = draft_step(self.lm.extend([tok])[-1], sampling, seed, n + i, d.q_mass, d.q_max_entries)
                parents.append(len(steps) - 1)
                steps.append(nxt)
                tok = nxt.token
            self.lm.crop(base)
        if len(steps) == k:  # q's support held one first token: the chain
            return None
        return DraftTree([s.token for s in steps], parents, _pack_q(steps))

    @torch.inference_mode()
    def guess_next(self, token_ids: Sequence[int], sampling: SamplingParams, seed: int) -> int | None:
        """At T = 0 the draft's argmax; at T > 0 a draw from q with the noise the target draws
        its token there with (ADR 0027): when q is close to p the two Gumbel-max draws agree (a
        coupling), so the guess is right as often as possible."""
        if len(token_ids) >= self.drafter.max_positions:
            return None
        self.lm.reconcile(token_ids)
        logits = self.lm.extend(token_ids[self.lm.length :])[-1]
        return bonus_guess(logits, sampling, seed, len(token_ids))

    def release(self) -> None:
        self.lm.reset()


@dataclass
class DraftStep:
    """One drafted position, on the host: the token, its truncated q (None at T = 0), the
    runner-up and the draft's (p(token), p(runner-up)).

    q is the truncated distribution's entries (`q_ids` [E] and `q` [E] float32, most likely
    first, zero-padded) when the truncation caps them (`q_entries`), else dense [V]. numpy:
    the step's single copy is read once, and the proposal is built without torch ops."""

    token: int
    q: np.ndarray | None
    runner_up: int | None
    confidence: tuple[float, float]
    q_ids: np.ndarray | None = None


@dataclass
class DevicePick:
    """The same for one row, on the logits' device: nothing read back. `pack`
    lays it out as one float64 row for the step's single copy to the host."""

    token: torch.Tensor  # [] int64
    head: torch.Tensor  # [4] float64: token, runner-up (-1 = none), p(token), p(runner-up)
    q: torch.Tensor | None  # [E] entries or [V] dense, float32; None at T = 0
    q_ids: torch.Tensor | None  # [E] int64 with entries; None when dense or at T = 0

    def pack(self, width: int | None = None) -> torch.Tensor:
        """float64: the head, then q's ids and probs (entries) or q (dense), zero-padded to
        `width` when given. Token ids are exact in float64, and so are float32 probabilities."""
        parts = [self.head] + [t.double() for t in (self.q_ids, self.q) if t is not None]
        row = torch.cat(parts) if len(parts) > 1 else self.head
        return row if width is None else pad_to(row, width)

    @staticmethod
    def unpack(row: np.ndarray, sampling: SamplingParams, entries: int | None, vocab: int) -> DraftStep:
        """The host row `pack` wrote ([width] float64) -> a DraftStep."""
        token, alt = int(row[0]), int(row[1])
        q = q_ids = None
        if not sampling.greedy:
            if entries is not None:
                q_ids, q = row[4:4 + entries].astype(np.int64), row[4 + entries:4 + 2 * entries].astype(np.float32)
            else:
                q = row[4:4 + vocab].astype(np.float32)
        return DraftStep(token, q, alt if alt >= 0 else None, (float(row[2]), float(row[3])), q_ids)


def q_entries(q_max_entries: int, vocab: int) -> int | None:
    """How many entries carry a truncated q: the cap when it makes q sparse on the wire
    (`_pack_q`), else None (q is kept dense)."""
    return q_max_entries if 0 < q_max_entries <= SPARSE_MAX_SHARE * vocab else None


def pick_on_device(logits: torch.Tensor, sampling: SamplingParams, u: torch.Tensor | None, q_mass: float,
                   q_max_entries: int) -> DevicePick:
    """The draft token from the draft's logits [V] at one position, on their device: argmax at
    T = 0 (`greedy_picks_on_device`), else the Gumbel-max draw from q truncated to q_mass with
    the position's noise (ADR 0027: the noise the target draws its own token there with, keyed
    by the uniform `u`, [1] float64 on the device: uniform(seed, pos, BONUS)). Shared by the
    per-session path and the batched draft worker, so both draft the same from the same logits."""
    if sampling.greedy:
        tok, heads = greedy_picks_on_device(logits.unsqueeze(0), [sampling])
        return DevicePick(tok[0], heads[0], None, None)
    if u is None:
        raise ValueError("a sampled draft position needs its uniform")
    probs = truncate_mass(logits_to_probs(logits, sampling), q_mass, q_max_entries)
    entries = q_entries(q_max_entries, probs.shape[-1])
    if entries is None:
        tok = coupled_tokens(probs.unsqueeze(0), keys_of(u))  # [1]
        q, q_ids = probs, None
    else:  # the noise of the truncated q's support only (at most `entries` tokens, not V)
        q, q_ids = torch.topk(probs, entries)
        tok = coupled_among(q.unsqueeze(0), q_ids.unsqueeze(0), keys_of(u))
    head = draft_heads(_banned(logits.unsqueeze(0), [sampling]), tok, probs.unsqueeze(0))[0]
    return DevicePick(tok[0], head, q, q_ids)


def greedy_picks_on_device(logits: torch.Tensor,
                           samplings: Sequence[SamplingParams]) -> tuple[torch.Tensor, torch.Tensor]:
    """Argmax picks of B rows at once (one kernel per op, not one per row): logits [B, V] ->
    (tokens [B] int64, their heads [B, 4] float64; see `algorithm.sampling.draft_heads`, scored by the softmax of
    the logits)."""
    masked = _banned(logits, samplings)
    tok = masked.argmax(-1)  # as greedy_tokens: the first index on ties
    return tok, draft_heads(masked, tok, torch.softmax(logits.float(), -1))


def _banned(logits: torch.Tensor, samplings: Sequence[SamplingParams]) -> torch.Tensor:
    """logits [B, V] with each row's banned tokens at -inf (the input when none are)."""
    banned = [(i, sp.banned_token_ids) for i, sp in enumerate(samplings) if sp.banned_token_ids]
    if not banned:
        return logits
    masked = logits.clone()
    for i, ids in banned:
        masked[i].index_fill_(0, to_device(ids, logits.device), float("-inf"))
    return masked


def pad_to(row: torch.Tensor, width: int) -> torch.Tensor:
    return row if row.shape[0] == width else torch.nn.functional.pad(row, (0, width - row.shape[0]))


def draft_step(logits: torch.Tensor, sampling: SamplingParams, seed: int, pos: int, q_mass: float,
               q_max_entries: int) -> DraftStep:
    """`pick_on_device` read back at once: the per-session path, which feeds each token to
    its own next forward."""
    u = None if sampling.greedy else to_device(uniform(seed, [pos], Purpose.BONUS), logits.device)
    pick = pick_on_device(logits, sampling, u, q_mass, q_max_entries)
    entries = q_entries(q_max_entries, logits.shape[-1]) if not sampling.greedy else None
    width = 4 + (0 if sampling.greedy else 2 * entries if entries is not None else logits.shape[-1])
    return DevicePick.unpack(pick.pack(width).cpu().numpy(), sampling, entries, logits.shape[-1])


def make_proposal(steps: Sequence[DraftStep], sampling: SamplingParams, dropped: int) -> DraftProposal:
    if not steps:
        return DraftProposal([], None, dropped_on_reconcile=dropped)
    q = None if sampling.greedy else _pack_q(steps)
    return DraftProposal([s.token for s in steps], q, dropped_on_reconcile=dropped,
                         runner_up=[s.runner_up for s in steps], confidence=[s.confidence for s in steps])


def bonus_on_device(logits: torch.Tensor, sampling: SamplingParams, u: torch.Tensor | None) -> torch.Tensor:
    """The draft's guess of the target's token ([] int64 on the logits' device); `u`: [1]
    float64, uniform(seed, pos, BONUS), at T > 0 (see HFDraftSession.guess_next)."""
    if sampling.greedy:
        return greedy_tokens(logits, sampling).long()
    if u is None:
        raise ValueError("a sampled guess needs its uniform")
    return coupled_tokens(logits_to_probs(logits, sampling).unsqueeze(0), keys_of(u))[0].long()


def bonus_guess(logits: torch.Tensor, sampling: SamplingParams, seed: int, pos: int) -> int:
    """The draft's guess of the target's token at `pos` (see HFDraftSession.guess_next)."""
    u = None if sampling.greedy else to_device(uniform(seed, [pos], Purpose.BONUS), logits.device)
    return int(bonus_on_device(logits, sampling, u))


def _pack_q(steps: Sequence[DraftStep]) -> DenseQ | SparseQ:
    """The steps' q [K, ...] -> sparse when truncation left few tokens with mass, else dense.
    Exact. Sparse entries are the most likely first, cut to the widest position's support
    (ties in probability by token id)."""
    probs = np.stack([s.q for s in steps if s.q is not None])
    support = int((probs > 0).sum(-1).max())
    if steps[0].q_ids is not None:
        ids = np.stack([s.q_ids for s in steps if s.q_ids is not None])
    elif support <= SPARSE_MAX_SHARE * probs.shape[-1]:
        ids = np.argsort(-probs, axis=-1, kind="stable")
        probs = np.take_along_axis(probs, ids, -1)
    else:
        return DenseQ(probs=torch.from_numpy(probs))
    return SparseQ(ids=torch.from_numpy(np.ascontiguousarray(ids[:, :support])),
                   probs=torch.from_numpy(np.ascontiguousarray(probs[:, :support])))
