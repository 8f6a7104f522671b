"""Speculative decoding benchmark: one run, one pair, the same held-out prompts for every method.

Methods (per workload class and temperature T):
  target       specserve engine with K=0 (plain target decoding) -- the speedup baseline
  spec-model   specserve engine + HFDrafter (the pair's distilled draft model)
  spec-ngram   specserve engine + NgramDrafter (prompt lookup, no model)
  hf-plain     transformers `generate` without assistance (HF's own baseline)
  hf-assisted  transformers `generate(assistant_model=draft)`, K = num_assistant_tokens (constant)
  hf-lookup    transformers `generate(prompt_lookup_num_tokens=K)`

Timing: each generation is timed --repeats times (fastest kept) and the plain baseline is
measured at the start and the end of each (class, T) block (fastest kept), because one noisy
stretch on a shared 2-core machine would otherwise skew a whole block of speedups.

Figures per (class, T, method, K): acceptance length (mean/p50/p90 of accepted drafts per round),
per-position acceptance (position i: share of rounds with k > i that accepted > i), target
passes per output token, ms per token (generate wall time / generated tokens), speedup against
`target` of the same class and T, alpha, c, and Leviathan et al.'s S = (1 - a^(K+1)) / ((1 - a)(Kc + 1)).

alpha (engine methods) is the maximum-likelihood per-token acceptance under Leviathan's i.i.d.
model: accepted drafts / drafts actually tested, a draft being tested when every draft before it
was accepted (sum(a) / sum(min(a + 1, k))); accepted / proposed would under-count. alpha_fit (all
methods, HF included) solves (1 - a^(K+1)) / (1 - a) = output tokens per target pass instead.
c = draft ms per drafted token / `target` ms per token. The breakeven table gives, per drafter, K
and measured c, the smallest alpha with S >= 1 (bisection). HF methods' rounds are counted with
a forward hook on the target (one call = one target pass).

EOS is banned by default (engine: banned_token_ids, HF: suppress_tokens) so that every run
emits exactly --max-tokens tokens; --natural-eos lets generations stop. At T=0 every method's
tokens are compared with `target`'s (greedy_identical). Sampled runs use seed + prompt index.

Honest acceptance: a prompt is degenerate when the target's greedy continuation of it loops
(specserve.tooling.textquality: one token over 30 % of it, or a 4-gram more than 3 times). A
looping target is easy to draft for, so every row also carries `nondegenerate` (acceptance,
alpha and speedup on the other prompts only, the same prompts at every T), and the tables
print both.
Writes <out>/engine.json and <out>/speedup_vs_k.png, <out>/acceptance_by_position.png.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import platform
import sys
import time
from pathlib import Path

if not sys.stdout.isatty():  # no progress bars from libraries in logs
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TQDM_DISABLE", "1")

import numpy as np
import torch
import transformers
from common import parser, warn_if_busy

from specserve.algorithm.sampling import SamplingParams
from specserve.drafters import HFDrafter, NgramDrafter
from specserve.models.loading import load_pair
from specserve.models.verifier import TargetModel
from specserve.tooling.modelbuild.build import find_pair
from specserve.tooling.textquality import is_degenerate
from specserve.worker.reference import GenerationParams, ReferenceDecoder

SPEC = ("spec-model", "spec-ngram", "hf-assisted", "hf-lookup")  # methods that take a K


def parse_args(argv=None) -> argparse.Namespace:
    p = parser(__doc__)
    p.add_argument("--prompts-per-class", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--ks", default="1,2,3,4,6,8")
    p.add_argument("--temperatures", default="0,0.8")
    p.add_argument("--methods", default="target,hf-plain," + ",".join(SPEC))
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2, help="time each generation N times, keep the fastest")
    p.add_argument("--natural-eos", action="store_true", help="let generations stop at EOS")
    p.add_argument("--quick", action="store_true", help="1 prompt/class, K in {2,4}, 24 tokens")
    a = p.parse_args(argv)
    if a.quick:
        a.prompts_per_class, a.ks, a.max_tokens = 1, "2,4", 24
    a.ks = [int(k) for k in a.ks.split(",")]
    a.temperatures = [float(t) for t in a.temperatures.split(",")]
    a.methods = a.methods.split(",")
    return a


def load_prompts(pair: Path, per_class: int) -> dict[str, list[str]]:
    data = json.loads((pair / "eval_prompts.json").read_text())
    items = data["prompts"] if isinstance(data, dict) else data  # {"version", "prompts"} or a bare list
    by_class: dict[str, list[str]] = {}
    for item in items:
        by_class.setdefault(item["workload_class"], []).append(item["prompt"])
    return {c: ps[:per_class] for c, ps in by_class.items()}


def engine_runner(engine: ReferenceDecoder, temp: float, k: int, max_tokens: int, banned: tuple):
    sampling = SamplingParams(temperature=temp, banned_token_ids=banned)

    def run(ids: list[int], seed: int):
        r = engine.generate(ids, GenerationParams(max_tokens, sampling, num_draft_tokens=k, seed=seed))
        rounds = [(x.k, x.accepted, x.draft_ms) for x in r.rounds]
        return r.token_ids, rounds, len(r.rounds)
    return run


def hf_runner(target, passes: list[int], temp: float, max_tokens: int, banned: tuple, draft=None, k=0, mode=None):
    kw = dict(max_new_tokens=max_tokens, do_sample=temp > 0, suppress_tokens=list(banned) or None)
    if temp > 0:
        kw.update(temperature=temp, top_k=0, top_p=1.0)  # same distribution as the engine's
    if mode == "hf-lookup":
        kw["prompt_lookup_num_tokens"] = k
    if mode == "hf-assisted":
        kw["assistant_model"] = draft

    def run(ids: list[int], seed: int):
        if mode == "hf-assisted":  # HF reads K from the assistant's generation_config
            gc = draft.generation_config
            gc.num_assistant_tokens, gc.num_assistant_tokens_schedule = k, "constant"
            gc.assistant_confidence_threshold = 0.0  # no early stop: K drafts every round
        x = torch.tensor([ids])
        torch.manual_seed(seed)
        passes[0] = 0
        out = target.generate(x, attention_mask=torch.ones_like(x), **kw)
        return out[0, len(ids):].tolist(), None, passes[0]
    return run


def measure(run, prompts: list[list[int]], seed: int, repeats: int = 1) -> dict:
    per_prompt, wall = [], 0.0
    for i, ids in enumerate(prompts):
        ms = float("inf")
        for _ in range(repeats):  # same seed: the same tokens every repeat
            t0 = time.perf_counter()
            tokens, rounds, passes = run(ids, seed + i)
            ms = min(ms, (time.perf_counter() - t0) * 1e3)
        wall += ms
        per_prompt.append({"tokens": tokens, "ms": round(ms, 3), "passes": passes, "rounds": rounds})
    n_tok = sum(len(p["tokens"]) for p in per_prompt)
    n_pass = sum(p["passes"] for p in per_prompt)
    return {"tokens": n_tok, "passes": n_pass, "wall_ms": round(wall, 3),
            "ms_per_token": wall / max(n_tok, 1), "passes_per_token": n_pass / max(n_tok, 1),
            "per_prompt": per_prompt}


def speedup_theory(alpha: float, k: int, c: float) -> float:
    gain = k + 1 if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)
    return gain / (k * c + 1)


def bisect(f, lo: float = 0.0, hi: float = 1.0, iters: int = 60) -> float:
    """Smallest x in [lo, hi] with f(x) >= 0 for increasing f."""
    for _ in range(iters):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if f(mid) >= 0 else (mid, hi)
    return hi


def breakeven_alpha(k: int, c: float) -> float | None:
    if speedup_theory(1.0, k, c) < 1:
        return None  # a draft step dearer than a target step never pays
    return bisect(lambda a: speedup_theory(a, k, c) - 1)


def alpha_fit(tokens_per_pass: float, k: int) -> float | None:
    if k == 0 or tokens_per_pass <= 0:
        return None
    return bisect(lambda a: speedup_theory(a, k, 0.0) - min(tokens_per_pass, k + 1))


def acceptance(per_prompt: list[dict], k: int) -> dict:
    """Acceptance figures from the engine's per-round (k, accepted, draft_ms) records."""
    rounds = [r for p in per_prompt if p["rounds"] for r in p["rounds"] if r[0] > 0]
    if not rounds:
        return {}
    acc = np.array([r[1] for r in rounds])
    ks = np.array([r[0] for r in rounds])
    return dict(mean_accepted=float(acc.mean()), p50_accepted=float(np.percentile(acc, 50)),
                p90_accepted=float(np.percentile(acc, 90)), spec_rounds=len(rounds),
                per_position=[float((acc[ks > i] > i).mean()) if (ks > i).any() else None for i in range(k)],
                alpha=float(acc.sum() / np.minimum(acc + 1, ks).sum()),
                accepted_over_proposed=float(acc.sum() / ks.sum()),
                draft_ms_per_token=float(sum(r[2] for r in rounds) / ks.sum()))


