import pytest
import torch

from specserve.algorithm.sampling import (
    SamplingParams,
    draw,
    greedy_tokens,
    logits_to_probs,
    truncate_mass,
)
from specserve.errors import InvalidRequest

LOGITS = torch.tensor([[2.0, 1.0, 0.5, 0.5, -1.0, 3.0]])


def test_greedy_is_one_hot_on_argmax():
    p = logits_to_probs(LOGITS, SamplingParams(temperature=0.0))
    assert p.tolist() == [[0, 0, 0, 0, 0, 1]]
    assert int(greedy_tokens(LOGITS, SamplingParams())[0]) == 5


def test_banned_tokens_never_get_mass():
    sp = SamplingParams(temperature=1.0, banned_token_ids=(5, 0))
    p = logits_to_probs(LOGITS, sp)
    assert p[0, 5] == 0 and p[0, 0] == 0
    assert torch.isclose(p.sum(), torch.tensor(1.0))
    assert int(greedy_tokens(LOGITS, SamplingParams(banned_token_ids=(5,)))[0]) == 0


def test_temperature_scales_logits():
    p = logits_to_probs(LOGITS, SamplingParams(temperature=0.5))
    assert torch.allclose(p, torch.softmax(LOGITS / 0.5, -1))


def test_top_k_keeps_k_and_ties():
    p = logits_to_probs(LOGITS, SamplingParams(temperature=1.0, top_k=2))
    assert (p[0] > 0).nonzero().flatten().tolist() == [0, 5]
    # 0.5 appears twice, at ranks 4 and 5: top_k=4 keeps both tied tokens
    p4 = logits_to_probs(LOGITS, SamplingParams(temperature=1.0, top_k=4))
    assert (p4[0] > 0).sum() == 5


def test_top_p_keeps_smallest_set_reaching_p():
    base = torch.softmax(LOGITS, -1)[0]
    p = logits_to_probs(LOGITS, SamplingParams(temperature=1.0, top_p=0.7))
    kept = (p[0] > 0).nonzero().flatten().tolist()
    order = torch.argsort(base, descending=True).tolist()
    mass = 0.0
    expect = []
    for t in order:
        expect.append(t)
        mass += float(base[t])
        if mass >= 0.7:
            break
    assert sorted(kept) == sorted(expect)


@pytest.mark.parametrize(
    "kwargs",
    [dict(temperature=-0.1), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-1), dict(banned_token_ids=(-3,))],
)
def test_bad_params_raise_invalid_request(kwargs):
    with pytest.raises(InvalidRequest):
        SamplingParams(**kwargs)


def test_banned_outside_vocab_is_refused():
    with pytest.raises(InvalidRequest, match="outside the vocabulary"):
        SamplingParams(banned_token_ids=(99,)).check_vocab(10)


def test_draw_never_picks_zero_probability_tokens():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]]).expand(1000, 5)
    u = torch.linspace(0, 1 - 1e-12, 1000, dtype=torch.float64)
    ids = draw(probs, u)
    assert set(ids.tolist()) == {1, 3}
    # the inverse CDF splits [0, 1) in proportion to the mass
    assert abs((ids == 1).float().mean().item() - 0.5) < 0.01


def test_truncate_mass_keeps_the_smallest_covering_set_capped_and_renormalised():
    probs = torch.tensor([[0.1, 0.6, 0.3], [0.25, 0.25, 0.5]])
    # 0.6 alone does not cover 0.8: 0.6 and 0.3 stay
    assert torch.allclose(truncate_mass(probs[:1], 0.8, 0), torch.tensor([[0.0, 2 / 3, 1 / 3]]))
    # a tie at the cut goes to the lower token id (a pure function of probs)
    assert torch.allclose(truncate_mass(probs[1:], 0.6, 0), torch.tensor([[1 / 3, 0.0, 2 / 3]]))
    assert torch.allclose(truncate_mass(probs, 1.0, 1), torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]]))
    assert truncate_mass(probs, 1.0, 0) is probs  # disabled
