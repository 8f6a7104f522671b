"""What the helm tests share: where things are, running helm, walking rendered manifests."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "specserve"
PRODUCTION_VALUES = CHART / "ci" / "production-values.yaml"
# the KubeRay CRD the chart's RayCluster is validated against (test data, source in its README)
CRDS = Path(__file__).resolve().parent / "data"
KUBE_VERSION = "1.31.0"
NAMESPACE = "specserve"
RELEASE = "spec"

Manifest = dict[str, Any]

# The Redis of every rendering below: redis.source x redis.mode, as `--set`s over the default
# values. An external Redis takes its password from this Secret.
EXTERNAL_SECRET = "ext-redis"
EXTERNAL_SENTINELS = ("sentinel-a.cache.example.internal:26379", "sentinel-b.cache.example.internal:26379",
                      "sentinel-c.cache.example.internal:26379")
EXTERNAL_MASTER = "cache-primary"
EXTERNAL_NODES = ("node-a.cache.example.internal:6379", "node-b.cache.example.internal:6379")
EXTERNAL_URL = "redis://redis.cache.example.internal:6379/0"
REDIS_MODES: dict[str, tuple[str, ...]] = {
    "bundled-standalone": (),
    "bundled-sentinel": ("redis.mode=sentinel",),
    "bundled-cluster": ("redis.mode=cluster",),
    "external-standalone": ("redis.source=external", f"redis.external.url={EXTERNAL_URL}",
                            f"redis.external.existingSecret={EXTERNAL_SECRET}"),
    "external-sentinel": ("redis.source=external", "redis.mode=sentinel",
                          f"redis.external.sentinels={{{','.join(EXTERNAL_SENTINELS)}}}",
                          f"redis.external.masterName={EXTERNAL_MASTER}",
                          f"redis.external.existingSecret={EXTERNAL_SECRET}"),
    "external-cluster": ("redis.source=external", "redis.mode=cluster",
                         f"redis.external.nodes={{{','.join(EXTERNAL_NODES)}}}",
                         f"redis.external.existingSecret={EXTERNAL_SECRET}"),
}


def run_helm(helm: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(helm), *args], capture_output=True, text=True, timeout=120)


def template_args(*values: Path, sets: tuple[str, ...] = ()) -> list[str]:
    args = ["template", RELEASE, str(CHART), "--namespace", NAMESPACE,
            "--kube-version", KUBE_VERSION]
    for v in values:
        args += ["-f", str(v)]
    return args + set_args(sets)


def template(helm: Path, *values: Path, sets: tuple[str, ...] = ()) -> list[Manifest]:
    proc = run_helm(helm, *template_args(*values, sets=sets))
    assert proc.returncode == 0, proc.stderr
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


def set_args(sets: tuple[str, ...]) -> list[str]:
    return [arg for s in sets for arg in ("--set", s)]


def pod_specs(manifests: list[Manifest]) -> Iterator[tuple[str, Manifest]]:
    """(where, pod spec) for every pod template: workloads and the RayCluster's groups."""
    for m in manifests:
        kind, name = m["kind"], m["metadata"]["name"]
        if kind in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
            yield f"{kind}/{name}", m["spec"]["template"]["spec"]
        elif kind == "RayCluster":
            yield f"{kind}/{name}/head", m["spec"]["headGroupSpec"]["template"]["spec"]
            for group in m["spec"].get("workerGroupSpecs", []):
                yield f"{kind}/{name}/{group['groupName']}", group["template"]["spec"]


def containers(manifests: list[Manifest]) -> Iterator[tuple[str, Manifest, Manifest]]:
    """(where, pod spec, container) for every container and init container."""
    for where, spec in pod_specs(manifests):
        for c in spec.get("initContainers", []) + spec["containers"]:
            yield f"{where}/{c['name']}", spec, c


def find(manifests: list[Manifest], kind: str, name: str | None = None) -> list[Manifest]:
    return [m for m in manifests if m["kind"] == kind
            and (name is None or m["metadata"]["name"] == name)]


def env_of(container: Manifest) -> dict[str, Manifest]:
    """name -> env entry (value or valueFrom)."""
    return {e["name"]: e for e in container.get("env", [])}
