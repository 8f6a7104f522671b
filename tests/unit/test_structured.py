"""Structured outputs (ADR 0017): constraints compile or are refused with the compiler's
message; under a constraint the engine is lossless (greedy byte-identical to target-only
constrained greedy decoding; at T > 0 the first free position follows the target's masked
distribution); every finished output parses; forced tokens cost no draft forward."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from scipy import stats

from specserve.algorithm.sampling import SamplingParams
from specserve.algorithm.stops import StopChecker
from specserve.drafters import HFDrafter, NgramDrafter
from specserve.engine.drafting import LocalDrafts
from specserve.engine.loop import EngineLoop
from specserve.engine.session import EnginePlan
from specserve.engine.speculation import SpeculationSettings
from specserve.errors import InvalidRequest
from specserve.model_info import ModelInfo
from specserve.params import GenerationParams
from specserve.structured.constraint import Constraint
from specserve.structured.grammar import ConstrainedRow, GrammarCache, tokenizer_info
from specserve.worker.model_step import Batching, make_target_step

xgr = pytest.importorskip("xgrammar")

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                           "year": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                                    "maxItems": 3}},
          "required": ["name", "year", "tags"]}
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def cache(demo_pair_dir, target_model):
    info = tokenizer_info(str(demo_pair_dir / "target" / "tokenizer.json"), target_model.vocab_size,
                          sorted(target_model.eos_token_ids))
    return GrammarCache(info)


def _encode(demo_pair):
    return lambda text: demo_pair.tokenizer.encode(text, add_special_tokens=False)


def _loop(demo_pair, target_model, cache, forced=True, sources=None, **kw) -> EngineLoop:
    model = make_target_step(target_model, Batching(kv_budget_mb=96, max_sessions=16, prefill_chunk=32, max_len=512))
    eos = target_model.eos_token_ids
    encode = _encode(demo_pair)
    return EngineLoop(model, lambda p: StopChecker(eos, p.stop, demo_pair.tokenizer.decode),
                      sources if sources is not None else
                      {"small": LocalDrafts(HFDrafter(demo_pair.draft)),
                       "ngram": LocalDrafts(NgramDrafter(target_model.vocab_size))},
                      constrain=lambda c: ConstrainedRow(cache.compile(c), cache.vocab_size, target_model.vocab_size,
                                                         forced_drafts=forced, encode=encode),
                      speculation=SpeculationSettings(**kw))


def _reference(demo_pair, target_model, cache, ids: list[int], c: Constraint, max_tokens: int) -> list[int]:
    """Target-only constrained greedy decoding from transformers' logits: each step the full
    forward, the legal tokens from a fresh matcher, the legal argmax."""
    matcher = xgr.GrammarMatcher(cache.compile(c))
    mask = xgr.allocate_token_bitmask(1, cache.vocab_size)
    out: list[int] = []
    with torch.inference_mode():
        for _ in range(max_tokens):
            logits = demo_pair.target(torch.tensor([ids + out])).logits[0, -1].float()
            matcher.fill_next_token_bitmask(mask)
            xgr.apply_token_bitmask_inplace(logits, mask)
            tok = int(logits.argmax())
            out.append(tok)
            assert matcher.accept_token(tok)
            if tok in target_model.eos_token_ids:
                break
    return out


def _prompts(demo_pair, eval_prompts, n: int) -> list[list[int]]:
    items = [p for p in eval_prompts if p["workload_class"] == "extraction"][:n]
    return [demo_pair.tokenizer.encode(p["prompt"]) for p in items]


# -- the constraint and its compilation -----------------------------------------------------
def test_a_bad_constraint_is_refused_with_the_compilers_message(cache):
    with pytest.raises(InvalidRequest, match="not valid JSON"):
        Constraint.json_schema("{not json")
    with pytest.raises(InvalidRequest, match="unknown constraint kind"):
        Constraint("xml", "x")
    with pytest.raises(InvalidRequest, match="regex constraint does not compile: .*parenthesis"):
        cache.compile(Constraint("regex", "(ab"))
    with pytest.raises(InvalidRequest, match='grammar constraint does not compile: .*"foo" is not defined'):
        cache.compile(Constraint("grammar", "root ::= foo"))
    with pytest.raises(InvalidRequest, match="guided_choice"):
        Constraint.choice([])


def test_a_constraint_no_token_can_start_is_refused():
    info = xgr.TokenizerInfo(["a", "b", "</s>"], stop_token_ids=[2])
    with pytest.raises(InvalidRequest, match="cannot be satisfied"):
        GrammarCache(info).compile(Constraint("regex", "c+"))
    GrammarCache(info).compile(Constraint("regex", "(ab)+"))  # the control: one it can


def test_compilations_are_cached_by_constraint(cache):
    c = Constraint("regex", "[0-9]{3}-[0-9]{4}")
    before = cache.misses
    assert cache.compile(c) is cache.compile(Constraint("regex", "[0-9]{3}-[0-9]{4}"))
    assert cache.misses == before + 1


def test_the_grammar_drafts_what_it_forces_and_masks_every_position(demo_pair, cache, target_model):
    row = ConstrainedRow(cache.compile(Constraint.json_schema(SCHEMA)), cache.vocab_size, target_model.vocab_size,
                         encode=_encode(demo_pair))
    drafts, q, allowed = row.constrain([], None, greedy=True, k_max=4)
    assert drafts == [] and allowed.shape == (1, target_model.vocab_size)  # " {" or "{": the model's choice
    row.advance(_encode(demo_pair)(" {"))  # as the pair writes it
    drafts, q, allowed = row.constrain([], None, greedy=True, k_max=4)
    assert demo_pair.tokenizer.decode(drafts) == '"name": "'  # the forced string, no model involved
    assert allowed.shape == (len(drafts) + 1, target_model.vocab_size)
    row.advance(drafts)
    model_drafts = demo_pair.tokenizer.encode('Ada", "year": 1815, ', add_special_tokens=False)
    drafts, _, allowed = row.constrain(model_drafts, None, greedy=True, k_max=len(model_drafts))
    text = demo_pair.tokenizer.decode(drafts)
    assert text.startswith('Ada", "year": 1815, "tags": [')  # the model's drafts, then the forced key
    assert all(bool(allowed[i, t]) for i, t in enumerate(drafts))
    # an illegal model draft ends the drafts at greedy (the target's mask would reject it)
    bad = demo_pair.tokenizer.encode('Ada"}', add_special_tokens=False)
    drafts, _, _ = row.constrain(bad, None, greedy=True, k_max=len(bad))
    assert len(drafts) < len(bad) and 'Ada"}'.startswith(demo_pair.tokenizer.decode(drafts))


# -- lossless under the constraint ----------------------------------------------------------
@pytest.mark.parametrize("pool,trees", [("small", False), ("ngram", False), (None, False),
                                        ("small", True), ("ngram", True)])
def test_constrained_greedy_equals_target_only_constrained_greedy(demo_pair, target_model, cache, eval_prompts, pool,
                                                                  trees):
    """Chains, and token trees (ADR 0020: pruned and masked along their paths; the control
    without the tree's masks fails for `small`)."""
    c = Constraint.json_schema(SCHEMA)
    prompts = _prompts(demo_pair, eval_prompts, 3)
    loop = _loop(demo_pair, target_model, cache, **({"tree_width": 2, "tree_always": True} if trees else {}))
    for i, ids in enumerate(prompts):
        loop.add(f"s{i}", ids, EnginePlan(GenerationParams(max_tokens=MAX_TOKENS, num_draft_tokens=4, seed=1),
                                          pool=pool, constraint=c))
    loop.run_until_idle()
    parsed = 0
    for i, ids in enumerate(prompts):
        s = loop.ended[f"s{i}"]
        assert s.generated == _reference(demo_pair, target_model, cache, ids, c, MAX_TOKENS), i
        if s.finish_reason == "eos":
            obj = json.loads(demo_pair.tokenizer.decode(s.generated, skip_special_tokens=True))
            assert set(obj) == {"name", "year", "tags"} and isinstance(obj["year"], int)
            parsed += 1
        else:
            assert s.finish_reason == "length" and len(s.generated) == MAX_TOKENS
    assert parsed >= 1  # a finished output was checked, not only truncated ones
    if trees:  # some rounds verified a tree under the constraint
        assert any(r.tree_size > 0 for i in range(len(prompts)) for r in loop.ended[f"s{i}"].rounds)


def test_forced_tokens_need_no_draft_and_cut_target_passes(demo_pair, target_model, cache, eval_prompts):
    c = Constraint.json_schema(SCHEMA)
    prompts = _prompts(demo_pair, eval_prompts, 3)
    out, passes = {}, {}
    for forced in (True, False):
        loop = _loop(demo_pair, target_model, cache, forced=forced)
        for i, ids in enumerate(prompts):
            loop.add(f"s{i}", ids, EnginePlan(GenerationParams(max_tokens=MAX_TOKENS, seed=1), constraint=c))
        loop.run_until_idle()
        out[forced] = {sid: s.generated for sid, s in loop.ended.items()}
        passes[forced] = sum(len(s.rounds) for s in loop.ended.values())
    assert out[True] == out[False]  # plain sessions: the same tokens
    tokens = sum(len(g) for g in out[True].values())
    assert passes[False] == tokens  # without: one target pass per token
    assert passes[True] <= 0.8 * tokens, (passes, tokens)  # the keys, quotes and braces came free


@pytest.mark.parametrize("pool", ["small", "ngram"])
def test_the_draft_drafts_from_its_masked_q(demo_pair, target_model, cache, eval_prompts, pool):
    """The draft side of the constraint: the model draft samples from its own masked q, the
    n-gram's drafts stop before a forbidden one. The output is the same; the drafts the target
    verifies are all legal, so more of them are accepted per drafted token."""
    c = Constraint.json_schema(SCHEMA)
    prompts = _prompts(demo_pair, eval_prompts, 3)
    got = {}
    for masked in (False, True):
        drafter = HFDrafter(demo_pair.draft) if pool == "small" else NgramDrafter(target_model.vocab_size)
        loop = _loop(demo_pair, target_model, cache, forced=False,
                     sources={pool: LocalDrafts(drafter, mask_drafts=masked)})
        for i, ids in enumerate(prompts):
            loop.add(f"s{i}", ids, EnginePlan(GenerationParams(max_tokens=MAX_TOKENS, num_draft_tokens=4, seed=1),
                                              pool=pool, constraint=c))
        loop.run_until_idle()
        rounds = [r for s in loop.ended.values() for r in s.rounds if r.k > 0]
        got[masked] = ({sid: s.generated for sid, s in loop.ended.items()}, sum(r.k for r in rounds),
                       sum(r.accepted for r in rounds))
    (free_out, free_k, free_acc), (out, k, acc) = got[False], got[True]
    print(f"{pool}: unmasked drafts {free_acc}/{free_k} accepted, masked {acc}/{k}")
    assert out == free_out
    assert acc / k > free_acc / free_k


def _first_position_counts(demo_pair, target_model, cache, ids, c, pool, n, temperature) -> np.ndarray:
    loop = _loop(demo_pair, target_model, cache)
    sampling = SamplingParams(temperature=temperature)
    opened = []
    for i in range(n):
        opened.append(loop.add(f"t{i}", ids, EnginePlan(GenerationParams(
            max_tokens=3, sampling=sampling, num_draft_tokens=3, seed=9000 + i), pool=pool, constraint=c)))
        if i % 8 == 7:  # what the loop's KV holds at max_len 512
            loop.run_until_idle()
    loop.run_until_idle()
    for f in opened:
        f.result(timeout=0)
    counts = np.zeros(target_model.vocab_size)
    for i in range(n):
        counts[loop.ended[f"t{i}"].generated[0]] += 1
    return counts


@pytest.mark.parametrize("pool", ["small", "ngram"])
def test_sampled_first_position_follows_the_masked_target_distribution(demo_pair, target_model, cache,
                                                                       eval_prompts, pool):
    # a choice whose first tokens differ: the first position is free among a few of them
    c = Constraint.choice(["red", "green", "blue", "yellow", "black", "white", "orange", "purple"])
    ids = demo_pair.tokenizer.encode("Name a colour: ")
    temperature = 1.5  # flattens the target so several legal tokens are likely enough to count
    n = 384
    counts = _first_position_counts(demo_pair, target_model, cache, ids, c, pool, n, temperature)
    matcher = xgr.GrammarMatcher(cache.compile(c))
    mask = xgr.allocate_token_bitmask(1, cache.vocab_size)
    matcher.fill_next_token_bitmask(mask)
    with torch.inference_mode():
        logits = demo_pair.target(torch.tensor([ids])).logits[0, -1].float() / temperature
    right = logits.clone()
    xgr.apply_token_bitmask_inplace(right, mask)
    legal = torch.isfinite(right)
    assert int(legal.sum()) >= 4
    assert counts[~legal.numpy()].sum() == 0  # nothing illegal was ever sampled

    def chi2_p(expected_logits: torch.Tensor) -> float:
        p = torch.softmax(expected_logits.double(), -1).numpy()
        cells = (p > 0) | (counts > 0)
        obs, exp = counts[cells], p[cells] * n
        if bool(((exp == 0) & (obs > 0)).any()):
            return 0.0  # a token this distribution never gives was sampled
        # pool the rare cells (expected < 5) into one, as the χ² approximation needs
        rare = exp < 5
        obs = np.append(obs[~rare], obs[rare].sum())
        exp = np.append(exp[~rare], exp[rare].sum())
        return float(stats.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue)

    # fixed seeds; under a correct sampler p is uniform (seed bases 1000, 5000, 9000 gave
    # n-gram 0.011, 0.365, 0.454; the model pool 0.877 at 1000, and 0.553 at 9000 once its q
    # was masked too), so p > 0.001 fails a correct
    # sampler once in a thousand. The controls show the test has
    # the power to see a wrong distribution: the same samples against the target's without the
    # mask (what a mask applied only to the draft, or only at greedy, would sample), and
    # against the masked target at T = 1 (a transform applied in the wrong order, or twice)
    p_right = chi2_p(right)
    p_unmasked = chi2_p(logits)
    p_wrong_t = chi2_p(right * temperature)
    print(f"{pool}: chi2 p (masked) {p_right:.3f}, (unmasked) {p_unmasked:.2e}, (masked, T=1) {p_wrong_t:.2e}")
    assert p_right > 0.001
    assert p_unmasked < 1e-2 and p_wrong_t < 1e-4


# -- the API's constraint, and a class's default output --------------------------------------
def test_openai_fields_name_one_constraint():
    from specserve.services.router.openai_schema import CompletionRequest

    def parse(**kw) -> Constraint | None:
        return CompletionRequest(model="m", prompt="p", **kw).constraint()

    assert parse() is None
    assert parse(response_format={"type": "json_object"}) == Constraint.json_object()
    assert parse(response_format={"type": "text"}) == Constraint.text()
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert parse(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}) \
        == Constraint.json_schema(schema)
    assert parse(guided_choice=["a", "b"]).choices() == ["a", "b"]
    with pytest.raises(InvalidRequest, match="json_schema.schema"):
        parse(response_format={"type": "json_schema", "json_schema": {"name": "x"}})
    with pytest.raises(InvalidRequest, match="name one constraint"):
        parse(guided_regex="a", response_format={"type": "json_object"})


