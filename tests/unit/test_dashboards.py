"""Observability deploy files (DESIGN §6): the Grafana dashboard queries only metrics the services
export, covers every §6 metric and links slow rounds to traces; the collector config wires OTLP
traces to Tempo and metrics to a Prometheus exporter; the round waterfall renders a trace."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from specserve.serving.busy import BusyMeter, DeviceCollector
from specserve.serving.metrics import RoundMetrics, RouterMetrics, WorkerMetrics
from specserve.tooling import promrules, waterfall

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "specserve.json"
COLLECTOR = ROOT / "deploy" / "otel-collector.yaml"

# a recorded series (deploy/prometheus/, `level:metric:operation`) is not an exported name
RECORDED = re.compile(r"[a-z_]+:specserve_[a-z0-9_]+:[a-z0-9_]+")
NAME = re.compile(r"(?<![:\w])specserve_[a-z0-9_]+(?!:)")
SUFFIX = re.compile(r"_(bucket|sum|count|total|created)$")
_EXPOSED = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"),
            "gauge": ("",)}


# ------------------------------------------------------------------ helpers


def _families() -> dict[str, str]:
    """Metric family name -> type, as the router and both workers export them."""
    out: dict[str, str] = {}
    for metrics in (RouterMetrics(), RoundMetrics(), WorkerMetrics("draft"), WorkerMetrics("target")):
        for fam in metrics.registry.collect():
            out[fam.name] = fam.type
    # a GPU node's NVML families (absent here: no NVML), as its worker exports them
    gpu = SimpleNamespace(nvmlDeviceGetCount=lambda: 1, nvmlDeviceGetHandleByIndex=lambda i: i,
                          nvmlDeviceGetUtilizationRates=lambda h: SimpleNamespace(gpu=50),
                          nvmlDeviceGetMemoryInfo=lambda h: SimpleNamespace(used=1, total=2))
    for fam in DeviceCollector("target", BusyMeter(), nvml=gpu).collect():
        out[fam.name] = fam.type
    return out


def _walk(node, key: str | None = None):
    """Every (key, value) pair of a JSON document, depth first (rows, panels, targets...)."""
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _walk(v, k)
    elif isinstance(node, list):
        for v in node:
            yield from _walk(v, key)
    else:
        yield key, node


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


@pytest.fixture(scope="module")
def exprs(dashboard) -> list[str]:
    return [v for k, v in _walk(dashboard) if k == "expr" and isinstance(v, str)]


def _panels(dashboard: dict):
    for p in dashboard["panels"]:
        yield p
        yield from p.get("panels", [])  # collapsed rows keep their panels inside


# ------------------------------------------------------------------ dashboard


def test_dashboard_queries_only_exported_metric_families(exprs):
    families = _families()
    assert {"specserve_accepted_drafts", "specserve_proposed_tokens", "specserve_draft_call_seconds",
            "specserve_target_sessions"} <= set(families)  # the registries really were collected
    queried = {SUFFIX.sub("", n) for e in exprs for n in NAME.findall(e)}
    assert queried, "no specserve_ metric found in any expr"
    assert queried <= set(families), f"not exported by any service: {sorted(queried - set(families))}"


def test_dashboard_reads_only_recorded_series_the_rules_record(exprs):
    used = {n for e in exprs for n in RECORDED.findall(e)}
    assert "workload_class_draft_pool:specserve_acceptance_length:mean5m" in used
    records, _ = promrules.names(promrules.load())
    assert used <= records, f"not recorded by deploy/prometheus/specserve-rules.yaml: {sorted(used - records)}"


def test_dashboard_uses_exposed_sample_names(dashboard):
    """Stricter: each name as Prometheus stores it (a Counter only as `_total`, a Histogram only
    as `_bucket`/`_sum`/`_count`), in exprs and in the variables' label_values queries too."""
    exposed = {fam + suffix for fam, kind in _families().items() for suffix in _EXPOSED[kind]}
    used = {n for _, v in _walk(dashboard) if isinstance(v, str) for n in NAME.findall(v)}
    assert used, "no specserve_ metric in the dashboard"
    assert used <= exposed, f"never exposed under these names: {sorted(used - exposed)}"


