"""Where a worker's model runs: the `device` and `dtype` settings resolved to torch objects,
and the one named copy of a step's results to the host.

`device`: "auto" (CUDA when torch sees one, else the CPU), "cpu", "cuda" or "cuda:N".
`dtype`: "auto" (bf16 on CUDA, fp32 on the CPU) or "fp32", "bf16", "fp16". The batched
runner keeps its weights, KV slots and RoPE tables on that device in that dtype; logits come
out float32 whatever the dtype.
"""

from __future__ import annotations

import re

import numpy as np
import torch

DEVICE_PATTERN = r"^(auto|cpu|cuda(:\d+)?)$"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_device(setting: str) -> torch.device:
    """The torch device a `device` setting names; "auto" is CUDA when available."""
    if not re.match(DEVICE_PATTERN, setting):
        raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {setting!r}")
    if setting == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(setting)


def resolve_dtype(setting: str, device: torch.device) -> torch.dtype:
    """The torch dtype a `dtype` setting names; "auto" is bf16 on CUDA, fp32 elsewhere
    (bf16 matmuls on a CPU are slower than fp32 ones and lose exactness for nothing)."""
    if setting == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if setting not in DTYPES:
        raise ValueError(f"dtype must be auto, {', '.join(DTYPES)}, got {setting!r}")
    return DTYPES[setting]


def kv_budget_bytes(device: torch.device, cpu_budget_mb: float, memory_fraction: float,
                    reserve_bytes: int = 0, mem_get_info=None) -> int:
    """The KV store's byte budget on `device`, taken after the weights are there.

    CPU, or `memory_fraction` 0: `cpu_budget_mb` (the `kv_budget_mb` setting). CUDA: like
    vLLM's `gpu_memory_utilization`, this worker may use `memory_fraction` of the device's
    total memory; what is in use already (the weights, the CUDA context, anything else on the
    device) and `reserve_bytes` (a step's activations) are subtracted, the rest holds KV.
    A budget that holds nothing is an error that says what to change."""
    if device.type != "cuda" or memory_fraction <= 0:
        return int(cpu_budget_mb * 2**20)
    free, total = (mem_get_info or torch.cuda.mem_get_info)(device)
    used = total - free
    budget = int(memory_fraction * total) - used - reserve_bytes
    if budget <= 0:
        raise ValueError(
            f"no device memory left for the KV cache on {device}: {memory_fraction:.2f} of "
            f"{total / 2**30:.1f} GiB allowed, {used / 2**30:.1f} GiB in use after the weights, "
            f"{reserve_bytes / 2**30:.2f} GiB reserved for a step's activations; raise "
            "gpu_memory_utilization, or set it to 0 and give kv_budget_mb")
    return budget


def activation_reserve_bytes(cfg, step_tokens: int, logit_rows: int, dtype: torch.dtype) -> int:
    """A step's peak working memory beyond weights and KV, over-estimated: `step_tokens`
    tokens each holding the MLP's three intermediate tensors and a dozen hidden-size tensors
    in the model's dtype, and float32 logits for `logit_rows` positions."""
    elem = torch.finfo(dtype).bits // 8
    per_token = elem * (3 * cfg.intermediate_size + 12 * cfg.hidden_size)
    return int(step_tokens * per_token + logit_rows * 4 * cfg.vocab_size)


def to_device(data, device: torch.device | str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Small host data (a tensor, a numpy array, or a list of indices, positions, token ids)
    on the step's device without a stream sync. A plain copy from pageable memory waits for
    every kernel queued before it (found on an H100 with `torch.cuda.set_sync_debug_mode`: 12
    such waits in a target step, 18 in a draft step, where the step's one designated transfer
    was meant to be the only one), so the host could not queue the next layer while the GPU
    ran this one. On CUDA it goes through pinned memory, asynchronously (the caching host
    allocator keeps the pinned buffer until the copy is done); elsewhere it is a plain `.to`."""
    t = torch.as_tensor(data, dtype=dtype)  # a tensor or numpy array as it is; a list copied once
    device = torch.device(device)
    if t.device.type == "cpu" and device.type == "cuda" and _can_pin():
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def copy_in(dst: torch.Tensor, data: np.ndarray) -> None:
    """Host numbers into a persistent device buffer `dst` of the same shape, without a stream
    sync (through pinned memory on CUDA, as `to_device`): the device step's one copy in."""
    t = torch.from_numpy(data)
    if dst.device.type == "cuda" and _can_pin():
        dst.copy_(t.pin_memory(), non_blocking=True)
    else:
        dst.copy_(t)


def _can_pin() -> bool:
    """Pinned memory needs a CUDA runtime (the fake-device audit stands one in)."""
    return torch.cuda.is_available()


def to_host(rows: list[torch.Tensor]) -> list[torch.Tensor]:
    """Rows [n_i, W] on the device -> the same rows on the host, in one copy: the designated
    transfer of a step (the target's verdicts, `verifier.judge_rows`; the draft's picks,
    `BatchedDraft._finish`). Nothing else in a step reads the device
    (tests/unit/test_device_audit.py)."""
    if not rows or rows[0].device.type == "cpu":
        return rows
    flat = torch.cat(rows).cpu()  # [sum n_i, W]
    return list(flat.split([r.shape[0] for r in rows]))
