"""Observability deploy files (DESIGN §6): the Grafana dashboard queries only metrics the services
export, covers every §6 metric and links slow rounds to traces; the collector config wires OTLP
traces to Tempo and metrics to a Prometheus exporter; the round waterfall renders a trace."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from specserve.serving.metrics import RouterMetrics, WorkerMetrics
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
    for metrics in (RouterMetrics(), WorkerMetrics("draft"), WorkerMetrics("target")):
        for fam in metrics.registry.collect():
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
    assert {"specserve_acceptance_length", "specserve_proposed_tokens", "specserve_draft_call_seconds",
            "specserve_target_sessions"} <= set(families)  # the registries really were collected
    queried = {SUFFIX.sub("", n) for e in exprs for n in NAME.findall(e)}
    assert queried, "no specserve_ metric found in any expr"
    assert queried <= set(families), f"not exported by any service: {sorted(queried - set(families))}"


def test_dashboard_reads_only_recorded_series_the_rules_record(exprs):
    used = {n for e in exprs for n in RECORDED.findall(e)}
    assert "workload_class_draft_pool:specserve_acceptance_length_vllm:mean5m" in used
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
    "acceptance length": {"specserve_acceptance_length"},
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
    assert any("histogram_quantile" in e and "specserve_acceptance_length_bucket" in e for e in exprs)


def test_router_queries_filter_by_class_and_pool(dashboard, exprs):
    router = {fam.name for fam in RouterMetrics().registry.collect()}
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
    spans = [_span(trace_id, "g", None, "specserve.generate", "INTERNAL", 0, 40, "router",
                   **{"specserve.session_id": session, "specserve.workload_class": "chat",
                      "specserve.draft_pool": "small", "specserve.k": 4})]
    for i, (t0, acc) in enumerate([(1, 4), (21, 1)]):
        r = f"r{i}"
        spans += [
            _span(trace_id, r, "g", "specserve.round", "INTERNAL", t0, t0 + 18, "router",
                  **{"specserve.k": 4, "specserve.num_accepted": acc, "specserve.emitted": acc + 1}),
            _span(trace_id, f"{r}d", r, "specserve.draft.propose", "CLIENT", t0, t0 + 5, "router"),
            _span(trace_id, f"{r}ds", f"{r}d", "specserve.v1.Draft/Propose", "SERVER", t0 + 1, t0 + 4, "draft"),
            _span(trace_id, f"{r}v", r, "specserve.target.verify", "CLIENT", t0 + 5, t0 + 15, "router"),
            _span(trace_id, f"{r}vs", f"{r}v", "specserve.v1.Target/Verify", "SERVER", t0 + 6, t0 + 14, "target"),
            _span(trace_id, f"{r}c", r, "specserve.commit", "CLIENT", t0 + 15, t0 + 18, "router"),
        ]
    return spans


def test_rounds_pair_each_client_call_with_its_server_span():
    rounds = waterfall.rounds_of(_synthetic_trace())
    assert [r["round"]["span_id"] for r in rounds] == ["r0", "r1"]
    for i, r in enumerate(rounds):
        assert set(r["calls"]) == {"specserve.draft.propose", "specserve.target.verify", "specserve.commit"}
        for client, server in waterfall._CLIENT_TO_SERVER.items():
            srv = r["servers"][client]
            assert srv is not None and srv["name"] == server and srv["kind"] == "SERVER"
            assert srv["parent_span_id"] == r["calls"][client]["span_id"] and srv["span_id"].startswith(f"r{i}")
            assert srv["service"] != r["calls"][client]["service"]
        assert r["servers"]["specserve.commit"] is None  # Redis: no server span


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
