"""The chart's tensor-parallel target (ADR 0030): the worker pod asks for every rank's GPUs, the
launcher is told the degree, and the schema refuses a degree the model's heads cannot split."""

from __future__ import annotations

from pathlib import Path

import pytest
from rendered import containers, env_of, run_helm, template_args


def _worker(manifests) -> tuple[dict, dict]:
    by_name = {where: c for where, _, c in containers(manifests)}
    return (by_name["RayCluster/spec-specserve-target/large-gpu/ray-worker"],
            by_name["RayCluster/spec-specserve-target/large-gpu/target-launcher"])


def test_a_tp2_target_asks_for_two_gpus_in_its_pod(render, default_manifests):
    ray, launcher = _worker(render(sets=("target.tensorParallel=2", "target.attentionHeads=32",
                                          "target.kvHeads=8")))
    assert ray["resources"]["limits"]["nvidia.com/gpu"] == 2
    env = env_of(launcher)
    assert env["SPECSERVE_TARGET_TENSOR_PARALLEL"]["value"] == "2"
    assert env["SPECSERVE_TARGET_NUM_GPUS"]["value"] == "1"  # per rank
    one, launcher1 = _worker(default_manifests)
    assert one["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert env_of(launcher1)["SPECSERVE_TARGET_TENSOR_PARALLEL"]["value"] == "1"


@pytest.mark.parametrize("sets, message", [
    (("target.tensorParallel=3", "target.attentionHeads=32", "target.kvHeads=8"), "target.tensorParallel"),
    (("target.tensorParallel=8", "target.attentionHeads=12", "target.kvHeads=4"), "target.attentionHeads"),
    (("target.tensorParallel=4", "target.attentionHeads=32", "target.kvHeads=2"), "target.kvHeads"),
])
def test_the_schema_refuses_a_degree_the_heads_cannot_split(helm: Path, sets, message):
    proc = run_helm(helm, *template_args(sets=sets))
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr[-1500:]