# DESIGN §6 metric -> families that show it (all must be queried)
_COVERAGE = {
    "acceptance length": {"specserve_accepted_drafts"},
    "per-position acceptance": {"specserve_accepted_tokens", "specserve_proposed_tokens"},
    "target passes per output token": {"specserve_target_passes", "specserve_output_tokens",
                                       "specserve_target_passes_per_token"},
    "TPOT": {"specserve_tpot_seconds"},
    "TTFT": {"specserve_ttft_seconds"},
    "draft latency": {"specserve_draft_latency_seconds"},
    "verify latency": {"specserve_verify_latency_seconds"},
    "rollback tokens": {"specserve_rollback_tokens"},
    "rejected KV bytes": {"specserve_rejected_kv_bytes"},
    "fallbacks by reason": {"specserve_fallbacks"},
    "sessions active": {"specserve_sessions_active"},
}


def test_dashboard_covers_every_design_metric(exprs):
    queried = {SUFFIX.sub("", n) for e in exprs for n in NAME.findall(e)}
    missing = {what: sorted(fams - queried) for what, fams in _COVERAGE.items() if not fams <= queried}
    assert not missing, f"DESIGN §6 metrics missing from the dashboard: {missing}"
    # per position, fallbacks by reason: the breakdown label must be in the query
    assert any("specserve_accepted_tokens" in e and "position" in e for e in exprs)
    assert any("specserve_fallbacks" in e and "reason" in e for e in exprs)
    assert any("histogram_quantile" in e and "specserve_accepted_drafts_bucket" in e for e in exprs)


def test_router_queries_filter_by_class_and_pool(dashboard, exprs):
    # the per (class, pool) families: the control plane's and the engine's rounds
    router = {fam.name for m in (RouterMetrics(), RoundMetrics()) for fam in m.registry.collect()}
    router_exprs = [e for e in exprs if {SUFFIX.sub("", n) for n in NAME.findall(e)} & router]
    assert len(router_exprs) >= 15
    for e in router_exprs:
        assert 'workload_class=~"$workload_class"' in e and 'draft_pool=~"$draft_pool"' in e, e
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    for name in ("workload_class", "draft_pool"):
        query = variables[name]["query"]
        query = query["query"] if isinstance(query, dict) else query
        assert query.startswith("label_values(") and query.rstrip(")").endswith(name), query


def test_dashboard_is_well_formed(dashboard):
    assert dashboard["schemaVersion"] >= 36
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    panels = list(_panels(dashboard))
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "duplicate panel ids"
    for p in panels:
        assert {"h", "w", "x", "y"} <= set(p["gridPos"]) and p["gridPos"]["x"] + p["gridPos"]["w"] <= 24, p["title"]
        if p["type"] != "row":
            assert p.get("targets"), f"panel {p['title']!r} has no query"
            assert {"timeseries", "heatmap", "stat", "table", "traces"} >= {p["type"]}
    kinds = {p["type"] for p in panels}
    assert {"timeseries", "heatmap", "stat"} <= kinds


def test_dashboard_links_slow_rounds_to_traces(dashboard):
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert any(v["type"] == "datasource" and v["query"] in ("tempo", "jaeger") for v in variables.values())
    assert "slow_round" in variables
    trace_panels = [p for p in _panels(dashboard) if p.get("datasource", {}).get("type") in ("tempo", "jaeger")]
    queries = [t.get("query", "") for p in trace_panels for t in p["targets"]]
    assert any('name = "specserve.round"' in q and "duration > $slow_round" in q for q in queries), queries
    # the latency panels link each series to its slow rounds in the trace datasource
    for p in _panels(dashboard):
        if p["type"] == "timeseries" and any("latency_seconds" in t.get("expr", "") for t in p["targets"]):
            links = p["fieldConfig"]["defaults"].get("links", [])
            assert any("/explore" in lk["url"] and "${tempo}" in lk["url"] for lk in links), p["title"]
    # and the trace table links each trace ID
    urls = [v for k, v in _walk(dashboard) if k == "url"]
    table = next(p for p in trace_panels if p["type"] == "table")
    overrides = json.dumps(table["fieldConfig"]["overrides"])
    assert re.search(r"trace_?id", overrides, re.IGNORECASE) and "${__value.raw}" in overrides
    assert any("specserve.round" in _unquote(u) for u in urls)