def summarize(res: dict, k: int) -> None:
    if res["tokens"] and res["passes"]:  # every method; HF's only acceptance figure
        res["accepted_per_pass"] = res["tokens"] / res["passes"] - 1
        res["alpha_fit"] = alpha_fit(res["tokens"] / res["passes"], k)
    res.update(acceptance(res["per_prompt"], k))


def nondegenerate(res: dict, keep: list[int]) -> dict:
    """The row's figures on the prompts whose greedy target continuation is not degenerate
    (textquality): a draft that learnt a loop is accepted almost always, so acceptance on
    looping text would flatter the speedup."""
    sub = [res["per_prompt"][i] for i in keep]
    n_tok = sum(len(p["tokens"]) for p in sub)
    out = {"n_prompts": len(sub), "ms_per_token": sum(p["ms"] for p in sub) / n_tok if n_tok else None}
    fig = acceptance(sub, res["K"])
    return out | {k: fig[k] for k in ("mean_accepted", "alpha", "per_position") if k in fig}


def degenerate_prompts(engine: ReferenceDecoder, prompts: list[list[int]], max_tokens: int,
                       banned: tuple) -> list[bool]:
    """Per prompt: is the target's greedy continuation degenerate (the same test at every T)."""
    params = GenerationParams(max_tokens, SamplingParams(banned_token_ids=banned), num_draft_tokens=0)
    return [is_degenerate(engine.generate(ids, params).token_ids) for ids in prompts]


