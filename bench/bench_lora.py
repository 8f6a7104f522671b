"""LoRA adapters with speculation (ADR 0029): the three figures of issue 55, on the shipped pair
and its demo adapter (models/specserve-demo-v1/adapters/records-nested), in one run.

1. step: one forward of 16 verify rows (K = 4, 5 tokens each, sessions of ~200 cached
   positions) on the target's runner, with the rows of (a) the base only, (b) one adapter, (c)
   three adapters and the base, four rows each; the eager forward (the CPU's: segmented
   products) and the device step's fixed shapes (masked products), the configurations
   interleaved rep by rep, median ms. Target: mixed <= 1.3 x single.
2. acceptance: the adapter's held-out prompts, greedy, K = 4, through the engine in process:
   mean accepted drafts a round of the base draft (`small`) and of the adapter's own drafter (the
   draft with its draft-side LoRA merged, `small-records-nested`). Target: >= 1.3 x.
3. speedup over plain per adapter, the engine choosing each round's K (adaptive, 1..8: its
   controller of K and plain, kchoice.py): the base on the pair's held-out extraction prompts
   with `small`; the adapter on its own prompts with `small` and with its drafter; requests one
   at a time, plain and speculative alternated `--repeats` times a prompt (the fastest of each
   kept: the machine is shared), ms per token.

Writes <out>/lora.json and <out>/lora.png.
"""

from __future__ import annotations

import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from common import parser, warn_if_busy

from specserve.models.lora import merge_adapter, read_adapter
from specserve.models.lora_set import Prepared, enable_lora
from specserve.models.runner import ModelRunner, Row
from specserve.tooling.modelbuild.build import find_pair, load_eval_prompts

ADAPTER = "records-nested"


def parse_args(argv=None):
    p = parser(__doc__)
    p.set_defaults(out="bench/results/lora")
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--prompts", type=int, default=12, help="held-out prompts for figures 2 and 3")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3, help="figure 3: plain and speculative alternated, fastest kept")
    p.add_argument("--parts", default="step,acceptance,speedup")
    return p.parse_args(argv)


def _random_like(lora, adapter, seed: int) -> Prepared:
    """Another adapter of the demo adapter's rank and modules, random weights (the step's cost does
    not depend on the values)."""
    g = torch.Generator().manual_seed(seed)
    prepared = lora.prepare(adapter)
    return Prepared(adapter, {k: (torch.randn(a.shape, generator=g) * (a != 0), torch.randn(b.shape, generator=g)
                                  * (b != 0) * 0.01) for k, (a, b) in prepared.weights.items()})


def step_figure(pair: Path, rows: int, reps: int) -> dict:
    from specserve.models.loading import load_model

    model = load_model(str(pair / "target"))
    adapter = read_adapter(pair / "adapters" / ADAPTER / "target", ADAPTER)
    out = {}
    for path in ("eager", "device-step"):
        runner = ModelRunner.from_hf(model, max_sessions=3 * rows + 2, max_len=512, tile=4 if path == "eager" else None)
        lora = enable_lora(runner, model.config, 4, 16)
        lora.install(lora.prepare(adapter))
        for i, name in enumerate(("b", "c")):
            other = read_adapter(pair / "adapters" / ADAPTER / "target", name)
            lora.install(_random_like(lora, other, i))
        if path == "device-step":
            runner.enable_device_step(max_rows=rows)
        mixes = {"base": [""] * rows, "single": [ADAPTER] * rows,
                 "mixed": [(ADAPTER, "b", "c", "")[i % 4] for i in range(rows)]}
        sessions = {}
        for mix, names in mixes.items():
            sessions[mix] = []
            for i, name in enumerate(names):
                sid = f"{mix}-{i}"
                runner.allocate(sid, name)
                runner.forward([Row(sid, [(7 * i + j) % 4000 + 5 for j in range(190 + i)], num_logits=0)])
                sessions[mix].append(sid)
        times: dict[str, list[float]] = {m: [] for m in mixes}
        for rep in range(reps + 3):
            for mix in mixes:
                lengths = [runner.length(s) for s in sessions[mix]]
                batch = [Row(s, [11, 12, 13, 14, 15], num_logits=5) for s in sessions[mix]]
                t0 = time.perf_counter()
                runner.forward(batch)
                dt = (time.perf_counter() - t0) * 1e3
                for s, n in zip(sessions[mix], lengths, strict=True):
                    runner.rollback(s, n)
                if rep >= 3:  # (warm-up)
                    times[mix].append(dt)
        med = {m: statistics.median(v) for m, v in times.items()}
        out[path] = {"ms": med, "mixed_over_single": med["mixed"] / med["single"],
                     "single_over_base": med["single"] / med["base"], "mixed_over_base": med["mixed"] / med["base"],
                     "reps": reps, "rows": rows}
        print(f"[step] {path}: " + ", ".join(f"{m} {v:.1f} ms" for m, v in med.items())
              + f"; mixed / single {med['mixed'] / med['single']:.2f}")
    return out


