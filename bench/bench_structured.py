"""Structured outputs with speculation (issue 23, ADR 0017), in process on the shipped pair:
the engine loop beside the target, one session at a time, greedy.

Held-out extraction records (the pair's eval prompts of class `extraction`) under a JSON
Schema of the record's fields. Arms, interleaved per prompt:
  free small        unconstrained, the model pool (`small`), K = 4
  plain             constrained, no draft pool; forced tokens off / on
  small             constrained, the model pool, K = 4; forced tokens off / on; and with
                    forced tokens but the draft's own q unmasked ("free draft")
  ngram             constrained, the n-gram pool, K = 4; forced tokens off / on
Reported per arm: parse rate of the finished outputs (must be 100 %), the share that
finished (the rest hit --max-tokens), field match rate (an output field whose value appears
verbatim in the record's text), tokens per target pass, ms per token, and the masks' host
time per step.
Writes <out>/structured.json and <out>/structured.png.

    python bench/bench_structured.py [--models models] [--prompts 12] [--max-tokens 120]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer"}, "name": {"type": "string", "maxLength": 40},
        "email": {"type": "string", "maxLength": 60}, "city": {"type": "string", "maxLength": 30},
        "age": {"type": "integer"}, "status": {"type": "string", "maxLength": 16},
        "items": {"type": "array", "maxItems": 4, "items": {
            "type": "object", "properties": {"sku": {"type": "string", "maxLength": 20}, "qty": {"type": "integer"},
                                             "price": {"type": "number"}},
            "required": ["sku", "qty", "price"], "additionalProperties": False}},
        "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
    },
    "required": ["id", "name", "email", "city", "age", "status", "items", "date"],
    "additionalProperties": False,
}
ARMS = [("free small", None, "small", True), ("plain, forced off", SCHEMA, None, False),
        ("plain, forced on", SCHEMA, None, True), ("small, forced off", SCHEMA, "small", False),
        ("small, forced on", SCHEMA, "small", True), ("small, free draft", SCHEMA, "small-free", True),
        ("ngram, forced off", SCHEMA, "ngram", False),
        ("ngram, forced on", SCHEMA, "ngram", True)]


def _values(obj) -> list[str]:
    """Every scalar field of a record (items flattened)."""
    out = []
    for key, v in obj.items():
        if key == "items" and isinstance(v, list):
            for it in v:
                out += [str(x) for x in it.values()] if isinstance(it, dict) else []
        elif not isinstance(v, dict | list):
            out.append(str(v))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="models")
    ap.add_argument("--pair", default="specserve-demo-v1")
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=120)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()

    import torch

    from specserve.algorithm.stops import StopChecker
    from specserve.drafters import HFDrafter, NgramDrafter
    from specserve.engine.drafting import LocalDrafts
    from specserve.engine.loop import EngineLoop
    from specserve.engine.session import EnginePlan
    from specserve.models.loading import load_pair
    from specserve.models.verifier import TargetModel
    from specserve.params import GenerationParams
    from specserve.structured.constraint import Constraint
    from specserve.structured.grammar import ConstrainedRow, GrammarCache, tokenizer_info
    from specserve.worker.model_step import Batching, make_target_step

    torch.set_num_threads(2)
    pair_dir = Path(args.models) / args.pair
    pair = load_pair(str(pair_dir / "target"), str(pair_dir / "draft"))
    target = TargetModel(pair.target)
    prompts = [p["prompt"] for p in json.loads((pair_dir / "eval_prompts.json").read_text())["prompts"]
               if p["workload_class"] == "extraction"][:args.prompts]
    cache = GrammarCache(tokenizer_info(str(pair_dir / "target" / "tokenizer.json"), target.vocab_size,
                                        sorted(target.eos_token_ids)))
    encode = lambda text: pair.tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    loops = {}
    for forced in (False, True):
        model = make_target_step(target, Batching(kv_budget_mb=64, max_sessions=4, prefill_chunk=64, max_len=512))
        loops[forced] = EngineLoop(
            model, lambda p: StopChecker(target.eos_token_ids, p.stop, pair.tokenizer.decode),
            {"small": LocalDrafts(HFDrafter(pair.draft)), "ngram": LocalDrafts(NgramDrafter(target.vocab_size)),
             "small-free": LocalDrafts(HFDrafter(pair.draft), mask_drafts=False)},
            constrain=lambda c, f=forced: ConstrainedRow(cache.compile(c), cache.vocab_size, target.vocab_size,
                                                         forced_drafts=f, encode=encode))
    mask_ms: dict[str, list[float]] = {name: [] for name, *_ in ARMS}
    for forced, loop in loops.items():
        loop.on_step = lambda report, lp=loop, f=forced: _note(lp, f, report)
    rows: dict[str, list[dict]] = {name: [] for name, *_ in ARMS}
    def plan(schema, pool, max_tokens):
        return EnginePlan(GenerationParams(max_tokens=max_tokens, num_draft_tokens=args.k if pool else 0, seed=1),
                          pool=pool, constraint=Constraint.json_schema(schema) if schema is not None else None)

    for _name, schema, pool, forced in ARMS:  # compile and first-touch every path once, unmeasured
        _run(loops[forced], encode(prompts[0]), plan(schema, pool, 8))
    for i, prompt in enumerate(prompts):
        for name, schema, pool, forced in ARMS:
            loop = loops[forced]
            loop.mask_steps = []  # type: ignore[attr-defined]
            s, wall = _run(loop, encode(prompt), plan(schema, pool, args.max_tokens))
            text = pair.tokenizer.decode(s.generated, skip_special_tokens=True)
            row = {"prompt": i, "finish": s.finish_reason, "tokens": len(s.generated), "rounds": len(s.rounds),
                   "wall_s": wall, "text": text}
            if schema is not None and s.finish_reason == "eos":
                try:
                    obj = json.loads(text)
                    row["parsed"] = True
                    vals = _values(obj)
                    row["fields"] = len(vals)
                    row["matched"] = sum(v in prompt for v in vals)
                except ValueError:
                    row["parsed"] = False
            rows[name].append(row)
            mask_ms[name] += loop.mask_steps  # type: ignore[attr-defined]
    summary = {}
    for name, schema, pool, forced in ARMS:
        rs = rows[name]
        done = [r for r in rs if r["finish"] == "eos"]
        tokens = sum(r["tokens"] for r in rs)
        summary[name] = {
            "constrained": schema is not None, "pool": pool or "none", "forced": forced,
            "finished": len(done) / len(rs),
            "parse_rate": (sum(bool(r.get("parsed")) for r in done) / len(done))
            if schema is not None and done else None,
            "field_match": (sum(r.get("matched", 0) for r in done) / max(sum(r.get("fields", 0) for r in done), 1))
            if schema is not None else None,
            "tokens_per_pass": tokens / sum(r["rounds"] for r in rs),
            "ms_per_token": 1e3 * sum(r["wall_s"] for r in rs) / tokens,
            "mask_ms_per_step_p50": statistics.median(mask_ms[name]) if mask_ms[name] else 0.0,
        }
    batched = _batched_cost(args, target, pair, cache, encode, prompts, plan)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "structured.json").write_text(json.dumps({"args": vars(args), "schema": SCHEMA, "summary": summary,
                                                     "batched": batched, "rows": rows}, indent=1))
    print(f"{'arm':20} {'finished':>8} {'parse':>6} {'fields':>6} {'tok/pass':>8} {'ms/tok':>7} {'mask ms':>7}")
    for name, m in summary.items():
        parse = "-" if m["parse_rate"] is None else f"{m['parse_rate']:.0%}"
        fields = "-" if m["field_match"] is None else f"{m['field_match']:.0%}"
        print(f"{name:20} {m['finished']:>8.0%} {parse:>6} {fields:>6} {m['tokens_per_pass']:>8.2f} "
              f"{m['ms_per_token']:>7.1f} {m['mask_ms_per_step_p50']:>7.2f}")
    print(f"{batched['sessions']} constrained sessions at once (pool small, forced on): per step p50 "
          f"{batched['rows_p50']} rows, masks {batched['mask_ms_p50']:.2f} ms "
          f"({batched['mask_ms_per_row_p50']:.3f} ms a row), forward {batched['forward_ms_p50']:.1f} ms")
    _plot(summary, out / "structured.png")


def _batched_cost(args, target, pair, cache, encode, prompts, plan) -> dict:
    """Item 6: what the masks cost beside a batched forward, all the prompts' sessions at once
    (the masks are filled row by row on the loop thread, before the forward)."""
    from specserve.algorithm.stops import StopChecker
    from specserve.drafters import HFDrafter
    from specserve.engine.drafting import LocalDrafts
    from specserve.engine.loop import EngineLoop
    from specserve.structured.grammar import ConstrainedRow
    from specserve.worker.model_step import Batching, make_target_step

    n = len(prompts)
    model = make_target_step(target, Batching(kv_budget_mb=16 * n, max_sessions=n, prefill_chunk=64, max_len=512))
    steps: list[tuple[int, float, float]] = []
    loop = EngineLoop(model, lambda p: StopChecker(target.eos_token_ids, p.stop, pair.tokenizer.decode),
                      {"small": LocalDrafts(HFDrafter(pair.draft))},
                      constrain=lambda c: ConstrainedRow(cache.compile(c), cache.vocab_size, target.vocab_size,
                                                         encode=encode))
    loop.on_step = lambda r: steps.append((r.rows, loop.mask_ms, r.forward_ms))
    for i, prompt in enumerate(prompts):
        loop.add(f"b{i}", encode(prompt), plan(SCHEMA, "small", args.max_tokens))
    loop.run_until_idle()
    full = [s for s in steps if s[0] == n] or steps  # the steps every session shared
    return {"sessions": n, "steps": len(full), "rows_p50": statistics.median(s[0] for s in full),
            "mask_ms_p50": statistics.median(s[1] for s in full),
            "mask_ms_per_row_p50": statistics.median(s[1] / s[0] for s in full),
            "forward_ms_p50": statistics.median(s[2] for s in full)}


def _note(loop, forced, report) -> None:
    steps = getattr(loop, "mask_steps", None)
    if steps is not None:
        steps.append(loop.mask_ms)


def _run(loop, ids: list[int], plan) -> tuple:
    """One session alone on the loop: (the ended session, its wall seconds)."""
    sid = f"s{time.monotonic_ns()}"
    t0 = time.perf_counter()
    loop.add(sid, ids, plan)
    loop.run_until_idle()
    return loop.ended[sid], time.perf_counter() - t0


def _plot(summary, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(summary)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    axes[0].barh(names, [summary[n]["tokens_per_pass"] for n in names], color="tab:blue")
    axes[0].set_xlabel("tokens per target pass")
    axes[1].barh(names, [summary[n]["ms_per_token"] for n in names], color="tab:orange")
    axes[1].set_xlabel("ms per token")
    axes[0].invert_yaxis()
    axes[1].invert_yaxis()
    fig.suptitle("Structured outputs with speculation (extraction records, greedy)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
