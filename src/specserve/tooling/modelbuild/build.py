"""`specserve models build`: tokenizer, target, distilled draft, held-out prompts.

Deterministic from a seed and cached by the hash of the preset (plus the corpus
fingerprint): a second build with the same config is a no-op. The result is a directory
with `target/` and `draft/` that load with `from_pretrained` like any Hugging Face pair.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import platform
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

from specserve.tooling.modelbuild.corpus import CLASSES, build_corpus
from specserve.tooling.modelbuild.evaluate import annotate_prompts, heldout_nll
from specserve.tooling.modelbuild.tokenizer import train_tokenizer
from specserve.tooling.modelbuild.train import (
    WindowSampler,
    bf16_autocast_supported,
    distill_draft,
    train_target,
)

BUILD_VERSION = 3  # bump when the training recipe changes so cached pairs are rebuilt
PROMPTS_VERSION = 3  # bump when held-out prompt selection changes (no retraining needed)
PROMPT_CHARS = 200


@dataclass(frozen=True)
class ModelShape:
    layers: int
    hidden: int
    heads: int
    intermediate: int


@dataclass(frozen=True)
class PairConfig:
    name: str
    vocab_size: int
    target: ModelShape
    draft: ModelShape
    max_positions: int
    seq_len: int
    batch: int
    target_steps: int
    target_lr: float
    draft_steps: int
    draft_lr: float
    code_bytes: int
    prose_bytes: int
    n_extraction: int
    weights: tuple[tuple[str, float], ...] = (("code", 0.45), ("chat", 0.30), ("extraction", 0.25))
    prompts_per_class: int = 12
    seed: int = 0
    # training threads, fixed (not the machine's core count): a matmul's reduction order, and
    # so its rounding, follows how it is split across threads
    threads: int = 2
    corpus_version: int = 1  # corpus.py: 2 = no codec tables, whole-library sample, docstrings
    # the weights as saved (and evaluated): bfloat16 halves the shipped pair; served in fp32 on
    # CPU, the upcast is exact, so what was evaluated is what is served
    save_dtype: str = "float32"

    def digest(self) -> str:
        # bf16 autocast is part of the recipe where the CPU supports it: another machine type
        # builds (and caches) its own pair rather than reusing one trained differently.
        blob = json.dumps({"v": BUILD_VERSION, "bf16": bf16_autocast_supported(), **dataclasses.asdict(self)},
                          sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]


PRESETS: dict[str, PairConfig] = {
    # The pair `make run` and `make bench` use (DESIGN §7 feasibility shape).
    "default": PairConfig(
        name="default", vocab_size=4096,
        target=ModelShape(layers=6, hidden=512, heads=8, intermediate=1408),
        draft=ModelShape(layers=1, hidden=128, heads=4, intermediate=384),
        max_positions=1024, seq_len=128, batch=8, target_steps=900, target_lr=2e-3,
        draft_steps=300, draft_lr=3e-3, code_bytes=4_000_000, prose_bytes=2_000_000,
        n_extraction=1200,
    ),
    # The shipped demo pair (models/specserve-demo-v1, ADR 0003): trained once with a real budget
    # (about 50 min of target training on 2 cores with bf16), committed, served everywhere.
    "demo": PairConfig(
        name="demo", vocab_size=4096,
        target=ModelShape(layers=6, hidden=512, heads=8, intermediate=1408),
        draft=ModelShape(layers=1, hidden=128, heads=4, intermediate=384),
        max_positions=1024, seq_len=256, batch=16, target_steps=2000, target_lr=2e-3,
        draft_steps=800, draft_lr=3e-3, code_bytes=8_000_000, prose_bytes=4_000_000,
        n_extraction=3000, prompts_per_class=30, corpus_version=2, save_dtype="bfloat16",
        weights=(("code", 0.5), ("chat", 0.25), ("extraction", 0.25)),
    ),
    # The two-builds determinism test's pair: the whole recipe, built in seconds (not served).
    "micro": PairConfig(
        name="micro", vocab_size=512,
        target=ModelShape(layers=1, hidden=64, heads=2, intermediate=128),
        draft=ModelShape(layers=1, hidden=32, heads=2, intermediate=64),
        max_positions=256, seq_len=64, batch=4, target_steps=40, target_lr=3e-3,
        draft_steps=20, draft_lr=5e-3, code_bytes=200_000, prose_bytes=100_000,
        n_extraction=60, prompts_per_class=3, corpus_version=2, save_dtype="bfloat16",
    ),
    # A quick pair: trained enough to be non-trivial, built in ~1 min.
    "tiny": PairConfig(
        name="tiny", vocab_size=1024,
        target=ModelShape(layers=2, hidden=128, heads=4, intermediate=352),
        draft=ModelShape(layers=1, hidden=64, heads=2, intermediate=176),
        max_positions=512, seq_len=128, batch=8, target_steps=600, target_lr=3e-3,
        draft_steps=200, draft_lr=5e-3, code_bytes=1_500_000, prose_bytes=500_000,
        n_extraction=400, prompts_per_class=10,
    ),
}


def llama_config(shape: ModelShape, cfg: PairConfig, eos: int, pad: int) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
        num_key_value_heads=shape.heads, max_position_embeddings=cfg.max_positions,
        rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=eos, eos_token_id=eos,
        pad_token_id=pad,  # RoPE: transformers' default, theta 10000
    )


def pair_dir(root: Path, cfg: PairConfig) -> Path:
    return Path(root) / f"{cfg.name}-{cfg.digest()}"


def _quiet_hf() -> None:
    """No transformers progress bars ("Writing model shards") without a terminal."""
    if not sys.stderr.isatty():
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()


def build_pair(cfg: PairConfig, root: Path, force: bool = False, log=print) -> Path:
    """Build (or find cached) and return the pair directory; `root/<name>` links to it."""
    out = pair_dir(root, cfg)
    link = Path(root) / cfg.name
    if (out / "build.json").exists() and not force:
        _refresh_prompts(out, cfg)
        _link(link, out)
        return out
    _quiet_hf()
    threads = torch.get_num_threads()
    try:
        with _deterministic(cfg):
            _build(cfg, out, log)
    finally:
        torch.set_num_threads(threads)
    _link(link, out)
    return out


@contextlib.contextmanager
def _deterministic(cfg: PairConfig):
    """Same config, same weights: seeded RNGs, and a fixed thread count, because a CPU
    matmul's reduction order (hence its rounding, in bf16 above all) follows its thread
    split. Every other source of order (corpus, tokenizer merges, window sampling) is
    already a pure function of the config."""
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(cfg.threads)
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(previous)


def _build(cfg: PairConfig, out: Path, log) -> None:
    started = time.time()
    corpus = build_corpus(cfg.code_bytes, cfg.prose_bytes, cfg.n_extraction, cfg.seed, cfg.corpus_version)
    log("corpus: " + ", ".join(f"{c} {sum(map(len, corpus.train[c])) / 1e6:.1f} MB" for c in CLASSES))
    tokenizer = train_tokenizer((d for c in CLASSES for d in corpus.train[c]), cfg.vocab_size)
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    streams = {
        c: torch.tensor([t for d in corpus.train[c] for t in tokenizer.encode(d) + [eos]], dtype=torch.long)
        for c in CLASSES
    }
    log("tokens: " + ", ".join(f"{c} {len(s) / 1e3:.0f}k" for c, s in streams.items()))
    weights = dict(cfg.weights)
    bf16 = bf16_autocast_supported()
    log(f"training with {'bf16 autocast' if bf16 else 'fp32'} on {torch.get_num_threads()} threads")
    target = LlamaForCausalLM(llama_config(cfg.target, cfg, eos, pad))
    draft = LlamaForCausalLM(llama_config(cfg.draft, cfg, eos, pad))
    with _progress() as bar:
        task = bar.add_task("target", total=cfg.target_steps)
        loss_t = train_target(target, WindowSampler(streams, weights, cfg.seq_len, cfg.batch, cfg.seed),
                              cfg.target_steps, cfg.target_lr, _reporter(bar, task, "target", log), bf16)
        task = bar.add_task("draft (distil)", total=cfg.draft_steps)
        loss_d = distill_draft(draft, target,
                               WindowSampler(streams, weights, cfg.seq_len, cfg.batch, cfg.seed + 1),
                               cfg.draft_steps, cfg.draft_lr, _reporter(bar, task, "draft", log), bf16)
    if cfg.save_dtype != "float32":  # round once, then evaluate exactly what is saved
        for model in (target, draft):
            model.to(getattr(torch, cfg.save_dtype)).float()
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    gen = GenerationConfig(do_sample=False, eos_token_id=eos, pad_token_id=pad, bos_token_id=eos)
    for name, model in (("target", target), ("draft", draft)):
        model.generation_config = gen
        _save(model, tmp / name, cfg.save_dtype)
        tokenizer.save_pretrained(tmp / name)
    quality = {c: heldout_nll(target, tokenizer, corpus.heldout[c], cfg.seq_len, max_windows=32)
               for c in CLASSES}
    prompts = _write_prompts(tmp, corpus.heldout, tokenizer, target, cfg)
    for c in CLASSES:
        flags = [p["greedy"]["degenerate"] for p in prompts if p["workload_class"] == c]
        quality[c]["degenerate_fraction"] = sum(flags) / max(len(flags), 1)
    log("held-out: " + ", ".join(f"{c} ppl {q['ppl']:.1f} ({q['bits_per_byte']:.2f} bits/byte), "
                                 f"{q['degenerate_fraction']:.0%} degenerate" for c, q in quality.items()))
    (tmp / "build.json").write_text(json.dumps({
        "config": dataclasses.asdict(cfg), "digest": cfg.digest(), "weights_sha256": weights_digest(tmp),
        "corpus": corpus.fingerprint(), "target_loss": loss_t, "draft_kl": loss_d,
        "seconds": round(time.time() - started, 1), "bf16_autocast": bf16, "threads": cfg.threads,
        "torch": torch.__version__, "python": platform.python_version(), "heldout": quality,
        "target_params": sum(p.numel() for p in target.parameters()),
        "draft_params": sum(p.numel() for p in draft.parameters()),
    }, indent=1))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


def _save(model, path: Path, dtype: str) -> None:
    if dtype == "float32":
        model.save_pretrained(path)
        return
    model.to(getattr(torch, dtype))
    try:
        model.save_pretrained(path)
    finally:
        model.float()


def weights_digest(pair: Path) -> str:
    """sha256 over both models' weights and the tokenizer: equal digests, identical pairs."""
    h = hashlib.sha256()
    for part in ("target", "draft"):
        for f in sorted((pair / part).glob("*.safetensors")) + [pair / part / "tokenizer.json"]:
            h.update(f"{part}/{f.name}\n".encode())
            h.update(f.read_bytes())
    return h.hexdigest()


