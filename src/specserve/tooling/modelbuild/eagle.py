"""`specserve models eagle`: train an EAGLE-style draft head for a target (ADR 0020).

The recipe, deterministic from its seed on one CPU type (as the pair's, `build.py`):
- data: the project's own corpus (the pair's recipe: the standard library's source, its
  docs and docstrings, generated extraction records), tokenized with the target's tokenizer,
  sampled as random windows mixed by class;
- per batch, the frozen target's features (the output of its `feature_layers`), its last
  layer's output and its logits, from one forward;
- the head predicts each next position's feature from the current feature and the next
  token, and is trained on (1) the regression of its prediction onto the target's last-layer
  feature (smooth L1, in units of that feature's RMS) and (2) the cross-entropy of the target's
  LM head on its prediction against the target's own distribution there; noise on the input
  features (EAGLE's);
- a second, unrolled pass (EAGLE-3's training-time test, one step): each position's input is
  the head's own prediction, attending to the true prefix before it and itself, as when it
  drafts the second token of a block.
The held-out acceptance (`acceptance`): on the pair's held-out prompts, the target's greedy
continuation, and at each position a K-token block drafted by the head from the true prefix;
the accepted length is the block's agreement with the continuation, as a greedy verify
would count it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from specserve.drafters.eagle import EagleConfig, EagleHead, HeadCache, TargetParts, save_head
from specserve.tooling.modelbuild.train import WindowSampler, _lr

RECIPE_VERSION = 1


@dataclass(frozen=True)
class HeadRecipe:
    feature_layers: tuple[int, ...] | None = None  # None: the target's last layer
    seq_len: int = 256
    batch: int = 8
    steps: int = 1200
    lr: float = 1e-3
    noise: float = 0.1  # uniform noise on the input features, as a fraction of their RMS
    reg_weight: float = 1.0
    cls_weight: float = 1.0
    unroll_weight: float = 0.5  # the second, unrolled pass (0: none)
    seed: int = 0
    threads: int = 2
    # the corpus (the demo pair's recipe)
    code_bytes: int = 8_000_000
    prose_bytes: int = 4_000_000
    n_extraction: int = 3000
    corpus_version: int = 2
    weights: tuple[tuple[str, float], ...] = (("code", 0.5), ("chat", 0.25), ("extraction", 0.25))

    def digest(self, target_digest: str) -> str:
        blob = json.dumps({"v": RECIPE_VERSION, "target": target_digest, **dataclasses.asdict(self)}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]


def target_digest(target_dir: Path) -> str:
    """sha256 of the target's weights files (the head is trained for exactly these)."""
    h = hashlib.sha256()
    for f in sorted(Path(target_dir).glob("*.safetensors")):
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def _streams(tokenizer, recipe: HeadRecipe) -> tuple[dict[str, torch.Tensor], dict[str, list[str]]]:
    from specserve.tooling.modelbuild.corpus import CLASSES, build_corpus

    corpus = build_corpus(recipe.code_bytes, recipe.prose_bytes, recipe.n_extraction, recipe.seed,
                          recipe.corpus_version)
    eos = tokenizer.eos_token_id
    streams = {c: torch.tensor([t for d in corpus.train[c] for t in tokenizer.encode(d) + [eos]], dtype=torch.long)
               for c in CLASSES}
    return streams, corpus.heldout


