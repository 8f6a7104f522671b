"""A byte-level BPE tokenizer trained with `tokenizers`, wrapped as a transformers fast
tokenizer so it saves and loads through the same `from_pretrained` path as a real model."""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from specserve.serving.chat import CHAT_TEMPLATE

EOS = "<|endoftext|>"
PAD = "<|pad|>"


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS, pad_token=PAD, bos_token=EOS, unk_token=None,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE  # saved in tokenizer_config.json: the HTTP API's chat turns
    return fast