def _engine(pair: Path, draft_merged):
    """An in-process engine on the target with the adapter, pools `small` and the adapter's drafter."""
    from specserve.algorithm.stops import StopChecker
    from specserve.drafters import HFDrafter
    from specserve.engine.drafting import LocalDrafts
    from specserve.engine.loop import EngineLoop
    from specserve.models.loading import load_pair
    from specserve.models.verifier import TargetModel
    from specserve.worker.model_step import Batching, make_target_step

    lp = load_pair(str(pair / "target"), str(pair / "draft"))
    target = TargetModel(lp.target)
    model = make_target_step(target, Batching(kv_budget_mb=64, max_sessions=8, max_len=512, max_loras=2,
                                              max_lora_rank=8))
    model.adapters.install(model.adapters.prepare(read_adapter(pair / "adapters" / ADAPTER / "target", ADAPTER)))
    loop = EngineLoop(model, lambda p: StopChecker(target.eos_token_ids, p.stop, lp.tokenizer.decode),
                      {"small": LocalDrafts(HFDrafter(lp.draft)),
                       f"small-{ADAPTER}": LocalDrafts(HFDrafter(draft_merged))})
    return lp, loop


def _run_one(loop, sid: str, ids: list[int], plan) -> tuple[list, float, int]:
    t0 = time.perf_counter()
    opened = loop.add(sid, ids, plan)
    loop.run_until_idle()
    opened.result(0)
    dt = time.perf_counter() - t0
    s = loop.ended[sid]
    return s.rounds, dt, s.n_generated


def _plan(adapter: str, pool: str | None, max_tokens: int, k: int, adaptive: bool):
    from specserve.engine.session import EnginePlan
    from specserve.params import GenerationParams, SamplingParams

    # EOS banned: every run emits max_tokens
    params = GenerationParams(max_tokens=max_tokens, num_draft_tokens=k, seed=1,
                              sampling=SamplingParams(banned_token_ids=(0,)))
    stats = f"extraction@{adapter}" if adapter else "extraction"
    return EnginePlan(params, pool=pool, workload_class="extraction", adapter=adapter, adaptive=adaptive,
                      k_min=1, k_max=8 if adaptive else 0, stats_class=stats)


