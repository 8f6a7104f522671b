"""Where the engine's draft blocks come from (ADR 0014): a `DraftSource` per pool.

The engine tells a source when a session opens, each round's outcome, and when it closes.
Each call is made on the loop thread and must not block. The source delivers blocks through
the callback the engine attached; it may deliver from any thread, at any time. A block names
the committed prefix it assumes, and the engine uses it only for exactly that prefix.

`LocalDrafts` runs an in-process drafter (a small model, n-gram, a prediction) and delivers
each block at once. It serves the in-process reference decoder and the tests. The draft workers'
stream (`Draft.Link`) is the remote source.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from specserve.engine.session import DraftBlock, EngineSession, Outcome
from specserve.state.prefix import CommittedPrefix
from specserve.structured.grammar import DraftGrammar, propose_constrained

if TYPE_CHECKING:
    from specserve.algorithm.rejection import QProbs
    from specserve.drafters.base import Drafter, DraftSession

DRAFT_UNAVAILABLE = "draft_unavailable"

Deliver = Callable[[DraftBlock], None]


class DraftSource(Protocol):
    def drafts_for(self, session_id: str) -> bool:
        """False when no replica can draft for the session now: its rows run plain at once,
        failing closed (an exact session waits, unless `refused`)."""
        ...

    def refused(self, session_id: str) -> bool:
        """True when the pool will never draft for the session (a replica refused it): not
        even an exact session waits for its blocks."""
        ...

    def attach(self, deliver: Deliver) -> None: ...
    def open(self, session: EngineSession) -> None: ...
    def outcome(self, outcome: Outcome) -> None: ...
    def close(self, session_id: str) -> None: ...


def clip(block: DraftBlock, k: int, offset: int = 0) -> tuple[list[int], QProbs]:
    """The block's drafts from `offset` (those before it are committed already), at most k,
    with their q rows."""
    from specserve.step import q_rows

    end = min(len(block.tokens), offset + k)
    tokens = list(block.tokens[offset:end])
    q = block.q
    if (offset, end) != (0, len(block.tokens)):
        q = q_rows(q, slice(offset, end))
    return tokens, q


class _Local:
    """One session's state in a local source: the prefix it has seen, the drafter's session."""

    def __init__(self, session: EngineSession, draft: DraftSession, grammar: Any = None) -> None:
        self.prefix = CommittedPrefix(session.committed.ids)
        self.sampling = session.plan.params.sampling
        self.seed = session.plan.seed
        self.draft = draft
        self.grammar = grammar  # structured/grammar.py DraftGrammar: drafts from the masked q


class LocalDrafts:
    # drafts on the engine's thread, between its steps: every session of a step waits for each
    # one's drafting (Speculation prices K so)
    on_engine_thread = True

    def __init__(self, drafter: Drafter, mask_drafts: bool = True) -> None:
        self.drafter = drafter
        self.mask_drafts = mask_drafts  # under a constraint, the drafter drafts from its masked q (ADR 0017)
        self.deliver: Deliver | None = None
        self.sessions: dict[str, _Local] = {}

    def drafts_for(self, session_id: str) -> bool:
        return True

    def refused(self, session_id: str) -> bool:
        return False

    def attach(self, deliver: Deliver) -> None:
        self.deliver = deliver

    def open(self, session: EngineSession) -> None:
        local = self.sessions[session.id] = _Local(session, self.drafter.start(), self._grammar(session))
        self._propose(session.id, local, session.k_next)

    def _grammar(self, session: EngineSession) -> Any:
        g = session.grammar
        if g is None or not self.mask_drafts:
            return None
        return DraftGrammar(g.compiled, session.prompt_len, g.vocab_size, g.width)

    def outcome(self, outcome: Outcome) -> None:
        local = self.sessions.get(outcome.session_id)
        if local is None:
            return
        local.prefix.crop(outcome.committed_len - len(outcome.emitted))
        local.prefix.extend(outcome.emitted)
        self._propose(outcome.session_id, local, outcome.k, outcome.width)

    def close(self, session_id: str) -> None:
        local = self.sessions.pop(session_id, None)
        if local is not None:
            local.draft.release()

    def _propose(self, session_id: str, local: _Local, k: int, width: int = 1) -> None:
        if k <= 0 or self.deliver is None:
            return
        t = time.perf_counter()
        n = len(local.prefix)
        tree = getattr(local.draft, "propose_tree", None)
        if width > 1 and tree is not None:  # a token tree where it pays (ADR 0020)
            # (a draft model masks its branches to the constraint; the target prunes what it forbids)
            proposed = tree(local.prefix.ids, k, local.sampling, local.seed, width, grammar=local.grammar)
            if proposed is not None:
                self.deliver(DraftBlock(session_id, n, local.prefix.hash_at(n), tuple(proposed.tokens), proposed.q,
                                        draft_ms=(time.perf_counter() - t) * 1e3, parents=tuple(proposed.parents)))
                return
        proposal = propose_constrained(local.draft, local.prefix.ids, k, local.sampling, local.seed, local.grammar)
        self.deliver(DraftBlock(session_id, n, local.prefix.hash_at(n), tuple(proposal.tokens), proposal.q,
                                draft_ms=(time.perf_counter() - t) * 1e3))


class PredictionDrafts(LocalDrafts):
    """Predicted Outputs beside the target: each session drafts from its own prediction
    (`plan.prediction`), in process, one-hot q (ADR 0012)."""

    def __init__(self) -> None:
        super().__init__(None)  # type: ignore[arg-type]  # a drafter per session, from its plan

    def open(self, session: EngineSession) -> None:
        from specserve.drafters.prediction import PredictionDrafter

        drafter = PredictionDrafter(session.plan.prediction, session.prompt_len)
        local = self.sessions[session.id] = _Local(session, drafter.start(), self._grammar(session))
        self._propose(session.id, local, session.k_next)


class DraftPools:
    """The engine's draft sources, by pool, as a session's rounds need them."""

    def __init__(self, sources: Mapping[str, DraftSource], deliver: Deliver) -> None:
        self.sources = dict(sources)
        # the pools that draft from the target's features (ADR 0020): fixed per pool
        self.feature_pools = {name for name, source in self.sources.items() if getattr(source, "wants_features", False)}
        # the pools drafted on the engine's thread (LocalDrafts): fixed per pool; and their
        # drafting since the step began (the step cost fit leaves it out: the K choice prices it)
        self.serial_pools = {name for name, source in self.sources.items()
                             if getattr(source, "on_engine_thread", False)}
        self.serial_s = 0.0
        # the sources that learn from every finished session, whichever pool it ran on (the
        # suffix pool's class indexes, ADR 0026): fixed per pool
        self.learners: list[Any] = [s for s in self.sources.values() if getattr(s, "learns_from_outputs", False)]
        for source in self.sources.values():
            source.attach(deliver)

    def of(self, s: EngineSession) -> DraftSource | None:
        """The session's pool's source (None: plain, or a pool this engine has no source for)."""
        return self.sources.get(s.plan.pool or "")

    def open(self, s: EngineSession, source: DraftSource) -> None:
        self._timed(s, source.open, s)

    def outcome(self, s: EngineSession, source: DraftSource, outcome: Outcome) -> None:
        """The round's outcome to the session's source (which asks it for the next block)."""
        self._timed(s, source.outcome, outcome)

    def _timed(self, s: EngineSession, call: Callable[[Any], None], arg: Any) -> None:
        t = time.perf_counter()
        call(arg)
        if (s.plan.pool or "") in self.serial_pools:  # drafted on this thread, now
            self.serial_s += time.perf_counter() - t

    def live(self, s: EngineSession) -> bool:
        source = self.of(s)
        return source is not None and source.drafts_for(s.id)

    def can_draft(self, s: EngineSession) -> bool:
        """Whether a row of the session may wait for a block. An exact session also waits
        while its pool has no live replica (a restarted target's links still connecting, a
        failover), up to `exact_wait_s` (ADR 0014: a plain round changed its sample path; since
        the coupled sampler, ADR 0027, it changes only its speed). It waits
        once per outage (not when its last round already ran plain for want of a replica),
        and not for a pool that refused it."""
        source = self.sources.get(s.plan.pool or "")  # (per session a step: no call through `of`)
        if source is None:
            return False
        if source.drafts_for(s.id):
            return True
        waited = bool(s.rounds) and s.rounds[-1].fallback_reason == DRAFT_UNAVAILABLE
        return s.plan.exact and not waited and not source.refused(s.id)

    def wants_features(self, s: EngineSession) -> bool:
        """The pool drafts from the target's features (ADR 0020): its rows return them (a pool
        that says per session: where it drafts on the host)."""
        if s.plan.pool not in self.feature_pools:
            return False
        per_session = getattr(self.sources[s.plan.pool or ""], "features_for", None)
        return per_session is None or bool(per_session(s))

    def on_device(self, s: EngineSession) -> bool:
        """The session drafts on the target's own head, inside the step (ADR 0025): its rows
        say so (`StepRow.head`)."""
        source = self.sources.get(s.plan.pool or "")
        decide = getattr(source, "on_device", None)
        return decide is not None and bool(decide(s))

    def features(self, s: EngineSession, start: int, features: Any) -> None:
        """The target's features for a session's positions from `start`, to a pool that drafts from them."""
        source = self.of(s)
        if source is not None and hasattr(source, "features"):
            source.features(s.id, start, features)

    def close(self, s: EngineSession) -> None:
        """The session ended: its source forgets it, and every source that learns from outputs
        hears how it ended (`served`: on this thread, at the end of its last round)."""
        source = self.of(s)
        if source is not None:
            source.close(s.id)
        for learner in self.learners:
            learner.served(s)
