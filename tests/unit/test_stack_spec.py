"""The local stack gives the target this machine's cores but those the services beside it need
(StackSpec.target_threads; ADR 0028): one core for the router, Redis and the clients, one for
each router more and each draft model replica's thread, never fewer than one thread. A team
that shares its cores with them (a count set by hand) waits passively."""

import pytest

from specserve.tooling import stack
from specserve.tooling.stack import PoolSpec, StackSpec


@pytest.mark.parametrize(("cores", "threads"), [(1, 1), (2, 1), (3, 2), (4, 3), (16, 15), (64, 63), (None, 1)])
def test_the_target_gets_every_core_but_one_beside_a_router_and_redis(monkeypatch, cores, threads):
    monkeypatch.setattr(stack.os, "cpu_count", lambda: cores)
    assert stack.local_target_threads() == threads
    assert StackSpec("pair", "run").target_threads == threads


def test_each_draft_model_replica_and_router_more_keeps_its_cores(monkeypatch):
    monkeypatch.setattr(stack.os, "cpu_count", lambda: 16)
    pools = {"small": PoolSpec("draft", replicas=2),  # two threads
             "big": PoolSpec("draft", env={"SPECSERVE_DRAFT_TORCH_THREADS": "3"}),  # three
             "ngram": PoolSpec("ngram"),  # an n-gram replica runs no model
             "eagle-local": PoolSpec("eagle", local=True), "ngram-local": PoolSpec("ngram", local=True)}
    spec = StackSpec("pair", "run", pools=pools, routers=2)
    assert spec.reserved_cores() == 2 + 2 + 3
    assert spec.target_threads == 16 - 7
    # what `specserve up` starts: two small replicas and an EAGLE replica beside one router
    up = StackSpec("pair", "run", pools={"small": PoolSpec("draft", replicas=2), "eagle": PoolSpec("eagle")})
    assert up.target_threads == 16 - 4


def test_the_rule_never_gives_fewer_than_one_thread_and_an_explicit_count_stands(monkeypatch):
    monkeypatch.setattr(stack.os, "cpu_count", lambda: 2)
    assert StackSpec("pair", "run", pools={"small": PoolSpec("draft", replicas=4)}).target_threads == 1
    assert StackSpec("pair", "run", target_threads=2).target_threads == 2
    assert stack.local_target_threads(cores=8, reserved=3) == 5
    assert stack.local_target_threads(cores=2, reserved=5) == 1


def test_a_team_that_shares_its_cores_waits_passively():
    passive = {"OMP_WAIT_POLICY": "PASSIVE"}
    assert stack.target_omp_env(2, reserved=1, cores=2, environ={}) == passive  # 2 threads by hand on 2 cores
    assert stack.target_omp_env(2, reserved=4, cores=2, environ={}) == passive
    assert stack.target_omp_env(15, reserved=1, cores=16, environ={}) == {}  # its own cores: libgomp's default
    assert stack.target_omp_env(1, reserved=1, cores=1, environ={}) == {}  # one thread: no team
    # a wait the launcher or the spec names stands
    assert stack.target_omp_env(2, reserved=1, cores=2, environ={"OMP_WAIT_POLICY": "ACTIVE"}) == {}
    assert stack.target_omp_env(2, reserved=1, cores=2, environ={"GOMP_SPINCOUNT": "300000"}) == {}


def test_the_stack_starts_the_target_with_that_wait(monkeypatch, tmp_path):
    monkeypatch.setattr(stack.os, "cpu_count", lambda: 2)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    seen: dict[str, dict[str, str]] = {}

    class Started(Exception):
        pass

    def spawn(self, name, module, env):
        seen[name] = env
        raise Started

    monkeypatch.setattr(stack.Stack, "_spawn", spawn)
    # 2 threads by hand on 2 cores share them with the services: passive; the rule's 1 thread: no team
    for spec, wait in ((StackSpec("pair", str(tmp_path), target_threads=2), "PASSIVE"),
                       (StackSpec("pair", str(tmp_path)), None)):
        with pytest.raises(Started):
            stack.Stack(spec)._start_target(1.0)
        assert seen["target"]["SPECSERVE_TARGET_TORCH_THREADS"] == str(spec.target_threads)
        assert seen["target"].get("OMP_WAIT_POLICY") == wait
