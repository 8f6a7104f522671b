"""Conversions between protobuf messages and core types. Servicers stay thin: they call
these and the core, nothing else. Bad values raise InvalidRequest (INVALID_ARGUMENT).
Torch-free: the router imports it (the q codec is worker-side, specserve.worker.qcodec)."""

from __future__ import annotations

from collections.abc import Sequence

from specserve.errors import InvalidRequest
from specserve.params import SamplingParams
from specserve.state.prefix import CommittedPrefix
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


def prefix_to_proto(committed: CommittedPrefix, base_len: int) -> common_pb2.Prefix:
    """What to send a worker believed to hold committed[0:base_len]."""
    base_len = min(base_len, len(committed))
    return common_pb2.Prefix(base_len=base_len, base_hash=committed.hash_at(base_len),
                             tokens=committed.ids[base_len:])


def check_token_ids(ids: Sequence[int], vocab_size: int, what: str = "token id") -> None:
    for t in ids:
        if not (0 <= t < vocab_size):
            raise InvalidRequest(f"{what} {t} is outside the vocabulary (size {vocab_size})")
