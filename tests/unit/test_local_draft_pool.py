"""The `local:draft` pool (ADR 0025): a draft model with the target's vocabulary drafting inside
the target's process. Where the target runs the device step (forced on the CPU here) it drafts
inside the target's round, rounds chained on the device; elsewhere (the CPU default) on the
engine's thread. The device step holds one drafter: with a `local:eagle` pool beside it, the
head takes the device and the draft model drafts on the host. The settings accept it as a
pool's only address; the target refuses a draft model that is missing or does not share the
target's tokenizer and vocabulary; the router and the controller treat it as any pool."""

from __future__ import annotations

import asyncio
import json
import random
import shutil
from dataclasses import replace

import pytest
import torch
from pydantic import ValidationError

from specserve.config import LOCAL_DRAFT, LOCAL_EAGLE, LOCAL_NGRAM, RouterSettings, TargetSettings
from specserve.errors import IncompatiblePair

PROMPTS = ["def parse(self, text):\n", "Extract the record as JSON. Name: Ann, age 3", "Hello, how are"]
TOKENS = 24
VOCAB = 4096  # the demo pair's


@pytest.mark.parametrize("settings", [RouterSettings, TargetSettings])
def test_local_draft_is_a_pools_only_address(settings):
    assert settings(draft_pools={"draft-local": [LOCAL_DRAFT]}).draft_pools["draft-local"] == [LOCAL_DRAFT]
    for bad in ([LOCAL_DRAFT, "127.0.0.1:1"], [LOCAL_DRAFT, LOCAL_NGRAM], ["local:drafts"]):
        with pytest.raises(ValidationError, match="only address"):
            settings(draft_pools={"x": bad})


def test_the_routers_view_of_a_local_draft_pool_has_no_replica_to_ask():
    from specserve.services.router.pools import DraftPool

    async def go() -> int:
        pool = DraftPool("draft-local", [LOCAL_DRAFT])
        await pool.check_health()
        return pool.healthy

    assert asyncio.run(go()) == 1
    assert DraftPool("draft-local", [LOCAL_DRAFT]).replicas[LOCAL_DRAFT].channel is None


def test_the_controller_chooses_the_local_draft_pool_where_it_pays():
    """Controlled estimates: the pool that pays is chosen, none that pays runs plain, and a
    rollout slice keeps the pool to its slice (the rules of every pool)."""
    from specserve.control.arms import Decision, RequestFacts, choose_arm
    from specserve.control.controller import Estimate
    from specserve.control.policy import Policy

    def est(s: float) -> Estimate:
        return Estimate(spec_rounds=50.0, plain_rounds=50.0, seen=50.0, acceptance=[0.8], plain_step_ms=10.0,
                        speedup={4: s}, round_ms={4: 12.0})

    pools = {"small", "draft-local"}
    policy = Policy("code", draft_pool="small", draft_pools=("draft-local",), k=4, probe_fraction=0.0)
    facts, rng = RequestFacts(temperature=0.0, prompt_tokens=40, request_id="r"), random.Random(2)
    choice, _ = choose_arm(facts, policy, pools, {"small": est(1.2), "draft-local": est(1.7)}, rng, 8.0)
    assert (choice.pool, choice.decision) == ("draft-local", Decision.SPECULATE)
    choice, _ = choose_arm(facts, policy, pools, {"small": est(0.7), "draft-local": est(0.8)}, rng, 8.0)
    assert choice.pool is None
    sliced = replace(policy, mode="slice", slice_percent=25.0)
    arms = [choose_arm(replace(facts, request_id=f"r{i}"), sliced, pools,
                       {"small": est(0.9), "draft-local": est(1.7)}, rng, 8.0)[0] for i in range(200)]
    inside = [c.pool for c in arms if c.pool is not None]
    assert 20 < len(inside) < 80 and set(inside) == {"draft-local"}


# -- the target's setting: the draft model's directory, refused where it cannot draft ----------

