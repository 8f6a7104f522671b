"""EAGLE-style heads (issue 40, ADR 0020): the head's loading, the target's features, and the
eagle-local pool beside the engine.

1. The runner keeps the chosen layers' outputs per token from the same forward (eager and the
   device step) equal to the HF model's own layer outputs; the target's VERIFY rows hand out
   those of the committed positions they fed, contiguous from 0 over a chunked prompt and
   rounds with rejections.
2. The eagle-local pool's blocks are exactly the head's drafts from the features it was
   handed, at each committed prefix (its cache follows the committed positions); greedy output
   through it equals target-only greedy decoding (lossless whatever the head drafts).
3. The head saves and loads (config and bf16 weights); the recipe's losses fall on a micro
   target; the shipped head, where present, loads for the demo target and drafts.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specserve.algorithm.stops import StopChecker
from specserve.drafters.eagle import (
    EagleConfig,
    EagleHead,
    HeadCache,
    TargetParts,
    load_head,
    save_head,
)
from specserve.engine.eagle_local import EagleLocalDrafts
from specserve.engine.loop import EngineLoop
from specserve.engine.session import EnginePlan
from specserve.engine.speculation import SpeculationSettings
from specserve.models.runner import ModelRunner, Row
from specserve.models.verifier import TargetModel
from specserve.params import GenerationParams, SamplingParams
from specserve.step import Step, StepRow
from specserve.tooling.modelbuild.eagle import HeadRecipe, draft_block, head_losses, total_loss
from specserve.worker.model_step import Batching, make_target_step

SHIPPED_HEAD = Path(__file__).resolve().parents[2] / "models" / "specserve-demo-v1" / "eagle"


def _micro(seed: int = 0, layers: int = 3) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=97, hidden_size=48, intermediate_size=96, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=True)
    return LlamaForCausalLM(cfg).eval()


@pytest.mark.parametrize("fixed", [False, True], ids=["eager", "device-step"])
@pytest.mark.parametrize("layers", [(2,), (0, 1, 2)], ids=["last", "fused"])
def test_the_runner_keeps_the_layers_outputs_of_the_same_forward(fixed, layers, one_thread):
    model = _micro()
    runner = ModelRunner.from_hf(model, max_sessions=4, max_len=64, tile=None if fixed else 4, fuse_upto=0)
    if fixed:
        runner.enable_device_step(max_rows=2)
    runner.keep_features(layers)
    runner.allocate("a")
    runner.allocate("b")
    seq_a, seq_b = list(range(3, 23)), list(range(40, 49))
    runner.forward([Row("a", seq_a), Row("b", seq_b)])
    got_a = [runner.last_features[0]]
    runner.forward([Row("a", [30, 31]), Row("b", [50])])
    got_a.append(runner.last_features[0].clone())
    feats, _, _ = TargetParts(model, layers).features(torch.tensor([seq_a + [30, 31]]))
    assert torch.cat(got_a).shape == (22, 48 * len(layers))
    assert torch.allclose(torch.cat(got_a), feats[0], atol=1e-5)
    with pytest.raises(ValueError, match="outside"):
        runner.keep_features((3,))


def test_verify_rows_hand_out_the_committed_positions_features(demo_pair, one_thread):
    """A 40-token prompt in chunks of 16, then a round with 2 of 3 drafts accepted: features of
    positions 0..42 arrive, each once, in order; the last committed token's comes next round."""
    model = make_target_step(TargetModel(demo_pair.target), Batching(max_sessions=2, max_len=128, prefill_chunk=16))
    model.keep_features((5,))
    slot = model.open("a")
    ids = list(range(100, 140))
    pieces = []
    while True:
        res = model.step(Step([StepRow.verify(slot, ids, [], None, SamplingParams(), 0, features=True)])).rows[0]
        pieces.append((res.features_start, res.features.shape[0]))
        if not res.again:
            break
    ids = ids + res.verdict.tokens
    with torch.inference_mode():
        cont = demo_pair.target.generate(torch.tensor([ids]), max_new_tokens=2, do_sample=False)[0, len(ids):].tolist()
    res = model.step(Step([StepRow.verify(slot, ids, cont + [7], None, SamplingParams(), 0, features=True)])).rows[0]
    assert res.verdict.num_accepted == 2
    pieces.append((res.features_start, res.features.shape[0]))
    assert pieces == [(0, 16), (16, 16), (32, 8), (40, 3)]
    # a row that does not ask gets none
    plain = model.step(Step([StepRow.verify(slot, ids + res.verdict.tokens, [], None, SamplingParams(), 0)])).rows[0]
    assert plain.features is None


