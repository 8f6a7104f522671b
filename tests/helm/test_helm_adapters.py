"""The chart's LoRA adapters (ADR 0029): the target's adapters reach its launcher as the JSON
SPECSERVE_TARGET_ADAPTERS reads (with its room, max_loras / max_lora_rank), and a draft pool of an
adapter's own drafter gets its draft-side adapter (SPECSERVE_DRAFT_LORA)."""

from __future__ import annotations

import json

import yaml
from rendered import containers, env_of
from test_helm_values import default_values

from specserve.config import DraftSettings, TargetSettings


def test_adapters_reach_the_target_and_a_pool_its_draft_side_adapter(render, tmp_path, monkeypatch):
    values = default_values()
    values["target"]["settings"].update(adapters={"sql-v2": "/models/adapters/sql-v2/target"}, max_loras=8)
    values["draft"]["pools"][0]["settings"]["lora"] = "/models/adapters/sql-v2/draft"
    (tmp_path / "values.yaml").write_text(yaml.safe_dump(values))
    manifests = render(tmp_path / "values.yaml")
    by_name = {where: c for where, _, c in containers(manifests)}
    launcher = env_of(by_name["RayCluster/spec-specserve-target/large-gpu/target-launcher"])
    assert json.loads(launcher["SPECSERVE_TARGET_ADAPTERS"]["value"]) == {"sql-v2": "/models/adapters/sql-v2/target"}
    for name in ("SPECSERVE_TARGET_ADAPTERS", "SPECSERVE_TARGET_MAX_LORAS"):  # as the target reads them
        monkeypatch.setenv(name, launcher[name]["value"])
    target = TargetSettings()
    assert target.adapters == {"sql-v2": "/models/adapters/sql-v2/target"} and target.max_loras == 8
    small = next(c for where, _, c in containers(manifests) if "draft-small" in where)
    monkeypatch.setenv("SPECSERVE_DRAFT_LORA", env_of(small)["SPECSERVE_DRAFT_LORA"]["value"])
    assert DraftSettings().lora == "/models/adapters/sql-v2/draft"
