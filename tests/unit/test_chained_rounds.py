"""Speculative rounds on the device (ADR 0025): the target's own EAGLE head inside the device
step's round (its drafts, the verify, the verdict and the head fed the accepted features, in
one run), and rounds chained on the device with the host one round behind.

1. The device's uniforms equal the host's counter-based stream bit for bit.
2. The head on the device drafts exactly what the host's head (drafters/eagle.py) drafts for
   the same committed prefix.
3. Exactness: rounds drafted on the device, host-driven (synchronous) and chained, give the
   target's own greedy tokens; through the engine loop, chained rounds give exactly the
   host-driven rounds' tokens while every way a round launched ahead is thrown away happens
   (a session's budget reached and a stop string inside a round, a cancel, a late block, a
   sampled session joining), with the rounds taken and thrown away counted.
4. The graph-safety audit on the fake CUDA device: over three chained rounds (advance, the
   head's K positions, verify, verdict, the head's feed) the same ops on the same buffers, no
   host copy or read; the same audit fails on the synchronous round (the host's drafts copied
   in at every round).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from fakedevice import OpTrace, audit_runs, fake_cuda, storages
from test_device_audit import ARCHITECTURES
from torch._subclasses.fake_tensor import unset_fake_temporarily

import specserve.device as device_module
from specserve.algorithm.rng import Purpose, signed64, uniform, uniform_on_device
from specserve.algorithm.stops import StopChecker
from specserve.algorithm.tree import Tree
from specserve.drafters.eagle import EagleConfig, EagleHead, EagleSession, TargetParts, load_head
from specserve.drafters.ngram import NgramDrafter
from specserve.engine.drafting import LocalDrafts
from specserve.engine.eagle_local import DeviceHeadDrafts
from specserve.engine.loop import EngineLoop
from specserve.engine.session import EnginePlan
from specserve.engine.speculation import SpeculationSettings
from specserve.models.runner import ModelRunner, Row
from specserve.models.step_buckets import Bucket
from specserve.models.verifier import TargetModel
from specserve.params import GenerationParams, SamplingParams
from specserve.step import Step, StepRow, head_tree
from specserve.worker.model_step import BatchedTarget, Batching

GREEDY = SamplingParams()
PROMPTS = ["def parse(self, text):\n", "Extract the record as JSON. Name: Ann, age 3", "Hello, how are"]


def test_the_devices_uniforms_are_the_host_stream_bit_for_bit():
    rng = np.random.default_rng(0)
    positions = rng.integers(0, 2**40, size=64).tolist() + [0, 1, 2**62]
    for purpose in Purpose:
        for seed in (0, 7, 2**63 - 1, 2**63, 2**64 - 1):
            got = uniform_on_device(torch.tensor(signed64(seed)), torch.tensor(positions), purpose).numpy()
            assert np.array_equal(got, uniform(seed, positions, purpose)), (seed, purpose)


@pytest.fixture(scope="module")
def head(demo_pair_dir) -> EagleHead:
    return load_head(demo_pair_dir / "eagle")


def _target(demo_pair, head: EagleHead, lookahead: bool) -> BatchedTarget:
    t = BatchedTarget(TargetModel(demo_pair.target), Batching(kv_budget_mb=64, max_sessions=6, max_len=256,
                                                              prefill_chunk=16, device="cpu", dtype="fp32",
                                                              fixed_step=True, max_batch=6, lookahead=lookahead))
    t.enable_head(head)
    return t


def _head_row(slot, ids: list[int], k: int, width: int = 1, sampling: SamplingParams = GREEDY,
              seed: int = 0) -> StepRow:
    row = StepRow.verify(slot, ids, [], None, sampling, seed)
    row.head, row.k = True, k
    if width > 1:
        row.parents = head_tree(width, k)
    return row


def _rounds(t: BatchedTarget, prompts: list[list[int]], n: int | list[int], k: int | list[int] = 4,
            width: int = 1, sampling: SamplingParams = GREEDY) -> tuple[list[list[int]], list]:
    """Every session's next n tokens (or n[i] for session i), each round drafted on the
    target's head (K = k, or k[i]; a tree of `width` first candidates where > 1; session i
    sampled with seed 100 + i where `sampling` is); and each round's (drafted, accepted)."""
    ns = n if isinstance(n, list) else [n] * len(prompts)
    ks = k if isinstance(k, list) else [k] * len(prompts)
    seqs = [[t.open(str(i)), list(p), i] for i, p in enumerate(prompts)]
    rounds = []
    while live := [s for s, p, m in zip(seqs, prompts, ns, strict=True) if len(s[1]) - len(p) < m]:
        step = Step([_head_row(s[0], s[1], ks[s[2]], width, sampling, 100 + s[2]) for s in live])
        for s, res in zip(live, t.step(step).rows, strict=True):
            assert res.error is None, res.error
            if not res.again:
                s[1] = s[1] + res.verdict.tokens
                rounds.append((list(res.drafted or []), res.verdict.num_accepted))
    return [s[1][len(p):len(p) + m] for s, p, m in zip(seqs, prompts, ns, strict=True)], rounds


