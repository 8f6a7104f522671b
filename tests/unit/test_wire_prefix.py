"""Wire-level core pieces: the committed-prefix hash chain, protobuf conversions, the session
LRU and the incremental visible text."""

import pytest
import torch

from specserve.algorithm.rejection import DenseQ, SparseQ
from specserve.algorithm.sampling import SamplingParams
from specserve.algorithm.stops import IncrementalText, StopChecker
from specserve.errors import InvalidRequest, NeedsFullPrefix
from specserve.serving.wire import prefix_to_proto, sampling_from_proto, sampling_to_proto
from specserve.state.prefix import CommittedPrefix, chain
from specserve.worker.qcodec import q_from_proto, q_to_proto


def test_worker_follows_deltas_and_refuses_a_different_prefix():
    router = CommittedPrefix([5, 6, 7])
    worker = CommittedPrefix()
    msg = prefix_to_proto(router, 0)
    assert worker.apply(msg.base_len, msg.base_hash, msg.tokens) == [5, 6, 7]
    router.extend([8, 9])
    msg = prefix_to_proto(router, 3)
    assert list(msg.tokens) == [8, 9]  # only the delta travels
    assert worker.apply(msg.base_len, msg.base_hash, msg.tokens) == [5, 6, 7, 8, 9]
    other = CommittedPrefix([5, 6, 1, 8, 9])  # same length, different history
    with pytest.raises(NeedsFullPrefix):
        worker.apply(5, other.hash_at(5), [2])
    with pytest.raises(NeedsFullPrefix):  # the worker holds fewer tokens than assumed
        CommittedPrefix([5]).apply(3, router.hash_at(3), [8])


def test_chain_hash_depends_on_order_and_content():
    assert chain(0, [1, 2]) != chain(0, [2, 1])
    assert chain(0, [1, 2]) == chain(chain(0, [1]), [2])
    assert chain(0, []) == 0


def test_q_roundtrips_exactly():
    dense = DenseQ(torch.softmax(torch.randn(3, 11), -1))
    back = q_from_proto(q_to_proto(dense), 3, 11)
    assert isinstance(back, DenseQ) and torch.equal(back.probs, dense.probs)
    sparse = SparseQ(torch.tensor([[1, 4], [0, 2]]), torch.tensor([[0.25, 0.75], [1.0, 0.0]]))
    back = q_from_proto(q_to_proto(sparse), 2, 11)
    assert isinstance(back, SparseQ) and torch.equal(back.ids, sparse.ids) and torch.equal(back.probs, sparse.probs)
    assert q_from_proto(q_to_proto(None), 2, 11) is None


def test_bad_q_is_invalid_argument():
    msg = q_to_proto(DenseQ(torch.ones(2, 5) / 5))
    with pytest.raises(InvalidRequest, match="dense q"):
        q_from_proto(msg, 3, 5)  # says 3 drafts, carries 2 rows
    bad = q_to_proto(SparseQ(torch.tensor([[9]]), torch.tensor([[1.0]])))
    with pytest.raises(InvalidRequest, match="outside"):
        q_from_proto(bad, 1, 5)


def test_sampling_roundtrip_and_unset_top_p():
    sp = SamplingParams(temperature=0.7, top_k=5, top_p=0.9, banned_token_ids=(3,))
    assert sampling_from_proto(sampling_to_proto(sp)) == sp
    assert sampling_from_proto(sampling_to_proto(SamplingParams())).top_p == 1.0


def test_incremental_text_never_shows_what_a_stop_string_takes_back():
    vocab = {1: "Hel", 2: "lo E", 3: "ND", 4: "!"}
    checker = StopChecker(frozenset(), ("END",), lambda ids: "".join(vocab[i] for i in ids))
    text = IncrementalText(checker)
    assert text.advance([1], None) == "Hel"
    assert text.advance([1, 2], None) == "lo "  # "E" might start "END": held back
    stop = checker.first_stop([1, 2, 3], 2)
    assert stop == (3, "stop")
    assert text.advance([1, 2, 3], "stop") == ""  # the stop string never appears
    assert text.published == "Hello "


def test_one_k_limit_everywhere_a_k_comes_in():
    """The request's K, a draft call's K and a policy's K are checked by the one `check_k`."""
    import pytest

    from specserve.control.policy import Policy
    from specserve.errors import InvalidRequest
    from specserve.params import MAX_K, GenerationParams, check_k

    assert check_k(MAX_K) == MAX_K and check_k(0) == 0
    for bad in (lambda: check_k(MAX_K + 1), lambda: GenerationParams(num_draft_tokens=MAX_K + 1),
                lambda: Policy("code", k=MAX_K + 1).validate(), lambda: Policy("code", k=0).validate()):
        with pytest.raises(InvalidRequest, match=rf"must be in \[[01], {MAX_K}\]"):
            bad()
