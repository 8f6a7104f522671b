"""Each session's K, chosen in the engine every round (ADR 0014): from the measured step cost
at the current load and its class's acceptance, within the plan's bounds. Torch-free; pure
functions plus a small decayed table.

A round with K drafts emits E(K) = 1 + Σ_{j=1..K} Π_{i≤j} α_i tokens, where α_i is the
rate at which position i is accepted once positions before it were. It costs what a batch
of B rows like it takes, T(B, K + 1) (worker/cost.py: a + r·B + b·B·n, the price if every
row ran this arm). A plain round emits 1 token for T(B, 1). So

    S(K) = E(K) · T(B, 1) / T(B, K + 1),

and the engine runs the K that maximises S, or plain (K = 0) unless S > 1 + margin. As the
batch grows, b·B·n takes over and long verify rows stop paying: speculation turns itself
off under load, and back on when the load falls.

Example: α = 0.8 everywhere, a = 10, r = 0, b = 1 (ms). At B = 1, S(4) = 3.36 · 11 / 15 =
2.46, and K = 6 is best (S = 2.56). At B = 16, S(4) = 3.36 · 26 / 90 = 0.97, S(1) = 1.8 · 26 /
42 = 1.11: K = 1.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

PRIOR_ALPHA = 0.6  # before a class has rounds: optimistic enough to try, and learnt within a few rounds
DECAY = 0.97  # per round of the class: the rates follow its last ~30 rounds
PROBE_EVERY = 16  # a session held plain drafts once every this many rounds, to keep learning
# A probe asks for blocks for up to this many rounds and waits for none: its rounds run plain
# until a block is there when the step starts, and the first one there is verified. So a
# probe costs its session no wait (waiting for a slow drafter cost a held-plain class 5 % of
# its throughput in bench_engine_loop's seed profile, where plain is best at every load).
PROBE_ROUNDS = 4
# A step's cost per extra token fed, relative to a 1-token step, until the engine's own fit
# can tell (one session alone gives it nothing to separate): verifying 5 tokens was measured
# at 1.2-1.5x one token on the 2-core CPU (DESIGN §7), about 0.1 per token; a GPU's
# memory-bound step is flatter, and the fit takes over as soon as the batches vary.
PRIOR_TOKEN_COST = 0.1
# a tree's other first candidates: how often they hold the target's token where the first does
# not, before a class has tree rounds (a guess, learnt within a few tree rounds)
PRIOR_SIBLING = 0.3


def prior_cost(step_s: float) -> Callable[[int], float]:
    """Step time by tokens per row before a fit: step_s · (1 + PRIOR_TOKEN_COST · (n - 1))."""
    return lambda n: step_s * (1.0 + PRIOR_TOKEN_COST * (n - 1))


def expected_emitted(alphas: Sequence[float], k: int) -> float:
    """E[emitted] for K drafts; positions past the rates known use the last one.

    Example: alphas (0.5,), K = 2 -> 1 + 0.5 + 0.25 = 1.75.
    """
    total, prod = 1.0, 1.0
    for j in range(k):
        prod *= alphas[min(j, len(alphas) - 1)] if alphas else PRIOR_ALPHA
        total += prod
    return total


def speedups(alphas: Sequence[float], k_max: int, cost: Callable[[int], float]) -> dict[int, float]:
    """S(K) for K in 0..k_max; `cost(n)` is the step time with rows of n tokens."""
    plain = cost(1)
    return {k: expected_emitted(alphas, k) * plain / cost(k + 1) for k in range(k_max + 1)}


def choose_k(estimates: dict[int, float], margin: float = 0.05) -> int:
    """The K with the best S (`speedups`), or 0 unless it beats plain by the margin."""
    best = max(estimates, key=lambda k: (estimates[k], -k))
    return best if best > 0 and estimates[best] > 1.0 + margin else 0


@dataclass
class Acceptance:
    """Per-position acceptance of one (class, pool), decayed per round: α_i = accepted at i /
    reached position i."""

    reached: list[float] = field(default_factory=list)
    accepted: list[float] = field(default_factory=list)

    def observe(self, k: int, num_accepted: int) -> None:
        for i in range(len(self.reached)):
            self.reached[i] *= DECAY
            self.accepted[i] *= DECAY
        while len(self.reached) < k:
            self.reached.append(0.0)
            self.accepted.append(0.0)
        for i in range(min(num_accepted + 1, k)):  # positions 0..num_accepted were judged
            self.reached[i] += 1.0
            self.accepted[i] += 1.0 if i < num_accepted else 0.0

    def alphas(self) -> list[float]:
        return [(a + PRIOR_ALPHA) / (r + 1.0) for a, r in zip(self.accepted, self.reached, strict=True)]


@dataclass
class Siblings:
    """How often a token tree's other first candidates held the target's token where the
    first did not, for one (class, pool), decayed per trial as `Acceptance` is. Its prior
    (PRIOR_SIBLING, weight one trial) lets a tree be tried before any was verified."""

    hits: float = 0.0
    trials: float = 0.0

    def observe(self, hit: bool) -> None:
        self.hits = self.hits * DECAY + (1.0 if hit else 0.0)
        self.trials = self.trials * DECAY + 1.0

    def rate(self) -> float:
        return (self.hits + PRIOR_SIBLING) / (self.trials + 1.0)
