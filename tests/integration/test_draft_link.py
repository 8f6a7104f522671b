"""Drafts come to the target (ADR 0014): the engine loop with a draft pool of real draft
workers on loopback, linked by one `Draft.Link` stream per replica. Greedy output is the
target's alone. Blocks drafted ahead are pushed and used without a call. When replicas die
mid-generation, sessions move to the survivor, then run plain, and the output is unchanged."""

from __future__ import annotations

import asyncio
import threading

import grpc
import pytest

from specserve.algorithm.stops import StopChecker
from specserve.drafters import HFDrafter
from specserve.engine.drafting import DRAFT_UNAVAILABLE
from specserve.engine.loop import EngineLoop
from specserve.engine.remote_drafts import RemoteDrafts
from specserve.engine.scheduler import Budget
from specserve.engine.session import EnginePlan
from specserve.engine.speculation import SpeculationSettings
from specserve.models.verifier import TargetModel
from specserve.params import GenerationParams, SamplingParams
from specserve.services.draft.server import DraftServicer
from specserve.v1 import draft_pb2_grpc
from specserve.worker.model_step import Batching, make_target_step

VOCAB = 96
PROMPTS = [[(5 * i + 3 * j) % VOCAB for j in range(4 + 6 * i)] for i in range(4)]


@pytest.fixture(scope="module")
def models(micro_llama):
    """The draft is the target's twin: two unrelated random models almost never agree at
    greedy, and this test is about the stream (acceptance, bonus, blocks drafted ahead)."""
    return micro_llama(2, 64, 0), micro_llama(2, 64, 0)


def _stops(p):
    return StopChecker(frozenset(), p.stop, lambda ids: "")


async def _draft_server(draft_model, simulated_token_ms: float = 0.0, **kw) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    servicer = DraftServicer(HFDrafter(draft_model), 8, batching=Batching(kv_budget_mb=8, max_sessions=8),
                             simulated_token_ms=simulated_token_ms, **kw)
    server.servicer = servicer  # (the tests read its metrics)
    draft_pb2_grpc.add_DraftServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


def _engine(target_model, sources, step_ms: float = 0.0, budget: Budget | None = None,
            **kw) -> tuple[EngineLoop, threading.Event, threading.Thread]:
    """The engine on its own thread; `step_ms`: a slower simulated target device, so the
    draft (here the target's twin) is cheap next to a target step, as a real draft is."""
    engine = EngineLoop(make_target_step(TargetModel(target_model), Batching(kv_budget_mb=8, max_sessions=8)),
                        _stops, sources, budget=budget, speculation=SpeculationSettings(block_wait_max_s=0.05, **kw),
                        simulated_step_ms=(lambda step, out: step_ms) if step_ms else None)
    stop = threading.Event()
    thread = threading.Thread(target=engine.run_forever, args=(stop,), daemon=True)
    thread.start()
    return engine, stop, thread


def _plain_reference(target_model, max_tokens: int) -> list[list[int]]:
    engine = EngineLoop(make_target_step(TargetModel(target_model), Batching(kv_budget_mb=8, max_sessions=8)), _stops)
    for i, p in enumerate(PROMPTS):
        engine.add(f"s{i}", p, EnginePlan(GenerationParams(max_tokens=max_tokens, seed=1)))
    engine.run_until_idle()
    return [engine.ended[f"s{i}"].generated for i in range(len(PROMPTS))]