def _plain(demo_pair, prompts: list[list[int]], n: int) -> list[list[int]]:
    with torch.inference_mode():
        return [demo_pair.target.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False)[0, len(p):].tolist()
                for p in prompts]


def _drafts_as_on_the_host(t: BatchedTarget, head: EagleHead, parts: TargetParts, slot, ids: list[int], rounds: int,
                           sampling: SamplingParams = GREEDY, seed: int = 0) -> tuple[list[int], int]:
    """`rounds` rounds of K 4 on the device's head, each one's drafts checked against the host
    head's for the same committed prefix; the ids after them and the rounds compared."""
    compared = 0
    for _ in range(rounds):
        res = t.step(Step([_head_row(slot, ids, 4, sampling=sampling, seed=seed)])).rows[0]
        if res.drafted:
            host = EagleSession(head, parts)
            host.add_features(0, parts.features(torch.tensor([ids]))[0][0])
            assert host.draft(ids, 4, sampling, seed)[0] == res.drafted
            compared += 1
        ids = ids + res.verdict.tokens
    return ids, compared


def test_the_head_on_the_device_drafts_what_the_hosts_head_drafts(demo_pair, head, one_thread):
    t = _target(demo_pair, head, lookahead=False)
    parts = TargetParts(demo_pair.target, head.cfg.feature_layers)
    slot = t.open("s")
    ids, compared = _drafts_as_on_the_host(t, head, parts, slot, demo_pair.tokenizer.encode(PROMPTS[0]), 9)
    assert compared == 8  # every round after the prompt's (the head is current from then on)
    trees = 0
    for _ in range(6):  # trees of two first candidates: the host's head's, where it drafts a tree
        res = t.step(Step([_head_row(slot, ids, 3, width=2)])).rows[0]
        host = EagleSession(head, parts)
        host.add_features(0, parts.features(torch.tensor([ids]))[0][0])
        tokens, _, parents = host.draft(ids, 3, GREEDY, 0, width=2)
        if parents is not None:  # (the host's head drafts a chain where it is sure of the first token)
            assert (tokens, parents) == (res.drafted, head_tree(2, 3))
            trees += 1
        ids = ids + res.verdict.tokens
    assert trees >= 2


def test_trees_drafted_on_the_device_give_the_targets_greedy_tokens_and_more_of_them_a_round(demo_pair, head,
                                                                                             one_thread):
    """Trees of two first candidates, each with its chain to K = 4 (the head's one shape),
    drafted and judged inside the round, synchronous and chained: the target's own tokens,
    and more accepted a round than the chains (0.94 to 1.19 on these prompts)."""
    prompts = [demo_pair.tokenizer.encode(p) for p in PROMPTS]
    want = _plain(demo_pair, prompts, 24)
    _, chains = _rounds(_target(demo_pair, head, lookahead=False), prompts, 24)
    sync, trees = _rounds(_target(demo_pair, head, lookahead=False), prompts, 24, width=2)
    chained_target = _target(demo_pair, head, lookahead=True)
    chained, trees_chained = _rounds(chained_target, prompts, 24, width=2)
    assert sync == want and chained == want and trees_chained == trees
    assert all(len(d) in (0, 8) for d, _ in trees)

    def per_round(rounds) -> float:
        verified = [a for d, a in rounds if d]
        return sum(verified) / len(verified)

    assert per_round(trees) > 1.1 * per_round(chains)
    assert chained_target.rounds.counts["taken"] >= 6


