"""The engine's commits in a real Redis (ADR 0014): the engine loop on its own thread, the
committer on the event loop sending one pipeline per batch of steps. What Redis holds is
exactly what the engine generated, chunk by chunk; a session another driver claims (its
epoch bumped) gets nothing more from the old one; closing a session stops the engine."""

from __future__ import annotations

import asyncio
import threading

import pytest

from specserve.algorithm.sampling import SamplingParams
from specserve.algorithm.stops import StopChecker
from specserve.drafters import HFDrafter
from specserve.engine.committer import RedisCommitter
from specserve.engine.drafting import LocalDrafts
from specserve.engine.loop import EngineLoop
from specserve.engine.session import EnginePlan, Status
from specserve.engine.speculation import SpeculationSettings
from specserve.models.verifier import TargetModel
from specserve.params import GenerationParams
from specserve.worker.model_step import Batching, make_target_step

VOCAB = 96




@pytest.fixture(scope="module")
def pair(micro_llama):
    return TargetModel(micro_llama(2, 64, 0)), HFDrafter(micro_llama(1, 32, 1))


def _decode(ids) -> str:
    return "".join(f"<{t}>" for t in ids)


class Driver:
    """An engine on its own thread (as in the target worker) committing through Redis, with
    the target's commit back-pressure (two unanswered rounds at most per session)."""

    def __init__(self, pair, store, aloop: asyncio.AbstractEventLoop) -> None:
        target, drafter = pair
        self.refused: list[tuple[str, str]] = []
        self.committer = RedisCommitter(store, aloop, self._refused).start()
        self.engine = EngineLoop(make_target_step(target, Batching(kv_budget_mb=8, max_sessions=8, prefill_chunk=16)),
                                 lambda p: StopChecker(frozenset(), p.stop, _decode),
                                 {"small": LocalDrafts(drafter)}, committer=self.committer,
                                 speculation=SpeculationSettings(max_commit_lag=2))
        self.committer.on_acked = self.engine.acked
        self.widest_lag = 0  # the most rounds of one session handed over and not yet answered
        self.engine.on_step = lambda report: setattr(self, "widest_lag", max(
            [self.widest_lag, *(s.unacked for s in self.engine.sessions.values())]))
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.engine.run_forever, args=(self.stop,), daemon=True)
        self.thread.start()

    def _refused(self, session_id: str, why: str) -> None:
        self.refused.append((session_id, why))
        self.engine.cancel(session_id, why)

    async def until_ended(self, sids, timeout_s: float = 120.0) -> None:
        async with asyncio.timeout(timeout_s):
            while not all(s in self.engine.ended for s in sids):
                await asyncio.sleep(0.01)
        await self.committer.flush()

    async def close(self) -> None:
        self.stop.set()
        self.thread.join(10)
        await self.committer.stop()


async def _claim(store, prompt: list[int], driver: str) -> tuple[str, int]:
    """A session created as the router does, then claimed by a target incarnation."""
    handle = await store.create_or_join(None, {"test": True}, prompt, owner="router")
    return handle.session_id, await store.take_over(handle.session_id, driver)


def test_what_redis_holds_is_what_the_engine_generated_in_few_pipelines(pair, store, run):
    prompts = [[(5 * i + 3 * j) % VOCAB for j in range(4 + 6 * i)] for i in range(4)]

    async def go():
        driver = Driver(pair, store, asyncio.get_running_loop())
        sp = SamplingParams(temperature=0.8, top_p=0.95)
        sids = []
        for i, prompt in enumerate(prompts):
            sid, epoch = await _claim(store, prompt, "target-a:1")
            plan = EnginePlan(GenerationParams(max_tokens=24, sampling=sp, num_draft_tokens=3, seed=i),
                              pool="small" if i % 2 else None)
            driver.engine.add(sid, prompt, plan, epoch=epoch)
            sids.append(sid)
        await driver.until_ended(sids)
        out = {}
        for sid in sids:
            chunks = [c async for c in store.read_chunks(sid, 0, block_ms=100)]
            out[sid] = (await store.committed_tokens(sid), chunks, (await store.get(sid)).status)
        await driver.close()
        return driver, sids, out

    driver, sids, out = run(go())
    rounds = sum(len(driver.engine.ended[s].rounds) for s in sids)
    for sid in sids:
        tokens, chunks, status = out[sid]
        assert tokens == driver.engine.ended[sid].generated and len(tokens) == 24
        assert "".join(c.text for c in chunks) == _decode(tokens)
        assert [c.offset for c in chunks] == [sum(len(c.tokens) for c in chunks[:i]) for i in range(len(chunks))]
        assert status.value == "finished"
    assert driver.refused == []
    assert 1 <= driver.widest_lag <= 2  # the back-pressure held, and commits did lag
    assert driver.committer.pipelines < rounds  # several sessions' rounds shared a pipeline


def test_a_session_claimed_by_another_driver_gets_nothing_more_from_the_old_one(pair, store, run):
    async def go():
        driver = Driver(pair, store, asyncio.get_running_loop())
        prompt = list(range(1, 12))
        sid, epoch = await _claim(store, prompt, "target-a:1")
        driver.engine.add(sid, prompt, EnginePlan(GenerationParams(max_tokens=200, seed=3)), epoch=epoch)
        async with asyncio.timeout(60):
            while len(await store.committed_tokens(sid)) < 5:
                await asyncio.sleep(0.002)
        new_epoch = await store.take_over(sid, "target-a:2")  # a restarted incarnation claims it
        at_claim = len(await store.committed_tokens(sid))
        await driver.until_ended([sid])
        final = await store.committed_tokens(sid)
        info = await store.get(sid)
        await driver.close()
        return driver, sid, at_claim, final, info, new_epoch, epoch

    driver, sid, at_claim, final, info, new_epoch, epoch = run(go())
    s = driver.engine.ended[sid]
    assert new_epoch == epoch + 1
    assert len(final) == at_claim < 200  # the zombie's commits after the claim were all refused
    assert final == s.generated[: len(final)]
    assert s.status is Status.CANCELLED and driver.refused[0] == (sid, "stale_epoch")
    assert info.status.value == "running"  # the session is the new driver's to finish


def test_a_cancelled_session_stops_the_engine(pair, store, run):
    async def go():
        driver = Driver(pair, store, asyncio.get_running_loop())
        prompt = list(range(3, 9))
        sid, epoch = await _claim(store, prompt, "target-a:1")
        driver.engine.add(sid, prompt, EnginePlan(GenerationParams(max_tokens=200, num_draft_tokens=2, seed=1),
                                                  pool="small"), epoch=epoch)
        async with asyncio.timeout(60):
            while len(await store.committed_tokens(sid)) < 3:
                await asyncio.sleep(0.002)
        assert await store.cancel(sid)
        await driver.until_ended([sid])
        tokens = await store.committed_tokens(sid)
        await driver.close()
        return driver, sid, tokens

    driver, sid, tokens = run(go())
    assert driver.engine.ended[sid].status is Status.CANCELLED and (sid, "closed") in driver.refused
    assert len(tokens) < 200
