"""The suffix drafter (ADR 0026) against a brute-force reference: the longest match of the
context's end in the session's own sequence and in its class's index, the occurrences' votes
(counts) for the continuation, the probability floor, the speculation length from the match
length, the choice between the two corpora, token trees; on random and adversarial sequences.
And the index's bounds: a long stream of outputs leaves it within its requests, tokens and
bytes, the least recently used out."""

from __future__ import annotations

import random

import numpy as np
import pytest

from specserve.drafters import suffix_index as sx
from specserve.drafters.suffix import SuffixDrafter, SuffixSettings
from specserve.drafters.suffix_index import SuffixIndex
from specserve.errors import InvalidRequest
from specserve.params import SamplingParams

END = -1


# ---- the reference: every position, every length, by hand ----
def _match_len(seq: list[int], e: int, ctx: list[int], limit: int) -> int:
    m = 0
    while m < limit and e - m - 1 >= 0 and seq[e - m - 1] == ctx[len(ctx) - m - 1]:
        m += 1
    return m


def _occurrences(ctx: list[int], corpus: list[list[int]], own: bool, limit: int):
    """(m*, [(seq index, e)]) over the corpus (own: the context itself, ends before its last token)."""
    found = []
    for j, seq in enumerate(corpus):
        for e in range(1, len(seq)):  # the token after the match, seq[e], exists
            m = _match_len(seq, e, ctx, limit)
            if m:
                found.append((m, j, e))
    if not found:
        return 0, []
    best = max(m for m, _, _ in found)
    return best, [(j, e) for m, j, e in found if m == best]


def _token(corpus, own: bool, occ, d: int) -> int:
    j, e = occ
    seq = corpus[j]
    if own:
        return seq[e + d % (len(seq) - e)]
    return seq[e + d] if e + d < len(seq) else END


def _ref_chain(corpus, own, occs, n, start, length, min_prob):
    tokens, probs, live = [], [], list(occs)
    for d in range(start, length):
        votes: dict[int, list[int]] = {}
        for i, o in enumerate(live):
            t = _token(corpus, own, o, d)
            if t != END:
                votes.setdefault(t, []).append(i)
        if not votes:
            break
        best = max(votes, key=lambda t: (len(votes[t]), votes[t][-1]))
        p = len(votes[best]) / n
        if p < min_prob:
            break
        tokens.append(best)
        probs.append(p)
        live = [live[i] for i in votes[best]]
    return tokens, probs


def _ref_draft(corpus, own, ctx, k, s: SuffixSettings, width: int):
    m, occs = _occurrences(ctx, corpus, own, min(s.max_match, len(ctx)))
    length = min(k, int(s.spec_factor * m))
    if not occs or length <= 0:
        return None
    n = len(occs)
    if width <= 1:
        tokens, probs = _ref_chain(corpus, own, occs, n, 0, length, s.min_prob)
        return (tokens, probs, None) if tokens else None
    votes: dict[int, list[int]] = {}
    for i, o in enumerate(occs):
        t = _token(corpus, own, o, 0)
        if t != END:
            votes.setdefault(t, []).append(i)
    tokens, probs, parents = [], [], []
    for t in sorted(votes, key=lambda t: (len(votes[t]), votes[t][-1]), reverse=True)[:width]:
        if len(votes[t]) / n < s.min_prob:
            continue
        rest, rest_p = _ref_chain(corpus, own, [occs[i] for i in votes[t]], n, 1, length, s.min_prob)
        parents += [-1, *range(len(tokens), len(tokens) + len(rest))]
        tokens += [t, *rest]
        probs += [len(votes[t]) / n, *rest_p]
    return (tokens, probs, parents) if tokens else None


