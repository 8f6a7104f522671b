"""What a row costs at the current load (ADR 0013), torch-free.

The worker fits its batches' wall time as T = a + r·B + b·N (B rows, N tokens fed), by least
squares over the recent batches (exponentially decayed). A row of n tokens in a batch of B
rows is then charged what a batch of B rows like it would take: a + r·B + b·B·n. That is
the round time a session would see if every session ran its arm, at this batch size. So a
plain probe among speculative rows is priced as a plain batch, and a K-token verify as a
batch of (K+1)-token rows. The controller compares exactly those (S(K) = E(K)·T0 / T(K)).
As B grows, b·B·n takes over and long verify rows cost more relative to plain steps.

Example, figures of the shape fitted on a 2-core CPU (a ≈ 9, r ≈ 0.8, b ≈ 0.33 ms): at B = 1
a K=4 verify costs 1.2x a plain step; at B = 16, 1.8x.
"""

from __future__ import annotations

import numpy as np

DECAY = 0.98  # per batch: the fit follows the last ~50 batches
MIN_BATCHES = 8


class CostModel:
    def __init__(self, decay: float = DECAY, min_batches: int = MIN_BATCHES) -> None:
        self.decay = decay
        self.min_batches = min_batches
        self.xtx = np.zeros((3, 3))
        self.xty = np.zeros(3)
        self.seen = 0
        self.coef: np.ndarray | None = None  # (a, r, b) in seconds

    def observe(self, rows: int, tokens: int, seconds: float) -> None:
        x = np.array([1.0, rows, tokens])
        self.xtx = self.decay * self.xtx + np.outer(x, x)
        self.xty = self.decay * self.xty + x * seconds
        self.seen += 1
        if self.seen >= self.min_batches:
            self.coef = self._solve()

    def _solve(self) -> np.ndarray | None:
        """Non-negative coefficients, or None when the batches seen cannot separate them. A
        batch size that never changed (one session alone) cannot be told from the constant:
        then the fit is a + b·N, the rows' term folded into a."""
        if np.linalg.cond(self.xtx) > 1e10:
            return self._fit((0, 2))
        coef = np.linalg.solve(self.xtx, self.xty)
        if coef.min() >= 0:
            return coef
        # a negative term: drop it and refit the others (the constant always stays)
        return self._fit(tuple([0] + [i for i in (1, 2) if coef[i] >= 0]))

    def _fit(self, keep: tuple[int, ...]) -> np.ndarray | None:
        """The fit over the terms `keep` alone (the others 0), or None where they too cannot
        be separated; negative terms are clipped to 0."""
        sub = self.xtx[np.ix_(keep, keep)]
        if np.linalg.cond(sub) > 1e10:
            return None
        out = np.zeros(3)
        out[list(keep)] = np.maximum(np.linalg.solve(sub, self.xty[list(keep)]), 0.0)
        return out

    def row_cost(self, rows: int, row_tokens: float, batch_s: float) -> float:
        """Seconds a batch of `rows` rows of `row_tokens` tokens takes; the batch's own wall
        time while the fit is not ready."""
        if self.coef is None:
            return batch_s
        a, r, b = self.coef
        return float(a + r * rows + b * rows * row_tokens)