def bench(args, pair: Path) -> tuple[list[dict], dict]:
    lp = load_pair(str(pair / "target"), str(pair / "draft"))
    target, draft, tok = lp.target, lp.draft, lp.tokenizer
    tm = TargetModel(target)
    banned = () if args.natural_eos else tuple(sorted(tm.eos_token_ids))
    engines = {"target": ReferenceDecoder(tm, None, tok), "spec-model": ReferenceDecoder(tm, HFDrafter(draft), tok),
               "spec-ngram": ReferenceDecoder(tm, NgramDrafter(tm.vocab_size), tok)}
    passes = [0]
    target.register_forward_pre_hook(lambda *_: passes.__setitem__(0, passes[0] + 1))

    def runner(method: str, temp: float, k: int, max_tokens: int):
        if method in engines:
            return engine_runner(engines[method], temp, k, max_tokens, banned)
        return hf_runner(target, passes, temp, max_tokens, banned, draft, k, method)

    prompts = {c: [engines["target"].encode_prompt(p) for p in ps]
               for c, ps in load_prompts(pair, args.prompts_per_class).items()}
    degenerate = {c: degenerate_prompts(engines["target"], ids, args.max_tokens, banned) for c, ids in prompts.items()}
    first = next(iter(prompts.values()))[:1]
    for m in args.methods:  # warm-up: first calls pay for lazy init and allocator growth
        for temp in args.temperatures:
            with contextlib.suppress(Exception):  # a failing mode is reported by the timed run
                measure(runner(m, temp, max(args.ks), 8), first, args.seed)
    results = []
    for cls, ids in prompts.items():
        for temp in args.temperatures:
            print(f"[bench] {cls} T={temp}", file=sys.stderr, flush=True)
            plan = [(m, 0) for m in ("target", "hf-plain") if m in args.methods]
            plan += [(m, k) for k in args.ks for m in SPEC if m in args.methods]
            block = []
            for method, k in plan:
                row = {"class": cls, "temperature": temp, "method": method, "K": k, "n_prompts": len(ids)}
                try:
                    row.update(measure(runner(method, temp, k, args.max_tokens), ids, args.seed, args.repeats))
                    summarize(row, k)
                except Exception as e:  # an unsupported mode is a result, not a crash
                    row["error"] = f"{type(e).__name__}: {e}"
                block.append(row)
            if "target" in args.methods:  # the baseline again at the block's end: best of both
                again = measure(runner("target", temp, 0, args.max_tokens), ids, args.seed, args.repeats)
                base = next(r for r in block if r["method"] == "target")
                for p, q in zip(base["per_prompt"], again["per_prompt"], strict=True):
                    p["ms"] = min(p["ms"], q["ms"])
                base["wall_ms"] = round(sum(p["ms"] for p in base["per_prompt"]), 3)
                base["ms_per_token"] = base["wall_ms"] / max(base["tokens"], 1)
            finish_block(block, temp, [i for i, d in enumerate(degenerate[cls]) if not d])
            results += block
    return results, {"vocab_size": tm.vocab_size, "banned_token_ids": list(banned), "degenerate_prompts": degenerate,
                     "target_params": sum(p.numel() for p in target.parameters()),
                     "draft_params": sum(p.numel() for p in draft.parameters())}


