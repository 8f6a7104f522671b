"""The one sampling transform shared by the draft and the target.

`logits_to_probs` turns raw logits into the distribution a token is drawn from. The draft
(q) and the target (p) must use exactly this function with the same parameters, otherwise
rejection sampling is silently biased (DESIGN §3, invariant 4).
"""

from __future__ import annotations

import torch

from specserve.algorithm.rng import S_GOLDEN, S_M1, S_M2, mix_int64
from specserve.device import to_device
from specserve.params import SamplingParams

__all__ = ["SamplingParams", "coupled_among", "coupled_tokens", "draw", "exponentials", "greedy_tokens", "keys_of",
           "logits_to_probs", "mask_logits", "truncate_mass"]


def mask_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Banned tokens and top-k/top-p truncation as -inf, temperature applied.

    logits: [..., V] -> [..., V] float32 (a new tensor; the input is not modified).
    """
    x = logits.float().clone()
    if params.banned_token_ids:
        # index_fill_, not `x[..., ids] = v`: on CUDA that index_put waits for the GPU (seen on an H100)
        x.index_fill_(-1, to_device(params.banned_token_ids, x.device), float("-inf"))
    if params.greedy:
        return x
    x = x / params.temperature
    vocab = x.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))  # ties with the k-th value are kept
    if params.top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        sorted_p = torch.softmax(sorted_x, dim=-1)
        mass_before = torch.cumsum(sorted_p, dim=-1) - sorted_p
        drop_sorted = mass_before >= params.top_p  # keep the token that crosses top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return x


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [..., V] -> probabilities [..., V] (float32) under `params`.

    Greedy gives a one-hot on the argmax (first index on ties, as torch.argmax and
    transformers' greedy search do).
    """
    x = mask_logits(logits, params)
    if params.greedy:
        return torch.nn.functional.one_hot(x.argmax(dim=-1), x.shape[-1]).float()
    return torch.softmax(x, dim=-1)


def truncate_mass(probs: torch.Tensor, mass: float, max_entries: int) -> torch.Tensor:
    """The draft's own truncation before it samples (DESIGN §3: "sparse when the draft sampler
    truncates"): the smallest set of most likely tokens that covers `mass` of `probs`, at most
    `max_entries` of them, renormalised; zero elsewhere. Exact for rejection sampling because
    the draft samples from, and sends, this q. mass >= 1 and max_entries <= 0 disable each.

    probs: [..., V] -> [..., V] float32. Ties are broken by token id (stable sort), so the
    kept set is a pure function of probs.

    Example: probs [0.6, 0.3, 0.1], mass 0.8 -> [2/3, 1/3, 0] (0.6 alone does not cover 0.8).
    """
    vocab = probs.shape[-1]
    if mass >= 1.0 and not 0 < max_entries < vocab:
        return probs
    sorted_p, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    before = torch.cumsum(sorted_p, dim=-1) - sorted_p
    keep_sorted = before < mass * sorted_p.sum(-1, keepdim=True)  # the token that crosses `mass` stays
    if 0 < max_entries < vocab:
        keep_sorted[..., max_entries:] = False
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    out = probs * keep
    return out / out.sum(-1, keepdim=True)