def test_rounds_drafted_on_the_device_give_the_targets_greedy_tokens(demo_pair, head, one_thread):
    prompts = [demo_pair.tokenizer.encode(p) for p in PROMPTS]
    want = _plain(demo_pair, prompts, 24)
    sync, rounds = _rounds(_target(demo_pair, head, lookahead=False), prompts, 24)
    chained_target = _target(demo_pair, head, lookahead=True)
    chained, rounds_chained = _rounds(chained_target, prompts, 24)
    assert sync == want and chained == want
    assert rounds_chained == rounds  # the same drafts and verdicts, round for round
    accepted = sum(a for d, a in rounds if d)
    assert sum(1 for d, _ in rounds if d) >= 20 and accepted >= 20  # the head's drafts are accepted
    counts = chained_target.rounds.counts
    assert counts["taken"] >= 6 and counts["thrown"] <= 2, counts  # (sessions that end leave the round)


@pytest.mark.parametrize("seeded", [False, True], ids=["rejection", "coupled"])
def test_sampled_rounds_chained_on_the_device_equal_host_driven_ones(demo_pair, head, seeded, one_thread):
    """Sessions at T > 0 drafting on the head inside the round (its draws from its q with the
    positions' noise), judged inside it (rejection sampling, or the coupled verdict of a seeded
    row, ADR 0027), mixed K: chained rounds give the host-driven rounds' drafts, verdicts and
    tokens, round for round. A seeded session's tokens are plain decoding's with its seed."""
    prompts = [demo_pair.tokenizer.encode(p) for p in PROMPTS]
    sampling = SamplingParams(temperature=0.8, top_p=0.95, coupled=seeded)
    sync, rounds = _rounds(_target(demo_pair, head, lookahead=False), prompts, 20, [4, 2, 3], sampling=sampling)
    chained_target = _target(demo_pair, head, lookahead=True)
    chained, rounds_chained = _rounds(chained_target, prompts, 20, [4, 2, 3], sampling=sampling)
    assert chained == sync and rounds_chained == rounds
    assert sum(a for d, a in rounds if d) >= 8  # the head's sampled drafts are accepted
    counts = chained_target.rounds.counts
    assert counts["taken"] >= 6, (counts, chained_target.rounds.thrown_by)
    if seeded:  # the drafts decide only how many positions a pass settles
        plain, _ = _rounds(_target(demo_pair, head, lookahead=False), prompts, 20, 0, sampling=sampling)
        assert sync == plain


def test_the_head_on_the_device_draws_what_the_hosts_head_draws(demo_pair, head, one_thread):
    """At T > 0 the head's drafts are draws from its q with the positions' noise (ADR 0027):
    on the device, inside the round, the same tokens as the host's head for the same prefix."""
    t = _target(demo_pair, head, lookahead=False)
    parts = TargetParts(demo_pair.target, head.cfg.feature_layers)
    _, compared = _drafts_as_on_the_host(t, head, parts, t.open("s"), demo_pair.tokenizer.encode(PROMPTS[1]), 8,
                                         SamplingParams(temperature=0.9, top_k=40), seed=7)
    assert compared == 7


def test_sessions_that_end_leave_a_part_of_the_chained_round(demo_pair, head, one_thread):
    """Four sessions (a bucket of 4 rows) ending one after another: while the rest still fill
    the bucket the round launched ahead is taken for them (its ended row runs on, unread),
    after that it is thrown away; the tokens are the target's own either way."""
    prompts = [demo_pair.tokenizer.encode(p) for p in PROMPTS + ["def add(a, b):"]]
    ns = [12, 20, 28, 36]
    t = _target(demo_pair, head, lookahead=True)
    got, _ = _rounds(t, prompts, ns)
    assert got == [want[:m] for want, m in zip(_plain(demo_pair, prompts, 36), ns, strict=True)]
    assert t.rounds.counts["parts"] >= 1 and t.rounds.counts["taken"] >= 10, (t.rounds.counts, t.rounds.thrown_by)