def reference(ctx: list[int], index: list[list[int]], k: int, s: SuffixSettings, width: int = 1):
    """(tokens, parents, source) the drafter must propose; None when it proposes nothing."""
    own = _ref_draft([ctx], True, ctx, k, s, width)
    other = _ref_draft(index, False, ctx, k, s, width) if index else None
    best = max(((d, src) for d, src in ((own, "session"), (other, "index")) if d is not None),
               key=lambda ds: (sum(ds[0][1]), ds[1] == "session"), default=None)
    if best is None:
        return None
    (tokens, _, parents), source = best
    return tokens, parents, source


def _drafter_says(ctx, index_seqs, k, s: SuffixSettings, width: int = 1):
    index = None
    if index_seqs:
        index = SuffixIndex(max_requests=10_000, max_tokens=10**7)
        for seq in index_seqs:
            index.add(seq)
    d = SuffixDrafter(64, s).start(index).drafts(ctx, k, width)
    return None if d is None else (d.tokens, d.parents, d.source)


# ---- the cases ----
def _random_case(rng: random.Random):
    vocab = rng.choice([2, 3, 5, 12, 300])
    ctx = [rng.randrange(vocab) for _ in range(rng.randint(1, 90))]
    index = [[rng.randrange(vocab) for _ in range(rng.randint(0, 40))] for _ in range(rng.randint(0, 12))]
    if rng.random() < 0.5 and index:  # some outputs share the context's end, as a class's do
        tail = ctx[-rng.randint(1, min(len(ctx), 20)):]
        for seq in rng.sample(index, rng.randint(1, len(index))):
            seq[rng.randint(0, len(seq)):rng.randint(0, len(seq))] = tail + [rng.randrange(vocab)]
    s = SuffixSettings(min_prob=rng.choice([0.0, 0.1, 0.34, 0.5]), spec_factor=rng.choice([0.5, 1.0, 2.0, 4.0]),
                       max_match=rng.choice([1, 2, 3, 8, 32, 64]))
    return ctx, index, rng.randint(1, 32), s


def _adversarial_cases():
    s = SuffixSettings(min_prob=0.0, spec_factor=4.0)
    yield [7] * 50, [], 32, s  # one token: every position matches, the continuation is periodic
    yield [7] * 50, [[7] * 10, [7, 8] * 5], 32, s
    yield [1, 2] * 40, [[1, 2, 3] * 5], 16, s  # a period in the session, another in the index
    yield [1, 2, 3, 4, 5], [[3, 4, 5]], 8, s  # the match at an output's very end: no continuation
    yield [1, 2, 3, 4, 5], [[3, 4, 5], [4, 5, 9], [4, 5, 9, 9], [5, 1]], 8, s  # a shorter match with one
    yield [9], [[9, 1], [9, 2], [9, 1]], 4, s  # the shortest context: a vote of 2 to 1
    yield [5, 6], [[5, 6, 1], [5, 6, 2]], 4, s  # a tie: the latest occurrence wins
    yield [5, 6], [[5, 6, 2], [5, 6, 1]], 4, s
    yield list(range(40)), [list(range(40))], 32, s  # a unique long match, capped by max_match
    yield [3, 1, 3, 1, 3], [[3, 1, 3, 1, 3, 1, 3, 2]], 32, s
    yield [0, 0, 1], [[0, 0, 1, 0, 0, 1, 5], [0, 1, 7]], 32, SuffixSettings(min_prob=0.5, spec_factor=1.0)
    yield [4, 4, 4, 4], [[4, 4, 4, 4, 4, 8]] * 3, 3, SuffixSettings(min_prob=0.9, spec_factor=0.5)


def test_the_drafter_equals_the_brute_force_reference_on_random_sequences():
    rng = random.Random(20261)
    drafted = 0
    for _ in range(1500):
        ctx, index, k, s = _random_case(rng)
        want = reference(ctx, index, k, s)
        assert _drafter_says(ctx, index, k, s) == want, (ctx, index, k, s)
        drafted += want is not None
    assert drafted > 500  # most cases proposed something: the comparison is not of empty drafts


