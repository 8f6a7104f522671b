"""Draft servicer: a thin layer over the worker skeleton (specserve.worker). Its one RPC is
`Link`, the target's stream (services/draft/link.py, ADR 0014); the link drafts each block
through `propose`, which reconciles the session to the committed prefix (NeedsFullPrefix
when it holds too little) and queues one item: the queued sessions' K draft steps run
batched (ADR 0013); the n-gram drafter keeps its per-session path.

While the target verifies, the worker drafts ahead for the prefixes the next round is likely
to start from (ADR 0010), at background priority: the scheduler runs those items only when
no foreground block is queued, so a block never waits behind more than the one background
batch already running. A prepared block is kept per session and pushed to the target on the
link; it is used only for exactly the prefix it assumed."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from specserve.algorithm.sampling import SamplingParams
from specserve.drafters.base import SURE, Drafter, DraftProposal
from specserve.errors import InvalidRequest, SessionNotFound
from specserve.model_info import ModelInfo
from specserve.params import check_k
from specserve.services.draft.link import Link
from specserve.serving.metrics import WorkerMetrics
from specserve.serving.telemetry import tracer
from specserve.serving.wire import check_token_ids, sampling_from_proto
from specserve.state.prefix import chain
from specserve.step import Kind, StepRow, q_rows
from specserve.v1 import draft_pb2, draft_pb2_grpc
from specserve.worker.batcher import BACKGROUND, FOREGROUND, Work
from specserve.worker.core import WorkerCore
from specserve.worker.model_step import Batching, make_draft_step
from specserve.worker.predraft import BlockKey, SpeculationCache, likely_outcomes, likely_prefix
from specserve.worker.qcodec import q_to_proto
from specserve.worker.session_table import WorkerSession

if TYPE_CHECKING:
    from specserve.algorithm.rejection import QProbs

Push = Callable[[draft_pb2.Predraft], None]  # a block drafted ahead, on its way to the target


@dataclass
class _Ahead:
    """The servicer's state of one session: the blocks drafted ahead for it."""

    cache: SpeculationCache = field(default_factory=SpeculationCache)
    task: asyncio.Task | None = None  # the pre-drafting task of its last round


def _stop_ahead(seq: WorkerSession) -> None:
    if seq.extra is not None:
        if seq.extra.task is not None:
            seq.extra.task.cancel()
        seq.extra.cache.clear()


