"""The router needs neither torch nor transformers (its image ships without them): a router
process in which both are unimportable starts, serves health, validates requests and plans
them, against a real redis-server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specserve.v1 import generation_pb2, generation_pb2_grpc, policy_pb2, policy_pb2_grpc

# `import torch` raises ImportError once sys.modules maps it to None.
BLOCK_AND_RUN = (
    "import sys, runpy\n"
    "for name in ('torch', 'transformers', 'safetensors'):\n"
    "    sys.modules[name] = None\n"
    "runpy.run_module('specserve.services.router', run_name='__main__', alter_sys=True)\n"
)


@pytest.fixture
def router_without_torch(redis_server, demo_pair_dir, tmp_path):
    port_file = tmp_path / "router.port"
    env = {**os.environ, "SPECSERVE_ROUTER_PORT": "0", "SPECSERVE_ROUTER_PORT_FILE": str(port_file),
           "SPECSERVE_ROUTER_METRICS_PORT": "-1", "SPECSERVE_ROUTER_HTTP_PORT": "0",
           "SPECSERVE_ROUTER_REDIS_URL": redis_server.url,
           "SPECSERVE_ROUTER_KEY_PREFIX": "torchfree", "SPECSERVE_ROUTER_TOKENIZER": str(demo_pair_dir / "target"),
           "SPECSERVE_ROUTER_DRAFT_POOLS": json.dumps({"small": ["127.0.0.1:9"]}),
           "SPECSERVE_ROUTER_ADMIN_TOKEN": "t0ken"}
    with open(tmp_path / "router.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, "-c", BLOCK_AND_RUN], env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while not (port_file.exists() and port_file.read_text().strip()):
            assert proc.poll() is None, (tmp_path / "router.log").read_text()
            assert time.monotonic() < deadline, "the router did not bind a port"
            time.sleep(0.1)
        address = f"127.0.0.1:{port_file.read_text().strip()}"
        with grpc.insecure_channel(address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            while True:
                try:
                    if health.Check(health_pb2.HealthCheckRequest(service="specserve.v1.Generation"),
                                    timeout=1).status == health_pb2.HealthCheckResponse.SERVING:
                        break
                except grpc.RpcError:
                    pass
                assert proc.poll() is None, (tmp_path / "router.log").read_text()
                assert time.monotonic() < deadline, "the router never became SERVING"
                time.sleep(0.1)
            yield channel, proc
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_router_starts_and_serves_with_torch_unimportable(router_without_torch):
    channel, proc = router_without_torch
    gen = generation_pb2_grpc.GenerationStub(channel)
    # validation runs (tokenizer, limits) and answers a person-readable INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as err:
        gen.Generate(generation_pb2.GenerateRequest(prompt="def f():", max_tokens=0), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_tokens" in err.value.details()
    # the control plane (policies, controller assessment) runs too
    admin = policy_pb2_grpc.PolicyAdminStub(channel)
    eff = admin.GetEffectivePolicy(policy_pb2.GetEffectivePolicyRequest(workload_class="code"),
                                   metadata=[("authorization", "Bearer t0ken")], timeout=10)
    assert eff.decision.decision == "learn" and eff.decision.draft_pool == "small"
    assert proc.poll() is None
