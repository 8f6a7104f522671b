"""The stop checks and the streamed text decode only the newest tokens (with a little context),
and say exactly what decoding everything generated said: the same stops, the same text a
round, on the demo tokenizer, over generations with multi-byte characters and stop strings."""

import random

import pytest

from specserve.algorithm.stops import IncrementalText, StopChecker


class FullDecode:
    """The implementation before: everything generated decoded at every check and round."""

    def __init__(self, stops: StopChecker) -> None:
        self.stops, self.published = stops, ""

    def stop_at(self, generated, i) -> bool:
        before = self.stops.decode(generated[:i])
        text = self.stops.decode(generated[: i + 1])
        longest = max(len(s) for s in self.stops.stop_strings)
        return any(s in text[max(0, len(before) - longest + 1):] for s in self.stops.stop_strings)

    def advance(self, generated, finish_reason) -> str:
        text = self.stops.visible_text(generated, finish_reason or "")
        if finish_reason is None:
            text = text[: len(text) - IncrementalText(self.stops)._hold(text)]
        if len(text) <= len(self.published) or not text.startswith(self.published):
            return ""
        new = text[len(self.published):]
        self.published = text
        return new


@pytest.fixture(scope="module")
def tokenizer(demo_pair_dir):
    from specserve.models.loading import load_tokenizer

    return load_tokenizer(str(demo_pair_dir / "target"))


def _generations(tokenizer, n: int, seed: int):
    """Token sequences a model could emit: real text (with accents, CJK and emoji, which the
    byte-level tokenizer splits into tokens of part of a character) and random tokens."""
    rng = random.Random(seed)
    words = ["def", " return", " x", "\n", "    ", "é", "漢字", "🙂", " stop", "END", ".", " the", "##", "}"]
    for _ in range(n):
        if rng.random() < 0.7:
            text = "".join(rng.choice(words) for _ in range(rng.randrange(5, 120)))
            yield tokenizer.encode(text, add_special_tokens=False)
        else:
            yield [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randrange(5, 200))]


@pytest.mark.parametrize("stops", [(), ("END",), ("\n\n", "漢"), ("🙂 stop",)])
def test_the_windowed_checks_and_text_equal_full_decoding(tokenizer, stops):
    def decode(ids):
        return tokenizer.decode(list(ids), skip_special_tokens=True)

    checker = StopChecker(frozenset(), stops, decode)
    rng = random.Random(len(stops))
    met = streamed = 0
    for gen in _generations(tokenizer, 60, seed=len(stops)):
        if stops:  # every position's stop check
            for i in range(len(gen)):
                want = FullDecode(checker).stop_at(gen, i)
                assert checker._stop_string_at(gen, i) == want, (gen, i)
                met += want
        stop = checker.first_stop(gen, 0)  # a generation ends at its first stop, as the engine ends it
        gen, reason = (gen[:stop[0]], stop[1]) if stop else (gen, "length")
        new, old = IncrementalText(checker), FullDecode(checker)
        at, chunks = 0, []
        while (at := at + rng.randrange(1, 7)) < len(gen):  # rounds of 1 to 6 tokens; the last one ends it
            got = new.advance(gen[:at], None)
            assert got == old.advance(gen[:at], None), (gen, at)
            chunks.append(got)
            streamed += bool(got)
        last = new.advance(gen, reason)
        assert last == old.advance(gen, reason)
        assert "".join(chunks) + last == checker.visible_text(gen, reason)
    assert streamed > 100 and (met > 0 or not stops)  # (the cases bite)


def test_decoding_is_windowed(tokenizer):
    """The point of it: a round decodes the newest tokens, not everything generated."""
    lengths = []

    def decode(ids):
        lengths.append(len(ids))
        return tokenizer.decode(list(ids), skip_special_tokens=True)

    text = IncrementalText(StopChecker(frozenset(), ("END",), decode))
    gen = tokenizer.encode("word " * 400, add_special_tokens=False)
    for at in range(4, len(gen), 4):
        text.advance(gen[:at], None)
    assert len(gen) > 300 and max(lengths) <= 12, max(lengths)
    lengths.clear()
    StopChecker(frozenset(), ("END",), decode).first_stop(gen, len(gen) - 4)
    assert max(lengths) <= 8, max(lengths)