class _LateEveryOther(LocalDrafts):
    """An n-gram source whose block comes only every other round: the rounds between run
    plain, their block late (the engine waits 0 s for it)."""

    def __init__(self, vocab: int) -> None:
        super().__init__(NgramDrafter(vocab))
        self.asked = 0

    def _propose(self, session_id, local, k, width=1) -> None:
        self.asked += 1
        if self.asked % 2:
            super()._propose(session_id, local, k, width)


def _grammar(demo_pair, demo_pair_dir):
    """The engine's `constrain` for the demo pair (ADR 0017), and a JSON schema's constraint."""
    pytest.importorskip("xgrammar")
    from specserve.structured.constraint import Constraint
    from specserve.structured.grammar import ConstrainedRow, GrammarCache, tokenizer_info

    vocab = demo_pair.target.config.vocab_size
    eos = [demo_pair.tokenizer.eos_token_id] if demo_pair.tokenizer.eos_token_id is not None else []
    cache = GrammarCache(tokenizer_info(str(demo_pair_dir / "target" / "tokenizer.json"), vocab, eos))

    def constrain(c):
        return ConstrainedRow(cache.compile(c), cache.vocab_size, vocab,
                              encode=lambda text: demo_pair.tokenizer.encode(text, add_special_tokens=False))

    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}}, "required": ["name"]}
    return constrain, Constraint.json_schema(schema)


def _engine_run(demo_pair, head, lookahead: bool, stop: str, grammar=None) -> tuple[dict, BatchedTarget]:
    t = _target(demo_pair, head, lookahead)
    tok = demo_pair.tokenizer
    eos = frozenset({tok.eos_token_id} if tok.eos_token_id is not None else ())
    steps = []
    loop = EngineLoop(t, lambda p: StopChecker(eos, p.stop, tok.decode),
                      {"eagle": DeviceHeadDrafts(head, TargetParts(demo_pair.target, head.cfg.feature_layers)),
                       "late": _LateEveryOther(t.runner.vocab_size)},
                      speculation=SpeculationSettings(block_wait_max_s=0.0, gather=False), on_step=steps.append,
                      constrain=grammar[0] if grammar else None)

    def plan(n: int, k: int = 4, **kw) -> EnginePlan:
        pool = kw.pop("pool", "eagle")
        return EnginePlan(GenerationParams(max_tokens=n, num_draft_tokens=k, seed=3, **kw), pool=pool)

    p = [tok.encode(x) for x in PROMPTS]
    loop.add("budget", p[0], plan(21))  # its budget ends inside a round
    loop.add("stop", p[1], plan(40, stop=(stop,)))  # a stop string found inside a round
    loop.add("cancel", p[2], plan(40, k=2))  # K 2 beside K 4; cancelled mid-generation
    loop.add("plain", p[1], EnginePlan(GenerationParams(max_tokens=30, seed=3)))  # rides along
    loop.add("long", p[2], plan(72))  # chained from start to end, beside the others
    while loop._inbox or any(s.running for s in loop.sessions.values()):
        loop.step()
        if len(steps) == 10:
            loop.cancel("cancel")
        if len(steps) == 14:  # its block late every other round
            loop.add("late", p[0], plan(24, pool="late"))
        if len(steps) == 22:  # a sampled session joins: it drafts on the device's head too
            loop.add("sampled", p[2], plan(8, sampling=SamplingParams(temperature=0.8)))
        if len(steps) == 30 and grammar:  # a session whose grammar forces its tokens joins (host-judged rows)
            loop.add("json", p[1], EnginePlan(GenerationParams(max_tokens=12, num_draft_tokens=4, seed=3),
                                              pool="eagle", constraint=grammar[1]))
    ended = loop.ended
    return {sid: (ended[sid].generated, ended[sid].finish_reason) for sid in ended}, t


