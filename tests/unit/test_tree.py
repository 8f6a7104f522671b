"""Token trees (issue 40, ADR 0020): verification of a branching block in one target pass.

1. The algorithm (algorithm/tree.py), on synthetic logits: a chain-shaped tree gets exactly
   the verdicts `rejection_judge` gives the chain with a one-hot q (same uniforms); at T = 0 the
   walk follows the target's argmax; sampled, the first and second emitted tokens follow the
   target's distributions (chi-squared, fixed seeds), and a control walker that keeps a later
   sibling with its unconditional probability fails the same test.
2. Through the target's model step: tree rows (eager and device step) keep only the accepted
   path's KV, compacted after the prefix, so greedy decoding with trees whose greedy token is
   the second sibling equals target-only greedy; a chain given as a tree gives the chain's
   verdicts, sampled.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from scipy.stats import chi2

from specserve.algorithm import tree as tree_module
from specserve.algorithm.rejection import DenseQ, StepUniforms, rejection_judge
from specserve.algorithm.rng import Purpose, uniform
from specserve.algorithm.sampling import draw, logits_to_probs
from specserve.algorithm.tree import Tree, draw_siblings, tree_judge_on_device, walk
from specserve.models.verifier import TargetModel
from specserve.params import SamplingParams
from specserve.step import Step, StepRow
from specserve.worker.model_step import Batching, make_target_step

V = 12


def _logits(seed: int, rows: int) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * 1.5


def _verdict(logits, tokens, tree, sampling, seed, start):
    host = tree_judge_on_device(logits, tokens, tree, sampling, seed, start).numpy()
    return walk(host, tokens, tree, sampling, seed, start)


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.3])
def test_a_chain_tree_is_judged_as_the_chain(temperature):
    sampling = SamplingParams(temperature=temperature)
    k = 3
    for seed in range(200):
        logits = _logits(seed, k + 1)
        drafts = [int(t) for t in torch.randint(0, V, (k,), generator=torch.Generator().manual_seed(1000 + seed))]
        if seed % 3 == 0:  # some blocks the target agrees with
            drafts = [int(t) for t in logits[:k].argmax(-1)]
        verdict, path = _verdict(logits, drafts, Tree.chain(k), sampling, seed, 40)
        p = logits_to_probs(logits, sampling)[None]
        judged = rejection_judge(p, torch.tensor([drafts]), torch.tensor([k]), None,
                                 StepUniforms.draw(np.array([seed], dtype=np.uint64), np.array([40]), k))
        assert verdict.num_accepted == int(judged.num_accepted[0]) and verdict.tokens[-1] == int(judged.final[0]), seed
        assert path == list(range(verdict.num_accepted))


def test_at_t0_the_walk_follows_the_targets_argmax():
    # root: children a (wrong) and b (the argmax); b's children: c (the argmax there) and d
    logits = _logits(3, 5)
    top = logits.argmax(-1).tolist()  # per node: root, a, b, c, d
    a = (top[0] + 1) % V
    tokens = [a, top[0], (top[2] + 2) % V, top[2]]  # a, b, d(wrong), c(right) as b's second child
    tree = Tree((-1, -1, 1, 1))
    verdict, path = _verdict(logits, tokens, tree, SamplingParams(), 0, 10)
    assert path == [1, 3] and verdict.tokens == [top[0], top[2], top[4]] and verdict.rejected_position is None


class _Wrong:
    """The control: a walker that keeps the j-th sibling with its unconditional probability
    p(c_j), not renormalised by the siblings tried before it (it under-keeps later siblings)."""

    def __init__(self) -> None:
        self.original = tree_module.uniform_for

    def __enter__(self):
        orig = self.original

        def biased(seed, position, sibling):
            u = orig(seed, position, sibling)
            return u if sibling == 0 else min(1.0, u * 1.8)  # a later sibling's coin, skewed up

        tree_module.uniform_for = biased
        return self

    def __exit__(self, *exc):
        tree_module.uniform_for = self.original


def _chi2(counts: np.ndarray, p: np.ndarray) -> tuple[float, float]:
    n = counts.sum()
    keep = p * n >= 5
    obs = np.append(counts[keep], counts[~keep].sum())
    exp = np.append(p[keep] * n, p[~keep].sum() * n)
    if exp[-1] < 5:  # fold a tiny remainder into the largest bin
        obs[np.argmax(exp[:-1])] += obs[-1]
        exp[np.argmax(exp[:-1])] += exp[-1]
        obs, exp = obs[:-1], exp[:-1]
    return float(((obs - exp) ** 2 / exp).sum()), float(chi2.ppf(0.999, len(exp) - 1))


def _draws(n: int, wrong: bool = False):
    """n walks of one tree: the root's two likeliest tokens as candidates, each with the two
    likeliest at its own position as children (synthetic logits, fixed)."""
    sampling = SamplingParams(temperature=1.0)
    logits = _logits(7, 7)
    p = torch.softmax(logits.double(), -1).numpy()
    r1, r2 = np.argsort(-p[0])[:2].tolist()
    a1, a2 = np.argsort(-p[1])[:2].tolist()
    b1, b2 = np.argsort(-p[2])[:2].tolist()
    tokens = [r1, r2, a1, a2, b1, b2]
    tree = Tree((-1, -1, 0, 0, 1, 1))
    firsts, seconds = np.zeros(V), {r1: np.zeros(V), r2: np.zeros(V)}
    ctx = _Wrong() if wrong else None
    if ctx:
        ctx.__enter__()
    try:
        for seed in range(n):
            v, _ = _verdict(logits, tokens, tree, sampling, seed, 100)
            firsts[v.tokens[0]] += 1
            if v.tokens[0] in seconds and len(v.tokens) > 1:
                seconds[v.tokens[0]][v.tokens[1]] += 1
    finally:
        if ctx:
            ctx.__exit__()
    return p, (r1, r2), firsts, seconds


def test_sampled_trees_emit_the_targets_distribution_at_the_first_and_second_positions():
    """4000 walks (seeds 0..3999); p < 0.001 fails (chi-squared, bins of expected count >= 5).
    Second position: given the first emitted token was the root's candidate a (or b), the next
    token follows the target's distribution at a's node (b's)."""
    p, (r1, r2), firsts, seconds = _draws(4000)
    stat, limit = _chi2(firsts, p[0])
    assert stat < limit, (stat, limit)
    for tok, node in ((r1, 1), (r2, 2)):
        assert seconds[tok].sum() > 300
        stat, limit = _chi2(seconds[tok], p[node])
        assert stat < limit, (tok, stat, limit)
    # the control keeps the root's second candidate too rarely: the first position fails
    p, _, firsts, _ = _draws(4000, wrong=True)
    stat, limit = _chi2(firsts, p[0])
    assert stat > limit, (stat, limit)


# ---- sampled trees with the drafter's q (recursive rejection sampling without replacement) ----


def _q(seed: int, rows: int) -> torch.Tensor:
    """A drafter's distributions: near the target's (its logits plus noise), never equal."""
    return torch.softmax(_logits(seed, rows) + torch.randn(rows, V, generator=torch.Generator().manual_seed(
        seed + 1)), -1)


@pytest.mark.parametrize("temperature", [0.7, 1.3])
def test_a_chain_tree_with_q_is_judged_as_the_chain_with_that_q(temperature):
    sampling = SamplingParams(temperature=temperature)
    k = 3
    for seed in range(200):
        logits = _logits(seed, k + 1)
        q = _q(500 + seed, k)
        drafts = [int(draw(q[i:i + 1], torch.tensor(uniform(seed, [40 + i], Purpose.DRAFT)))[0]) for i in range(k)]
        host = tree_judge_on_device(logits, drafts, Tree.chain(k), sampling, seed, 40, q=DenseQ(q)).numpy()
        verdict, path = walk(host, drafts, Tree.chain(k), sampling, seed, 40, with_q=True)
        p = logits_to_probs(logits, sampling)[None]
        judged = rejection_judge(p, torch.tensor([drafts]), torch.tensor([k]), q[None],
                                 StepUniforms.draw(np.array([seed], dtype=np.uint64), np.array([40]), k))
        assert verdict.num_accepted == int(judged.num_accepted[0]) and verdict.tokens[-1] == int(judged.final[0]), seed
        assert path == list(range(verdict.num_accepted))


def _q_draws(n: int, top2: bool = False):
    """n walks of a sampled tree with q: per seed, the root's two candidates drawn without
    replacement from the drafter's q0 (`draw_siblings`; `top2`: the control, q0's two likeliest
    judged as if drawn), each with one child drawn from its own q row; the target's
    distributions fixed (synthetic) per node."""
    sampling = SamplingParams(temperature=1.0)
    logits = _logits(11, 5)  # root, r1, r2, a, b
    qs = _q(12, 3)  # the drafter at the root, under r1, under r2
    p = torch.softmax(logits.double(), -1).numpy()
    tree = Tree((-1, -1, 0, 1))
    firsts, seconds = np.zeros(V), {}
    for seed in range(n):
        first = int(draw(qs[0:1], torch.tensor(uniform(seed, [100], Purpose.DRAFT)))[0])
        roots = qs[0].topk(2).indices.tolist() if top2 else draw_siblings(qs[0], 2, seed, 100, first)
        under = [int(draw(qs[i + 1:i + 2], torch.tensor(uniform(seed, [101], Purpose.DRAFT)))[0]) for i in range(2)]
        tokens = [roots[0], roots[1], under[0], under[1]]
        q = DenseQ(torch.stack([qs[0], qs[0], qs[1], qs[2]]))
        host = tree_judge_on_device(logits, tokens, tree, sampling, seed, 100, q=q).numpy()
        v, path = walk(host, tokens, tree, sampling, seed, 100, with_q=True)
        firsts[v.tokens[0]] += 1
        if path and len(v.tokens) > 1:  # the first token was a candidate: the next follows its node's p
            seconds.setdefault(path[0], np.zeros(V))[v.tokens[1]] += 1
    return p, firsts, seconds


def test_sampled_trees_with_q_emit_the_targets_distribution_at_the_first_and_second_positions():
    """As the one-hot test: 4000 walks, p < 0.001 fails. The candidates are random here (drawn
    from q with each seed), and each is accepted with min(1, p_j / q_j). The control draws
    the root's candidates as q's two likeliest, not from q, and judges them with q: the first
    position fails."""
    p, firsts, seconds = _q_draws(4000)
    stat, limit = _chi2(firsts, p[0])
    assert stat < limit, (stat, limit)
    for node in (0, 1):  # first emitted = the root's first (second) candidate: the next follows p at it
        assert seconds[node].sum() > 300
        stat, limit = _chi2(seconds[node], p[node + 1])
        assert stat < limit, (node, stat, limit)
    p, firsts, _ = _q_draws(4000, top2=True)
    stat, limit = _chi2(firsts, p[0])
    assert stat > limit, (stat, limit)


def test_siblings_are_drawn_without_replacement_from_q():
    q = torch.tensor([0.5, 0.3, 0.2, 0.0])
    counts = np.zeros((4, 4))
    for seed in range(3000):
        first = int(draw(q[None], torch.tensor(uniform(seed, [7], Purpose.DRAFT)))[0])
        a, b = draw_siblings(q, 2, seed, 7, first)
        counts[a, b] += 1
    assert counts.diagonal().sum() == 0 and counts[3].sum() == counts[:, 3].sum() == 0
    # P(b | a) = q(b) / (1 - q(a)): e.g. after 0, 1 with 0.6 and 2 with 0.4
    assert abs(counts[0, 1] / counts[0].sum() - 0.6) < 0.05 and abs(counts[1, 0] / counts[1].sum() - 0.5 / 0.7) < 0.05
    assert draw_siblings(torch.tensor([1.0, 0.0, 0.0]), 3, 0, 7, 0) == [0]  # q's support is one token


# ---- through the target's model step ----------------------------------------------------------


def _top2(model, ids: list[int]) -> tuple[int, int]:
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
    a, b = logits.topk(2).indices.tolist()
    return a, b


@pytest.mark.parametrize("fixed", [False, True], ids=["eager", "device-step"])
def test_greedy_decoding_with_trees_equals_target_only(demo_pair, fixed):
    """Each round: a tree whose root's first candidate is the target's runner-up and second its
    argmax, the argmax with a 2-token chain under it: the accepted path is the second branch,
    its KV moved to follow the prefix; the next rounds read it. 12 rounds."""
    target = demo_pair.target
    model = make_target_step(TargetModel(target), Batching(max_sessions=2, max_len=256, tile=None if fixed else 4,
                                                           fixed_step=fixed))
    prompt = demo_pair.tokenizer.encode("def add(a, b):\n    return")
    with torch.inference_mode():
        ref = target.generate(torch.tensor([prompt]), max_new_tokens=60, do_sample=False)[0, len(prompt):].tolist()
    slot = model.open("s")
    ids = list(prompt)
    res = model.step(Step([StepRow.verify(slot, ids, [], None, SamplingParams(), 0)])).rows[0]
    ids += res.verdict.tokens
    moved = 0
    for _ in range(12):
        g = len(ids) - len(prompt)
        second, first = ref[g], _top2(target, ids)[1]  # first candidate: the runner-up (rejected)
        drafts = [first, second, ref[g + 1], ref[g + 2]]
        row = StepRow.verify(slot, ids, drafts, None, SamplingParams(), 0)
        row.parents = [-1, -1, 1, 2]
        res = model.step(Step([row])).rows[0]
        assert res.error is None, res.error
        moved += res.verdict.num_accepted
        ids += res.verdict.tokens
        assert res.cached_len == len(ids) - 1 == model.runner.length(slot)
    assert ids[len(prompt):] == ref[:len(ids) - len(prompt)]
    assert moved >= 24  # every round accepted the second branch (3 tokens) or most of it


def test_a_chain_given_as_a_tree_gets_the_chains_verdicts_through_the_target(demo_pair):
    sampling = SamplingParams(temperature=0.9)
    model = make_target_step(TargetModel(demo_pair.target), Batching(max_sessions=4, max_len=256))
    prompt = demo_pair.tokenizer.encode("class Stack:\n    def")
    a, b = model.open("a"), model.open("b")
    for seed in range(8):
        drafts = [(seed * 13 + j * 7) % 4096 for j in range(3)]
        if seed % 2:
            drafts[0] = _top2(demo_pair.target, prompt)[0]
        chain = StepRow.verify(a, prompt, drafts, None, sampling, seed)
        as_tree = StepRow.verify(b, prompt, drafts, None, sampling, seed)
        as_tree.parents = [-1, 0, 1]
        ra, rb = model.step(Step([chain, as_tree])).rows
        assert (ra.verdict.num_accepted, ra.verdict.tokens) == (rb.verdict.num_accepted, rb.verdict.tokens), seed
        for slot in (a, b):
            model.runner.rollback(slot, len(prompt) - 1)


@pytest.mark.parametrize("pool", ["small", "ngram"])
def test_local_small_and_ngram_pools_propose_trees_and_stay_lossless(demo_pair, pool):
    """tree_width 2 at one session: `small` branches where it is unsure of the next token, the
    n-gram drafter where the suffix matches with two different continuations; greedy output
    equals target-only greedy, and some rounds verified a tree."""
    from specserve.algorithm.stops import StopChecker
    from specserve.drafters.hf import HFDrafter
    from specserve.drafters.ngram import NgramDrafter
    from specserve.engine.drafting import LocalDrafts
    from specserve.engine.loop import EngineLoop
    from specserve.engine.session import EnginePlan
    from specserve.engine.speculation import SpeculationSettings
    from specserve.params import GenerationParams

    drafter = HFDrafter(demo_pair.draft) if pool == "small" else NgramDrafter(demo_pair.target.config.vocab_size)
    model = make_target_step(TargetModel(demo_pair.target), Batching(max_sessions=2, max_len=512))
    stops = lambda params: StopChecker(frozenset(), params.stop, lambda ids: "")  # noqa: E731
    loop = EngineLoop(model, stops, {pool: LocalDrafts(drafter)},
                      speculation=SpeculationSettings(tree_width=2, tree_always=True))
    # (n-gram: after "x =" the prompt has " 1" once and " 3" once: two continuations)
    text = "x = 1\ny = 2\nx = 3\ny = 4\nx =" if pool == "ngram" else "class Stack:\n    def push(self, item):\n"
    prompt = demo_pair.tokenizer.encode(text)
    loop.add("s", prompt, EnginePlan(GenerationParams(max_tokens=40, num_draft_tokens=3, seed=1), pool=pool))
    loop.run_until_idle()
    got = loop.ended["s"]
    assert any(r.tree_size > 0 for r in got.rounds), [r.tree_size for r in got.rounds]
    with torch.inference_mode():
        ref = demo_pair.target.generate(torch.tensor([prompt]), max_new_tokens=40, do_sample=False)
    assert got.generated == ref[0, len(prompt):].tolist()[:len(got.generated)]


def test_ngram_branches_are_the_latest_matches_with_distinct_next_tokens():
    from specserve.drafters.ngram import NgramDrafter

    seq = [1, 2, 3, 9, 1, 2, 4, 8, 1, 2, 3, 7, 1, 2]  # "1 2" followed by 3, 4, 3 (latest first)
    s = NgramDrafter(50).start()
    found = s.propose_tree(seq, 2, SamplingParams(), 0, 2)
    tokens, parents = found.tokens, found.parents
    assert tokens == [3, 7, 4, 8] and parents == [-1, 0, -1, 2]
    assert s.propose_tree([5, 6, 5, 6, 5], 2, SamplingParams(), 0, 2) is None  # one continuation: a chain


def test_a_late_tree_is_used_below_the_path_a_plain_round_committed():
    """A tree drafted for prefix P, late: a plain round committed token t meanwhile. Where t is
    one of its first candidates the tree below it still drafts P + t (re-rooted there); where
    it is none of them the tree is stale. (On the old code any tree past its prefix was
    dropped, where a chain in the same place is kept: trees ran late more often.)"""
    from specserve.algorithm.stops import StopChecker
    from specserve.engine.scheduler import Budget, schedule
    from specserve.engine.session import DraftBlock, EnginePlan, EngineSession
    from specserve.params import GenerationParams
    from specserve.step import reparented, subtree_nodes

    assert subtree_nodes([5, 6, 7], [-1, 0, -1], [5]) == [1] and reparented([-1, 0, -1], [1]) == [-1]
    assert subtree_nodes([5, 6, 7, 8], [-1, 0, -1, 2], []) == [0, 1, 2, 3]
    assert reparented([-1, 0, -1, 2], [0, 1, 2, 3]) == [-1, 0, -1, 2]
    assert subtree_nodes([5, 6, 7, 8], [-1, 0, -1, 2], [7]) == [3] and reparented([-1, 0, -1, 2], [3]) == [-1]
    assert subtree_nodes([5, 6, 7, 8], [-1, 0, -1, 2], [9]) is None
    plan = EnginePlan(GenerationParams(max_tokens=20, num_draft_tokens=3, seed=1), pool="p")
    s = EngineSession.new("s", [1, 2, 3], plan, StopChecker(frozenset(), (), lambda ids: ""))
    s.cached = 3
    tree = DraftBlock("s", 3, s.committed.hash_at(3), (5, 6, 7, 8, 9, 10), parents=(-1, 0, 1, -1, 3, 4))
    s.committed.extend([8])  # a plain round emitted the second first candidate
    assert s.usable(tree) == 1
    s.block = tree
    plan_rows = schedule([s], 0.0, Budget(), lambda s: 1.0, lambda s: True, lambda s: False)
    row = plan_rows.rows[0]
    assert row.tree == ([9, 10], [-1, 0], None) and row.tokens == 1 + 2
    # a sampled tree's q rows go with its nodes
    q = DenseQ(torch.arange(6, dtype=torch.float32)[:, None].expand(6, 4).contiguous())
    s.block = DraftBlock("s", 3, s.committed.hash_at(3), tree.tokens, q, parents=tree.parents)
    row = schedule([s], 0.0, Budget(), lambda s: 1.0, lambda s: True, lambda s: False).rows[0]
    assert row.tree[:2] == ([9, 10], [-1, 0]) and row.tree[2].probs[:, 0].tolist() == [4.0, 5.0]
    s.committed.crop(3)
    s.committed.extend([4])  # none of them
    assert s.usable(tree) is None


def test_a_sampled_tree_from_small_is_its_chain_plus_siblings_drawn_from_q(demo_pair):
    """Sampled, the draft model's tree's first branch is exactly the chain it drafts with the
    same seed (the same draws at the same positions), with the chain's q rows; the second
    first candidate differs from the first and carries the first's q row (drawn from it)."""
    from specserve.algorithm.rejection import q_to_dense
    from specserve.drafters.hf import HFDrafter

    drafter = HFDrafter(demo_pair.draft)
    prompt = demo_pair.tokenizer.encode("def push(self, item):\n    ")
    sampling = SamplingParams(temperature=1.0)
    trees = 0
    for seed in range(6):
        chain = drafter.start().propose(prompt, 3, sampling, seed)
        found = drafter.start().propose_tree(prompt, 3, sampling, seed, 2)
        if found is None:
            continue
        trees += 1
        assert found.parents == [-1, 0, 1, -1, 3, 4]
        assert found.tokens[:3] == chain.tokens and found.tokens[3] != found.tokens[0]
        V = demo_pair.draft.config.vocab_size
        tree_q = q_to_dense(found.q, torch.tensor(found.tokens), V)
        assert torch.equal(tree_q[:3], q_to_dense(chain.q, torch.tensor(chain.tokens), V))
        assert torch.equal(tree_q[3], tree_q[0]) and float(tree_q[0, found.tokens[3]]) > 0
    assert trees >= 3, trees


def test_sampled_sessions_verify_trees_and_a_seeded_ones_tokens_are_plain_decodings(demo_pair):
    """The engine offers trees (tree_width 2) to every sampled session: to one without a seed
    of its own drawn from the draft's q and judged with it; to a seeded one too, judged by the
    coupled sampler (ADR 0027), so its tokens are those of plain decoding with its seed, tree
    or chain. (Before, a seeded session was given chains: a tree's coins differ from a chain's.)"""
    from specserve.algorithm.stops import StopChecker
    from specserve.drafters.hf import HFDrafter
    from specserve.engine.drafting import LocalDrafts
    from specserve.engine.loop import EngineLoop
    from specserve.engine.session import EnginePlan
    from specserve.engine.speculation import SpeculationSettings
    from specserve.params import GenerationParams

    model = make_target_step(TargetModel(demo_pair.target), Batching(max_sessions=3, max_len=512))
    verified: list[StepRow] = []
    step = model.step

    def spy(s: Step):
        verified.extend(r for r in s.rows if r.parents is not None)
        return step(s)

    model.step = spy  # type: ignore[method-assign]
    stops = lambda params: StopChecker(frozenset(), params.stop, lambda ids: "")  # noqa: E731
    loop = EngineLoop(model, stops, {"small": LocalDrafts(HFDrafter(demo_pair.draft))},
                      speculation=SpeculationSettings(tree_width=2, tree_always=True))
    prompt = demo_pair.tokenizer.encode("class Stack:\n    def push(self, item):\n")
    params = GenerationParams(max_tokens=40, num_draft_tokens=3, seed=5, sampling=SamplingParams(temperature=0.9))
    loop.add("free", prompt, EnginePlan(params, pool="small", seeded=False))
    loop.add("seeded", prompt, EnginePlan(params, pool="small", seeded=True))
    loop.add("plain", prompt, EnginePlan(params, pool=None, seeded=True))
    loop.run_until_idle()
    free, seeded, plain = loop.ended["free"], loop.ended["seeded"], loop.ended["plain"]
    assert len(free.generated) == len(seeded.generated) == 40
    assert any(r.tree_size > 0 for r in free.rounds) and any(r.tree_size > 0 for r in seeded.rounds)
    assert sum(r.accepted for r in seeded.rounds if r.tree_size > 0) > 0  # trees that settled tokens
    assert seeded.generated == plain.generated
    assert verified and all(r.q is not None for r in verified)
    # a per-session target (batching off) judges rows as chains only: it is never given a tree
    # (a sampled tree judged as a flattened chain would not be exact)
    per_session = make_target_step(TargetModel(demo_pair.target), Batching(enabled=False))
    loop = EngineLoop(per_session, stops, {"small": LocalDrafts(HFDrafter(demo_pair.draft))},
                      speculation=SpeculationSettings(tree_width=2, tree_always=True))
    loop.add("free", prompt, EnginePlan(replace(params, max_tokens=12), pool="small", seeded=False))
    loop.run_until_idle()
    assert loop.ended["free"].rounds and not any(r.tree_size > 0 for r in loop.ended["free"].rounds)


def test_a_remote_replicas_sampled_tree_carries_each_nodes_q_row():
    """A draft-model replica's sampled tree (services/draft/server.py): its chain, a second
    first candidate drawn from the chain's first q row without the chain's first token, then
    that candidate's own block; the tree's q rows follow its tokens (the chain's, the first
    row again, the second block's), sparse as the blocks were."""
    from specserve.algorithm.rejection import SparseQ, q_to_dense
    from specserve.drafters.base import DraftProposal
    from specserve.services.draft.server import _second_draw, _tree_q

    ids = torch.tensor([[3, 5, 0], [1, 2, 0]])
    first = DraftProposal([3, 1], SparseQ(ids, torch.tensor([[0.5, 0.3, 0.2], [0.9, 0.1, 0.0]])))
    rest = DraftProposal([2], SparseQ(torch.tensor([[2, 4, 6]]), torch.tensor([[0.6, 0.4, 0.0]])))
    seconds = {_second_draw(first, seed, 10, V) for seed in range(200)}
    assert seconds == {5, 0}  # q's other tokens, never the chain's own first (3)
    q = _tree_q(first, rest, V)
    dense = q_to_dense(q, torch.tensor([3, 1, 5, 2]), V)
    assert torch.equal(dense[2], dense[0]) and dense[3, 2] == pytest.approx(0.6) and dense[1, 1] == pytest.approx(0.9)
    # whatever the second block's q looks like, the tree keeps a q row for every node (a tree
    # offered only for some second draws would bias them): narrower sparse rows padded, mixed
    # forms made dense
    narrow = DraftProposal([2], SparseQ(torch.tensor([[2, 4]]), torch.tensor([[0.6, 0.4]])))
    dense_rest = DraftProposal([2], DenseQ(torch.softmax(torch.zeros(1, V), -1)))
    for other in (narrow, dense_rest):
        got = q_to_dense(_tree_q(first, other, V), torch.tensor([3, 1, 5, 2]), V)
        assert torch.equal(got[:3], dense[:3]) and got[3].sum() == pytest.approx(1.0)
    assert _second_draw(DraftProposal([3], SparseQ(torch.tensor([[3, 0]]), torch.tensor([[1.0, 0.0]]))), 0, 10, V) \
        is None  # q held one token
