"""One request's rounds as a waterfall PNG, from exported spans (`specserve trace`).

Each round is a row (ADR 0014: rounds run in the target's engine): the engine step it was
verified in (dark orange: the forward, light: the engine's own Python), and the draft block
it verified, as the draft worker drafted it (blue), with the blocks the worker drafted ahead
for likely outcomes while the target verified (hatched). Markers show each drafted token
accepted (green) or rejected (red) and the emitted recovered/bonus token (blue)."""

from __future__ import annotations

import json
from pathlib import Path

from specserve.params import MAX_K

_COLORS = {"step": "#DD8452", "block": "#4C72B0"}


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
    """Per round: its span, the draft block it verified and the blocks drafted ahead under
    that block's span. A block is matched by the committed prefix it was drafted for: a
    `specserve.draft.block` span, or, for a round that verified a block drafted ahead
    (`specserve.predraft`), the `specserve.predrafted` event of the ahead span that drafted it
    (the block's bar runs from the ahead span's previous block to that event). Of several for
    one prefix length, the newest ready before the round ended. A round with no block ready
    for its own prefix by its end verified the rest of a block for a shorter one (a plain round
    committed that block's first drafts meanwhile; the block asked for its own prefix came
    late): the longest such prefix ready before the round ended."""
    candidates: dict[tuple[bool, int], list[dict]] = {}
    for b in trace:
        if b["name"] == "specserve.draft.block":
            candidates.setdefault((False, int(b["attributes"].get("specserve.prefix_len", -1))), []).append(b)
        elif b["name"] == "specserve.draft.ahead":
            t = b["start_ns"]
            for e in sorted(b.get("events", []), key=lambda e: e["time_ns"]):
                if e["name"] == "specserve.predrafted":
                    n = int(e["attributes"].get("specserve.prefix_len", -1))
                    candidates.setdefault((True, n), []).append(
                        {"name": "specserve.predrafted", "span_id": b["span_id"], "start_ns": t, "end_ns": e["time_ns"],
                         "attributes": e["attributes"]})
                    t = e["time_ns"]
    ahead_of: dict[str, list[dict]] = {}
    for x in trace:
        if x["name"] == "specserve.draft.ahead":
            ahead_of.setdefault(x["parent_span_id"], []).append(x)
    out = []
    for r in sorted((s for s in trace if s["name"] == "specserve.round"), key=lambda s: s["start_ns"]):
        a, block = r["attributes"], None
        if int(a.get("specserve.k", 0)):
            pushed, n = bool(a.get("specserve.predraft")), int(a.get("specserve.prefix_len", -2))
            own = sorted(candidates.get((pushed, n), []), key=lambda b: b["end_ns"])
            ready = [b for b in own if b["end_ns"] <= r["end_ns"]]
            for back in range(1, MAX_K + 1):
                if ready:
                    break
                ready = sorted((b for b in candidates.get((pushed, n - back), []) if b["end_ns"] <= r["end_ns"]),
                               key=lambda b: b["end_ns"])
            pick = ready or own
            block = pick[-1] if pick else None
        out.append({"round": r, "block": block,
                    "ahead": ahead_of.get(block["span_id"], []) if block and block["name"] == "specserve.draft.block"
                    else []})
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
        rs, ra = r["round"], r["round"]["attributes"]
        ax.barh(y, ms(rs["end_ns"]) - ms(rs["start_ns"]), left=ms(rs["start_ns"]), color=_COLORS["step"], alpha=0.35,
                height=0.6)
        forward_ns = float(ra.get("specserve.verify_ms", 0.0)) * 1e6
        ax.barh(y, forward_ns / 1e6, left=ms(rs["start_ns"]), color=_COLORS["step"], height=0.6)
        if r["block"] is not None:
            b = r["block"]
            ax.barh(y, ms(b["end_ns"]) - ms(b["start_ns"]), left=ms(b["start_ns"]), color=_COLORS["block"], height=0.6)
        for x in r["ahead"]:
            ax.barh(y, ms(x["end_ns"]) - ms(x["start_ns"]), left=ms(x["start_ns"]), color="none", hatch="////",
                    edgecolor=_COLORS["block"], height=0.6, lw=0.5)
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
        title += (f" — class {ga.get('specserve.workload_class')}, pool {ga.get('specserve.draft_pool')}, "
                  f"K {ga.get('specserve.k')}")
    ax.set_title(title, fontsize=9)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in _COLORS.values()]
    ax.legend(handles + [plt.Line2D([], [], marker="s", ls="", color="#2ca02c"),
                         plt.Line2D([], [], marker="s", ls="", color="#d62728"),
                         plt.Line2D([], [], marker="o", ls="", color="#1f77b4")],
              ["engine step (dark: forward)", "draft block (hatched: drafted ahead)", "accepted", "rejected",
               "recovered / bonus"], fontsize=7, loc="upper left",
              bbox_to_anchor=(1.01, 1.0), borderaxespad=0)  # outside the axes: never covers a round
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    return Path(out)
