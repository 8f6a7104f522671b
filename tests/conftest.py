"""Shared fixtures: the quick `tiny` model pair (built once, cached by config hash)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("SPECSERVE_TEST_MODELS", ROOT / ".cache" / "models"))

torch.set_num_threads(2)


@pytest.fixture(scope="session")
def tiny_pair_dir() -> Path:
    from specserve.tooling.modelbuild.build import PRESETS, build_pair

    return build_pair(PRESETS["tiny"], CACHE, log=lambda *_: None)


@pytest.fixture(scope="session")
def tiny_pair(tiny_pair_dir):
    from specserve.models.loading import load_pair

    return load_pair(str(tiny_pair_dir / "target"), str(tiny_pair_dir / "draft"))


@pytest.fixture(scope="session")
def eval_prompts(tiny_pair_dir) -> list[dict]:
    from specserve.tooling.modelbuild.build import load_eval_prompts

    return load_eval_prompts(tiny_pair_dir)


@pytest.fixture(scope="session")
def target_model(tiny_pair):
    from specserve.models.verifier import TargetModel

    return TargetModel(tiny_pair.target)
