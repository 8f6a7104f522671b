"""Predicted Outputs in the router: a request's own prediction drafts for it, in process, with
the interface of a draft pool (no network hop: the prediction is already here, and walking it
costs microseconds where a Propose call costs a round trip; ADR 0012)."""

from __future__ import annotations

import time
from collections.abc import Sequence

from services.router.pools import Drafted
from specserve.drafters.prediction import PREDICTION_POOL, PredictionDrafter
from specserve.serving.wire import sampling_from_proto
from specserve.state.prefix import CommittedPrefix
from specserve.v1 import common_pb2, draft_pb2


class PredictionPool:
    """One request's prediction as its draft pool; q is one-hot (absent on the wire)."""

    name = PREDICTION_POOL

    def __init__(self, prediction: Sequence[int], prompt_len: int) -> None:
        self.session = PredictionDrafter(prediction, prompt_len).start()

    async def propose(self, session_id: str, committed: CommittedPrefix, held: dict[str, int], k: int,
                      sampling: common_pb2.SamplingParams, seed: int) -> Drafted | None:
        t0 = time.perf_counter()
        proposal = self.session.propose(committed.ids, k, sampling_from_proto(sampling), seed)
        return Drafted(draft_pb2.ProposeResponse(tokens=proposal.tokens, drafter=PREDICTION_POOL,
                                                 draft_ms=(time.perf_counter() - t0) * 1e3))

    async def release(self, session_id: str, replica: str) -> None:
        self.session.release()
