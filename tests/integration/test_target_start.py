"""The target drives sessions (ADR 0014): `Target.Start` over real gRPC claims a session the
router created in Redis (its stored plan, as the router's SessionPlan encodes it), and the
engine commits every round there. A restarted incarnation adopts the sessions in its index
mid-generation and finishes them exactly, while the old one is fenced out. Bad starts get
NOT_FOUND or FAILED_PRECONDITION."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from specserve.algorithm.stops import StopChecker
from specserve.control.arms import Choice, Decision, Fallback
from specserve.drafters import HFDrafter
from specserve.engine.drafting import LocalDrafts
from specserve.engine.loop import EngineLoop
from specserve.engine.session import EnginePlan
from specserve.models.verifier import TargetModel
from specserve.params import GenerationParams, SamplingParams
from specserve.services.router.plan import SessionPlan
from specserve.services.target.loop_host import LoopHost
from specserve.services.target.server import TargetServicer
from specserve.serving.grpc_server import DomainErrorInterceptor
from specserve.v1 import target_pb2, target_pb2_grpc
from specserve.worker.model_step import Batching, make_target_step

VOCAB = 96
PROMPT = [(7 * j + 3) % VOCAB for j in range(9)]




@pytest.fixture(scope="module")
def target(micro_llama):
    return TargetModel(micro_llama(2, 64, 0))


@pytest.fixture(scope="module")
def drafter(micro_llama):
    return HFDrafter(micro_llama(2, 64, 0))  # the target's twin: blocks are accepted


def _decode(ids) -> str:
    return "".join(f"<{t}>" for t in ids)


def _stops(p: GenerationParams) -> StopChecker:
    return StopChecker(frozenset(), p.stop, _decode)


def _plan(max_tokens: int, pool: str | None, temperature: float = 0.8) -> SessionPlan:
    params = GenerationParams(max_tokens=max_tokens, sampling=SamplingParams(temperature=temperature, top_p=0.9),
                              num_draft_tokens=3, seed=11)
    choice = Choice(pool, 3, False, Decision.PINNED, Fallback.SPECULATION_OFF if pool is None else Fallback(""))
    return SessionPlan(params, "code", "explicit", "code", choice)


def _reference(target, drafter, plan: SessionPlan) -> list[int]:
    loop = EngineLoop(make_target_step(target, Batching(kv_budget_mb=8, max_sessions=4)), _stops,
                      {"small": LocalDrafts(drafter)})
    loop.add("r", PROMPT, EnginePlan.from_stored(plan.encode()))
    loop.run_until_idle()
    return loop.ended["r"].generated


def _host(target, drafter, store, step_ms: float = 0.0) -> LoopHost:
    return LoopHost(make_target_step(target, Batching(kv_budget_mb=8, max_sessions=4)), _stops, store, "target-0",
                      {"small": LocalDrafts(drafter)}, asyncio.get_running_loop(),
                      simulated_step_ms=step_ms).start_loop()


async def _serve(servicer) -> tuple[grpc.aio.Server, target_pb2_grpc.TargetStub, grpc.aio.Channel]:
    server = grpc.aio.server(interceptors=[DomainErrorInterceptor()])
    target_pb2_grpc.add_TargetServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    return server, target_pb2_grpc.TargetStub(channel), channel


async def _all_chunks(store, sid: str):
    return [c async for c in store.read_chunks(sid, 0, block_ms=200)]


@pytest.mark.parametrize("pool", ["small", None])
def test_start_over_grpc_drives_the_session_and_redis_gets_every_round(target, drafter, store, run, pool):
    plan = _plan(30, pool)
    reference = _reference(target, drafter, plan)

    async def go():
        host = _host(target, drafter, store)
        server, stub, channel = await _serve(TargetServicer(host))
        handle = await store.create_or_join(None, plan.encode(), PROMPT, owner="router-0")
        reply = await stub.Start(target_pb2.StartRequest(session_id=handle.session_id))
        chunks = await asyncio.wait_for(_all_chunks(store, handle.session_id), 60)
        info = await store.get(handle.session_id)
        await channel.close()
        await server.stop(0)
        await host.close()
        return reply, handle, chunks, info

    reply, handle, chunks, info = run(go())
    assert reply.epoch == handle.epoch + 1 and reply.committed == 0
    assert [t for c in chunks for t in c.tokens] == reference and len(reference) == 30
    assert "".join(c.text for c in chunks) == _decode(reference)
    assert chunks[-1].finish_reason == "length" and info.status.value == "finished"


def test_a_restarted_incarnation_adopts_its_sessions_and_finishes_them_exactly(target, drafter, store, run):
    plan = _plan(120, "small")
    reference = _reference(target, drafter, plan)

    async def go():
        first = _host(target, drafter, store, step_ms=5.0)
        handle = await store.create_or_join(None, plan.encode(), PROMPT, owner="router-0")
        await first.start(handle.session_id)
        async with asyncio.timeout(60):
            while len(await store.committed_tokens(handle.session_id)) < 10:
                await asyncio.sleep(0.005)
        second = _host(target, drafter, store)  # Ray restarted the actor: a new incarnation
        adopted = await second.adopt_mine()
        at_adoption = len(await store.committed_tokens(handle.session_id))
        chunks = await asyncio.wait_for(_all_chunks(store, handle.session_id), 60)
        zombie = first.engine.ended.get(handle.session_id)
        stored_epoch = (await store.get(handle.session_id)).epoch
        await first.close()
        await second.close()
        return handle, adopted, at_adoption, chunks, zombie, second, stored_epoch

    handle, adopted, at_adoption, chunks, zombie, second, stored_epoch = run(go())
    assert adopted == [handle.session_id] and 10 <= at_adoption < 120  # adopted mid-generation
    tokens = [t for c in chunks for t in c.tokens]
    assert tokens == reference  # nothing lost, nothing repeated, the same sampled tokens
    assert [c.offset for c in chunks] == [sum(len(c.tokens) for c in chunks[:i]) for i in range(len(chunks))]
    # the old incarnation was fenced out: its engine was stopped by a refused commit
    # (stale_epoch), or, on a loaded machine, had already run to the end in memory while its
    # commits waited; either way none of its commits after the take-over landed (the tokens
    # above are exactly the reference, once) and the session is the new incarnation's
    assert zombie is not None and zombie.finish_reason in ("stale_epoch", "length")
    assert second.engine.ended[handle.session_id].finish_reason == "length"
    # the first Start took epoch + 1, the adoption epoch + 2, and Redis holds the adopter's
    assert second.engine.ended[handle.session_id].epoch == handle.epoch + 2 == stored_epoch


def test_a_start_whose_caller_gives_up_midway_still_drives_the_session_and_the_engine_runs_on(
        target, drafter, store, run):
    """The 64-stream soak killed a router while its Start was waiting for the engine to open
    the session: the RPC was cancelled, the engine's add future with it, and the engine loop
    stopped on setting its result, stalling every session of the target. Now the start runs
    to the end and both sessions finish."""
    plan = _plan(40, "small")
    reference = _reference(target, drafter, plan)

    async def go():
        host = _host(target, drafter, store, step_ms=30.0)  # the loop thread sleeps in its steps
        try:
            first = await store.create_or_join(None, plan.encode(), PROMPT, owner="router-0")
            await host.start(first.session_id)
            second = await store.create_or_join(None, plan.encode(), PROMPT, owner="router-0")
            call = asyncio.create_task(host.start(second.session_id))
            async with asyncio.timeout(10):  # until the start waits for the engine to open it
                while second.session_id not in host.driving:
                    await asyncio.sleep(0.001)
            gave_up = call.cancel()
            chunks = [await asyncio.wait_for(_all_chunks(store, h.session_id), 30) for h in (first, second)]
            return gave_up, chunks, host.started
        finally:
            await host.close()

    gave_up, chunks, started = run(go())
    assert gave_up and started
    assert [[t for c in ch for t in c.tokens] for ch in chunks] == [reference, reference]


def test_bad_starts_are_refused_with_a_status_a_caller_can_act_on(target, drafter, store, run):
    async def go():
        host = _host(target, drafter, store)
        server, stub, channel = await _serve(TargetServicer(host))
        codes = []
        handle = await store.create_or_join(None, _plan(4, None).encode(), PROMPT, owner="router-0")
        await store.cancel(handle.session_id)
        for sid in ("0" * 32, handle.session_id, "not-a-session"):
            try:
                await stub.Start(target_pb2.StartRequest(session_id=sid))
                codes.append(grpc.StatusCode.OK)
            except grpc.aio.AioRpcError as exc:
                codes.append(exc.code())
        await channel.close()
        await server.stop(0)
        await host.close()
        return codes

    assert run(go()) == [grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION,
                         grpc.StatusCode.INVALID_ARGUMENT]


def test_an_engine_loop_that_fails_is_logged_and_the_host_says_it_stopped(target, drafter, store, run, caplog):
    """And hands the failure on: the target worker exits on it, so that Ray restarts it."""
    failures: list[BaseException] = []

    def fail(stop):
        raise RuntimeError("boom in the engine loop")

    async def go():
        host = LoopHost(make_target_step(target, Batching(kv_budget_mb=8, max_sessions=4)), _stops, store, "target-0",
                          {}, asyncio.get_running_loop(), on_loop_failure=failures.append)
        host.engine.run_forever = fail
        host.start_loop()
        for _ in range(200):
            if not host.started:
                break
            await asyncio.sleep(0.01)
        started = host.started
        await host.close()  # does not raise: the failure was reported when it happened
        return started

    with caplog.at_level("ERROR", logger="specserve.target"):
        assert run(go()) is False
    assert [str(e) for e in failures] == ["boom in the engine loop"]
    assert any("engine loop stopped" in r.getMessage() and "boom in the engine loop" in r.getMessage()
               for r in caplog.records), caplog.text


def test_a_constraint_is_compiled_off_the_engine_thread_before_the_session_is_taken_over(target, drafter, store, run):
    """Compiling a constraint takes milliseconds (a new JSON schema; the tokenizer's tables on
    first use). On the engine thread it stalled every session's step, on the event loop the
    draft links and the commits: `start` compiles it on a thread of its own first. A
    constraint that does not compile is then refused before the session is taken over."""
    import threading
    from dataclasses import replace

    from specserve.errors import InvalidRequest
    from specserve.structured.constraint import Constraint

    threads: list[str] = []

    def constrain(c):
        threads.append(threading.current_thread().name)
        raise InvalidRequest(f"no compiler for {c.kind} here")

    plan = replace(_plan(8, None), constraint=Constraint.json_object())

    async def go():
        host = LoopHost(make_target_step(target, Batching(kv_budget_mb=8, max_sessions=4)), _stops, store, "target-0",
                          {}, asyncio.get_running_loop(), constrain=constrain).start_loop()
        handle = await store.create_or_join(None, plan.encode(), PROMPT, owner="router-0")
        with pytest.raises(InvalidRequest, match="no compiler"):
            await host.start(handle.session_id)
        info = await store.get(handle.session_id)
        await host.close()
        return handle, info, threading.current_thread().name

    handle, info, loop_thread = run(go())
    assert len(threads) == 1 and threads[0] not in ("engine", loop_thread), threads
    assert info.epoch == handle.epoch  # refused before the take-over: the router's epoch stands
