"""The prediction drafter (Predicted Outputs): alignment and re-synchronisation on literal
tokens, then losslessness through the engine: at T = 0 the output is the target's greedy
output whatever the prediction says (here); at T > 0 its distribution is the target's (a case
of tests/unit/test_engine_sequence.py, beside the other drafters)."""


import numpy as np
import pytest

from specserve.algorithm.sampling import SamplingParams
from specserve.drafters.prediction import PredictionDrafter, resync
from specserve.errors import InvalidRequest
from specserve.worker.reference import GenerationParams, ReferenceDecoder

GREEDY = SamplingParams()
PROMPT = [100, 101]  # the drafter reads the output after these


def proposes(prediction, output, k=3):
    session = PredictionDrafter(prediction, len(PROMPT)).start()
    return session.propose(PROMPT + list(output), k, GREEDY, 0).tokens


def test_empty_output_proposes_the_prediction_start():
    assert proposes([1, 2, 3, 4], []) == [1]  # no evidence yet that the output follows it


def test_block_grows_with_the_evidence_up_to_k():
    pred = list(range(1, 40))
    assert [len(proposes(pred, pred[:n], k=16)) for n in (0, 1, 2, 4, 8)] == [1, 3, 5, 9, 16]


def test_in_step_proposes_what_follows():
    assert proposes([1, 2, 3, 4, 5, 6], [1, 2]) == [3, 4, 5]


def test_token_absent_from_prediction_proposes_nothing():
    assert proposes([1, 2, 3, 4, 5, 6], [1, 2, 9]) == []


def test_substitution_resyncs_on_the_next_token():
    # `9` replaced `3`; `4` is found at index 3, so the walk is back in step (one token of
    # evidence: a block of 1, then growing)
    assert proposes([1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 9, 4]) == [5]
    assert proposes([1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 9, 4, 5]) == [6, 7, 8]


def test_insertion_resyncs():
    # `7 8` inserted after `1 2`; `3` comes next
    assert proposes([1, 2, 3, 4, 5], [1, 2, 7, 8, 3, 4]) == [5]


def test_deletion_skips_ahead():
    # `3 4` deleted: the output goes on with `5`
    assert proposes([1, 2, 3, 4, 5, 6, 7], [1, 2, 5]) == [6]


def test_longest_suffix_wins_over_nearest_single_token():
    # `5` alone occurs at index 1, right where the walk expected it; `2 5` only at 6-7
    assert resync(np.array([1, 5, 8, 0, 0, 0, 2, 5, 9]), [1, 7, 2, 5], expected=2, min_n=1, max_n=4) == (8, 2)


def test_repeated_token_resyncs_to_the_occurrence_nearest_the_cursor():
    pred = [5, 1, 2, 3, 5, 4, 6, 5, 7]
    # in step to index 4, then `0` replaces `5`; `4` follows: found at index 5 only
    assert proposes(pred, [5, 1, 2, 3, 0, 4, 6], k=2) == [5, 7]
    # `5` occurs at indices 0, 4 and 7: the one ending nearest the expected end (5) wins
    assert resync(np.array(pred), [5, 1, 2, 3, 0, 5], expected=5, min_n=1, max_n=1) == (5, 1)


def test_end_of_prediction_proposes_nothing():
    assert proposes([1, 2, 3], [1, 2, 3]) == []
    assert proposes([1, 2, 3], [1, 2, 3, 4]) == []


def test_banned_token_ends_the_block():
    sp = SamplingParams(temperature=0.5, banned_token_ids=(4,))
    session = PredictionDrafter([1, 2, 3, 4, 5], len(PROMPT)).start()
    assert session.propose(PROMPT + [1], 4, sp, 0).tokens == [2, 3]


def test_walk_is_a_pure_function_of_the_prefix():
    pred = [1, 2, 3, 4, 5, 6, 7, 8]
    session = PredictionDrafter(pred, len(PROMPT)).start()
    session.propose(PROMPT + [1, 2, 9, 9], 3, GREEDY, 0)  # walked a branch that was not committed
    fresh = PredictionDrafter(pred, len(PROMPT)).start()
    for out in ([1, 2, 3], [1, 2, 3, 4, 5], [1, 9, 3]):
        assert session.propose(PROMPT + out, 3, GREEDY, 0).tokens == fresh.propose(PROMPT + out, 3, GREEDY, 0).tokens


def test_q_is_one_hot():
    assert PredictionDrafter([1, 2], 0).start().propose([1], 2, GREEDY, 0).q is None


def test_bad_ngram_sizes_are_refused():
    with pytest.raises(InvalidRequest):
        PredictionDrafter([1], 0, min_n=3, max_n=2)


# -- lossless through the engine -----------------------------------------------------------
MAX_TOKENS = 24


def _edited(ref: list[int], vocab: int) -> list[int]:
    """The reference with an edit in it: one token replaced, two dropped, one inserted."""
    out = list(ref)
    out[4] = (out[4] + 1) % vocab
    del out[10:12]
    out.insert(16, (out[16] + 7) % vocab)
    return out


@pytest.mark.slow
def test_greedy_output_is_plain_greedy_whatever_the_prediction(demo_pair, target_model, eval_prompts):
    plain = ReferenceDecoder(target_model, None, demo_pair.tokenizer)
    accepted = rejected = 0
    for item in eval_prompts[:3]:
        ids = demo_pair.tokenizer.encode(item["prompt"])
        ref = plain.generate(ids, GenerationParams(max_tokens=MAX_TOKENS)).token_ids
        for prediction in (_edited(ref, target_model.vocab_size), ref[::-1]):
            engine = ReferenceDecoder(target_model, PredictionDrafter(prediction, len(ids), target_model.vocab_size),
                                demo_pair.tokenizer)
            res = engine.generate(ids, GenerationParams(max_tokens=MAX_TOKENS, num_draft_tokens=8))
            assert res.token_ids == ref, item["prompt"][:60]
            accepted += sum(r.accepted for r in res.rounds)
            rejected += sum(r.k - r.accepted for r in res.rounds)
    assert accepted > 0 and rejected > 0  # both paths were exercised


def test_the_token_index_finds_what_the_full_scan_finds():
    """resync with `ends_by_token` (what the router uses) and without it (a scan of the
    whole prediction) agree on random predictions and outputs, small vocabulary so that
    n-grams repeat and ties between occurrences occur."""
    from specserve.drafters.prediction import ends_by_token

    rng = np.random.default_rng(7)
    for _ in range(300):
        pred = rng.integers(0, 6, size=int(rng.integers(1, 60)))
        out = [int(t) for t in rng.integers(0, 7, size=int(rng.integers(1, 10)))]
        expected = int(rng.integers(0, len(pred) + 2))
        scan = resync(pred, out, expected, 1, 4)
        # the scan the index replaced: sliding windows over the whole prediction
        brute = None
        for n in range(min(4, len(out), len(pred)), 0, -1):
            ends = [i + n for i in range(len(pred) - n + 1) if list(pred[i:i + n]) == out[-n:]]
            if ends:
                brute = (min(ends, key=lambda e: (abs(e - expected), e)), n)
                break
        assert resync(pred, out, expected, 1, 4, ends_by_token(pred)) == scan == brute
