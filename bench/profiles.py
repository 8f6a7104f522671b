"""Simulated device profiles (ADR 0014): what a target step and a draft step cost on a GPU,
as data, for benchmarks that run a small real model on this CPU and pad each step up to the
profile's time.

- `seed`: measured in the first wave with HF eager on an A10G. A Qwen3-4B target pass takes
  30 ms and a Qwen3-0.6B draft token 22 ms, flat in the batch (HF eager is launch-bound at
  these sizes).
- `h100`: derived from public figures for an 8B-class bf16 target (Llama-3-8B shape: 32
  layers, 8 KV heads × 128) on an H100-class GPU, assuming 75 % of 3.35 TB/s and 60 % of
  990 dense TFLOPS are achieved:
  - weights: 16 GB / 2.51 TB/s = 6.4 ms a pass;
  - compute: 16 GFLOP a token / 594 TFLOPS = 0.027 ms a token in the batch;
  - KV: 131 kB a cached token / 2.51 TB/s = 0.052 µs;
  - launch and sampling: 0.3 ms.

  The draft is a 0.6B-class model on an A10G-class GPU (600 GB/s, 75 %): 1.2 GB / 450 GB/s
  = 2.7 ms a step, plus 0.02 ms a token in its batch.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Profile:
    name: str
    weights_ms: float  # target: reading the weights, once a pass (memory-bound floor)
    token_ms: float  # target: compute per token fed in the batch
    kv_us: float  # target: reading one cached token's KV, per pass
    fixed_ms: float  # target: launches, sampling, the host transfer
    draft_step_ms: float  # draft: one autoregressive step of its batch
    draft_token_ms: float  # draft: per row in that step

    def target_ms(self, tokens: int, cached: int) -> float:
        """One target step feeding `tokens` tokens over `cached` KV positions in all."""
        return max(self.weights_ms, self.token_ms * tokens) + self.kv_us * cached / 1e3 + self.fixed_ms

    def draft_ms(self, k: int, rows: int = 1) -> float:
        """K draft steps for a batch of `rows` sessions."""
        return k * (self.draft_step_ms + self.draft_token_ms * rows)

    def speculation_bound(self, alpha: float, k: int, rows: int, cached: int, overhead_ms: float = 0.0,
                          width: int = 1, beta: float = 0.0) -> dict:
        """The most a fixed K can gain over plain, in this profile, with bench_engine_loop's
        synthetic pool: each position accepted with probability α; a block drafted after the
        outcome it follows (K draft steps, d each, a session drafted alone); the all-accepted
        branch drafted ahead once the block is sent (the bonus and K more: K + 1 steps), right
        when all K are accepted and the bonus guessed, α^(K + 1). `rows` sessions decode
        together over `cached` KV positions in all; `overhead_ms` is the engine's own time a
        step beside the device (plain and speculative steps alike).

        A session's two verifies are at least a step apart (T_K + o), and its next block is
        there at the end of one only when drafted ahead and not later than that: otherwise
        the drafting waits K d after the outcome, or the ahead block (K + 1) d − (T_K + o)
        more. So, for any schedule, tokens per session per ms are at most
            E(K) / (T_K + o + a · late + (1 − a) · K · d),   E(K) = 1 + α + … + α^K,
        against plain's 1 / (T_0 + o). `held` is the schedule whose steps wait for every
        row's block (the engine's gather on a flat step): a step waits for the slowest of
        `rows` blocks, K d unless every row's came ahead; `held_busy` is its device share.

        Example (`h100`, α 0.7, 16 rows over 768 positions, o = 0): K = 1 -> any 1.41, held
        1.21 at 71 % busy; K = 2 -> any 1.37 (the ahead block is 1.4 ms late), held 1.21.

        A token tree (`width` 2, ADR 0020; the shape the pools draft): two first candidates,
        each followed by its chain to depth K, 2K tokens verified. The second is tried where
        the first was rejected and is right with probability `beta` then, its chain's
        positions with α each: E = E(K) + (1 − α) β E(K − 1). Its branches are drafted as one
        batch of `width` rows (d at `width` rows a step), and the verify feeds 1 + width K
        tokens a row.
        """
        d = self.draft_ms(1, width)
        t0 = self.target_ms(rows, cached) + overhead_ms
        tk = self.target_ms(rows * (width * k + 1), cached) + overhead_ms
        emitted = sum(alpha ** j for j in range(k + 1))
        if width > 1:
            emitted += (1.0 - alpha) * beta * sum(alpha ** j for j in range(k))
        ahead = alpha ** (k + 1)
        late = max(0.0, (k + 1) * d - tk)
        every = ahead ** rows  # every row's block came ahead (and in time)
        held_wait = every * late + (1.0 - every) * k * d
        return {"any": emitted * t0 / (tk + ahead * late + (1.0 - ahead) * k * d),
                "held": emitted * t0 / (tk + held_wait), "held_busy": (tk - overhead_ms) / (tk + held_wait)}


PROFILES = {
    "seed": Profile("seed", weights_ms=30.0, token_ms=0.0, kv_us=0.0, fixed_ms=0.0,
                    draft_step_ms=22.0, draft_token_ms=0.0),
    "h100": Profile("h100", weights_ms=6.4, token_ms=0.027, kv_us=0.052, fixed_ms=0.3,
                    draft_step_ms=2.7, draft_token_ms=0.02),
}


@dataclass(frozen=True)
class StepFit:
    """A target step measured on a device, as a line in the rows it runs: pass_ms + row_ms ×
    rows (the target's `simulated_pass_ms` and `simulated_row_ms`). `measured`: rows -> ms,
    the points it was fitted to."""

    name: str
    pass_ms: float
    row_ms: float
    measured: tuple[tuple[int, float], ...]

    def step_ms(self, rows: int) -> float:
        return self.pass_ms + self.row_ms * rows


def _through(name: str, lo: tuple[int, float], hi: tuple[int, float], *more: tuple[int, float]) -> StepFit:
    slope = (hi[1] - lo[1]) / (hi[0] - lo[0])
    return StepFit(name, lo[1] - slope * lo[0], slope, (lo, *more, hi))


# The 1.1B-class target (TinyLlama's shape, bf16) of ADR 0019 on an H200, plain greedy steps:
# 1.61 ms at 1 session (gpu_check, run 8), 1.81 ms at 16 (8,818 tok/s, same run) and 3.35 ms at 64
# (19,111 tok/s, `bench_engine_loop --device cuda`, issue 52). The line goes through the 1- and
# 64-row points (16 rows: 2.02 ms, 0.21 over the measured step, so the stack is given a slightly
# slower device there); 256 rows (8.65 ms) is extrapolated, not measured.
H200_STEP = _through("h200", (1, 1.61), (64, 3.35), (16, 1.81))
