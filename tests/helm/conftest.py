"""Rendering the chart offline: a pinned helm (helm_tool.py), `helm template` with the default
values and with ci/production-values.yaml, parsed into objects for the tests."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from helm_tool import HelmUnavailable, ensure_helm
from rendered import PRODUCTION_VALUES, Manifest, template


@pytest.fixture(scope="session")
def helm() -> Path:
    try:
        return ensure_helm()
    except HelmUnavailable as exc:
        pytest.skip(f"helm tests skipped, no helm binary: {exc}")


@pytest.fixture(scope="session")
def render(helm: Path) -> Callable[..., list[Manifest]]:
    def _render(*values: Path, sets: tuple[str, ...] = ()) -> list[Manifest]:
        return template(helm, *values, sets=sets)

    return _render


@pytest.fixture(scope="session")
def default_manifests(render) -> list[Manifest]:
    return render()


@pytest.fixture(scope="session")
def production_manifests(render) -> list[Manifest]:
    return render(PRODUCTION_VALUES)


@pytest.fixture(scope="session", params=["default", "production"])
def manifests(request, default_manifests, production_manifests) -> list[Manifest]:
    """Each test that takes this runs on both renderings."""
    return default_manifests if request.param == "default" else production_manifests
