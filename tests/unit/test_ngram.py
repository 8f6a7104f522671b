from specserve.algorithm.sampling import SamplingParams
from specserve.drafters.ngram import NgramDrafter, lookup


def test_continues_the_most_recent_match_of_the_longest_ngram():
    seq = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3]
    assert lookup(seq, 3, 1, 4) == [7, 8, 5]  # "2 3" last seen before 7 8 5
    assert lookup([4, 1, 2, 5, 6, 1, 2], 2, 2, 2) == [5, 6]


def test_no_match_proposes_nothing_and_k_caps_length():
    assert lookup([1, 2, 3, 4], 3, 1, 3) == []
    assert lookup([7], 3, 1, 3) == []
    assert lookup([1, 2, 3, 1, 2], 0, 1, 3) == []


def test_periodic_text_gets_a_full_block():
    # "1 2" last matched just before the end: the continuation repeats with period 2
    assert lookup([5, 1, 2, 1, 2], 5, 1, 2) == [1, 2, 1, 2, 1]
    assert lookup([9, 9, 9], 4, 1, 4) == [9, 9, 9, 9]


def test_banned_tokens_cut_the_block():
    session = NgramDrafter(10).start()
    out = session.propose([1, 2, 3, 4, 1, 2], 3, SamplingParams(banned_token_ids=(4,)), 0)
    assert out.tokens == [3] and out.q is None


def _by_windows(seq: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The definition, one n at a time from max_n down: the latest earlier window equal to
    the last n tokens (the lookup's implementation before it narrowed candidates)."""
    if k <= 0 or len(seq) < 2:
        return []
    for n in range(min(max_n, len(seq) - 1), min_n - 1, -1):
        starts = [s for s in range(len(seq) - n) if seq[s:s + n] == seq[len(seq) - n:]]
        if starts:
            out: list[int] = []
            for j in range(k):
                i = starts[-1] + n + j
                out.append(seq[i] if i < len(seq) else out[i - len(seq)])
            return out
    return []


def test_lookup_equals_the_window_definition_on_random_sequences():
    import random

    rng = random.Random(7)  # small vocabularies: long and overlapping matches are common
    for _ in range(3000):
        seq = [rng.randrange(rng.choice([2, 3, 5, 50])) for _ in range(rng.randrange(1, 40))]
        k, min_n = rng.randrange(0, 6), rng.randrange(1, 4)
        max_n = rng.randrange(min_n, 6)
        assert lookup(seq, k, min_n, max_n) == _by_windows(seq, k, min_n, max_n), (seq, k, min_n, max_n)
