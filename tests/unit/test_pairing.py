import pytest

from specserve.errors import IncompatiblePair
from specserve.models.loading import check_pair
from specserve.tooling.modelbuild.tokenizer import train_tokenizer

TEXT_A = ["def add(a, b):\n    return a + b\n"] * 50 + ["the quick brown fox jumps"] * 50
TEXT_B = ["SELECT name FROM users WHERE id = 1;"] * 100


def test_same_tokenizer_passes(demo_pair):
    check_pair(demo_pair.tokenizer, demo_pair.tokenizer, 1024, 1024)


def test_different_vocabularies_name_the_first_mismatch():
    a, b = train_tokenizer(TEXT_A, 300), train_tokenizer(TEXT_B, 300)
    with pytest.raises(IncompatiblePair) as err:
        check_pair(a, b)
    msg = str(err.value)
    first = min(i for i in set(a.get_vocab().values()) | set(b.get_vocab().values())
                if a.convert_ids_to_tokens(i) != b.convert_ids_to_tokens(i))
    assert f"token id {first}:" in msg and "target has" in msg and "draft has" in msg


def test_different_output_sizes_are_refused(demo_pair):
    with pytest.raises(IncompatiblePair, match="output sizes differ"):
        check_pair(demo_pair.tokenizer, demo_pair.tokenizer, 1024, 2048)


def test_engine_refuses_mismatched_drafter(demo_pair, target_model):
    from specserve.drafters import NgramDrafter
    from specserve.errors import InvalidRequest
    from specserve.worker.reference import ReferenceDecoder

    with pytest.raises(InvalidRequest, match="vocabulary size"):
        ReferenceDecoder(target_model, NgramDrafter(vocab_size=7), demo_pair.tokenizer)
