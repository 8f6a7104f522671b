"""Token trees drafted by the target's own head and judged inside the device step's round
(ADR 0025; ADR 0020 for trees on the host).

A tree of width w and depth K has one static shape: the head's w likeliest first tokens, each
followed by its greedy chain to depth K, laid out depth-first after the row's first token. Lane
1 + b K + s holds branch b's draft at depth s + 1; its parent is lane 0 (the row's first token,
the last committed one) for s = 0, else the lane before. A chain is the tree of width 1, so
rows of both kinds share a round. The verify sees the tree's ancestor mask and rotary positions
by depth (`Row.mask`, `Row.depths`: the host writes them with the step, and a chained round
keeps them). In the round, after the target's verify:
- `judge`: a node is accepted when its parent is and it is the target's argmax at its parent
  (greedy: the accepted nodes are one path); the verdict is the path's length and the target's
  argmax at its last node; `path` [R, K] holds the accepted lanes by depth;
- `compact`: the path's KV moved to follow the prefix (positions start + 1 ..), in every layer;
- the head is fed along the path (`DeviceHead.feed` with the path's lanes).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from specserve.models.head_step import DeviceHead
    from specserve.models.step_buckets import Bucket


def tree_chain(head: DeviceHead, b: Bucket, k: int, w: int) -> None:
    """The round's trees (and chains), written into the step's token ids: row i's w_i first
    candidates (`hwidth`), each with its chain to its K (`hdraft`). Branches are drafted one
    after another: each one's head positions overwrite the last's, and read only their own."""
    ds, r, width = head.ds, b.rows, b.width
    rslot, start = ds.field("rslot", r), ds.field("start", r)
    hdraft, hwidth = ds.field("hdraft", r), ds.field("hwidth", r)
    size = head.hlast.shape[2]
    x0 = head.hlast.view(-1, size).index_select(0, rslot * head.m + (start - 1).remainder(head.m))
    logits = head.logits(x0)
    # a tree's candidates: the likeliest w; a chain's first draft: the argmax (its first index on ties)
    first = torch.where(hwidth.view(r, 1) > 1, logits.topk(w, -1).indices, logits.argmax(-1).view(r, 1))
    scratch = torch.full_like(rslot, ds.scratch)
    max_len = head.keys.shape[2]
    for branch in range(w):
        tok, x = first[:, branch], x0
        head.drafts[:r, branch * k].copy_(tok)
        for s in range(1, k):
            p = start + (s - 1)
            live = (hdraft > s) & (hwidth > branch) & (p < max_len)
            x = head._layer(head._input(tok, x), p.view(r, 1), torch.where(live, rslot, scratch).view(r, 1), rslot,
                            b.span)
            tok = head._pick(x)
            head.drafts[:r, branch * k + s].copy_(tok)
    ids = ds.field("ids", b.tokens).view(r, width)
    take = head.lanes[1:width].view(1, width - 1) <= (hdraft * hwidth).view(r, 1)
    ids[:, 1:].copy_(torch.where(take, head.drafts[:r, :width - 1], ids[:, 1:]))


def _shape(head: DeviceHead, r: int, width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each lane's depth and parent lane, and whether it holds a node ([R, W] each)."""
    ds = head.ds
    hdraft, hwidth = ds.field("hdraft", r), ds.field("hwidth", r)
    lanes = head.lanes[:width].view(1, width)
    k = hdraft.clamp(min=1).view(r, 1)
    node = (lanes - 1).clamp(min=0)
    depth = torch.where(lanes == 0, torch.zeros_like(node), node.remainder(k) + 1)
    parent = torch.where((lanes == 0) | (node.remainder(k) == 0), torch.zeros_like(node), lanes - 1)
    valid = (lanes >= 1) & (lanes <= (hdraft * hwidth).view(r, 1))
    return depth, parent, valid


def judge(head: DeviceHead, b: Bucket, k: int) -> torch.Tensor:
    """The greedy verdict of every tree row (`hwidth` > 1) over the verify's logits, in place
    of the chain's (`DeviceStep.run` judged every row as a chain), and the accepted lanes by
    depth into `head.path` (a chain row's: 1 .. K). Returns the lanes the head is fed from
    [R, W]: the first token's, then the path's."""
    ds, r, width = head.ds, b.rows, b.width
    top = ds.logits[:b.tokens].argmax(-1).view(r, width)  # the target's token after each lane
    ids = ds.field("ids", b.tokens).view(r, width)
    depth, parent, valid = _shape(head, r, width)
    lanes = head.lanes[:width].view(1, width)
    root = lanes == 0
    match = valid & (ids == top.gather(1, parent))
    accepted = root.expand(r, width)
    for _ in range(k):  # a node is accepted when its parent is: K rounds reach the deepest
        accepted = root | (match & accepted.gather(1, parent))
    n = accepted.long().sum(1) - 1
    last = (accepted.long() * (depth + 1)).argmax(1)  # the deepest accepted lane (the root if none)
    final = top.gather(1, last.view(r, 1)).squeeze(1)
    path = torch.stack([(accepted & (depth == d)).long().argmax(1) for d in range(1, k + 1)], 1)  # [R, K]
    tree = ds.field("hwidth", r) > 1
    chain = head.lanes[1:k + 1].view(1, k).expand(r, k)
    head.path[:r, :k].copy_(torch.where(tree.view(r, 1), path, chain))
    ds.verdicts[:r, 0].copy_(torch.where(tree, n.double(), ds.verdicts[:r, 0]))
    ds.verdicts[:r, 1].copy_(torch.where(tree, final.double(), ds.verdicts[:r, 1]))
    ds.picks[:r].copy_(torch.where(tree, final, ds.picks[:r]))
    src = lanes.expand(r, width).clone()
    src[:, 1:k + 1] = torch.where(tree.view(r, 1), path, src[:, 1:k + 1])
    return src


def compact(head: DeviceHead, b: Bucket, k: int) -> None:
    """A tree row's accepted path's keys and values, in every layer of the target, moved from
    the nodes' lanes to the positions after the first token (start + 1 + d); other rows and
    the path's unaccepted depths move within the scratch slot."""
    ds, r = head.ds, b.rows
    rslot, start = ds.field("rslot", r), ds.field("start", r)
    depths = head.lanes[:k].view(1, k)
    moved = (ds.field("hwidth", r) > 1).view(r, 1) & (depths < ds.verdicts[:r, 0].long().view(r, 1))
    slot = torch.where(moved, rslot.view(r, 1), torch.full_like(rslot, ds.scratch).view(r, 1)).reshape(-1)
    last = head.keys.shape[2] - 1
    src = (start.view(r, 1) + head.path[:r, :k]).clamp(max=last).reshape(-1)
    dst = (start.view(r, 1) + 1 + depths).clamp(max=last).reshape(-1)
    kv = ds.r.kv
    for cache in (*kv.keys, *kv.values):  # [slots, Hkv, L, D]: all read, then written
        cache[slot, :, dst] = cache[slot, :, src]


def run_tree_round(head: DeviceHead, b: Bucket, k: int, w: int) -> None:
    """One round with trees in one run: the drafts, the verify, the trees' verdicts, their
    paths compacted, the head fed along them."""
    tree_chain(head, b, k, w)
    head.ds._run(b)
    src = judge(head, b, k)
    compact(head, b, k)
    head.feed(b, src)
