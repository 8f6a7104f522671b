"""The draft distribution q on the wire (DESIGN §3): dense float32 [K, V], or sparse ids +
probs when the draft sampler truncated. Only the workers encode and decode q, so this torch
module stays out of the router's import path (the router forwards the message untouched)."""

from __future__ import annotations

import numpy as np
import torch

from specserve.algorithm.rejection import DenseQ, QProbs, SparseQ
from specserve.errors import InvalidRequest
from specserve.v1 import common_pb2


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
