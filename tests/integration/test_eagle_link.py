"""The remote `eagle` pool (issue 40, ADR 0020): a draft replica with an EAGLE head, fed the
target's features over its `Draft.Link` stream, on loopback.

The target's engine sends the features of every committed position it computes (the prompt's
chunks, each round's accepted positions) ahead of the round's outcome; the replica's head
drafts from them exactly the blocks the same head drafts beside the target (`eagle-local`),
so the remote pool's rounds accept what the local one's do (sampled, with the client's seed:
every round waits for its block), and the output is the same.
The bytes that crossed are counted: hidden size x 2 (bf16) per committed position. A replica
that dies mid-generation hands its sessions to the survivor, which gets their features again.
"""

from __future__ import annotations

import asyncio
import threading

import grpc
import pytest
import torch
from test_draft_link import _finish, _until

from specserve.algorithm.stops import StopChecker
from specserve.drafters.eagle import EagleConfig, EagleDrafter, EagleHead, TargetParts, save_head
from specserve.engine.eagle_local import EagleLocalDrafts
from specserve.engine.loop import EngineLoop
from specserve.engine.remote_drafts import RemoteDrafts
from specserve.engine.session import EnginePlan
from specserve.engine.speculation import SpeculationSettings
from specserve.models.verifier import TargetModel
from specserve.params import GenerationParams, SamplingParams
from specserve.services.draft.server import DraftServicer
from specserve.v1 import draft_pb2_grpc
from specserve.worker.model_step import Batching, make_target_step

VOCAB = 96
PROMPTS = [[(5 * i + 3 * j) % VOCAB for j in range(4 + 9 * i)] for i in range(3)]


@pytest.fixture(scope="module")
def models(micro_llama, tmp_path_factory):
    """A micro target and a head for it, saved and loaded as a replica loads it (random init:
    the test is about the stream; a head that drafts the target's own continuation would
    accept everything and test less)."""
    target = micro_llama(2, 64, 0)
    target_dir = tmp_path_factory.mktemp("target")
    target.save_pretrained(target_dir)
    torch.manual_seed(4)
    head = EagleHead(EagleConfig.for_target(target.config)).eval()
    head_dir = tmp_path_factory.mktemp("head")
    save_head(head, head_dir)
    from specserve.drafters.eagle import load_head

    return target, target_dir, load_head(head_dir)


def _stops(p):
    return StopChecker(frozenset(), p.stop, lambda ids: "")


async def _eagle_server(head, target_dir) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    parts = TargetParts.from_weights(target_dir, head.cfg.feature_layers)
    servicer = DraftServicer(EagleDrafter(head, parts), 8)
    draft_pb2_grpc.add_DraftServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


def _model(target, head):
    model = make_target_step(TargetModel(target), Batching(kv_budget_mb=8, max_sessions=8, prefill_chunk=16))
    model.keep_features(head.cfg.feature_layers)
    return model


def _plan(max_tokens: int) -> EnginePlan:
    """Sampled with the client's seed: an exact session, whose rounds wait for their blocks
    (a late block would change its sample path), so the remote pool's rounds are the local's."""
    return EnginePlan(GenerationParams(max_tokens=max_tokens, num_draft_tokens=3, seed=1,
                                       sampling=SamplingParams(temperature=1.0)), pool="eagle", seeded=True)


def _local_run(target, head, max_tokens):
    loop = EngineLoop(_model(target, head), _stops, {"eagle": EagleLocalDrafts(head, TargetParts(
        target, head.cfg.feature_layers))})
    for i, p in enumerate(PROMPTS):
        loop.add(f"s{i}", p, _plan(max_tokens))
    loop.run_until_idle()
    return loop


async def _remote(head, target_dir, target, **pool_args):
    """Two eagle replicas on loopback, the pool over them, and the engine on its own thread with
    every prompt's session added: (servers, pool, engine, stop, thread)."""
    servers = [await _eagle_server(head, target_dir) for _ in range(2)]
    pool = RemoteDrafts([a for _, a in servers], asyncio.get_running_loop(), VOCAB, wants_features=True,
                        timeout_s=5.0, **pool_args).start()
    await _until(lambda: all(r.up for r in pool.replicas))
    engine = EngineLoop(_model(target, head), _stops, {"eagle": pool},
                        speculation=SpeculationSettings(block_wait_max_s=1.0, exact_wait_s=8.0))
    stop = threading.Event()
    thread = threading.Thread(target=engine.run_forever, args=(stop,), daemon=True)
    thread.start()
    for i, p in enumerate(PROMPTS):  # exact: every round waits for its block, as the local pool's has it
        engine.add(f"s{i}", p, _plan(24))
    return servers, pool, engine, stop, thread


def test_a_remote_head_drafts_what_the_local_one_does_from_the_features_on_the_link(models, run):
    target, target_dir, head = models
    local = _local_run(target, head, 24)

    async def go():
        servers, pool, engine, stop, thread = await _remote(head, target_dir, target)
        await _finish(servers, pool, engine, stop, thread, len(PROMPTS))
        return engine, pool

    engine, pool = run(go())
    for i in range(len(PROMPTS)):
        remote, here = engine.ended[f"s{i}"], local.ended[f"s{i}"]
        assert remote.generated == here.generated
        assert [(r.k, r.accepted) for r in remote.rounds] == [(r.k, r.accepted) for r in here.rounds], i
    # every committed position but each session's last crossed once: 64 numbers of 2 bytes
    committed = sum(len(PROMPTS[i]) + len(engine.ended[f"s{i}"].generated) for i in range(len(PROMPTS)))
    assert pool.feature_bytes == (committed - len(PROMPTS)) * 64 * 2


def test_a_replica_that_dies_mid_generation_hands_its_sessions_and_their_features_on(models, run):
    """One of two replicas is stopped once a session has run 3 speculative rounds: its sessions
    reopen on the survivor with the features sent so far, and every session still gets the
    local pool's output and blocks (the rounds after the kill accept as the local ones do)."""
    target, target_dir, head = models
    local = _local_run(target, head, 24)

    async def go():
        servers, pool, engine, stop, thread = await _remote(head, target_dir, target, reconnect_s=30.0)
        await _until(lambda: any(sum(1 for r in s.rounds if r.k) >= 3 for s in engine.sessions.values()))
        victim = next(s.replica for s in pool.sessions.values() if s.replica is not None)
        moved = [sid for sid, s in pool.sessions.items() if s.replica is victim]
        at_kill = {sid: len(engine.sessions[sid].rounds) for sid in moved if sid in engine.sessions}
        await next(srv for srv, a in servers if a == victim.address).stop(0)
        await _finish(servers, pool, engine, stop, thread, len(PROMPTS))
        return engine, at_kill

    engine, at_kill = run(go())
    assert at_kill, "no session was on the stopped replica while it ran"
    for i in range(len(PROMPTS)):
        remote, here = engine.ended[f"s{i}"], local.ended[f"s{i}"]
        assert remote.generated == here.generated
        assert [(r.k, r.accepted) for r in remote.rounds] == [(r.k, r.accepted) for r in here.rounds], i
    # the moved sessions kept drafting after the kill (their features reached the survivor)
    for sid, n in at_kill.items():
        assert sum(1 for r in engine.ended[sid].rounds[n:] if r.k) > 0, sid