def _soft_ce(head_logits: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the head's distribution against the target's: -sum p log q."""
    p = torch.softmax(target_logits, -1)
    return -(p * torch.log_softmax(head_logits, -1)).sum(-1).mean()


def head_losses(head: EagleHead, parts: TargetParts, ids: torch.Tensor, recipe: HeadRecipe,
                gen: torch.Generator | None = None) -> dict[str, torch.Tensor]:
    """The recipe's losses on one batch of windows ids [B, T]."""
    feats, last, logits = parts.features(ids)
    scale = last.pow(2).mean().sqrt().clamp(min=1e-6)
    b, t = ids.shape
    inputs = head.project(feats[:, :-1])
    if recipe.noise > 0:
        noise = torch.rand(inputs.shape, generator=gen) * 2 - 1
        inputs = inputs + recipe.noise * inputs.detach().pow(2).mean().sqrt() * noise
    with torch.no_grad():
        nxt = parts.embed(ids[:, 1:])  # [B, T-1, H]: the token after each input position
    pos = torch.arange(t - 1).expand(b, -1)
    x1 = head.fc(torch.cat([nxt, inputs], -1))
    pred1, (k1, v1) = head.layer(x1, pos)  # features of positions 1..T-1
    out = {"reg": F.smooth_l1_loss(pred1 / scale, last[:, 1:] / scale),
           "cls": _soft_ce(parts.logits(pred1), logits[:, 1:])}
    if recipe.unroll_weight > 0:
        # position i's input is the head's own prediction of its feature; it sees the true
        # prefix's keys (positions < i) and its own: how the second drafted token is made
        x2 = head.fc(torch.cat([nxt[:, 1:], pred1[:, :-1]], -1))  # inputs at positions 1..T-2
        n1, n2 = t - 1, t - 2
        true_before = torch.arange(n1)[None, :] < torch.arange(1, n2 + 1)[:, None]  # [n2, n1]
        own = torch.eye(n2, dtype=torch.bool)
        mask = torch.cat([true_before, own], 1)
        pred2, _ = head.layer(x2, pos[:, 1:], past=(k1, v1), mask=mask)  # features of positions 2..T-1
        out["reg2"] = F.smooth_l1_loss(pred2 / scale, last[:, 2:] / scale)
        out["cls2"] = _soft_ce(parts.logits(pred2), logits[:, 2:])
    return out


def total_loss(losses: dict[str, torch.Tensor], recipe: HeadRecipe) -> torch.Tensor:
    loss = recipe.reg_weight * losses["reg"] + recipe.cls_weight * losses["cls"]
    if "reg2" in losses:
        loss = loss + recipe.unroll_weight * (recipe.reg_weight * losses["reg2"] + recipe.cls_weight * losses["cls2"])
    return loss


def train_head(target, tokenizer, recipe: HeadRecipe, log=print) -> tuple[EagleHead, dict]:
    """The head for `target` (an HF Llama-family model), trained by `recipe`."""
    torch.manual_seed(recipe.seed)
    target.eval()
    for p in target.parameters():
        p.requires_grad_(False)
    cfg = EagleConfig.for_target(target.config, recipe.feature_layers)
    parts = TargetParts(target, cfg.feature_layers)
    head = EagleHead(cfg)
    streams, heldout = _streams(tokenizer, recipe)
    log("head: " + ", ".join(f"{c} {len(s) / 1e3:.0f}k tokens" for c, s in streams.items())
        + f"; features of layers {list(cfg.feature_layers)}; {sum(p.numel() for p in head.parameters()) / 1e6:.2f} M "
          "parameters")
    sampler = WindowSampler(streams, dict(recipe.weights), recipe.seq_len, recipe.batch, recipe.seed + 2)
    gen = torch.Generator().manual_seed(recipe.seed + 3)
    opt = torch.optim.AdamW(head.parameters(), lr=recipe.lr, betas=(0.9, 0.95), weight_decay=0.0)
    head.train()
    history = []
    t0 = time.time()
    for step in range(recipe.steps):
        for g in opt.param_groups:
            g["lr"] = _lr(step, recipe.steps, recipe.lr, max(recipe.steps // 20, 1))
        losses = head_losses(head, parts, sampler.next()[:, :-1], recipe, gen)
        loss = total_loss(losses, recipe)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        if (step + 1) % max(recipe.steps // 20, 1) == 0 or step == 0:
            row = {"step": step + 1, "s": round(time.time() - t0, 1),
                   **{k: round(float(v), 4) for k, v in losses.items()}}
            history.append(row)
            log("head: " + " ".join(f"{k} {v}" for k, v in row.items()))
    head.eval()
    return head, {"history": history, "seconds": round(time.time() - t0, 1), "heldout": heldout}


@torch.no_grad()
def draft_block(head: EagleHead, parts: TargetParts, cache: HeadCache, last_input: torch.Tensor, token: int,
                k: int) -> list[int]:
    """K greedy tokens after a prefix whose head cache holds positions < the last one: the last
    position's input (its projected target feature) and the token after it, then the head's
    own predictions. The cache is left as it was."""
    length = cache.length
    k_saved, v_saved = cache.k, cache.v
    out = []
    inp = last_input[None]
    for _ in range(k):
        pred = head.extend(cache, inp, parts.embed(torch.tensor([token])))  # [1, H]
        token = int(parts.logits(pred).argmax(-1))
        out.append(token)
        inp = pred
    cache.k, cache.v, cache.length = k_saved, v_saved, length
    return out


def _agreement(block: list[int], truth: list[int]) -> int:
    """Accepted drafts of a greedy verify: the block's agreement with the continuation."""
    a = 0
    while a < min(len(block), len(truth)) and block[a] == truth[a]:
        a += 1
    return a


@torch.no_grad()
def _per_class(target, tokenizer, prompts: list[dict], per_class: int, new_tokens: int,
               rounds_of) -> dict[str, dict]:
    """The held-out measure's frame: per class, its first `per_class` prompts, the target's
    greedy continuation of each, and `rounds_of(ids, gen)`'s accepted drafts at every position
    (a list); the mean accepted drafts a round."""
    seen: dict[str, int] = {}
    out: dict[str, dict] = {}
    for p in prompts:
        cls = p["workload_class"]
        if seen.get(cls, 0) >= per_class:
            continue
        seen[cls] = seen.get(cls, 0) + 1
        ids = tokenizer.encode(p["prompt"])
        gen = target.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                              max_new_tokens=new_tokens, do_sample=False)[0].tolist()
        accepted = rounds_of(ids, gen)
        row = out.setdefault(cls, {"accepted": 0, "rounds": 0})
        row["accepted"] += sum(accepted)
        row["rounds"] += len(accepted)
    for row in out.values():
        row["mean_accepted"] = row["accepted"] / max(row["rounds"], 1)
    return out


def acceptance(head: EagleHead, target, tokenizer, prompts: list[dict], k: int = 4, new_tokens: int = 48,
               per_class: int = 10) -> dict[str, dict]:
    """Per class: mean accepted drafts per round (greedy, K = k) when every position of the
    target's greedy continuation starts a round, and the rounds counted."""
    parts = TargetParts(target, head.cfg.feature_layers)

    def rounds_of(ids: list[int], gen: list[int]) -> list[int]:
        feats, _, _ = parts.features(torch.tensor([gen]))
        inputs = head.project(feats[0])  # [T, H]
        cache = HeadCache()
        n0 = len(ids)
        # the head's cache over positions < n0 - 1 (true inputs), then a round at each position
        head.extend(cache, inputs[:n0 - 2], parts.embed(torch.tensor(gen[1:n0 - 1])))
        out = []
        for pos in range(n0 - 1, len(gen) - 1):
            # committed: gen[:pos + 1]; the head drafts gen[pos + 1 ...] from (input at pos - 1, token at pos)
            out.append(_agreement(draft_block(head, parts, cache, inputs[pos - 1], gen[pos], k),
                                  gen[pos + 1:pos + 1 + k]))
            head.extend(cache, inputs[pos - 1:pos], parts.embed(torch.tensor([gen[pos]])))  # the true position
        return out

    return _per_class(target, tokenizer, prompts, per_class, new_tokens, rounds_of)


def draft_model_acceptance(draft, target, tokenizer, prompts: list[dict], k: int = 4, new_tokens: int = 48,
                           per_class: int = 10) -> dict[str, dict]:
    """`acceptance`'s measure for a separate draft model (the pair's `small`): at each position
    of the target's greedy continuation, the draft's greedy K tokens from the true prefix."""

    def rounds_of(ids: list[int], gen: list[int]) -> list[int]:
        out = []
        for pos in range(len(ids) - 1, len(gen) - 1):
            prefix = torch.tensor([gen[:pos + 1]])
            block = draft.generate(prefix, attention_mask=torch.ones_like(prefix), max_new_tokens=k,
                                   min_new_tokens=k, do_sample=False)[0, pos + 1:].tolist()
            out.append(_agreement(block, gen[pos + 1:pos + 1 + k]))
        return out

    return _per_class(target, tokenizer, prompts, per_class, new_tokens, rounds_of)


def build_head(target_dir: Path, out: Path, recipe: HeadRecipe, prompts: list[dict] | None = None,
               log=print) -> dict:
    """Train, save (bf16) and evaluate a head for the target in `target_dir`; writes
    `out/{config.json, model.safetensors, build.json}` and returns build.json's record."""
    from specserve.models.loading import load_model, load_tokenizer

    threads = torch.get_num_threads()
    torch.set_num_threads(recipe.threads)
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        target = load_model(str(target_dir), dtype=torch.float32)
        tokenizer = load_tokenizer(str(target_dir))
        started = time.time()
        head, stats = train_head(target, tokenizer, recipe, log)
        # evaluate what is shipped: the bf16-rounded weights
        head.to(torch.bfloat16).float()
        save_head(head, out)
        record: dict = {"recipe": {**dataclasses.asdict(recipe)}, "recipe_version": RECIPE_VERSION,
                        "target_sha256": target_digest(target_dir), "seconds": round(time.time() - started, 1),
                        "train_seconds": stats["seconds"], "history": stats["history"],
                        "torch": torch.__version__, "python": platform.python_version(),
                        "machine": platform.processor() or platform.machine(),
                        "params": sum(p.numel() for p in head.parameters())}
        if prompts:
            record["acceptance_k4"] = acceptance(head, target, tokenizer, prompts)
            log("head held-out acceptance (K = 4, greedy): " + ", ".join(
                f"{c} {r['mean_accepted']:.2f}" for c, r in record["acceptance_k4"].items()))
        from safetensors.torch import load_file  # noqa: F401  (the file is readable)

        h = hashlib.sha256((Path(out) / "model.safetensors").read_bytes()).hexdigest()
        record["weights_sha256"] = h
        (Path(out) / "build.json").write_text(json.dumps(record, indent=1))
        return record
    finally:
        torch.use_deterministic_algorithms(previous)
        torch.set_num_threads(threads)


def write_card(out: Path, record: dict, small: dict | None, command: str) -> None:
    """The head's MODEL_CARD.md: identity, recipe, training time, held-out acceptance beside the
    pair's draft model's (the same measure)."""
    r = record["recipe"]
    acc = record.get("acceptance_k4", {})
    lines = [
        "# EAGLE-style draft head for specserve-demo-v1's target",
        "",
        "A one-layer head that drafts from the target's own features (ADR 0020): it predicts the "
        "target's next last-layer feature from the current one and the next token, and drafts through "
        "the target's final norm and LM head (borrowed, not shipped). Served by the `eagle-local` pool "
        "beside the target and by `eagle` draft replicas fed the features over the Link.",
        "",
        "## Identity",
        f"- weights sha256 (model.safetensors, bfloat16): `{record['weights_sha256']}`",
        f"- for the target whose weights' sha256 begins `{record['target_sha256']}`",
        f"- parameters: {record['params'] / 1e6:.2f} M; features of layers {list(r['feature_layers'] or ['last'])}",
        f"- recipe version {record['recipe_version']}; torch {record['torch']}, Python {record['python']}, "
        f"{record['machine']}",
        f"- trained in {record['train_seconds'] / 60:.1f} min ({record['seconds'] / 60:.1f} min with the corpus, the "
        "save and the evaluation) of wall time on 2 threads; the machine was shared with other work during "
        "the build (see ADR 0020 for the calm step time)",
        "",
        "## Recipe",
        f"- `{command}` (tooling/modelbuild/eagle.py; deterministic from seed {r['seed']} on one CPU type)",
        f"- data: the pair's corpus (code {r['code_bytes'] / 1e6:.0f} MB, prose {r['prose_bytes'] / 1e6:.0f} MB, "
        f"{r['n_extraction']} extraction records), windows of {r['seq_len']} tokens, batches of {r['batch']}, "
        f"mixed {dict(r['weights'])}",
        f"- {r['steps']} steps of AdamW, lr {r['lr']} (warm-up, cosine to 10 %); loss: smooth-L1 regression onto "
        f"the target's last-layer feature (x{r['reg_weight']}) + cross-entropy against the target's distribution "
        f"(x{r['cls_weight']}), input-feature noise {r['noise']} of their RMS, one unrolled training-time-test pass "
        f"(x{r['unroll_weight']})",
        "",
        "## Held-out acceptance",
        "The pair's held-out prompts, 10 a class: the target's greedy 48-token continuation; every position "
        "starts a round; a K = 4 block drafted from the true prefix; accepted drafts = its agreement with the "
        "continuation (what a greedy verify accepts). Mean accepted drafts a round:",
        "",
        "| class | this head | the pair's draft model (`small`) | ratio |",
        "|---|---|---|---|",
    ]
    for cls, row in acc.items():
        s_row = (small or {}).get(cls)
        ratio = f"{row['mean_accepted'] / s_row['mean_accepted']:.2f}" if s_row and s_row["mean_accepted"] else "-"
        lines.append(f"| {cls} | {row['mean_accepted']:.2f} | {s_row['mean_accepted']:.2f} | {ratio} |" if s_row
                     else f"| {cls} | {row['mean_accepted']:.2f} | - | - |")
    lines += ["", "The training log (every 5 %): `build.json`'s history.", ""]
    (Path(out) / "MODEL_CARD.md").write_text("\n".join(lines))


def steps_per_minute_hint(seconds_per_step: float, budget_min: float = 60.0) -> int:
    """How many steps fit the budget at a measured step time (for choosing `steps`)."""
    return int(math.floor(budget_min * 60 / max(seconds_per_step, 1e-3)))
