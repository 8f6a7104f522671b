"""An EAGLE-style draft head (ADR 0020): drafting from the target's own features.

The head predicts the target's next *feature* (the hidden state its LM head reads) from the
current feature and the token that follows it, and drafts a token from that prediction with
the target's own final norm and LM head:

    f̂[i+1] = head(fc([embed(x[i+1]); f[i]]), its keys and values of positions <= i)
    x̂[i+2] = argmax lm_head(norm(f̂[i+1]))

`f[i]` is the target's feature at position i: the output of one decoder layer (the last by
default), or EAGLE-3's concatenation of a low, a middle and a high layer's (`feature_layers`).
On the committed prefix the head reads the target's true features (pushed with each verdict);
past it, its own predictions, one position at a time. The head is one Llama decoder layer
(RMSNorm, RoPE attention, SwiGLU MLP) of the target's width; it borrows the target's token
embedding, final norm and LM head, frozen, and ships without them (a few MB).

`EagleHead.forward` runs whole sequences (training; the held-out acceptance); `HeadCache` and
`EagleHead.extend` run a session position by position with a KV cache (drafting).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from specserve.drafters.base import (
    SURE,  # (a tree branches where the head is less sure of its first token)
)


@dataclass(frozen=True)
class EagleConfig:
    hidden: int  # the target's hidden size (the head's width)
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab_size: int
    feature_layers: tuple[int, ...]  # the target's decoder layers whose outputs are the feature
    rope_theta: float = 10000.0
    eps: float = 1e-5
    max_positions: int = 1024

    @property
    def feature_dim(self) -> int:
        return self.hidden * len(self.feature_layers)

    @classmethod
    def for_target(cls, target_config, feature_layers: tuple[int, ...] | None = None,
                   intermediate: int | None = None) -> EagleConfig:
        c = target_config
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        layers = feature_layers if feature_layers is not None else (c.num_hidden_layers - 1,)
        rope = dict(getattr(c, "rope_parameters", None) or {})
        return cls(hidden=c.hidden_size, heads=c.num_attention_heads, kv_heads=c.num_key_value_heads,
                   head_dim=head_dim, intermediate=intermediate or c.intermediate_size, vocab_size=c.vocab_size,
                   feature_layers=tuple(int(x) for x in layers),
                   rope_theta=float(rope.get("rope_theta", getattr(c, "rope_theta", 10000.0))),
                   eps=float(c.rms_norm_eps), max_positions=int(c.max_position_embeddings))

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "feature_layers": list(self.feature_layers)}, indent=1)

    @classmethod
    def from_json(cls, text: str) -> EagleConfig:
        d = json.loads(text)
        d["feature_layers"] = tuple(d["feature_layers"])
        return cls(**d)


class HeadCache:
    """One session's head state: its keys and values per position, and the last feature."""

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None  # [1, kv_heads, L, head_dim]
        self.v: torch.Tensor | None = None
        self.length = 0

    def crop(self, length: int) -> None:
        if self.k is not None and length < self.length:
            self.k, self.v = self.k[:, :, :length], self.v[:, :, :length]  # type: ignore[index]
        self.length = min(self.length, length)


