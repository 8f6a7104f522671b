"""Rendering the chart offline: a pinned helm (helm_tool.py), `helm template` with the default
values, with ci/production-values.yaml and with each Redis mode (rendered.REDIS_MODES), parsed
into objects for the tests."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from helm_tool import HelmUnavailable, ensure_helm
from rendered import PRODUCTION_VALUES, REDIS_MODES, Manifest, template


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


_RENDERED_MODES: dict[str, list[Manifest]] = {}


def _mode(render, name: str) -> list[Manifest]:
    if name not in _RENDERED_MODES:
        _RENDERED_MODES[name] = render(sets=REDIS_MODES[name])
    return _RENDERED_MODES[name]


@pytest.fixture(scope="session", params=sorted(REDIS_MODES))
def redis_mode(request, render) -> tuple[str, list[Manifest]]:
    """(name, manifests) for each redis.source x redis.mode: "bundled-sentinel", ..."""
    return request.param, _mode(render, request.param)


# default: bundled-standalone; production: an external standalone Redis over TLS
ALL_RENDERINGS = ["default", "production"] + [m for m in sorted(REDIS_MODES) if m != "bundled-standalone"]


@pytest.fixture(scope="session", params=ALL_RENDERINGS)
def manifests(request, render, default_manifests, production_manifests) -> list[Manifest]:
    """Each test that takes this runs on every rendering: the default and production values,
    and every other Redis mode."""
    if request.param == "default":
        return default_manifests
    if request.param == "production":
        return production_manifests
    return _mode(render, request.param)
