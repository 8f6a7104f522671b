"""The fault matrix's stack: real Redis (AOF + password), Ray target, draft replicas and two
router replicas on loopback, TLS on every hop (mTLS to the workers, a local CA), with a simulated
target pass time so that a request lasts long enough for a fault to land in the middle of it
(ADR 0006's simulated costs, ADR 0011)."""

from __future__ import annotations

import pytest
from faultkit import DETACHED_IDLE_S, LEASE_S, PASS_MS


@pytest.fixture(scope="module")
def stack(demo_pair_dir, tmp_path_factory: pytest.TempPathFactory):
    from specserve.serving.tls import make_local_ca
    from specserve.tooling.stack import PoolSpec, Stack, StackSpec

    run_dir = tmp_path_factory.mktemp("faults")
    spec = StackSpec(
        pair_dir=str(demo_pair_dir), run_dir=str(run_dir),
        pools={"small": PoolSpec("draft", replicas=2)},
        target_threads=1, routers=2,
        router_env={"SPECSERVE_ROUTER_TARGET_WAIT_S": "180", "SPECSERVE_ROUTER_LEASE_S": str(LEASE_S),
                    "SPECSERVE_ROUTER_REAP_S": "1", "SPECSERVE_ROUTER_MAX_TOKENS_LIMIT": "128"},
        # the driver's lease and the detached-session timeout are the target's (ADR 0014)
        env={"SPECSERVE_TARGET_SIMULATED_PASS_MS": str(PASS_MS), "SPECSERVE_TARGET_LEASE_S": str(LEASE_S),
             "SPECSERVE_TARGET_HEARTBEAT_S": "0.5", "SPECSERVE_TARGET_DETACHED_IDLE_S": str(DETACHED_IDLE_S)},
        tls_dir=str(make_local_ca(run_dir / "tls")),
    )
    with Stack(spec).running(timeout_s=480) as s:
        yield s
