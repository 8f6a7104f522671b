"""The engine <-> model boundary (ADR 0019): one step descriptor and one typed result.

Everything that asks a model for work builds a `Step` of `StepRow`s and gets a `StepResult`
with one `RowResult` per row, in order: the target's engine loop (engine/loop.py), the draft
worker's micro-batcher (worker/batcher.py) and the in-process reference decoder
(worker/reference.py). What answers it is a `ModelStep` (worker/model_step.py): the batched
target and draft over the batched runner, or the per-session paths.

A row names its session's KV slot (what `ModelStep.open` gave), its kind, the committed
sequence (the step feeds whatever of it the slot does not hold yet, a prefill chunk at a
time), and per kind:
- VERIFY (the target): the draft block to verify (none: a plain row), its q, a constraint's
  legal tokens, and optionally a block mask over the new tokens (a token tree; None: a chain);
- DRAFT (a drafter): K positions to draft, and a constraint's matcher;
- GUESS (a drafter): its guess of the target's next token (drafting ahead).
A result is `done` (a verdict, a proposal or a guess), `again` (a long prompt fed one chunk:
ask again next step), or `error` (this row's input was bad; the rest of the step ran).

torch-free: the engine loop and the schedulers import it without the model stack.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from specserve.algorithm.rejection import QProbs, Verdict
    from specserve.drafters.base import DraftProposal
    from specserve.params import SamplingParams


class Kind(enum.Enum):
    VERIFY = "verify"
    DRAFT = "draft"
    GUESS = "guess"


@dataclass(eq=False)
class StepRow:
    slot: Any  # the session's KV slot or per-session state (ModelStep.open)
    kind: Kind
    ids: Sequence[int]  # the committed sequence (prompt + generated)
    sampling: SamplingParams
    seed: int
    drafts: list[int] = field(default_factory=list)  # VERIFY: the block (empty: a plain row)
    q: QProbs = None  # VERIFY: the block's draft distribution (None: one-hot)
    allowed: Any = None  # VERIFY: [len(drafts) + 1, V] bool, a constraint's legal tokens
    mask: Any = None  # VERIFY: [n, n] bool block mask over the new tokens (a token tree)
    k: int = 0  # DRAFT: positions to draft; VERIFY with `head`: drafts the target's own head gives
    grammar: Any = None  # DRAFT: structured/grammar.py DraftGrammar (q masked to the constraint)
    features: bool = False  # VERIFY: hand out the target's features of the committed positions fed (ADR 0020)
    # VERIFY: the drafts form a token tree (algorithm/tree.py): each one's parent among them, or
    # -1 for the last committed token; None: a chain
    parents: list[int] | None = None
    # VERIFY: the session drafts on the target's own EAGLE head, inside the step (ADR 0025): every
    # row feeds the head its committed positions, and `k` drafts come from it (no `drafts`)
    head: bool = False

    @classmethod
    def verify(cls, slot: Any, ids: Sequence[int], drafts: list[int], q: QProbs, sampling: SamplingParams,
               seed: int, allowed: Any = None, features: bool = False) -> StepRow:
        return cls(slot, Kind.VERIFY, ids, sampling, seed, drafts=list(drafts), q=q, allowed=allowed,
                   features=features)

    @classmethod
    def draft(cls, slot: Any, ids: Sequence[int], k: int, sampling: SamplingParams, seed: int,
              grammar: Any = None) -> StepRow:
        return cls(slot, Kind.DRAFT, ids, sampling, seed, k=k, grammar=grammar)

    @classmethod
    def guess(cls, slot: Any, ids: Sequence[int], sampling: SamplingParams, seed: int, grammar: Any = None) -> StepRow:
        return cls(slot, Kind.GUESS, ids, sampling, seed, k=1, grammar=grammar)


@dataclass
class RowResult:
    status: str = "done"  # "done" | "again" | "error"
    verdict: Verdict | None = None  # VERIFY
    proposal: DraftProposal | None = None  # DRAFT
    guess: int | None = None  # GUESS (None: no guess)
    error: Exception | None = None
    cached_len: int = 0  # VERIFY: the slot's length after the verdict
    rolled_back: int = 0  # positions dropped while reconciling, and the rejected drafts
    fed: int = 0  # tokens this pass fed (a row's share of the step's cost)
    # VERIFY rows that asked: the target's features [n, F] (on its device) of the positions from
    # `features_start` that this pass fed and that are committed (a chunk's tokens; the last
    # committed tokens and the accepted drafts)
    features: Any = None
    features_start: int = 0
    # VERIFY rows of a session drafting on the target's own head (ADR 0025): the drafts the head
    # gave this round (empty: it was not current, the row ran plain); None for other rows
    drafted: list[int] | None = None

    @property
    def again(self) -> bool:
        return self.status == "again"

    @property
    def failed(self) -> bool:
        return self.status == "error"

    @classmethod
    def later(cls, fed: int = 0) -> RowResult:
        return cls("again", fed=fed)

    @classmethod
    def of_error(cls, exc: Exception) -> RowResult:
        return cls("error", error=exc)


@dataclass(frozen=True)
class Step:
    rows: Sequence[StepRow]


@dataclass
class StepResult:
    rows: list[RowResult]
    # the device's time for this step where it is not the call's: a step launched before the
    # call (the target's lookahead, ADR 0019) ran on the device while the caller did its own work
    device_ms: float | None = None


def first_branch(tokens: Sequence[int], parents: Sequence[int]) -> list[int]:
    """A token tree's first branch as a chain: the first candidate and its first child, and
    so on (the leading nodes of a depth-first tree whose parent is the node before)."""
    out: list[int] = []
    for i, p in enumerate(parents):
        if p != i - 1:
            break
        out.append(int(tokens[i]))
    return out


def reparented(parents: Sequence[int], nodes: Sequence[int]) -> list[int]:
    """The parents of a subtree's `nodes` (indices into the tree, parents first) among them,
    -1 for those whose parent is the subtree's root."""
    where = {n: i for i, n in enumerate(nodes)}
    return [where.get(parents[n], -1) for n in nodes]


