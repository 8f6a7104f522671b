"""The images in deploy/docker/ (which cannot be built here): pinned base images, a non-root
user, entrypoints that are the services' modules, `make proto` in the build, versions that
agree with pyproject.toml, the Makefile and the chart; and a router image without the heavy
dependencies still imports the router."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib

import pytest
import yaml
from packaging.requirements import Requirement
from rendered import CHART, ROOT

DOCKER = ROOT / "deploy" / "docker"
SERVICES = {"router": [50051, 9090], "draft": [50061, 9090], "target": [50071, 9090]}
PINNED = re.compile(r"^[\w.\-/]+:(\d+\.\d+\.\d+)[\w.\-]*(@sha256:[0-9a-f]{64})?$|^[\w.\-/]+@sha256:[0-9a-f]{64}$")


def instructions(service: str) -> list[tuple[str, str]]:
    text = (DOCKER / f"{service}.Dockerfile").read_text()
    text = re.sub(r"\\\n", " ", text)  # line continuations
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            op, _, rest = line.partition(" ")
            out.append((op.upper(), rest.strip()))
    return out


def args(service: str) -> dict[str, str]:
    return dict(rest.split("=", 1) for op, rest in instructions(service) if op == "ARG" and "=" in rest)


def final_stage(service: str) -> list[tuple[str, str]]:
    ins = instructions(service)
    last_from = max(i for i, (op, _) in enumerate(ins) if op == "FROM")
    return ins[last_from:]


def pyproject_deps() -> dict[str, Requirement]:
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    reqs = [Requirement(d) for d in data["project"]["dependencies"]]
    return {r.name.lower(): r for r in reqs}


@pytest.mark.parametrize("service", SERVICES)
def test_base_images_are_pinned(service):
    defaults = args(service)
    for op, rest in instructions(service):
        if op != "FROM":
            continue
        image = rest.split()[0]
        image = re.sub(r"\$\{(\w+)\}", lambda m: defaults[m.group(1)], image)
        assert PINNED.match(image), f"{service}: base image {image} is not pinned"
        assert ":latest" not in image
        if "python" in image:
            assert re.search(r":3\.11\.\d+-", image), "pyproject.toml requires Python 3.11"


@pytest.mark.parametrize("service", SERVICES)
def test_runs_as_a_non_root_user(service):
    users = [rest for op, rest in final_stage(service) if op == "USER"]
    assert users, f"{service}: the final stage sets no USER"
    uid = users[-1].split(":")[0]
    assert uid not in ("root", "0") and uid.isdigit(), \
        f"{service}: USER {users[-1]} (numeric, non-zero: runAsNonRoot can check it)"
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert int(uid) == values["podSecurityContext"]["runAsUser"]


@pytest.mark.parametrize("service", SERVICES)
def test_entrypoint_is_the_service_module(service):
    (entrypoint,) = [json.loads(rest) for op, rest in final_stage(service) if op == "ENTRYPOINT"]
    assert entrypoint == ["python", "-m", f"specserve.services.{service}"]
    assert (ROOT / "src" / "specserve" / "services" / service / "__main__.py").exists()
    exposed = {int(p) for op, rest in final_stage(service) if op == "EXPOSE" for p in rest.split()}
    assert set(SERVICES[service]) <= exposed


@pytest.mark.parametrize("service", SERVICES)
def test_build_generates_the_stubs_like_make_proto(service):
    runs = " ".join(rest for op, rest in instructions(service) if op == "RUN")
    makefile = (ROOT / "Makefile").read_text()
    protoc = re.search(r"-m grpc_tools\.protoc (-Iproto [^$]+)\$\(PROTOS\)", makefile).group(1).strip()
    assert f"grpc_tools.protoc {protoc} proto/specserve/v1/*.proto" in runs
    assert "src/specserve/v1/__init__.py" in runs
    copied = {rest.split()[0] for op, rest in instructions(service) if op == "COPY"}
    assert {"pyproject.toml", "proto/", "src/"} <= copied
    ignore = (DOCKER / f"{service}.Dockerfile.dockerignore").read_text().splitlines()
    assert ignore[[line.startswith("#") for line in ignore].index(False)] == "*", \
        "the build context should be an allow-list (.venv, models and .cache stay out)"


def test_the_worker_images_take_the_cpu_torch_by_default_and_cuda_by_a_build_argument():
    """Issue 21: a CUDA variant of the draft and target images by a build argument; the CPU
    build stays the default (PyPI's Linux wheel is the CUDA one)."""
    for service in ("draft", "target"):
        assert args(service)["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu", service
        text = (DOCKER / f"{service}.Dockerfile").read_text()
        assert "--build-arg TORCH_INDEX_URL=https://pypi.org/simple" in text, service
        assert 'pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"' in text, service


def test_versions_agree_with_makefile_pyproject_and_chart():
    torch_pin = re.search(r"torch==([\d.]+)", (ROOT / "Makefile").read_text()).group(1)
    for service in set(SERVICES) - {"router"}:  # the router image has no torch
        assert args(service)["TORCH_VERSION"] == torch_pin, service
        assert pyproject_deps()["torch"].specifier.contains(torch_pin)
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert args("target")["RAY_VERSION"] == values["target"]["rayVersion"]
    assert pyproject_deps()["ray"].specifier.contains(values["target"]["rayVersion"])
    assert 'ray[default]==${RAY_VERSION}' in " ".join(r for op, r in instructions("target") if op == "RUN")


def router_requirements() -> list[Requirement]:
    lines = (DOCKER / "router-requirements.txt").read_text().splitlines()
    return [Requirement(line) for line in lines if line.strip() and not line.startswith("#")]


def test_router_requirements_are_pyprojects():
    deps = pyproject_deps()
    for req in router_requirements():
        assert req.name.lower() in deps, f"{req.name} is not a dependency in pyproject.toml"
        assert str(req) == str(deps[req.name.lower()]), f"{req} differs from pyproject.toml"
    runs = " ".join(rest for op, rest in instructions("router") if op == "RUN")
    assert "pip install --no-deps ." in runs
    assert "torch" not in runs and "TORCH_VERSION" not in args("router")  # torch-free (issue: router's shape)


# distribution -> top-level module, for what the router image leaves out
MODULES = {"torch": "torch", "transformers": "transformers", "safetensors": "safetensors", "ray": "ray",
           "typer": "typer", "rich": "rich"}


def test_router_imports_without_what_its_image_leaves_out():
    left_out = set(pyproject_deps()) - {r.name.lower() for r in router_requirements()}
    assert left_out == set(MODULES), "update MODULES with the router image's omissions"
    blocked = ",".join(MODULES[d] for d in left_out)
    code = (
        "import importlib.abc, sys\n"
        f"BLOCKED = set({blocked!r}.split(','))\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path, target=None):\n"
        "        if name.partition('.')[0] in BLOCKED:\n"
        "            raise ImportError(name + ' is not in the router image')\n"
        "sys.meta_path.insert(0, Block())\n"
        "import specserve.services.router.__main__\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
