"""The emitted tokens follow p, whatever q is (the lossless property), on a tiny vocabulary.

Each case draws N = 100k independent rounds (one seed each) with synthetic, context-free p
and q, so the first emitted token must be distributed as p at position 0 and, when a round
emits two or more tokens, the second as p at position 1. A chi-square goodness-of-fit test
compares the counts with N·p.

Threshold: ALPHA = 1e-3. Under a correct sampler the statistic is χ²(df)-distributed, so a
p-value below 1e-3 happens for one seed set in a thousand; the seeds are fixed, so the
outcome is deterministic. The deliberately wrong sampler below (recovered token drawn from p
instead of the residual) fails the same test with p-values around 1e-100 at this N, so the
test has the power to catch the classic bias, not just crashes.
"""

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from specserve.algorithm.rejection import SparseQ, q_to_dense, rejection_sample
from specserve.algorithm.rng import Purpose, uniform
from specserve.algorithm.sampling import SamplingParams, draw, logits_to_probs, truncate_mass

N = 100_000
VOCAB, K = 8, 3
ALPHA = 1e-3


def _synthetic_logits():
    g = torch.Generator().manual_seed(1234)
    p_logits = torch.randn(K + 1, VOCAB, generator=g) * 1.5
    # an imperfect draft: correlated with the target, with its own errors
    q_logits = p_logits[:K] + torch.randn(K, VOCAB, generator=g) * 1.2
    return p_logits, q_logits


def _draft_tokens(q: torch.Tensor | None, fixed: list[int], seeds: np.ndarray) -> torch.Tensor:
    if q is None:  # deterministic drafter (n-gram style): same tokens every round
        return torch.tensor(fixed).expand(len(seeds), K).clone()
    cols = [draw(q[i].expand(len(seeds), VOCAB), torch.from_numpy(uniform(seeds, i, Purpose.DRAFT)))
            for i in range(K)]
    return torch.stack(cols, 1)


def _correct_sampler(p, draft, q, seeds):
    verdicts = rejection_sample(
        p.expand(len(seeds), K + 1, VOCAB), draft, torch.full((len(seeds),), K),
        None if q is None else q.expand(len(seeds), K, VOCAB), seeds, np.zeros(len(seeds), dtype=np.int64),
    )
    return [v.tokens for v in verdicts]


def _wrong_sampler(p, draft, q, seeds):
    """Same acceptance rule, but the recovered token is drawn from p, not norm(max(0, p - q))."""
    n = len(seeds)
    q_full = torch.nn.functional.one_hot(draft, VOCAB).float() if q is None else q.expand(n, K, VOCAB)
    px = p[:K].expand(n, K, VOCAB).gather(-1, draft.unsqueeze(-1)).squeeze(-1).double()
    qx = q_full.gather(-1, draft.unsqueeze(-1)).squeeze(-1).double()
    u = torch.from_numpy(uniform(seeds[:, None], np.arange(K)[None, :], Purpose.ACCEPT))
    num_acc = torch.cumprod((u * qx < px).long(), 1).sum(1)
    final = draw(p[num_acc], torch.from_numpy(uniform(seeds, num_acc.numpy(), Purpose.RECOVER)))
    return [draft[b, : int(num_acc[b])].tolist() + [int(final[b])] for b in range(n)]


def _pvalues(emitted: list[list[int]], p: torch.Tensor) -> list[float]:
    out = []
    for pos in (0, 1):
        toks = np.array([e[pos] for e in emitted if len(e) > pos], dtype=np.int64)
        assert len(toks) > 1000, f"too few rounds reached position {pos}"
        counts = np.bincount(toks, minlength=VOCAB)
        expected = p[pos].double().numpy() * len(toks)
        assert counts[expected == 0].sum() == 0, "a token with p = 0 was emitted"
        keep = expected > 0
        if keep.sum() < 2:  # a single support token: the no-zero check above is the test
            out.append(1.0)
            continue
        out.append(float(chisquare(counts[keep], expected[keep] * counts[keep].sum() / expected[keep].sum()).pvalue))
    return out


CASES = [
    pytest.param(SamplingParams(temperature=1.0), "dense", id="T1.0-dense"),
    pytest.param(SamplingParams(temperature=0.7), "dense", id="T0.7-dense"),
    pytest.param(SamplingParams(temperature=1.0, top_k=4), "sparse", id="T1.0-topk4-sparse"),
    pytest.param(SamplingParams(temperature=0.7, top_p=0.8), "sparse", id="T0.7-topp0.8-sparse"),
    pytest.param(SamplingParams(temperature=0.7, top_k=5, top_p=0.9), "dense", id="T0.7-topk-topp"),
    pytest.param(SamplingParams(temperature=1.0), "onehot", id="T1.0-onehot"),
    pytest.param(SamplingParams(temperature=0.7, top_k=4), "onehot", id="T0.7-topk4-onehot"),
    # the draft's own truncation (ADR 0010): it samples from, and sends, q cut to the tokens
    # covering 0.9 of its mass (at most 3 here); p keeps its full support
    pytest.param(SamplingParams(temperature=1.0), "truncated", id="T1.0-q-truncated"),
]


def _setup(sp: SamplingParams, q_kind: str):
    p_logits, q_logits = _synthetic_logits()
    p = logits_to_probs(p_logits, sp)
    q = logits_to_probs(q_logits, sp)  # the shared transform, as the draft worker applies it
    if q_kind == "truncated":
        q = truncate_mass(q, 0.9, 3)
        assert int((q > 0).sum(-1).max()) <= 3 and bool((p > 0).all())
    if q_kind in ("sparse", "truncated"):
        support = int((q > 0).sum(-1).max())
        top = torch.topk(q, support, -1)
        q = q_to_dense(SparseQ(top.indices, top.values), torch.zeros(K, dtype=torch.long), VOCAB)
    seeds = np.arange(N, dtype=np.uint64) + 10_000
    fixed = q_logits.argmax(-1).tolist()  # the draft's own best guess, as an n-gram match would be
    qq = None if q_kind == "onehot" else q
    return p, qq, _draft_tokens(qq, fixed, seeds), seeds


@pytest.mark.slow
@pytest.mark.parametrize("sp,q_kind", CASES)
def test_emitted_tokens_follow_p(sp, q_kind):
    p, q, draft, seeds = _setup(sp, q_kind)
    emitted = _correct_sampler(p, draft, q, seeds)
    assert min(_pvalues(emitted, p)) > ALPHA
    # and speculation did something: some rounds emitted several tokens
    assert np.mean([len(e) for e in emitted]) > 1.2


@pytest.mark.slow
@pytest.mark.parametrize("sp,q_kind", CASES[:4])
def test_wrong_sampler_fails_the_same_test(sp, q_kind):
    p, q, draft, seeds = _setup(sp, q_kind)
    assert min(_pvalues(_wrong_sampler(p, draft, q, seeds), p)) < ALPHA