async def _until(predicate, timeout_s: float = 60.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not predicate():
            await asyncio.sleep(0.005)


async def _finish(servers, pool, engine, stop, thread, sessions: int) -> None:
    """Sessions s0.. all ended: stop the engine's thread, the pool and the draft servers."""
    await _until(lambda: all(f"s{i}" in engine.ended for i in range(sessions)))
    stop.set()
    thread.join(10)
    await pool.stop()
    for server, _ in servers:
        await server.stop(0)


async def _serve_prompts(servers, pool, engine, stop, thread, max_tokens: int) -> None:
    """Every prompt a greedy session on pool `small` (K 3) until all ended; then the teardown."""
    for i, p in enumerate(PROMPTS):
        engine.add(f"s{i}", p, EnginePlan(GenerationParams(max_tokens=max_tokens, num_draft_tokens=3, seed=1),
                                          pool="small"))
    await _finish(servers, pool, engine, stop, thread, len(PROMPTS))


def test_greedy_through_the_link_is_the_target_alone_and_pushed_blocks_are_used(models, run):
    target_model, draft_model = models
    reference = _plain_reference(target_model, 32)

    async def go():
        servers = [await _draft_server(draft_model) for _ in range(2)]
        # all K + 1 outcomes of K = 3 drafted ahead: a random model's near-uniform q ranks them poorly
        pool = RemoteDrafts([a for _, a in servers], asyncio.get_running_loop(), VOCAB, predraft_branches=4).start()
        await _until(lambda: all(r.up for r in pool.replicas))
        # ample for drafting ahead (80 ms was not, once, on a 2-core AVX2 CI machine: no
        # round used a pushed block)
        engine, stop, thread = _engine(target_model, {"small": pool}, step_ms=160.0)
        await _serve_prompts(servers, pool, engine, stop, thread, 32)
        return engine

    engine = run(go())
    assert [engine.ended[f"s{i}"].generated for i in range(len(PROMPTS))] == reference
    rounds = [r for i in range(len(PROMPTS)) for r in engine.ended[f"s{i}"].rounds]
    assert sum(r.k for r in rounds) > 0 and sum(r.accepted for r in rounds) > 0
    assert any(r.predraft == "pushed" for r in rounds)  # a block drafted ahead, used with no call


def test_remote_replicas_draft_token_trees_and_the_output_stays_the_targets(models, run):
    """Trees from a remote pool (ADR 0020): the engine's width goes out with each outcome; a
    replica unsure of a block's first token (a random model always is) drafts its runner-up
    there as a second branch with its own chain; the target verifies the tree. Greedy output
    is the target's alone, and the rounds verified trees of both branches."""
    target_model, draft_model = models
    reference = _plain_reference(target_model, 24)

    async def go():
        servers = [await _draft_server(draft_model) for _ in range(2)]
        pool = RemoteDrafts([a for _, a in servers], asyncio.get_running_loop(), VOCAB).start()
        await _until(lambda: all(r.up for r in pool.replicas))
        # a target step of 100 ms (simulated), so a tree's block is worth waiting for and lands
        # within the wait even on a loaded 2-core machine (with the CPU's own few-ms steps every
        # block came late there once, and a late tree verifies below a plain round's token: a chain)
        engine, stop, thread = _engine(target_model, {"small": pool}, step_ms=100.0, tree_width=2, tree_always=True)
        await _serve_prompts(servers, pool, engine, stop, thread, 24)
        return engine

    engine = run(go())
    assert [engine.ended[f"s{i}"].generated for i in range(len(PROMPTS))] == reference
    rounds = [r for i in range(len(PROMPTS)) for r in engine.ended[f"s{i}"].rounds]
    trees = [r for r in rounds if r.tree_size]
    # (a late tree is verified below the token a plain round committed: a smaller tree, or a branch)
    assert all(r.k <= 3 and r.tree_size <= 6 for r in trees), [(r.k, r.tree_size) for r in trees]
    # trees that branch (a failure lists every round: late blocks show as draft_late)
    assert any(r.k < r.tree_size for r in trees), [(r.k, r.tree_size, r.fallback_reason) for r in rounds]
    assert sum(r.accepted for r in trees) > 0


def test_remote_ngram_replicas_draft_token_trees_from_their_matches(models, run):
    """A remote n-gram replica asked for a tree (ADR 0020) answers with its own: the latest
    matches of its longest suffix match with distinct next tokens, each continued, as
    branches (drafts with parents). The prompt repeats (7, 8) before three different tokens, so
    its suffix (7, 8) has several continuations: the replica's tree for it has more than one
    root (two: its latest matches with distinct next tokens, 3 and 2). Over
    the session (a tree is offered with each outcome, so from the second round) the target
    verifies trees on more than one branch, and the greedy output is the target's alone."""
    from specserve.drafters import NgramDrafter

    target_model, _ = models
    prompt = [7, 8, 1, 9, 7, 8, 2, 9, 7, 8, 3, 9, 7, 8]
    engine0 = EngineLoop(make_target_step(TargetModel(target_model), Batching(kv_budget_mb=8, max_sessions=8)), _stops)
    engine0.add("r", prompt, EnginePlan(GenerationParams(max_tokens=16, seed=1)))
    engine0.run_until_idle()
    reference = engine0.ended["r"].generated

    async def go():
        server = grpc.aio.server()
        servicer = DraftServicer(NgramDrafter(VOCAB), 8, batching=Batching(kv_budget_mb=8, max_sessions=8))
        draft_pb2_grpc.add_DraftServicer_to_server(servicer, server)
        address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
        await server.start()
        pool = RemoteDrafts([address], asyncio.get_running_loop(), VOCAB).start()
        await _until(lambda: all(r.up for r in pool.replicas))
        engine, stop, thread = _engine(target_model, {"ngram": pool}, tree_width=3, tree_always=True)
        engine.add("s0", prompt, EnginePlan(GenerationParams(max_tokens=16, num_draft_tokens=3, seed=1),
                                            pool="ngram"))
        await _finish([(server, address)], pool, engine, stop, thread, 1)
        return engine

    engine = run(go())
    assert engine.ended["s0"].generated == reference
    trees = [r for r in engine.ended["s0"].rounds if r.tree_size > r.k]  # drafts on more than one branch
    assert trees, [(r.k, r.tree_size) for r in engine.ended["s0"].rounds]
    assert trees[0].tree_size >= trees[0].k + 2  # beyond one chain by two nodes: branches
    found = NgramDrafter(VOCAB).start().propose_tree(prompt, 3, SamplingParams(), 1, 3)
    tokens, parents = found.tokens, found.parents
    assert sorted(t for t, p in zip(tokens, parents, strict=True) if p < 0) == [2, 3]  # two roots


def test_a_saturated_replica_refuses_sessions_to_plain_and_nothing_changes_in_the_output(models, run):
    """Draft capacity (ADR 0021), both sides overloaded: one replica whose queue bound is 1 work
    item, its device slow (20 ms a draft step), and a target whose step holds 2 rows for 4
    sessions. Sessions opened while the replica is busy are refused at once: they decode plain
    from their first round (never waiting for a block), the refusals are counted, the sessions
    it took still speculate, every step held at most its 2 rows, and every output is the
    target's alone."""
    target_model, draft_model = models
    reference = _plain_reference(target_model, 24)

    async def go():
        server, address = await _draft_server(draft_model, simulated_token_ms=20.0, max_queue=1)
        pool = RemoteDrafts([address], asyncio.get_running_loop(), VOCAB, predraft_branches=0).start()
        await _until(lambda: all(r.up for r in pool.replicas))
        # a target step of 100 ms (a simulated device): the admitted sessions' 20 ms drafts pay,
        # so the engine's cost model speculates for them rather than holding them plain (on the
        # CPU's real few-ms step it held them plain under load and the test read no drafts)
        engine, stop, thread = _engine(target_model, {"small": pool}, step_ms=100.0, budget=Budget(max_batch=2))
        engine.on_step = lambda report: widest.append(report.rows)
        await _serve_prompts([(server, address)], pool, engine, stop, thread, 24)
        return engine, server.servicer.metrics

    widest: list[int] = []
    engine, metrics = run(go())
    assert max(widest) == 2  # the target at twice its batch: its widest steps held their 2 rows, none more
    assert [engine.ended[f"s{i}"].generated for i in range(len(PROMPTS))] == reference
    sessions = [engine.ended[f"s{i}"] for i in range(len(PROMPTS))]
    # refused: every round plain at once for want of a replica (none waited for a block)
    refused = [s for s in sessions if all(not r.k and r.fallback_reason in ("draft_unavailable", "")
                                          for r in s.rounds)]
    assert 1 <= len(refused) < len(sessions)
    assert metrics.shed.labels("admission")._value.get() == len(refused)
    assert any(r.k for s in sessions for r in s.rounds)  # the sessions it took were drafted for


def test_replicas_dying_mid_generation_move_sessions_then_fail_closed_to_plain(models, run):
    target_model, draft_model = models
    reference = _plain_reference(target_model, 150)

    async def go():
        servers = [await _draft_server(draft_model, simulated_token_ms=2.0) for _ in range(2)]
        pool = RemoteDrafts([a for _, a in servers], asyncio.get_running_loop(), VOCAB, reconnect_s=30).start()
        await _until(lambda: all(r.up for r in pool.replicas))
        engine, stop, thread = _engine(target_model, {"small": pool})
        sids = [f"s{i}" for i in range(len(PROMPTS))]
        for sid, p in zip(sids, PROMPTS, strict=True):
            engine.add(sid, p, EnginePlan(GenerationParams(max_tokens=150, num_draft_tokens=3, seed=1), pool="small"))

        def progress() -> int:
            return min((len(s.generated) for s in list(engine.sessions.values())), default=0)

        await _until(lambda: progress() >= 10)
        await servers[0][0].stop(0)  # one replica dies mid-generation
        at_first = progress()
        await _until(lambda: progress() >= at_first + 20 or len(engine.ended) == len(sids))
        await servers[1][0].stop(0)  # then the other
        at_second = progress()
        await _until(lambda: len(engine.ended) == len(sids), 120)
        stop.set()
        thread.join(10)
        await pool.stop()
        return engine, sids, at_first, at_second

    engine, sids, at_first, at_second = run(go())
    assert 10 <= at_first < at_second < 150  # both faults landed mid-generation
    assert [engine.ended[s].generated for s in sids] == reference
    rounds = [r for s in sids for r in engine.ended[s].rounds]
    assert any(r.fallback_reason == DRAFT_UNAVAILABLE for r in rounds)  # plain once no replica was left
    assert sum(r.k for r in rounds) > 0


def test_a_draining_replica_ends_its_links_at_once_and_its_sessions_move(models, run):
    """SIGTERM drains a draft replica (`GrpcServer.stop`, here with a 30 s grace). A target's
    `Draft.Link` stream never ends by itself, so the drain would wait out the whole grace while
    the target kept its sessions on a replica going away. The replica ends its links as the
    drain begins: the drain returns at once, and the target's source sees the stream end and
    moves the session to the pool's other replica."""
    from specserve.engine.remote_drafts import replica_for
    from specserve.serving.grpc_server import GrpcServer
    from specserve.v1 import common_pb2

    _, draft_model = models

    async def go():
        stays, stays_at = await _draft_server(draft_model)
        servicer = DraftServicer(HFDrafter(draft_model), 8, batching=Batching(kv_budget_mb=8, max_sessions=8))
        server = GrpcServer(["specserve.v1.Draft"], "127.0.0.1", 0, 30.0,
                            lambda s: draft_pb2_grpc.add_DraftServicer_to_server(servicer, s))
        server.on_drain.append(servicer.end_links)
        await server.start()
        await server.set_serving()
        drains_at = f"127.0.0.1:{server.port}"
        pool = RemoteDrafts([stays_at, drains_at], asyncio.get_running_loop(), VOCAB, reconnect_s=30).start()
        await _until(lambda: all(r.up for r in pool.replicas))
        sid = next(f"s{i}" for i in range(100) if replica_for(f"s{i}", [stays_at, drains_at]) == drains_at)
        pool._open(sid, [1, 2, 3], common_pb2.SamplingParams(), 1, 0)
        await _until(lambda: len(servicer.links) == 1 and sid in next(iter(servicer.links)).sessions)
        t0 = asyncio.get_running_loop().time()
        await server.stop()
        took = asyncio.get_running_loop().time() - t0
        await _until(lambda: not pool.replicas[1].up, 5.0)  # the stream's end reaches the target
        placed = pool.sessions[sid].replica
        up = [r.up for r in pool.replicas]
        await pool.stop()
        await stays.stop(0)
        return took, placed.address if placed else None, up, stays_at

    took, placed, up, stays_at = run(go())
    assert took < 5, f"the drain waited {took:.1f} s for a link"
    assert up == [True, False] and placed == stays_at