def _unquote(url: str) -> str:
    from urllib.parse import unquote

    return unquote(url)


# ------------------------------------------------------------------ collector


def test_collector_pipelines():
    yaml = pytest.importorskip("yaml", reason="pyyaml is not installed in this environment")
    cfg = yaml.safe_load(COLLECTOR.read_text())
    pipes = cfg["service"]["pipelines"]

    def kinds(names: list[str]) -> list[str]:
        return [n.split("/")[0] for n in names]  # "otlp/tempo" is an otlp exporter

    assert "otlp" in kinds(pipes["traces"]["receivers"])
    assert "otlp" in kinds(pipes["traces"]["exporters"])
    assert "prometheus" in kinds(pipes["metrics"]["exporters"])
    assert cfg["exporters"]["prometheus"]["endpoint"].endswith(":8889")
    grpc = cfg["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"]
    assert grpc.endswith(":4317")
    # every component a pipeline names is defined in its section
    for pipe in pipes.values():
        for section in ("receivers", "processors", "exporters"):
            for name in pipe.get(section, []):
                assert name in (cfg.get(section) or {}), f"{section} {name} is not defined"
    assert pipes["traces"]["processors"][0] == "memory_limiter"  # must come first
    jobs = cfg["receivers"]["prometheus"]["config"]["scrape_configs"]
    assert any(j["job_name"] == "specserve" for j in jobs)


# ------------------------------------------------------------------ waterfall

MS = 1_000_000


def _span(trace_id, span_id, parent, name, kind, start_ms, end_ms, service, **attributes):
    return {"trace_id": trace_id, "span_id": span_id, "parent_span_id": parent, "name": name, "kind": kind,
            "start_ns": int(start_ms * MS), "end_ns": int(end_ms * MS), "service": service,
            "attributes": attributes}