def finish_block(block: list[dict], temp: float, keep: list[int]) -> None:
    """Speedups, c, S_theory and greedy identity against the block's `target` row; the same
    speedup and acceptance on the non-degenerate prompts `keep` (row["nondegenerate"])."""
    base = next((r for r in block if r["method"] == "target" and "error" not in r), None)
    hf_base = next((r for r in block if r["method"] == "hf-plain" and "error" not in r), None)
    base_nd = nondegenerate(base, keep) if base else None
    for r in block:
        if "error" in r or base is None:
            continue
        r["speedup"] = base["ms_per_token"] / r["ms_per_token"]
        nd = r["nondegenerate"] = nondegenerate(r, keep)
        if nd["ms_per_token"]:
            nd["speedup"] = base_nd["ms_per_token"] / nd["ms_per_token"]
        if hf_base and r["method"].startswith("hf-"):
            r["speedup_vs_hf_plain"] = hf_base["ms_per_token"] / r["ms_per_token"]
        if "draft_ms_per_token" in r:
            r["c"] = r["draft_ms_per_token"] / base["ms_per_token"]
            r["s_theory"] = speedup_theory(r["alpha"], r["K"], r["c"])
        if temp == 0:
            same = [a["tokens"] == b["tokens"] for a, b in zip(r["per_prompt"], base["per_prompt"], strict=True)]
            r["greedy_identical"] = all(same)
            r["greedy_mismatch_prompts"] = [i for i, s in enumerate(same) if not s]


def breakeven_table(results: list[dict], ks: list[int]) -> dict:
    """Per drafter and K: c pooled over classes and temperatures, and the breakeven alpha."""
    table = {}
    for m in ("spec-model", "spec-ngram"):
        for k in ks:
            cs = [r["c"] for r in results if r["method"] == m and r["K"] == k and "c" in r]
            if cs:
                c = float(np.mean(cs))
                table.setdefault(m, {})[str(k)] = {"c": c, "alpha_breakeven": breakeven_alpha(k, c)}
    return table


def fmt(x, nd=2) -> str:
    return "-" if x is None else (f"{x:.{nd}f}" if isinstance(x, float) else str(x))


def acc_cell(r: dict) -> str:
    """Measured mean accepted (engine) or ~tokens per pass - 1 (HF, from the pass count)."""
    if "mean_accepted" in r:
        return fmt(r["mean_accepted"])
    return "-" if r["K"] == 0 or "accepted_per_pass" not in r else "~" + fmt(r["accepted_per_pass"])


def markdown(results: list[dict]) -> str:
    head = ("| class | T | method | K | mean acc | ms/token | speedup | S_theory | greedy= "
            "| non-degenerate: prompts | mean acc | speedup |\n" + "|---" * 12 + "|\n")
    lines = []
    for r in results:
        g, nd = r.get("greedy_identical"), r.get("nondegenerate", {})
        lines.append(f"| {r['class']} | {r['temperature']:g} | {r['method']} | {r['K']} | "
                     f"{acc_cell(r)} | {fmt(r.get('ms_per_token'))} | "
                     f"{fmt(r.get('speedup'))} | {fmt(r.get('s_theory'))} | "
                     f"{'-' if g is None else 'yes' if g else 'NO'} | "
                     f"{nd.get('n_prompts', '-')}/{r['n_prompts']} | {fmt(nd.get('mean_accepted'))} | "
                     f"{fmt(nd.get('speedup'))} |"
                     + (f" error: {r['error'][:80]}" if "error" in r else ""))
    return head + "\n".join(lines)


def best_table(results: list[dict]) -> tuple[str, list[dict]]:
    best: dict[tuple, dict] = {}
    for r in results:
        if r["method"] in SPEC and "speedup" in r:
            key = (r["class"], r["temperature"], r["method"])
            if key not in best or r["speedup"] > best[key]["speedup"]:
                best[key] = r
    rows = list(best.values())
    head = ("| class | T | method | best K | speedup | mean acc | alpha | passes/token "
            "| non-degenerate: speedup | mean acc | alpha |\n" + "|---" * 11 + "|\n")
    body = "\n".join(f"| {r['class']} | {r['temperature']:g} | {r['method']} | {r['K']} | "
                     f"{fmt(r['speedup'])} | {acc_cell(r)} | "
                     f"{fmt(r.get('alpha', r.get('alpha_fit')))} | {fmt(r['passes_per_token'])} | "
                     f"{fmt(r['nondegenerate'].get('speedup'))} | {fmt(r['nondegenerate'].get('mean_accepted'))} | "
                     f"{fmt(r['nondegenerate'].get('alpha'))} |" for r in rows)
    return head + body, [{k: r.get(k) for k in ("class", "temperature", "method", "K", "speedup")}
                         | {"nondegenerate_speedup": r["nondegenerate"].get("speedup")} for r in rows]


