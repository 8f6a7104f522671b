"""The `suffix` pool beside the target (ADR 0026): the engine drafts it on its own thread, from
each session's own sequence and its class's index; the index learns from every finished
session of its class, whichever pool it ran on, and from the fleet's outputs handed in from
another thread; greedy output is the target's alone; and at high load the engine's K choice
holds it plain, as it does the other pools drafted on its thread."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from specserve.algorithm.stops import StopChecker
from specserve.drafters.suffix import SuffixSettings
from specserve.engine.loop import EngineLoop
from specserve.engine.scheduler import Budget
from specserve.engine.session import EnginePlan, Status
from specserve.engine.suffix_pool import SuffixDrafts, settings_of
from specserve.models.verifier import TargetModel
from specserve.params import GenerationParams
from specserve.worker.model_step import Batching, make_target_step

VOCAB = 96
PROMPTS = [[(7 * i + 3 * j) % VOCAB for j in range(6 + 4 * i)] + [5, 6, 7, 5, 6] for i in range(6)]


@pytest.fixture(scope="module")
def target(micro_llama):
    return TargetModel(micro_llama(2, 64, 0, positions=200))


def _stops(params: GenerationParams) -> StopChecker:
    return StopChecker(frozenset(), params.stop, lambda ids: " ".join(map(str, ids)))


def _loop(target, source: SuffixDrafts | None = None) -> EngineLoop:
    model = make_target_step(target, Batching(kv_budget_mb=4, max_sessions=8, prefill_chunk=16))
    return EngineLoop(model, _stops, {"suffix": source or SuffixDrafts(VOCAB)})


def _plan(pool: str | None, cls: str = "agent", k: int = 8, max_tokens: int = 24, **kw) -> EnginePlan:
    return EnginePlan(GenerationParams(max_tokens=max_tokens, num_draft_tokens=k, seed=3), pool=pool,
                      workload_class=cls, stats_class=cls, **kw)


def _run(loop: EngineLoop, items) -> dict[str, list[int]]:
    for sid, prompt, plan in items:
        loop.add(sid, prompt, plan)
    loop.run_until_idle()
    return {sid: loop.ended[sid].generated for sid, _, _ in items}


def _accepted(loop: EngineLoop, sid: str) -> int:
    return sum(r.accepted for r in loop.ended[sid].rounds)


def test_greedy_output_is_the_targets_alone_and_drafts_are_accepted(target):
    plain = _run(_loop(target), [(f"p{i}", p, _plan(None)) for i, p in enumerate(PROMPTS[:4])])
    loop = _loop(target)
    got = _run(loop, [(f"p{i}", p, _plan("suffix")) for i, p in enumerate(PROMPTS[:4])])
    assert got == plain
    assert sum(_accepted(loop, s) for s in got) > 12  # the loops the micro model falls into: drafted and taken
    assert all(r.fallback_reason in ("", "speculation_not_paying") for s in got for r in loop.ended[s].rounds)


def test_the_index_learns_from_every_finished_session_of_its_class_whichever_pool(target):
    source = SuffixDrafts(VOCAB)
    loop = _loop(target, source)
    out = _run(loop, [("plain", PROMPTS[2], _plan(None)), ("other", PROMPTS[3], _plan(None, cls="chat"))])
    index = source.indexes["agent"]
    assert index.requests == 1 and index.tokens == len(out["plain"])
    assert source.indexes["chat"].requests == 1  # each class its own index
    # a cancelled session's output is not what the class produces: not indexed
    loop.add("cut", PROMPTS[4], _plan(None, max_tokens=200))
    loop.step()
    loop.step()
    loop.cancel("cut")
    loop.run_until_idle()
    assert loop.ended["cut"].status is Status.CANCELLED and index.requests == 1
    # a shadow twin's output is its served session's again: not indexed twice
    _run(loop, [("twin", PROMPTS[2], _plan("suffix", shadow=True))])
    assert index.requests == 1


def test_a_session_drafts_what_the_class_served_before_and_acceptance_rises(target):
    """The same request again (its output recurs across the class): with the first run's
    output in the index, the second drafts most of it from there, its blocks growing with the
    match (2, 5, 11, 16 on this pair); from an empty index it drafts only from its own
    sequence."""
    warm = SuffixDrafts(VOCAB)
    loop = _loop(target, warm)
    first = _run(loop, [("first", PROMPTS[5], _plan(None, max_tokens=40))])["first"]
    again = _run(loop, [("again", PROMPTS[5], _plan("suffix", k=16, max_tokens=40))])["again"]
    cold = _loop(target)
    alone = _run(cold, [("again", PROMPTS[5], _plan("suffix", k=16, max_tokens=40))])["again"]
    assert again == alone == first
    assert _accepted(loop, "again") >= 0.8 * len(first)
    assert _accepted(loop, "again") > _accepted(cold, "again")  # (its loop, 4 tokens a period, the cold one drafts too)
    assert 2 * len(loop.ended["again"].rounds) <= len(cold.ended["again"].rounds)  # half the target passes
    stats = warm.snapshot()["agent"]
    assert stats.added == {"local": 2, "fleet": 0} and stats.proposals["index"] >= 1


def test_the_fleets_outputs_are_indexed_before_the_next_draft_from_any_thread(target):
    source = SuffixDrafts(VOCAB)
    loop = _loop(target, source)
    first = _run(_loop(target), [("elsewhere", PROMPTS[1], _plan(None))])["elsewhere"]
    big = SuffixSettings(max_requests=3, max_tokens=10_000)
    senders = [threading.Thread(target=source.receive, args=("agent", first, 100.0 + i, big)) for i in range(4)]
    for t in senders:
        t.start()
    for t in senders:
        t.join()
    assert not source.indexes  # nothing indexed off the engine's thread
    bounds = {"max_requests": 3, "max_tokens": 10_000}
    got = _run(loop, [("here", PROMPTS[1], _plan("suffix", k=16, suffix=bounds))])["here"]
    assert got == first and _accepted(loop, "here") >= 0.6 * len(first)
    stats = source.snapshot()["agent"]
    # the bounds came with the outputs (3 kept of 4), then "here" was added as the newest:
    # out went the least recently used, 100.0 and then 101.0
    assert (stats.outputs, stats.added) == (3, {"local": 1, "fleet": 4}) and stats.oldest == 102.0


def test_the_plans_suffix_settings_bound_the_class_index(target):
    plan = _plan("suffix", suffix={"max_requests": 2, "max_tokens": 50, "min_prob": 0.5, "spec_factor": 2.0})
    assert settings_of(plan) == SuffixSettings(min_prob=0.5, spec_factor=2.0, max_requests=2, max_tokens=50)
    assert settings_of(_plan("suffix")) == SuffixSettings()
    source = SuffixDrafts(VOCAB)
    _run(_loop(target, source), [(f"s{i}", p, plan) for i, p in enumerate(PROMPTS[:3])])
    index = source.indexes["agent"]
    assert index.requests <= 2 and index.tokens <= 50
    none = SuffixDrafts(VOCAB)  # a class whose policy keeps no index drafts from its own sequence
    _run(_loop(target, none), [("s", PROMPTS[0], _plan("suffix", suffix={"max_requests": 0}))])
    assert "agent" not in none.indexes


def test_at_high_load_the_k_choice_holds_the_suffix_pool_plain(target):
    """Drafted on the engine's thread, the pool is priced as the others drafted there are
    (ADR 0020): every session's drafting lengthens the step. On a step whose cost grows with
    the tokens it verifies (kchoice.py's example: a = 10, r = 0, b = 1 ms), a class whose
    blocks are accepted at 0.6 a position speculates at one session (K = 3: S = 2.18 x 11 /
    14 = 1.71) and steps aside at 32 (K = 1: 1.6 x 42 / 74 = 0.91); controlled inputs: the fit
    and the acceptance set by hand."""
    loop = _loop(target)
    plan = _plan("suffix", k=8, adaptive=True, k_min=1, k_max=8)
    loop.add("s", PROMPTS[0], plan)
    loop._drain()
    s = loop.sessions["s"]
    assert "suffix" in loop.pools.serial_pools
    table = loop.speculation.acceptance_of(s)
    table.reached, table.accepted = [1000.0] * 8, [600.0] * 8
    loop.speculation.measured.draft_latency["suffix"] = 20e-6  # its drafting: 20 us a draft
    loop.speculation.cost.coef = np.array([0.010, 0.0, 0.001])  # a + r B + b B n (seconds)
    assert loop.speculation.best_k(s, batch=1, step_s=0.011) == 3
    assert loop.speculation.best_k(s, batch=32, step_s=0.042) == 0


@pytest.mark.slow
def test_sampled_output_at_t1_follows_the_targets_distribution():
    """Chi-squared at T = 1, as test_engine_sequence.py does it (the micro pair there, its
    exact distribution of the first three tokens enumerated): 2000 sessions through the
    engine on the suffix pool, each with a seed of its own, all of one class, so the class
    index learns every finished output and later sessions draft from it (one-hot q, judged
    by the engine's rejection sampling). p > 1e-3 (fixed seeds: deterministic)."""
    from scipy.stats import chisquare
    from test_engine_sequence import ALPHA, PROMPT, SCALE, _exact_distribution, _micro

    from specserve.algorithm.sampling import SamplingParams

    target_hf = _micro(seed=0, scale=SCALE)
    sp = SamplingParams(temperature=1.0)
    exact = _exact_distribution(target_hf, sp)
    source = SuffixDrafts(5)
    model = make_target_step(TargetModel(target_hf), Batching(kv_budget_mb=8, max_sessions=128, prefill_chunk=16))
    loop = EngineLoop(model, _stops, {"suffix": source}, budget=Budget(max_batch=128))
    n, wave = 2048, 128  # (the KV slots' sessions at once)
    counts: dict[tuple[int, ...], int] = {}
    rounds = []
    for first in range(0, n, wave):
        for seed in range(first, first + wave):
            loop.add(f"s{seed}", PROMPT, EnginePlan(GenerationParams(max_tokens=3, sampling=sp, num_draft_tokens=2,
                                                                     seed=seed), pool="suffix", workload_class="c",
                                                    stats_class="c"))
        loop.run_until_idle()
        for seed in range(first, first + wave):
            s = loop.ended[f"s{seed}"]
            counts[tuple(s.generated)] = counts.get(tuple(s.generated), 0) + 1
            rounds += s.rounds
    assert sum(r.accepted for r in rounds) > n // 4 and sum(r.k - r.accepted for r in rounds) > n // 10
    assert source.snapshot()["c"].proposals["index"] > n // 4  # the index drafted many of them
    keys = sorted(exact)
    assert sum(counts.get(k, 0) for k in keys if exact[k] == 0) == 0, "emitted an impossible sequence"
    obs = np.array([counts.get(k, 0) for k in keys], dtype=float)
    exp = np.array([exact[k] for k in keys]) * n
    big = exp >= 5
    obs_p, exp_p = np.append(obs[big], obs[~big].sum()), np.append(exp[big], exp[~big].sum())
    keep = exp_p > 0
    assert chisquare(obs_p[keep], exp_p[keep] * obs_p[keep].sum() / exp_p[keep].sum()).pvalue > ALPHA