def _settings(demo_pair_dir, **kw) -> TargetSettings:
    return TargetSettings(model=str(demo_pair_dir / "target"), draft_pools={"draft-local": [LOCAL_DRAFT]}, **kw)


def test_the_draft_model_defaults_to_draft_beside_the_target(demo_pair_dir, tmp_path):
    from specserve.services.target.local_draft import load_local_draft, local_draft_dir

    assert local_draft_dir(_settings(demo_pair_dir)) == demo_pair_dir / "draft"
    assert local_draft_dir(_settings(demo_pair_dir, local_draft_model=str(tmp_path))) == tmp_path
    model = load_local_draft(_settings(demo_pair_dir), VOCAB)
    assert model.get_output_embeddings().weight.shape[0] == VOCAB


def _copy_draft(demo_pair_dir, dst):
    shutil.copytree(demo_pair_dir / "draft", dst)
    return dst


def test_a_missing_or_incompatible_draft_model_is_refused(demo_pair_dir, tmp_path):
    from specserve.services.target.local_draft import load_local_draft

    def refused(directory, error, match: str) -> None:
        with pytest.raises(error, match=match):
            load_local_draft(_settings(demo_pair_dir, local_draft_model=str(directory)), VOCAB)

    refused(tmp_path / "nowhere", ValueError, "needs a draft model: none at")
    (tmp_path / "empty").mkdir()
    refused(tmp_path / "empty", ValueError, "needs a draft model: none at")
    no_tok = _copy_draft(demo_pair_dir, tmp_path / "no-tokenizer")
    for f in no_tok.glob("tokenizer*"):
        f.unlink()
    refused(no_tok, IncompatiblePair, "has no tokenizer")
    # the same model with two of its tokenizer's ids swapped: the vocabularies differ
    swapped = _copy_draft(demo_pair_dir, tmp_path / "swapped")
    tok = json.loads((swapped / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[300:302]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (swapped / "tokenizer.json").write_text(json.dumps(tok))
    refused(swapped, IncompatiblePair, "does not share the target's vocabulary: vocabularies differ at token id")
    # the target's tokenizer, but an output layer of another size
    from transformers import LlamaConfig, LlamaForCausalLM

    wider = tmp_path / "wider"
    LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB + 8, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1)).save_pretrained(wider)
    for f in (demo_pair_dir / "draft").glob("tokenizer*"):
        shutil.copy(f, wider / f.name)
    refused(wider, IncompatiblePair, "output sizes differ")


# -- through the engine: the target's own greedy tokens, on the device step and on the host ----

def _target_step(demo_pair, fixed: bool):
    from specserve.models.verifier import TargetModel
    from specserve.worker.model_step import Batching, make_target_step

    b = Batching(kv_budget_mb=64, max_sessions=8, max_len=256, prefill_chunk=16, device="cpu", dtype="fp32",
                 max_batch=8, **({"fixed_step": True, "lookahead": True} if fixed else {}))
    return make_target_step(TargetModel(demo_pair.target), b)


def _sources(demo_pair_dir, engine, target, pools: dict[str, list[str]]) -> dict:
    from specserve.services.target.actor import draft_sources

    sources, fleets = draft_sources(TargetSettings(model=str(demo_pair_dir / "target"), draft_pools=pools),
                                    engine, target, None, None, None)
    assert fleets == []
    return sources


def _generate(demo_pair, engine, sources: dict, pools: list[str]) -> dict:
    """Each prompt on each pool (greedy, K 4), all at once through the engine loop."""
    from specserve.algorithm.stops import StopChecker
    from specserve.engine.loop import EngineLoop
    from specserve.engine.session import EnginePlan
    from specserve.params import GenerationParams

    tok = demo_pair.tokenizer
    loop = EngineLoop(engine, lambda p: StopChecker(frozenset(), p.stop, tok.decode), sources)
    for pool in pools:
        for i, prompt in enumerate(PROMPTS):
            loop.add(f"{pool}/{i}", tok.encode(prompt),
                     EnginePlan(GenerationParams(max_tokens=TOKENS, num_draft_tokens=4, seed=1), pool=pool))
    loop.run_until_idle()
    return loop.ended