class _Recording(EagleLocalDrafts):
    """The source, recording every feature hand-out and every block it delivers."""

    def __init__(self, head, parts) -> None:
        super().__init__(head, parts)
        self.handed: list[tuple[int, torch.Tensor]] = []
        self.blocks = []

    def features(self, session_id, start, feats) -> None:
        self.handed.append((start, feats.clone()))
        super().features(session_id, start, feats)

    def attach(self, deliver) -> None:
        def record(block):
            self.blocks.append(block)
            deliver(block)
        super().attach(record)


def _engine(target: LlamaForCausalLM, head: EagleHead, fixed: bool = False):
    model = make_target_step(TargetModel(target), Batching(max_sessions=4, max_len=256, prefill_chunk=16,
                                                           tile=None if fixed else 4, fixed_step=fixed))
    model.keep_features(head.cfg.feature_layers)
    source = _Recording(head, TargetParts(target, head.cfg.feature_layers))
    stops = lambda params: StopChecker(frozenset(), params.stop, lambda ids: "")  # noqa: E731
    return EngineLoop(model, stops, {"eagle": source}), source


@pytest.mark.parametrize("fixed", [False, True], ids=["eager", "device-step"])
def test_eagle_local_blocks_are_the_heads_drafts_at_each_prefix(fixed, one_thread):
    """Each block the pool delivered equals `draft_block` over the features it was handed: the
    head's cache holds exactly the committed positions before the last one."""
    target = _micro(1)
    torch.manual_seed(5)
    head = EagleHead(EagleConfig.for_target(target.config)).eval()
    loop, source = _engine(target, head, fixed)
    prompt = [(7 * i) % 97 for i in range(1, 38)]
    loop.add("s", prompt, EnginePlan(GenerationParams(max_tokens=30, num_draft_tokens=3, seed=2), pool="eagle"))
    loop.run_until_idle()
    s = loop.ended["s"]
    seq = prompt + s.generated
    feats = torch.zeros(len(seq), head.cfg.feature_dim)
    for start, f in source.handed:
        feats[start:start + f.shape[0]] = f
    inputs = head.project(feats)
    parts = TargetParts(target, head.cfg.feature_layers)
    assert source.blocks, "the pool drafted nothing"
    for block in source.blocks:
        n = block.base_len
        cache = HeadCache()
        with torch.inference_mode():
            head.extend(cache, inputs[:n - 2], parts.embed(torch.tensor(seq[1:n - 1])))
            want = draft_block(head, parts, cache, inputs[n - 2], seq[n - 1], len(block.tokens))
        assert list(block.tokens) == want, n


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_output_through_eagle_local_is_the_targets(demo_pair, temperature, one_thread):
    """Lossless whatever the head drafts: greedy equals target-only greedy; seeded equals the
    same request with no drafts (the verdicts use the target's own draws where a block ends)."""
    torch.manual_seed(0)
    head = load_head(SHIPPED_HEAD) if SHIPPED_HEAD.exists() else \
        EagleHead(EagleConfig.for_target(demo_pair.target.config)).eval()
    prompt = demo_pair.tokenizer.encode("def add(a, b):\n    return")
    params = GenerationParams(max_tokens=32, num_draft_tokens=4, seed=3,
                              sampling=SamplingParams(temperature=temperature))
    loop, source = _engine(demo_pair.target, head)
    loop.add("s", prompt, EnginePlan(params, pool="eagle"))
    loop.run_until_idle()
    got = loop.ended["s"]
    assert len(source.blocks) > 3 and sum(r.k for r in got.rounds) > 0
    if temperature == 0:
        with torch.inference_mode():
            ref = demo_pair.target.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False)
        assert got.generated == ref[0, len(prompt):].tolist()[:len(got.generated)]


def test_a_head_saves_and_loads(tmp_path):
    target = _micro()
    head = EagleHead(EagleConfig.for_target(target.config, (0, 2))).eval()
    save_head(head, tmp_path)
    again = load_head(tmp_path)
    assert again.cfg == head.cfg and again.cfg.feature_dim == 96 and again.reduce is not None
    for (name, a), (_, b) in zip(head.state_dict().items(), again.state_dict().items(), strict=True):
        assert torch.equal(a.to(torch.bfloat16).float(), b), name


