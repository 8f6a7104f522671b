"""The fast batched sampler equals the slow reference exactly, and the edge cases."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specserve.algorithm.rejection import (
    DenseQ,
    SparseQ,
    greedy_verify,
    q_to_dense,
    rejection_sample,
    rejection_sample_reference,
)


def _run_fast(p, draft, q, seed, start):
    k = len(draft)
    d = torch.tensor([draft], dtype=torch.long).reshape(1, k)
    return rejection_sample(p.unsqueeze(0), d, torch.tensor([k]), None if q is None else q.unsqueeze(0),
                            np.array([seed], dtype=np.uint64), np.array([start]))[0]


@settings(max_examples=150, deadline=None)
@given(
    k=st.integers(0, 6), vocab=st.integers(2, 40), seed=st.integers(0, 2**63),
    start=st.integers(0, 5000), q_kind=st.sampled_from(["dense", "sparse", "onehot"]),
    sharpness=st.floats(0.1, 5.0),
)
def test_fast_equals_reference(k, vocab, seed, start, q_kind, sharpness):
    g = torch.Generator().manual_seed(seed % 2**31)
    p = torch.softmax(torch.randn(k + 1, vocab, generator=g) * sharpness, -1)
    q = torch.softmax(torch.randn(k, vocab, generator=g) * sharpness, -1)
    if q_kind == "sparse":  # truncated draft distribution: zero outside its top 2
        top = torch.topk(q, min(2, vocab), -1)
        q = q_to_dense(SparseQ(top.indices, top.values / top.values.sum(-1, keepdim=True)),
                       torch.zeros(k, dtype=torch.long), vocab)
    draft = [int(torch.multinomial(q[i], 1, generator=g)) for i in range(k)] if q_kind != "onehot" \
        else torch.randint(0, vocab, (k,), generator=g).tolist()
    qq = None if q_kind == "onehot" else q
    fast = _run_fast(p, draft, qq, seed, start)
    ref = rejection_sample_reference(p, draft, qq, seed, start)
    assert fast.tokens == ref.tokens
    assert fast.num_accepted == ref.num_accepted
    assert fast.rejected_position == ref.rejected_position
    assert np.allclose(fast.p_draft, ref.p_draft) and np.allclose(fast.q_draft, ref.q_draft)


def test_batched_rows_equal_single_rows():
    g = torch.Generator().manual_seed(0)
    bsz, k, vocab = 16, 4, 12
    p = torch.softmax(torch.randn(bsz, k + 1, vocab, generator=g), -1)
    q = torch.softmax(torch.randn(bsz, k, vocab, generator=g), -1)
    draft = torch.randint(0, vocab, (bsz, k), generator=g)
    num = torch.randint(0, k + 1, (bsz,), generator=g)
    seeds = np.arange(bsz, dtype=np.uint64) * 1000 + 7
    start = np.arange(bsz) * 3
    batch = rejection_sample(p, draft, num, q, seeds, start)
    for b in range(bsz):
        n = int(num[b])
        ref = rejection_sample_reference(p[b, : n + 1], draft[b, :n].tolist(), q[b, :n], int(seeds[b]), int(start[b]))
        # a shorter block reads p at position n for the bonus, exactly like the reference
        assert batch[b].tokens == ref.tokens, b


def test_sparse_q_is_exact():
    q = torch.tensor([[0.0, 0.7, 0.0, 0.3], [0.5, 0.0, 0.5, 0.0]])
    sparse = SparseQ(ids=torch.tensor([[1, 3, 0], [0, 2, 0]]), probs=torch.tensor([[0.7, 0.3, 0.0], [0.5, 0.5, 0.0]]))
    assert torch.equal(q_to_dense(sparse, torch.tensor([1, 0]), 4), q)
    assert torch.equal(q_to_dense(DenseQ(q), torch.tensor([1, 0]), 4), q)
    assert torch.equal(q_to_dense(None, torch.tensor([1, 2]), 4), torch.tensor([[0, 1.0, 0, 0], [0, 0, 1.0, 0]]))


def test_q_zero_at_draft_token_is_judged_by_p_alone():
    p = torch.tensor([[0.2, 0.8, 0.0], [0.3, 0.3, 0.4]])
    q = torch.tensor([[1.0, 0.0, 0.0]])  # the draft claims it could not have proposed token 1
    for seed in range(50):
        v = _run_fast(p, [1], q, seed, 0)
        assert v.num_accepted == 1  # p(1) > 0 and q(1) = 0: ratio is infinite
    q2 = torch.tensor([[0.0, 0.0, 1.0]])
    for seed in range(50):
        v = _run_fast(p, [2], q2, seed, 0)  # p(2) = 0: never kept, whatever q says
        assert v.num_accepted == 0 and v.tokens[0] in (0, 1)


def test_all_rejected_draws_recovered_from_residual():
    p = torch.tensor([[0.0, 1.0, 0.0], [1 / 3, 1 / 3, 1 / 3], [1 / 3, 1 / 3, 1 / 3]])
    for seed in range(20):
        v = _run_fast(p, [0, 0], None, seed, 0)  # p(0) = 0 at position 0
        assert v.num_accepted == 0 and v.rejected_position == 0 and v.tokens == [1]


def test_all_accepted_gets_bonus_from_last_position():
    p = torch.tensor([[0, 1.0, 0], [0, 0, 1.0], [1.0, 0, 0]])
    v = _run_fast(p, [1, 2], None, 3, 10)
    assert v.num_accepted == 2 and v.bonus and v.tokens == [1, 2, 0]


def test_zero_drafts_is_a_plain_step():
    p = torch.tensor([[0.0, 0.0, 1.0]])
    v = _run_fast(p, [], None, 1, 0)
    assert v.tokens == [2] and v.num_accepted == 0 and v.bonus


def test_greedy_fast_path():
    target_ids = torch.tensor([[5, 6, 7, 8], [5, 6, 7, 8], [5, 6, 7, 8]])
    draft = torch.tensor([[5, 6, 7], [5, 9, 7], [1, 6, 7]])
    out = greedy_verify(target_ids, draft, torch.tensor([3, 3, 2]))
    assert [v.tokens for v in out] == [[5, 6, 7, 8], [5, 6], [5]]
    assert [v.rejected_position for v in out] == [None, 1, 0]


@pytest.mark.parametrize("start", [0, 17])
def test_same_inputs_same_verdict(start):
    g = torch.Generator().manual_seed(1)
    p = torch.softmax(torch.randn(4, 9, generator=g), -1)
    q = torch.softmax(torch.randn(3, 9, generator=g), -1)
    a = _run_fast(p, [1, 2, 3], q, 99, start)
    b = _run_fast(p, [1, 2, 3], q, 99, start)
    assert a.tokens == b.tokens


def test_greedy_rows_judged_together_equal_each_row_alone():
    """judge_on_device's greedy group takes one argmax over every row's positions: with mixed
    K, banned tokens, a constraint and exact ties, each row's verdict is the one it gets alone,
    and the runner's back-to-back logits are read in place (no copy)."""
    from specserve.models.verifier import JudgeRow, greedy_targets, joined, judge_rows
    from specserve.params import SamplingParams

    g = torch.Generator().manual_seed(3)
    vocab, sizes = 11, [1, 4, 3, 1, 5, 2]
    out = torch.randn(sum(sizes), vocab, generator=g)
    out[1, 4] = out[1, 7] = out[1].max() + 1  # a tie: the first index wins
    logits = list(out.split(sizes))  # as the runner hands them out
    allowed = torch.ones(3, vocab, dtype=torch.bool)
    allowed[:, int(logits[2][0].argmax())] = False  # the constraint forbids row 2's first pick
    rows = []
    for b, lg in enumerate(logits):
        top = lg.argmax(-1).tolist()
        drafts = top[:-1] if b % 2 else [(t + 1) % vocab for t in top[:-1]]  # accepted, or rejected at once
        banned = [int(lg[-1].argmax())] if b == 4 else []
        rows.append(JudgeRow(lg, drafts, None, SamplingParams(banned_token_ids=banned), b, 10,
                             allowed if b == 2 else None))
    together = judge_rows(rows)
    alone = [judge_rows([r])[0] for r in rows]
    assert together == alone
    assert together[1].num_accepted == 3 and together[0].num_accepted == 0  # (the setup bites)
    assert together[4].tokens[-1] != int(logits[4][-1].argmax())  # the banned token is not the bonus
    assert int(greedy_targets(rows[1:2], 3)[0, 0]) == 4  # the tie, to the first index
    view = joined(logits)
    assert view.untyped_storage()._cdata == out.untyped_storage()._cdata and torch.equal(view, out)
    assert not torch.equal(joined([logits[1], logits[0]]), out[:5])  # out of order: a copy, in that order
    assert torch.equal(joined([logits[1], logits[0]]), torch.cat([logits[1], logits[0]]))
