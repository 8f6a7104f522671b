"""The device step's layers with the residual add fused into the next layer's norm (issue 51,
item 7; `DeviceStep(fuse=True)`, `Batching.fuse_step`).

A decoder layer ends with the MLP's residual add, and the next begins with its input norm. In
`layer_forward` each layer is one program (compile "layer"), so the add closes one program and
the norm opens the next: two kernels, the residual stream written and read again between them.
Here each layer's program takes its input already normed and ends with the *next* layer's
norm (the last layer's: the final norm before the LM head), so the compiler fuses the add and
the norm into one kernel, and the final norm leaves the uncompiled tail of the step. The ops
are the same in the same order: uncompiled, the logits are bitwise those of `layer_forward`'s
loop; compiled, within the compiler's rounding (tests/unit/test_device_step.py). Off by default
until a GPU run has compared the two side by side (`bench/gpu_check.py`'s `layer+fused` arm).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from specserve.models.device_step import DeviceStep


def fused_layer(h: torch.Tensor, x: torch.Tensor, wqkv: torch.Tensor, bqkv: torch.Tensor | None,
                q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, wo: torch.Tensor, bo: torch.Tensor | None,
                mlp_norm: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, next_norm: torch.Tensor,
                keys: torch.Tensor, values: torch.Tensor, wslot: torch.Tensor, at: torch.Tensor, rslot: torch.Tensor,
                mask: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float, hq: int, hkv: int, d: int,
                linear: Any, reduce: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`device_step.layer_forward` over the residual stream h [T, H] and its norm x (this
    layer's input norm of h), returning the next h and its norm under `next_norm`."""
    from specserve.models.device_step import attend, attention_in, attention_out
    from specserve.models.runner import rms_norm

    qk, v = attention_in(x, None, wqkv, bqkv, q_norm, k_norm, cos, sin, eps, hq, hkv, d, linear)
    keys[wslot, :, at] = qk[:, hq:]
    values[wslot, :, at] = v
    h = attention_out(h, attend(qk[:, :hq], keys, values, rslot, mask), wo, bo, mlp_norm, w_gate_up, w_down,
                      eps, linear, reduce)
    return h, rms_norm(h, next_norm, eps)


def fused_layers(ds: DeviceStep, layer: Any, h: torch.Tensor, wslot: torch.Tensor, at: torch.Tensor,
                 rslot: torch.Tensor, mask: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 reduce: Any) -> torch.Tensor:
    """Every decoder layer of the step through `layer` (`fused_layer`, compiled or not) from
    the embeddings h [T, H]: the final norm's output [T, H] (the LM head's input). The runner's
    feature layers' outputs go to `ds.features` as in the unfused loop."""
    from specserve.models.runner import rms_norm

    w, kv = ds.r.w, ds.r.kv
    kept, width, t = ds.r.feature_layers, w.embed.shape[1], h.shape[0]
    x = rms_norm(h, w.layers[0].attn_norm, w.eps)
    for li, lay in enumerate(w.layers):
        nxt = w.layers[li + 1].attn_norm if li + 1 < len(w.layers) else w.norm
        h, x = layer(h, x, lay.wqkv, lay.bqkv, lay.q_norm, lay.k_norm, lay.wo, lay.bo, lay.mlp_norm, lay.w_gate_up,
                     lay.w_down, nxt, kv.keys[li], kv.values[li], wslot, at, rslot, mask, cos, sin, w.eps,
                     w.num_heads, w.num_kv_heads, w.head_dim, ds.r.linear, reduce)
        if li in kept:
            j = kept.index(li)
            ds.features[:t, j * width:(j + 1) * width].copy_(h)
    return x