def _greedy(demo_pair) -> list[list[int]]:
    out = []
    with torch.inference_mode():
        for prompt in PROMPTS:
            ids = demo_pair.tokenizer.encode(prompt)
            out.append(demo_pair.target.generate(torch.tensor([ids]), max_new_tokens=TOKENS,
                                                 do_sample=False)[0, len(ids):].tolist())
    return out


@pytest.mark.parametrize("fixed", [True, False], ids=["device-step-chained", "cpu-default-host"])
def test_local_draft_through_the_engine_gives_the_targets_greedy_tokens(demo_pair, demo_pair_dir, fixed, one_thread):
    from specserve.engine.device_drafts import DeviceDraftModelDrafts
    from specserve.engine.drafting import LocalDrafts
    from specserve.models.draft_step import DeviceDraft

    engine = _target_step(demo_pair, fixed)
    assert (engine.runner.device_step is not None) == fixed
    sources = _sources(demo_pair_dir, engine, engine.target, {"draft-local": [LOCAL_DRAFT]})
    source = sources["draft-local"]
    ended = _generate(demo_pair, engine, sources, ["draft-local"])
    want = _greedy(demo_pair)
    for i in range(len(PROMPTS)):
        got = ended[f"draft-local/{i}"]
        assert got.generated == want[i][:len(got.generated)] and len(got.generated) >= TOKENS - 4, i
    accepted = sum(r.accepted for i in range(len(PROMPTS)) for r in ended[f"draft-local/{i}"].rounds)
    assert accepted >= 15  # the draft model's drafts are accepted
    if fixed:  # inside the target's round, chained on the device
        assert isinstance(source, DeviceDraftModelDrafts) and isinstance(engine.heads.device, DeviceDraft)
        assert engine.rounds.counts["taken"] >= 3, (engine.rounds.counts, engine.rounds.thrown_by)
    else:  # on the engine's thread
        assert type(source) is LocalDrafts and getattr(engine, "heads", None) is None


def test_with_an_eagle_head_beside_it_the_head_takes_the_device(demo_pair, demo_pair_dir, one_thread):
    """Both local pools on a target with the device step: the EAGLE head drafts inside the
    round, the draft model on the engine's thread, in whichever order the pools are named;
    both give the target's greedy tokens in the same steps."""
    from specserve.engine.drafting import LocalDrafts
    from specserve.engine.eagle_local import DeviceHeadDrafts
    from specserve.models.head_step import DeviceHead

    engine = _target_step(demo_pair, fixed=True)
    sources = _sources(demo_pair_dir, engine, engine.target,
                       {"draft-local": [LOCAL_DRAFT], "eagle-local": [LOCAL_EAGLE]})
    assert isinstance(sources["eagle-local"], DeviceHeadDrafts) and isinstance(engine.heads.device, DeviceHead)
    assert type(sources["draft-local"]) is LocalDrafts
    ended = _generate(demo_pair, engine, sources, ["draft-local", "eagle-local"])
    want = _greedy(demo_pair)
    for pool in ("draft-local", "eagle-local"):
        for i in range(len(PROMPTS)):
            got = ended[f"{pool}/{i}"].generated
            assert got == want[i][:len(got)] and len(got) >= TOKENS - 4, (pool, i)
        assert sum(r.accepted for i in range(len(PROMPTS)) for r in ended[f"{pool}/{i}"].rounds) > 0, pool


