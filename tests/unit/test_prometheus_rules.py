"""The Prometheus rules (deploy/prometheus/, ADR 0015): promtool accepts them and their unit
tests pass, the tests bite (a weakened threshold fails them), every rule is tested, every name
a rule reads is exported by a service, every alert has a summary and a runbook entry, the chart
ships the same file, and the test-window transformation divides every window."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from specserve.serving.metrics import RoundMetrics, RouterMetrics, WorkerMetrics
from specserve.tooling import promrules

ROOT = Path(__file__).resolve().parents[2]
RULE_TESTS = sorted((ROOT / "deploy" / "prometheus" / "tests").glob("*_test.yaml"))
CHART_COPY = ROOT / "helm" / "specserve" / "files" / "prometheus" / "specserve-rules.yaml"
RUNBOOK = ROOT / "docs" / "runbook.md"
SPECSERVE_NAME = re.compile(r"(?<![:\w])specserve_[a-z0-9_]+")
SUFFIX = re.compile(r"_(bucket|sum|count|total)$")


@pytest.fixture(scope="module")
def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.skip("promtool not found: `make prometheus-tools` installs it (apt-get install prometheus, as root)")
    return path


def _promtool(promtool: str, *args: str | Path, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([promtool, *map(str, args)], cwd=cwd, capture_output=True, text=True, timeout=120)


def test_promtool_accepts_the_rules(promtool):
    out = _promtool(promtool, "check", "rules", promrules.RULES, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout


def test_rule_unit_tests_pass(promtool):
    assert RULE_TESTS, "no promtool tests found in deploy/prometheus/tests"
    out = _promtool(promtool, "test", "rules", *RULE_TESTS, cwd=RULE_TESTS[0].parent)
    assert out.returncode == 0, out.stdout + out.stderr


def test_rule_unit_tests_catch_a_weakened_alert(promtool, tmp_path):
    """The same tests against rules whose acceptance-drop threshold is 0.1 instead of 0.7 (a drop
    would have to be 90% to page): they must fail, or they test nothing."""
    text = promrules.RULES.read_text()
    assert "(0.7 * workload_class:specserve" in text
    (tmp_path / "tests").mkdir()
    weakened = text.replace("(0.7 * workload_class:specserve", "(0.1 * workload_class:specserve")
    (tmp_path / "specserve-rules.yaml").write_text(weakened)
    for t in RULE_TESTS:
        (tmp_path / "tests" / t.name).write_text(t.read_text())
    out = _promtool(promtool, "test", "rules", *(t.name for t in RULE_TESTS), cwd=tmp_path / "tests")
    assert out.returncode != 0
    assert "SpecserveAcceptanceDrop" in out.stdout + out.stderr


def test_every_rule_has_a_promtool_test():
    records, alerts = promrules.names(promrules.load())
    tests = [yaml.safe_load(t.read_text()) for t in RULE_TESTS]
    cases = [c for doc in tests for group in doc["tests"] for c in group.get("alert_rule_test", [])]
    fired = {c["alertname"] for c in cases if c["exp_alerts"]}
    quiet = {c["alertname"] for c in cases if not c["exp_alerts"]}
    tested = " ".join(c["expr"] for doc in tests for group in doc["tests"] for c in group.get("promql_expr_test", []))
    assert alerts - fired == set(), "alerts never shown firing"
    assert alerts - quiet == set(), "alerts never shown quiet"
    assert {r for r in records if r not in tested} == set(), "recording rules without a promtool test"


def test_rules_read_only_exported_metric_families():
    exported = set()
    for metrics in (RouterMetrics(), RoundMetrics(), WorkerMetrics("draft"), WorkerMetrics("target")):
        exported |= {fam.name for fam in metrics.registry.collect()}
    exprs = " ".join(r["expr"] for g in promrules.load()["groups"] for r in g["rules"])
    read = {SUFFIX.sub("", n) for n in SPECSERVE_NAME.findall(exprs)}
    assert "specserve_accepted_drafts" in read
    assert read - exported == set(), "rules read metrics no service exports"


def test_every_alert_has_a_summary_and_a_runbook_entry():
    runbook = RUNBOOK.read_text()
    headings = {re.sub(r"[^a-z0-9]", "", h.lower()) for h in re.findall(r"^## (.+)$", runbook, re.M)}
    alerts = [r for g in promrules.load()["groups"] for r in g["rules"] if "alert" in r]
    assert len(alerts) >= 9
    for a in alerts:
        assert a["annotations"]["summary"], a["alert"]
        anchor = a["annotations"]["runbook"].split("#", 1)[1]
        assert anchor in headings, f"{a['alert']}: no '## {a['alert']}' section in docs/runbook.md"
        assert a["labels"]["severity"] in {"page", "ticket"}


def test_the_chart_ships_the_same_rules():
    assert CHART_COPY.read_bytes() == promrules.RULES.read_bytes(), \
        "helm/specserve/files/prometheus/specserve-rules.yaml must link to deploy/prometheus/"


def test_shorten_divides_every_window_and_for():
    rules = promrules.load()
    short = promrules.shorten(rules, 60)
    long_rules = [r for g in rules["groups"] for r in g["rules"]]
    short_rules = [r for g in short["groups"] for r in g["rules"]]
    for before, after in zip(long_rules, short_rules, strict=True):
        ranges = [promrules.seconds(d) for d in re.findall(r"\[(\w+)\]", before["expr"])]
        assert [promrules.seconds(d) for d in re.findall(r"\[(\w+)\]", after["expr"])] == \
            [max(4, r / 60) for r in ranges]
        if "for" in before:
            assert promrules.seconds(after["for"]) == promrules.seconds(before["for"]) / 60
        assert re.sub(r"\[\w+\]", "", before["expr"]) == re.sub(r"\[\w+\]", "", after["expr"])
    assert rules == promrules.load(), "shorten must not modify its argument"


def test_seconds_refuses_compound_durations():
    assert promrules.seconds("10m") == 600
    with pytest.raises(ValueError, match="single-unit"):
        promrules.seconds("1h30m")
