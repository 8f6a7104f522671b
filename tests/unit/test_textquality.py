from specserve.tooling.textquality import (
    degeneracy,
    degenerate_fraction,
    is_degenerate,
    max_ngram_count,
    top_token_share,
)


def test_one_token_over_thirty_percent_is_degenerate():
    tokens = [5, 5, 5, 5, 7, 5, 5, 9]  # 6 of 8 are 5
    d = degeneracy(tokens)
    assert d.top_share == 0.75 and d.degenerate


def test_exactly_thirty_percent_is_not():
    tokens = [1, 1, 1, 2, 3, 4, 5, 6, 7, 8]  # 3 of 10: not *more* than 30 %
    assert top_token_share(tokens) == 0.3
    assert not is_degenerate(tokens)


def test_a_four_gram_repeated_four_times_is_degenerate():
    loop = [10, 11, 12, 13]
    tokens = loop * 4 + list(range(20, 40))  # shares stay low: 4 of 36 each
    assert top_token_share(tokens) < 0.3
    assert max_ngram_count(tokens) == 4  # (10, 11, 12, 13) at 0, 4, 8, 12
    assert is_degenerate(tokens)


def test_three_occurrences_are_allowed():
    tokens = [10, 11, 12, 13] * 3 + list(range(20, 40))
    assert max_ngram_count(tokens) == 3
    assert not is_degenerate(tokens)


def test_varied_text_and_edge_cases():
    assert not is_degenerate(list(range(48)))
    assert not is_degenerate([])  # nothing generated: not a loop
    assert max_ngram_count([1, 2, 3]) == 0  # shorter than one 4-gram
    assert degenerate_fraction([[1] * 10, list(range(10)), list(range(10, 20)), [2, 3] * 5]) == 0.5
    assert degenerate_fraction([]) == 0.0