def greedy_masked(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """What greedy takes the argmax of: the logits, with banned tokens at -inf where any are."""
    return mask_logits(logits, params) if params.banned_token_ids else logits


def greedy_tokens(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Greedy fast path: logits [..., V] -> argmax ids [...] after banning."""
    return greedy_masked(logits, params).argmax(dim=-1)


def draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw: probs [N, V] (unnormalised is fine), u [N] float64 in [0, 1) -> ids [N].

    One uniform per token keeps the stream counter-based; the CDF is accumulated in float64
    so that the fast path and the reference agree bit for bit. Zero-probability tokens are
    never drawn (their CDF interval is empty).
    """
    cdf = torch.cumsum(probs.double(), dim=-1)  # [N, V]
    target = (u.double() * cdf[:, -1]).unsqueeze(-1)  # [N, 1]
    idx = torch.searchsorted(cdf, target, right=True).squeeze(-1)  # [N]
    # u * total can round up to total: fall back to the last token with mass.
    last_nonzero = (probs > 0).cumsum(-1).argmax(-1)
    return torch.minimum(idx, last_nonzero)


def draft_heads(masked: torch.Tensor, tok: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """[B, 4] float64 per row: the drafted token, the runner-up (the most likely other token
    by the masked logits; -1 when only banned tokens are left), and both their
    probabilities under `scores` [B, V] (0 for no runner-up)."""
    top = torch.topk(masked, 2, dim=-1)
    first_is_drafted = top.indices[:, 0] == tok
    alt = torch.where(first_is_drafted, top.indices[:, 1], top.indices[:, 0])
    alt_ok = torch.where(first_is_drafted, top.values[:, 1], top.values[:, 0]) != float("-inf")
    alt = torch.where(alt_ok, alt, torch.full_like(alt, -1))
    conf = scores.gather(1, torch.stack([tok, alt.clamp(min=0)], 1)).double()  # [B, 2]
    conf = torch.stack([conf[:, 0], torch.where(alt_ok, conf[:, 1], torch.zeros_like(conf[:, 1]))], 1)
    return torch.cat([tok.double().unsqueeze(1), alt.double().unsqueeze(1), conf], 1)


def _mix_(x: torch.Tensor, tmp: torch.Tensor) -> torch.Tensor:
    """`rng.mix_int64` in place, with `tmp` (x's shape) as scratch: on the CPU a step's noise is
    megabytes, and a fresh tensor per operation costs more than the arithmetic (2.5x measured)."""
    for shift, mult in ((30, S_M1), (27, S_M2)):
        torch.bitwise_right_shift(x, shift, out=tmp).bitwise_and_((1 << (64 - shift)) - 1)
        x.bitwise_xor_(tmp).mul_(mult)
    torch.bitwise_right_shift(x, 31, out=tmp).bitwise_and_((1 << 33) - 1)
    return x.bitwise_xor_(tmp)


def keys_of(u: torch.Tensor) -> torch.Tensor:
    """The noise keys of positions whose uniforms uniform(seed, pos, BONUS) a step was handed
    (float64, on any device) -> int64: their 53 bits, as rng.noise_keys gives them on the host."""
    return (u.double() * 9007199254740992.0).long()


def exponentials(keys: torch.Tensor, ids: torch.Tensor | None, vocab: int = 0) -> torch.Tensor:
    """The position noise of tokens (ADR 0027), float64 standard exponentials on the keys'
    device (rng.exponentials_reference's numbers: the same 64-bit hashes, the log within an
    ulp of numpy's): keys [...] int64 (rng.noise_keys); `ids`
    [..., E] int64 (broadcast against keys[..., None]) or None for every token of `vocab`
    -> [..., E]. Per key, SplitMix64's stream from the mixed key, the token's number in it,
    u in (0, 1), -log u. A pure function of its inputs: no generator state, no host round
    trip (it can run inside a captured graph)."""
    if ids is None:
        ids = torch.arange(vocab, device=keys.device, dtype=torch.long)
    state = mix_int64(keys.long() + S_GOLDEN)
    x = state.unsqueeze(-1) + ids.long() * S_GOLDEN
    tmp = torch.empty_like(x)
    _mix_(x, tmp)
    torch.bitwise_right_shift(x, 11, out=tmp).bitwise_and_((1 << 53) - 1)
    return tmp.double().add_(0.5).mul_(1.0 / 9007199254740992.0).log_().neg_()


def coupled_tokens(probs: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """The coupled sampler (ADR 0027): probs [..., V] (logits_to_probs, or a drafter's q), keys
    [...] int64 -> ids [...]: argmax(p / E) with E the keys' exponentials, which is Gumbel-max,
    argmax(log p + G) with G = -log E, in one log instead of two. So each id is an exact draw
    from p (unnormalised is fine; zero-probability tokens are never drawn), and two
    distributions drawn with one key pick the same token as often as Gumbel coupling allows:
    a drafter's proposal from q is the target's own sample from p whenever the two argmaxes
    meet. Ties (measure zero) go to the first index."""
    return probs.to(torch.float64, copy=True).div_(exponentials(keys, None, probs.shape[-1])).argmax(-1)


def coupled_among(probs: torch.Tensor, ids: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """`coupled_tokens` over a distribution given by its support: probs [..., E] of the token
    ids [..., E] (a truncated q's entries; zero-probability padding allowed) -> ids [...]. The
    same token as the dense form, at the cost of E tokens' noise instead of V."""
    best = probs.to(torch.float64, copy=True).div_(exponentials(keys, ids)).argmax(-1, keepdim=True)
    return ids.gather(-1, best).squeeze(-1)