def test_chained_rounds_through_the_engine_equal_host_driven_rounds(demo_pair, demo_pair_dir, head, one_thread):
    """Every way a round launched ahead is thrown away happens here (a session's budget and
    a stop string inside a round, a cancel, a late block, sampled sessions and a session under
    a grammar joining), and the tokens are the host-driven rounds' (and the target's own
    greedy tokens)."""
    tok = demo_pair.tokenizer
    plain = _plain(demo_pair, [tok.encode(PROMPTS[1])], 40)[0]
    stop = tok.decode(plain[14:17])  # inside the 4th or 5th round of 4 drafts
    grammar = _grammar(demo_pair, demo_pair_dir)
    sync, _ = _engine_run(demo_pair, head, False, stop, grammar)
    chained, t = _engine_run(demo_pair, head, True, stop, grammar)
    assert chained["json"] == sync["json"] and tok.decode(sync["json"][0]).lstrip().startswith("{")
    assert chained["budget"] == sync["budget"] and len(sync["budget"][0]) == 21
    assert chained["stop"] == sync["stop"] and sync["stop"][1] == "stop"
    assert chained["late"] == sync["late"] and chained["plain"] == sync["plain"]
    assert chained["long"] == sync["long"] == (_plain(demo_pair, [tok.encode(PROMPTS[2])], 72)[0], "length")
    assert chained["sampled"] == sync["sampled"]  # (seeded: the same draws)
    assert chained["cancel"][1] == sync["cancel"][1] == "cancelled"
    assert plain[:len(sync["plain"][0])] == sync["plain"][0]
    counts, why = t.rounds.counts, t.rounds.thrown_by
    # where a session ended (its budget, its stop, the cancel) the rest of the round is taken
    # while it fills the same bucket (a part), else thrown away; thrown away where a late block
    # came (its row asks for its own drafts), and where sessions joined
    assert why.get("ended", 0) + counts.get("parts", 0) >= 2, (counts, why)
    assert why.get("changed", 0) >= 1 and why.get("joined", 0) >= 1, why
    assert counts["taken"] >= 5 and counts["thrown"] == sum(why.values()), counts


def test_trees_through_the_engine_are_the_targets_tokens(demo_pair, head, one_thread):
    """The engine offers trees (`tree_always`) to sessions drafting on the target's own head:
    they verify trees of the head's shape, chained, and generate the target's own tokens."""
    tok = demo_pair.tokenizer
    t = _target(demo_pair, head, lookahead=True)
    loop = EngineLoop(t, lambda p: StopChecker(frozenset(), p.stop, tok.decode),
                      {"eagle": DeviceHeadDrafts(head, TargetParts(demo_pair.target, head.cfg.feature_layers))},
                      speculation=SpeculationSettings(tree_width=2, tree_always=True))
    prompts = [tok.encode(p) for p in PROMPTS[:2]]
    for i, p in enumerate(prompts):
        loop.add(f"s{i}", p, EnginePlan(GenerationParams(max_tokens=24, num_draft_tokens=3, seed=1), pool="eagle"))
    loop.run_until_idle()
    assert [loop.ended[f"s{i}"].generated for i in range(2)] == _plain(demo_pair, prompts, 24)
    rounds = [r for i in range(2) for r in loop.ended[f"s{i}"].rounds]
    assert sum(r.tree_size == 6 for r in rounds) >= 6 and t.rounds.counts["taken"] >= 3


# ---- 4. the graph-safety audit ----------------------------------------------------------------


def _fake_head_runner(arch: str, monkeypatch) -> tuple[ModelRunner, EagleHead]:
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (2**30 - 2**20, 2**30))
    monkeypatch.setattr(device_module, "_can_pin", lambda: True)
    model = ARCHITECTURES[arch]().eval()
    runner = ModelRunner.from_hf(model, max_sessions=8, max_len=64, device="cuda", dtype=torch.bfloat16, tile=None,
                                 fuse_upto=0)
    runner.enable_device_step(max_rows=4, graphs=False)
    with unset_fake_temporarily():
        head = EagleHead(EagleConfig.for_target(model.config)).eval()
    return runner, head


def audited_rounds(runner: ModelRunner, drafter, b: Bucket, k: int, host_copies, w: int = 1) -> list[OpTrace]:
    """Three chained rounds of the prepared bucket, each from the verdicts the round before left
    on the device, recorded: they pass the graph-safety audit (the weights, the KV and the step's
    and drafter's buffers read, nothing else) and copy nothing from or to the host."""
    ds = runner.device_step
    host_copies.copies.clear()
    host_copies.blocking_in.clear()
    traces = []
    for _ in range(3):
        with OpTrace() as t:
            drafter.run_chained(b, k, w)
        traces.append(t)
    allowed = storages(runner.w, runner.kv.keys, runner.kv.values, ds.ints, ds.keys_at, ds.causal, ds.within,
                       ds.logits, ds.verdicts, ds.picks, ds.heads, ds.features, drafter.__dict__)
    assert audit_runs(traces, allowed) == []
    assert host_copies.copies == [] and host_copies.blocking_in == []
    return traces