def test_without_a_device_step_neither_local_pool_takes_one(demo_pair, demo_pair_dir):
    from specserve.services.target.local_draft import device_pool

    pools = {"a": [LOCAL_NGRAM], "d": [LOCAL_DRAFT], "e": [LOCAL_EAGLE], "e2": [LOCAL_EAGLE]}
    assert device_pool(pools, _target_step(demo_pair, fixed=False)) is None
    fixed = _target_step(demo_pair, fixed=True)
    assert device_pool(pools, fixed) == "e"
    assert device_pool({"d": [LOCAL_DRAFT], "d2": [LOCAL_DRAFT]}, fixed) == "d"
    assert device_pool({"n": [LOCAL_NGRAM]}, fixed) is None


def test_the_kv_budget_holds_the_draft_models_kv_beside_the_targets(demo_pair, demo_pair_dir):
    """The draft model in the round keeps its KV over every slot of the target (ADR 0025): the
    target's slots leave it room, so both fit the budget (on a GPU the budget is the memory the
    weights leave: past it, an out-of-memory at start). A budget of 10.25 of the target's slots:
    10 slots for the target alone and the draft's KV past the budget, before."""
    from specserve.models.verifier import TargetModel
    from specserve.services.target.actor import draft_sources
    from specserve.services.target.local_draft import target_batching
    from specserve.worker.model_step import make_target_step

    slot_mb = 256 * 2 * 6 * 8 * 64 * 4 / 2**20  # 256 positions, K and V, 6 layers, 8 KV heads of 64, fp32
    s = TargetSettings(model=str(demo_pair_dir / "target"), draft_pools={"draft-local": [LOCAL_DRAFT]},
                       kv_budget_mb=10.25 * slot_mb, max_len=256, max_sessions=32, prefill_chunk=16, max_batch=4,
                       device="cpu", dtype="fp32")
    b = target_batching(s, fixed_step=True)
    assert b.drafter_kv_share == pytest.approx((1 * 4 * 32) / (6 * 8 * 64))
    assert b.drafter_params == sum(p.numel() for p in demo_pair.draft.parameters())  # (its weights, reserved)
    engine = make_target_step(TargetModel(demo_pair.target), b)
    draft_sources(s, engine, engine.target, None, None, None)
    kv = engine.runner.kv
    target_bytes = sum(k.numel() * k.element_size() * 2 for k in kv.keys)
    assert target_bytes == kv.num_slots * slot_mb * 2**20
    assert target_bytes + engine.heads.device.kv_bytes <= s.kv_budget_mb * 2**20
    assert kv.num_slots == 9  # one slot less than the target alone, not more
    alone = target_batching(s.model_copy(update={"draft_pools": {}}), fixed_step=True)
    assert alone.drafter_kv_share == 0 and alone.drafter_params == 0
    assert target_batching(s).drafter_kv_share == 0  # the CPU default drafts on the host: no KV beside the slots


def test_specserve_up_starts_draft_local_and_the_stack_names_its_model(demo_pair_dir, tmp_path):
    from specserve.tooling.cli.stack import _stack_spec
    from specserve.tooling.stack import PoolSpec, StackError, StackSpec, local_draft_env

    spec = _stack_spec(demo_pair_dir, tmp_path / "run")
    assert spec.pools["draft-local"] == PoolSpec("draft", local=True)
    assert local_draft_env(spec) == {"SPECSERVE_TARGET_LOCAL_DRAFT_MODEL": str(demo_pair_dir / "draft")}
    assert local_draft_env(StackSpec(str(demo_pair_dir), "run", pools={"n": PoolSpec("ngram", local=True)})) == {}
    other = _copy_draft(demo_pair_dir, tmp_path / "other")
    for pools, match in (({"a": PoolSpec("draft", local=True), "b": PoolSpec(str(other), local=True)}, "one draft"),
                         ({"a": PoolSpec(str(tmp_path / "none"), local=True)}, "no model at")):
        with pytest.raises(StackError, match=match):
            local_draft_env(StackSpec(str(demo_pair_dir), "run", pools=pools))
