"""The committed sequence as a worker or the router holds it, with a hash chain so a
worker can check that what it cached is really the committed prefix (DESIGN §3, inv. 2).

A call carries (base_len, base_hash, tokens): "you hold committed[0:base_len], whose chain
hash is base_hash; here is the rest". A worker that holds less, or a different prefix,
raises NeedsFullPrefix (gRPC FAILED_PRECONDITION) and the caller resends with base_len = 0.
"""

from __future__ import annotations

from collections.abc import Sequence

from specserve.algorithm.rng import GOLDEN, MASK64, mix64
from specserve.errors import NeedsFullPrefix


def chain(h: int, tokens: Sequence[int]) -> int:
    """Extend a chain hash by tokens; the empty prefix hashes to 0."""
    for t in tokens:
        h = mix64((h ^ ((int(t) + 1) * GOLDEN)) & MASK64)
    return h


class CommittedPrefix:
    """Committed token ids plus the chain hash at every length."""

    def __init__(self, ids: Sequence[int] = ()) -> None:
        self.ids: list[int] = []
        self.hashes: list[int] = [0]
        self.extend(ids)

    def __len__(self) -> int:
        return len(self.ids)

    def hash_at(self, n: int) -> int:
        return self.hashes[n]

    def extend(self, tokens: Sequence[int]) -> None:
        h = self.hashes[-1]
        for t in tokens:
            h = chain(h, (t,))
            self.ids.append(int(t))
            self.hashes.append(h)

    def crop(self, n: int) -> None:
        """Keep the first n ids."""
        del self.ids[n:]
        del self.hashes[n + 1 :]

    def apply(self, base_len: int, base_hash: int, tokens: Sequence[int]) -> list[int]:
        """Reconcile to a caller's committed sequence; returns it (ids)."""
        if base_len > len(self.ids) or self.hashes[base_len] != base_hash:
            raise NeedsFullPrefix(
                f"worker holds {len(self.ids)} committed tokens that do not match the caller's "
                f"first {base_len}: resend the full prefix"
            )
        self.crop(base_len)
        self.extend(tokens)
        return self.ids
