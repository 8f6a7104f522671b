"""The `eagle-local` draft pool (ADR 0020): an EAGLE-style head drafting beside the
target, on the engine's thread, from the target's own features.

The engine asks the target for the features of every committed position it feeds (a prompt's
chunks; each round's last committed tokens and accepted drafts: `StepRow.features`) and hands
them here (`features`) before the round's outcome. Each session's `EagleSession`
(drafters/eagle.py) keeps the head's inputs by position and its key/value cache over the
committed prefix; at each outcome it drafts a block of K from the last committed position, or
a token tree of the engine's `width` where the head is unsure of the first token. A rollback
(features re-sent from an earlier position, after an adoption or a reconcile) crops both.
"""

from __future__ import annotations

import time
from typing import Any

from specserve.drafters.eagle import EagleHead, EagleSession, TargetParts
from specserve.engine.drafting import LocalDrafts
from specserve.engine.session import DraftBlock, EngineSession
from specserve.state.prefix import CommittedPrefix
from specserve.step import head_tree


class _HeadSession:
    def __init__(self, session: EngineSession, head: EagleHead, parts: TargetParts) -> None:
        self.prefix = CommittedPrefix(session.committed.ids)
        self.sampling = session.plan.params.sampling
        self.seed = session.plan.seed
        self.eagle = EagleSession(head, parts)


class EagleLocalDrafts(LocalDrafts):
    """A local source (LocalDrafts: it always drafts, never refuses) whose drafter is the head."""

    wants_features = True  # the engine asks the target for this pool's sessions' features

    def __init__(self, head: EagleHead, parts: TargetParts) -> None:
        super().__init__(None)  # type: ignore[arg-type]  # a head session per session, not a drafter
        self.head = head
        self.parts = parts
        self.sessions: dict[str, _HeadSession] = {}  # type: ignore[assignment]

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return self.head.cfg.feature_layers

    def open(self, session: EngineSession) -> None:
        # nothing to draft from until the target has fed the prompt: its features come first
        self.sessions[session.id] = _HeadSession(session, self.head, self.parts)

    def features(self, session_id: str, start: int, feats: Any) -> None:
        """The target's features of positions start.. (committed): the head's inputs there."""
        s = self.sessions.get(session_id)
        if s is not None and feats is not None:
            s.eagle.add_features(start, feats)

    # (`outcome` is LocalDrafts': the session's prefix moved, then this `_propose`)

    def close(self, session_id: str) -> None:
        self.sessions.pop(session_id, None)

    def _propose(self, session_id: str, s: _HeadSession, k: int, width: int = 1) -> None:  # type: ignore[override]
        if k <= 0 or self.deliver is None:
            return
        t = time.perf_counter()
        block = s.eagle.draft(s.prefix.ids, k, s.sampling, s.seed, width)
        if block is None:
            return
        tokens, q, parents = block
        n = len(s.prefix)
        self.deliver(DraftBlock(session_id, n, s.prefix.hash_at(n), tuple(tokens), q,
                                draft_ms=(time.perf_counter() - t) * 1e3,
                                parents=tuple(parents) if parents is not None else None))


class _OnDevice:
    """A session drafting on the target's own head: only its committed prefix is kept here."""

    def __init__(self, session: EngineSession) -> None:
        self.prefix = CommittedPrefix(session.committed.ids)
        self.greedy = session.plan.params.sampling.greedy  # (a sampled session's drafts there are chains)


class OnDeviceSessions:
    """A source whose sessions draft inside the target's device step where it judges their rows
    (ADR 0025: no banned tokens, no constraint; greedy or sampled): such a session's block is
    placeholders the round fills (`_propose`); the others open as the source's base class does."""

    sessions: dict[str, Any]

    @staticmethod
    def on_device(session: EngineSession) -> bool:
        sampling = session.plan.params.sampling
        return not sampling.banned_token_ids and session.plan.constraint is None

    def open(self, session: EngineSession) -> None:
        if not self.on_device(session):
            super().open(session)  # type: ignore[misc]
            return
        local = self.sessions[session.id] = _OnDevice(session)
        self._propose(session.id, local, session.k_next)  # type: ignore[attr-defined]


class DeviceHeadDrafts(OnDeviceSessions, EagleLocalDrafts):
    """`eagle-local` where the target runs the head inside its device step (ADR 0025,
    `BatchedTarget.enable_head`): a session whose rows the device step judges (greedy, no
    banned tokens, no constraint) drafts there, inside the round that verifies the drafts;
    its block here is K placeholders (`DraftBlock.on_device`), delivered at once. Other
    sessions draft on the host's head as `EagleLocalDrafts` does, from the features. A sampled
    session's rounds there are chains (trees on the device are greedy)."""

    def features_for(self, session: EngineSession) -> bool:
        return not self.on_device(session)

    def _propose(self, session_id: str, s: Any, k: int, width: int = 1) -> None:
        if not isinstance(s, _OnDevice):
            super()._propose(session_id, s, k, width)
            return
        if k <= 0 or self.deliver is None:
            return
        n = len(s.prefix)  # a tree where the engine offers one: the head's one shape (step.head_tree)
        parents = tuple(head_tree(width, k)) if width > 1 and s.greedy else None
        nodes = k * (width if parents else 1)
        self.deliver(DraftBlock(session_id, n, s.prefix.hash_at(n), (0,) * nodes, parents=parents, on_device=True))
