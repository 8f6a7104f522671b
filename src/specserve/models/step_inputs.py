"""The host's part of the device step (ADR 0019, `device_step.py`): every number a step's run
reads (token ids, positions, the KV slot each token writes and each row reads, the rows'
cached lengths, where each row's judged positions are), laid out on the host for the step's
bucket and copied into one persistent int64 device buffer in one non-blocking copy. Tokens
already on the device (a draft's picks) are put in place there. Nothing on the device is read.

The buffer's fields sit at fixed offsets, so a graph captured for a bucket reads the same
addresses at every replay; only their values change.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from specserve.device import copy_in
from specserve.errors import InvalidRequest
from specserve.models.step_judge import row_fields

if TYPE_CHECKING:
    from specserve.models.runner import Row
    from specserve.models.step_buckets import Bucket

Ints = np.ndarray[Any, np.dtype[np.int64]]


class StepInputs:
    """The step's int buffer (`buffer`, [fields]) and what writes it. A bucket of R rows of W
    tokens: row i's tokens at i W .. i W + n - 1; padding tokens and padding rows write to and
    read the `scratch` slot, at positions clamped to the slot's `max_len`."""

    def __init__(self, max_rows: int, max_width: int, scratch: int, max_len: int, vocab: int,
                 device: torch.device) -> None:
        t, r = max_rows * max_width, max_rows
        # pos: a token's rotary position; at: the slot position its KV goes to (start + i: they
        # differ in a token tree, whose tokens sit in order but rotate by depth)
        # hdraft, hfeed: a row's drafts by the target's own head and whether it feeds the head (ADR 0025)
        # mode, seed, topk, temp, topp: a row's sampling, judged on the device (models/step_judge.py;
        # temp and topp as float64 bit patterns); lora: each token's adapter slot (ADR 0029; 0: none)
        sizes = {"ids": t, "pos": t, "at": t, "wslot": t, "dst": t, "rslot": r, "start": r, "jpos": t,
                 "ndraft": r, "kleft": r, "hdraft": r, "hfeed": r, "hwidth": r,
                 "mode": r, "seed": r, "topk": r, "temp": r, "topp": r, "lora": t}
        self.offsets: dict[str, int] = {}
        at = 0
        for name, n in sizes.items():
            self.offsets[name] = at
            at += n
        self.buffer = torch.zeros(at, dtype=torch.long, device=device)
        self.scratch, self.max_len, self.vocab = scratch, max_len, vocab

    def field(self, name: str, n: int) -> torch.Tensor:
        """The first `n` entries of one field of the buffer (a view: a fixed address)."""
        at = self.offsets[name]
        return self.buffer[at:at + n]

    def write(self, rows: Sequence[Row], slots: Sequence[int], starts: Sequence[int], b: Bucket,
              depths: Sequence[Sequence[int] | None] | None = None, chain: Sequence[int] | None = None,
              lora: Sequence[int] | None = None) -> None:
        """The step's numbers (`numbers`) into the buffer in one copy, then the rows' tokens that
        are on the device into their places. A token outside the vocabulary raises before
        anything is written. `lora`: each row's adapter slot (ADR 0029), where any has one."""
        fields, on_device = self.numbers(rows, slots, starts, b, depths, chain)
        if lora is not None:  # every lane of a row takes its adapter (padding rows: none)
            fields = {**fields, "lora": np.repeat(np.asarray(list(lora) + [0] * (b.rows - len(lora))), b.width)}
        host = np.zeros(self.buffer.shape[0], dtype=np.int64)
        for name, values in fields.items():
            arr = np.asarray(values, dtype=np.int64).reshape(-1)
            host[self.offsets[name]:self.offsets[name] + arr.shape[0]] = arr
        copy_in(self.buffer, host)
        if on_device:  # a draft's picks, fed from where they are
            picks = torch.cat([t.to(dtype=torch.long).view(-1) for t in on_device])
            self.field("ids", b.tokens).index_copy_(0, self.field("dst", len(fields["dst"])), picks)

    def numbers(self, rows: Sequence[Row], slots: Sequence[int], starts: Sequence[int], b: Bucket,
                depths: Sequence[Sequence[int] | None] | None = None,
                chain: Sequence[int] | None = None) -> tuple[Mapping[str, Ints], list[torch.Tensor]]:
        """Each field's values for this step (its first entries; the rest of the buffer is 0),
        and the rows' tokens that are on the device, in row order (their places in `ids`: the
        field `dst`). `depths`: per row its tokens' positions after the row's start (a tree's;
        None: 0, 1, 2, ...): the rotary positions (`pos`), while token i still takes slot
        position start + i (`at`). `chain`: per row, the chain positions it drafts (`kleft`)."""
        w, last = b.width, self.max_len - 1
        lane = np.arange(w)
        at = np.minimum(np.tile(lane, b.rows), last)  # padding rows: positions 0..W-1 of the scratch slot
        wslot = np.full(b.tokens, self.scratch)
        ids = np.zeros(b.tokens, dtype=np.int64)
        rslot = np.full(b.rows, self.scratch)
        start = np.zeros(b.rows, dtype=np.int64)
        jpos = np.repeat(np.arange(b.rows) * w, w)  # [R * W]
        ndraft = np.zeros(b.rows, dtype=np.int64)
        hdraft = np.zeros(b.rows, dtype=np.int64)
        hfeed = np.zeros(b.rows, dtype=np.int64)
        hwidth = np.ones(b.rows, dtype=np.int64)
        sampled = np.zeros((5, b.rows), dtype=np.int64)  # mode, seed, topk, temp and topp's bits
        sampled[3:] = np.ones(1, dtype=np.float64).view(np.int64)
        on_device: list[tuple[int, torch.Tensor]] = []
        for i, (row, slot, st) in enumerate(zip(rows, slots, starts, strict=True)):
            n, base = len(row.tokens), i * w
            at[base:base + w] = np.minimum(st + lane, last)  # padding tokens: clamped, scratch slot
            wslot[base:base + n] = slot
            rslot[i], start[i] = slot, st
            if isinstance(row.tokens, torch.Tensor):
                on_device.append((base, row.tokens))
            else:
                toks = np.asarray(row.tokens, dtype=np.int64)
                if toks.min() < 0 or toks.max() >= self.vocab:
                    raise InvalidRequest(f"a token id is outside the vocabulary (size {self.vocab})")
                ids[base:base + n] = toks
            c = n if row.num_logits is None else max(0, min(row.num_logits, n))
            first = base + n - max(c, 1)
            jpos[base:base + w] = first + np.minimum(lane, max(c, 1) - 1)
            ndraft[i] = max(c - 1, 0)
            if row.head is not None:  # the head's drafts fill the row's lanes after the first; judged rows feed it
                hwidth[i] = max(row.head_width, 1)
                hdraft[i], hfeed[i] = min(row.head, max(c - 1, 0) // hwidth[i]), int(c > 0)
            if row.sampling is not None:
                mode, seed, k, temp, top_p = row_fields(row.sampling, row.seed, self.vocab)
                sampled[:3, i] = (mode, seed, k)
                sampled[3:, i] = np.array([temp, top_p], dtype=np.float64).view(np.int64)
        pos = at.copy()
        for i, (row, st) in enumerate(zip(rows, starts, strict=True)):
            if depths is not None and depths[i] is not None:
                pos[i * w:i * w + len(row.tokens)] = st + np.asarray(depths[i], dtype=np.int64)
        dst = np.asarray([base + j for base, t in on_device for j in range(t.shape[0])], dtype=np.int64)
        fields = {"ids": ids, "pos": pos, "at": at, "wslot": wslot, "dst": dst, "rslot": rslot, "start": start,
                  "jpos": jpos, "ndraft": ndraft, "hdraft": hdraft, "hfeed": hfeed, "hwidth": hwidth,
                  **dict(zip(("mode", "seed", "topk", "temp", "topp"), sampled, strict=True))}
        if chain is not None:
            fields["kleft"] = np.asarray(list(chain), dtype=np.int64)
        return fields, [t for _, t in on_device]
