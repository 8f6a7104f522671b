"""How good is a built pair on held-out text: perplexity per class, and how often its greedy
continuations degenerate (textquality). The build records both in build.json and ranks the
held-out prompts by them, so the demo shows prompts the pair continues well.

Perplexity is per token of the pair's own tokenizer; bits per byte is the figure to compare
across tokenizers (a larger vocabulary has fewer, harder tokens for the same text).

    python -m specserve.tooling.modelbuild.evaluate models/default [--per-class 30] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F

from specserve.tooling.textquality import degeneracy

CONTINUATION_TOKENS = 48


@torch.no_grad()
def heldout_nll(model, tokenizer, docs: list[str], seq_len: int, max_windows: int) -> dict:
    """Mean next-token NLL over non-overlapping windows of the class's held-out stream (each
    document followed by EOS): {"ppl", "bits_per_byte", "tokens"}."""
    eos = tokenizer.eos_token_id
    stream = [t for d in docs for t in tokenizer.encode(d) + [eos]]
    windows = [stream[i : i + seq_len + 1] for i in range(0, len(stream) - seq_len - 1, seq_len)][:max_windows]
    if not windows:
        return {"ppl": float("nan"), "bits_per_byte": float("nan"), "tokens": 0}
    nll, n_tok, n_bytes = 0.0, 0, 0
    for i in range(0, len(windows), 16):
        batch = torch.tensor(windows[i : i + 16])  # [b, seq_len + 1]
        logits = model(input_ids=batch[:, :-1]).logits.float()  # [b, seq_len, vocab]
        nll += float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1),
                                     reduction="sum"))
        n_tok += batch[:, 1:].numel()
        n_bytes += sum(len(tokenizer.decode(w[1:]).encode()) for w in batch.tolist())
    return {"ppl": math.exp(nll / n_tok), "bits_per_byte": nll / math.log(2) / n_bytes, "tokens": n_tok}


@torch.no_grad()
def greedy(model, ids: list[int], max_new: int, banned: tuple[int, ...]) -> list[int]:
    """Plain greedy decoding with a KV cache; `banned` ids (EOS) never win, so every
    continuation has exactly max_new tokens (as in the benchmarks)."""
    out: list[int] = []
    x = torch.tensor([ids])
    past = None
    for _ in range(max_new):
        res = model(input_ids=x, past_key_values=past, use_cache=True)
        logits = res.logits[0, -1].float()  # [vocab]
        logits[list(banned)] = -math.inf
        nxt = int(logits.argmax())
        out.append(nxt)
        past, x = res.past_key_values, torch.tensor([[nxt]])
    return out


@torch.no_grad()
def reference_nll(model, prompt_ids: list[int], reference_ids: list[int]) -> float:
    """Mean NLL of the document's own continuation after the prompt (how well the pair
    knows this text)."""
    ids = torch.tensor([prompt_ids + reference_ids])
    logits = model(input_ids=ids[:, :-1]).logits[0, len(prompt_ids) - 1 :].float()  # [len(ref), vocab]
    return float(F.cross_entropy(logits, ids[0, len(prompt_ids) :]))


def annotate_prompts(model, tokenizer, prompts: list[dict]) -> list[dict]:
    """Each prompt with its greedy continuation's degeneracy and the reference NLL; prompts
    carry "reference" (the document's own next text), which is dropped here."""
    eos = tokenizer.eos_token_id
    out = []
    for p in prompts:
        ids = tokenizer.encode(p["prompt"])
        ref = tokenizer.encode(p["reference"])[:CONTINUATION_TOKENS]
        cont = greedy(model, ids, CONTINUATION_TOKENS, (eos,))
        item = {k: v for k, v in p.items() if k != "reference"}
        item["greedy"] = degeneracy(cont).as_dict()
        item["reference_nll"] = round(reference_nll(model, ids, ref), 4) if ref else None
        out.append(item)
    return out


@torch.no_grad()
def extraction_match(model, tokenizer, docs: list[str], max_new: int = 128) -> dict:
    """Does the pair copy the source record? For each held-out extraction document, the
    greedy continuation after "JSON:" is parsed (its first line) and each field compared
    with the record's own: {"records", "parse_rate", "field_match"} (exact-match rate over
    all fields of all records; a record that does not parse scores 0 on its fields)."""
    fields = hits = parsed = 0
    for doc in docs:
        cut = doc.index("JSON: ") + len("JSON:")
        truth = json.loads(doc[cut:].strip().splitlines()[0])
        ids = tokenizer.encode(doc[:cut])
        text = tokenizer.decode(greedy(model, ids, max_new, (tokenizer.eos_token_id,))).strip()
        try:
            got = json.loads(text.splitlines()[0]) if text else None
        except ValueError:
            got = None
        parsed += isinstance(got, dict)
        for key, value in truth.items():
            fields += 1
            hits += isinstance(got, dict) and got.get(key) == value
    n = max(len(docs), 1)
    return {"records": len(docs), "parse_rate": parsed / n, "field_match": hits / max(fields, 1)}


def demo_choice(prompts: list[dict], workload_class: str, n: int) -> list[dict]:
    """The n prompts of a class the pair continues best: non-degenerate greedy continuation
    first, then the lowest reference NLL. Unannotated prompts keep their order."""
    mine = [p for p in prompts if p["workload_class"] == workload_class]

    def key(ip):
        i, p = ip
        if "greedy" not in p:
            return (0, 0.0, i)
        nll = p.get("reference_nll")
        return (int(p["greedy"]["degenerate"]), nll if nll is not None else math.inf, i)

    return [p for _, p in sorted(enumerate(mine), key=key)[:n]]


def evaluate_pair(pair: Path, per_class: int, code_bytes: int | None = None, prose_bytes: int | None = None,
                  windows: int = 64, samples: int = 3) -> dict:
    """Held-out perplexity and degenerate fraction per class, with sample continuations."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specserve.tooling.modelbuild.build import eval_prompts
    from specserve.tooling.modelbuild.corpus import CLASSES, build_corpus

    cfg = json.loads((pair / "build.json").read_text())["config"]
    corpus = build_corpus(code_bytes or cfg["code_bytes"], prose_bytes or cfg["prose_bytes"],
                          cfg["n_extraction"], cfg["seed"], cfg.get("corpus_version", 1))
    tok = AutoTokenizer.from_pretrained(pair / "target")
    model = AutoModelForCausalLM.from_pretrained(pair / "target", dtype=torch.float32).eval()
    prompts = eval_prompts(corpus.heldout, per_class)
    report: dict = {"pair": str(pair), "per_class": per_class, "classes": {}}
    for cls in CLASSES:
        nll = heldout_nll(model, tok, corpus.heldout[cls], cfg["seq_len"], windows)
        mine = [p for p in prompts if p["workload_class"] == cls]
        rows = []
        for p in mine:
            ids = tok.encode(p["prompt"])
            cont = greedy(model, ids, CONTINUATION_TOKENS, (tok.eos_token_id,))
            rows.append({"prompt": p["prompt"], "output": tok.decode(cont), **degeneracy(cont).as_dict()})
        report["classes"][cls] = {
            **nll, "prompts": len(rows),
            "degenerate_fraction": sum(r["degenerate"] for r in rows) / max(len(rows), 1),
            "samples": rows[:samples], "all": rows,
        }
    report["extraction_match"] = extraction_match(model, tok, corpus.heldout["extraction"][:per_class])
    return report


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description="held-out perplexity and degenerate continuations of a pair")
    ap.add_argument("pair", type=Path)
    ap.add_argument("--per-class", type=int, default=30)
    ap.add_argument("--code-bytes", type=int, default=None, help="corpus size the held-out set is drawn from")
    ap.add_argument("--prose-bytes", type=int, default=None)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args(argv)
    torch.set_num_threads(2)
    rep = evaluate_pair(a.pair.resolve(), a.per_class, a.code_bytes, a.prose_bytes)
    print(f"{a.pair}: held-out, {a.per_class} prompts per class, {CONTINUATION_TOKENS}-token greedy")
    print("| class | ppl/token | bits/byte | degenerate |")
    print("|---|---|---|---|")
    for cls, r in rep["classes"].items():
        print(f"| {cls} | {r['ppl']:.2f} | {r['bits_per_byte']:.3f} | "
              f"{r['degenerate_fraction']:.0%} ({sum(x['degenerate'] for x in r['all'])}/{r['prompts']}) |")
    m = rep["extraction_match"]
    print(f"extraction, {m['records']} held-out records: {m['parse_rate']:.0%} parse, "
          f"{m['field_match']:.0%} of fields copied exactly")
    for cls, r in rep["classes"].items():
        for s in r["samples"]:
            print(f"[{cls}] prompt {s['prompt'][-80:]!r}\n   -> {s['output']!r}  (degenerate={s['degenerate']})")
    if a.json:
        a.json.write_text(json.dumps(rep, indent=1))


if __name__ == "__main__":
    main()
