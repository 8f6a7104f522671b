"""Predicted Outputs: the client's expected output as the draft. The drafter walks the
committed output along the prediction: while they agree it proposes the prediction's next
tokens; after a divergence (an edit) it finds its place again the way the n-gram drafter
does, by the last few committed tokens, taking the occurrence nearest to where the walk
expected to be. Its q is one-hot (deterministic), so rejection sampling stays exact.

The block grows with the evidence: 1 + 2 x (output tokens in step since the last resync,
beyond the first), capped at K. An output that does not follow the prediction (a chat answer that quotes none of
it) then costs one rejected token per round, not K; one that does reaches K in three rounds.

Example (prediction `a b c d e f`, k = 3):
    output `a b`          -> proposes `c d e`  (in step, 2 tokens of evidence)
    output `a b X`        -> proposes nothing  (`X` is not in the prediction)
    output `a b X d`      -> proposes `e`      (`d` found at index 3: back in step, on 1 token)
    output `a b X d e`    -> proposes `f`      (in step; the prediction ends there)
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from specserve.drafters.base import DraftProposal, check_ngram_sizes, until_banned
from specserve.errors import InvalidRequest
from specserve.params import SamplingParams

PREDICTION_POOL = "prediction"  # the draft_pool name of a request's own prediction
PREDICTION_K = 16  # draft tokens per round from a prediction (measured in ADR 0012)


# -- the request side (torch-free: the router validates, plans and reports with these) --------

def check_prediction(prediction: Sequence[int], pinned_pool: str | None, context_len: int) -> None:
    """INVALID_ARGUMENT for a prediction longer than the context, or the prediction pool
    pinned without one."""
    if len(prediction) > context_len:
        raise InvalidRequest(f"the prediction has {len(prediction)} tokens; the limit is the context length "
                             f"({context_len})")
    if pinned_pool == PREDICTION_POOL and not prediction:
        raise InvalidRequest(f"draft_pool {PREDICTION_POOL!r} needs a prediction (the expected output text)")


def drafts_from_prediction(prediction: Sequence[int], pinned_pool: str | None, pinned_k: int | None) -> bool:
    """A request with a prediction drafts from it unless it pins another pool or K = 0; the
    prediction is the request's own, so no class policy or statistics apply (ADR 0012)."""
    return bool(prediction) and pinned_pool in (None, PREDICTION_POOL) and pinned_k != 0


def prediction_usage(pool: str | None, drafted: int, accepted: int) -> tuple[int, int]:
    """(accepted, rejected) prediction tokens, OpenAI's usage fields, of a request whose
    rounds drafted and accepted these many tokens: (0, 0) unless it drafted from its prediction."""
    return (accepted, drafted - accepted) if pool == PREDICTION_POOL else (0, 0)


class PredictionDrafter:
    """One request's prediction; `prompt_len` committed tokens precede the output."""

    name = PREDICTION_POOL

    def __init__(self, prediction: Sequence[int], prompt_len: int, vocab_size: int = 0, min_n: int = 1,
                 max_n: int = 4) -> None:
        check_ngram_sizes(min_n, max_n)
        self.prediction = np.asarray(list(prediction), dtype=np.int64)
        self.prompt_len = prompt_len
        self.vocab_size = vocab_size  # the Drafter protocol's (the engine checks it against the target's)
        self.min_n = min_n
        self.max_n = max_n
        self.ends_of = ends_by_token(self.prediction)

    def start(self) -> PredictionSession:
        return PredictionSession(self)


class PredictionSession:
    """The walk is memoised: (output walked, cursor, in step). A prefix that does not extend
    the walked output (a take-over, a cancelled tail) is walked again from the start, so the
    proposal is a pure function of the committed sequence."""

    def __init__(self, drafter: PredictionDrafter) -> None:
        self.d = drafter
        self.release()

    def propose(self, token_ids: Sequence[int], k: int, sampling: SamplingParams, seed: int) -> DraftProposal:
        cursor = self.advance(token_ids[self.d.prompt_len :])
        if cursor is None or k <= 0:
            return DraftProposal([], None)
        tokens = [int(t) for t in self.d.prediction[cursor : cursor + min(k, 1 + 2 * self.run)]]
        return DraftProposal(until_banned(tokens, set(sampling.banned_token_ids)), None)

    def guess_next(self, token_ids: Sequence[int], sampling: SamplingParams, seed: int) -> int | None:
        got = self.propose(token_ids, 1, sampling, seed).tokens
        return got[0] if got else None

    def release(self) -> None:
        self.walked: list[int] = []
        self.cursor = 0  # index in the prediction where the next output token is expected
        self.in_step = True  # False: the last tokens were not found in the prediction
        self.run = 0  # output tokens in step with the prediction since the last resync

    def advance(self, output: Sequence[int]) -> int | None:
        """The cursor after walking `output` (the committed generated tokens); None while
        the output is out of step with the prediction."""
        n = len(self.walked)
        if len(output) < n or list(output[:n]) != self.walked:
            self.release()
            n = 0
        for i in range(n, len(output)):
            self.walked.append(int(output[i]))
            self.cursor, self.in_step, self.run = step(self.d.prediction, self.walked, self.cursor,
                                                       self.in_step, self.run, self.d.min_n, self.d.max_n,
                                                       self.d.ends_of)
        return self.cursor if self.in_step else None


def step(prediction: np.ndarray, output: list[int], cursor: int, in_step: bool, run: int, min_n: int,
         max_n: int, ends_of: dict[int, np.ndarray] | None = None) -> tuple[int, bool, int]:
    """(cursor, in step, run) after output[-1]: one past it while in step, else re-synchronised
    near where the walk expected to be; out of step (the cursor still
    advancing with the output) when the last tokens occur nowhere in the prediction."""
    if in_step and cursor < len(prediction) and prediction[cursor] == output[-1]:
        return cursor + 1, True, run + 1
    found = resync(prediction, output, cursor + 1, min_n, max_n, ends_of)
    # a single matching token is weak evidence (common tokens occur everywhere): run = n - 1
    return (found[0], True, found[1] - 1) if found is not None else (cursor + 1, False, 0)


def ends_by_token(prediction: np.ndarray) -> dict[int, np.ndarray]:
    """token -> the positions one past each of its occurrences, ascending (built once per
    request, so a resync looks only where the output's last token occurs)."""
    order = np.argsort(prediction, kind="stable")
    tokens, first = np.unique(prediction[order], return_index=True)
    return dict(zip(tokens.tolist(), np.split(order + 1, first[1:]), strict=True))


def resync(prediction: np.ndarray, output: list[int], expected: int, min_n: int, max_n: int,
           ends_of: dict[int, np.ndarray] | None = None) -> tuple[int, int] | None:
    """(one past, n) for the occurrence of the output's last n tokens (longest n first) in
    the prediction whose end is nearest to `expected`; None when none occurs. `ends_of`:
    `ends_by_token(prediction)`, when the caller keeps it."""
    ends = ends_of.get(output[-1]) if ends_of is not None else np.flatnonzero(prediction == output[-1]) + 1
    if ends is None or not ends.size:
        return None
    for n in range(min(max_n, len(output), len(prediction)), min_n - 1, -1):
        hit = ends[ends >= n]  # occurrences of the last token with room for n - 1 before it
        for j in range(2, n + 1):
            hit = hit[prediction[hit - j] == output[-j]]
        if hit.size:
            return int(hit[np.argmin(np.abs(hit - expected))]), n
    return None
