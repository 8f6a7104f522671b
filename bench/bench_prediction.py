"""Predicted Outputs on a code-editing set, through the local stack (ADR 0012).

Each item is a held-out code prompt of the pair, used as a file: the prompt shows the file and
asks for it back with a small change (a renamed identifier, an added line); the prediction is
the original file, as an editor would send it. Greedy, every mode gives the same tokens (the
bench checks it); it reports ms/token and speedup over plain decoding for the prediction
drafter and for the model (`small`) and n-gram (`ngram`) pools, the accepted/rejected
prediction tokens, and the drafting time per round (the prediction drafts in the target's
engine, the n-gram pool on its replica).

A small base model does not follow "give the file back" (ours are trained on plain text), so
its output need not repeat the original file. The second prediction mode is the case the
feature is for, whatever the model: the prediction is the model's own previous answer with a
small edit in it (a renamed identifier or a changed line), as when a client regenerates a
draft; the output then mostly repeats the prediction.
Writes <out>/prediction.json and <out>/prediction.png.
"""

from __future__ import annotations

import json
import keyword
import re
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from bench_stack import via_router  # noqa: E402
from common import parser

from specserve.tooling.modelbuild.build import find_pair, load_eval_prompts  # noqa: E402
from specserve.tooling.stack import PoolSpec, Stack, StackSpec  # noqa: E402

IDENT = re.compile(r"\b[a-z_][a-z0-9_]{2,}\b")


def edit_task(code: str, i: int) -> tuple[str, str]:
    """(prompt, prediction): ask for `code` back with one identifier renamed (even items) or
    a line added (odd items); the prediction is the original."""
    names = [n for n in IDENT.findall(code) if not keyword.iskeyword(n)]
    repeated = sorted({n for n in names if names.count(n) > 1}, key=names.index)
    if i % 2 == 0 and repeated:
        old = repeated[0]
        ask = f"the same file with `{old}` renamed to `{old}_v2`"
    else:
        ask = "the same file with a `# reviewed` comment line added at the top"
    return f"{code.rstrip()}\n\n# Below: {ask}.\n", code


def edit_text(text: str, i: int) -> str:
    """`text` with a small edit: an identifier renamed (even items) or a middle line changed."""
    names = [n for n in IDENT.findall(text) if not keyword.iskeyword(n)]
    if i % 2 == 0 and names:
        return re.sub(rf"\b{names[len(names) // 2]}\b", f"{names[len(names) // 2]}_v2", text)
    lines = text.splitlines(keepends=True)
    mid = len(lines) // 2
    return "".join(lines[:mid] + ["    pass  # edited\n"] + lines[mid + 1 :])


def call(stub, prompt: str, max_tokens: int, pool: str, k: int | None, prediction: str, repeats: int):
    """(best seconds, response): bench_stack's timed call, with a prediction."""
    ms, resp = via_router(stub, prompt, pool, k, max_tokens, [], repeats, prediction)
    return ms / 1e3, resp


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=160, help="cap on each output (the file's length + a few)")
    ap.add_argument("--k", type=int, default=4, help="K of the small and ngram pools")
    ap.add_argument("--prediction-k", type=int, nargs="+", default=[16], help="K of the prediction drafter")
    ap.add_argument("--repeats", type=int, default=2, help="best of this many runs per request")
    ap.add_argument("--table", metavar="JSON", help="only print the table of an earlier run's JSON")
    a = ap.parse_args()
    if a.table:
        done = json.loads(Path(a.table).read_text())
        print_table(summarise(done["rows"], list(dict.fromkeys(r["mode"] for r in done["rows"]))))
        return
    pair = find_pair(a.models)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    files = [p["prompt"] for p in load_eval_prompts(pair) if p["workload_class"] == "code"][: a.prompts]
    tasks = [edit_task(code, i) for i, code in enumerate(files)]
    modes = [("plain", "none", 0, ""), ("small", "small", a.k, ""), ("ngram", "ngram", a.k, "")] + \
        [(f"prediction=file K={k}", "", k, "file") for k in a.prediction_k] + \
        [(f"prediction=edited draft K={k}", "", k, "draft") for k in a.prediction_k]

    import grpc

    from specserve.v1 import generation_pb2_grpc

    rows = []
    with tempfile.TemporaryDirectory(prefix="specserve-bench-") as run_dir:
        stack = Stack(StackSpec(pair_dir=str(pair), run_dir=run_dir,
                                pools={"small": PoolSpec("draft", 1), "ngram": PoolSpec("ngram", 1)},
                                router_env={"SPECSERVE_ROUTER_MAX_TOKENS_LIMIT": str(max(a.max_tokens, 1024))}))
        with stack.running(), grpc.insecure_channel(stack.info.router) as ch:
            stub = generation_pb2_grpc.GenerationStub(ch)
            call(stub, tasks[0][0], 8, "small", a.k, "", 1)  # warm-up
            for i, (prompt, prediction) in enumerate(tasks):
                print(f"[bench] item {i + 1}/{len(tasks)}", file=sys.stderr, flush=True)
                plain = None
                for name, pool, k, predicted in modes:
                    text = {"": "", "file": prediction,
                            "draft": edit_text(plain.text, i) if plain is not None else ""}[predicted]
                    s, resp = call(stub, prompt, a.max_tokens, pool, k if pool != "none" else None, text,
                                   a.repeats)
                    plain = resp if plain is None else plain
                    drafting = [r.draft_ms for r in resp.stats.round if r.k]
                    rows.append({"item": i, "mode": name, "seconds": s, "tokens": len(resp.token_ids),
                                 "rounds": len(resp.stats.round), "same_as_plain": resp.text == plain.text,
                                 "accepted": resp.stats.accepted_tokens, "drafted": resp.stats.draft_tokens,
                                 "accepted_prediction": resp.stats.accepted_prediction_tokens,
                                 "rejected_prediction": resp.stats.rejected_prediction_tokens,
                                 "draft_ms_mean": float(np.mean(drafting)) if drafting else None})
    summary = summarise(rows, [m[0] for m in modes])
    (out / "prediction.json").write_text(json.dumps({"args": vars(a), "pair": str(pair), "summary": summary,
                                                     "rows": rows, "items": [t[0] for t in tasks]}, indent=1))
    print_table(summary)
    _plot(summary, out / "prediction.png")
    print(f"wrote {out / 'prediction.json'} and {out / 'prediction.png'}", file=sys.stderr)


