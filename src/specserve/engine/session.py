"""One session as the engine drives it (nano-vllm's `Sequence`): the one owner of its
committed tokens, the length its KV holds, its plan, the draft block waiting for it, and its
status. Everything else reads it. Torch-free.

The records that cross the engine's edges live here too: a `DraftBlock` (a draft replica's
proposal for exactly one committed prefix), an `Outcome` (what a round committed, for the
draft replica), and a `CommitRecord` (what the committer appends to Redis).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import StrEnum
from functools import cached_property
from typing import TYPE_CHECKING, Any

from specserve.algorithm.round import RoundStats, draft_budget
from specserve.algorithm.stops import IncrementalText, StopChecker
from specserve.control.arms import Fallback
from specserve.params import GenerationParams, SamplingParams, coupled_for
from specserve.state.prefix import CommittedPrefix
from specserve.step import subtree_nodes
from specserve.structured.constraint import Constraint

if TYPE_CHECKING:
    from specserve.algorithm.rejection import QProbs


@dataclass(frozen=True)
class EnginePlan:
    """What the engine needs of a session's plan: sampling, budget, stops, seed (resolved),
    the draft pool (None: plain) and K, the most drafts a round may verify."""

    params: GenerationParams
    pool: str | None = None
    workload_class: str = ""
    plain_reason: str = Fallback.SPECULATION_OFF.value  # a plain session's rounds' fallback_reason
    adaptive: bool = False  # the engine picks K in 0..k every round (kchoice.py); else K is fixed
    stats_class: str = ""  # the class the controller's statistics and the metrics count it under
    prediction: tuple[int, ...] = ()  # Predicted Outputs: the request's expected output (pool `prediction`)
    shadow_pool: str | None = None  # shadow mode: a speculative twin beside this plain session
    shadow: bool = False  # this is the twin: it commits nothing
    # the client chose the seed: at T > 0 its output must be the same on every run, so its rows
    # sample with the coupled sampler (ADR 0027: `params.sampling.coupled`, set here)
    seeded: bool = False
    k_min: int = 1  # adaptive: the least K a speculative round verifies (the policy's bound)
    k_max: int = 0  # adaptive: the most; params.num_draft_tokens is the K the first round starts at
    constraint: Constraint | None = None  # structured output (ADR 0017): the target masks every position
    draft_priority: int = 0  # its class's (ADR 0021): a saturated draft replica sheds the lowest first
    # its class's suffix settings (ADR 0026: the policy's suffix_* fields), as stored; None = the defaults
    suffix: dict[str, Any] | None = None
    adapter: str = ""  # its LoRA adapter (ADR 0029; "" = the base): its KV slot is tied to it
    adapter_label: str = "none"  # the `adapter` label of its metrics (bounded: serving/metrics.py)

    def __post_init__(self) -> None:
        # every row of the session (verify, local and remote drafting) carries its sampling
        object.__setattr__(self, "params", replace(self.params, sampling=coupled_for(self.params.sampling,
                                                                                     self.seeded)))

    @classmethod
    def from_stored(cls, d: dict[str, Any]) -> EnginePlan:
        """The engine's part of a session's stored plan (the `params` the router wrote:
        specserve/services/router/plan.py SessionPlan.encode)."""
        sampling = SamplingParams(d["temperature"], d["top_k"], d["top_p"], tuple(d["banned"]))
        params = GenerationParams(max_tokens=int(d["max_tokens"]), sampling=sampling, num_draft_tokens=int(d["k"]),
                                  stop=tuple(d["stop"]), seed=int(d["seed"]))
        return cls(params, d.get("pool") or None, d.get("workload_class", ""),
                   d.get("plain_reason") or Fallback.SPECULATION_OFF.value, bool(d.get("adaptive")),
                   d.get("stats_class") or d.get("workload_class", ""), tuple(d.get("prediction") or ()),
                   d.get("shadow_pool") or None, seeded=bool(d.get("seeded")),
                   k_min=int(d.get("k_min") or 1), k_max=int(d.get("k_max") or 0),
                   constraint=Constraint.decode(d.get("constraint")),
                   draft_priority=int(d.get("draft_priority") or 0), suffix=d.get("suffix") or None,
                   adapter=str(d.get("adapter") or ""))

    @property
    def exact(self) -> bool:
        """Its output is fixed by its seed: sampled, with a seed the client chose."""
        return self.seeded and self.params.sampling.temperature > 0

    @property
    def index_class(self) -> str:
        """The class whose suffix index its output feeds and its drafts read (ADR 0026): its
        statistics' class, constrained or not (`other` for a class no policy names, so a
        client cannot grow the indexes or their Redis streams without bound)."""
        return (self.stats_class or self.workload_class).partition("+")[0]

    @property
    def labels(self) -> tuple[str, str, str]:
        """(class, pool, adapter) of its metrics: `none` for a plain session and for the base."""
        return self.workload_class, self.pool or "none", self.adapter_label

    @property
    def seed(self) -> int:
        if self.params.seed is None:
            raise ValueError("an engine plan needs a resolved seed")
        return self.params.seed

    @cached_property  # (asked several times a round)
    def k(self) -> int:
        """The most drafts a round verifies (0: plain)."""
        if not self.pool:
            return 0
        return max(self.k_max, self.params.num_draft_tokens) if self.adaptive else self.params.num_draft_tokens


# what a block is assumed to be worth (tokens emitted by its round) before a session has
# verified any, and what a session's estimate relaxes to while its blocks keep coming late
PRIOR_EMITTED = 2.0


@dataclass(frozen=True)
class DraftBlock:
    """K draft tokens for exactly the committed prefix (base_len, base_hash) they assume."""

    session_id: str
    base_len: int
    base_hash: int
    tokens: tuple[int, ...]
    q: QProbs = None  # their draft distributions; None = one-hot
    draft_ms: float = 0.0  # the replica's compute for it (0 when it was drafted ahead)
    predrafted: bool = False
    # a token tree (algorithm/tree.py, ADR 0020): each token's parent among them, -1 for the last
    # committed token; None: a chain. A tree's q: None where its candidates were chosen without
    # draws (one-hot), else each node's q row (a sampled tree drawn from q, algorithm/tree.py)
    parents: tuple[int, ...] | None = None
    # drafted on the target's device inside the round that verifies it (the target's own head,
    # ADR 0025): `tokens` are K placeholders, and the round's result names the drafts
    on_device: bool = False


@dataclass(frozen=True)
class Outcome:
    """A round's result as a draft replica needs it: the committed length after the round,
    the tokens it emitted, and the K the next block may have (0: no block wanted); `width`:
    the most candidates its first position may have (a token tree, where the pool drafts
    trees and the engine's load makes the wider verify pay; 1: a chain)."""

    session_id: str
    committed_len: int
    emitted: tuple[int, ...]
    k: int
    width: int = 1


@dataclass(frozen=True)
class CommitRecord:
    """One round's tokens for Redis, fenced by the length they extend and the epoch."""

    session_id: str
    epoch: int
    expected_len: int  # generated tokens committed before this round
    tokens: tuple[int, ...]
    text: str  # the text they make visible (stop strings held back until settled)
    finish_reason: str | None
    stats: str = ""  # the final round's: the session's statistics (JSON), stored before it finishes

    @property
    def round_id(self) -> str:
        return f"{self.epoch}:{self.expected_len}"


MAX_AHEAD = 8  # blocks drafted ahead kept per session (a few likely outcomes of one round)


class Status(StrEnum):
    RUNNING = "running"
    FINISHED = "finished"  # eos | stop | length
    CANCELLED = "cancelled"
    FAILED = "failed"


@dataclass(eq=False)
class EngineSession:
    id: str
    plan: EnginePlan
    prompt_len: int
    committed: CommittedPrefix  # prompt + generated tokens, as the engine has settled them
    text: IncrementalText
    epoch: int = 0
    handle: Any = None  # the model step's KV handle
    cached: int = 0  # positions its KV holds (after the last step)
    block: DraftBlock | None = None
    ahead: list[DraftBlock] = field(default_factory=list)  # blocks for prefixes not yet committed
    waiting_since: float | None = None  # when it began waiting for a block for this prefix
    status: Status = Status.RUNNING
    finish_reason: str | None = None
    error: str = ""
    rounds: list[RoundStats] = field(default_factory=list)
    arrived: float = 0.0  # the engine's clock when it was added
    expected_emitted: float = PRIOR_EMITTED  # tokens per verified round, recent average: what a block is worth
    k_choice: int | None = None  # the engine's K for the next round (adaptive plans); None: the plan's
    held_plain: int = 0  # rounds in a row the engine held it plain (it probes now and then)
    probing: int = 0  # rounds left in a probe: held plain, it asks for blocks but waits for none
    # when its draft source was asked for a block, by the committed length the block is for
    # (prices the wait: a block is timed when it arrives, even one that came too late to use)
    asks: dict[int, float] = field(default_factory=dict)
    grammar: Any = None  # its matcher when the plan has a constraint (structured/grammar.py: ConstrainedRow)
    unacked: int = 0  # its rounds handed to the committer that Redis has not answered yet
    last_round_end: float | None = None  # perf_counter when its previous round's step ended

    @classmethod
    def new(cls, session_id: str, prompt_ids: list[int], plan: EnginePlan, stops: StopChecker,
            generated: list[int] | tuple[int, ...] = (), epoch: int = 0, now: float = 0.0) -> EngineSession:
        """A session from its prompt and the tokens already committed (an adopted session
        continues after them)."""
        text = IncrementalText(stops)
        text.advance(list(generated), None)
        return cls(session_id, plan, len(prompt_ids), CommittedPrefix([*prompt_ids, *generated]), text,
                   epoch=epoch, arrived=now)

    @property
    def generated(self) -> list[int]:
        return self.committed.ids[self.prompt_len :]

    @property
    def n_generated(self) -> int:
        """len(generated), without copying it (the engine asks several times a round)."""
        return len(self.committed) - self.prompt_len

    @property
    def running(self) -> bool:
        return self.status is Status.RUNNING

    @property
    def k_next(self) -> int:
        """Drafts the next round may verify (0: a plain round)."""
        k = self.plan.k if self.k_choice is None else min(self.k_choice, self.plan.k)
        return draft_budget(k, self.n_generated, self.plan.params.max_tokens)

    @property
    def prefilling(self) -> bool:
        """More than the last committed token is still to be fed to the KV."""
        return len(self.committed) - self.cached > 1

    def usable(self, block: DraftBlock) -> int | None:
        """How many of the block's drafts the committed prefix has already passed, when what
        is left is a draft for exactly the committed prefix; None when the block is stale.

        A block drafted for prefix P whose first d drafts were since committed (a plain round
        emitted the token the draft guessed) still drafts P + those d tokens: its remaining
        tokens, and their q rows, were drawn conditioned on exactly that prefix, with draft
        randomness keyed by absolute position. Using them is as lossless as a fresh block.

        Example: block (base_len 10, tokens [7, 8, 9]), committed now 11 tokens ending in 7
        -> 1: drafts [8, 9] verify after the committed prefix.
        """
        d = len(self.committed) - block.base_len
        if d < 0 or d >= len(block.tokens) or block.base_hash != self.committed.hash_at(block.base_len):
            return None
        if block.parents is not None:  # a tree: the committed tokens are a path in it
            inside = subtree_nodes(block.tokens, block.parents, self.committed.ids[block.base_len:]) if d else []
            return d if inside is not None else None
        if self.committed.ids[block.base_len :] != list(block.tokens[:d]):
            return None
        return d

    def declined(self, block: DraftBlock | None) -> bool:
        """An empty block for exactly the committed prefix: the drafter has nothing to
        propose there (an n-gram without a match), so the round runs plain at once."""
        n = len(self.committed)
        return block is not None and not block.tokens and block.base_len == n and \
            block.base_hash == self.committed.hash_at(n)

    def offer(self, block: DraftBlock) -> bool:
        """Keep the block if (what is left of) it drafts the committed prefix, or if it was
        drafted ahead for a longer prefix this session may reach (ADR 0010: pushed during the
        verify, before the commit it assumes); drop a stale one."""
        if not self.running:
            return False
        if self.usable(block) is not None or self.declined(block):
            self.block = block
            return True
        if block.base_len > len(self.committed):
            self.ahead = [*self.ahead[-(MAX_AHEAD - 1):], block]
            return True
        return False

    def promote(self) -> None:
        """After a commit: take a block drafted ahead for the prefix reached, if any (the one
        with the most drafts left); forget those it has passed."""
        n = len(self.committed)
        best, best_left = None, 0
        for b in self.ahead:
            offset = self.usable(b)
            if offset is not None and len(b.tokens) - offset > best_left:
                best, best_left = b, len(b.tokens) - offset
        self.ahead = [b for b in self.ahead if b.base_len > n]
        if best is not None:
            self.block = best

    def finish(self, status: Status, reason: str, error: str = "") -> None:
        self.status, self.finish_reason, self.error = status, reason, error
        self.block, self.ahead = None, []
