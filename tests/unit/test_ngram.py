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
