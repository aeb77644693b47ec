"""Optimizer, learning-rate schedule and the clipped step."""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import nn

__all__ = ["build_lr_scheduler", "build_optimizer", "clip_grad_norm_and_step"]


def build_optimizer(
    model: nn.Module,
    *,
    learning_rate: float,
    weight_decay: float = 0.0,
    betas: tuple[float, float] = (0.9, 0.999),
) -> torch.optim.AdamW:
    return torch.optim.AdamW(model.parameters(), lr=learning_rate, weight_decay=weight_decay, betas=betas)


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer,
    *,
    warmup_steps: int,
    total_steps: int,
    schedule: Literal["constant", "linear", "cosine"],
) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup from 0 over ``warmup_steps``, then constant, linear to 0, or cosine to 0."""

    def factor(step: int) -> float:
        if warmup_steps and step < warmup_steps:
            return (step + 1) / (warmup_steps + 1)
        if schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return 1.0 - progress if schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def clip_grad_norm_and_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    *,
    max_grad_norm: float,
) -> float:
    """Clip to ``max_grad_norm`` and step; a non-finite norm skips the step (grads are dropped).

    The scheduler is stepped by the caller once per RL step, not here. The norm is computed over
    the DTensor gradients, so it is the global norm across shards.
    """
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    full = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    value = float(full)
    if math.isfinite(value):
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return value