def test_a_class_policy_names_its_default_output_and_it_survives_the_wire():
    from specserve.control.policy import Policy
    from specserve.services.router.admin import policy_from_pb, policy_to_pb

    p = Policy("extraction", output_format="json_object").validate()
    assert policy_from_pb(policy_to_pb(p)).output_format == "json_object"
    assert Policy.from_body(p.body()).output_format == "json_object"
    with pytest.raises(InvalidRequest, match="output_format must be one of text, json_object"):
        Policy("extraction", output_format="xml").validate()


def test_json_object_means_an_object(cache):
    m = xgr.GrammarMatcher(cache.compile(Constraint.json_object()))
    assert m.accept_string('{"a": [1, {"b": null}], "c": "x"}') and m.is_completed()
    assert not xgr.GrammarMatcher(cache.compile(Constraint.json_object())).accept_string("[1]")


@pytest.mark.parametrize("batched", [False, True])
@pytest.mark.parametrize("name", ["small", "ngram"])
def test_a_draft_replica_under_a_constraint_drafts_only_what_it_allows(demo_pair, demo_pair_dir, eval_prompts, name,
                                                                     batched):
    """The remote draft path (specserve/services/draft): the session's constraint comes with its link's
    open, and every block (the batched model path, the per-session path, the n-gram) is drafted
    from the masked q or cut before the first forbidden draft."""
    import asyncio

    from specserve.services.draft.server import DraftServicer
    from specserve.v1 import common_pb2, draft_pb2

    drafter = HFDrafter(demo_pair.draft) if name == "small" else NgramDrafter(1 << 31)
    servicer = DraftServicer(drafter, max_sessions=4,
                             batching=Batching(enabled=batched, kv_budget_mb=32, max_sessions=4, max_len=512),
                             tokenizer=ModelInfo(str(demo_pair_dir / "target")))
    c = Constraint.json_schema(SCHEMA)
    ids = _prompts(demo_pair, eval_prompts, 1)[0]
    grammar = servicer.grammar(c.kind, c.value, len(ids))
    # inside the object, where the pair writes the record's next key ("email") and the schema
    # wants "year"
    committed = ids + _encode(demo_pair)(' {"name": "Hana Wei", "')

    async def propose(sid: str, g) -> list[int]:
        req = draft_pb2.ProposeRequest(session_id=sid, prefix=common_pb2.Prefix(tokens=committed), k=6,
                                       sampling=common_pb2.SamplingParams(), seed=1)
        return list((await servicer.propose(req, grammar=g)).tokens)

    async def both() -> tuple[list[int], list[int]]:  # one event loop: the servicer's scheduler lives on it
        return await propose("free", None), await propose("masked", grammar)

    free, masked = asyncio.run(both())
    print(name, batched, repr(demo_pair.tokenizer.decode(free)), repr(demo_pair.tokenizer.decode(masked)))
    assert grammar.legal_prefix(committed, masked) == masked  # every draft legal
    if name == "small":
        assert grammar.legal_prefix(committed, free) != free  # the control: unmasked, it drafts a forbidden key
        assert demo_pair.tokenizer.decode(masked).startswith("year")
    else:
        assert masked == grammar.legal_prefix(committed, free) and len(masked) < len(free)  # its drafts, cut