def test_the_drafter_equals_the_reference_on_adversarial_sequences():
    for ctx, index, k, s in _adversarial_cases():
        assert _drafter_says(ctx, index, k, s) == reference(ctx, index, k, s), (ctx, index)
    # spelled out: a 2-to-1 vote, and the latest occurrence on a tie
    s = SuffixSettings(min_prob=0.0, spec_factor=4.0)
    assert _drafter_says([9], [[9, 1], [9, 2], [9, 1]], 4, s)[0][0] == 1
    assert _drafter_says([5, 6], [[5, 6, 1], [5, 6, 2]], 4, s)[0] == [2]
    assert _drafter_says([5, 6], [[5, 6, 2], [5, 6, 1]], 4, s)[0] == [1]
    # the session's own periodic sequence runs on past its end, as prompt lookup's does
    assert _drafter_says([1, 2, 3] * 4, [], 7, s) == ([1, 2, 3, 1, 2, 3, 1], None, "session")


def test_the_index_wins_where_it_expects_more_accepted_and_the_floor_prunes():
    s = SuffixSettings(min_prob=0.3, spec_factor=2.0)
    ctx = [10, 11, 12, 13]
    outputs = [[12, 13, 20, 21, 22, 23]] * 3 + [[12, 13, 30]]
    tokens, _, source = _drafter_says(ctx, outputs, 8, s)
    assert source == "index" and tokens == [20, 21, 22, 23]  # 3 of 4 occurrences: p = 0.75 each
    s_high = SuffixSettings(min_prob=0.8, spec_factor=2.0)
    assert _drafter_says(ctx, outputs, 8, s_high) is None  # 0.75 is under the floor: nothing
    # the speculation length follows the match: a 2-token match drafts at most 2 at factor 1
    assert _drafter_says(ctx, outputs, 8, SuffixSettings(min_prob=0.0))[0] == [20, 21]


@pytest.mark.parametrize("width", [2, 3])
def test_trees_equal_the_reference(width):
    rng = random.Random(77 + width)
    trees = 0
    for _ in range(600):
        ctx, index, k, s = _random_case(rng)
        want = reference(ctx, index, k, s, width)
        assert _drafter_says(ctx, index, k, s, width) == want, (ctx, index, k, s)
        trees += want is not None and want[1] is not None and sum(p < 0 for p in want[1]) > 1
    assert trees > 50


def test_a_tree_is_offered_only_with_two_branches_and_bans_prune_whole_branches():
    index = SuffixIndex()
    for out in ([5, 6, 1, 2, 3], [5, 6, 1, 2, 3], [5, 6, 8, 9]):
        index.add(out)
    session = SuffixDrafter(16, SuffixSettings(min_prob=0.2, spec_factor=4.0)).start(index)
    tree = session.propose_tree([0, 5, 6], 4, SamplingParams(), 0, 2)
    assert (tree.tokens, tree.parents) == ([1, 2, 3, 8, 9], [-1, 0, 1, -1, 3])
    banned = session.propose_tree([0, 5, 6], 4, SamplingParams(banned_token_ids=(2,)), 0, 2)
    assert (banned.tokens, banned.parents) == ([1, 8, 9], [-1, -1, 1])  # 2 and what follows it cut
    assert session.propose_tree([0, 5, 6], 4, SamplingParams(banned_token_ids=(8,)), 0, 2) is None
    assert session.propose([0, 5, 6], 4, SamplingParams(banned_token_ids=(2,)), 0).tokens == [1]


