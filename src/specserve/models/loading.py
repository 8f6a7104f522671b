"""Loading a draft/target pair by `from_pretrained` (local directory or hub id) and the
pairing check: a pair whose vocabularies differ is refused, naming the first mismatch."""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.utils import logging as hf_logging

from specserve.errors import IncompatiblePair

if not sys.stdout.isatty():  # no progress bars without a terminal (CI)
    hf_logging.disable_progress_bar()


@dataclass
class LoadedPair:
    tokenizer: PreTrainedTokenizerBase
    target: PreTrainedModel
    draft: PreTrainedModel | None


def load_model(path: str, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """Any Hugging Face causal LM by local path or hub id (nothing here forces a download:
    offline, a hub id only resolves from the local cache)."""
    model: PreTrainedModel = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    model.eval()
    return model


def load_tokenizer(path: str) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(path)


def check_pair(target_tok: PreTrainedTokenizerBase, draft_tok: PreTrainedTokenizerBase,
               target_vocab_size: int | None = None, draft_vocab_size: int | None = None) -> None:
    """Raise IncompatiblePair unless both tokenizers map the same strings to the same ids
    (special tokens included) and the models' output sizes agree."""
    tv, dv = target_tok.get_vocab(), draft_tok.get_vocab()
    target_by_id = {i: s for s, i in tv.items()}
    draft_by_id = {i: s for s, i in dv.items()}
    for i in sorted(set(target_by_id) | set(draft_by_id)):
        ts, ds = target_by_id.get(i), draft_by_id.get(i)
        if ts != ds:
            raise IncompatiblePair(
                f"vocabularies differ at token id {i}: target has {ts!r}, draft has {ds!r} "
                f"(target vocabulary {len(tv)} tokens, draft {len(dv)})"
            )
    for name in ("eos_token_id", "bos_token_id", "pad_token_id", "unk_token_id"):
        t, d = getattr(target_tok, name, None), getattr(draft_tok, name, None)
        if t != d:
            raise IncompatiblePair(f"special token {name} differs: target {t}, draft {d}")
    if target_vocab_size is not None and draft_vocab_size is not None and target_vocab_size != draft_vocab_size:
        raise IncompatiblePair(
            f"output sizes differ: target logits have {target_vocab_size} entries, draft "
            f"{draft_vocab_size}; both models must share one vocabulary"
        )


def load_pair(target_path: str, draft_path: str | None) -> LoadedPair:
    tokenizer = load_tokenizer(target_path)
    target = load_model(target_path)
    draft = None
    if draft_path is not None:
        draft_tok = load_tokenizer(draft_path)
        draft = load_model(draft_path)
        check_pair(tokenizer, draft_tok, _out_size(target), _out_size(draft))
    return LoadedPair(tokenizer, target, draft)


def _out_size(model: PreTrainedModel) -> int:
    return int(model.get_output_embeddings().weight.shape[0])
