"""Where a block meets the end: EOS and max_tokens inside a block, K beyond the budget,
all-rejected and all-accepted rounds, bad prompts."""

from collections.abc import Sequence

import pytest
import torch

from specserve.algorithm.sampling import SamplingParams
from specserve.drafters.base import DraftProposal
from specserve.errors import InvalidRequest
from specserve.models.verifier import TargetModel
from specserve.worker.reference import GenerationParams, ReferenceDecoder


class ScriptedDrafter:
    """Proposes a fixed continuation (or garbage) regardless of the model: fakes are fine
    on the draft side because the verdict only depends on the target."""

    name = "scripted"

    def __init__(self, vocab_size: int, script: Sequence[int] | None) -> None:
        self.vocab_size = vocab_size
        self.script = script  # full expected sequence (prompt + continuation); None = wrong tokens

    def start(self):
        return self

    def propose(self, token_ids, k, sampling, seed):
        if self.script is None:
            return DraftProposal([(token_ids[-1] + 1) % self.vocab_size] * k, None)
        n = len(token_ids)
        return DraftProposal(list(self.script[n : n + k]), None)

    def observe(self, proposal, num_accepted):
        pass

    def release(self):
        pass


def _greedy_reference(demo_pair, ids, n):
    with torch.inference_mode():
        out = demo_pair.target.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                        max_new_tokens=n, do_sample=False)
    return out[0].tolist()


@pytest.fixture(scope="module")
def prompt_ids(demo_pair, eval_prompts):
    return demo_pair.tokenizer.encode(eval_prompts[12]["prompt"])


def test_all_accepted_plus_bonus_with_an_oracle_drafter(demo_pair, target_model, prompt_ids):
    full = _greedy_reference(demo_pair, prompt_ids, 40)
    engine = ReferenceDecoder(target_model, ScriptedDrafter(target_model.vocab_size, full), demo_pair.tokenizer)
    res = engine.generate(prompt_ids, GenerationParams(max_tokens=30, num_draft_tokens=4))
    assert res.token_ids == full[len(prompt_ids) : len(prompt_ids) + 30]
    # a last round cut by EOS emits fewer than K + 1 (the demo pair ends some prompts early)
    rounds = res.rounds[:-1] if res.finish_reason == "eos" else res.rounds
    full_rounds = [r for r in rounds if r.k == 4]
    assert full_rounds and all(r.accepted == 4 and r.rejected_position is None and r.emitted == 5 for r in full_rounds)


def test_all_rejected_still_emits_one_token_per_round(demo_pair, target_model, prompt_ids):
    full = _greedy_reference(demo_pair, prompt_ids, 12)
    engine = ReferenceDecoder(target_model, ScriptedDrafter(target_model.vocab_size, None), demo_pair.tokenizer)
    res = engine.generate(prompt_ids, GenerationParams(max_tokens=12, num_draft_tokens=3))
    assert res.token_ids == full[len(prompt_ids) :]
    assert all(r.emitted == 1 for r in res.rounds)
    assert sum(r.rejected_position == 0 for r in res.rounds) >= len(res.rounds) - 3  # the odd lucky guess aside


def test_eos_inside_the_block_ends_generation(demo_pair, prompt_ids):
    full = _greedy_reference(demo_pair, prompt_ids, 40)
    cont = full[len(prompt_ids) :]
    # pretend the token the target emits at position 2 is EOS (first occurrence)
    eos = cont[2]
    first = cont.index(eos)
    target = TargetModel(demo_pair.target)
    target.eos_token_ids = frozenset([eos])
    engine = ReferenceDecoder(target, ScriptedDrafter(target.vocab_size, full), demo_pair.tokenizer)
    res = engine.generate(prompt_ids, GenerationParams(max_tokens=30, num_draft_tokens=6))
    assert res.finish_reason == "eos"
    assert res.token_ids == cont[: first + 1]
    assert res.rounds[-1].k > res.rounds[-1].emitted - 1  # the block went past EOS; its tail was dropped


