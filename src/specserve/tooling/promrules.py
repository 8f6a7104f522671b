"""The Prometheus rules of deploy/prometheus/ as data: where they live, their names, and the
shortened copy the real-scrape test evaluates.

Production windows (a 1h trailing baseline, `for: 10m`) cannot be waited for in a test, and a
hand-written test copy would drift from the source. `shorten` derives the copy instead: every
PromQL range `[N<unit>]` and every `for:` is divided by one factor (floored, so a rate still
spans a few scrapes), names, thresholds and label matchers untouched.

Example: factor 60 turns `rate(x[5m])` into `rate(x[5s])`, `[1h]` into `[60s]`, `for: 10m`
into `for: 10s`.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import yaml

RULES = Path(__file__).resolve().parents[3] / "deploy" / "prometheus" / "specserve-rules.yaml"
_UNIT_S = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}
_DURATION = re.compile(r"^(\d+)(ms|s|m|h|d)$")
_RANGE = re.compile(r"\[(\d+)(ms|s|m|h|d)\]")


def seconds(duration: str) -> float:
    """`10m` -> 600.0; a duration Prometheus would not accept raises ValueError."""
    m = _DURATION.match(duration)
    if m is None:
        raise ValueError(f"not a single-unit Prometheus duration: {duration!r} (write e.g. 5m, 1h, 30s)")
    return int(m.group(1)) * _UNIT_S[m.group(2)]


def _scaled(duration_s: float, factor: float, floor_s: int) -> str:
    return f"{max(floor_s, round(duration_s / factor))}s"


def shorten(rules: dict[str, Any], factor: float, floor_s: int = 4) -> dict[str, Any]:
    """A copy of a rules document with every range and `for:` divided by `factor`."""
    if factor < 1:
        raise ValueError(f"factor must be >= 1 (it divides the windows), got {factor}")
    out = copy.deepcopy(rules)
    for group in out["groups"]:
        for rule in group["rules"]:
            rule["expr"] = _RANGE.sub(
                lambda m: f"[{_scaled(int(m.group(1)) * _UNIT_S[m.group(2)], factor, floor_s)}]", rule["expr"])
            if "for" in rule:
                rule["for"] = _scaled(seconds(rule["for"]), factor, 0)
    return out


def load(path: Path = RULES) -> dict[str, Any]:
    return yaml.safe_load(path.read_text())


def names(rules: dict[str, Any]) -> tuple[set[str], set[str]]:
    """(recorded series names, alert names) of a rules document."""
    rows = [r for g in rules["groups"] for r in g["rules"]]
    return {r["record"] for r in rows if "record" in r}, {r["alert"] for r in rows if "alert" in r}
