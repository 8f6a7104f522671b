"""The target's model step over a tensor-parallel group (ADR 0030): rank 0 drives, every rank
runs the same step on its shard.

Rank 0's engine calls `LeaderTarget` as it calls any model step (step.py's `ModelStep`). Each
`step` is first sent to the other ranks as one message (`Channel`: pickled, broadcast on the
group's gloo control group): the step's rows with each session's committed ids as the change
since the last message, and the sessions opened and closed since. Then rank 0 runs the step
on its own `BatchedTarget`. Every other rank (`follow`) runs the same `BatchedTarget.step` on
the same rows: the same KV bookkeeping, the same verdicts (their logits are the same after the
all-reduces and the gather: models/sharding.py). So the ranks stay in step without a second
message, and what rank 0 hands the engine is what every rank computed.

Each rank keeps a digest of its verdicts (`VerdictDigest`); rank 0 compares them with its own
at least every `check_s` seconds (`LeaderTarget.check`: an all-gather on the control group) and
fails the step where they differ (`RanksDisagree`): the group is restarted, never left to
diverge.
"""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist

from specserve.errors import AdapterNotFound
from specserve.models.runner import ModelRunner
from specserve.models.sharding import GroupCollectives, ShardedTarget, ShardLoader, control_group, start_group
from specserve.step import Step, StepResult, StepRow
from specserve.worker.model_step import BatchedTarget, Batching

log = logging.getLogger(__name__)


class RanksDisagree(RuntimeError):
    """The ranks' verdicts differ: the group's state is no longer one (restart it)."""


@dataclass(frozen=True)
class Ids:
    """A row's committed ids on the wire: the first `keep` of those last sent for its session,
    then `tail`."""

    keep: int
    tail: list[int]


class Channel:
    """Rank 0 -> every other rank, in order: `send` pickles a message and broadcasts its length
    and its bytes on the control group; `receive` is the other side. Counts the messages by
    kind (`counts`) and their bytes."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.counts: Counter[str] = Counter()
        self.bytes = 0

    def send(self, kind: str, body: Any = None, ops: Sequence[tuple[Any, ...]] = ()) -> None:
        payload = pickle.dumps((kind, list(ops), body), protocol=pickle.HIGHEST_PROTOCOL)
        g = control_group()
        dist.broadcast(torch.tensor([len(payload)], dtype=torch.int64), 0, group=g)
        dist.broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8), 0, group=g)
        self.counts[kind] += 1
        self.bytes += len(payload)

    def receive(self) -> tuple[str, list[tuple[Any, ...]], Any]:
        g = control_group()
        n = torch.zeros(1, dtype=torch.int64)
        dist.broadcast(n, 0, group=g)
        buf = torch.empty(int(n.item()), dtype=torch.uint8)
        dist.broadcast(buf, 0, group=g)
        kind, ops, body = pickle.loads(buf.numpy().tobytes())
        self.counts[kind] += 1
        self.bytes += int(n.item())
        return kind, ops, body


class VerdictDigest:
    """A running hash of every row result a rank computed, in order (status, tokens, accepted,
    cached length, positions dropped, tokens fed): equal on every rank of a healthy group."""

    def __init__(self) -> None:
        self._h = hashlib.blake2b(digest_size=16)
        self.rows = 0

    def add(self, out: StepResult) -> None:
        for r in out.rows:
            v = r.verdict
            self._h.update(repr((r.status, None if v is None else (v.num_accepted, list(v.tokens)), r.cached_len,
                                 r.rolled_back, r.fed, type(r.error).__name__ if r.error else None)).encode())
            self.rows += 1

    def hexdigest(self) -> str:
        return self._h.hexdigest()


@dataclass
class RankState:
    """What a rank reports at a check."""

    rank: int
    pid: int
    digest: str
    rows: int
    messages: dict[str, int] = field(default_factory=dict)
    collective_s: dict[str, float] = field(default_factory=dict)
    memory_bytes: int = 0  # its device's memory in use (CUDA: allocated by torch; the CPU: the process's RSS)


def _memory(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.memory_allocated(device))
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0


def _state(tp: GroupCollectives, channel: Channel, digest: VerdictDigest, device: torch.device) -> RankState:
    return RankState(tp.rank, os.getpid(), digest.hexdigest(), digest.rows, dict(channel.counts), dict(tp.seconds),
                     _memory(device))


class LeaderTarget:
    """Rank 0's model step: each call sent to the group, then run on its own shard. Reads
    (`slots`, `runner`, `max_batch`) are its own step's."""

    verifies_trees = True

    def __init__(self, local: BatchedTarget, tp: GroupCollectives, check_s: float = 1.0) -> None:
        self.local = local
        self.tp = tp
        self.channel = Channel(0)
        self.digest = VerdictDigest()
        self.check_s = check_s
        self.steps = 0
        self.last_check: list[RankState] = []
        self._checked_at = time.monotonic()
        self._ops: list[tuple[Any, ...]] = []  # sessions opened and closed since the last message
        self._ids: dict[Any, list[int]] = {}  # each session's committed ids as last sent
        self.keep: list[Any] = []  # what lives as long as the group (under Ray: its ranks' actor handles)

    @property
    def max_batch(self) -> int | None:
        return self.local.max_batch

    @property
    def slots(self) -> tuple[int, int]:
        return self.local.slots

    @property
    def runner(self) -> ModelRunner:
        return self.local.runner

    def open(self, session_id: str, adapter: str = "") -> Any:
        if adapter:  # (ADR 0029: not under tensor parallelism)
            raise AdapterNotFound(f"no adapter {adapter!r}: a tensor-parallel target serves no LoRA adapters")
        handle = self.local.open(session_id)
        self._ops.append(("open", handle))
        return handle

    def close(self, handle: Any) -> None:
        self.local.close(handle)
        self._ids.pop(handle, None)
        self._ops.append(("close", handle))

    def keep_features(self, layers: Sequence[int]) -> None:
        self._send("features", tuple(layers))
        self.local.keep_features(layers)

    def enable_head(self, head: Any) -> None:
        """The target's own EAGLE head inside every rank's device step (ADR 0025): each rank
        holds the whole head (one layer, replicated) and gathers its first draft's logits from
        the ranks' LM-head slices."""
        self._send("head", head)
        self.local.enable_head(head)

    def step(self, step: Step) -> StepResult:
        self._send("step", [self._wire(row) for row in step.rows])
        out = self.local.step(step)
        self.steps += 1
        self.digest.add(out)
        if self.check_s >= 0 and time.monotonic() - self._checked_at >= self.check_s:
            self.check()
        return out

    def check(self) -> list[RankState]:
        """Every rank's state (an all-gather after the messages so far); raises RanksDisagree
        where a rank's verdicts or its count of step messages differ from rank 0's."""
        self._send("check")
        states: list[Any] = [None] * self.tp.size
        dist.all_gather_object(states, _state(self.tp, self.channel, self.digest, self.runner.device),
                               group=control_group())
        self._checked_at = time.monotonic()
        self.last_check = states
        mine = states[0]
        for s in states[1:]:
            if s.digest != mine.digest or s.messages.get("step", 0) != mine.messages.get("step", 0):
                raise RanksDisagree(f"rank {s.rank} disagrees with rank 0 after {self.steps} steps: "
                                    f"{s.rows} rows, digest {s.digest}; rank 0: {mine.rows} rows, {mine.digest}")
        return states

    def stop(self) -> None:
        """Release the other ranks from `follow` (a clean shutdown)."""
        self._send("stop")

    def _send(self, kind: str, body: Any = None) -> None:
        ops, self._ops = self._ops, []
        self.channel.send(kind, body, ops)

    def _wire(self, row: StepRow) -> StepRow:
        """The row as sent: its committed ids as the change since the last message."""
        ids = list(row.ids)
        sent = self._ids.get(row.slot, [])
        n = min(len(sent), len(ids))
        keep = n if ids[:n] == sent[:n] else next(i for i in range(n) if ids[i] != sent[i])
        self._ids[row.slot] = ids
        return replace(row, ids=Ids(keep, ids[keep:]))  # type: ignore[arg-type]


