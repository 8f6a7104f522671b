"""Counter-based randomness keyed by (seed, absolute position, purpose).

Every random number specserve draws is a pure function of those three values, so a retried
or resumed round reproduces the same tokens, and discarded work (rejected drafts, a failed
commit) consumes nothing from a stream (DESIGN §3, invariant 5). The mixer is SplitMix64's
finaliser applied in a chain; it is vectorised over positions with numpy's wrapping uint64.
"""

from __future__ import annotations

import secrets
from enum import IntEnum
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # (torch only where the device's uniforms are drawn: this module stays torch-free)
    from torch import Tensor


class Purpose(IntEnum):
    DRAFT = 1  # retired (ADR 0027): a drafter draws with the position's noise (BONUS); the value stays reserved
    ACCEPT = 2  # the accept/reject coin of a draft token (rejection sampling)
    RECOVER = 3  # the recovered token at the first rejection (rejection sampling)
    # the position's noise (ADR 0027): its 53 bits key the Gumbel noise of every fresh sample at
    # the position: the target's (a plain step, a bonus token, every token of a seeded row) and
    # a drafter's proposal or guess there
    BONUS = 4
    SIBLING = 5  # a token tree's second and later candidates at one position (algorithm/tree.py)
    SIBLING_DRAFT = 6  # retired (ADR 0027): a sampled tree's siblings are the position's Gumbel top-k


# SplitMix64 (Steele, Lea and Flood, 2014): the golden-ratio increment and the finaliser's two
# multipliers. The one mixer of the project: `mix64` for one integer (the committed prefix's
# hash chain, state/prefix.py), `_mix` vectorised over numpy's wrapping uint64 (the uniforms).
GOLDEN = 0x9E3779B97F4A7C15
M1 = 0xBF58476D1CE4E5B9
M2 = 0x94D049BB133111EB
MASK64 = (1 << 64) - 1
_GOLDEN, _M1, _M2 = np.uint64(GOLDEN), np.uint64(M1), np.uint64(M2)


def mix64(x: int) -> int:
    """SplitMix64's finaliser of one 64-bit integer (`_mix` of one element, as a Python int)."""
    x ^= x >> 30
    x = (x * M1) & MASK64
    x ^= x >> 27
    x = (x * M2) & MASK64
    return x ^ (x >> 31)


def _mix(x: np.ndarray) -> np.ndarray:
    x = x ^ (x >> np.uint64(30))
    x = x * _M1
    x = x ^ (x >> np.uint64(27))
    x = x * _M2
    out: np.ndarray = x ^ (x >> np.uint64(31))
    return out


def _as_u64(x: int | np.ndarray | list[int]) -> np.ndarray:
    if isinstance(x, np.ndarray) and x.dtype != object:
        return x.astype(np.uint64)
    return np.asarray([int(v) & MASK64 for v in np.ravel(np.asarray(x, dtype=object))],
                      dtype=np.uint64).reshape(np.shape(x))


def uniform(
    seed: int | np.ndarray, positions: int | np.ndarray | list[int], purpose: Purpose
) -> np.ndarray:
    """Uniform float64 numbers in [0, 1): one per (seed, position) pair, broadcast together."""
    with np.errstate(over="ignore"):
        s = _as_u64(seed)
        pos = _as_u64(positions)
        tag = np.uint64(int(purpose))
        h = _mix(s + _GOLDEN)
        h = _mix(h ^ (pos * _GOLDEN + tag))
        h = _mix(h + tag * _M1)
        return (h >> np.uint64(11)).astype(np.float64) * (1.0 / 9007199254740992.0)


def noise_keys(seed: int | np.ndarray, positions: int | np.ndarray | list[int]) -> np.ndarray:
    """int64 keys of the positions' noise (ADR 0027): the 53 bits of uniform(seed, position,
    BONUS) as integers, exactly `uniform(...) * 2**53` (so a device that was handed the uniform
    derives the same key: algorithm/sampling.py `keys_of`)."""
    return (uniform(seed, positions, Purpose.BONUS) * 9007199254740992.0).astype(np.int64)


def exponentials_reference(keys: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """The position noise of tokens (ADR 0027): standard exponentials [..., E] float64 of
    `keys` [...] (noise_keys) and token `ids` [..., E] (the slow reference of
    algorithm/sampling.py `exponentials`, whose hashes must be these bits): per key, SplitMix64's
    own stream from the mixed key, a token's number at its id, mapped to the open interval
    (0, 1) and through -log u."""
    with np.errstate(over="ignore"):
        state = _mix(np.asarray(keys).astype(np.uint64) + _GOLDEN)
        x = _mix(state[..., None] + np.asarray(ids).astype(np.uint64) * _GOLDEN)
        u = ((x >> np.uint64(11)).astype(np.float64) + 0.5) * (1.0 / 9007199254740992.0)
    out: np.ndarray = -np.log(u)
    return out


def fresh_seed() -> int:
    """A random 63-bit seed for a request that did not give one (it is reported back)."""
    return secrets.randbits(63)



def signed64(x: int) -> int:
    """A 64-bit pattern as the int64 torch stores it (two's complement)."""
    x &= MASK64
    return x - (1 << 64) if x >= 1 << 63 else x


# SplitMix64's constants as torch's int64 holds them: int64 addition and multiplication wrap
# modulo 2**64 on every device, so the uint64 mixer runs as is on tensors, with the right
# shifts made logical by a mask (`shr`). Torch-free here: the functions take any int64 tensor.
S_GOLDEN, S_M1, S_M2 = signed64(GOLDEN), signed64(M1), signed64(M2)


def shr(x: Tensor, n: int) -> Tensor:
    """Logical right shift of an int64 tensor (torch's >> is arithmetic: the sign bit spreads)."""
    return (x >> n) & ((1 << (64 - n)) - 1)


def mix_int64(x: Tensor) -> Tensor:
    """`_mix` on an int64 tensor: the same 64 bits, on the tensor's device."""
    x = x ^ shr(x, 30)
    x = x * S_M1
    x = x ^ shr(x, 27)
    x = x * S_M2
    return x ^ shr(x, 31)


def uniform_on_device(seed: Tensor, positions: Tensor, purpose: Purpose) -> Tensor:
    """`uniform` computed where `seed` and `positions` are (int64 tensors, broadcast
    together): the same float64 numbers bit for bit, as a pure tensor function (no host read,
    no branch on data), so a sampled verdict whose positions the device computed (a round
    chained on the device, ADR 0025) can draw inside a CUDA graph. Seeds are the 64-bit
    patterns `uniform` takes, stored as int64 (`signed64`)."""
    tag = int(purpose)
    h = mix_int64(seed + S_GOLDEN)
    h = mix_int64(h ^ (positions * S_GOLDEN + tag))
    h = mix_int64(h + signed64(tag * M1))
    return shr(h, 11).double() * (1.0 / 9007199254740992.0)
