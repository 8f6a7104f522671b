"""Where generation ends inside a block of emitted tokens: EOS, the token budget, or a
stop string (which may straddle round boundaries)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

# a decode that starts mid-sequence may differ from the full decode in its first characters
# only: at most 3 replacement characters for a character whose first bytes it cut, or a
# leading space a sentencepiece decoder strips from its first token
WINDOW_GARBLE = 3


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
        # tokens (checked before) are never re-reported. The text is decoded from a few
        # tokens back, not from the start (that made each token cost a decode of everything
        # generated): the window starts early enough that its first characters, which a
        # tokenizer may decode differently mid-sequence, are not looked at: a leading space
        # stripped, or up to 3 replacement characters where the window cuts a character's
        # bytes (review: with a margin of 0 a stop string starting with "🙂" was missed).
        longest = max(len(s) for s in self.stop_strings)
        span = longest + 2
        while True:
            j = max(0, i - span)
            before = self.decode(generated[j:i])
            text = self.decode(generated[j : i + 1])
            if j == 0 or len(before) > longest + WINDOW_GARBLE:
                break
            span *= 2  # tokens of little text (bytes of one character): further back
        window = text[max(0, len(before) - longest + 1) :]
        return any(s in window for s in self.stop_strings)

    def visible_text(self, generated: Sequence[int], reason: str) -> str:
        """The text a client sees: a stop string and what follows it are cut."""
        text = self.decode(generated)
        if reason == "stop":
            cut = min((text.find(s) for s in self.stop_strings if s in text), default=len(text))
            return text[:cut]
        return text


class IncrementalText:
    """The newly visible text after each commit. Until the end, a tail that could still
    become a stop string, or an incomplete UTF-8 character, is held back, so a client never
    sees text that a later round would take away.

    Until the end only the new tokens are decoded, with the round before as context (the
    text decoded from `prefix` on, less that of `prefix` to `read`): decoding everything
    generated at every round cost one decode of all of it a round, per session (226 µs at
    1,024 tokens with the demo tokenizer, `python -m timeit` on a loaded machine). The end
    decodes it all once, as the client's final text. Where later bytes
    rewrite text already published (byte-fallback tokens: a lone byte, then a continuation
    byte), neither way can take it back; the full decode then stopped streaming until the end,
    this goes on with the new tokens' text."""

    def __init__(self, stops: StopChecker) -> None:
        self.stops = stops
        self.published = ""
        self.decoded = ""  # the text of generated[:read]
        self.prefix = self.read = 0  # token offsets: the context window's start, and its end

    def advance(self, generated: Sequence[int], finish_reason: str | None) -> str:
        if finish_reason is not None:
            text = self.stops.visible_text(generated, finish_reason)
        else:
            before = self.stops.decode(generated[self.prefix : self.read])
            now = self.stops.decode(generated[self.prefix :])
            # (where the new tokens changed their context's text: everything decoded, as it was)
            full = self.decoded + now[len(before) :] if now.startswith(before) else self.stops.decode(generated)
            # the window moves on only past tokens that added text: after a round of skipped
            # special tokens the context would decode to nothing, and a sentencepiece decoder
            # would then strip the next word's space (review: "hello", "<s>", " world" streamed
            # "helloworld"); nor while a character is incomplete, to decode it again
            if len(now) > len(before) and not full.endswith("\ufffd"):
                self.decoded, self.prefix, self.read = full, self.read, len(generated)
            text = full[: len(full) - self._hold(full)]
        if len(text) <= len(self.published) or not text.startswith(self.published):
            return ""  # nothing new (or a decode that rewrote earlier text: wait for more)
        new = text[len(self.published) :]
        self.published = text
        return new

    def _hold(self, text: str) -> int:
        hold = len(text) - len(text.rstrip("\ufffd"))
        for s in self.stops.stop_strings:
            for n in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:n]):
                    hold = max(hold, n)
                    break
        return hold
