"""Turning a GenerateRequest into validated parameters: every refusal is INVALID_ARGUMENT
with a message a person can act on. Also the rule-based workload classifier."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

from specserve.errors import InvalidRequest
from specserve.params import MAX_K, GenerationParams, SamplingParams
from specserve.v1 import generation_pb2

CLASSES = ("code", "chat", "extraction")
NO_SPECULATION = "none"

_CODE = re.compile(r"```|^\s*(def|class|import|from|return|for|while|if)\b|[{};]\s*$|\w+\(.*\)\s*:?\s*$", re.M)
_EXTRACTION = re.compile(r"\bjson\b|\bextract\b|^\s*[\[{]\s*\"|\"\w+\"\s*:", re.I | re.M)


def classify(prompt: str) -> tuple[str, str]:
    """Rules first: (class, reason). Explicit classes on the request skip this."""
    if _EXTRACTION.search(prompt):
        return "extraction", "json/extraction markers"
    if len(_CODE.findall(prompt)) >= 2:
        return "code", "code syntax"
    return "chat", "default"


class ModelInfo:
    """What the router needs of the model: tokenizer, EOS ids, context length (no torch)."""

    def __init__(self, model_dir: str) -> None:
        path = Path(model_dir)
        self.tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
        self.vocab_size = self.tokenizer.get_vocab_size(with_added_tokens=True)
        config = json.loads((path / "config.json").read_text()) if (path / "config.json").exists() else {}
        gen = json.loads((path / "generation_config.json").read_text()) if (path / "generation_config.json").exists() else {}
        eos = gen.get("eos_token_id", config.get("eos_token_id"))
        self.eos_token_ids = frozenset([] if eos is None else [eos] if isinstance(eos, int) else eos)
        self.context_len = int(config.get("max_position_embeddings", 1 << 30))
        heads = int(config.get("num_attention_heads", 1))
        head_dim = int(config.get("head_dim") or int(config.get("hidden_size", 0)) // max(heads, 1))
        kv_heads = int(config.get("num_key_value_heads") or heads)
        width = {"float16": 2, "bfloat16": 2}.get(str(config.get("dtype") or config.get("torch_dtype")), 4)
        # K and V for every layer: what a rejected draft position costs in target KV cache
        self.kv_bytes_per_token = 2 * int(config.get("num_hidden_layers", 0)) * kv_heads * head_dim * width

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)


@dataclass(frozen=True)
class Spec:
    prompt_ids: list[int]
    prompt_text: str
    params: GenerationParams
    workload_class: str
    class_reason: str
    pool: str | None  # None = plain decoding
    request_id: str | None


def parse(req: generation_pb2.GenerateRequest, model: ModelInfo, pools: list[str], default_pool: str,
          default_k: int, max_tokens_limit: int, max_prompt_tokens: int) -> Spec:
    which = req.WhichOneof("input")
    if which == "prompt_ids":
        ids = [int(t) for t in req.prompt_ids.ids]
        bad = [t for t in ids if t >= model.vocab_size]
        if bad:
            raise InvalidRequest(f"prompt token id {bad[0]} is outside the vocabulary (size {model.vocab_size})")
        text = model.decode(ids)
    else:
        text = req.prompt
        ids = model.encode(text) if text else []
    if not ids:
        raise InvalidRequest("the prompt is empty: send prompt text or prompt_ids")
    if len(ids) > max_prompt_tokens:
        raise InvalidRequest(f"the prompt has {len(ids)} tokens; the limit is {max_prompt_tokens}")
    if req.max_tokens < 1 or req.max_tokens > max_tokens_limit:
        raise InvalidRequest(f"max_tokens must be in [1, {max_tokens_limit}], got {req.max_tokens}")
    if len(ids) + req.max_tokens > model.context_len:
        raise InvalidRequest(f"prompt ({len(ids)} tokens) + max_tokens ({req.max_tokens}) exceeds the "
                             f"context length of {model.context_len}")
    if req.workload_class and req.workload_class not in CLASSES:
        raise InvalidRequest(f"unknown workload_class {req.workload_class!r}; use one of {', '.join(CLASSES)} "
                             "or leave it empty to classify the prompt")
    cls, reason = (req.workload_class, "explicit") if req.workload_class else classify(text)
    pool_name = req.draft_pool or default_pool
    if pool_name != NO_SPECULATION and pool_name not in pools:
        raise InvalidRequest(f"unknown draft_pool {pool_name!r}; available: {', '.join(sorted(pools))}, "
                             f"or {NO_SPECULATION!r}")
    k = req.num_draft_tokens if req.HasField("num_draft_tokens") else default_k
    if k > MAX_K:
        raise InvalidRequest(f"num_draft_tokens must be in [0, {MAX_K}], got {k}")
    if len(req.request_id) > 256:
        raise InvalidRequest("request_id is longer than 256 characters")
    sampling = SamplingParams(
        temperature=float(req.temperature), top_k=int(req.top_k),
        top_p=float(req.top_p) if req.HasField("top_p") else 1.0,
        banned_token_ids=tuple(int(t) for t in req.banned_token_ids))
    sampling.check_vocab(model.vocab_size)
    params = GenerationParams(
        max_tokens=int(req.max_tokens), sampling=sampling, num_draft_tokens=int(k),
        stop=tuple(req.stop), seed=int(req.seed) if req.HasField("seed") else None)
    pool = None if pool_name == NO_SPECULATION or k == 0 else pool_name
    return Spec(ids, text, params, cls, reason, pool, req.request_id or None)