class DraftServicer(draft_pb2_grpc.DraftServicer):
    def __init__(self, drafter: Drafter, max_sessions: int, metrics: WorkerMetrics | None = None,
                 simulated_token_ms: float = 0.0, max_predraft_branches: int = 4, batching: Batching | None = None,
                 max_batch: int = 32, max_wait_ms: float = 0.0, evict_idle_s: float = 1.0,
                 max_batched_tokens: int = 2048, tokenizer: ModelInfo | None = None,
                 model_thread: Executor | None = None, max_queue: int = 0) -> None:
        self.simulated_token_ms = simulated_token_ms
        self.max_queue = max_queue  # draft capacity (ADR 0021): saturated at this queue depth; 0 = never
        self.tokenizer = tokenizer  # the pair's tokenizer: constraints compiled for draft-side masks (ADR 0017)
        self.drafter = drafter
        self.max_predraft_branches = max_predraft_branches
        self.metrics = metrics or WorkerMetrics("draft")
        b = batching or Batching(enabled=False)
        self.model = make_draft_step(drafter, replace(b, max_sessions=min(b.max_sessions, max_sessions)))
        self.core = WorkerCore(self.model, self.metrics, max_sessions, max_batch, max_wait_ms, evict_idle_s,
                               max_batched_tokens, extra_s=self._simulated_s, on_close=_stop_ahead, name="draft",
                               executor=model_thread)
        self.sessions = self.core.sessions
        self.links: set[Link] = set()  # the targets' open streams (ended as the replica drains)

    def saturated(self) -> bool:
        """The replica's queue holds `max_queue` work items or more: it takes no new session
        and sheds those its drafts help least (services/draft/link.py; ADR 0021)."""
        return bool(self.max_queue) and self.core.scheduler.depth() >= self.max_queue

    def _simulated_s(self, batch: list[Work]) -> float:
        """A slower draft device: simulated_token_ms per draft step of the batch."""
        if not self.simulated_token_ms:
            return 0.0
        return self.simulated_token_ms * max(1 if w.payload.kind is Kind.GUESS else w.payload.k for w in batch) / 1e3

    def _session(self, session_id: str) -> WorkerSession:
        seq = self.core.session(session_id)
        if seq.extra is None:
            seq.extra = _Ahead()
        return seq

    def grammar(self, kind: str, value: str, prompt_len: int) -> Any:
        """A session's draft-side constraint (ADR 0017), compiled against this replica's
        tokenizer (once per constraint); None for an unconstrained session or a replica
        without a tokenizer (it then drafts free: the output is the same)."""
        if not kind or self.tokenizer is None:
            return None
        from specserve.drafters.hf import HFDrafter
        from specserve.structured.constraint import Constraint
        from specserve.structured.grammar import DraftGrammar

        # a model's logits width; the tokenizer's own size for a model-free drafter
        width = self.drafter.vocab_size if isinstance(self.drafter, HFDrafter) else 0
        grammars = self.tokenizer.grammars(width)
        return DraftGrammar(grammars.compile(Constraint(kind, value)), prompt_len, grammars.vocab_size,
                            width or grammars.vocab_size)

    def ready(self, session_id: str, length: int) -> bool:
        """Whether the session's drafter can draft after `length` committed tokens: a head needs
        the target's features of the positions before the last (a session reopened here after a
        failover gets them just after its open); any other drafter always can."""
        ready = getattr(self._session(session_id).handle, "ready", None)
        return ready is None or bool(ready(length))

    def features(self, session_id: str, f: draft_pb2.Features) -> None:
        """The target's features of a session's committed positions (the Link, ADR 0020), for
        a drafter that drafts from them; ignored by the others."""
        from specserve.drafters.eagle import features_from_wire

        seq = self._session(session_id)
        add = getattr(seq.handle, "add_features", None)
        if add is not None:
            try:
                feats = features_from_wire(f.rows, f.width, f.data)
            except ValueError as exc:
                raise InvalidRequest(str(exc)) from exc
            add(int(f.start), feats)

    async def propose(self, request: draft_pb2.ProposeRequest, push: Push | None = None,
                      grammar: Any = None) -> draft_pb2.ProposeResponse:
        k = check_k(request.k)
        sampling = sampling_from_proto(request.sampling)
        sampling.check_vocab(self.drafter.vocab_size)
        check_token_ids(request.prefix.tokens, self.drafter.vocab_size)
        seq = self._session(request.session_id)
        if seq.extra.task is not None:  # drafting ahead for the previous round: this one is here
            seq.extra.task.cancel()
        ids = seq.reconcile(request.prefix)
        seed = int(request.seed)
        key = BlockKey(len(ids), seq.prefix.hash_at(len(ids)), k, sampling, seed, grammar is not None)
        prepared = seq.extra.cache.take(key)
        if prepared is not None:
            proposal, ahead_s = prepared
            elapsed = 0.0
        else:
            proposal, elapsed = await self._draft(seq, ids, k, sampling, seed, grammar=grammar)
            ahead_s = 0.0
        self.metrics.call_latency.labels("propose").observe(elapsed)
        self.metrics.dropped_on_reconcile.inc(proposal.dropped_on_reconcile)
        branches = min(request.predraft_branches, self.max_predraft_branches)
        first, parents = proposal, None  # (drafting ahead follows the chain's likely outcomes)
        if request.tree_width > 1 and grammar is None and prepared is None:
            proposal, parents, more_s = await self._tree(seq, ids, first, k, sampling, seed, request.tree_width)
            elapsed += more_s
        if branches and first.tokens:
            seq.extra.task = asyncio.create_task(self._draft_ahead(request.session_id, seq, ids, first, k,
                                                                   sampling, seed, branches, push, grammar))
        response = self._response(proposal, elapsed, prepared is not None, ahead_s)
        if parents is not None:
            response.parents.extend(parents)
        return response

    async def _tree(self, seq: WorkerSession, ids: list[int], first: DraftProposal, k: int,
                    sampling: SamplingParams, seed: int, width: int) -> tuple[DraftProposal, list[int] | None, float]:
        """A token tree (ADR 0020). A model-free drafter (n-gram) gives its own: the latest
        matches of its longest suffix match with distinct next tokens, up to `width` branches
        (microseconds: no block to schedule). A model's is two first candidates where the draft
        is unsure of the first token (its probability under SURE): the chain, then the draft's
        runner-up there (sampled: a second draw from q without the first, algorithm/tree.py:
        draw_siblings) with its own chain to depth k, drafted as a second block; the chain
        alone elsewhere. (proposal, parents or None, the second block's cost in seconds.)"""
        if getattr(seq.handle, "inline_tree", False):
            found = seq.handle.propose_tree(ids, k, sampling, seed, width)
            if found is None:
                return first, None, 0.0
            return DraftProposal(found.tokens, found.q, first.dropped_on_reconcile), found.parents, 0.0
        if not first.tokens or not first.runner_up or first.runner_up[0] is None or not first.confidence \
                or first.confidence[0][0] >= SURE or first.runner_up[0] == first.tokens[0]:
            return first, None, 0.0
        second = int(first.runner_up[0]) if sampling.greedy else \
            _second_draw(first, seed, len(ids), self.drafter.vocab_size)
        if second is None:
            return first, None, 0.0
        rest, cost_s = (await self._draft(seq, [*ids, second], k - 1, sampling, seed)) if k > 1 else \
            (DraftProposal([], None), 0.0)
        a = len(first.tokens)
        tokens = [*first.tokens, second, *rest.tokens]
        parents = [*range(-1, a - 1), -1, *range(a, a + len(rest.tokens))]
        q = None if sampling.greedy else _tree_q(first, rest, self.drafter.vocab_size)
        return (DraftProposal(tokens, q, first.dropped_on_reconcile, first.runner_up, first.confidence),
                parents, cost_s)

    def _response(self, proposal: DraftProposal, elapsed_s: float, predrafted: bool,
                  ahead_s: float) -> draft_pb2.ProposeResponse:
        return draft_pb2.ProposeResponse(
            tokens=proposal.tokens, q=q_to_proto(proposal.q), rollback_tokens=proposal.dropped_on_reconcile,
            draft_ms=elapsed_s * 1e3, drafter=self.drafter.name, predrafted=predrafted, predraft_ms=ahead_s * 1e3)

    async def _draft(self, seq: WorkerSession, ids: list[int], k: int, sampling: SamplingParams, seed: int,
                     priority: int = FOREGROUND, guess: bool = False, grammar: Any = None):
        """One block (or the bonus guess) through the scheduler: (result, its cost in seconds
        at the current batch size, worker/cost.py)."""
        row = (StepRow.guess(seq.handle, ids, sampling, seed, grammar) if guess
               else StepRow.draft(seq.handle, ids, k, sampling, seed, grammar))
        done = await self.core.run(seq, row, 1 if guess else k, priority)
        return (done.value.guess if guess else done.value.proposal), done.cost_s

    async def _draft_ahead(self, session_id: str, seq: WorkerSession, ids: list[int], proposal: DraftProposal, k: int,
                           sampling: SamplingParams, seed: int, branches: int, push: Push | None,
                           grammar: Any = None) -> None:
        """Blocks for the likely next prefixes, likeliest first (likely_outcomes: all accepted
        + the bonus guess, or a rejection at j + the runner-up), each cached and pushed when
        ready. The bonus guess costs one draft forward, spent only when that branch comes."""
        base = seq.prefix.hash_at(len(ids))
        prepared = 0
        # a child of the Propose's server span that outlives it: the waterfall draws it beside
        # the round's Verify, which it overlaps
        span = tracer().start_span("specserve.draft.ahead")
        try:
            for j in likely_outcomes(len(proposal.tokens), proposal.runner_up, proposal.confidence, branches):
                guess, guess_s = None, 0.0
                if j == len(proposal.tokens):
                    guess, guess_s = await self._draft(seq, [*ids, *proposal.tokens], 1, sampling, seed,
                                                       BACKGROUND, guess=True, grammar=grammar)
                prefix = likely_prefix(ids, proposal.tokens, j, proposal.runner_up, guess)
                if prefix is None:
                    continue
                block, elapsed = await self._draft(seq, prefix, k, sampling, seed, BACKGROUND, grammar=grammar)
                prefix_hash = chain(base, prefix[len(ids):])
                seq.extra.cache.put(BlockKey(len(prefix), prefix_hash, k, sampling, seed, grammar is not None),
                                    (block, elapsed + guess_s))
                self.metrics.predrafts.inc()
                # the waterfall matches a round to the pre-drafted block it verified by this
                span.add_event("specserve.predrafted", {"specserve.prefix_len": len(prefix), "specserve.k": k})
                if push is not None:
                    push(draft_pb2.Predraft(session_id=session_id, prefix_len=len(prefix), prefix_hash=prefix_hash,
                                            k=k, block=self._response(block, 0.0, True, elapsed + guess_s)))
                prepared += 1
        except asyncio.CancelledError:
            pass  # the next round arrived: what it needs was cached or is drafted afresh
        except SessionNotFound:
            pass  # the session was released meanwhile: nobody will ask for these blocks
        finally:
            span.set_attribute("specserve.predrafted_blocks", prepared)
            span.end()

    async def Link(self, request_iterator, context):
        link = Link(self)
        self.links.add(link)
        try:
            async for reply in link.serve(request_iterator):
                yield reply
        finally:
            self.links.discard(link)

    def end_links(self) -> None:
        """Draining: end every target's stream now (GrpcServer.on_drain), so the targets move
        their sessions to the pool's other replicas instead of waiting out the grace."""
        for link in list(self.links):
            link.end()