@pytest.mark.parametrize("pool", ["small", "ngram"])
def test_sampled_outputs_under_a_grammar_and_a_regex_match_them(demo_pair, target_model, cache, pool):
    """At T > 0 with speculation, every finished output matches its EBNF grammar or regex."""
    import re

    grammar = Constraint("grammar", 'root ::= "colour: " colour (", " colour)* "."\n'
                                    'colour ::= "red" | "green" | "blue" | "light " colour')
    regex = Constraint("regex", r"[A-Z][a-z]{2,8} [0-9]{1,3}")
    loop = _loop(demo_pair, target_model, cache)
    ids = demo_pair.tokenizer.encode("Extract the record as JSON.\nText: name: Ada\n")
    for i in range(8):
        for c in (grammar, regex):
            loop.add(f"{c.kind}{i}", ids, EnginePlan(GenerationParams(
                max_tokens=40, sampling=SamplingParams(temperature=0.9), num_draft_tokens=4, seed=50 + i),
                pool=pool, constraint=c))
    loop.run_until_idle()
    finished = 0
    for sid, s in loop.ended.items():
        text = demo_pair.tokenizer.decode(s.generated, skip_special_tokens=True)
        c = grammar if sid.startswith("grammar") else regex
        m = xgr.GrammarMatcher(cache.compile(c))
        assert m.accept_string(text), text  # cut at max_tokens or not, a prefix of a match
        if s.finish_reason == "length":
            assert len(s.generated) == 40
            continue
        finished += 1
        assert m.is_completed(), text
        pattern = r"colour: (light )*(red|green|blue)(, (light )*(red|green|blue))*\." if c is grammar \
            else r"[A-Z][a-z]{2,8} [0-9]{1,3}"
        assert re.fullmatch(pattern, text), text
    assert finished >= 4  # finished outputs were checked, not only cut ones (6 of 16 end on their own)


