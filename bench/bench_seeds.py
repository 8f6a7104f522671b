"""What seeds that hold cost (issue 53, ADR 0027): the coupled sampler against rejection
sampling, on the demo pair in process, at T = 1 and T = 0.7, the same held-out prompts and seeds.

1. **Through the engine** (the engine loop beside the demo target, every session of a cell in
   one loop): pools `small` (the distilled draft model), `ngram-local` (prompt lookup),
   `eagle-local` (the pair's EAGLE head, chains) and `eagle-tree` (the head's token trees of two
   first candidates), K fixed, each session once judged by rejection sampling (what a request
   without a seed gets) and once coupled (a seed the client chose). Per cell: accepted drafts
   per speculative round, alpha (accepted / drafts tested), tokens per target pass, and
   whether every coupled output equals plain decoding's with its seed (it must) and how many
   rejection-sampled ones do not.
2. **Per position, exactly** (no sequence effects): along the target's own sampled
   continuations, the probability that a draft-model token is kept, 1 - TV(p, q) = sum
   min(p, q) under rejection sampling, against the probability that the draft's Gumbel-max draw
   meets the target's with shared noise (Monte Carlo over --noise-draws draws per position),
   with Gumbel coupling's lower bound (1 - TV) / (1 + TV), and the alternative it was chosen
   over: one shared uniform through both inverse CDFs in token-id order (exact: the overlap of
   the two tokens' CDF intervals). A drafter without a q (n-gram, one-hot) is kept with
   probability p(x) under all of them.
3. **The noise's cost** on this CPU: a verify's verdict over B rows of K + 1 positions, coupled
   against rejection sampling, and a draft position's pick.

Writes <out>/seeds/seeds.json and <out>/seeds/seeds.png. Run niced on a shared machine:

    nice -n 10 python bench/bench_seeds.py [--prompts-per-class 4] [--max-tokens 48] [--k 4]
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from common import parser, warn_if_busy

from specserve.algorithm.rejection import StepUniforms, coupled_judge, rejection_judge
from specserve.algorithm.sampling import exponentials, logits_to_probs
from specserve.algorithm.stops import StopChecker
from specserve.drafters.eagle import TargetParts, load_head
from specserve.drafters.hf import HFDrafter, pick_on_device
from specserve.drafters.ngram import NgramDrafter
from specserve.engine.drafting import LocalDrafts
from specserve.engine.eagle_local import EagleLocalDrafts
from specserve.engine.loop import EngineLoop
from specserve.engine.scheduler import Budget
from specserve.engine.session import EnginePlan
from specserve.engine.speculation import SpeculationSettings
from specserve.models.loading import load_pair
from specserve.models.verifier import TargetModel
from specserve.params import GenerationParams, SamplingParams
from specserve.tooling.modelbuild.build import find_pair, load_eval_prompts
from specserve.worker.model_step import Batching, make_target_step

POOLS = ("small", "ngram-local", "eagle-local", "eagle-tree")
SAMPLINGS = {"T1.0": SamplingParams(temperature=1.0), "T0.7": SamplingParams(temperature=0.7)}


def _source(pool: str, pair, head, parts):
    if pool == "small":
        return LocalDrafts(HFDrafter(pair.draft))
    if pool == "ngram-local":
        return LocalDrafts(NgramDrafter(pair.target.config.vocab_size))
    return EagleLocalDrafts(head, parts)


def engine_cell(model, pair, head, parts, pool: str | None, sampling: SamplingParams, prompts: list[list[int]],
                max_tokens: int, k: int, seeded: bool) -> dict:
    """Every prompt a session (seed 1000 + i), all in one loop; `seeded`: the coupled sampler."""
    sources = {"pool": _source(pool, pair, head, parts)} if pool else {}
    stops = lambda params: StopChecker(frozenset(), params.stop, lambda ids: "")  # noqa: E731
    loop = EngineLoop(model, stops, sources, budget=Budget(max_batch=64),
                      speculation=SpeculationSettings(tree_width=2 if pool == "eagle-tree" else 1, tree_always=True))
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        params = GenerationParams(max_tokens=max_tokens, num_draft_tokens=k if pool else 0, sampling=sampling,
                                  seed=1000 + i)
        loop.add(f"s{i}", p, EnginePlan(params, pool="pool" if pool else None, seeded=seeded))
    loop.run_until_idle()
    wall = time.perf_counter() - t0
    sessions = [loop.ended[f"s{i}"] for i in range(len(prompts))]
    spec = [r for s in sessions for r in s.rounds if r.k > 0]
    rounds = sum(len(s.rounds) for s in sessions)
    tested = sum(min(r.accepted + 1, r.k) for r in spec)
    tokens = sum(len(s.generated) for s in sessions)
    return {"accepted_per_round": sum(r.accepted for r in spec) / max(len(spec), 1),
            "alpha": sum(r.accepted for r in spec) / max(tested, 1), "tokens_per_pass": tokens / max(rounds, 1),
            "speculative_rounds": len(spec), "tokens": tokens, "wall_s": wall,
            "outputs": [s.generated for s in sessions]}


def per_position(pair, sampling: SamplingParams, prompts: list[list[int]], outputs: list[list[int]],
                 draws: int) -> dict:
    """Part 2 along the given continuations (the target's own, coupled plain decoding's)."""
    gen = torch.Generator().manual_seed(0)
    rej, coup, bound, inv = [], [], [], []
    with torch.inference_mode():
        for prompt, out in zip(prompts, outputs, strict=True):
            ids = torch.tensor([prompt + out])
            n = len(out)
            p = logits_to_probs(pair.target(ids).logits[0, len(prompt) - 1:len(prompt) - 1 + n].float(), sampling)
            q = logits_to_probs(pair.draft(ids).logits[0, len(prompt) - 1:len(prompt) - 1 + n].float(), sampling)
            tv = 1.0 - torch.minimum(p, q).sum(-1).double()
            rej += (1.0 - tv).tolist()
            bound += ((1.0 - tv) / (1.0 + tv)).tolist()
            fp, fq = torch.cumsum(p.double(), -1), torch.cumsum(q.double(), -1)
            inv += (torch.minimum(fp, fq) - torch.maximum(fp - p, fq - q)).clamp(min=0).sum(-1).tolist()
            for i in range(n):  # (one position's noise at a time: draws x V float64)
                e = exponentials(torch.randint(0, 2**53, (draws,), generator=gen), None, p.shape[-1])
                meet = (p[i].double() / e).argmax(-1) == (q[i].double() / e).argmax(-1)
                coup.append(float(meet.double().mean()))
    return {"positions": len(rej), "rejection_accept": float(np.mean(rej)), "coupled_accept": float(np.mean(coup)),
            "coupled_lower_bound": float(np.mean(bound)), "coupled_over_rejection": float(np.mean(coup) / np.mean(rej)),
            "inverse_cdf_accept": float(np.mean(inv)),
            "rejection_by_position": rej, "coupled_by_position": coup}


def noise_cost(vocab: int, k: int, repeats: int = 30) -> dict:
    """Part 3: ms per verdict over B rows (rejection vs coupled), and per draft pick."""
    out: dict = {"vocab": vocab, "k": k}
    gen = torch.Generator().manual_seed(0)
    for b in (1, 16):
        p = torch.softmax(torch.randn(b, k + 1, vocab, generator=gen), -1)
        q = torch.softmax(torch.randn(b, k, vocab, generator=gen), -1)
        draft = torch.randint(0, vocab, (b, k), generator=gen)
        num = torch.full((b,), k)
        u = StepUniforms.draw(np.arange(b, dtype=np.uint64), np.full(b, 100), k)
        for name, judge in (("rejection", rejection_judge), ("coupled", coupled_judge)):
            judge(p, draft, num, q, u)
            t0 = time.perf_counter()
            for _ in range(repeats):
                judge(p, draft, num, q, u)
            out[f"verdict_ms_{name}_b{b}"] = (time.perf_counter() - t0) / repeats * 1e3
    logits = torch.randn(vocab, generator=gen)
    u = torch.tensor([0.25], dtype=torch.float64)
    sp = SamplingParams(temperature=1.0)
    for name, mass, entries in (("pick_ms_truncated", 0.999, 256), ("pick_ms_dense", 1.0, 0)):
        t0 = time.perf_counter()
        for _ in range(repeats):
            pick_on_device(logits, sp, u, mass, entries)
        out[name] = (time.perf_counter() - t0) / repeats * 1e3
    return out


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--prompts-per-class", type=int, default=4)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--noise-draws", type=int, default=256)
    a = ap.parse_args()
    load = warn_if_busy()
    torch.set_num_threads(a.threads)
    pair_dir = find_pair(a.models)
    pair = load_pair(str(pair_dir / "target"), str(pair_dir / "draft"))
    head = load_head(pair_dir / "eagle")
    parts = TargetParts(pair.target, head.cfg.feature_layers)
    n = a.prompts_per_class
    chosen = [p for cls in ("code", "chat", "extraction")
              for p in [q for q in load_eval_prompts(pair_dir) if q["workload_class"] == cls][:n]]
    prompts = [pair.tokenizer.encode(p["prompt"]) for p in chosen]
    model = make_target_step(TargetModel(pair.target), Batching(max_sessions=len(prompts) + 2, max_len=512,
                                                                max_batch=len(prompts)))
    model.keep_features(head.cfg.feature_layers)
    eos = pair.target.generation_config.eos_token_id
    rows, positions = [], {}
    for tname, sampling in SAMPLINGS.items():
        # EOS banned: every session emits --max-tokens (the shared transform bans it on both sides)
        sampling = replace(sampling, banned_token_ids=(eos,) if eos is not None else ())
        plain = engine_cell(model, pair, head, parts, None, sampling, prompts, a.max_tokens, 0, True)["outputs"]
        for pool in POOLS:
            cells = {s: engine_cell(model, pair, head, parts, pool, sampling, prompts, a.max_tokens, a.k,
                                    seeded=s == "coupled") for s in ("rejection", "coupled")}
            for sampler, c in cells.items():
                row = {"temperature": tname, "pool": pool, "sampler": sampler, "k": a.k,
                       **{key: v for key, v in c.items() if key != "outputs"},
                       "outputs_equal_plain": sum(o == w for o, w in zip(c["outputs"], plain, strict=True)),
                       "sessions": len(prompts)}
                rows.append(row)
                print(f"{tname} {pool:12} {sampler:9} acc/round {row['accepted_per_round']:.2f}  "
                      f"alpha {row['alpha']:.3f}  tok/pass {row['tokens_per_pass']:.2f}  "
                      f"= plain {row['outputs_equal_plain']}/{len(prompts)}", flush=True)
        positions[tname] = per_position(pair, sampling, prompts, plain, a.noise_draws)
        pp = positions[tname]
        print(f"{tname} per position ({pp['positions']}): rejection {pp['rejection_accept']:.3f}  coupled "
              f"{pp['coupled_accept']:.3f}  bound {pp['coupled_lower_bound']:.3f}  inverse-CDF coupling "
              f"{pp['inverse_cdf_accept']:.3f}", flush=True)
    cost = noise_cost(pair.target.config.vocab_size, a.k)
    print("noise cost (ms):", {k: round(v, 3) for k, v in cost.items() if k.endswith(("b1", "b16", "truncated",
                                                                                         "dense"))})
    out = Path(a.out) / "seeds"
    out.mkdir(parents=True, exist_ok=True)
    (out / "seeds.json").write_text(json.dumps({
        "load_before": load, "load_after": warn_if_busy(), "k": a.k, "max_tokens": a.max_tokens, "threads": a.threads,
        "prompts": len(prompts), "seeds": "1000 + prompt index", "rows": rows,
        "per_position": {t: {k: v for k, v in pp.items() if not k.endswith("by_position")}
                         for t, pp in positions.items()},
        "noise_cost": cost}, indent=1))
    _plot(rows, positions, out / "seeds.png")
    print(f"wrote {out / 'seeds.json'} and {out / 'seeds.png'}")


def _plot(rows: list[dict], positions: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    temps = list(SAMPLINGS)
    for ax, metric, label in ((axes[0], "accepted_per_round", "accepted drafts per round"),
                              (axes[1], "tokens_per_pass", "tokens per target pass")):
        width = 0.2
        for j, (t, sampler) in enumerate((t, s) for t in temps for s in ("rejection", "coupled")):
            ys = [next(r[metric] for r in rows if r["pool"] == p and r["temperature"] == t and r["sampler"] == sampler)
                  for p in POOLS]
            ax.bar(np.arange(len(POOLS)) + (j - 1.5) * width, ys, width, label=f"{t} {sampler}",
                   hatch="//" if sampler == "coupled" else None, alpha=0.85)
        ax.set_xticks(np.arange(len(POOLS)), POOLS)
        ax.set_ylabel(label)
    axes[0].legend(fontsize=8)
    ax = axes[2]
    for t, pp in positions.items():
        ax.scatter(pp["rejection_by_position"], pp["coupled_by_position"], s=6, alpha=0.5,
                   label=f"{t}: mean {pp['coupled_accept']:.3f} vs {pp['rejection_accept']:.3f}")
    ax.plot([0, 1], [0, 1], color="grey", lw=0.5)
    ax.set(xlabel="P(kept), rejection sampling: 1 - TV(p, q)", ylabel="P(kept), coupled: Gumbel meets",
           title="small draft, per position")
    ax.legend(fontsize=8)
    fig.suptitle("seeds that hold (ADR 0027): the coupled sampler against rejection sampling, demo pair, CPU")
    fig.tight_layout()
    fig.savefig(path)


if __name__ == "__main__":
    main()
