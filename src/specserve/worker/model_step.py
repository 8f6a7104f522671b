"""The model step of a worker (ADR 0019): `step(Step) -> StepResult` over the rows of one
step, on the model thread (specserve/step.py has the descriptors). The target's engine loop
builds the target's steps (ADR 0014), the draft worker's micro-batcher the draft's (ADR 0013),
the in-process reference decoder both.

Two model steps per role, behind one interface (open/close a session's slot, step):
- `BatchedTarget` / `BatchedDraft`: the batched runner (models/runner.py, ADR 0008; on CUDA
  its short rows replayed from CUDA graphs, ADR 0019). The target runs every verify, plain
  and prefill row of the step in one forward and judges them with one rejection-sampling call
  per kind of row; the draft runs the rows' K autoregressive positions as K batched forwards
  (a row leaves when its K is reached).
- `SessionTarget` / `SessionDraft`: the per-session path (an HF cache per session, or the
  n-gram drafter), row by row. Used for architectures the runner does not support (one
  log line, `runner.choose_path`), for the n-gram drafter, and with batching off.

Long prompts are fed in chunks (`prefill_chunks`): a row whose committed tokens span more
than one chunk feeds one chunk and answers `again` (its caller asks again next step), so
a long prompt never stalls the running sessions.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from specserve.algorithm.rejection import Verdict, verdicts_from_host
from specserve.algorithm.rng import Purpose, uniform
from specserve.algorithm.sampling import SamplingParams
from specserve.algorithm.tree import Tree, tree_judge_on_device
from specserve.algorithm.tree import walk as tree_walk
from specserve.device import (
    activation_reserve_bytes,
    kv_budget_bytes,
    resolve_device,
    resolve_dtype,
    to_device,
    to_host,
)
from specserve.drafters.base import DraftProposal
from specserve.drafters.hf import (
    DevicePick,
    HFDrafter,
    bonus_on_device,
    greedy_picks_on_device,
    make_proposal,
    pad_to,
    pick_on_device,
    q_entries,
)
from specserve.errors import AdapterNotFound
from specserve.models.kv_slots import prefill_chunks
from specserve.models.runner import SHORT_ROW, ModelRunner, Row, choose_path
from specserve.models.verifier import (
    JudgeRow,
    TargetModel,
    judge_on_device,
    verdicts_of,
    verify_block,
)
from specserve.step import Kind, RowResult, Step, StepResult, StepRow
from specserve.structured.grammar import propose_constrained
from specserve.worker.head_rounds import ChainedRounds, HeadRows, head_verdict, verdict_rows
from specserve.worker.lookahead import PlainLookahead, judged_in_step, row_sampling


@dataclass
class Batching:
    """How a worker batches (the services' settings map onto this)."""

    enabled: bool = True
    kv_budget_mb: float = 512.0  # KV storage for every session's slot, allocated at start
    max_sessions: int = 256  # and at most this many slots
    max_len: int = 0  # positions per slot; 0 = the model's context length
    prefill_chunk: int = 128
    tile: int | None = 4  # ADR 0008; None: the plain batched forward (exact_batching: fast)
    fuse_upto: int = 128
    device: str = "auto"  # device.py: auto, cpu, cuda, cuda:N
    dtype: str = "auto"  # auto (bf16 on CUDA, fp32 on the CPU), fp32, bf16, fp16
    gpu_memory_utilization: float = 0.9  # CUDA: the KV budget's share of device memory (device.kv_budget_bytes)
    max_batch: int = 32  # work items per step: with prefill_chunk, bounds a step's activations
    # ADR 0019: on CUDA, "auto" runs decode, verify and draft rows as the fixed-shape device step
    # replayed from CUDA graphs; "off" keeps the eager forward. `fixed_step` forces the device
    # step's fixed shapes on (True, graphs only on CUDA) or off (False); None: with the graphs
    cuda_graphs: str = "auto"
    fixed_step: bool | None = None
    capture_budget_s: float = 60.0  # start-up capture of the common buckets stops after this long
    # start-up capture covers rounds of K <= capture_k (the policies' adaptive range, 1..8) and
    # trees of up to capture_tree_width first candidates (the target's tree_width), so a K, a
    # tree or speculation off chosen per step replays a graph captured already (issue 51 item 6)
    capture_k: int = 8
    capture_tree_width: int = 1
    # torch.compile in the device step (ADR 0019): False, "whole" (the run), "pieces" (a layer's
    # two pieces around attention), "layer" (a whole layer, attention in), or "auto" (the
    # settings' cuda_compile: layer with the CUDA graphs on where torch finds Triton, else none)
    compile_step: bool | str = False
    # issue 51 item 7: each layer's program ends with the next layer's norm (models/step_fusion.py);
    # off until a GPU run has compared it with the layers as they were
    fuse_step: bool = False
    # ADR 0019, async steps: a target step of greedy plain rows only launches the next step of
    # the same rows (fed its own picks, on the device) before it returns, so the engine's
    # bookkeeping runs while the device computes. None: on where the CUDA graphs are
    lookahead: bool | None = None
    # a drafter inside the device step's rounds beside the target's slots (ADR 0025: a draft
    # model): its KV a position over the target's, and its parameters (on the device twice: the
    # round's copy and the host drafter's). The KV budget then holds both KVs, the reserve the weights
    drafter_kv_share: float = 0.0
    drafter_params: int = 0
    max_loras: int = 0  # LoRA adapters (ADR 0029): room for this many, of rank up to max_lora_rank (0: none)
    max_lora_rank: int = 16

    @classmethod
    def from_settings(cls, s) -> Batching:
        """From DraftSettings or TargetSettings (same field names)."""
        return cls(enabled=s.batching, kv_budget_mb=s.kv_budget_mb, max_sessions=s.max_sessions, max_len=s.max_len,
                   prefill_chunk=s.prefill_chunk, device=s.device, dtype=s.dtype,
                   gpu_memory_utilization=s.gpu_memory_utilization, max_batch=s.max_batch,
                   tile=None if s.exact_batching == "fast" else cls.tile, cuda_graphs=s.cuda_graphs,
                   compile_step="auto" if s.cuda_compile == "auto" else False,
                   lookahead=False if getattr(s, "async_steps", "auto") == "off" else None,
                   capture_tree_width=getattr(s, "tree_width", 1),
                   max_loras=getattr(s, "max_loras", 0), max_lora_rank=getattr(s, "max_lora_rank", 16))


_handles = itertools.count()


def step_compile(b: Batching, graphs: bool) -> bool | str:
    """What the device step compiles: `compile_step` as given, or for "auto" each layer whole
    where the graphs are on and torch has Triton for the device (ADR 0019)."""
    if b.compile_step != "auto":
        return b.compile_step
    from torch.utils._triton import has_triton

    return "layer" if graphs and has_triton() else False


def eager_tile(b: Batching, graphs: bool) -> int | None:
    """The eager forward's tile (ADR 0008) under these settings; `graphs`: the device step
    runs with CUDA graphs (not the graphs setting alone: with the fixed step forced off,
    everything is eager and the tiles keep it invariant). There a decode or verify row's
    bits already follow its bucket (ADR 0019), so tiles would keep
    nothing invariant and only run each prefill chunk a tile at a time: on the H200 a 16 × 128
    token prefill of the 1.1B target took 3.2 s so, one launch sequence per 4 tokens per layer
    (session 21's probe). There the prefill is one batched forward (`fast`)."""
    return None if graphs else b.tile


def make_runner(model: torch.nn.Module, b: Batching, load: Callable[..., ModelRunner] | None = None) -> ModelRunner:
    """The runner of `model` under these settings; `load`: what builds it in place of
    `ModelRunner.from_hf` (a tensor-parallel rank's shard, models/sharding.py: ShardLoader)."""
    device = resolve_device(b.device)
    dtype = resolve_dtype(b.dtype, device)

    def budget() -> int:  # called once the weights are on the device (the drafter's come after)
        reserve = activation_reserve_bytes(model.config, b.max_batch * b.prefill_chunk, b.max_batch * SHORT_ROW, dtype)
        reserve += 2 * b.drafter_params * (torch.finfo(dtype).bits // 8)
        total = kv_budget_bytes(device, b.kv_budget_mb, b.gpu_memory_utilization, reserve)
        return int(total / (1 + b.drafter_kv_share))  # (the rest: the drafter's KV over the same slots)

    if b.cuda_graphs not in ("auto", "off"):
        raise ValueError(f"cuda_graphs must be auto or off, got {b.cuda_graphs!r}")
    graphs = b.cuda_graphs == "auto" and device.type == "cuda"
    fixed = b.fixed_step if b.fixed_step is not None else graphs
    # the device step's scratch slot comes on top of the sessions' (within the byte budget)
    runner = (load or ModelRunner.from_hf)(model, kv_budget_bytes=budget, max_sessions=b.max_sessions + int(fixed),
                                 max_len=b.max_len or None, device=device, dtype=dtype,
                                 tile=eager_tile(b, graphs and fixed), fuse_upto=b.fuse_upto)
    if b.max_loras and runner.tp.size == 1:  # (ADR 0029; a tensor-parallel target has none)
        from specserve.models.lora import base_fingerprint
        from specserve.models.lora_set import enable_lora

        path = str(getattr(model, "name_or_path", "") or "")
        enable_lora(runner, model.config, b.max_loras, b.max_lora_rank, base_fingerprint(path) if path else "")
    if fixed:
        capture_startup(runner.enable_device_step(max_rows=b.max_batch, graphs=graphs,
                                                  compile=step_compile(b, graphs), fuse=b.fuse_step), b)
    return runner


def runs_device_step(b: Batching) -> bool:
    """A runner under these settings runs the device step (`make_runner`: the fixed step as
    forced, else with the CUDA graphs on CUDA)."""
    graphs = b.cuda_graphs == "auto" and resolve_device(b.device).type == "cuda"
    return b.fixed_step if b.fixed_step is not None else graphs


def capture_startup(step: Any, b: Batching) -> None:
    """The device step's start-up capture (logged; the rest when a step first needs them): the
    widths of every K up to `capture_k` and trees of `capture_tree_width` (issue 51 item 6)."""
    step.capture(step.startup_buckets(b.capture_k, b.capture_tree_width), b.capture_budget_s)


class _RunnerSessions:
    """A model's runner (from the batching settings) and open/close of its slots; `close`
    runs on the model thread (the caller's job)."""

    max_batch: int | None = None

    def __init__(self, model: torch.nn.Module, max_positions: int, b: Batching,
                 load: Callable[..., ModelRunner] | None = None) -> None:
        self.chunk = b.prefill_chunk
        self.runner = make_runner(model, b, load)
        self.max_positions = min(max_positions, self.runner.kv.max_len)

    def open(self, session_id: str, adapter: str = "") -> Any:
        """A session's KV slot, tied to its LoRA adapter (ADR 0029; "" = the base)."""
        handle = (session_id, next(_handles))  # unique: a reopened session never meets its old slot
        self.runner.allocate(handle, adapter)
        return handle

    @property
    def adapters(self) -> Any:
        """The LoRA adapters this model step holds (models/lora_set.py: LoraSet), or None."""
        return self.runner.lora

    def close(self, handle: Any) -> None:
        self.runner.free(handle)

    @property
    def slots(self) -> tuple[int, int]:
        """(used, free) KV slots."""
        kv = self.runner.kv
        scratch = 1 if self.runner.device_step is not None else 0  # the device step's own slot
        return kv.num_slots - kv.free_slots - scratch, kv.free_slots

    def _feed(self, handle: Any, ids: Sequence[int], extra: int) -> tuple[int, list[int], bool]:
        """Reconcile to `ids`; (positions dropped, tokens to feed now, whether they are the
        last of the prompt). `extra`: tokens the item will add after the prompt."""
        dropped = self.runner.reconcile(handle, ids)
        length = self.runner.length(handle)
        # only the next piece: its cut is the one prefill_chunks makes (an absolute position)
        first = (prefill_chunks(length, list(ids[length:length + self.chunk]), self.chunk)[0]
                 if len(ids) > length else [])
        if length + len(first) < len(ids):
            return dropped, first, False
        self.runner.kv.check_room(handle, len(first) + extra)
        return dropped, first, True


class BatchedTarget(_RunnerSessions):
    verifies_trees = True  # token trees: one row each, judged by algorithm/tree.py

    def __init__(self, target: TargetModel, b: Batching, load: Callable[..., ModelRunner] | None = None) -> None:
        """`load`: see `make_runner` (a tensor-parallel rank's shard, ADR 0030)."""
        self.target = target
        self.settings = b
        super().__init__(target.model, target.max_positions, b, load)
        ds = self.runner.device_step
        self.lookahead = ds is not None and (ds.graphs_on if b.lookahead is None else b.lookahead)
        self.plain = PlainLookahead(self)  # its lookahead steps (worker/lookahead.py)
        self.ahead_counts, self.gaps_ms = self.plain.counts, self.plain.gaps_ms
        self.heads: HeadRows | None = None  # the target's own EAGLE head (ADR 0025; `enable_head`)
        self._rows: list[Row] = []  # the last step's forward rows
        self._drafted: dict[int, list[int]] = {}  # the last step's head drafts, by forward row
        self.rounds: ChainedRounds | None = None  # its rounds chained on the device, with the lookahead

    def enable_head(self, head: Any) -> None:
        """Draft on `head` (an EagleHead for this target) inside the device step's rounds, for
        rows marked `StepRow.head` (ADR 0025); with the lookahead on, their rounds chain on the
        device. Needs the device step."""
        self.heads = HeadRows(self.runner, head)
        self.rounds = ChainedRounds(self) if self.lookahead else None
        self._recapture()
        b = self.settings
        self.heads.device.capture(b.capture_k, b.capture_budget_s, b.capture_tree_width)  # (logged)

    def open(self, session_id: str, adapter: str = "") -> Any:
        handle = super().open(session_id, adapter)
        if self.heads is not None:
            self.heads.opened(handle)
        return handle

    def close(self, handle: Any) -> None:
        if self.heads is not None:
            self.heads.closed(handle)
        super().close(handle)

    def step(self, step: Step) -> StepResult:
        """Every VERIFY row (a prefill chunk, a plain row, a verify row) in one forward, then
        the verdicts in one copy to the host and the rejected drafts rolled back. A step of
        plain rows may already be on the device: the lookahead the step before launched
        (`PlainLookahead.take`); a step that is may launch the next (`PlainLookahead.after`)."""
        taken = self.plain.take(step)
        if taken is not None:
            return taken
        if self.rounds is not None and self.rounds.ahead is not None:
            chained = self.rounds.take(step)
            if chained is not None:
                return chained
        self.plain.last_clock = None  # (the step below runs between: no gap to the next)
        out = self._step(step)
        if not (self.lookahead and self.plain.after(step, out)) and self.rounds is not None \
                and any(job.head for job in step.rows):
            self.rounds.launch(step, self._rows, out.rows)
        return out

    def _row_of(self, job: StepRow, feed: list[int], last: bool, start: int) -> Row:
        """The forward's row: the tokens to feed, then (at the prompt's end) the drafts."""
        if job.head and self.heads is not None:  # its drafts from the target's own head (ADR 0025)
            return self.heads.row(job, feed, last, start)
        if last and job.parents is not None:  # a token tree: its block mask, positions by depth
            return _tree_row(job.slot, feed, job.drafts, Tree(tuple(job.parents)))
        return Row(job.slot, feed + job.drafts if last else feed, num_logits=len(job.drafts) + 1 if last else 0,
                   sampling=row_sampling(job), seed=job.seed)  # (a sampled row judged on the device)

    def _step(self, step: Step) -> StepResult:
        results = [RowResult() for _ in step.rows]
        rows, live = [], []
        for i, job in enumerate(step.rows):
            try:
                if job.kind is not Kind.VERIFY:
                    raise ValueError(f"the target's step takes verify rows, not {job.kind.value}")
                dropped, feed, last = self._feed(job.slot, job.ids, len(job.drafts) + 1)
            except Exception as exc:  # per row: a bad row must not fail the step
                results[i] = RowResult.of_error(exc)
                continue
            start = self.runner.length(job.slot)
            tail = len(feed)
            row = self._row_of(job, feed, last, start)
            rows.append(row)
            results[i].fed = len(row.tokens)
            live.append((i, job, last, dropped, start, tail))
        self._rows = rows
        logits = self.runner.forward(rows)  # on the runner's device: judged there, one copy back
        feats = self.runner.last_features
        keeping = bool(self.runner.feature_layers)  # (features only once asked for: keep_features)
        judged = []
        for r, ((i, job, last, dropped, start, _), lg) in enumerate(zip(live, logits, strict=True)):
            if not last:
                results[i] = RowResult.later(results[i].fed)
                if job.head and self.heads is not None:  # a prompt chunk: the head fed its positions
                    self.heads.fed(job, start, results[i].fed, None, False, feats[r] if feats else None)
                if job.features and keeping:  # a chunk of the prompt: every token fed is committed
                    results[i].features, results[i].features_start = feats[r].clone(), start
            else:
                judged.append((i, job, lg, dropped, r))
        verdicts, paths = self._judge(judged)
        for (i, job, _, dropped, r), verdict in zip(judged, verdicts, strict=True):
            keep = len(job.ids) + verdict.num_accepted
            start, tail = live[r][4], live[r][5]
            if job.head and self.heads is not None:  # its drafts named, the head fed (ADR 0025)
                self.heads.settled(job, rows[r], results[i], verdict, start, tail,
                                   self._drafted.get(r, []), r in self.runner.fixed_rows, feats[r] if feats else None)
            path = paths.get(r)
            if path is not None:  # a tree's accepted path, compacted to follow the prefix
                self.runner.kv.move(job.slot, [start + tail + n for n in path],
                                    [start + tail + k for k in range(len(path))])
                self.runner.kv.settle(job.slot, start + tail, [job.drafts[n] for n in path])
            dropped += self.runner.rollback(job.slot, keep)
            results[i].verdict, results[i].cached_len, results[i].rolled_back = verdict, keep, dropped
            if job.features and keeping:  # the committed tokens fed and the accepted drafts: on the device
                if path is not None:
                    at = list(range(tail)) + [tail + n for n in path]
                    results[i].features = feats[r].index_select(0, to_device(at, feats[r].device, torch.long))
                else:
                    committed = results[i].fed - len(job.drafts) + verdict.num_accepted
                    results[i].features = feats[r][:committed].clone()
                results[i].features_start = start
        return StepResult(results)

    def keep_features(self, layers) -> None:
        """Hand out these decoder layers' outputs with VERIFY rows that ask (ADR 0020)."""
        self.runner.keep_features(layers)
        self._recapture()

    def _recapture(self) -> None:
        """The start-up graphs again (keeping features drops the ones captured without them)."""
        ds = self.runner.device_step
        if ds is not None and ds.graphs_on and not ds.graphs:
            capture_startup(ds, self.settings)

    def _judge(self, judged: list) -> tuple[list[Verdict], dict[int, list[int]]]:
        """The judged rows' verdicts in one copy to the host, and each tree row's accepted
        path (by its row in the forward). A greedy row without banned tokens or a constraint
        that the device step ran takes the verdict that step already computed on the device
        (ADR 0019: inside its graph); a token tree is judged by algorithm/tree.py (2 numbers a
        node cross); the rest here, by kind of row."""
        ds, fixed = self.runner.device_step, self.runner.fixed_rows
        # (a tree the target's own head drafted is judged in its round, on the device: ADR 0025)
        trees = [k for k, (_, job, _, _, r) in enumerate(judged)
                 if job.parents is not None and self._rows[r].head is None]
        fast = [k for k, (_, job, _, _, r) in enumerate(judged) if r in fixed and judged_in_step(job, self._rows[r])]
        if ds is None:
            fast = []
        taken = set(fast) | set(trees)
        slow = [k for k in range(len(judged)) if k not in taken]
        parts: list[torch.Tensor] = []
        ks = [self._rows[judged[k][4]].head or 0 for k in fast]  # the head's drafts of each (ADR 0025)
        self._drafted = {}
        if fast and ds is not None:
            parts.append(verdict_rows(ds, [fixed[judged[k][4]] for k in fast], any(ks)))
        slow_rows = [JudgeRow(lg, j.drafts, j.q, j.sampling, j.seed, len(j.ids), j.allowed)
                     for _, j, lg, _, _ in (judged[k] for k in slow)]
        if slow_rows:
            groups, packed = judge_on_device(slow_rows)
            parts.append(packed)
        for k in trees:
            _, j, lg, _, _ = judged[k]
            parts.append(tree_judge_on_device(lg, j.drafts, Tree(tuple(j.parents)), j.sampling, j.seed, len(j.ids),
                                              j.allowed, j.q))
        out: list[Verdict | None] = [None] * len(judged)
        paths: dict[int, list[int]] = {}
        if not parts:
            return [], paths
        width = max(p.shape[1] for p in parts)
        host_all = to_host([torch.cat([F.pad(p, (0, width - p.shape[1])) for p in parts])])[0].numpy()
        at_row = 0
        if fast:
            rows_f = host_all[at_row:at_row + len(fast)].tolist()
            at_row += len(fast)
            host_v = verdicts_from_host([h[:2] for h in rows_f], [judged[k][1].drafts for k in fast], False)
            for j, (k, h, n) in enumerate(zip(fast, rows_f, ks, strict=True)):
                if n:  # the head's drafts, read with the verdict (ADR 0025)
                    r = judged[k][4]
                    host_v[j], self._drafted[r] = head_verdict(h, n, self._rows[r].head_width, ds.last.width)  # type: ignore[union-attr]
            for k, v in zip(fast, host_v, strict=True):
                out[k] = v
        if slow_rows:
            rows_s = host_all[at_row:at_row + len(slow_rows)].tolist()
            at_row += len(slow_rows)
            for k, v in zip(slow, verdicts_of(slow_rows, groups, rows_s), strict=True):
                out[k] = v
        for k in trees:
            _, j, _, _, r = judged[k]
            n = len(j.drafts) + 1
            out[k], paths[r] = tree_walk(host_all[at_row:at_row + n], j.drafts, Tree(tuple(j.parents)), j.sampling,
                                         j.seed, len(j.ids), with_q=j.q is not None)
            at_row += n
        return out, paths  # type: ignore[return-value]


@dataclass
class _Drafting:
    """A draft job in the middle of a batched step: its picks so far, on the device."""

    index: int
    job: StepRow
    k: int
    dropped: int
    masks: Any
    u: torch.Tensor | None = None  # its uniforms on the device ([k], or [1] for a guess); None at T = 0
    rows: list[torch.Tensor] = field(default_factory=list)  # its picks so far, packed (DevicePick.pack)


class BatchedDraft(_RunnerSessions):
    def __init__(self, drafter: HFDrafter, b: Batching) -> None:
        self.drafter = drafter
        super().__init__(drafter.model, drafter.max_positions, b)
        self._fixed: dict = {}
        if self.runner.device_step is not None:
            self.runner.device_step.with_heads = True

    def step(self, step: Step) -> StepResult:
        """Step 0 feeds each session's new committed tokens (1 logit), then one batched
        1-token step per further draft position. The picks stay on the device, each fed to
        the next forward from there; the step's results cross to the host in one copy at the
        end. A constrained row reads its token at each position: its grammar runs
        on the host."""
        results = [RowResult() for _ in step.rows]
        rows: list[Row] = []
        live: list[_Drafting] = []
        for i, job in enumerate(step.rows):
            if job.kind is Kind.VERIFY:
                results[i] = RowResult.of_error(ValueError("a draft's step takes draft and guess rows, not verify"))
                continue
            guess = job.kind is Kind.GUESS
            k = 1 if guess else min(job.k, self.max_positions - len(job.ids))
            if k <= 0:
                results[i] = RowResult(proposal=None if guess else DraftProposal([], None))
                continue
            try:
                dropped, feed, last = self._feed(job.slot, job.ids, k)
            except Exception as exc:
                results[i] = RowResult.of_error(exc)
                continue
            rows.append(Row(job.slot, feed, num_logits=1 if last else 0))
            results[i].fed = len(feed)
            if last:
                masks = job.grammar.start(job.ids) if job.grammar is not None else None
                live.append(_Drafting(i, job, k, dropped, masks))
            else:
                results[i] = RowResult.later(len(feed))
        self._uniforms(live)
        done: list[_Drafting] = []
        logits = self._forward(rows)
        while live:
            rows, live = self._position(live, logits, results, done)
            if live and self._chained(live, rows, results, done):
                break
            logits = self._forward(rows)
        self._finish(done, results)
        return StepResult(results)

    def _chained(self, live: list[_Drafting], rows: list[Row], results: list[RowResult],
                 done: list[_Drafting]) -> bool:
        """Every live row's remaining positions in one device run (the device step's chain,
        ADR 0019: the K-position loop in one graph), where all are greedy, unbanned and
        unconstrained; False where it cannot (the caller goes on position by position)."""
        ds = self.runner.device_step
        if ds is None or not ds.with_heads or any(
                not d.job.sampling.greedy or d.job.sampling.banned_token_ids or d.job.kind is not Kind.DRAFT
                or d.masks is not None for d in live):
            return False
        chain = [d.k - len(d.rows) for d in live]
        out = self.runner.forward_chain(rows, chain)
        if out is None:
            return False
        heads = out[1].clone()  # (the next step writes over the buffers)
        for j, (d, n) in enumerate(zip(live, chain, strict=True)):
            d.rows.extend(heads[s, j] for s in range(n))
            results[d.index].fed += n - 1
            done.append(d)
        return True

    def _forward(self, rows: list[Row]) -> dict:
        """The rows' logits by session; `self._fixed`: the sessions the device step ran, by
        their row there (its greedy picks and heads are already computed, ADR 0019)."""
        logits = dict(zip((r.session for r in rows), self.runner.forward(rows), strict=True))
        self._fixed = {rows[i].session: j for i, j in self.runner.fixed_rows.items()}
        return logits

    def _position(self, live: list[_Drafting], logits: dict, results: list[RowResult],
                  done: list[_Drafting]) -> tuple[list[Row], list[_Drafting]]:
        """One draft position for every live row, on the device: its pick from its logits
        (unconstrained greedy rows together: one kernel per op for all of them, or none where
        the device step picked them in its own run). Returns the next forward's rows (each
        pick fed from the device) and the rows still drafting."""
        rows, still = [], []
        together = [d for d in live if d.job.sampling.greedy and d.job.kind is Kind.DRAFT and d.masks is None]
        ds = self.runner.device_step
        if together and ds is not None and ds.with_heads and all(
                d.job.slot in self._fixed and not d.job.sampling.banned_token_ids for d in together):
            at_rows = [self._fixed[d.job.slot] for d in together]
            if at_rows == list(range(len(at_rows))):  # copies: the next replay writes over the buffers
                toks, packed = ds.picks[:len(at_rows)].clone(), ds.heads[:len(at_rows)].clone()
            else:
                index = to_device(at_rows, ds.device)
                toks, packed = ds.picks.index_select(0, index), ds.heads.index_select(0, index)
        elif together:
            toks, packed = greedy_picks_on_device(torch.stack([logits[d.job.slot][-1] for d in together]),
                                                  [d.job.sampling for d in together])
        at = {id(d): j for j, d in enumerate(together)}
        for d in live:
            if id(d) in at:
                j = at[id(d)]
                token, row = toks[j:j + 1], packed[j]
            else:
                lg = logits[d.job.slot][-1]
                if d.masks is not None:
                    lg = d.masks.apply(lg)
                if d.job.kind is Kind.GUESS:  # its row is the guessed token alone (`_finish` pads it)
                    d.rows.append(bonus_on_device(lg, d.job.sampling, d.u).double().view(1))
                    done.append(d)
                    continue
                n = len(d.rows)
                u = None if d.u is None else d.u[n:n + 1]
                pick = pick_on_device(lg, d.job.sampling, u, self.drafter.q_mass, self.drafter.q_max_entries)
                token, row = pick.token.view(1), pick.pack()
                if d.masks is not None:
                    d.masks.push(int(pick.token))
            d.rows.append(row)
            if len(d.rows) == d.k:
                done.append(d)
                continue
            rows.append(Row(d.job.slot, token, num_logits=1))
            results[d.index].fed += 1
            still.append(d)
        return rows, still

    def _uniforms(self, live: list[_Drafting]) -> None:
        """Every sampled row's uniforms for the step, drawn on the host (ADR 0001: the same
        on every device) and copied in at once: uniform(seed, pos, BONUS), the keys of the
        positions' noise (ADR 0027), for its k positions (1 for a guess)."""
        sampled = [d for d in live if not d.job.sampling.greedy]
        if not sampled:
            return
        draws = [uniform(d.job.seed, list(range(len(d.job.ids), len(d.job.ids) + d.k)), Purpose.BONUS)
                 for d in sampled]
        flat = to_device(np.concatenate(draws), self.runner.device)
        at = 0
        for d, u in zip(sampled, draws, strict=True):
            d.u = flat[at:at + len(u)]
            at += len(u)

    def _finish(self, done: list[_Drafting], results: list[RowResult]) -> None:
        """The one copy of the step's picks to the host (`to_host`), then the proposals, and
        the KV's record of the tokens that were fed from the device."""
        if not done:
            return
        vocab = self.runner.vocab_size
        entries = q_entries(self.drafter.q_max_entries, vocab)
        q_width = 2 * entries if entries is not None else vocab
        width = 4 + max((q_width for d in done if not d.job.sampling.greedy and d.job.kind is Kind.DRAFT), default=0)
        packed = [torch.stack([pad_to(r, width) for r in d.rows]) for d in done]
        for d, host in zip(done, to_host(packed), strict=True):
            job = d.job
            if job.kind is Kind.GUESS:
                results[d.index].guess = int(host.numpy()[0, 0])
                continue
            steps = [DevicePick.unpack(r, job.sampling, entries, vocab) for r in host.numpy()]
            self.runner.kv.settle(job.slot, len(job.ids), [s.token for s in steps[:-1]])
            results[d.index].proposal = make_proposal(steps, job.sampling, d.dropped)


class _PerSession:
    """The per-session path: the backend's own state per session, items run one by one
    (nothing to share: each call answers as soon as its own forward is done)."""

    max_batch: int | None = 1
    slots: tuple[int, int] | None = None

    def __init__(self, backend) -> None:
        self.backend = backend  # a TargetModel or a drafter: `start()` gives a session

    def open(self, session_id: str, adapter: str = "") -> Any:
        if adapter:  # (the per-session path serves the base model only; ADR 0029)
            raise AdapterNotFound(f"no adapter {adapter!r}: LoRA adapters need the batched runner (batching on)")
        return self.backend.start()

    def close(self, handle: Any) -> None:
        handle.release()

    def step(self, step: Step) -> StepResult:
        return StepResult([_guarded(self._one, row) for row in step.rows])

    def _one(self, job: StepRow) -> RowResult:
        raise NotImplementedError


class SessionTarget(_PerSession):
    def __init__(self, target: TargetModel) -> None:
        super().__init__(target)
        self.max_positions = target.max_positions

    def _one(self, job: StepRow) -> RowResult:
        if job.kind is not Kind.VERIFY:
            raise ValueError(f"the target's step takes verify rows, not {job.kind.value}")
        sess = job.slot
        before, length = sess.dropped_positions, sess.lm.length
        verdict = verify_block(sess, job.ids, job.drafts, job.q, job.sampling, job.seed, job.allowed)
        return RowResult(verdict=verdict, cached_len=sess.lm.length, rolled_back=sess.dropped_positions - before,
                         fed=max(len(job.ids) - length, 1) + len(job.drafts))


class SessionDraft(_PerSession):
    """Any drafter (the n-gram drafter always takes this path)."""

    @staticmethod
    def _one(job: StepRow) -> RowResult:
        if job.kind is Kind.GUESS:
            guess = job.slot.guess_next(job.ids, job.sampling, job.seed)
            if guess is not None and job.grammar is not None and not job.grammar.legal_prefix(job.ids, [guess]):
                guess = None  # a guess the constraint forbids is no branch to draft ahead for
            return RowResult(guess=guess, fed=1)
        if job.kind is not Kind.DRAFT:
            raise ValueError(f"a draft's step takes draft and guess rows, not {job.kind.value}")
        return RowResult(proposal=propose_constrained(job.slot, list(job.ids), job.k, job.sampling, job.seed,
                                                      job.grammar),
                         fed=job.k)


def _tree_row(slot: Any, tail: list[int], drafts: list[int], tree: Tree) -> Row:
    """The forward's row for the committed tokens still to feed and a tree of drafts: the tail
    causal, each draft seeing the tail and its ancestors, rotary positions by depth; logits at
    the tail's last token and at every draft."""
    t, m = len(tail), tree.size
    if t == 0:
        raise ValueError("a tree row needs the last committed token fed with it")
    mask = torch.zeros(t + m, t + m, dtype=torch.bool)
    mask[:t, :t] = torch.ones(t, t, dtype=torch.bool).tril()
    within = tree.mask()  # [m + 1, m + 1]: the root (the tail's last token) and the drafts
    mask[t:, :t] = True
    mask[t:, t:] = within[1:, 1:]
    return Row(slot, tail + list(drafts), num_logits=m + 1, mask=mask,
               depths=list(range(t)) + [t - 1 + d for d in tree.depths])


def _guarded(fn, row: StepRow) -> RowResult:
    try:
        return fn(row)
    except Exception as exc:
        return RowResult.of_error(exc)


def make_target_step(target: TargetModel, b: Batching) -> BatchedTarget | SessionTarget:
    if b.enabled and choose_path(target.model) == "runner":
        return BatchedTarget(target, b)
    place_hf_model(target.model, b)
    return SessionTarget(target)


def place_hf_model(model: torch.nn.Module, b: Batching) -> None:
    """The per-session path runs the HF model itself: it moves to the worker's device and
    dtype (the batched runner copies the weights it needs instead)."""
    device = resolve_device(b.device)
    model.to(device=device, dtype=resolve_dtype(b.dtype, device))


def warm_up(model: BatchedTarget | SessionTarget) -> None:
    """One verify row (3 committed tokens, 2 drafts) through the target's step, then forget
    it: the first real step does not pay for the lazy set-up."""
    slot = model.open("\0warm-up")
    try:
        row = StepRow.verify(slot, [0, 1, 2], [3, 4], None, SamplingParams(), 0)
        while (res := model.step(Step([row])).rows[0]).again:
            pass
        if res.error is not None:
            raise res.error
    finally:
        model.close(slot)


def make_draft_step(drafter, b: Batching) -> BatchedDraft | SessionDraft:
    """The n-gram drafter (no model) keeps its per-session path."""
    if b.enabled and isinstance(drafter, HFDrafter) and choose_path(drafter.model) == "runner":
        return BatchedDraft(drafter, b)
    if isinstance(drafter, HFDrafter):
        place_hf_model(drafter.model, b)
    return SessionDraft(drafter)
