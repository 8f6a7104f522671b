"""KV slots: the budget decides how many sessions fit, rollback only moves a length, freed
slots are reused, and prefill chunks are cut at fixed absolute positions."""

import pytest
import torch

from specserve.errors import SpecserveError
from specserve.models.kv_slots import (
    ContextTooLong,
    KVBudgetExhausted,
    KVLayout,
    KVSlots,
    prefill_chunks,
)

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4)  # 2*2*2*4*4 = 128 bytes/token


def test_budget_in_bytes_sets_the_slot_count():
    assert LAYOUT.bytes_per_token == 128
    kv = KVSlots(LAYOUT, max_len=10, budget_bytes=128 * 10 * 3 + 127)
    assert kv.num_slots == 3 and kv.nbytes == 3 * 1280
    assert kv.keys[0].shape == (3, 2, 10, 4)
    assert KVLayout(1, 1, 4, torch.bfloat16).bytes_per_token == 16


def test_budget_below_one_slot_is_refused():
    with pytest.raises(ValueError, match="holds no session"):
        KVSlots(LAYOUT, max_len=10, budget_bytes=1279)
    with pytest.raises(ValueError, match="give budget_bytes"):
        KVSlots(LAYOUT, max_len=10)


def test_a_budget_and_a_session_count_give_the_smaller():
    assert KVSlots(LAYOUT, max_len=10, budget_bytes=5000, num_slots=2).num_slots == 2  # 3 would fit
    assert KVSlots(LAYOUT, max_len=10, budget_bytes=2600, num_slots=8).num_slots == 2  # the budget caps


def test_exhaustion_raises_a_domain_error_and_free_slots_are_reused():
    kv = KVSlots(LAYOUT, max_len=8, num_slots=2)
    assert kv.allocate("a") == 0 and kv.allocate("b") == 1
    with pytest.raises(KVBudgetExhausted) as err:
        kv.allocate("c")
    assert isinstance(err.value, SpecserveError)  # mapped to RESOURCE_EXHAUSTED by the worker
    assert kv.free("a") and not kv.free("a")
    assert kv.allocate("c") == 0 and kv.length("c") == 0
    with pytest.raises(ValueError, match="already holds"):
        kv.allocate("c")


def test_rollback_moves_the_length_and_touches_no_tensor():
    kv = KVSlots(LAYOUT, max_len=8, num_slots=1)
    slot = kv.allocate("s")
    k = torch.arange(5 * 2 * 4, dtype=torch.float32).view(5, 2, 4)  # [n, heads, D]
    kv.write(0, torch.full((5,), slot), torch.arange(5), k, -k)
    kv.append("s", [10, 11, 12, 13, 14])
    before = kv.keys[0].clone()
    ptr = kv.keys[0].data_ptr()
    assert kv.rollback("s", 2) == 3
    assert kv.length("s") == 2 and list(kv.ids[kv.slot("s")]) == [10, 11]
    assert torch.equal(kv.keys[0], before) and kv.keys[0].data_ptr() == ptr
    keys, values = kv.read(0, slot, kv.length("s"))
    assert keys.shape == (2, 2, 4) and torch.equal(keys, k[:2].transpose(0, 1))
    assert torch.equal(values, -k[:2].transpose(0, 1))
    with pytest.raises(ValueError, match="caches 2"):
        kv.rollback("s", 3)  # rollback never grows a session


def test_room_is_checked_against_the_slot_capacity():
    kv = KVSlots(LAYOUT, max_len=8, num_slots=1)
    kv.allocate("s")
    kv.append("s", range(6))
    kv.check_room("s", 2)
    with pytest.raises(ContextTooLong, match="KV slot of 8"):
        kv.check_room("s", 3)
    with pytest.raises(KeyError, match="allocate it first"):
        kv.length("nobody")


@pytest.mark.parametrize(("start", "n", "chunk", "sizes"), [
    (0, 20, 8, [8, 8, 4]),
    (5, 20, 8, [3, 8, 8, 1]),  # cuts at positions 8, 16, 24
    (8, 8, 8, [8]),
    (3, 2, 8, [2]),
    (0, 0, 4, []),
    (7, 3, 1, [1, 1, 1]),
])
def test_prefill_chunks_cut_at_multiples_of_the_chunk(start, n, chunk, sizes):
    ids = list(range(100, 100 + n))
    pieces = prefill_chunks(start, ids, chunk)
    assert [len(p) for p in pieces] == sizes
    assert [t for p in pieces for t in p] == ids
    ends = [start + sum(sizes[: i + 1]) for i in range(len(sizes))]
    assert all(e % chunk == 0 for e in ends[:-1])


def test_prefill_chunk_must_be_positive():
    with pytest.raises(ValueError):
        prefill_chunks(0, [1, 2], 0)


def test_reconcile_keeps_the_agreeing_prefix_and_leaves_one_token_to_feed():
    kv = KVSlots(LAYOUT, max_len=16, num_slots=1)
    kv.allocate("s")
    kv.append("s", [1, 2, 3, 4, 9, 9])  # 9, 9: provisional drafts
    assert kv.reconcile("s", [1, 2, 3, 4, 5]) == 2
    assert list(kv.ids[kv.slot("s")]) == [1, 2, 3, 4]  # feed [5]
    assert kv.reconcile("s", [1, 2, 3, 4]) == 0
    assert list(kv.ids[kv.slot("s")]) == [1, 2, 3]  # nothing new: the last token is fed again
    assert kv.reconcile("s", [7, 8]) == 3 and kv.length("s") == 0  # disagreement at 0


def test_common_prefix_agrees_with_the_position_by_position_walk():
    """The reconcile's common prefix: the usual case (cached is a prefix of the sequence,
    compared in C) and every other shape (a divergence, cached longer, an UNKNOWN position, a
    tuple) give what the position-by-position walk gives."""
    from specserve.models.kv_slots import UNKNOWN, common_prefix

    def walk(a, b):  # the first position where they part, or the shorter's length
        return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))

    seq = list(range(100, 140))
    cases = [(seq[:10], seq), (seq, seq), (seq, seq[:10]), ([], seq), (seq[:5] + [7] + seq[6:12], seq),
             (seq[:8] + [UNKNOWN, UNKNOWN], seq), (seq[:10], tuple(seq)), (seq[:3], [])]
    for cached, ids in cases:
        assert common_prefix(cached, ids) == walk(cached, ids), (cached, ids)
