"""The control plane's side of LoRA adapters (ADR 0029), torch-free: the policy of a class x
adapter, the statistics class an adapter's requests count under, the bounded `adapter` label of
the metrics, and the request's validation."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from specserve.control.policy import Policy, PolicyCache
from specserve.errors import InvalidRequest
from specserve.services.router.planner import Planner
from specserve.serving.metrics import NO_ADAPTER, OTHER_ADAPTERS, AdapterLabels, split_class


def _cache(*policies: Policy) -> PolicyCache:
    cache = PolicyCache(store=None, builtin=Policy("default"))  # type: ignore[arg-type]
    cache.policies = {p.workload_class: p for p in policies}
    return cache


def test_a_class_x_adapter_policy_applies_to_its_requests_and_falls_back_to_the_class():
    mine = Policy("extraction@records-nested", draft_pool="small-records-nested", k=6).validate(
        ["small", "small-records-nested"])
    cls = Policy("extraction", draft_pool="small", k=4).validate(["small"])
    cache = _cache(mine, cls, Policy("default", draft_pool="small").validate(["small"]))
    assert cache.effective("extraction@records-nested") == (mine, "class")
    assert cache.effective("extraction@other-adapter") == (cls, "class")  # the class's own
    assert cache.effective("extraction") == (cls, "class")
    assert cache.effective("code@records-nested")[1] == "default"
    with pytest.raises(InvalidRequest, match="CLASS@ADAPTER"):
        Policy("extraction@Bad Name", draft_pool="small").validate(["small"])


def test_an_adapters_requests_count_apart_and_the_metrics_label_splits_them():
    planner = Planner(_cache(), SimpleNamespace(), ["small"], SimpleNamespace())  # type: ignore[arg-type]
    assert planner.stats_class("extraction", "records-nested") == "extraction@records-nested"
    assert planner.stats_class("extraction") == "extraction"
    assert planner.stats_class("nobody-knows", "records-nested") == "other@records-nested"  # (bounded classes)
    assert split_class("extraction@records-nested+schema") == ("extraction+schema", "records-nested")
    assert split_class("code") == ("code", "")


def test_the_adapter_label_is_bounded_by_traffic():
    labels = AdapterLabels(top=2, every=8)
    assert labels.label("") == NO_ADAPTER
    assert [labels.label(a) for a in ("a", "b", "c")] == ["a", "b", OTHER_ADAPTERS]  # room for two
    for _ in range(6):  # c is the busiest now: at the next re-ranking it takes the quieter one's place
        labels.label("c")
    assert labels.label("c") == "c" and labels.label("b") == OTHER_ADAPTERS
    assert labels.of_class("chat@c+json") == ("chat+json", "c")
    assert len({labels.label(f"x{i}") for i in range(100)}) <= 3  # two names and `other`, whatever comes
