"""Conversions between protobuf messages and core types. Servicers stay thin: they call
these and the core, nothing else. Bad values raise InvalidRequest (INVALID_ARGUMENT)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from specserve.errors import InvalidRequest
from specserve.params import MAX_K
from specserve.prefix import CommittedPrefix
from specserve.rejection import DenseQ, QProbs, SparseQ
from specserve.sampling import SamplingParams
from specserve.v1 import common_pb2


def sampling_from_proto(msg: common_pb2.SamplingParams) -> SamplingParams:
    return SamplingParams(
        temperature=float(msg.temperature),
        top_k=int(msg.top_k),
        top_p=float(msg.top_p) if msg.HasField("top_p") else 1.0,
        banned_token_ids=tuple(int(t) for t in msg.banned_token_ids),
    )


def sampling_to_proto(sp: SamplingParams) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams(
        temperature=sp.temperature, top_k=sp.top_k, banned_token_ids=list(sp.banned_token_ids)
    )
    if sp.top_p < 1.0:
        msg.top_p = sp.top_p
    return msg


def q_to_proto(q: QProbs) -> common_pb2.DraftProbs:
    if q is None:
        return common_pb2.DraftProbs()
    if isinstance(q, DenseQ):
        probs = q.probs.float().contiguous().numpy().astype("<f4")
        return common_pb2.DraftProbs(dense=common_pb2.DenseProbs(vocab_size=probs.shape[1], probs=probs.tobytes()))
    ids = q.ids.numpy().astype("<i4")
    return common_pb2.DraftProbs(sparse=common_pb2.SparseProbs(
        width=ids.shape[1], ids=ids.tobytes(), probs=q.probs.float().numpy().astype("<f4").tobytes()))


def q_from_proto(msg: common_pb2.DraftProbs, k: int, vocab_size: int) -> QProbs:
    form = msg.WhichOneof("form")
    if form is None:
        return None
    if form == "dense":
        if msg.dense.vocab_size != vocab_size or len(msg.dense.probs) != 4 * k * vocab_size:
            raise InvalidRequest(
                f"dense q must be {k} x {vocab_size} float32 ({4 * k * vocab_size} bytes), "
                f"got vocab_size {msg.dense.vocab_size} and {len(msg.dense.probs)} bytes")
        arr = np.frombuffer(msg.dense.probs, dtype="<f4").reshape(k, vocab_size)
        return DenseQ(torch.from_numpy(arr.copy()))
    w = msg.sparse.width
    if len(msg.sparse.ids) != 4 * k * w or len(msg.sparse.probs) != 4 * k * w:
        raise InvalidRequest(f"sparse q must hold {k} x {w} ids and probs")
    ids = np.frombuffer(msg.sparse.ids, dtype="<i4").reshape(k, w).astype(np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        raise InvalidRequest("sparse q has token ids outside the vocabulary")
    probs = np.frombuffer(msg.sparse.probs, dtype="<f4").reshape(k, w)
    return SparseQ(torch.from_numpy(ids), torch.from_numpy(probs.copy()))


def prefix_to_proto(committed: CommittedPrefix, base_len: int) -> common_pb2.Prefix:
    """What to send a worker believed to hold committed[0:base_len]."""
    base_len = min(base_len, len(committed))
    return common_pb2.Prefix(base_len=base_len, base_hash=committed.hash_at(base_len),
                             tokens=committed.ids[base_len:])


def check_k(k: int) -> int:
    if not (0 <= k <= MAX_K):
        raise InvalidRequest(f"k must be in [0, {MAX_K}], got {k}")
    return k


def check_token_ids(ids: Sequence[int], vocab_size: int, what: str = "token id") -> None:
    for t in ids:
        if not (0 <= t < vocab_size):
            raise InvalidRequest(f"{what} {t} is outside the vocabulary (size {vocab_size})")
