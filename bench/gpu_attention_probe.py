"""The device step's attention, alternatives side by side on one GPU (ADR 0019, issue 39 item 3):
for the 1.1B-class target's shape (32 query heads, 4 KV heads, head size 64, bf16, slots of
1,024 positions), the device time of one attention call per layer (22 layers in a CUDA graph,
timed with CUDA events over replays) at a few buckets (rows, width, span):

- gathered: `device_step.attend` as the step runs it (two index_selects of the rows' slots,
  the query's layout copy, one SDPA call under an additive mask, the output's layout copy);
- gathered, compiled: the same function through torch.compile (the gathers and copies fused);
- flex: FlexAttention compiled, reading every slot in place ([1, Hkv, slots x 1,024, D]) under
  a block mask built from the rows' slots and lengths (its build is timed apart: once a step);
- the KV scatter (`KVSlots.write`'s) per layer, for scale.

Every variant's output is checked against the gathered one first. Usage (on a GPU node):
    python bench/gpu_attention_probe.py --out bench/results/gpu
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from specserve.models.device_step import attend  # noqa: E402

HQ, HKV, D, L, LAYERS = 32, 4, 64, 1024, 22


def events_ms(fn, reps: int) -> float:
    """Device ms of one `fn()`, the mean over `reps` calls between two CUDA events."""
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / reps


def graph_ms(fn, reps: int = 50) -> float:
    """Device ms of one `fn()` (which runs LAYERS calls), replayed from a CUDA graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    return events_ms(g.replay, reps)


def eager_ms(fn, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    return events_ms(fn, reps)


def guarded(spec: str, fn):
    """fn(), or nan with the error printed: one variant failing must not cost the others' figures."""
    try:
        return fn()
    except Exception as exc:
        print(f"[attention] {spec}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
        return float("nan")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="bench/results/gpu")
    p.add_argument("--buckets", default="1x1x256,1x5x256,16x1x256,16x5x512,64x1x512")
    a = p.parse_args(argv)
    dev, dt = torch.device("cuda"), torch.bfloat16
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    flex = torch.compile(flex_attention, dynamic=False)
    gathered_c = torch.compile(attend, dynamic=False)
    torch.manual_seed(0)
    slots = 66
    keys = torch.randn(slots, HKV, L, D, device=dev, dtype=dt)
    values = torch.randn(slots, HKV, L, D, device=dev, dtype=dt)
    rows_out = []
    for spec in a.buckets.split(","):
        r, w, s = (int(x) for x in spec.split("x"))
        g = HQ // HKV
        rslot = torch.randperm(slots - 1, device=dev)[:r]
        start = torch.randint(s // 2, s - w + 1, (r,), device=dev)  # cached positions before the row's tokens
        q = torch.randn(r * w, HQ, D, device=dev, dtype=dt)
        # the step's additive mask (device_step._mask, causal block)
        keys_at = torch.arange(s, device=dev)
        rel = keys_at.unsqueeze(0) - start.unsqueeze(1)
        i = torch.arange(w, device=dev).view(1, w, 1)
        seen = (rel.unsqueeze(1) < 0) | ((rel.unsqueeze(1) >= 0) & (rel.unsqueeze(1) <= i))
        add = torch.zeros(r, w, s, dtype=dt, device=dev).masked_fill_(~seen, float("-inf"))
        mask = add.unsqueeze(1).expand(r, g, w, s).reshape(r, 1, g * w, s)
        ref = attend(q, keys, values, rslot, mask)

        # flex over every slot in place: query token t (row t // w, index t % w) sees key j of
        # the flat [slots x L] axis where j is in its row's slot and before start + index + 1
        def mask_mod(b, h, qi, kv, rslot=rslot, start=start, w=w):
            row = qi // w
            return (kv // L == rslot[row]) & (kv % L <= start[row] + qi % w)

        def build(r=r, w=w, mask_mod=mask_mod):
            return create_block_mask(mask_mod, None, None, r * w, slots * L, device=dev)

        def safe(fn, spec=spec):
            return guarded(spec, fn)

        bm = safe(build)
        # (a KV laid out [Hkv, slots x L, D] per layer; copied into that layout here, outside the clock)
        kf = keys.permute(1, 0, 2, 3).reshape(1, HKV, slots * L, D)
        vf = values.permute(1, 0, 2, 3).reshape(1, HKV, slots * L, D)
        qf = q.view(1, r * w, HQ, D).transpose(1, 2)

        def flex_call(qf=qf, kf=kf, vf=vf, bm=bm):
            return flex(qf, kf, vf, block_mask=bm, enable_gqa=True, scale=D ** -0.5)

        flex_err = safe(lambda f=flex_call, ref=ref, n=r * w: (f().transpose(1, 2).reshape(n, HQ * D).float()
                                                               - ref.float()).abs().max().item())
        comp_err = safe(lambda q=q, rslot=rslot, mask=mask, ref=ref: (
            gathered_c(q, keys, values, rslot, mask).float() - ref.float()).abs().max().item())
        k_new = torch.randn(r * w, HKV, D, device=dev, dtype=dt)
        wslot, at = rslot.repeat_interleave(w), (start.view(r, 1) + torch.arange(w, device=dev)).reshape(-1)

        def scatter(k_new=k_new, wslot=wslot, at=at):
            for _ in range(LAYERS):
                keys[wslot, :, at] = k_new
                values[wslot, :, at] = k_new

        row = {"bucket": spec,
               "gathered_ms": safe(lambda q=q, rslot=rslot, mask=mask: graph_ms(
                   lambda: [attend(q, keys, values, rslot, mask) for _ in range(LAYERS)])),
               "gathered_compiled_ms": safe(lambda q=q, rslot=rslot, mask=mask: graph_ms(
                   lambda: [gathered_c(q, keys, values, rslot, mask) for _ in range(LAYERS)])),
               "flex_ms": safe(lambda f=flex_call: graph_ms(lambda: [f() for _ in range(LAYERS)])),
               "flex_block_mask_build_ms": safe(lambda: eager_ms(build)),
               "kv_scatter_ms": safe(lambda: graph_ms(scatter)),
               "flex_max_abs_err": flex_err, "compiled_max_abs_err": comp_err}
        rows_out.append(row)
        print(f"[attention] {spec} (rows x width x span), {LAYERS} layers: gathered {row['gathered_ms']:.3f} ms, "
              f"compiled {row['gathered_compiled_ms']:.3f}, flex {row['flex_ms']:.3f} (+ block mask "
              f"{row['flex_block_mask_build_ms']:.3f} a step), KV scatter {row['kv_scatter_ms']:.3f}; "
              f"errors flex {flex_err:.3g}, compiled {comp_err:.3g}", flush=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_attention_probe.json").write_text(json.dumps(
        {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows_out}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
