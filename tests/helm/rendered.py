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


def run_helm(helm: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(helm), *args], capture_output=True, text=True, timeout=120)


def template_args(*values: Path, sets: tuple[str, ...] = ()) -> list[str]:
    args = ["template", RELEASE, str(CHART), "--namespace", NAMESPACE,
            "--kube-version", KUBE_VERSION]
    for v in values:
        args += ["-f", str(v)]
    for s in sets:
        args += ["--set", s]
    return args


def template(helm: Path, *values: Path, sets: tuple[str, ...] = ()) -> list[Manifest]:
    proc = run_helm(helm, *template_args(*values, sets=sets))
    assert proc.returncode == 0, proc.stderr
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


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
