"""The shapes the device step (ADR 0019, `device_step.py`) runs at: a step of short rows is
laid out as a bucket of (rows R, width W, span S), each the smallest size on its ladder that
holds the step, so a few fixed shapes serve every step (one CUDA graph each)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

ROW_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
# every width up to 8 exactly (a verify row of K drafts is K + 1 tokens: vLLM pads nothing
# there either), then coarser
WIDTH_BUCKETS = (1, 2, 3, 4, 5, 6, 7, 8, 12, 16)
MIN_SPAN = 128  # key spans: 128, 256, 512, ... up to the slot length


@dataclass(frozen=True, order=True)
class Bucket:
    rows: int  # R
    width: int  # W: tokens per row
    span: int  # S: key positions each row attends over
    lora: bool = False  # some row runs with a LoRA adapter (ADR 0029): the step adds their products

    @property
    def tokens(self) -> int:
        return self.rows * self.width


def round_up(value: int, buckets: Sequence[int]) -> int | None:
    """The smallest of `buckets` (ascending) that is at least `value`, or None past the last."""
    return next((b for b in buckets if b >= value), None)


def bucket_ladders(max_rows: int, max_width: int, max_len: int,
                   least: int = 1) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """The row, width and span ladders of a step of at most `max_rows` rows of `max_width`
    tokens over slots of `max_len` positions: the standard sizes below each limit, then the
    limit itself. `least`: the smallest row count and width (2 for a compiled step, where a
    size of 1 would be specialised into a program of its own)."""
    rows = tuple(b for b in ROW_BUCKETS if least <= b < max_rows) + (max(max_rows, least),)
    widths = tuple(b for b in WIDTH_BUCKETS if least <= b < max_width) + (max(max_width, least),)
    spans, s = [], MIN_SPAN
    while s < max_len:
        spans.append(s)
        s *= 2
    return rows, widths, tuple(spans) + (max_len,)
