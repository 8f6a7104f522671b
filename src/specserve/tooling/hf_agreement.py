"""Greedy through the batched runner against transformers' own greedy generation of the same
model, on the same device and in the same dtype (ADR 0016): what the bf16 tests
check on the CPU and `make gpu-check` on CUDA.

The two sum in different orders, so their logits may differ by rounding. Where HF's top two
logits are further apart than `tolerance`, rounding cannot swap them and the tokens must
agree (a difference there is a failure); a difference at a nearer tie is reported as a
near-tie. Either ends that prompt's comparison, since what follows depends on it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from specserve.models.runner import ModelRunner, Row

# Logits, per dtype: where HF's top two are further apart, rounding cannot swap them. bf16:
# twice the largest difference measured on the CPU (0.125, one bf16 step for logits of 16-32;
# tests/unit/test_runner_invariance.py); fp16 keeps 3 more bits; fp32 differs in the last bits.
TOLERANCE = {torch.bfloat16: 0.25, torch.float16: 0.05, torch.float32: 1e-3}


def greedy_agreement(model: Any, runner: ModelRunner, prompts: Sequence[list[int]], new_tokens: int,
                     tolerance: float) -> dict:
    """Each prompt's greedy continuation by `runner` (plain decode rows, one session at a
    time) against `model.generate`'s (a transformers causal LM), token by token. Returns the tokens compared, the
    largest logit difference seen, the near-ties and failures ({prompt, token, gap}) and
    `ok` (no failure)."""
    device = runner.device
    near_ties: list[dict] = []
    failures: list[dict] = []
    compared, largest = 0, 0.0
    for i, ids in enumerate(prompts):
        with torch.inference_mode():
            gen = model.generate(torch.tensor([ids], device=device),
                                 attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=device),
                                 max_new_tokens=new_tokens, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True)
        ref = gen.sequences[0, len(ids):].tolist()
        runner.allocate(i)
        try:
            logits = runner.forward([Row(i, ids, num_logits=1)])[0][-1]
            for j, want in enumerate(ref):
                hf = gen.logits[j][0].float()
                largest = max(largest, float((logits - hf).abs().max()))
                got = int(logits.argmax())
                compared += 1
                if got != want:
                    top2 = hf.topk(2).values
                    gap = float(top2[0] - top2[1])
                    (near_ties if gap <= tolerance else failures).append({"prompt": i, "token": j, "gap": gap})
                    break
                logits = runner.forward([Row(i, [got], num_logits=1)])[0][-1]
        finally:
            runner.free(i)
    return {"prompts": len(prompts), "tokens_compared": compared, "largest_logit_difference": largest,
            "tolerance": tolerance, "near_ties": near_ties, "failures": failures, "ok": not failures}