def engine_figures(pair: Path, prompts: int, max_tokens: int, parts: set[str], repeats: int = 3) -> dict:
    from specserve.models.loading import load_model

    draft_merged = load_model(str(pair / "draft"))
    merge_adapter(draft_merged, pair / "adapters" / ADAPTER / "draft", ADAPTER)
    lp, loop = _engine(pair, draft_merged)
    held = json.loads((pair / "adapters" / ADAPTER / "eval_prompts.json").read_text())["prompts"][:prompts]
    mine = [lp.tokenizer.encode(p["prompt"]) for p in held]
    base_prompts = [lp.tokenizer.encode(p["prompt"]) for p in load_eval_prompts(pair)
                    if p["workload_class"] == "extraction"][:prompts]
    out: dict = {}
    n = 0
    if "acceptance" in parts:
        acc = {}
        for pool in ("small", f"small-{ADAPTER}"):
            rounds = []
            for ids in mine:
                n += 1
                rounds += [r for r in _run_one(loop, f"a{n}", ids, _plan(ADAPTER, pool, max_tokens, 4, False))[0]
                           if r.k > 0]
            acc[pool] = {"mean_accepted": sum(r.accepted for r in rounds) / max(len(rounds), 1), "rounds": len(rounds)}
        out["acceptance"] = {**acc, "ratio": acc[f"small-{ADAPTER}"]["mean_accepted"] / acc["small"]["mean_accepted"],
                             "k": 4, "prompts": len(mine), "max_tokens": max_tokens}
        print(f"[acceptance] {ADAPTER}'s prompts, K = 4: base draft {acc['small']['mean_accepted']:.2f}, its own "
              f"drafter {acc[f'small-{ADAPTER}']['mean_accepted']:.2f} ({out['acceptance']['ratio']:.2f}x)")
    if "speedup" in parts:
        arms = {"base / small": ("", "small", base_prompts), f"{ADAPTER} / small": (ADAPTER, "small", mine),
                f"{ADAPTER} / small-{ADAPTER}": (ADAPTER, f"small-{ADAPTER}", mine)}
        sp = {}
        for arm, (adapter, pool, ids_list) in arms.items():
            plain_s = spec_s = 0.0
            tokens = 0
            for j, ids in enumerate(ids_list):
                best = {"plain": float("inf"), "spec": float("inf")}
                for rep in range(repeats + (j == 0)):  # (the arm's first prompt once more: its warm-up)
                    for kind, plan in (("plain", _plan(adapter, None, max_tokens, 0, False)),
                                       ("spec", _plan(adapter, pool, max_tokens, 4, True))):
                        n += 1
                        _, dt, got = _run_one(loop, f"{kind}{n}", ids, plan)
                        if rep or j:
                            best[kind] = min(best[kind], dt)
                plain_s, spec_s, tokens = plain_s + best["plain"], spec_s + best["spec"], tokens + got
            sp[arm] = {"plain_ms_per_token": plain_s / tokens * 1e3, "spec_ms_per_token": spec_s / tokens * 1e3,
                       "speedup": plain_s / spec_s, "prompts": len(ids_list), "repeats": repeats}
            print(f"[speedup] {arm}: plain {sp[arm]['plain_ms_per_token']:.1f} ms/token, speculative (adaptive K) "
                  f"{sp[arm]['spec_ms_per_token']:.1f}: {sp[arm]['speedup']:.2f}x")
        out["speedup"] = sp
    return out


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    if "step" in result:
        ax = axes[0]
        mixes = ("base", "single", "mixed")
        for j, (path_name, r) in enumerate(result["step"].items()):
            ax.bar([i + 0.4 * j for i in range(3)], [r["ms"][m] for m in mixes], 0.4, label=path_name)
        ax.set_xticks([i + 0.2 for i in range(3)], ["base rows", "one adapter", "3 adapters + base"])
        ax.set_ylabel("ms per step (16 verify rows, K = 4)")
        ax.set_title("a mixed-adapter step against one adapter's")
        ax.legend()
    if "acceptance" in result:
        a = result["acceptance"]
        ax = axes[1]
        names = [k for k in a if isinstance(a[k], dict)]
        ax.bar(names, [a[k]["mean_accepted"] for k in names], color=["grey", "tab:green"])
        ax.set_ylabel("accepted drafts a round (K = 4, greedy)")
        ax.set_title(f"{ADAPTER}'s held-out prompts: {a['ratio']:.2f}x")
    if "speedup" in result:
        ax = axes[2]
        s = result["speedup"]
        ax.bar([k.replace(" / ", "\n") for k in s], [v["speedup"] for v in s.values()], color="tab:blue")
        ax.axhline(1.0, color="black", lw=0.8)
        ax.set_ylabel("speedup over plain (adaptive K)")
        ax.set_title("per adapter, the engine choosing K")
        ax.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> None:
    args = parse_args(argv)
    load = warn_if_busy()
    torch.set_num_threads(args.threads)
    pair = find_pair(Path(args.models))
    parts = set(args.parts.split(","))
    result: dict = {"command": " ".join(["python bench/bench_lora.py", *(sys.argv[1:] if argv is None else argv)]),
                    "load_before": load,
                    "machine": platform.processor() or platform.machine(), "torch": torch.__version__,
                    "threads": args.threads}
    t0 = time.time()
    if "step" in parts:
        result["step"] = step_figure(pair, args.rows, args.reps)
    if parts & {"acceptance", "speedup"}:
        result.update(engine_figures(pair, args.prompts, args.max_tokens, parts, args.repeats))
    result["seconds"] = round(time.time() - t0, 1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "lora.json").write_text(json.dumps(result, indent=1) + "\n")
    plot(result, out / "lora.png")
    print(f"wrote {out / 'lora.json'} and {out / 'lora.png'}")


if __name__ == "__main__":
    main()
