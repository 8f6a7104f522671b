"""A draft model drafting inside the target's device step (ADR 0025, issue 51 item 3): the
target runs the draft model's K positions in the round that verifies them
(`BatchedTarget.enable_head(model)`, models/draft_step.py), chained on the device where the
lookahead is on. A session whose rows the device step judges (no banned tokens, no
constraint; greedy or sampled) drafts there: its block here is K placeholders
(`DraftBlock.on_device`), delivered at once, and the round reports the drafts. Other sessions
draft on the engine's thread with the same model (`LocalDrafts` over an `HFDrafter`). Chains
only: the engine's offer of a tree is answered with a chain.
"""

from __future__ import annotations

from typing import Any

from specserve.engine.drafting import LocalDrafts
from specserve.engine.eagle_local import OnDeviceSessions, _OnDevice
from specserve.engine.session import DraftBlock


class DeviceDraftModelDrafts(OnDeviceSessions, LocalDrafts):
    def close(self, session_id: str) -> None:
        local = self.sessions.pop(session_id, None)
        if local is not None and not isinstance(local, _OnDevice):
            local.draft.release()

    def _propose(self, session_id: str, s: Any, k: int, width: int = 1) -> None:
        if not isinstance(s, _OnDevice):
            super()._propose(session_id, s, k, width)
            return
        if k > 0 and self.deliver is not None:
            n = len(s.prefix)
            self.deliver(DraftBlock(session_id, n, s.prefix.hash_at(n), (0,) * k, on_device=True))
