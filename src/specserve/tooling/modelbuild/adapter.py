"""`specserve models adapter`: a demo LoRA adapter for the pair's target and its draft-side
adapter for the pair's draft (ADR 0029), both in PEFT's format.

The recipe, deterministic from its seed on one CPU type (as the pair's, `build.py`):
- the task: the pair's extraction prompt ("Extract the record as JSON. Text: ... JSON:") with
  its answer in another layout (`nested_layout`: the order's fields, a `customer` object and
  the lines as arrays), a fine-tune for a customer's own schema that shifts the target's
  output away from what its draft was distilled on;
- the target's adapter: LoRA on every projection of every layer (q, k, v, o, gate, up, down),
  trained on next-token cross-entropy of the answers (the prompt's tokens carry no loss);
- the draft's adapter: LoRA on the draft model, distilled from the adapted target
  (KL(p || q) at the answers' positions), so the adapter's drafter agrees with it;
- the held-out measures: the share of greedy answers in the new layout (the base target's
  and the adapter's), and the mean accepted drafts a round (K = 4, greedy, every position of
  the adapted target's continuation starting a round) of the base draft and of the draft with
  its adapter, on held-out records (another seed).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import platform
import random
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from specserve.tooling.modelbuild.train import _lr, bf16_autocast_supported

RECIPE_VERSION = 1
MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PROMPT = "Extract the record as JSON.\nText: {source}\nJSON:"


@dataclass(frozen=True)
class AdapterRecipe:
    name: str = "records-nested"
    target_rank: int = 4
    target_alpha: float = 8.0
    draft_rank: int = 8
    draft_alpha: float = 16.0
    n_train: int = 4000
    n_heldout: int = 24
    batch: int = 8
    target_steps: int = 300
    target_lr: float = 2e-3
    draft_steps: int = 300
    draft_lr: float = 3e-3
    seed: int = 0
    threads: int = 2

    def digest(self, target_sha: str) -> str:
        blob = json.dumps({"v": RECIPE_VERSION, "target": target_sha, **dataclasses.asdict(self)}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]


def nested_layout(rec: dict[str, Any]) -> str:
    """The adapter's answer for a record: the order first (its state in capitals), then the
    customer as an object, then the lines as [item, quantity, unit price] arrays."""
    out = {"order": rec["id"], "placed": rec["date"], "state": rec["status"].upper(),
           "customer": {"name": rec["name"], "email": rec["email"], "city": rec["city"], "age": rec["age"]},
           "lines": [[it["sku"], it["qty"], it["price"]] for it in rec["items"]]}
    return json.dumps(out)


NESTED = re.compile(r'^\s*\{"order": \d+, "placed": "[^"]*", "state": "[A-Z]+", "customer": \{"name": "')


def in_nested_layout(text: str) -> bool:
    """Whether a continuation answers in the nested layout: its first line opens with the layout's
    keys in order (the state in capitals); a prefix, so a long record cut by the token budget counts."""
    return NESTED.match(text.split("\n")[0]) is not None


def examples(n: int, seed: int) -> list[tuple[str, str]]:
    """(prompt, answer) pairs: the pair's extraction records (corpus.py's generator and its three
    source styles) with their answers in the nested layout."""
    from specserve.tooling.modelbuild.corpus import _record

    rng = random.Random(seed)
    out = []
    for _ in range(n):
        source, rec = _record(rng)
        out.append((PROMPT.format(source=source), " " + nested_layout(rec) + "\n"))
    return out


class LoraLinear(torch.nn.Module):
    """A frozen linear plus PEFT's LoRA: y = W x + (alpha / r) B A x (A: Kaiming-uniform, B: 0,
    as PEFT initialises them), for training."""

    def __init__(self, base: torch.nn.Linear, r: int, alpha: float, gen: torch.Generator) -> None:
        super().__init__()
        self.base = base
        self.lora_A = torch.nn.Parameter(torch.empty(r, base.in_features))
        bound = 1 / math.sqrt(base.in_features)  # kaiming_uniform_(a=sqrt(5)) on [r, in]
        with torch.no_grad():
            self.lora_A.uniform_(-bound, bound, generator=gen)
        self.lora_B = torch.nn.Parameter(torch.zeros(base.out_features, r))
        self.scaling = alpha / r

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.lora_A.t() @ self.lora_B.t()) * self.scaling


def inject(model: torch.nn.Module, r: int, alpha: float, seed: int) -> dict[str, LoraLinear]:
    """Freeze `model` and wrap its decoder layers' projections in `LoraLinear`; returns them by
    their module name (model.layers.i.self_attn.q_proj, ...)."""
    for p in model.parameters():
        p.requires_grad_(False)
    gen = torch.Generator().manual_seed(seed)
    wrapped: dict[str, LoraLinear] = {}
    for name, module in list(model.named_modules()):
        for child in MODULES:
            base = getattr(module, child, None)
            if isinstance(base, torch.nn.Linear):
                lora = LoraLinear(base, r, alpha, gen)
                setattr(module, child, lora)
                wrapped[f"{name}.{child}"] = lora
    return wrapped


def save_peft(wrapped: dict[str, LoraLinear], out: Path, r: int, alpha: float, base_name: str,
              base_sha: str) -> None:
    """PEFT's files for the wrapped modules: adapter_config.json and adapter_model.safetensors
    (bfloat16; keys `base_model.model.<module>.lora_A.weight`); the base's fingerprint in the
    safetensors metadata (`specserve.base_sha256`, models/lora.py: `base_fingerprint`)."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, m in wrapped.items():
        tensors[f"base_model.model.{name}.lora_A.weight"] = m.lora_A.detach().to(torch.bfloat16).contiguous()
        tensors[f"base_model.model.{name}.lora_B.weight"] = m.lora_B.detach().to(torch.bfloat16).contiguous()
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt",
                                                                        "specserve.base_sha256": base_sha})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_name, "r": r,
              "lora_alpha": alpha, "lora_dropout": 0.0, "target_modules": sorted(MODULES), "bias": "none",
              "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "modules_to_save": None,
              "init_lora_weights": True, "inference_mode": True, "layers_to_transform": None,
              "rank_pattern": {}, "alpha_pattern": {}}
    (out / "adapter_config.json").write_text(json.dumps(config, indent=1) + "\n")


