"""The coupled sampler (ADR 0027): a seeded row's token at each position is the Gumbel-max draw
of p with the position's noise, a function of (seed, position) and p alone; a draft token is
kept exactly when it equals it.

1. The noise: the device's hash is the host reference's bit for bit, and a drafter handed the
   position's uniform derives the same key.
2. The verdict: the fast batched path equals the slow reference exactly; the emitted tokens
   are plain decoding's whatever the drafts; the drafts only decide how many positions a pass
   settles.
3. Exactness (χ², as tests/unit/test_rejection_distribution.py): N = 100k independent rounds
   (one fixed seed each) on a tiny vocabulary with synthetic, context-free p and q, the drafts
   drawn by the coupled drafter (dense, truncated-sparse, or a fixed one-hot guess). The first
   emitted token must follow p at position 0 and, when a round emits two or more, the second
   p at position 1. ALPHA = 1e-3: under a correct sampler a p-value below it comes for one
   seed set in a thousand, and the seeds are fixed, so the outcome is deterministic (they give
   0.22 to 0.83 here). The controls are the natural mistakes, each failing the same test with
   p-values below 1e-298 at this N (printed): the token at the first mismatch drawn afresh
   from p (as if it were a bonus), and the draft judged against the drafter's own draw. Also
   rejection sampling's bonus token, now drawn with the position's noise: at K = 1 the second
   emitted token is the bonus, and must follow p at position 1.
"""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare

from specserve.algorithm import rng as host_rng
from specserve.algorithm.rejection import (
    SparseQ,
    StepUniforms,
    coupled_judge,
    coupled_sample,
    coupled_sample_reference,
    q_to_dense,
    rejection_sample,
)
from specserve.algorithm.rng import Purpose, exponentials_reference, noise_keys, uniform
from specserve.algorithm.sampling import (
    SamplingParams,
    coupled_among,
    coupled_tokens,
    draw,
    exponentials,
    keys_of,
    logits_to_probs,
    truncate_mass,
)

N = 100_000
VOCAB, K = 8, 3
ALPHA = 1e-3


# --- the noise ---------------------------------------------------------------------------


def test_the_devices_noise_is_the_host_references():
    """The torch mixer (int64, wrapping, masked shifts) gives the numpy uint64 mixer's bits on
    edge and random keys; the exponentials agree to the last ulp or so (the two logs)."""
    gen = np.random.default_rng(3)
    keys = np.concatenate([[0, 1, 2**53 - 1, 2**52], gen.integers(0, 2**53, 500)]).astype(np.int64)
    ids = np.arange(VOCAB * 37)
    with np.errstate(over="ignore"):
        host = host_rng._mix(host_rng._mix(keys.astype(np.uint64) + host_rng._GOLDEN)[:, None]
                             + ids.astype(np.uint64) * host_rng._GOLDEN)
    dev = host_rng.mix_int64(host_rng.mix_int64(torch.from_numpy(keys) + host_rng.S_GOLDEN).unsqueeze(-1)
                             + torch.from_numpy(ids) * host_rng.S_GOLDEN)
    assert np.array_equal(host.view(np.int64), dev.numpy())
    assert np.allclose(exponentials(torch.from_numpy(keys), None, len(ids)).numpy(),
                       exponentials_reference(keys, ids), rtol=1e-14, atol=0)
    # a drafter handed the position's uniform (worker/model_step.py) derives the host's key
    seeds, pos = np.arange(50, dtype=np.uint64) * 977, np.arange(50) * 13
    assert np.array_equal(keys_of(torch.from_numpy(uniform(seeds, pos, Purpose.BONUS))).numpy(),
                          noise_keys(seeds, pos))


def test_the_noise_is_standard_exponential_and_positions_are_independent():
    e = exponentials(torch.from_numpy(noise_keys(5, np.arange(400))), None, 500).numpy()  # 200k numbers
    # mean and variance of Exp(1) are 1; their standard errors here are 0.0022 and 0.0067
    assert abs(e.mean() - 1.0) < 0.015 and abs(e.var() - 1.0) < 0.05
    # the noise of neighbouring positions, and of neighbouring tokens, is uncorrelated
    # (|r| of independent samples ~ N(0, 1/sqrt(n)): 0.0022 here; 0.02 is > 9 sigma)
    assert abs(np.corrcoef(e[:-1].ravel(), e[1:].ravel())[0, 1]) < 0.02
    assert abs(np.corrcoef(e[:, :-1].ravel(), e[:, 1:].ravel())[0, 1]) < 0.02


def test_a_truncated_q_draws_the_same_token_from_its_support_alone():
    g = torch.Generator().manual_seed(0)
    for i in range(200):
        q = truncate_mass(torch.softmax(torch.randn(64, generator=g) * 2, -1), 0.9, 16)
        keys = torch.from_numpy(noise_keys(i, [i * 7]))
        vals, ids = torch.topk(q, 16)
        assert int(coupled_tokens(q[None], keys)[0]) == int(coupled_among(vals[None], ids[None], keys)[0])


# --- the verdict ---------------------------------------------------------------------------


