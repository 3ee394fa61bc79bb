"""AdamW with linear warmup and cosine decay (DFlash paper A.1: lr 6e-4, warmup 4%, clip 1.0)."""

from __future__ import annotations

import math

import torch


def build_optimizer(params: list[torch.nn.Parameter], *, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW over the drafter's trainable parameters; norms and 1-D weights get no decay.

    Always the fused implementation (CUDA and CPU): one kernel for all parameters, and it honours
    `optimizer.found_inf` on the device, which is how non-finite steps are skipped without a sync.
    """
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8, fused=True)


def cosine_with_warmup(step: int, *, total_steps: int, warmup_steps: int, min_lr_ratio: float) -> float:
    """LR multiplier at `step` (0-based): linear 1/w … 1 over warmup, then cosine down to min_lr_ratio."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(opt: torch.optim.Optimizer, *, total_steps: int, warmup_ratio: float,
                    min_lr_ratio: float) -> torch.optim.lr_scheduler.LambdaLR:
    """LambdaLR applying `cosine_with_warmup`; warmup = round(warmup_ratio · total_steps)."""
    warmup = int(round(warmup_ratio * total_steps))
    return torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: cosine_with_warmup(s, total_steps=total_steps, warmup_steps=warmup, min_lr_ratio=min_lr_ratio))