def print_table(summary: list[dict]) -> None:
    print("| mode | ms/token | speedup vs plain (total / median item) | tokens per target pass "
          "| accepted / drafted | accepted / rejected prediction tokens | draft ms per round | same tokens as plain |")
    print("|---|---|---|---|---|---|---|---|")
    for m in summary:
        print(f"| {m['mode']} | {m['ms_per_token']:.1f} | {m['speedup']:.2f}x / {m['median_speedup']:.2f}x "
              f"| {m['tokens_per_pass']:.2f} | {m['accepted']}/{m['drafted']} "
              f"| {m['accepted_prediction']} / {m['rejected_prediction']} | {_fmt(m['draft_ms_mean'])} "
              f"| {m['same_as_plain']} |")


def summarise(rows: list[dict], modes: list[str]) -> list[dict]:
    """Per mode: totals, and the median over items of the per-item speedup (robust to a busy
    machine slowing one request) and tokens per target pass (rounds: independent of timing)."""
    def total(mode: str, key: str):
        return sum(r[key] for r in rows if r["mode"] == mode)

    def per_item(mode: str) -> dict[int, float]:
        return {r["item"]: r["seconds"] / r["tokens"] for r in rows if r["mode"] == mode}

    base = total("plain", "seconds") / total("plain", "tokens")
    plain_items = per_item("plain")
    out = []
    for mode in modes:
        per_token = total(mode, "seconds") / total(mode, "tokens")
        item_speedups = [plain_items[i] / t for i, t in per_item(mode).items()]
        drafting = [r["draft_ms_mean"] for r in rows if r["mode"] == mode and r["draft_ms_mean"]]
        out.append({"mode": mode, "ms_per_token": per_token * 1e3, "speedup": base / per_token,
                    "median_speedup": float(np.median(item_speedups)),
                    "tokens_per_pass": total(mode, "tokens") / total(mode, "rounds"),
                    "accepted": total(mode, "accepted"), "drafted": total(mode, "drafted"),
                    "accepted_prediction": total(mode, "accepted_prediction"),
                    "rejected_prediction": total(mode, "rejected_prediction"),
                    "draft_ms_mean": float(np.mean(drafting)) if drafting else None,
                    "same_as_plain": all(r["same_as_plain"] for r in rows if r["mode"] == mode)})
    return out


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.2f}"


def _plot(summary: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # horizontal bars: the modes' names are long ("prediction, K=16, pinned"), and on a shared
    # x axis they ran into each other
    names = [m["mode"] for m in summary]
    pred = [m for m in summary if m["mode"].startswith("prediction")]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 0.5 * max(len(names), 4) + 1.5))
    y = np.arange(len(names))
    ax1.barh(y, [m["speedup"] for m in summary], color="tab:blue")
    ax1.set_yticks(y, names)
    ax1.invert_yaxis()
    ax1.axvline(1.0, color="grey", lw=0.8)
    ax1.set_xlabel("speedup over plain decoding (greedy, same tokens)")
    for yi, m in zip(y, summary, strict=True):
        ax1.annotate(f"{m['speedup']:.2f}x", (m["speedup"], yi), xytext=(3, 0), textcoords="offset points",
                     va="center", fontsize=8)
    yp = np.arange(len(pred))
    accepted = [m["accepted_prediction"] for m in pred]
    ax2.barh(yp, accepted, label="accepted", color="tab:green")
    ax2.barh(yp, [m["rejected_prediction"] for m in pred], left=accepted, label="rejected", color="tab:red")
    ax2.set_yticks(yp, [m["mode"] for m in pred])
    ax2.invert_yaxis()
    ax2.set_xlabel("prediction tokens")
    ax2.legend(loc="lower right")
    fig.suptitle("Predicted Outputs on a code-editing set")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
