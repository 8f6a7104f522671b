"""The chart lints, renders with the default and the production-like values, and every object
it renders is valid: core kinds against the Kubernetes schemas (kubernetes-validate, strict:
unknown fields fail), ray.io/v1 kinds against the KubeRay CRD kept in tests/helm/data."""

from __future__ import annotations

import copy
from functools import cache
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from rendered import CHART, CRDS, KUBE_VERSION, PRODUCTION_VALUES, find, run_helm

CRD_FILES = {"RayCluster": "ray.io_rayclusters.yaml"}  # the chart renders no other ray.io kind
# Prometheus Operator kinds: rendered only when observability.serviceMonitor.enabled; no schema
# ships offline, test_helm_manifests checks their selectors instead.
PROMETHEUS_KINDS = {"ServiceMonitor", "PodMonitor"}


@pytest.mark.parametrize("values", [[], [PRODUCTION_VALUES]], ids=["default", "production"])
def test_helm_lint_strict(helm, values):
    args = ["lint", "--strict", str(CHART), "--kube-version", KUBE_VERSION]
    for v in values:
        args += ["-f", str(v)]
    proc = run_helm(helm, *args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 chart(s) failed" in proc.stdout


def test_default_install_has_every_component(default_manifests):
    kinds = {(m["kind"], m["metadata"]["name"]) for m in default_manifests}
    for expected in [("Deployment", "spec-specserve-router"), ("Service", "spec-specserve-router"),
                     ("HorizontalPodAutoscaler", "spec-specserve-router"),
                     ("PodDisruptionBudget", "spec-specserve-router"),
                     ("Deployment", "spec-specserve-draft-small"),
                     ("Service", "spec-specserve-draft-small"),
                     ("Deployment", "spec-specserve-draft-ngram"),
                     ("Service", "spec-specserve-draft-ngram"),
                     ("RayCluster", "spec-specserve-target"),
                     ("StatefulSet", "spec-specserve-redis"), ("Secret", "spec-specserve-redis"),
                     ("Service", "spec-specserve-redis"),
                     ("ConfigMap", "spec-specserve-otel-collector"),
                     ("ConfigMap", "spec-specserve-grafana-dashboard"),
                     ("ConfigMap", "spec-specserve-prometheus-rules")]:
        assert expected in kinds, f"{expected} missing from the default install"
    assert not find(default_manifests, "ServiceMonitor"), "ServiceMonitor is opt-in"


def test_external_redis_renders_no_bundled_redis(production_manifests):
    assert not [m for m in production_manifests if "redis" in m["metadata"]["name"]]
    assert find(production_manifests, "ServiceMonitor") and find(production_manifests, "PodMonitor")
    pools = {m["metadata"]["labels"].get("specserve.io/pool")
             for m in find(production_manifests, "Deployment")}
    assert pools == {None, "qwen3-0-6b", "ngram"}  # the router, and one per pool


def test_core_objects_are_valid_kubernetes(manifests):
    checked = 0
    for m in manifests:
        if m["apiVersion"].startswith("ray.io/") or m["kind"] in PROMETHEUS_KINDS:
            continue
        try:
            kubernetes_validate.validate(m, KUBE_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            path = "/".join(str(p) for p in exc.path)
            pytest.fail(f"{m['kind']}/{m['metadata']['name']}: {path}: {exc.message}")
        except kubernetes_validate.SchemaNotFoundError as exc:
            pytest.fail(f"no Kubernetes schema for {m['apiVersion']} {m['kind']}: {exc.message}")
        checked += 1
    assert checked >= 15


def _strict(schema: Any) -> Any:
    """Refuse unknown fields where the CRD lists the known ones (as the API server's pruning
    would silently drop them): additionalProperties false unless preserve-unknown-fields."""
    if isinstance(schema, dict):
        out = {k: _strict(v) for k, v in schema.items()}
        if ("properties" in out and "additionalProperties" not in out
                and not out.get("x-kubernetes-preserve-unknown-fields")):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


@cache
def crd_validator(kind: str, version: str) -> jsonschema.Draft7Validator:
    path = CRDS / CRD_FILES[kind]
    if not path.exists():
        pytest.fail(f"KubeRay CRD {path} not found: it is test data of the repository")
    crd = yaml.safe_load(path.read_text())
    (schema,) = [v["schema"]["openAPIV3Schema"] for v in crd["spec"]["versions"]
                 if v["name"] == version]
    return jsonschema.Draft7Validator(_strict(copy.deepcopy(schema)))


def test_ray_objects_match_the_kuberay_crd(manifests):
    ray_objects = [m for m in manifests if m["apiVersion"].startswith("ray.io/")]
    assert [m["kind"] for m in ray_objects] == ["RayCluster"]
    for m in ray_objects:
        group_version = m["apiVersion"].split("/")[1]
        assert group_version == "v1"
        errors = sorted(crd_validator(m["kind"], group_version).iter_errors(m), key=str)
        assert not errors, "\n".join(
            f"{'/'.join(map(str, e.path))}: {e.message}" for e in errors[:10])


def test_crd_validation_catches_a_bad_raycluster(default_manifests):
    (ray,) = find(default_manifests, "RayCluster")
    bad = copy.deepcopy(ray)
    bad["spec"]["workerGroupSpecs"][0]["replicaz"] = 1
    del bad["spec"]["workerGroupSpecs"][0]["maxReplicas"]
    messages = [e.message for e in crd_validator("RayCluster", "v1").iter_errors(bad)]
    assert any("maxReplicas" in msg for msg in messages)
    assert any("replicaz" in msg for msg in messages)


def test_every_kind_is_validated_somewhere(manifests):
    for m in manifests:
        kind = m["kind"]
        if m["apiVersion"].startswith("ray.io/"):
            assert kind in CRD_FILES
        elif kind not in PROMETHEUS_KINDS:
            assert "." not in m["apiVersion"].split("/")[0] or m["apiVersion"].split("/")[0].endswith(
                ".k8s.io"), f"{m['apiVersion']} {kind} is neither core nor validated"
