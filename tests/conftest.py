"""Shared fixtures: the committed demo pair (models/specserve-demo-v1), the weights every
machine serves. Nothing is trained here; the model-build tests build their own micro pair."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "models" / "specserve-demo-v1"

torch.set_num_threads(2)


@pytest.fixture(scope="session")
def demo_pair_dir() -> Path:
    if not (SHIPPED / "target" / "model.safetensors").exists():
        pytest.fail(f"the committed demo pair is missing at {SHIPPED}: the repository ships it (git lfs is not used)")
    return SHIPPED


@pytest.fixture(scope="session")
def demo_pair(demo_pair_dir):
    from specserve.models.loading import load_pair

    return load_pair(str(demo_pair_dir / "target"), str(demo_pair_dir / "draft"))


PROMPTS_PER_CLASS = 8  # of the pair's 30 held-out prompts per class: enough to cover, fast on 2 cores


@pytest.fixture(scope="session")
def eval_prompts(demo_pair_dir) -> list[dict]:
    """The first held-out prompts of each class (the suite's share of them)."""
    from specserve.tooling.modelbuild.build import load_eval_prompts

    seen: dict[str, int] = {}
    out = []
    for p in load_eval_prompts(demo_pair_dir):
        seen[p["workload_class"]] = seen.get(p["workload_class"], 0) + 1
        if seen[p["workload_class"]] <= PROMPTS_PER_CLASS:
            out.append(p)
    return out


@pytest.fixture(scope="session")
def target_model(demo_pair):
    from specserve.models.verifier import TargetModel

    return TargetModel(demo_pair.target)


@pytest.fixture(scope="session")
def micro_llama():
    """A builder of randomly initialised micro Llamas (no EOS; near-uniform logits, the hardest
    case for batch invariance): micro_llama(layers, hidden, seed, vocab=96, positions=256)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    def build(layers: int, hidden: int, seed: int, vocab: int = 96, positions: int = 256):
        torch.manual_seed(seed)
        cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                          num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                          max_position_embeddings=positions, eos_token_id=None, bos_token_id=None,
                          pad_token_id=None)
        return LlamaForCausalLM(cfg).eval()

    return build


@pytest.fixture
def one_thread():
    """One intra-op thread for a test's forwards (exactness does not depend on it; two threads on
    a shared 2-core machine stall each other)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