def test_max_tokens_inside_the_block_and_k_beyond_budget(demo_pair, target_model, prompt_ids):
    full = _greedy_reference(demo_pair, prompt_ids, 10)
    engine = ReferenceDecoder(target_model, ScriptedDrafter(target_model.vocab_size, full), demo_pair.tokenizer)
    res = engine.generate(prompt_ids, GenerationParams(max_tokens=3, num_draft_tokens=8))
    assert res.token_ids == full[len(prompt_ids) : len(prompt_ids) + 3]
    assert res.finish_reason == "length"
    assert [r.k for r in res.rounds] == [2]  # K clipped to the remaining budget minus the bonus
    one = engine.generate(prompt_ids, GenerationParams(max_tokens=1, num_draft_tokens=8))
    assert len(one.token_ids) == 1 and one.rounds[0].k == 0


def test_max_tokens_cut_inside_a_sampled_block(demo_pair, target_model, prompt_ids):
    full = _greedy_reference(demo_pair, prompt_ids, 10)
    engine = ReferenceDecoder(target_model, ScriptedDrafter(target_model.vocab_size, full), demo_pair.tokenizer)
    sampling = SamplingParams(temperature=0.8, banned_token_ids=tuple(target_model.eos_token_ids))  # (no EOS cut)
    for n in range(1, 8):
        res = engine.generate(prompt_ids, GenerationParams(max_tokens=n, num_draft_tokens=5, sampling=sampling, seed=n))
        assert len(res.token_ids) == n


def test_stop_string_across_round_boundaries(demo_pair, target_model, eval_prompts):
    tok = demo_pair.tokenizer
    ids = tok.encode(eval_prompts[21]["prompt"])  # extraction: long, varied continuation
    full = _greedy_reference(demo_pair, ids, 40)
    engine = ReferenceDecoder(target_model, ScriptedDrafter(target_model.vocab_size, full), demo_pair.tokenizer)
    plain = engine.generate(ids, GenerationParams(max_tokens=40, num_draft_tokens=2))
    text = plain.text
    # a stop string that starts in one round's tokens and ends in a later round's
    bounds, pos = [], 0
    for r in plain.rounds:
        pos += r.emitted
        bounds.append(len(tok.decode(plain.token_ids[:pos])))
    cut = next(b for b in bounds if 6 <= b <= len(text) - 4)
    stop = text[cut - 3 : cut + 3]
    assert stop.strip(), "pick a visible stop string"
    res = engine.generate(ids, GenerationParams(max_tokens=40, num_draft_tokens=2, stop=(stop,)))
    assert res.finish_reason == "stop"
    assert res.text == text[: text.index(stop)]
    assert stop in tok.decode(res.token_ids) and len(res.token_ids) < len(plain.token_ids)


def test_empty_and_overlong_prompts_are_refused(demo_pair, target_model):
    engine = ReferenceDecoder(target_model, None, demo_pair.tokenizer)
    with pytest.raises(InvalidRequest, match="empty"):
        engine.generate("", GenerationParams())
    with pytest.raises(InvalidRequest, match="context length"):
        engine.generate([5] * target_model.max_positions, GenerationParams(max_tokens=1))
    with pytest.raises(InvalidRequest, match="outside the vocabulary"):
        engine.generate([5, target_model.vocab_size + 3], GenerationParams())
    with pytest.raises(InvalidRequest, match="max_tokens"):
        GenerationParams(max_tokens=0)
    with pytest.raises(InvalidRequest, match="K"):
        GenerationParams(num_draft_tokens=-1)


def test_eos_token_id_zero_is_kept():
    """EOS is often token id 0: reading it with `or` would fall through to the model config."""
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(vocab_size=8, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2, eos_token_id=5))
    model.generation_config.eos_token_id = 0
    assert TargetModel(model).eos_token_ids == frozenset([0])
