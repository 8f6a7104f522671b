"""Token trees (ADR 0020): a draft block whose tokens branch, verified in one pass.

A tree is its draft tokens in an order where every parent comes before its children, and
`parents[i]`: the index of token i's parent among them, or -1 for the last committed token
(the root). Siblings are candidates for the same position, tried in their order.

Verification is exact for any tree whose tokens were chosen without the target's randomness
(top-k branches, several n-gram matches): multi-candidate rejection sampling with one-hot
candidates. At a node with target distribution p, its children c_1, c_2, ... are tried in
order: c_j is accepted with probability p(c_j) / (1 - p(c_1) - ... - p(c_{j-1})) (p with the
rejected candidates removed, renormalised); the first accepted child becomes the node and its
children are tried next. Where every child is rejected, the final token is drawn from p with
all of them removed (recovered, by inverse CDF with RECOVER); at a leaf, from p (bonus, by
Gumbel-max with the position's noise, as rejection.py draws it). Each candidate tried is kept with
exactly its probability under the target given the ones before it were not, so the emitted
tokens follow the target's distribution; at T = 0 the walk follows the target's argmax. A chain
(parents -1, 0, 1, ...) is judged exactly as `rejection.rejection_judge` judges it with a
one-hot q: the same numbers (ACCEPT at each position for the first candidate, RECOVER or the
position's noise where the block ends), the same verdicts.

A sampled session's tree may carry its drafter's q instead (recursive rejection sampling
without replacement, as SpecInfer's and Jeon et al.'s): the candidates at a node were drawn from
the drafter's q there without replacement (`draw_siblings`: the position's Gumbel top-k), and each node's
q row is the distribution its token was drawn from (siblings share one). Candidate c_j is
accepted with probability min(1, p_j(c_j) / q_j(c_j)), where p_1 = p, q_1 = q, and after a
rejection p_{j+1} = norm(max(0, p_j - q_j)) and q_{j+1} = q_j with c_j removed, renormalised;
where every child is rejected the final token is drawn from the last residual. Below the root's
children each branch is a chain drawn from q, judged as a chain is; a chain with q gets
`rejection_judge`'s verdicts with that q.

A coupled session's tree (`SamplingParams.coupled`, ADR 0027) is judged as its chain is: the
target's own draw at each node (Gumbel-max with the noise of the node's position, the one
plain decoding draws there), the child equal to it accepted (siblings are distinct, so at most
one is), and that draw the final token where none is. The path is then plain decoding's with
the seed, whatever the tree.

The device computes, per node, its token's probability under its parent's distribution and
the node's final token (recovered from p less its children, or bonus), and with q the token's
q_j; the host walks the tree on those 2 (3) numbers a node, which cross in the step's one copy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from specserve.algorithm.rejection import QProbs, Verdict, q_to_dense
from specserve.algorithm.rng import Purpose, noise_keys, uniform
from specserve.algorithm.sampling import coupled_tokens, draw, exponentials, logits_to_probs, mask_logits
from specserve.device import to_device
from specserve.params import SamplingParams

SIBLINGS = 256  # the most candidates at one position (the uniforms' index space per position)


@dataclass(frozen=True)
class Tree:
    parents: tuple[int, ...]

    def __post_init__(self) -> None:
        for i, p in enumerate(self.parents):
            if not -1 <= p < i:
                raise ValueError(f"tree node {i}'s parent {p} must be -1 (the root) or an earlier node")

    @classmethod
    def chain(cls, k: int) -> Tree:
        return cls(tuple(range(-1, k - 1)))

    @property
    def size(self) -> int:
        return len(self.parents)

    @property
    def depths(self) -> list[int]:
        """Per node, its depth (the root's children: 1)."""
        d: list[int] = []
        for p in self.parents:
            d.append(1 if p < 0 else d[p] + 1)
        return d

    def children(self) -> list[list[int]]:
        """Per node of the full tree (0: the root, i + 1: token i), its children's node indices
        (i + 1 for token i) in order."""
        out: list[list[int]] = [[] for _ in range(self.size + 1)]
        for i, p in enumerate(self.parents):
            out[p + 1].append(i + 1)
        return out

    def mask(self) -> torch.Tensor:
        """[m + 1, m + 1] bool over (the root, then the tokens): each sees its ancestors and itself."""
        m = self.size
        seen = torch.zeros(m + 1, m + 1, dtype=torch.bool)
        seen[0, 0] = True
        for i, p in enumerate(self.parents):
            seen[i + 1] = seen[p + 1]
            seen[i + 1, i + 1] = True
        return seen

    @property
    def is_chain(self) -> bool:
        return self.parents == tuple(range(-1, self.size - 1))


def tree_judge_on_device(logits: torch.Tensor, tokens: Sequence[int], tree: Tree, sampling: SamplingParams,
                         seed: int, start: int, allowed: torch.Tensor | None = None,
                         q: QProbs = None) -> torch.Tensor:
    """logits [m + 1, V] of the root and the tree's tokens -> [m + 1, 2] float64 on their
    device: per node, its token's probability under its parent's distribution (the root: 0),
    and its final token (drawn from p less its children, or from p at a leaf). `start`: the
    absolute position of the root's children. `allowed` [m + 1, V] bool: a constraint's legal
    tokens at each node (structured/grammar.py: ConstrainedRow.constrain_tree); p is the
    target's masked to them. `q` (sampled only; None: one-hot candidates): each node's draft
    distribution; the rows are then [m + 1, 3], p_j and q_j of each token (module docstring)
    and the final token. A coupled session's rows (module docstring) are [m + 1, 2]: 1 where a
    token is its parent's own draw, else 0, and each node's own draw."""
    device = logits.device
    if allowed is not None:
        logits = logits.masked_fill(~to_device(allowed, device), float("-inf"))
    m = tree.size
    children = tree.children()
    depths = [0] + tree.depths
    toks = to_device(list(tokens), device, torch.long)
    parent_rows = to_device([p + 1 for p in tree.parents], device, torch.long)  # [m]
    if not sampling.greedy:  # every node's fresh draw's noise: at the position after it
        keys = to_device(noise_keys(seed, [start + d for d in depths]), device)  # [m + 1]
        leaf = to_device([not kids for kids in children], device, torch.bool)
    if sampling.coupled and not sampling.greedy:
        own = coupled_tokens(logits_to_probs(logits, sampling), keys)  # [m + 1]
        p_tok = (own.index_select(0, parent_rows) == toks).double()
        return torch.stack([torch.cat([own.new_zeros(1, dtype=torch.float64), p_tok]), own.double()], 1)
    if q is not None and not sampling.greedy:
        return _judge_with_q(logits_to_probs(logits, sampling), tokens, children, q,
                             _recover_uniforms(depths, seed, start), keys, leaf)
    # children's tokens removed at each node that has any (a leaf keeps all of p)
    ban = torch.zeros(logits.shape, dtype=torch.bool, device=device)
    rows = [n for n in range(m + 1) for _ in children[n]]
    if rows:
        cols = [tokens[c - 1] for n in range(m + 1) for c in children[n]]
        ban[to_device(rows, device, torch.long), to_device(cols, device, torch.long)] = True
    if sampling.greedy:
        top = mask_logits(logits, sampling).argmax(-1)  # [m + 1]
        p_tok = (top.index_select(0, parent_rows) == toks).double() if m else logits.new_zeros(0, dtype=torch.float64)
        final = mask_logits(logits, sampling).masked_fill(ban, float("-inf")).argmax(-1)
        # (a node whose argmax is one of its children accepts it: its final token is not used)
    else:
        p = logits_to_probs(logits, sampling)  # [m + 1, V]
        p_tok = p.index_select(0, parent_rows).gather(1, toks[:, None])[:, 0].double() if m else \
            logits.new_zeros(0, dtype=torch.float64)
        rest = p.masked_fill(ban, 0.0)
        empty = rest.sum(-1) <= 0  # every token of p is a child: unreachable, drawn from p instead
        u = to_device(_recover_uniforms(depths, seed, start), device)
        recovered = draw(torch.where(empty[:, None], p, rest), u)
        final = torch.where(leaf, coupled_tokens(p, keys), recovered)
    root = torch.zeros(1, dtype=torch.float64, device=device)
    return torch.stack([torch.cat([root, p_tok]), final.double()], 1)


def _recover_uniforms(depths: list[int], seed: int, start: int) -> np.ndarray:
    """Per node, the RECOVER uniform of its final token where it has children (drawn if all
    are rejected), keyed by the node's absolute position (a leaf's final token is drawn with
    the position's noise instead)."""
    return uniform(seed, [start + d for d in depths], Purpose.RECOVER)


def _judge_with_q(p: torch.Tensor, tokens: Sequence[int], children: list[list[int]], q: QProbs,
                  u: np.ndarray, keys: torch.Tensor, leaf: torch.Tensor) -> torch.Tensor:
    """`tree_judge_on_device`'s rows for a tree with its drafter's q (recursive rejection
    sampling without replacement at each node; module docstring); `u` the nodes' RECOVER
    uniforms, `keys` their noise keys, `leaf` which have no children."""
    device, m = p.device, len(tokens)
    qd = q_to_dense(q, to_device(list(tokens), device, torch.long), p.shape[-1])  # [m, V] float32
    px = [p.new_zeros(())] * (m + 1)
    qx = [p.new_zeros(())] * (m + 1)
    dists = []
    for n in range(m + 1):
        p_cur, dist = p[n], p[n]
        if children[n]:
            q_cur = qd[children[n][0] - 1]
            for c in children[n]:
                x = int(tokens[c - 1])
                px[c], qx[c] = p_cur[x], q_cur[x]
                dist = torch.clamp(p_cur - q_cur, min=0.0)  # the residual, drawn from if all are rejected
                left = dist.sum()
                # p_j == q_j leaves no residual: a rejection is then impossible in exact arithmetic
                p_cur = torch.where(left > 0, dist / left.clamp(min=1e-30), p_cur)
                dist = torch.where(left > 0, dist, p_cur)
                q_cur = q_cur.index_fill(0, to_device([x], device, torch.long), 0.0)
                q_cur = q_cur / q_cur.sum().clamp(min=1e-30)
        dists.append(dist)
    final = torch.where(leaf, coupled_tokens(p, keys), draw(torch.stack(dists), to_device(u, device)))
    return torch.stack([torch.stack(px).double(), final.double(), torch.stack(qx).double()], 1)


def draw_siblings(q: torch.Tensor, width: int, seed: int, position: int, first: int) -> list[int]:
    """Up to `width` distinct tokens drawn without replacement from the drafter's q [V] at
    `position`: `first` (the chain's own draw there), then the other tokens of q's support in
    the order of the position's noise, q / E descending (the Gumbel top-k: a draw without
    replacement from q, since `first` is that order's head, or independent of it; and for a
    coupled session the likeliest other meetings with the target's own draw); fewer where q's
    support is smaller."""
    if width > SIBLINGS:
        raise ValueError(f"at most {SIBLINGS} candidates a position")
    keys = torch.from_numpy(noise_keys(seed, [position])).to(q.device)
    score = q.double() / exponentials(keys, None, q.shape[-1])[0]
    score[first] = 0.0
    top = torch.topk(score, min(width - 1, score.shape[-1]))
    return [first] + [int(t) for t, v in zip(top.indices.tolist(), top.values.tolist(), strict=True) if v > 0]


def walk(host: np.ndarray, tokens: Sequence[int], tree: Tree, sampling: SamplingParams, seed: int,
         start: int, with_q: bool = False) -> tuple[Verdict, list[int]]:
    """The host's walk over `tree_judge_on_device`'s rows: the verdict (accepted path tokens
    and the final one) and the accepted tokens' indices in the tree, in path order. `with_q`:
    the rows carry each token's q_j (a sampled tree with its drafter's q)."""
    children = tree.children()
    node, depth, path = 0, 0, []
    while True:
        tried = 0.0
        nxt = None
        for s, c in enumerate(children[node]):
            prob = float(host[c, 0])
            if sampling.greedy or sampling.coupled:  # the node's own token, or nothing
                keep = prob >= 0.5
            elif with_q:  # as a chain's draft: u q_j(c) < p_j(c)
                keep = uniform_for(seed, start + depth, s) * float(host[c, 2]) < prob
            else:
                left = 1.0 - tried
                keep = left > 0 and uniform_for(seed, start + depth, s) * left < prob
                tried += prob
            if keep:
                nxt = c
                break
        if nxt is None:
            final = int(host[node, 1])
            break
        path.append(nxt - 1)
        node, depth = nxt, depth + 1
    accepted = [int(tokens[i]) for i in path]
    rejected = depth if children[node] else None
    return Verdict(len(path), accepted + [final], rejected), path


def uniform_for(seed: int, position: int, sibling: int) -> float:
    """The coin of the `sibling`-th candidate at `position`: ACCEPT at the position for the
    first (as a chain's draft), the position's own sub-stream for the others."""
    if sibling == 0:
        return float(uniform(seed, [position], Purpose.ACCEPT)[0])
    if sibling >= SIBLINGS:
        raise ValueError(f"at most {SIBLINGS} candidates a position")
    return float(uniform(seed, [position * SIBLINGS + sibling], Purpose.SIBLING)[0])
