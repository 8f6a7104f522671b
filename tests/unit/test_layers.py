"""The layers hold (docs/design.md §1; the contract is `[tool.importlinter]` in pyproject.toml):
`lint-imports` keeps the contract on the code as it is, and breaks it on a copy of the code
with one upward import added (the algorithm importing the engine) and on one with a service
importing another."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LINT = Path(sys.executable).with_name("lint-imports")


def _lint(root: Path) -> subprocess.CompletedProcess:
    env = {"PYTHONPATH": str(root / "src"), "PATH": str(LINT.parent)}
    return subprocess.run([str(LINT), "--no-cache"], cwd=root, env=env, capture_output=True, text=True, timeout=300)


def _copy(tmp_path: Path) -> Path:
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    shutil.copytree(ROOT / "src" / "specserve", tmp_path / "src" / "specserve",
                    ignore=shutil.ignore_patterns("__pycache__", "v1"))
    return tmp_path


@pytest.fixture(scope="module")
def lint_ok():
    if not LINT.exists():
        pytest.fail(f"{LINT} is missing: `make setup` installs import-linter (the dev extra)")
    return _lint(ROOT)


def test_the_code_keeps_its_layers(lint_ok):
    assert lint_ok.returncode == 0, lint_ok.stdout + lint_ok.stderr
    assert "1 kept, 0 broken" in lint_ok.stdout


def test_an_upward_import_breaks_them(tmp_path):
    root = _copy(tmp_path)
    rng = root / "src" / "specserve" / "algorithm" / "rng.py"
    rng.write_text(rng.read_text() + "\nimport specserve.engine.loop  # noqa: E402,F401 (the scratch arrow up)\n")
    out = _lint(root)
    assert out.returncode != 0 and "BROKEN" in out.stdout, out.stdout
    assert "specserve.algorithm.rng -> specserve.engine.loop" in out.stdout


def test_a_service_importing_another_breaks_them(tmp_path):
    root = _copy(tmp_path)
    server = root / "src" / "specserve" / "services" / "draft" / "server.py"
    server.write_text(server.read_text() + "\nimport specserve.services.router.planner  # noqa: E402,F401\n")
    out = _lint(root)
    assert out.returncode != 0 and "specserve.services.draft.server -> specserve.services.router.planner" in out.stdout
