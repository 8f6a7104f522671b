"""The `eagle-local` draft pool (issue 40, ADR 0020): an EAGLE-style head drafting beside the
target, on the engine's thread, from the target's own features.

The engine asks the target for the features of every committed position it feeds (a prompt's
chunks; each round's last committed tokens and accepted drafts: `StepRow.features`) and hands
them here (`features`) before the round's outcome. Per session this source keeps the head's
inputs (the projected features, by position) and its cache of keys and values, advanced over
the committed prefix as far as the features reach; at each outcome it drafts a block of K
from the last committed position: the head's prediction from (the feature before the last
committed token, that token), then from its own predictions, each token through the target's
final norm and LM head (greedy: argmax, one-hot q; sampled: a draw with
uniform(seed, position, DRAFT) from the sampling transform of those logits, q dense).
A rollback (features re-sent from an earlier position, after an adoption or a reconcile)
crops both.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch

from specserve.algorithm.rng import Purpose, uniform
from specserve.algorithm.sampling import draw, logits_to_probs
from specserve.drafters.eagle import EagleHead, HeadCache, TargetParts
from specserve.engine.drafting import Deliver
from specserve.engine.session import DraftBlock, EngineSession, Outcome
from specserve.state.prefix import CommittedPrefix

if TYPE_CHECKING:
    from specserve.algorithm.rejection import QProbs


SURE = 0.9  # the head's top probability at a block's first position above which it drafts a chain


class _HeadSession:
    def __init__(self, session: EngineSession) -> None:
        self.prefix = CommittedPrefix(session.committed.ids)
        self.sampling = session.plan.params.sampling
        self.seed = session.plan.seed
        self.cache = HeadCache()
        self.inputs: torch.Tensor | None = None  # [n, H]: the head's inputs of positions 0..n-1


class EagleLocalDrafts:
    wants_features = True  # the engine asks the target for this pool's sessions' features

    def __init__(self, head: EagleHead, parts: TargetParts) -> None:
        self.head = head
        self.parts = parts
        self.deliver: Deliver | None = None
        self.sessions: dict[str, _HeadSession] = {}
        self.feature_bytes = 0  # what the target handed out, for the bytes-per-token figure

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return self.head.cfg.feature_layers

    def drafts_for(self, session_id: str) -> bool:
        return True

    def refused(self, session_id: str) -> bool:
        return False

    def attach(self, deliver: Deliver) -> None:
        self.deliver = deliver

    def open(self, session: EngineSession) -> None:
        # nothing to draft from until the target has fed the prompt: its features come first
        self.sessions[session.id] = _HeadSession(session)

    @torch.inference_mode()
    def features(self, session_id: str, start: int, feats: Any) -> None:
        """The target's features of positions start.. (committed): the head's inputs there."""
        s = self.sessions.get(session_id)
        if s is None or feats is None or feats.shape[0] == 0:
            return
        self.feature_bytes += feats.numel() * feats.element_size()
        inp = self.head.project(feats.to(device="cpu", dtype=torch.float32))
        have = 0 if s.inputs is None else s.inputs.shape[0]
        if start > have:  # a gap (features this source never saw): start over from what it has
            return
        keep = s.inputs[:start] if s.inputs is not None else inp[:0]
        s.inputs = torch.cat([keep, inp])
        s.cache.crop(min(s.cache.length, max(start - 1, 0)))

    def outcome(self, outcome: Outcome) -> None:
        s = self.sessions.get(outcome.session_id)
        if s is None:
            return
        s.prefix.crop(outcome.committed_len - len(outcome.emitted))
        s.prefix.extend(outcome.emitted)
        self._propose(outcome.session_id, s, outcome.k, outcome.width)

    def close(self, session_id: str) -> None:
        self.sessions.pop(session_id, None)

    @torch.inference_mode()
    def _propose(self, session_id: str, s: _HeadSession, k: int, width: int = 1) -> None:
        n = len(s.prefix)
        if k <= 0 or self.deliver is None or s.inputs is None or s.inputs.shape[0] < n - 1 or n < 2:
            return
        t = time.perf_counter()
        ids = s.prefix.ids
        if s.cache.length < n - 2:  # the committed positions the cache lacks, with their true features
            a = s.cache.length
            self.head.extend(s.cache, s.inputs[a:n - 2], self.parts.embed(torch.tensor(ids[a + 1:n - 1])))
        parents = None
        if width > 1:
            tokens, parents = self._tree(s, s.inputs[n - 2], ids[n - 1], k, width)
            q = None
        if parents is None:
            tokens, q = self._block(s, s.inputs[n - 2], ids[n - 1], n, k)
        self.deliver(DraftBlock(session_id, n, s.prefix.hash_at(n), tuple(tokens), q,
                                draft_ms=(time.perf_counter() - t) * 1e3,
                                parents=tuple(parents) if parents is not None else None))

    def _tree(self, s: _HeadSession, inp: torch.Tensor, token: int, k: int,
              width: int) -> tuple[list[int], list[int] | None]:
        """A token tree (ADR 0020): the head's `width` likeliest tokens at the first position
        where it is unsure of the first (its top probability under SURE), each followed by its
        greedy chain to depth k; depth-first, so parents come before children. (None, None)
        where it is sure: a chain is drafted instead."""
        saved = (s.cache.k, s.cache.v, s.cache.length)
        tokens: list[int] = []
        parents: list[int] = []
        try:
            first = self.head.extend(s.cache, inp[None], self.parts.embed(torch.tensor([token])))
            probs = torch.softmax(self.parts.logits(first)[0], -1)
            top = probs.topk(width)
            if float(top.values[0]) >= SURE:
                return [], None
            after_first = (s.cache.k, s.cache.v, s.cache.length)
            for cand in top.indices.tolist():
                s.cache.k, s.cache.v, s.cache.length = after_first
                tokens.append(cand)
                parents.append(-1)
                x, tok = first, cand
                for _ in range(k - 1):
                    x = self.head.extend(s.cache, x, self.parts.embed(torch.tensor([tok])))
                    tok = int(self.parts.logits(x)[0].argmax())
                    tokens.append(tok)
                    parents.append(len(tokens) - 2)
        finally:
            s.cache.k, s.cache.v, s.cache.length = saved
        return tokens, parents

    def _block(self, s: _HeadSession, inp: torch.Tensor, token: int, n: int, k: int) -> tuple[list[int], QProbs]:
        """K tokens from position n - 2's input and the last committed token; the cache is
        left holding the committed positions only."""
        from specserve.algorithm.rejection import DenseQ

        saved = (s.cache.k, s.cache.v, s.cache.length)
        out: list[int] = []
        qs = []
        x = inp[None]
        try:
            for i in range(k):
                pred = self.head.extend(s.cache, x, self.parts.embed(torch.tensor([token])))
                logits = self.parts.logits(pred)[0]
                if s.sampling.greedy:
                    token = int(logits.argmax())
                else:
                    probs = logits_to_probs(logits, s.sampling)
                    u = torch.from_numpy(uniform(s.seed, [n + i], Purpose.DRAFT))
                    token = int(draw(probs[None], u)[0])
                    qs.append(probs)
                out.append(token)
                x = pred
        finally:
            s.cache.k, s.cache.v, s.cache.length = saved
        return out, (DenseQ(torch.stack(qs)) if qs else None)