class EagleHead(nn.Module):
    inv_freq: torch.Tensor

    def __init__(self, cfg: EagleConfig) -> None:
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden
        # fused features (EAGLE-3: several layers') are reduced to the width first; the head's
        # own predictions, fed back while drafting, are already of that width
        self.reduce = nn.Linear(cfg.feature_dim, h, bias=False) if cfg.feature_dim != h else None
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.attn_norm = nn.Parameter(torch.ones(h))
        self.wq = nn.Linear(h, cfg.heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(h, cfg.kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(h, cfg.kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.heads * cfg.head_dim, h, bias=False)
        self.mlp_norm = nn.Parameter(torch.ones(h))
        self.gate_up = nn.Linear(h, 2 * cfg.intermediate, bias=False)
        self.down = nn.Linear(cfg.intermediate, h, bias=False)
        inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float32) / cfg.head_dim))
        self.register_buffer("inv_freq", inv, persistent=False)

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [B, heads, T, D], positions [B, T] -> RoPE applied (HF's rotate_half convention)."""
        freqs = positions.float()[..., None] * self.inv_freq  # [B, T, D/2]
        emb = torch.cat([freqs, freqs], -1)[:, None]  # [B, 1, T, D]
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat([-x2, x1], -1) * sin

    def _norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return w * F.rms_norm(x.float(), x.shape[-1:], None, self.cfg.eps).to(x.dtype)

    def layer(self, x: torch.Tensor, positions: torch.Tensor, past: tuple[torch.Tensor, torch.Tensor] | None = None,
              mask: torch.Tensor | None = None) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """The decoder layer over x [B, T, H] at `positions` [B, T], after `past` keys and values
        (causal within x, all of past visible; or `mask` [T, past + T] bool, who sees whom);
        returns the output and the keys and values of past + x."""
        c = self.cfg
        b, t, _ = x.shape
        y = self._norm(x, self.attn_norm)
        q = self._rope(self.wq(y).view(b, t, c.heads, c.head_dim).transpose(1, 2), positions)
        k = self._rope(self.wk(y).view(b, t, c.kv_heads, c.head_dim).transpose(1, 2), positions)
        v = self.wv(y).view(b, t, c.kv_heads, c.head_dim).transpose(1, 2)
        if past is not None:
            k, v = torch.cat([past[0], k], 2), torch.cat([past[1], v], 2)
        before = k.shape[2] - t
        if mask is None and t > 1:
            mask = torch.ones(t, k.shape[2], dtype=torch.bool, device=x.device).tril(before)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=c.heads != c.kv_heads)
        x = x + self.wo(o.transpose(1, 2).reshape(b, t, c.heads * c.head_dim))
        gate, up = self.gate_up(self._norm(x, self.mlp_norm)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up), (k, v)

    def project(self, features: torch.Tensor) -> torch.Tensor:
        """The target's features [..., F] -> the head's input width [..., H]."""
        return features if self.reduce is None else self.reduce(features)

    def forward(self, inputs: torch.Tensor, next_embeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Whole sequences: per position its input [B, T, H] (`project`ed target features, or
        the head's own predictions) and the embedding of the token that follows it [B, T, H]
        -> the predicted features of the next positions [B, T, H]."""
        x = self.fc(torch.cat([next_embeds, inputs], -1))
        return self.layer(x, positions)[0]

    def extend(self, cache: HeadCache, inputs: torch.Tensor, next_embeds: torch.Tensor) -> torch.Tensor:
        """A session's next positions: inputs [n, H] (as in `forward`) and next-token
        embeddings [n, H] -> predicted features [n, H]; the cache gains their keys and values."""
        x = self.fc(torch.cat([next_embeds, inputs], -1))[None]
        n = x.shape[1]
        positions = torch.arange(cache.length, cache.length + n, device=x.device)[None]
        past = (cache.k, cache.v) if cache.k is not None and cache.v is not None else None
        out, (cache.k, cache.v) = self.layer(x, positions, past)
        cache.length += n
        return out[0]


class TargetParts:
    """What the head borrows from its target, frozen: the token embedding, the final norm and
    the LM head; and, for training and evaluation, the target's features of a sequence."""

    def __init__(self, target: Any, feature_layers: tuple[int, ...]) -> None:
        self.model: Any = target
        inner: Any = target.model
        self.embed = inner.embed_tokens
        self.norm = inner.norm
        self.lm_head = target.lm_head
        self.feature_layers = feature_layers
        self.layers = inner.layers

    def logits(self, feature_last: torch.Tensor) -> torch.Tensor:
        """The target's logits from a last-layer feature (its final norm, then its LM head)."""
        return self.lm_head(self.norm(feature_last)).float()

    @torch.no_grad()
    def features(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """ids [B, T] -> (the head's input features [B, T, F], the last layer's output [B, T, H]
        (what the LM head reads, after the norm), the target's logits [B, T, V])."""
        captured: dict[int, torch.Tensor] = {}
        last = len(self.layers) - 1
        wanted = set(self.feature_layers) | {last}
        hooks = [self.layers[i].register_forward_hook(
            lambda _m, _a, out, i=i: captured.__setitem__(i, out[0] if isinstance(out, tuple) else out))
            for i in wanted]
        try:
            logits = self.model(input_ids=ids).logits.float()
        finally:
            for hk in hooks:
                hk.remove()
        feats = torch.cat([captured[i] for i in self.feature_layers], -1)
        return feats, captured[last], logits


    @classmethod
    def from_weights(cls, target_dir: str | Path, feature_layers: tuple[int, ...]) -> TargetParts:
        """Only what drafting needs (the token embedding, the final norm, the LM head), read
        from a target's safetensors without its layers: a remote draft replica's copy."""
        from safetensors import safe_open
        from transformers import AutoConfig

        d = Path(target_dir)
        cfg = AutoConfig.from_pretrained(d)
        tensors: dict[str, torch.Tensor] = {}
        for f in sorted(d.glob("*.safetensors")):
            with safe_open(str(f), "pt") as fh:
                for name in fh.keys():  # noqa: SIM118 (a safe_open handle, not a dict)
                    if name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
                        tensors[name] = fh.get_tensor(name).float()
        parts = cls.__new__(cls)
        parts.model = None
        parts.layers = None
        parts.feature_layers = feature_layers
        parts.embed = nn.Embedding.from_pretrained(tensors["model.embed_tokens.weight"])
        parts.norm = _RMSNorm(tensors["model.norm.weight"], float(cfg.rms_norm_eps))
        head = tensors.get("lm_head.weight", tensors["model.embed_tokens.weight"])
        parts.lm_head = nn.Linear(head.shape[1], head.shape[0], bias=False)
        parts.lm_head.weight.data = head
        return parts


class _RMSNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * F.rms_norm(x.float(), x.shape[-1:], None, self.eps).to(x.dtype)


class EagleSession:
    """One session's drafting state: the head's inputs by position (the projected target
    features of the committed positions, handed in as they are computed) and its key/value
    cache over the committed positions before the last one. `add_features` may be called from
    any thread (it queues); drafting takes what was queued first. Drafts a chain of K, or a
    tree of `width` first candidates with their greedy chains where the head is unsure of the
    first (ADR 0020)."""

    def __init__(self, head: EagleHead, parts: TargetParts) -> None:
        from collections import deque

        self.head, self.parts = head, parts
        self.cache = HeadCache()
        self.inputs: torch.Tensor | None = None  # [n, H]
        self.pending: Any = deque()
        self.feature_bytes = 0
        self.covered = 0  # positions 0.. whose features were handed in (queued or absorbed), without a gap

    def add_features(self, start: int, feats: torch.Tensor) -> None:
        """The target's features of positions start.. (committed), queued."""
        self.pending.append((start, feats))
        if start <= self.covered:  # (past a gap nothing is usable until it is re-fed)
            self.covered = start + feats.shape[0]

    def ready(self, length: int) -> bool:
        """Whether a block after `length` committed tokens can be drafted: the features of the
        positions before the last are all here (queued counts)."""
        return length >= 2 and self.covered >= length - 1

    @torch.inference_mode()
    def _absorb(self) -> None:
        while self.pending:
            start, feats = self.pending.popleft()
            if feats.shape[0] == 0:
                continue
            self.feature_bytes += feats.numel() * feats.element_size()
            inp = self.head.project(feats.to(device="cpu", dtype=torch.float32))
            have = 0 if self.inputs is None else self.inputs.shape[0]
            if start > have:  # a gap: features this session never saw (it drafts nothing until re-fed)
                continue
            keep = self.inputs[:start] if self.inputs is not None else inp[:0]
            self.inputs = torch.cat([keep, inp])
            self.cache.crop(min(self.cache.length, max(start - 1, 0)))

    @torch.inference_mode()
    def draft(self, ids: list[int], k: int, sampling, seed: int, width: int = 1
              ) -> tuple[list[int], Any, list[int] | None] | None:
        """The block for the committed `ids`: (tokens, q, parents) — parents None for a
        chain; None when the features of the positions before the last are not all here."""
        self._absorb()
        n = len(ids)
        if k <= 0 or self.inputs is None or self.inputs.shape[0] < n - 1 or n < 2:
            return None
        if self.cache.length > n - 2:
            self.cache.crop(n - 2)
        if self.cache.length < n - 2:  # the committed positions the cache lacks, with their true features
            a = self.cache.length
            self.head.extend(self.cache, self.inputs[a:n - 2], self.parts.embed(torch.tensor(ids[a + 1:n - 1])))
        if width > 1:
            tokens, q, parents = self._tree(self.inputs[n - 2], ids[n - 1], n, k, width, sampling, seed)
            if parents is not None:
                return tokens, q, parents
        tokens, q = self._chain(self.inputs[n - 2], ids[n - 1], n, k, sampling, seed)
        return tokens, q, None

    def _chain(self, inp: torch.Tensor, token: int, n: int, k: int, sampling, seed: int) -> tuple[list[int], Any]:
        """K tokens from position n - 2's input and the last committed token (greedy: argmax,
        one-hot q; sampled: Gumbel-max draws with the positions' noise, q dense); the cache is
        left holding the committed positions only."""
        from specserve.algorithm.rejection import DenseQ
        from specserve.algorithm.sampling import logits_to_probs

        saved = (self.cache.k, self.cache.v, self.cache.length)
        out: list[int] = []
        qs = []
        x = inp[None]
        try:
            for i in range(k):
                pred = self.head.extend(self.cache, x, self.parts.embed(torch.tensor([token])))
                logits = self.parts.logits(pred)[0]
                if sampling.greedy:
                    token = int(logits.argmax())
                else:
                    qs.append(logits_to_probs(logits, sampling))
                    token = _drawn(qs[-1], seed, n + i)
                out.append(token)
                x = pred
        finally:
            self.cache.k, self.cache.v, self.cache.length = saved
        return out, (DenseQ(torch.stack(qs)) if qs else None)

    def _tree(self, inp: torch.Tensor, token: int, n: int, k: int, width: int, sampling, seed: int
              ) -> tuple[list[int], Any, list[int] | None]:
        """(tokens, q, parents), depth-first (parents before children); ([], None, None) where
        the head is sure of the first token. Greedy: the head's `width` likeliest first tokens,
        each with its greedy chain to depth k (q None: judged one-hot). Sampled: the chain's own
        first draw, then more drawn from the head's q without replacement (algorithm/tree.py:
        draw_siblings), each followed by draws as a chain's, with every node's q row."""
        from specserve.algorithm.rejection import DenseQ
        from specserve.algorithm.sampling import logits_to_probs
        from specserve.algorithm.tree import draw_siblings

        saved = (self.cache.k, self.cache.v, self.cache.length)
        tokens: list[int] = []
        parents: list[int] = []
        qs: list[torch.Tensor] = []
        greedy = sampling.greedy

        def pick(logits: torch.Tensor, pos: int) -> int:
            if greedy:
                return int(logits.argmax())
            qs.append(logits_to_probs(logits, sampling))
            return _drawn(qs[-1], seed, pos)

        try:
            first = self.head.extend(self.cache, inp[None], self.parts.embed(torch.tensor([token])))
            logits = self.parts.logits(first)[0]
            probs = torch.softmax(logits, -1) if greedy else logits_to_probs(logits, sampling)
            if greedy:
                top = probs.topk(width)
                cands, sure = top.indices.tolist(), float(top.values[0])
            else:
                drawn = _drawn(probs, seed, n)
                cands, sure = draw_siblings(probs, width, seed, n, drawn), float(probs[drawn])
            if sure >= SURE or len(cands) < 2:
                return [], None, None
            after_first = (self.cache.k, self.cache.v, self.cache.length)
            for cand in cands:
                self.cache.k, self.cache.v, self.cache.length = after_first
                tokens.append(cand)
                parents.append(-1)
                if not greedy:
                    qs.append(probs)
                x, tok = first, cand
                for i in range(1, k):
                    x = self.head.extend(self.cache, x, self.parts.embed(torch.tensor([tok])))
                    tok = pick(self.parts.logits(x)[0], n + i)
                    tokens.append(tok)
                    parents.append(len(tokens) - 2)
        finally:
            self.cache.k, self.cache.v, self.cache.length = saved
        return tokens, (DenseQ(torch.stack(qs)) if qs else None), parents

    # the DraftSession protocol, for a draft replica's per-session path
    def propose(self, token_ids, k: int, sampling, seed: int):
        from specserve.drafters.base import DraftProposal

        block = self.draft(list(token_ids), k, sampling, seed)
        if block is None:  # no features for this prefix yet: nothing to propose, the round runs plain
            return DraftProposal([], None)
        tokens, q, _ = block
        return DraftProposal(tokens, q)

    def guess_next(self, token_ids, sampling, seed: int) -> int | None:
        return None  # (drafting ahead needs features of drafted positions: not for a head)

    def release(self) -> None:
        self.cache = HeadCache()
        self.inputs = None
        self.pending.clear()
        self.covered = 0


class EagleDrafter:
    """A draft replica's drafter over an EAGLE head (the `eagle` pool, ADR 0020): a session per
    draft session, fed the target's features over the Link."""

    name = "eagle"

    def __init__(self, head: EagleHead, parts: TargetParts) -> None:
        self.head, self.parts = head, parts
        self.vocab_size = head.cfg.vocab_size

    def start(self) -> EagleSession:
        return EagleSession(self.head, self.parts)


def _drawn(probs: torch.Tensor, seed: int, position: int) -> int:
    """The head's sampled draft at `position` from its distribution there: its Gumbel-max draw
    with the position's noise, as every drafter draws and the target draws its own token there
    (ADR 0027; a chain's and a tree's first candidate alike)."""
    from specserve.algorithm.rng import noise_keys
    from specserve.algorithm.sampling import coupled_tokens

    return int(coupled_tokens(probs, torch.from_numpy(noise_keys(seed, [position])).to(probs.device)[0]))


def features_to_wire(feats: torch.Tensor) -> tuple[int, int, bytes]:
    """Features [n, F] -> (rows, width, their bfloat16 bytes): what leaves the target's device,
    once, for a remote head (2 bytes a number)."""
    host = feats.detach().to(device="cpu", dtype=torch.bfloat16).contiguous()
    return host.shape[0], host.shape[1], host.view(torch.int16).numpy().tobytes()


def features_from_wire(rows: int, width: int, data: bytes) -> torch.Tensor:
    if len(data) != 2 * rows * width:
        raise ValueError(f"features of {rows} x {width} need {2 * rows * width} bytes, got {len(data)}")
    return torch.frombuffer(bytearray(data), dtype=torch.bfloat16).view(rows, width).float()


def load_head(directory: str | Path, dtype: torch.dtype = torch.float32) -> EagleHead:
    """A head saved by the recipe (config.json + model.safetensors)."""
    from safetensors.torch import load_file

    d = Path(directory)
    head = EagleHead(EagleConfig.from_json((d / "config.json").read_text()))
    head.load_state_dict(load_file(str(d / "model.safetensors")))
    return head.to(dtype).eval()


def save_head(head: EagleHead, directory: str | Path, dtype: torch.dtype = torch.bfloat16) -> None:
    from safetensors.torch import save_file

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(head.cfg.to_json())
    save_file({k: v.detach().to(dtype).contiguous() for k, v in head.state_dict().items()},
              str(d / "model.safetensors"))
