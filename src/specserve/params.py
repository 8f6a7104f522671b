"""Request parameters, validated on construction. Torch-free, so the router can import it."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from specserve.errors import InvalidRequest

MAX_K = 32
MAX_SEED = 1 << 64


def check_k(k: int, what: str = "K (num_draft_tokens)", low: int = 0) -> int:
    """The one K limit: `k` in [low, MAX_K], else InvalidRequest naming `what`.

    Example: check_k(33) raises "K (num_draft_tokens) must be in [0, 32], got 33"."""
    if not low <= k <= MAX_K:
        raise InvalidRequest(f"{what} must be in [{low}, {MAX_K}], got {k}")
    return k


@dataclass(frozen=True)
class SamplingParams:
    """How a token is drawn. temperature == 0 means greedy (argmax)."""

    temperature: float = 0.0
    top_k: int = 0  # 0 disables top-k
    top_p: float = 1.0  # 1.0 disables top-p
    banned_token_ids: tuple[int, ...] = field(default_factory=tuple)
    # The coupled sampler (ADR 0027), at T > 0: the target's token at each position is the
    # Gumbel-max draw of the position's noise, and a draft token is kept exactly when it equals
    # it, so the tokens are those of plain decoding with the seed whatever the drafts. Not a
    # client's field: the engine sets it for a request whose client chose the seed (`coupled_for`).
    coupled: bool = False

    def __post_init__(self) -> None:
        if not (self.temperature >= 0.0) or self.temperature > 100.0:
            raise InvalidRequest(f"temperature must be in [0, 100], got {self.temperature}")
        if self.top_k < 0:
            raise InvalidRequest(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise InvalidRequest(f"top_p must be in (0, 1], got {self.top_p}")
        if any(t < 0 for t in self.banned_token_ids):
            raise InvalidRequest("banned_token_ids must be non-negative token ids")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def check_vocab(self, vocab_size: int) -> None:
        bad = [t for t in self.banned_token_ids if t >= vocab_size]
        if bad:
            raise InvalidRequest(f"banned token id {bad[0]} is outside the vocabulary (size {vocab_size})")
        if len(set(self.banned_token_ids)) >= vocab_size:
            raise InvalidRequest("banned_token_ids bans the whole vocabulary")


def coupled_for(sampling: SamplingParams, seeded: bool) -> SamplingParams:
    """The sampling a request's rows run with (ADR 0027): coupled where its client chose the
    seed and it samples (its tokens must be fixed by the seed alone), else not."""
    coupled = seeded and not sampling.greedy
    return sampling if sampling.coupled == coupled else replace(sampling, coupled=coupled)


@dataclass(frozen=True)
class GenerationParams:
    max_tokens: int = 64
    sampling: SamplingParams = field(default_factory=SamplingParams)
    num_draft_tokens: int = 4  # K; 0 = plain decoding
    stop: tuple[str, ...] = ()
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.max_tokens <= 0:
            raise InvalidRequest(f"max_tokens must be >= 1, got {self.max_tokens}")
        check_k(self.num_draft_tokens)
        if any(not s for s in self.stop):
            raise InvalidRequest("stop strings must be non-empty")
        if self.seed is not None and not (0 <= self.seed < MAX_SEED):
            raise InvalidRequest(f"seed must be in [0, 2**64), got {self.seed}")