def test_the_recipes_losses_fall_on_a_micro_target(one_thread):
    target = _micro(2)
    for p in target.parameters():
        p.requires_grad_(False)
    recipe = HeadRecipe(seq_len=32, batch=4, noise=0.0)
    head = EagleHead(EagleConfig.for_target(target.config))
    parts = TargetParts(target, head.cfg.feature_layers)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 97, (4, 32), generator=g)
    opt = torch.optim.AdamW(head.parameters(), lr=3e-3)
    first = None
    for _ in range(30):
        losses = head_losses(head, parts, ids, recipe)
        loss = total_loss(losses, recipe)
        first = first if first is not None else {k: float(v.detach()) for k, v in losses.items()}
        opt.zero_grad()
        loss.backward()
        opt.step()
    last = {k: float(v) for k, v in head_losses(head, parts, ids, recipe).items()}
    assert set(last) == {"reg", "cls", "reg2", "cls2"}
    # a random target's distributions are near-uniform, so its cross-entropy floor (their
    # entropy) is near where it starts: the regression shows the learning, the CE must not rise
    assert last["reg"] < 0.2 * first["reg"] and last["reg2"] < 0.2 * first["reg2"], (first, last)
    assert last["cls"] <= first["cls"] + 1e-3, (first, last)


@pytest.mark.skipif(not SHIPPED_HEAD.exists(), reason="the demo pair's head is not shipped in this checkout")
def test_the_shipped_head_loads_for_the_demo_target(demo_pair):
    head = load_head(SHIPPED_HEAD)
    cfg = head.cfg
    assert (cfg.hidden, cfg.vocab_size) == (demo_pair.target.config.hidden_size, demo_pair.target.config.vocab_size)
    assert (SHIPPED_HEAD / "model.safetensors").stat().st_size <= 12 * 2**20
    assert (SHIPPED_HEAD / "MODEL_CARD.md").exists() and (SHIPPED_HEAD / "build.json").exists()


def test_local_eagle_is_a_pools_only_address_and_needs_a_head(tmp_path):
    from pydantic import ValidationError

    from specserve.config import LOCAL_EAGLE, LOCAL_NGRAM, RouterSettings, TargetSettings
    from specserve.services.target.actor import eagle_local

    for settings in (RouterSettings, TargetSettings):
        assert settings(draft_pools={"eagle-local": [LOCAL_EAGLE]}).draft_pools["eagle-local"] == [LOCAL_EAGLE]
        for bad in ([LOCAL_EAGLE, LOCAL_NGRAM], [LOCAL_EAGLE, "127.0.0.1:1"], ["local:medusa"]):
            with pytest.raises(ValidationError, match="only address"):
                settings(draft_pools={"x": bad})
    s = TargetSettings(model=str(tmp_path / "target"), draft_pools={"eagle-local": [LOCAL_EAGLE]})
    with pytest.raises(ValueError, match="needs an EAGLE head"):
        eagle_local(s, None, None)


@pytest.mark.parametrize("fixed", [False, True], ids=["eager", "device-step"])
def test_eagle_local_trees_are_verified_and_lossless(demo_pair, fixed, one_thread):
    """tree_width 2 at one session: where the head is unsure of a block's first token it drafts
    its two likeliest, each with its greedy chain; the target verifies the tree in one pass and
    greedy output stays the target's."""
    torch.manual_seed(0)
    head = load_head(SHIPPED_HEAD) if SHIPPED_HEAD.exists() else \
        EagleHead(EagleConfig.for_target(demo_pair.target.config)).eval()
    model = make_target_step(TargetModel(demo_pair.target), Batching(max_sessions=4, max_len=256, prefill_chunk=16,
                                                                     tile=None if fixed else 4, fixed_step=fixed))
    model.keep_features(head.cfg.feature_layers)
    source = _Recording(head, TargetParts(demo_pair.target, head.cfg.feature_layers))
    stops = lambda params: StopChecker(frozenset(), params.stop, lambda ids: "")  # noqa: E731
    loop = EngineLoop(model, stops, {"eagle": source}, speculation=SpeculationSettings(tree_width=2, tree_always=True))
    prompt = demo_pair.tokenizer.encode("def add(a, b):\n    return")
    loop.add("s", prompt, EnginePlan(GenerationParams(max_tokens=32, num_draft_tokens=3, seed=3), pool="eagle"))
    loop.run_until_idle()
    got = loop.ended["s"]
    trees = [b for b in source.blocks if b.parents is not None]
    def two_chains(k: int) -> tuple[int, ...]:
        return tuple([-1] + list(range(k - 1)) + [-1] + list(range(k, 2 * k - 1)))

    assert trees and all(b.parents == two_chains(len(b.tokens) // 2) for b in trees)
    assert any(len(b.tokens) == 6 for b in trees)
    assert any(r.tree_size == 6 for r in got.rounds) and all(r.k <= 3 for r in got.rounds)
    with torch.inference_mode():
        ref = demo_pair.target.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False)
    assert got.generated == ref[0, len(prompt):].tolist()[:len(got.generated)]