def _head_rows(runner: ModelRunner) -> list[Row]:
    """A prepared round of three head rows (K 4, 2, 3) over sessions of different lengths."""
    for s, n in (("a", 5), ("b", 11), ("c", 17)):
        runner.allocate(s)
        runner.forward([Row(s, [(7 * n + i) % 200 for i in range(n)], num_logits=0)])
    return [Row("a", [1, 0, 0, 0, 0], num_logits=5, head=4), Row("b", [2, 0, 0], num_logits=3, head=2),
            Row("c", [3, 0, 0, 0], num_logits=4, head=3)]


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_a_chained_round_is_graph_safe_on_a_fake_cuda_device(arch, monkeypatch):
    with fake_cuda() as (_, host_copies):
        runner, eagle = _fake_head_runner(arch, monkeypatch)
        ds = runner.device_step
        head = ds.enable_head(eagle)
        rows = _head_rows(runner)
        starts = [runner.length(r.session) for r in rows]
        b = ds.bucket_for(rows, starts)
        ds.prepare(rows, [runner.kv.slot(r.session) for r in rows], starts, b)
        assert b == Bucket(4, 5, 64)
        traces = audited_rounds(runner, head, b, 4, host_copies)
        n = len(traces[0].ops)
        with OpTrace() as plain:
            ds.run(b)
        assert n > len(plain.ops) + 3 * 20  # the head's K positions and its feed are in the round


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_a_chained_round_of_trees_is_graph_safe_on_a_fake_cuda_device(arch, monkeypatch):
    """A tree row (two first candidates, each with its chain to 2) beside a chain row: the
    trees' drafts, verdicts, the path's KV compaction and the head fed along it, chained."""
    with fake_cuda() as (_, host_copies):
        runner, eagle = _fake_head_runner(arch, monkeypatch)
        ds = runner.device_step
        head = ds.enable_head(eagle)
        _head_rows(runner)
        with unset_fake_temporarily():
            mask = Tree(tuple(head_tree(2, 2))).mask()
        tree = Row("a", [1, 0, 0, 0, 0], num_logits=5, head=2, head_width=2, mask=mask, depths=[0, 1, 2, 1, 2])
        rows = [tree, Row("b", [2, 0, 0], num_logits=3, head=2)]
        starts = [runner.length(r.session) for r in rows]
        b = ds.bucket_for(rows, starts)
        ds.prepare(rows, [runner.kv.slot(r.session) for r in rows], starts, b, masks=[tree.mask, None],
                   depths=[tree.depths, None])
        audited_rounds(runner, head, b, 2, host_copies, w=2)


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_the_audit_fails_on_the_synchronous_round(arch, monkeypatch):
    """The control: a round whose drafts the host made (as before ADR 0025) copies them in
    at every round, so it cannot be replayed without the host between rounds."""
    with fake_cuda():
        runner, _ = _fake_head_runner(arch, monkeypatch)
        ds = runner.device_step
        rows = [Row(r.session, r.tokens, num_logits=r.num_logits) for r in _head_rows(runner)]
        traces = []
        for i in range(3):
            drafted = [Row(r.session, [r.tokens[0]] + [(5 * i + j) % 200 for j in range(1, len(r.tokens))],
                           num_logits=r.num_logits) for r in rows]
            starts = [runner.length(r.session) for r in drafted]
            with OpTrace() as t:
                b = ds.bucket_for(drafted, starts)
                ds.prepare(drafted, [runner.kv.slot(r.session) for r in drafted], starts, b)
                ds.run(b)
            traces.append(t)
        problems = audit_runs(traces, storages(runner.w, runner.kv.keys, runner.kv.values, ds.ints, ds.keys_at,
                                               ds.causal, ds.within, ds.logits, ds.verdicts, ds.picks, ds.heads))
        assert any("copies from the host" in p for p in problems), problems
