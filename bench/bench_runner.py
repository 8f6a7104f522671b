"""Batched forward microbenchmark: HF's batched forward vs the specserve model runner.

One step = one forward of B rows, each appending `new` tokens (1: a decode step, 5: the last
token + K=4 drafts) after `--context` cached tokens, then a rollback of those tokens so every
step sees the same context. Methods, timed side by side in one run and interleaved:
  hf            transformers forward on [B, new] ids with a batched DynamicCache (crop after)
  runner-tT     ModelRunner, batch-invariant, one GEMM call per tile of T tokens (--tiles)
  runner-tT-fused  the same tiles, one GEMM per run of up to --fuse-upto tokens (the default
                mode; the runner checks at start-up that rows keep their bits, else tiles)
  runner-plain  ModelRunner with tile=None: one call over all tokens (not batch-invariant)

Each method's logits for row 0 (the same context and tokens at every B) are compared with its
own batch-1 logits: `row0_bitwise_equal_b1` says whether the batch changed them. Timings: ms
per step, median and min over --repeats x --steps samples, by the wall clock and by process
CPU time (on a shared machine the CPU time of a one-thread run is the steadier figure: it
leaves out the time other processes hold the core). Writes <out>/runner.json and
<out>/runner.png; prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

if not sys.stdout.isatty():
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TQDM_DISABLE", "1")

import torch
import transformers
from common import parser, warn_if_busy
from transformers import DynamicCache

from specserve.models.kvcache import crop_cache
from specserve.models.loading import load_model
from specserve.models.runner import ModelRunner, Row


def parse_args(argv=None) -> argparse.Namespace:
    p = parser(__doc__)
    p.add_argument("--batches", default="1,4,16")
    p.add_argument("--new", default="1,5", help="new tokens per row")
    p.add_argument("--context", type=int, default=200)
    p.add_argument("--tiles", default="4,8", help="tile sizes of the invariant runner")
    p.add_argument("--fuse-upto", type=int, default=128, help="0: no fused variants")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    a.batches = [int(x) for x in a.batches.split(",")]
    a.new = [int(x) for x in a.new.split(",")]
    a.tiles = [int(x) for x in a.tiles.split(",")]
    return a


def resolve_target(models: str) -> Path:
    root = Path(models)
    for cand in (root / "target", root / "default" / "target", root / "tiny" / "target",
                 Path(".cache/models/tiny/target")):
        if (cand / "config.json").exists():
            return cand
    raise SystemExit(f"no target model under {root} (run `make models`)")


def progress(msg: str) -> None:
    if sys.stderr.isatty():
        print(msg, file=sys.stderr, flush=True)


class HFMethod:
    def __init__(self, model, contexts: torch.Tensor) -> None:  # contexts [Bmax, C]
        self.model, self.contexts = model, contexts
        self.cache: DynamicCache | None = None

    @torch.inference_mode()
    def setup(self, b: int) -> None:
        self.cache = DynamicCache()
        self.model(input_ids=self.contexts[:b], past_key_values=self.cache, use_cache=True)
        self.ctx = self.contexts.shape[1]

    @torch.inference_mode()
    def step(self, new: torch.Tensor) -> torch.Tensor:  # new [B, n] -> logits of row 0 [n, V]
        out = self.model(input_ids=new, past_key_values=self.cache, use_cache=True)
        crop_cache(self.cache, self.ctx)
        return out.logits[0].float()


class RunnerMethod:
    def __init__(self, model, contexts: torch.Tensor, tile: int | None, fuse_upto: int = 0) -> None:
        self.runner = ModelRunner.from_hf(model, max_sessions=contexts.shape[0],
                                          max_len=contexts.shape[1] + 16, tile=tile,
                                          fuse_upto=fuse_upto)
        self.contexts = contexts

    def setup(self, b: int) -> None:
        for s in list(self.runner.kv.slot_of):
            self.runner.free(s)
        for i in range(b):
            self.runner.allocate(i)
            self.runner.forward([Row(i, self.contexts[i].tolist(), num_logits=0)])
        self.ctx = self.contexts.shape[1]

    def step(self, new: torch.Tensor) -> torch.Tensor:
        rows = [Row(i, new[i].tolist()) for i in range(new.shape[0])]
        logits = self.runner.forward(rows)
        for i in range(new.shape[0]):
            self.runner.rollback(i, self.ctx)
        return logits[0]


def bench(args, model) -> list[dict]:
    g = torch.Generator().manual_seed(args.seed)
    vocab = int(model.get_output_embeddings().weight.shape[0])
    bmax, nmax = max(args.batches), max(args.new)
    contexts = torch.randint(2, vocab, (bmax, args.context), generator=g)
    new_ids = torch.randint(2, vocab, (bmax, nmax), generator=g)
    methods = {"hf": HFMethod(model, contexts)}
    for t in args.tiles:
        methods[f"runner-t{t}"] = RunnerMethod(model, contexts, t)
        if args.fuse_upto:
            fused = RunnerMethod(model, contexts, t, args.fuse_upto)
            if not fused.runner.fused_threads:
                print(f"[bench] tile {t}: the fused-GEMM check failed; runner-t{t}-fused runs "
                      "tile by tile", file=sys.stderr)
            methods[f"runner-t{t}-fused"] = fused
    methods["runner-plain"] = RunnerMethod(model, contexts, None)
    rows = []
    row0_b1: dict[tuple[str, int], torch.Tensor] = {}
    for b in args.batches:
        for m in methods.values():
            m.setup(b)
        for n in args.new:
            new = new_ids[:b, :n].contiguous()
            samples: dict[str, list[float]] = {k: [] for k in methods}
            cpu: dict[str, list[float]] = {k: [] for k in methods}
            row0 = {}
            for name, m in methods.items():  # warm-up
                row0[name] = m.step(new)
                m.step(new)
            for rep in range(args.repeats):
                progress(f"B={b} new={n} repeat {rep + 1}/{args.repeats}")
                for name, m in methods.items():
                    for _ in range(args.steps):
                        t0, c0 = time.perf_counter(), time.process_time()
                        m.step(new)
                        samples[name].append((time.perf_counter() - t0) * 1e3)
                        cpu[name].append((time.process_time() - c0) * 1e3)
            for name in methods:
                if b == args.batches[0]:
                    row0_b1[(name, n)] = row0[name]
                ref = row0_b1[(name, n)]
                rows.append({
                    "method": name, "batch": b, "new_tokens": n,
                    "ms_median": statistics.median(samples[name]), "ms_min": min(samples[name]),
                    "cpu_ms_median": statistics.median(cpu[name]), "cpu_ms_min": min(cpu[name]),
                    "row0_bitwise_equal_b1": bool(torch.equal(row0[name], ref)),
                    "row0_max_abs_diff_b1": float((row0[name] - ref).abs().max()),
                    "samples_ms": [round(s, 3) for s in samples[name]],
                })
    return rows


def markdown(rows: list[dict], methods: list[str], key: str = "ms") -> str:
    """ms per step (median / min), then each runner vs hf and each invariant runner vs
    runner-plain (the cost of invariance), as ratios of medians. key: "ms" or "cpu_ms"."""
    tiles = [m for m in methods if m.startswith("runner-t")]
    ratio_cols = [(m, "hf") for m in methods[1:]] + [(m, "runner-plain") for m in tiles]
    head = ["B", "new"] + [f"{m} ms" for m in methods] + [f"{a} / {b}" for a, b in ratio_cols]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    keys = sorted({(r["batch"], r["new_tokens"]) for r in rows})
    for b, n in keys:
        by = {r["method"]: r for r in rows if r["batch"] == b and r["new_tokens"] == n}
        cells = [f"{by[m][key + '_median']:.1f} / {by[m][key + '_min']:.1f}"
                 + ("" if by[m]["row0_bitwise_equal_b1"] else " ≠") for m in methods]
        cells += [f"{by[a][key + '_median'] / by[c][key + '_median']:.2f}" for a, c in ratio_cols]
        lines.append(f"| {b} | {n} | " + " | ".join(cells) + " |")
    lines.append(f"\n{key}: median / min. ≠: row 0's logits differ bitwise from the same method at "
                 f"batch {keys[0][0]} (not batch-invariant).")
    return "\n".join(lines)


def plot(rows: list[dict], methods: list[str], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = sorted({(r["batch"], r["new_tokens"]) for r in rows})
    fig, axes = plt.subplots(1, 2, figsize=(13, 4))
    width = 0.8 / len(methods)
    for ax, key, label in zip(axes, ("ms_median", "cpu_ms_median"),
                              ("wall ms per step (median)", "process CPU ms per step (median)"),
                              strict=True):
        for i, m in enumerate(methods):
            ys = [next(r[key] for r in rows if r["method"] == m and (r["batch"], r["new_tokens"]) == k)
                  for k in keys]
            ax.bar([j + i * width for j in range(len(keys))], ys, width, label=m)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(keys))])
        ax.set_xticklabels([f"B={b}\nnew={n}" for b, n in keys])
        ax.set_ylabel(label)
    axes[0].set_title("Batched forward: HF vs specserve runner")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    target = resolve_target(args.models)
    model = load_model(str(target))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    load_before = warn_if_busy("compare the methods' ratios, measured side by side")
    t0 = time.perf_counter()
    rows = bench(args, model)
    methods = ["hf"] + [m for t in args.tiles for m in
                        ([f"runner-t{t}"] + ([f"runner-t{t}-fused"] if args.fuse_upto else []))] + ["runner-plain"]
    cfg = model.config
    report = {
        "meta": {"target": str(target), "layers": cfg.num_hidden_layers, "hidden": cfg.hidden_size,
                 "torch": torch.__version__, "transformers": transformers.__version__,
                 "torch_threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
                 "platform": platform.platform(), "device": "cpu (no GPU lent)",
                 "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
                 "elapsed_s": round(time.perf_counter() - t0, 1),
                 "args": vars(args)},
        "results": rows,
    }
    (out / "runner.json").write_text(json.dumps(report, indent=1))
    plot(rows, methods, out / "runner.png")
    print(f"target {target} ({cfg.num_hidden_layers}x{cfg.hidden_size}), context {args.context}, "
          f"{args.threads} threads, load {load_before[0]:.2f} -> {os.getloadavg()[0]:.2f}\n")
    print("### Wall clock\n")
    print(markdown(rows, methods))
    print("\n### Process CPU time\n")
    print(markdown(rows, methods, "cpu_ms"))
    print(f"\nwrote {out / 'runner.json'}, {out / 'runner.png'}")


if __name__ == "__main__":
    main()
