"""One request's rounds as a waterfall PNG, from exported spans (`specserve trace`).

Each round is a row: the draft call (its server-side compute dark, network and queueing
light), the verify call likewise, then the commit; markers show each drafted token accepted
(green) or rejected (red) and the emitted recovered/bonus token (blue). The overlap of ADR
0010 shows as it happens: the draft worker drafting ahead (hatched) under the round's
verify, and a round's commit running into the next round."""

from __future__ import annotations

import json
from pathlib import Path

_CLIENT_TO_SERVER = {"specserve.draft.propose": "specserve.v1.Draft/Propose",
                     "specserve.target.verify": "specserve.v1.Target/Verify"}
_COLORS = {"specserve.draft.propose": "#4C72B0", "specserve.target.verify": "#DD8452", "specserve.commit": "#55A868"}


def load_spans(path: Path) -> list[dict]:
    return json.loads(Path(path).read_text())


def pick_trace(spans: list[dict], session_id: str | None = None) -> list[dict]:
    gens = [s for s in spans if s["name"] == "specserve.generate"
            and (session_id is None or s["attributes"].get("specserve.session_id") == session_id)]
    if not gens:
        raise ValueError("no specserve.generate span" + (f" for session {session_id}" if session_id else ""))
    trace_id = max(gens, key=lambda s: s["start_ns"])["trace_id"]
    return [s for s in spans if s["trace_id"] == trace_id]


def rounds_of(trace: list[dict]) -> list[dict]:
    """Per round: its span, its client-call children and their server spans."""
    by_parent: dict[str, list[dict]] = {}
    for s in trace:
        by_parent.setdefault(s["parent_span_id"], []).append(s)
    out = []
    for r in sorted((s for s in trace if s["name"] == "specserve.round"), key=lambda s: s["start_ns"]):
        calls = {c["name"]: c for c in by_parent.get(r["span_id"], [])}
        def server_of(span_id: str) -> dict | None:
            # a round that used a pushed pre-drafted block told the worker unawaited, under a
            # `specserve.draft.inform` child of its propose span
            children = by_parent.get(span_id, [])
            found = next((x for x in children if x["kind"] == "SERVER"), None)
            inform = next((x for x in children if x["name"] == "specserve.draft.inform"), None)
            return found if found is not None or inform is None else server_of(inform["span_id"])

        servers = {name: server_of(c["span_id"]) for name, c in calls.items()}
        ahead = [x for srv in servers.values() if srv is not None for x in by_parent.get(srv["span_id"], [])
                 if x["name"] == "specserve.draft.ahead"]
        out.append({"round": r, "calls": calls, "servers": servers, "ahead": ahead})
    return out


def render(trace: list[dict], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rounds = rounds_of(trace)
    if not rounds:
        raise ValueError("the trace has no specserve.round spans")
    t0 = min(s["start_ns"] for s in trace)
    ms = lambda ns: (ns - t0) / 1e6  # noqa: E731
    step = max(ms(max(s["end_ns"] for s in trace)), 1.0) * 0.008  # marker spacing: scales with the trace
    fig, ax = plt.subplots(figsize=(12, 0.35 * len(rounds) + 1.8))
    for i, r in enumerate(rounds):
        y = len(rounds) - i
        for name, color in _COLORS.items():
            c = r["calls"].get(name)
            if c is None:
                continue
            ax.barh(y, ms(c["end_ns"]) - ms(c["start_ns"]), left=ms(c["start_ns"]), color=color, alpha=0.35, height=0.6)
            srv = r["servers"].get(name)
            if srv is not None:  # compute inside the remote process; the rest is network + queueing
                ax.barh(y, ms(srv["end_ns"]) - ms(srv["start_ns"]), left=ms(srv["start_ns"]), color=color, height=0.6)
        for x in r["ahead"]:
            ax.barh(y, ms(x["end_ns"]) - ms(x["start_ns"]), left=ms(x["start_ns"]), color="none", hatch="////",
                    edgecolor=_COLORS["specserve.draft.propose"], height=0.6, lw=0.5)
        a = r["round"]["attributes"]
        k, acc = int(a.get("specserve.k", 0)), int(a.get("specserve.num_accepted", 0))
        x = ms(r["round"]["end_ns"]) + step
        for j in range(k):
            ax.plot(x + j * step, y, "s", color="#2ca02c" if j < acc else "#d62728", ms=5)
        ax.plot(x + k * step, y, "o", color="#1f77b4", ms=5)
    ax.set_yticks(range(1, len(rounds) + 1), [f"round {len(rounds) - i}" for i in range(len(rounds))], fontsize=7)
    ax.set_xlabel("ms since the request started")
    g = next((s for s in trace if s["name"] == "specserve.generate"), None)
    title = "specserve rounds"
    if g is not None:
        ga = g["attributes"]
        title += f" — class {ga.get('specserve.workload_class')}, pool {ga.get('specserve.draft_pool')}, K {ga.get('specserve.k')}"
    ax.set_title(title, fontsize=9)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in _COLORS.values()]
    ax.legend(handles + [plt.Line2D([], [], marker="s", ls="", color="#2ca02c"),
                         plt.Line2D([], [], marker="s", ls="", color="#d62728"),
                         plt.Line2D([], [], marker="o", ls="", color="#1f77b4")],
              ["draft (dark: worker compute)", "verify (dark: worker compute)", "commit (Redis)",
               "accepted", "rejected", "recovered / bonus"], fontsize=7, loc="upper left",
              bbox_to_anchor=(1.01, 1.0), borderaxespad=0)  # outside the axes: never covers a round
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    return Path(out)