def _run_fast(p, draft, q, seed, start):
    k = len(draft)
    d = torch.tensor([draft], dtype=torch.long).reshape(1, k)
    return coupled_sample(p.unsqueeze(0), d, torch.tensor([k]), None if q is None else q.unsqueeze(0),
                          np.array([seed], dtype=np.uint64), np.array([start]))[0]


@settings(max_examples=120, deadline=None)
@given(k=st.integers(0, 6), vocab=st.integers(2, 40), seed=st.integers(0, 2**63), start=st.integers(0, 5000),
       sharpness=st.floats(0.1, 5.0), own=st.integers(0, 6))
def test_fast_equals_reference(k, vocab, seed, start, sharpness, own):
    """`own`: how many leading drafts are the target's own draws (the rest drawn at random),
    so every place a block can end is reached."""
    g = torch.Generator().manual_seed(seed % 2**31)
    p = torch.softmax(torch.randn(k + 1, vocab, generator=g) * sharpness, -1)
    mine = coupled_tokens(p, torch.from_numpy(noise_keys(seed, start + np.arange(k + 1)))).tolist()
    draft = mine[:min(own, k)] + torch.randint(0, vocab, (k - min(own, k),), generator=g).tolist()
    fast = _run_fast(p, draft, None, seed, start)
    ref = coupled_sample_reference(p, draft, None, seed, start)
    assert (fast.tokens, fast.num_accepted, fast.rejected_position) == \
        (ref.tokens, ref.num_accepted, ref.rejected_position)
    assert np.allclose(fast.p_draft, ref.p_draft)


def test_the_tokens_are_plain_decodings_whatever_the_drafts():
    """Per position the target's own draw y_i; any drafts: the emitted tokens are y's first
    num_accepted + 1, num_accepted the drafts' longest prefix equal to y."""
    g = torch.Generator().manual_seed(1)
    bsz, k, vocab = 64, 5, 10
    p = torch.softmax(torch.randn(k + 1, vocab, generator=g) * 2, -1).expand(bsz, k + 1, vocab)
    seeds, start = np.arange(bsz, dtype=np.uint64) + 400, np.full(bsz, 30)
    own = coupled_tokens(p, torch.from_numpy(noise_keys(seeds[:, None], start[:, None] + np.arange(k + 1))))
    hits = torch.rand(bsz, k, generator=g) < 0.7
    draft = torch.where(hits, own[:, :k], torch.randint(0, vocab, (bsz, k), generator=g))
    num = torch.randint(0, k + 1, (bsz,), generator=g)
    for b, v in enumerate(coupled_sample(p, draft, num, None, seeds, start)):
        n = int(num[b])
        agree = 0
        while agree < n and int(draft[b, agree]) == int(own[b, agree]):
            agree += 1
        assert v.num_accepted == agree
        assert v.tokens == own[b, :agree + 1].tolist()
        assert v.rejected_position == (agree if agree < n else None)


def test_batched_rows_equal_single_rows():
    g = torch.Generator().manual_seed(0)
    bsz, k, vocab = 16, 4, 12
    p = torch.softmax(torch.randn(bsz, k + 1, vocab, generator=g), -1)
    draft = torch.randint(0, vocab, (bsz, k), generator=g)
    num = torch.randint(0, k + 1, (bsz,), generator=g)
    seeds, start = np.arange(bsz, dtype=np.uint64) * 1000 + 7, np.arange(bsz) * 3
    batch = coupled_sample(p, draft, num, None, seeds, start)
    for b in range(bsz):
        n = int(num[b])
        one = _run_fast(p[b, :n + 1], draft[b, :n].tolist(), None, int(seeds[b]), int(start[b]))
        assert (batch[b].tokens, batch[b].num_accepted) == (one.tokens, one.num_accepted)


# --- exactness ------------------------------------------------------------------------------


def _setup(sp: SamplingParams, q_kind: str):
    g = torch.Generator().manual_seed(1234)
    p_logits = torch.randn(K + 1, VOCAB, generator=g) * 1.5
    q_logits = p_logits[:K] + torch.randn(K, VOCAB, generator=g) * 1.2  # correlated, with its own errors
    p, q = logits_to_probs(p_logits, sp), logits_to_probs(q_logits, sp)
    seeds = np.arange(N, dtype=np.uint64) + 20_000
    keys = noise_keys(seeds[:, None], np.arange(K + 1)[None, :])  # [N, K+1], start 0
    if q_kind == "onehot":  # a model-free drafter: the same guess every round
        draft = torch.tensor(q_logits.argmax(-1).tolist()).expand(N, K).clone()
        return p, None, draft, seeds
    if q_kind == "truncated":  # the draft's own truncation (ADR 0010), drawn from its support
        q = truncate_mass(q, 0.9, 3)
        vals, ids = torch.topk(q, 3)
        draft = coupled_among(vals.expand(N, K, 3), ids.expand(N, K, 3), torch.from_numpy(keys[:, :K]))
        return p, q_to_dense(SparseQ(ids, vals), torch.zeros(K, dtype=torch.long), VOCAB), draft, seeds
    return p, q, coupled_tokens(q.expand(N, K, VOCAB), torch.from_numpy(keys[:, :K])), seeds