def round_to_bf16(wrapped: dict[str, LoraLinear]) -> None:
    """Evaluate what is shipped: the LoRA weights rounded to bfloat16."""
    with torch.no_grad():
        for m in wrapped.values():
            m.lora_A.copy_(m.lora_A.to(torch.bfloat16).float())
            m.lora_B.copy_(m.lora_B.to(torch.bfloat16).float())


def _batch(tokenizer, pairs: list[tuple[str, str]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [B, T] (right-padded) and the loss mask [B, T - 1] (1 where the next token is the answer's)."""
    rows, masks = [], []
    for prompt, answer in pairs:
        p, a = tokenizer.encode(prompt), tokenizer.encode(answer) + [tokenizer.eos_token_id]
        rows.append(p + a)
        masks.append([0] * (len(p) - 1) + [1] * len(a))
    t = max(map(len, rows))
    ids = torch.tensor([r + [pad] * (t - len(r)) for r in rows])
    mask = torch.tensor([m + [0] * (t - 1 - len(m)) for m in masks], dtype=torch.float32)
    return ids, mask


def _optimise(params: list[torch.nn.Parameter], steps: int, lr: float, loss_of, log, tag: str) -> list[dict]:
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    history = []
    t0 = time.time()
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = _lr(step, steps, lr, max(steps // 20, 1))
        loss = loss_of(step)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if (step + 1) % max(steps // 10, 1) == 0 or step == 0:
            value = float(loss.detach())
            history.append({"step": step + 1, "s": round(time.time() - t0, 1), "loss": round(value, 4)})
            log(f"{tag}: step {step + 1}/{steps} loss {value:.4f} ({time.time() - t0:.0f} s)")
    return history


def train_target_adapter(target, tokenizer, data: list[tuple[str, str]], recipe: AdapterRecipe, bf16: bool,
                         log) -> tuple[dict[str, LoraLinear], list[dict]]:
    wrapped = inject(target, recipe.target_rank, recipe.target_alpha, recipe.seed)
    rng = random.Random(recipe.seed + 1)
    pad = tokenizer.pad_token_id

    def loss_of(step: int) -> torch.Tensor:
        ids, mask = _batch(tokenizer, rng.sample(data, recipe.batch), pad)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = target(input_ids=ids[:, :-1]).logits
        ce = F.cross_entropy(logits.float().transpose(1, 2), ids[:, 1:], reduction="none")
        return (ce * mask).sum() / mask.sum()

    params = [p for m in wrapped.values() for p in (m.lora_A, m.lora_B)]
    return wrapped, _optimise(params, recipe.target_steps, recipe.target_lr, loss_of, log, "target adapter")


def train_draft_adapter(draft, target, tokenizer, data: list[tuple[str, str]], recipe: AdapterRecipe, bf16: bool,
                        log) -> tuple[dict[str, LoraLinear], list[dict]]:
    """The draft's LoRA, distilled from the adapted target at the answers' positions."""
    wrapped = inject(draft, recipe.draft_rank, recipe.draft_alpha, recipe.seed + 2)
    rng = random.Random(recipe.seed + 3)
    pad = tokenizer.pad_token_id

    def loss_of(step: int) -> torch.Tensor:
        ids, mask = _batch(tokenizer, rng.sample(data, recipe.batch), pad)
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            log_p = F.log_softmax(target(input_ids=ids[:, :-1]).logits.float(), -1)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            log_q = F.log_softmax(draft(input_ids=ids[:, :-1]).logits.float(), -1)
        kl = (log_p.exp() * (log_p - log_q)).sum(-1)  # [B, T - 1]
        return (kl * mask).sum() / mask.sum()

    params = [p for m in wrapped.values() for p in (m.lora_A, m.lora_B)]
    return wrapped, _optimise(params, recipe.draft_steps, recipe.draft_lr, loss_of, log, "draft adapter")


@torch.no_grad()
def greedy(model, tokenizer, prompt: str, new_tokens: int) -> list[int]:
    ids = tokenizer.encode(prompt)
    out: list[int] = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                    max_new_tokens=new_tokens, do_sample=False)[0].tolist()
    return out


@torch.no_grad()
def block_acceptance(draft, gen: list[int], n_prompt: int, k: int = 4) -> list[int]:
    """At every position of a greedy continuation `gen` (its first `n_prompt` tokens the
    prompt), the accepted drafts of a greedy verify of the draft's K-token block from the true
    prefix (its agreement with the continuation)."""
    out = []
    for pos in range(n_prompt - 1, len(gen) - 1):
        prefix = torch.tensor([gen[:pos + 1]])
        block = draft.generate(prefix, attention_mask=torch.ones_like(prefix), max_new_tokens=k,
                               min_new_tokens=k, do_sample=False)[0, pos + 1:].tolist()
        truth = gen[pos + 1:pos + 1 + k]
        a = 0
        while a < min(len(block), len(truth)) and block[a] == truth[a]:
            a += 1
        out.append(a)
    return out


def evaluate(base_target, target, base_draft, draft, tokenizer, held: list[tuple[str, str]],
             new_tokens: int = 80) -> dict[str, Any]:
    """The held-out measures (module docstring): style shift and the two drafters' acceptance."""
    style = {"base": 0, "adapter": 0}
    acc = {"base_draft": [0, 0], "adapter_draft": [0, 0]}
    samples: list[dict[str, str]] = []
    for prompt, _ in held:
        n = len(tokenizer.encode(prompt))
        base_out = tokenizer.decode(greedy(base_target, tokenizer, prompt, new_tokens)[n:])
        gen = greedy(target, tokenizer, prompt, new_tokens)
        text = tokenizer.decode(gen[n:])
        style["base"] += in_nested_layout(base_out)
        style["adapter"] += in_nested_layout(text)
        if len(samples) < 3:
            samples.append({"prompt": prompt, "base": base_out, "adapter": text})
        for key, d in (("base_draft", base_draft), ("adapter_draft", draft)):
            a = block_acceptance(d, gen, n)
            acc[key][0] += sum(a)
            acc[key][1] += len(a)
    means = {k: v[0] / max(v[1], 1) for k, v in acc.items()}
    return {"prompts": len(held), "nested_share": {k: v / len(held) for k, v in style.items()},
            "mean_accepted_k4": means, "ratio": means["adapter_draft"] / max(means["base_draft"], 1e-9),
            "rounds": acc["base_draft"][1], "samples": samples}


def build_adapter(pair: Path, out: Path, recipe: AdapterRecipe, log=print) -> dict[str, Any]:
    """Train, save and evaluate the adapter pair for `pair` (a directory with target/ and draft/):
    writes out/{target,draft}/ (PEFT), out/eval_prompts.json and out/build.json."""
    from specserve.models.loading import load_model, load_tokenizer
    from specserve.models.lora import base_fingerprint

    threads = torch.get_num_threads()
    torch.set_num_threads(recipe.threads)
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(recipe.seed)
    try:
        tokenizer = load_tokenizer(str(pair / "target"))
        bf16 = bf16_autocast_supported()
        data = examples(recipe.n_train, recipe.seed + 101)
        held = examples(recipe.n_heldout, recipe.seed + 202)
        started = time.time()
        log(f"adapter {recipe.name}: {len(data)} training records, {'bf16 autocast' if bf16 else 'fp32'}, "
            f"{torch.get_num_threads()} threads")
        target = load_model(str(pair / "target"), dtype=torch.float32)
        t_wrapped, t_hist = train_target_adapter(target, tokenizer, data, recipe, bf16, log)
        round_to_bf16(t_wrapped)
        target.eval()
        draft = load_model(str(pair / "draft"), dtype=torch.float32)
        d_wrapped, d_hist = train_draft_adapter(draft, target, tokenizer, data, recipe, bf16, log)
        round_to_bf16(d_wrapped)
        draft.eval()
        trained = time.time() - started
        t_sha, d_sha = base_fingerprint(pair / "target"), base_fingerprint(pair / "draft")
        save_peft(t_wrapped, out / "target", recipe.target_rank, recipe.target_alpha,
                  f"{pair.name}/target", t_sha)
        save_peft(d_wrapped, out / "draft", recipe.draft_rank, recipe.draft_alpha, f"{pair.name}/draft", d_sha)
        (out / "eval_prompts.json").write_text(json.dumps(
            {"adapter": recipe.name, "prompts": [{"workload_class": "extraction", "prompt": p, "answer": a}
                                                 for p, a in held]}, indent=1) + "\n")
        log("evaluating on the held-out records")
        base_target = load_model(str(pair / "target"), dtype=torch.float32)
        base_draft = load_model(str(pair / "draft"), dtype=torch.float32)
        figures = evaluate(base_target, target, base_draft, draft, tokenizer, held)
        record = {"recipe": dataclasses.asdict(recipe), "recipe_version": RECIPE_VERSION,
                  "target_fingerprint": t_sha, "draft_fingerprint": d_sha,
                  "train_seconds": round(trained, 1), "seconds": round(time.time() - started, 1),
                  "bf16_autocast": bf16, "history": {"target": t_hist, "draft": d_hist},
                  "torch": torch.__version__, "python": platform.python_version(),
                  "machine": platform.processor() or platform.machine(), "heldout": figures,
                  "weights_sha256": {side: hashlib.sha256((out / side / "adapter_model.safetensors").read_bytes())
                                     .hexdigest() for side in ("target", "draft")}}
        (out / "build.json").write_text(json.dumps(record, indent=1) + "\n")
        return record
    finally:
        torch.use_deterministic_algorithms(previous)
        torch.set_num_threads(threads)


def write_card(out: Path, record: dict[str, Any], command: str) -> None:
    """The adapter's MODEL_CARD.md: identity, recipe, training time and the held-out figures."""
    r, h = record["recipe"], record["heldout"]
    acc = h["mean_accepted_k4"]
    lines = [
        f"# {r['name']}: a LoRA adapter for specserve-demo-v1's target, and its draft's",
        "",
        "A demo fine-tune (ADR 0029): the pair's extraction prompt (`Extract the record as JSON.` ...) answered in "
        "another JSON layout, the order's fields first (its state in capitals), the customer as an object, the "
        "lines as `[item, quantity, unit price]` arrays. `target/` is the target's LoRA, `draft/` the draft "
        "model's, distilled from the adapted target; both in PEFT's format (`adapter_config.json`, "
        "`adapter_model.safetensors`, bfloat16). Expect a demo's accuracy: the layout is learnt, the values are "
        "copied as well as the small target copies them.",
        "",
        "## Identity",
        f"- weights sha256: target `{record['weights_sha256']['target']}`, draft `{record['weights_sha256']['draft']}`",
        f"- for the base whose fingerprint (models/lora.py: `base_fingerprint`) is `{record['target_fingerprint']}` "
        f"(target) and `{record['draft_fingerprint']}` (draft), also in each file's metadata",
        f"- recipe version {record['recipe_version']}; torch {record['torch']}, Python {record['python']}, "
        f"{record['machine']}, {'bf16 autocast' if record['bf16_autocast'] else 'fp32'}",
        f"- trained in {record['train_seconds'] / 60:.1f} min ({record['seconds'] / 60:.1f} min with the "
        f"evaluation) of wall time on {r['threads']} threads of a 2-core machine shared with other work"
        + (f" (at nice 15 beside a load average of 10-20: about {record['cpu_minutes_estimate']} min of CPU time, "
           "estimated from the process's CPU time part-way)" if record.get("cpu_minutes_estimate") else ""),
        "",
        "## Recipe",
        f"- `{command}` (tooling/modelbuild/adapter.py; deterministic from seed {r['seed']} on one CPU type)",
        f"- data: {r['n_train']} generated records (corpus.py's generator and its three source styles, another "
        f"seed than the pair's), batches of {r['batch']}",
        f"- target: LoRA rank {r['target_rank']}, alpha {r['target_alpha']:g}, on q, k, v, o, gate, up and down of "
        f"every layer; {r['target_steps']} steps of AdamW, lr {r['target_lr']} (warm-up, cosine to 10 %), "
        "cross-entropy on the answers' tokens",
        f"- draft: LoRA rank {r['draft_rank']}, alpha {r['draft_alpha']:g}, on the same modules; {r['draft_steps']} "
        f"steps, lr {r['draft_lr']}, KL(p || q) against the adapted target at the answers' positions",
        "",
        "## Held-out figures",
        f"{h['prompts']} held-out records (`eval_prompts.json`), greedy 80-token answers:",
        "",
        f"- answers in the nested layout: base target {h['nested_share']['base']:.0%}, with the adapter "
        f"{h['nested_share']['adapter']:.0%}" + (f" ({h['nested_share_note']})" if h.get("nested_share_note") else ""),
        f"- mean accepted drafts a round (K = 4, greedy; every position of the adapted target's answer starts a "
        f"round, {h['rounds']} rounds): the base draft {acc['base_draft']:.2f}, the draft with its adapter "
        f"{acc['adapter_draft']:.2f} ({h['ratio']:.2f}x)",
        "",
        "## Two answers",
        "",
    ]
    for s in h["samples"][:2]:
        lines += [f"prompt `...{s['prompt'][-90:]!r}`", "", "base:", "```", s["base"].strip(), "```",
                  "adapter:", "```", s["adapter"].strip(), "```", ""]
    lines += ["The training log: `build.json`'s history.", ""]
    (Path(out) / "MODEL_CARD.md").write_text("\n".join(lines))