def follow(local: BatchedTarget, tp: GroupCollectives) -> RankState:
    """A rank > 0's loop: rank 0's messages, in order, run on `local` until "stop"."""
    channel = Channel(tp.rank)
    digest = VerdictDigest()
    handles: dict[Any, Any] = {}  # rank 0's session handle -> this rank's
    ids: dict[Any, list[int]] = {}
    while True:
        kind, ops, body = channel.receive()
        for op, handle in ops:
            if op == "open":
                handles[handle] = local.open(handle[0] if isinstance(handle, tuple) else str(handle))
            else:
                local.close(handles.pop(handle))
                ids.pop(handle, None)
        if kind == "step":
            rows = []
            for row in body:
                have = ids.get(row.slot, [])
                ids[row.slot] = full = have[:row.ids.keep] + row.ids.tail
                rows.append(replace(row, slot=handles[row.slot], ids=full))
            digest.add(local.step(Step(rows)))
        elif kind == "features":
            local.keep_features(body)
        elif kind == "head":
            local.enable_head(body)
        elif kind == "check":
            dist.all_gather_object([None] * tp.size, _state(tp, channel, digest, local.runner.device),
                                   group=control_group())
        elif kind == "stop":
            return _state(tp, channel, digest, local.runner.device)
        else:
            raise ValueError(f"unknown step message {kind!r}")


@dataclass(frozen=True)
class RankSpec:
    """What every rank of a group builds its model step from."""

    model: str  # the model directory (safetensors, config.json)
    batching: Batching
    size: int
    init_method: str  # torch.distributed's rendezvous: tcp://host:port on rank 0's node
    check_s: float = 1.0


def backend_for(b: Batching) -> str:
    from specserve.device import resolve_device

    return "nccl" if resolve_device(b.device).type == "cuda" else "gloo"


def rank_target(spec: RankSpec, rank: int) -> tuple[BatchedTarget, GroupCollectives]:
    """Join the group as `rank` and build this rank's model step on its shard. The start-up
    capture of CUDA graphs runs whole on every rank (no time budget: each rank must capture
    the same buckets, since a capture runs its collectives once more than a replay)."""
    from specserve.device import resolve_device

    device = resolve_device(spec.batching.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    tp = start_group(rank, spec.size, spec.init_method, backend_for(spec.batching))
    b = replace(spec.batching, capture_budget_s=float("inf"))
    return BatchedTarget(ShardedTarget(spec.model), b, ShardLoader(spec.model, tp)), tp  # type: ignore[arg-type]


def leader(spec: RankSpec) -> LeaderTarget:
    """Rank 0's model step (the other ranks join with `run_follower`)."""
    local, tp = rank_target(spec, 0)
    return LeaderTarget(local, tp, spec.check_s)


def run_follower(spec: RankSpec, rank: int, threads: int = 1) -> RankState:
    """A rank > 0's whole life in this process: join, load, follow until rank 0 stops."""
    from specserve.models.sharding import stop_group

    torch.set_num_threads(threads)
    local, tp = rank_target(spec, rank)
    try:
        return follow(local, tp)
    finally:
        stop_group()
