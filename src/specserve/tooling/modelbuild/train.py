"""Training the target (next-token cross-entropy) and distilling the draft from it
(KL(p || q) on the target's own distributions), on packed windows of the mixed corpus."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

Progress = Callable[[int, float], None]  # (step, loss)


def bf16_autocast_supported() -> bool:
    """CPUs with native bf16 (AVX512-BF16 / AMX) train ~1.6x faster under bf16 autocast;
    elsewhere bf16 is emulated and slower, so the recipe stays fp32 there."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def _autocast(enabled: bool):
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=enabled)


class WindowSampler:
    """Random windows of `seq_len` tokens from per-class token streams, mixed by weight."""

    def __init__(self, streams: dict[str, torch.Tensor], weights: dict[str, float],
                 seq_len: int, batch: int, seed: int) -> None:
        self.names = [n for n in streams if len(streams[n]) > seq_len + 1]
        self.streams = streams
        w = torch.tensor([weights[n] for n in self.names], dtype=torch.float64)
        self.probs = w / w.sum()
        self.seq_len, self.batch = seq_len, batch
        self.gen = torch.Generator().manual_seed(seed)

    def next(self) -> torch.Tensor:  # [batch, seq_len + 1]
        rows = []
        classes = torch.multinomial(self.probs, self.batch, replacement=True, generator=self.gen)
        for c in classes.tolist():
            s = self.streams[self.names[c]]
            i = int(torch.randint(0, len(s) - self.seq_len - 1, (1,), generator=self.gen))
            rows.append(s[i : i + self.seq_len + 1])
        return torch.stack(rows)


def _lr(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = (step - warmup) / max(total - warmup, 1)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def _optimise(model: torch.nn.Module, steps: int, lr: float, weight_decay: float,
              loss_of: Callable[[], torch.Tensor], on_step: Progress) -> float:
    """The training loop both models share: AdamW, warm-up then cosine decay of the learning
    rate, gradients clipped at 1; `loss_of()` draws a batch and returns its loss. The model is
    left in eval mode; returns the last step's loss."""
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=weight_decay, fused=True)
    loss_val = float("nan")
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = _lr(step, steps, lr, max(steps // 20, 1))
        loss = loss_of()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        loss_val = float(loss.detach())
        on_step(step, loss_val)
    model.eval()
    return loss_val


def train_target(model: torch.nn.Module, sampler: WindowSampler, steps: int, lr: float,
                 on_step: Progress, bf16: bool = False) -> float:
    """Next-token cross-entropy on the sampler's windows."""

    def loss_of() -> torch.Tensor:
        batch = sampler.next()
        with _autocast(bf16):
            logits = model(input_ids=batch[:, :-1]).logits
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))

    return _optimise(model, steps, lr, 0.1, loss_of, on_step)


def distill_draft(draft: torch.nn.Module, target: torch.nn.Module, sampler: WindowSampler,
                  steps: int, lr: float, on_step: Progress, bf16: bool = False) -> float:
    """Align the draft to the target: minimise KL(p_target || q_draft) per position."""
    target.eval()

    def loss_of() -> torch.Tensor:
        inp = sampler.next()[:, :-1]
        with torch.no_grad(), _autocast(bf16):
            target_logits = target(input_ids=inp).logits
        log_p = F.log_softmax(target_logits.float(), dim=-1)
        with _autocast(bf16):
            draft_logits = draft(input_ids=inp).logits
        log_q = F.log_softmax(draft_logits.float(), dim=-1)
        return F.kl_div(log_q.reshape(-1, log_q.shape[-1]), log_p.reshape(-1, log_p.shape[-1]),
                        log_target=True, reduction="batchmean")

    return _optimise(draft, steps, lr, 0.0, loss_of, on_step)

