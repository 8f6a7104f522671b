"""Traces and metrics from the real services: spans reach a real OTLP receiver from the
router, draft and target processes with correct cross-process parent links; the Prometheus
endpoints agree with a known workload. (Runs before test_router.py, which kills workers.)"""

from __future__ import annotations

import time
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from specserve.v1 import generation_pb2, generation_pb2_grpc


@pytest.fixture(scope="module")
def stub(stack):
    channel = grpc.insecure_channel(stack.info.router)
    yield generation_pb2_grpc.GenerationStub(channel)
    channel.close()


def _complete(trace: list[dict], services: int) -> bool:
    """All processes have flushed: every gRPC client span has its server span."""
    if len({s["service"] for s in trace}) < services:
        return False
    clients = [s["span_id"] for s in trace if s["name"] in ("specserve.draft.propose", "specserve.target.verify")]
    servers = {s["parent_span_id"] for s in trace if s["kind"] == "SERVER"}
    return all(c in servers for c in clients)


def _trace_of(receiver, session_id: str, services: int = 3, timeout_s: float = 30.0) -> list[dict]:
    """Spans of the request's trace, once every process has exported its share (each one
    batches spans for up to 0.5 s, so they arrive at different times)."""
    deadline = time.monotonic() + timeout_s
    while True:
        spans = receiver.snapshot()
        gen = [s for s in spans if s["name"] == "specserve.generate"
               and s["attributes"].get("specserve.session_id") == session_id]
        trace = [s for s in spans if gen and s["trace_id"] == gen[0]["trace_id"]]
        if (trace and _complete(trace, services)) or time.monotonic() > deadline:
            return trace
        time.sleep(0.3)


@pytest.mark.xfail(strict=False, reason="issue 20: a specserve.draft.propose client span sometimes has no "
                   "server span under it (reported failing 3/3 on machines without AVX-512, and here with the "
                   "demo pair); the rounds-beside-the-target switch rewrites this path and must fix it")
def test_one_request_is_one_trace_across_three_processes(stub, otlp_receiver, eval_prompts):
    req = generation_pb2.GenerateRequest(prompt=eval_prompts[0]["prompt"], max_tokens=20, draft_pool="small",
                                         num_draft_tokens=3, workload_class="code")
    resp = stub.Generate(req, timeout=120)
    trace = _trace_of(otlp_receiver, resp.session_id)
    assert trace, "no specserve.generate span arrived"
    services = {s["service"] for s in trace}
    assert {"specserve-router", "specserve-draft-small", "specserve-target"} <= services, services
    by_id = {s["span_id"]: s for s in trace}
    gen = next(s for s in trace if s["name"] == "specserve.generate")
    assert by_id[gen["parent_span_id"]]["name"] == "specserve.v1.Generation/Generate"  # the router's server span
    # the class, why it was chosen and the policy decision are on the request's span
    g = gen["attributes"]
    assert g["specserve.workload_class"] == "code" and g["specserve.class_reason"] == "explicit"
    assert g["specserve.decision"] == "pinned"  # the request named its pool and K
    rounds = [s for s in trace if s["name"] == "specserve.round"]
    assert len(rounds) == resp.stats.rounds and all(r["parent_span_id"] == gen["span_id"] for r in rounds)
    # the round spans' accepted counts add up to the response's stats
    assert sum(r["attributes"]["specserve.num_accepted"] for r in rounds) == resp.stats.accepted_tokens
    assert sum(r["attributes"]["specserve.emitted"] for r in rounds) == len(resp.token_ids)
    for r in rounds:
        a = r["attributes"]
        assert a["specserve.workload_class"] == "code" and a["specserve.draft_pool"] == "small"
        assert {"specserve.k", "specserve.rejected_position", "specserve.fallback_reason"} <= set(a)
    # every client call has its server span, in another process, as its child
    clients = [s for s in trace if s["name"] in ("specserve.draft.propose", "specserve.target.verify")]
    assert clients and all(by_id[c["parent_span_id"]]["name"] == "specserve.round" for c in clients)
    for c in clients:
        servers = [s for s in trace if s["parent_span_id"] == c["span_id"] and s["kind"] == "SERVER"]
        assert len(servers) == 1, c["name"]
        assert servers[0]["service"] != "specserve-router"
        assert servers[0]["start_ns"] >= c["start_ns"] and servers[0]["end_ns"] <= c["end_ns"]
    assert sum(s["name"] == "specserve.commit" for s in trace) == len(rounds)


def test_trace_renders_as_a_waterfall(stub, otlp_receiver, eval_prompts, tmp_path):
    from specserve.tooling.waterfall import render, rounds_of

    resp = stub.Generate(generation_pb2.GenerateRequest(prompt=eval_prompts[21]["prompt"], max_tokens=16,
                                                        draft_pool="small"), timeout=120)
    trace = _trace_of(otlp_receiver, resp.session_id)
    rounds = rounds_of(trace)
    assert len(rounds) == resp.stats.rounds
    # the overlap of ADR 0010 is in the trace: the draft worker drafts ahead while the target
    # verifies the same round (the hatched bars of the waterfall)
    overlapping = [r for r in rounds for a in r["ahead"] if "specserve.target.verify" in r["calls"]
                   and a["start_ns"] < r["calls"]["specserve.target.verify"]["end_ns"]]
    assert overlapping, "no draft-ahead span overlaps its round's verify"
    png = render(trace, tmp_path / "trace.png")
    assert png.stat().st_size > 5000


def _scrape(address: str) -> dict[tuple[str, tuple], float]:
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=5).read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def _total(metrics: dict, name: str, **labels) -> float:
    return sum(v for (n, ls), v in metrics.items() if n == name and all((k, w) in ls for k, w in labels.items()))


def test_metrics_agree_with_a_known_workload(stub, stack, eval_prompts):
    router, target = stack.info.metrics["router"], stack.info.metrics["target"]
    before, target_before = _scrape(router), _scrape(target)
    responses = [stub.Generate(generation_pb2.GenerateRequest(
        prompt=p["prompt"], max_tokens=16, draft_pool=pool, num_draft_tokens=3, workload_class="extraction"),
        timeout=120) for p in eval_prompts[20:23] for pool in ("small", "ngram")]
    after, target_after = _scrape(router), _scrape(target)

    def delta(name, **labels):
        return _total(after, name, **labels) - _total(before, name, **labels)

    for pool in ("small", "ngram"):
        mine = [r for r in responses if r.stats.draft_pool == pool]
        labels = dict(workload_class="extraction", draft_pool=pool)
        assert delta("specserve_target_passes_total", **labels) == sum(r.stats.rounds for r in mine)
        assert delta("specserve_output_tokens_total", **labels) == sum(len(r.token_ids) for r in mine)
        assert delta("specserve_accepted_tokens_total", **labels) == sum(r.stats.accepted_tokens for r in mine)
        assert delta("specserve_proposed_tokens_total", **labels) == sum(r.stats.draft_tokens for r in mine)
        speculative = sum(1 for r in mine for rd in r.stats.round if rd.k > 0)
        assert delta("specserve_acceptance_length_count", **labels) == speculative
        assert delta("specserve_requests_total", **labels) == len(mine)
        assert delta("specserve_rollback_tokens_total", **labels) == sum(
            rd.k - rd.accepted for r in mine for rd in r.stats.round)
    assert _total(after, "specserve_sessions_active") == 0
    verifies = _total(target_after, "specserve_target_call_seconds_count") - \
        _total(target_before, "specserve_target_call_seconds_count")
    assert verifies >= sum(r.stats.rounds for r in responses)