def _coupled(p, draft, q, seeds):
    verdicts = coupled_sample(p.expand(N, K + 1, VOCAB), draft, torch.full((N,), K),
                              None if q is None else q.expand(N, K, VOCAB), seeds, np.zeros(N, dtype=np.int64))
    return [v.tokens for v in verdicts]


def _fresh_at_mismatch(p, draft, q, seeds):
    """Control: drafts kept while they equal the target's draws, but the token at the first
    mismatch drawn afresh from p (another stream), as if it were a bonus token."""
    u = StepUniforms.draw(seeds, np.zeros(N, dtype=np.int64), K)
    judged = coupled_judge(p.expand(N, K + 1, VOCAB), draft, torch.full((N,), K), None, u)
    acc = judged.num_accepted
    fresh = draw(p[acc], torch.from_numpy(uniform(seeds, acc.numpy(), Purpose.RECOVER)))
    final = torch.where(acc < K, fresh, judged.final)
    return [draft[b, :int(acc[b])].tolist() + [int(final[b])] for b in range(N)]


def _against_own_draws(p, draft, q, seeds):
    """Control: each draft judged against the drafter's own draw with the noise (always equal
    for a model drafter): q's distribution, not p's."""
    qq = torch.nn.functional.one_hot(draft, VOCAB).float() if q is None else q.expand(N, K, VOCAB)
    keys = torch.from_numpy(noise_keys(seeds[:, None], np.arange(K)[None, :]))
    mine = coupled_tokens(qq, keys)
    acc = torch.cumprod((draft == mine).long(), 1).sum(1)
    own = coupled_tokens(p.expand(N, K + 1, VOCAB), torch.from_numpy(noise_keys(seeds[:, None], np.arange(K + 1))))
    return [draft[b, :int(acc[b])].tolist() + [int(own[b, int(acc[b])])] for b in range(N)]


def _pvalues(emitted: list[list[int]], p: torch.Tensor) -> list[float]:
    out = []
    for pos in (0, 1):
        toks = np.array([e[pos] for e in emitted if len(e) > pos], dtype=np.int64)
        assert len(toks) > 1000, f"too few rounds reached position {pos}"
        counts = np.bincount(toks, minlength=VOCAB)
        expected = p[pos].double().numpy() * len(toks)
        if counts[expected == 0].sum() > 0:  # a token with p = 0 was emitted
            out.append(0.0)
            continue
        keep = expected > 0
        out.append(float(chisquare(counts[keep], expected[keep] * counts[keep].sum() / expected[keep].sum()).pvalue))
    return out


CASES = [
    pytest.param(SamplingParams(temperature=1.0), "dense", id="T1.0-dense"),
    pytest.param(SamplingParams(temperature=0.7, top_k=5, top_p=0.9), "dense", id="T0.7-topk-topp"),
    pytest.param(SamplingParams(temperature=1.0), "truncated", id="T1.0-q-truncated"),
    pytest.param(SamplingParams(temperature=1.0), "onehot", id="T1.0-onehot"),
]


@pytest.mark.slow
@pytest.mark.parametrize("sp,q_kind", CASES)
def test_emitted_tokens_follow_p(sp, q_kind):
    p, q, draft, seeds = _setup(sp, q_kind)
    emitted = _coupled(p, draft, q, seeds)
    assert min(_pvalues(emitted, p)) > ALPHA
    assert np.mean([len(e) for e in emitted]) > 1.2  # drafts were kept: speculation did something


@pytest.mark.slow
@pytest.mark.parametrize("wrong", [_fresh_at_mismatch, _against_own_draws], ids=["fresh-at-mismatch", "own-draws"])
@pytest.mark.parametrize("sp,q_kind", CASES[:3])
def test_wrong_samplers_fail_the_same_test(sp, q_kind, wrong):
    p, q, draft, seeds = _setup(sp, q_kind)
    pvalues = _pvalues(wrong(p, draft, q, seeds), p)
    print(f"{wrong.__name__} {q_kind}: chi2 p {pvalues}")
    assert min(pvalues) < ALPHA


@pytest.mark.slow
def test_rejection_samplings_bonus_drawn_with_the_noise_follows_p():
    """K = 1: a round that keeps its draft emits the bonus token, drawn with the position's
    noise (Gumbel-max), and it must follow p at position 1."""
    p, q, _, seeds = _setup(SamplingParams(temperature=1.0), "dense")
    draft = coupled_tokens(q[:1].expand(N, 1, VOCAB), torch.from_numpy(noise_keys(seeds[:, None], np.zeros((1, 1)))))
    verdicts = rejection_sample(p[:2].expand(N, 2, VOCAB), draft, torch.ones(N, dtype=torch.long),
                                q[:1].expand(N, 1, VOCAB), seeds, np.zeros(N, dtype=np.int64))
    assert min(_pvalues([v.tokens for v in verdicts], p)) > ALPHA