def _second_draw(first: DraftProposal, seed: int, position: int, vocab: int) -> int | None:
    """A sampled block's second first candidate: a draw from its first q row without the
    chain's own first token (algorithm/tree.py: draw_siblings); None where q held one token."""
    import torch

    from specserve.algorithm.rejection import q_to_dense
    from specserve.algorithm.tree import draw_siblings

    if first.q is None:
        return None
    q0 = q_to_dense(q_rows(first.q, slice(0, 1)), torch.tensor(first.tokens[:1]), vocab)[0]
    drawn = draw_siblings(q0, 2, seed, position, first.tokens[0])
    return drawn[1] if len(drawn) > 1 else None


def _tree_q(first: DraftProposal, rest: DraftProposal, vocab: int) -> QProbs:
    """The q rows of a two-branch tree: the chain's, its first row again for the second first
    candidate (drawn from the same q), then the second branch's. Always a q for every node
    (whether a tree is offered must not depend on the second draw: that would bias it): sparse
    rows padded to one width with zero entries, or dense where the blocks' forms differ."""
    import torch

    from specserve.algorithm.rejection import DenseQ, SparseQ, q_to_dense

    parts = [(first.q, first.tokens), (q_rows(first.q, slice(0, 1)), first.tokens[:1])]
    if rest.tokens:
        parts.append((rest.q, rest.tokens))
    if all(isinstance(q, SparseQ) for q, _ in parts):
        width = max(q.ids.shape[1] for q, _ in parts)  # type: ignore[union-attr]

        def pad(t: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.pad(t, (0, width - t.shape[1]))

        return SparseQ(torch.cat([pad(q.ids) for q, _ in parts]),  # type: ignore[union-attr]
                       torch.cat([pad(q.probs) for q, _ in parts]))  # type: ignore[union-attr]
    return DenseQ(torch.cat([q_to_dense(q, torch.tensor(list(t)), vocab) for q, t in parts]))
