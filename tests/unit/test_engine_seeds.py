"""Seeded sampling is reproducible, and resuming from a committed prefix reproduces the rest."""

import itertools

import pytest

from specserve.algorithm.sampling import SamplingParams
from specserve.drafters import HFDrafter, NgramDrafter
from specserve.worker.reference import GenerationParams, ReferenceDecoder


def _engine(demo_pair, target_model, name):
    drafter = HFDrafter(demo_pair.draft) if name == "small" else NgramDrafter(target_model.vocab_size)
    return ReferenceDecoder(target_model, drafter, demo_pair.tokenizer)


@pytest.mark.parametrize("name", ["small", "ngram"])
def test_same_seed_same_tokens_other_seed_other_tokens(demo_pair, target_model, eval_prompts, name):
    engine = _engine(demo_pair, target_model, name)
    sp = SamplingParams(temperature=1.0, top_p=0.95)
    prompt = eval_prompts[0]["prompt"]
    a = engine.generate(prompt, GenerationParams(max_tokens=40, sampling=sp, num_draft_tokens=4, seed=11))
    b = engine.generate(prompt, GenerationParams(max_tokens=40, sampling=sp, num_draft_tokens=4, seed=11))
    c = engine.generate(prompt, GenerationParams(max_tokens=40, sampling=sp, num_draft_tokens=4, seed=12))
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


def test_unseeded_request_reports_its_seed(demo_pair, target_model, eval_prompts):
    engine = _engine(demo_pair, target_model, "small")
    params = GenerationParams(max_tokens=20, sampling=SamplingParams(temperature=1.0), num_draft_tokens=3)
    first = engine.generate(eval_prompts[1]["prompt"], params)
    again = engine.generate(eval_prompts[1]["prompt"], GenerationParams(
        max_tokens=20, sampling=params.sampling, num_draft_tokens=3, seed=first.seed))
    assert again.token_ids == first.token_ids


@pytest.mark.parametrize("name", ["small", "ngram"])
def test_resume_from_committed_prefix_reproduces_continuation(demo_pair, target_model, eval_prompts, name):
    engine = _engine(demo_pair, target_model, name)
    params = GenerationParams(max_tokens=48, sampling=SamplingParams(temperature=0.9), num_draft_tokens=4, seed=5)
    resumed_at = 0
    for item in eval_prompts[::7]:
        full = engine.generate(item["prompt"], params)
        boundaries = list(itertools.accumulate(r.emitted for r in full.rounds))[:-1]
        # a sample can end (EOS) in its first round: nothing to resume from there
        for cut in boundaries[:: max(len(boundaries) // 3, 1)]:
            resumed = engine.generate(item["prompt"], params, committed=full.token_ids[:cut])
            assert resumed.token_ids == full.token_ids
            resumed_at += 1
    assert resumed_at >= 6, "too few round boundaries to resume from"
