"""A causal LM plus the KV cache of one sequence, and the token ids that cache holds.

Both the draft and the target keep per-session state this way. `reconcile` is DESIGN §3
invariant 2 in one method: keep the longest cached prefix that agrees with the committed
tokens of the request, drop everything after it (provisional drafts, rejected positions).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import DynamicCache

from specserve.models.kv_slots import common_prefix


def cache_length(cache: DynamicCache | None) -> int:
    return 0 if cache is None else int(cache.get_seq_length())


def crop_cache(cache: DynamicCache, keep: int) -> None:
    """Keep the first `keep` positions. transformers 5 changed `DynamicCache.crop`: its
    argument is now the number of tokens to remove, as a negative int (4.x took the length to
    keep and read a negative value the same way). Only the negative form means the same in
    both, and the length is checked afterwards so a future change fails loudly."""
    remove = cache_length(cache) - keep
    if remove <= 0:
        return
    cache.crop(-remove)
    got = cache_length(cache)
    if got != keep:
        raise RuntimeError(f"DynamicCache.crop kept {got} positions, expected {keep}")


class CachedLM:
    """One sequence's view of a causal LM: model + KV cache + the ids in the cache."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.cache: DynamicCache | None = None
        self.ids: list[int] = []

    @property
    def length(self) -> int:
        return len(self.ids)

    def reconcile(self, token_ids: Sequence[int], feed_at_least: int = 1) -> int:
        """Crop to the longest common prefix with `token_ids`, leaving at least
        `feed_at_least` of them to be fed (a forward needs an input). Returns the number of
        provisional positions rolled back (cached past or disagreeing with `token_ids`)."""
        common = common_prefix(self.ids, token_ids)
        rolled_back = self.length - common
        self.crop(min(common, max(len(token_ids) - feed_at_least, 0)))
        return rolled_back

    def crop(self, keep: int) -> None:
        if keep < self.length:
            if self.cache is not None:
                crop_cache(self.cache, keep)
            del self.ids[keep:]

    @torch.inference_mode()
    def extend(self, new_ids: Sequence[int]) -> torch.Tensor:
        """Feed `new_ids` after the cached prefix (on the model's device); returns logits
        [len(new_ids), V] float32 on the host."""
        if not new_ids:
            raise ValueError("extend needs at least one token")
        if self.cache is None:
            self.cache = DynamicCache()
        device = next(self.model.parameters()).device
        inp = torch.tensor([list(new_ids)], dtype=torch.long, device=device)
        out = self.model(input_ids=inp, past_key_values=self.cache, use_cache=True)
        self.cache = out.past_key_values
        self.ids.extend(int(t) for t in new_ids)
        # on the host: the per-session path (architectures the batched runner does not serve)
        # reads its logits there, one copy per forward (ADR 0016)
        logits: torch.Tensor = out.logits[0].float().cpu()
        return logits

    def reset(self) -> None:
        self.cache = None
        self.ids = []
