"""What the router needs of the model, read from its directory without torch: the tokenizer,
EOS ids, the context length and what a KV position costs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer


class ModelInfo:
    """What the router needs of the model: tokenizer, EOS ids, context length (no torch)."""

    def __init__(self, model_dir: str) -> None:
        path = Path(model_dir)
        self.path = path
        self._grammars: dict[int, Any] = {}  # constraint compilers, by logits width
        self.tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
        self.vocab_size = self.tokenizer.get_vocab_size(with_added_tokens=True)
        config = json.loads((path / "config.json").read_text()) if (path / "config.json").exists() else {}
        gen = (json.loads((path / "generation_config.json").read_text())
               if (path / "generation_config.json").exists() else {})
        eos = gen.get("eos_token_id", config.get("eos_token_id"))
        self.eos_token_ids = frozenset([] if eos is None else [eos] if isinstance(eos, int) else eos)
        self.context_len = int(config.get("max_position_embeddings", 1 << 30))
        heads = int(config.get("num_attention_heads", 1))
        head_dim = int(config.get("head_dim") or int(config.get("hidden_size", 0)) // max(heads, 1))
        kv_heads = int(config.get("num_key_value_heads") or heads)
        width = {"float16": 2, "bfloat16": 2}.get(str(config.get("dtype") or config.get("torch_dtype")), 4)
        # K and V for every layer: what a rejected draft position costs in target KV cache
        self.kv_bytes_per_token = 2 * int(config.get("num_hidden_layers", 0)) * kv_heads * head_dim * width

    def grammars(self, logits_width: int = 0) -> Any:
        """The constraint compiler (structured/grammar.py) for this tokenizer, its masks
        `logits_width` wide (a model's logits may be wider than its vocabulary; 0 = the
        tokenizer's size), built on first use: it imports xgrammar (and torch), which a router
        that never sees a constraint skips. The router, the target and a draft replica share it."""
        width = logits_width or self.vocab_size
        if width not in self._grammars:
            from specserve.structured.grammar import GrammarCache, tokenizer_info

            self._grammars[width] = GrammarCache(tokenizer_info(str(self.path / "tokenizer.json"), width,
                                                                sorted(self.eos_token_ids)))
        return self._grammars[width]

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)
