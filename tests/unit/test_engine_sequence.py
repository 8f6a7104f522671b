"""Sequence level: the engine's distribution over the first three generated tokens equals
target-only sampling, on a micro model pair (random init, vocabulary of 5).

The exact target-only distribution is enumerated (5^3 = 125 sequences, from one batched
forward), so only the engine side is sampled. Chi-square goodness of fit at ALPHA = 1e-3:
with fixed seeds the outcome is deterministic, and a correct engine fails a given seed set
with probability 1e-3. Cells with an expected count below 5 are pooled (the usual validity
condition of the chi-square approximation).
"""

import itertools

import numpy as np
import pytest
import torch
from scipy.stats import chisquare
from transformers import LlamaConfig, LlamaForCausalLM

from specserve.algorithm.sampling import SamplingParams, logits_to_probs
from specserve.drafters import HFDrafter, NgramDrafter
from specserve.drafters.prediction import PredictionDrafter
from specserve.models.verifier import TargetModel
from specserve.worker.reference import GenerationParams, ReferenceDecoder

VOCAB = 5
PROMPT = [1, 2, 3, 1, 2, 4, 1, 2]  # repeats, so the n-gram drafter finds matches
ALPHA = 1e-3
SCALE = 5.0  # lm_head gain: spread-out but not uniform distributions


class IdsTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def _micro(seed: int, scale: float) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=False, eos_token_id=None, bos_token_id=None, pad_token_id=None)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)  # random init is near uniform: sharpen it
    model.generation_config.eos_token_id = None
    return model


def _exact_distribution(target, sp: SamplingParams) -> dict[tuple[int, ...], float]:
    seqs = torch.tensor([PROMPT + [a, b] for a, b in itertools.product(range(VOCAB), repeat=2)])
    with torch.inference_mode():
        probs = logits_to_probs(target(input_ids=seqs).logits[:, -3:], sp)  # [25, 3, V]
    out = {}
    for row, (a, b) in enumerate(itertools.product(range(VOCAB), repeat=2)):
        for c in range(VOCAB):
            out[(a, b, c)] = float(probs[row, 0, a] * probs[row, 1, b] * probs[row, 2, c])
    return out


@pytest.mark.slow
@pytest.mark.parametrize(
    "drafter_kind,sp,n",
    [("small", SamplingParams(temperature=1.0), 2000),
     ("ngram", SamplingParams(temperature=0.8, top_k=3), 2000),
     # Predicted Outputs: a one-hot draft from the target's likeliest sequence, against a
     # nucleus-truncated p (drafts are often accepted, so both paths run)
     ("prediction", SamplingParams(temperature=0.7, top_p=0.9), 800)],
)
def test_first_three_tokens_match_target_only(drafter_kind, sp, n):
    target_hf = _micro(seed=0, scale=SCALE)
    draft_hf = _micro(seed=1, scale=SCALE)
    target = TargetModel(target_hf)
    exact = _exact_distribution(target_hf, sp)
    drafter = {"small": lambda: HFDrafter(draft_hf), "ngram": lambda: NgramDrafter(VOCAB),
               "prediction": lambda: PredictionDrafter(list(max(exact, key=exact.get)), len(PROMPT), VOCAB)}
    engine = ReferenceDecoder(target, drafter[drafter_kind](), IdsTokenizer())

    counts: dict[tuple[int, ...], int] = {}
    accepted = 0
    for seed in range(n):
        res = engine.generate(PROMPT, GenerationParams(max_tokens=3, sampling=sp, num_draft_tokens=2, seed=seed))
        key = tuple(res.token_ids)
        counts[key] = counts.get(key, 0) + 1
        accepted += sum(r.accepted for r in res.rounds)
    # drafts were accepted, so the accept path (not only recovery) was exercised
    assert accepted > n // 20

    keys = sorted(exact)
    assert sum(counts.get(k, 0) for k in keys if exact[k] == 0) == 0, "emitted an impossible sequence"
    obs = np.array([counts.get(k, 0) for k in keys], dtype=float)
    exp = np.array([exact[k] for k in keys]) * n
    big = exp >= 5
    obs_p = np.append(obs[big], obs[~big].sum())
    exp_p = np.append(exp[big], exp[~big].sum())
    keep = exp_p > 0
    exp_p = exp_p[keep] * obs_p[keep].sum() / exp_p[keep].sum()
    assert chisquare(obs_p[keep], exp_p).pvalue > ALPHA