# -- token trees under a constraint (ADR 0020) --------------------------------------------
def test_a_trees_nodes_are_pruned_and_masked_along_their_own_paths(demo_pair, cache, target_model):
    """After '{"name": "Ada", "year": ' the schema wants an integer: a branch of digits is
    kept with each node's mask the chain's mask along it, a branch of letters is dropped with
    its subtree; where the grammar forces the next token the tree gives way to the chain."""
    encode = _encode(demo_pair)
    row = ConstrainedRow(cache.compile(Constraint.json_schema(SCHEMA)), cache.vocab_size, target_model.vocab_size,
                         encode=encode)
    row.advance(encode(" {"))
    assert row.constrain_tree(encode('"name'), [-1, 0][:len(encode('"name'))]) is None  # '"name": "' is forced
    row.advance(encode('"name": "Ada", "year": '))
    digits, letters = encode("1815,"), encode("abc")
    tokens = [*digits, *letters]
    parents = [-1, *range(len(digits) - 1), -1, *range(len(digits), len(tokens) - 1)]
    kept, kept_parents, allowed = row.constrain_tree(tokens, parents)
    chain, _, chain_allowed = row.constrain(digits, None, greedy=True, k_max=len(digits))
    # (the chain goes on with what the grammar forces after them: its first positions are the branch's)
    assert kept == chain[:len(digits)] == digits and kept_parents == list(range(-1, len(digits) - 1))
    assert torch.equal(allowed, chain_allowed[:len(digits) + 1])
    assert not bool(allowed[0, letters[0]])  # the dropped branch's first token is illegal at the root
    # the matcher is where it was: the same tree again gives the same answer
    assert row.constrain_tree(tokens, parents)[0] == kept
