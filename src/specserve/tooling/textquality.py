"""Is a continuation degenerate? One measure, shared by the build, the demo and the benchmarks.

An undertrained model falls into loops ("The\\nThe\\nThe", "table_table_table"). Such text is
unreadable, and it also flatters speculative decoding: a draft that learnt the loop is accepted
almost every time. So every acceptance figure is reported twice, on all held-out prompts and on
those whose greedy continuation is not degenerate, and the demo shows only the latter.

A token sequence is degenerate when its most frequent token is more than `max_top_share` of it,
or when some n-gram (n = 4) occurs more than `max_ngram_repeats` times. Both work on token ids,
so they need no tokenizer and cost nothing next to generation.

Example (ids): [5, 5, 5, 5, 7, 5, 5, 9] -> top share 6/8 = 0.75 > 0.3: degenerate.
               [1, 2, 3, 4] * 4 -> the 4-gram (1, 2, 3, 4) occurs 4 times > 3: degenerate.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

MAX_TOP_SHARE = 0.30
NGRAM = 4
MAX_NGRAM_REPEATS = 3


@dataclass(frozen=True)
class Degeneracy:
    top_share: float  # occurrences of the most frequent token / length
    max_ngram_count: int  # occurrences of the most frequent n-gram
    degenerate: bool

    def as_dict(self) -> dict:
        return {"top_share": round(self.top_share, 4), "max_ngram_count": self.max_ngram_count,
                "degenerate": self.degenerate}


def top_token_share(tokens: Sequence[int]) -> float:
    if not tokens:
        return 0.0
    return Counter(tokens).most_common(1)[0][1] / len(tokens)


def max_ngram_count(tokens: Sequence[int], n: int = NGRAM) -> int:
    """How often the most frequent n-gram occurs (overlapping occurrences count)."""
    grams = Counter(tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1))
    return grams.most_common(1)[0][1] if grams else 0


def degeneracy(tokens: Sequence[int], max_top_share: float = MAX_TOP_SHARE, n: int = NGRAM,
               max_ngram_repeats: int = MAX_NGRAM_REPEATS) -> Degeneracy:
    tokens = list(tokens)
    share, count = top_token_share(tokens), max_ngram_count(tokens, n)
    return Degeneracy(share, count, share > max_top_share or count > max_ngram_repeats)


def is_degenerate(tokens: Sequence[int]) -> bool:
    return degeneracy(tokens).degenerate


def degenerate_fraction(outputs: Iterable[Sequence[int]]) -> float:
    flags = [is_degenerate(t) for t in outputs]
    return sum(flags) / len(flags) if flags else 0.0