def test_a_session_follows_its_committed_sequence_and_rebuilds_on_another():
    s = SuffixSettings(min_prob=0.0, spec_factor=4.0)
    session = SuffixDrafter(16, s).start()
    seq = [1, 2, 3, 4, 1, 2]
    assert session.drafts(seq, 4).tokens == [3, 4, 1, 2]
    seq += [3, 9, 1, 2]  # extended: the latest occurrence of 1, 2 is now followed by 3, 9
    assert session.drafts(seq, 4).tokens == reference(seq, [], 4, s)[0]
    other = [5, 1, 2, 7, 1, 2]  # not an extension (its last tokens differ): rebuilt
    assert session.drafts(other, 2).tokens == [7, 1]
    changed = [5, 9, 2, 7, 1, 2]  # the same length and last token, another sequence: rebuilt
    assert session.drafts(changed, 2) is None or session.drafts(changed, 2).tokens == reference(changed, [], 2, s)[0]
    assert session.drafts([8, 9, 8, 9, 8], 4).tokens == [9, 8, 9, 8]  # shorter: rebuilt (periodic past its end)
    assert session.drafts([5], 2) is None


def test_settings_are_checked():
    for bad in ({"min_prob": 1.5}, {"spec_factor": 0.0}, {"max_match": 0}, {"max_match": 65},
                {"max_requests": -1}):
        with pytest.raises(InvalidRequest):
            SuffixSettings(**bad)


# ---- bounded memory, least recently used out ----
def test_a_long_stream_of_outputs_stays_within_the_bounds():
    rng = random.Random(5)
    index = SuffixIndex(max_requests=64, max_tokens=4000)
    peak_bytes = 0
    for _ in range(6000):  # ~ 600 k tokens through an index of 4 k
        out = [rng.randrange(4096) for _ in range(rng.randint(1, 200))]
        index.add(out)
        assert index.requests <= 64 and index.tokens <= 4000
        peak_bytes = max(peak_bytes, index.nbytes)
    # Per token of max_tokens: the buffer holds at most as many evicted tokens as live ones
    # (then it is rebuilt), 4 bytes each, at most doubled by its growth: 16 bytes; the sorted
    # keys, 12 bytes a token and level, 4 levels, live and evicted: 96 bytes. Plus the recent
    # part (its tokens and one output beyond, doubled) and a separator per output.
    bound = 112 * 4000 + 8 * (sx.RECENT_TOKENS + 200) + 4 * 2 * 4000
    assert peak_bytes <= bound, (peak_bytes, bound)
    assert index.merges > 100 and index.rebuilds > 10  # both ways of compacting ran, many times


def test_the_least_recently_used_output_goes_first_and_a_drafted_one_is_used():
    clock = [0.0]
    index = SuffixIndex(max_requests=3, max_tokens=10_000, clock=lambda: clock[0])
    for out in ([1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]):
        index.add(out)
        clock[0] += 1.0
    session = SuffixDrafter(16, SuffixSettings(min_prob=0.0)).start(index)
    assert session.drafts([0, 1, 2], 2).tokens == [3, 4]  # drafted from the oldest: now the most recent
    index.add([13, 14, 15])  # the least recently used, [5..8], goes
    assert session.drafts([0, 5, 6], 2) is None or session.drafts([0, 5, 6], 2).source == "session"
    assert session.drafts([0, 1, 2], 2).tokens == [3, 4] and session.drafts([0, 9, 10], 2).tokens == [11, 12]
    assert index.age_s() == 3.0  # the oldest kept was added at t = 0 (the clock is now 3)
    index.resize(1, 10_000)
    assert index.requests == 1 and session.drafts([0, 1, 2], 2) is None


def test_an_evicted_output_matches_nothing_before_and_after_a_rebuild():
    index = SuffixIndex(max_requests=1000, max_tokens=300)
    first = list(range(100, 150))
    index.add(first)
    for i in range(400):  # forces rebuilds and the eviction of `first`
        index.add([1000 + i % 7] * 20)
    assert index.rebuilds and not any(np.array_equal(index.main.buf[i:i + 3], [100, 101, 102])
                                      for i in range(index.main.n))
    session = SuffixDrafter(4096, SuffixSettings(min_prob=0.0)).start(index)
    assert session.drafts([0, 100, 101], 4) is None