def plot_per_class(results: list[dict], methods, series, path: Path, hline=None, **axes_set) -> None:
    """One panel per class, one line per (method, T): series(rows) -> (xs, ys, label suffix)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    classes = list(dict.fromkeys(r["class"] for r in results))
    temps = list(dict.fromkeys(r["temperature"] for r in results))
    fig, axes = plt.subplots(1, len(classes), figsize=(5 * len(classes), 4), sharey=True, squeeze=False)
    for ax, cls in zip(axes[0], classes, strict=True):
        for j, m in enumerate(methods):
            for temp, style in zip(temps, ("-", "--", ":", "-."), strict=False):
                rows = [r for r in results if (r["class"], r["method"], r["temperature"]) == (cls, m, temp)
                        and "error" not in r]
                xs, ys, extra = series(rows)
                if xs:
                    ax.plot(xs, ys, style, marker="o", color=f"C{j}", label=f"{m} T={temp:g}{extra}")
        if hline is not None:
            ax.axhline(hline, color="grey", lw=0.8)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set(title=cls, **axes_set)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def speedup_series(rows):
    pts = sorted((r["K"], r["speedup"]) for r in rows if "speedup" in r)
    return [k for k, _ in pts], [v for _, v in pts], ""


def position_series(rows):
    rows = [r for r in rows if r.get("per_position")]
    if not rows:
        return [], [], ""
    r = max(rows, key=lambda r: r["K"])  # the largest K shows the most positions
    pts = [(i + 1, v) for i, v in enumerate(r["per_position"]) if v is not None]
    return [i for i, _ in pts], [v for _, v in pts], f" K={r['K']}"


def plot(results: list[dict], out: Path) -> list[str]:
    plot_per_class(results, SPEC, speedup_series, out / "speedup_vs_k.png", hline=1.0,
                   xlabel="K (draft tokens per round)", ylabel="speedup vs plain target (1 = parity)")
    plot_per_class(results, ("spec-model", "spec-ngram"), position_series,
                   out / "acceptance_by_position.png", xlabel="draft position",
                   ylabel="P(accepted | reached)", ylim=(0, 1.05))
    return ["speedup_vs_k.png", "acceptance_by_position.png"]


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    pair = find_pair(args.models)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    load_before = warn_if_busy()
    t0 = time.perf_counter()
    results, model_info = bench(args, pair)
    elapsed = time.perf_counter() - t0
    build = (pair / "build.json").read_bytes()
    table, best = best_table(results)
    report = {
        "meta": {"pair": str(pair), "build_digest": json.loads(build).get("digest"),
                 "build_json_sha256": hashlib.sha256(build).hexdigest()[:16],
                 "torch": torch.__version__, "transformers": transformers.__version__,
                 "torch_threads": torch.get_num_threads(), "interop_threads": torch.get_num_interop_threads(),
                 "cpu_count": os.cpu_count(), "platform": platform.platform(), "elapsed_s": round(elapsed, 1),
                 "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
                 "args": {k: v for k, v in vars(args).items()}, **model_info,
                 "alpha": "sum(accepted) / sum(min(accepted + 1, k)) over rounds with k > 0",
                 "alpha_fit": "a solving (1 - a^(K+1)) / (1 - a) = tokens per target pass",
                 "c": "draft ms per drafted token / plain target ms per token (same class, T)"},
        "breakeven": breakeven_table(results, args.ks),
        "best": best,
        "results": results,
    }
    (out / "engine.json").write_text(json.dumps(report, indent=1))
    plots = plot(results, out)
    for cls, flags in report["meta"]["degenerate_prompts"].items():
        print(f"{cls}: {sum(flags)} of {len(flags)} prompts have a degenerate greedy continuation")
    print(markdown(results))
    print("\n### Best K per (class, T, method)\n")
    print(table)
    print("\n### Breakeven alpha (S >= 1) for the measured c\n")
    for m, per_k in report["breakeven"].items():
        print(f"{m}: " + ", ".join(f"K={k} c={v['c']:.3f} a>={fmt(v['alpha_breakeven'], 3)}" for k, v in per_k.items()))
    print(f"\nwrote {out / 'engine.json'}, {', '.join(str(out / p) for p in plots)}; "
          f"elapsed {elapsed:.1f} s, torch threads {torch.get_num_threads()}")


if __name__ == "__main__":
    main()