def subtree_nodes(tokens: Sequence[int], parents: Sequence[int], path: Sequence[int]) -> list[int] | None:
    """The nodes of the token tree below the node that `path` (tokens, from the root) reaches,
    as indices into the tree (their q rows, where it has q; `reparented` gives their parents
    with that node as the root): a tree block drafted for prefix P still drafts P + path there
    (a plain round committed the path meanwhile). None where the path leaves the tree.

    Example: tokens [5, 6, 7], parents [-1, 0, -1], path [5] -> [1] (token 6, parent -1)."""
    node = -1
    for t in path:
        node = next((i for i, p in enumerate(parents) if p == node and tokens[i] == t), -2)
        if node == -2:
            return None
    below = {node}
    out: list[int] = []
    for i, p in enumerate(parents):
        if p in below and i != node:
            below.add(i)
            out.append(i)
    return out


def q_rows(q: QProbs, rows: slice | list[int]) -> QProbs:
    """The q of some of a block's drafts (a slice of a chain, a token tree's nodes): each of
    q's fields (DenseQ's probs, SparseQ's ids and probs) at those rows; None stays None."""
    if q is None:
        return None
    return replace(q, **{f.name: getattr(q, f.name)[rows] for f in fields(q)})


def head_tree(width: int, k: int) -> list[int]:
    """The parents of the one tree shape the target's own head drafts (ADR 0025): `width` first
    candidates, each followed by its chain to depth k, depth-first."""
    return [-1 if s == 0 else b * k + s - 1 for b in range(width) for s in range(k)]


def tree_depth(parents: Sequence[int]) -> int:
    """A token tree's depth (its longest path), from its parents (-1: the root)."""
    depths: list[int] = []
    for p in parents:
        depths.append(1 if p < 0 else depths[p] + 1)
    return max(depths, default=0)


class ModelStep(Protocol):
    """What runs a step: worker/model_step.py's batched target and draft over the batched
    runner, and the per-session target and draft."""

    max_batch: int | None  # the most rows one step takes (None: the caller's limit)
    # A step whose VERIFY rows may be token trees (`StepRow.parents`, judged by
    # algorithm/tree.py) says so with a class attribute `verifies_trees = True`; the engine
    # gives any other step chains.

    def open(self, session_id: str, adapter: str = "") -> Any:
        """A slot for a new session (its KV slot or its own state), tied to its LoRA adapter
        (ADR 0029; "" = the base; a step that serves none refuses one: AdapterNotFound)."""
        ...

    def close(self, slot: Any) -> None:
        ...

    @property
    def slots(self) -> tuple[int, int] | None:
        """(used, free) KV slots, or None where the step keeps no slot table."""
        ...

    def step(self, step: Step) -> StepResult:
        ...