def _synthetic_trace(trace_id: str = "t1", session: str = "sess-1") -> list[dict]:
    """router -> Start -> the engine's session: two rounds, each verifying a block the draft
    worker drafted for its prefix (the first one with a block drafted ahead under it)."""
    spans = [_span(trace_id, "g", None, "specserve.generate", "INTERNAL", 0, 40, "router",
                   **{"specserve.session_id": session, "specserve.workload_class": "chat",
                      "specserve.draft_pool": "small", "specserve.k": 4}),
             _span(trace_id, "st", "g", "specserve.v1.Target/Start", "SERVER", 0, 1, "target"),
             _span(trace_id, "es", "st", "specserve.engine.session", "INTERNAL", 0, 40, "target")]
    for i, (t0, acc, prefix) in enumerate([(5, 4, 10), (25, 1, 15)]):
        r = f"r{i}"
        spans += [
            _span(trace_id, f"{r}b", "es", "specserve.draft.block", "INTERNAL", t0 - 4, t0 - 1, "draft",
                  **{"specserve.prefix_len": prefix, "specserve.k": 4}),
            _span(trace_id, r, "es", "specserve.round", "INTERNAL", t0, t0 + 12, "target",
                  **{"specserve.k": 4, "specserve.num_accepted": acc, "specserve.emitted": acc + 1,
                     "specserve.prefix_len": prefix, "specserve.verify_ms": 10.0}),
        ]
    ahead = _span(trace_id, "ah", "r0b", "specserve.draft.ahead", "INTERNAL", 6, 12, "draft")
    # drafted ahead while round 0 verified: blocks for prefixes 15 (used? no: round 1 got its
    # own) and 20, which round 2 verified without waiting (specserve.predraft)
    ahead["events"] = [{"name": "specserve.predrafted", "time_ns": 8 * MS, "attributes": {"specserve.prefix_len": 15}},
                       {"name": "specserve.predrafted", "time_ns": 11 * MS, "attributes": {"specserve.prefix_len": 20}}]
    spans.append(ahead)
    spans.append(_span(trace_id, "r2", "es", "specserve.round", "INTERNAL", 38, 40, "target",
                       **{"specserve.k": 4, "specserve.num_accepted": 0, "specserve.emitted": 1,
                          "specserve.prefix_len": 20, "specserve.verify_ms": 2.0, "specserve.predraft": True}))
    spans.append(_span(trace_id, "stale", "es", "specserve.draft.block", "INTERNAL", 16, 18, "draft",
                       **{"specserve.prefix_len": 99, "specserve.k": 4}))  # a block no round used
    # a block for prefix 21 that came late: a plain round committed its first draft, and
    # round 3 verified the rest of it from prefix 22
    spans.append(_span(trace_id, "r3b", "es", "specserve.draft.block", "INTERNAL", 41, 44, "draft",
                       **{"specserve.prefix_len": 21, "specserve.k": 4}))
    spans.append(_span(trace_id, "r3", "es", "specserve.round", "INTERNAL", 45, 47, "target",
                       **{"specserve.k": 3, "specserve.num_accepted": 3, "specserve.emitted": 4,
                          "specserve.prefix_len": 22, "specserve.verify_ms": 2.0}))
    # round 4 at prefix 30 verified the rest of a block for 28, while the block asked for 30
    # came after the round had ended (the suite's waterfall test met this under load)
    spans.append(_span(trace_id, "r4b", "es", "specserve.draft.block", "INTERNAL", 48, 50, "draft",
                       **{"specserve.prefix_len": 28, "specserve.k": 4}))
    spans.append(_span(trace_id, "r4", "es", "specserve.round", "INTERNAL", 51, 53, "target",
                       **{"specserve.k": 2, "specserve.num_accepted": 2, "specserve.emitted": 3,
                          "specserve.prefix_len": 30, "specserve.verify_ms": 2.0}))
    spans.append(_span(trace_id, "r4late", "es", "specserve.draft.block", "INTERNAL", 52, 55, "draft",
                       **{"specserve.prefix_len": 30, "specserve.k": 4}))
    return spans


def test_rounds_pair_each_round_with_the_block_it_verified():
    rounds = waterfall.rounds_of(_synthetic_trace())
    assert [r["round"]["span_id"] for r in rounds] == ["r0", "r1", "r2", "r3", "r4"]
    assert [r["block"]["span_id"] for r in rounds] == ["r0b", "r1b", "ah", "r3b", "r4b"]
    # the pre-drafted block's bar: from the ahead span's previous block to its own event
    assert (rounds[2]["block"]["start_ns"], rounds[2]["block"]["end_ns"]) == (8 * MS, 11 * MS)
    assert [[a["span_id"] for a in r["ahead"]] for r in rounds] == [["ah"], [], [], [], []]


def test_pick_trace_selects_the_session_and_rejects_unknown_ones():
    spans = _synthetic_trace("t1", "sess-1") + _synthetic_trace("t2", "sess-2")
    picked = waterfall.pick_trace(spans, "sess-1")
    assert picked and {s["trace_id"] for s in picked} == {"t1"} and len(picked) == len(spans) // 2
    with pytest.raises(ValueError, match="nope"):
        waterfall.pick_trace(spans, "nope")
    with pytest.raises(ValueError):
        waterfall.pick_trace([s for s in spans if s["name"] != "specserve.generate"])


def test_render_writes_a_png(tmp_path):
    out = waterfall.render(waterfall.pick_trace(_synthetic_trace()), tmp_path / "rounds.png")
    data = Path(out).read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5_000
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert width > height > 100
    with pytest.raises(ValueError):
        waterfall.render([s for s in _synthetic_trace() if s["name"] != "specserve.round"], tmp_path / "x.png")
