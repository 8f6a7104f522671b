"""Where generation ends inside a block of emitted tokens: EOS, the token budget, or a
stop string (which may straddle round boundaries)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass
class StopChecker:
    eos_token_ids: frozenset[int]
    stop_strings: tuple[str, ...]
    decode: Callable[[Sequence[int]], str]

    def first_stop(self, generated: Sequence[int], new_from: int) -> tuple[int, str] | None:
        """Scan tokens generated[new_from:] in order. Returns (n_keep, reason) where n_keep is
        the number of generated tokens to keep (the stopping token included), or None."""
        for i in range(new_from, len(generated)):
            if generated[i] in self.eos_token_ids:
                return i + 1, "eos"
            if self.stop_strings and self._stop_string_at(generated, i):
                return i + 1, "stop"
        return None

    def _stop_string_at(self, generated: Sequence[int], i: int) -> bool:
        # Only a stop string that ends inside token i's text counts here, so earlier
        # tokens (checked before) are never re-reported.
        before = self.decode(generated[:i])
        text = self.decode(generated[: i + 1])
        longest = max(len(s) for s in self.stop_strings)
        window = text[max(0, len(before) - longest + 1) :]
        return any(s in window for s in self.stop_strings)

    def visible_text(self, generated: Sequence[int], reason: str) -> str:
        """The text a client sees: a stop string and what follows it are cut."""
        text = self.decode(generated)
        if reason == "stop":
            cut = min((text.find(s) for s in self.stop_strings if s in text), default=len(text))
            return text[:cut]
        return text