def eval_prompts(heldout: dict[str, list[str]], per_class: int) -> list[dict]:
    """Held-out prompts, the same text whatever the tokenizer (so pairs with different
    vocabularies are compared on the same prompts). Code and prose: whole lines from the
    middle of a held-out document, up to PROMPT_CHARS (a file's first lines are licence
    headers, which say little about code). Extraction: the instruction and source text, up to
    "JSON:". "reference" is the document's own continuation (for the reference NLL)."""
    out = []
    for cls in CLASSES:
        for doc in heldout[cls][:per_class]:
            if cls == "extraction":
                prompt = doc[: doc.index("JSON: ") + len("JSON:")]
            else:
                start = doc.find("\n", len(doc) // 3) + 1
                prompt = doc[start : start + PROMPT_CHARS]
                cut = prompt.rfind("\n")
                prompt = prompt[: cut + 1] if cut > 60 else prompt
                doc = doc[start:]
            if prompt.strip():
                out.append({"workload_class": cls, "prompt": prompt,
                            "reference": doc[len(prompt) : len(prompt) + 4 * PROMPT_CHARS]})
    return out


def _write_prompts(out: Path, heldout, tokenizer, target, cfg: PairConfig) -> list[dict]:
    prompts = annotate_prompts(target, tokenizer, eval_prompts(heldout, cfg.prompts_per_class))
    (out / "eval_prompts.json").write_text(json.dumps({"version": PROMPTS_VERSION, "prompts": prompts}, indent=1))
    return prompts


def _refresh_prompts(out: Path, cfg: PairConfig) -> None:
    """Re-select held-out prompts of a cached pair when the selection rule changed."""
    path = out / "eval_prompts.json"
    try:
        if json.loads(path.read_text()).get("version") == PROMPTS_VERSION:
            return
    except (OSError, ValueError, AttributeError):
        pass
    from transformers import AutoTokenizer

    corpus = build_corpus(cfg.code_bytes, cfg.prose_bytes, cfg.n_extraction, cfg.seed, cfg.corpus_version)
    target = LlamaForCausalLM.from_pretrained(out / "target", dtype=torch.float32).eval()
    _write_prompts(out, corpus.heldout, AutoTokenizer.from_pretrained(out / "target"), target, cfg)


SHIPPED = "specserve-demo-v1"  # the committed demo pair's directory under models/


def find_pair(path: str | Path) -> Path:
    """A pair directory from what a user passes: the pair itself (target/ and draft/), or a
    models directory holding the shipped pair (`specserve-demo-v1/`) or a built `default/`."""
    p = Path(path)
    if not (p / "target").is_dir():
        for name in (SHIPPED, "default"):
            if (p / name / "target").is_dir():
                p = p / name
                break
    if not (p / "target").is_dir():
        raise SystemExit(f"no model pair at {path}: expected target/ and draft/, or {SHIPPED}/ in it")
    return p.resolve()


def load_eval_prompts(pair: Path) -> list[dict]:
    """[{"workload_class": ..., "prompt": ...}] of a built pair."""
    return json.loads((Path(pair) / "eval_prompts.json").read_text())["prompts"]


def _link(link: Path, target: Path) -> None:
    if link.is_symlink() or link.exists():
        if link.is_symlink() and link.resolve() == target.resolve():
            return
        link.unlink()
    link.symlink_to(target.name)


def _progress() -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                    TextColumn("loss {task.fields[loss]:.3f}"), TimeElapsedColumn(),
                    disable=not sys.stdout.isatty())


def _reporter(bar: Progress, task, label: str, log):
    quiet = not sys.stdout.isatty()
    total = bar.tasks[task].total if task < len(bar.tasks) else None

    def report(step: int, loss: float) -> None:
        bar.update(task, completed=step + 1, loss=loss)
        if quiet and total and ((step + 1) % max(int(total) // 10, 1) == 0):
            log(f"{label}: step {step + 1}/{int(total)} loss {loss:.3f}")

    return report


def untrained_copy(model_dir: Path, out: Path, seed: int = 0) -> Path:
    """The same architecture and tokenizer with fresh random weights: a deliberately poor
    draft (its proposals are almost never accepted), for controller tests and benchmarks."""
    import shutil

    from transformers import AutoConfig, AutoModelForCausalLM

    out = Path(out)
    if (out / "config.json").exists():
        return out
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    _quiet_hf()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    model.save_pretrained(tmp)
    for f in Path(model_dir).iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "generation_config")) and f.is_file():
            shutil.copy(f, tmp / f.name)
    tmp.rename(out)
    return out
