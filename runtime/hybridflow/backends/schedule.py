"""The learning-rate schedule every backend's trained roles share (a neutral module: backends do not import each other).

Per RL step (one rollout and all its updates) the worker calls ``scheduler.step()`` once:
``total_steps`` and ``warmup_steps`` count RL steps, as ``TrainingSpec`` documents and as in veRL.
"""

from __future__ import annotations

import math
from typing import Literal

import torch

__all__ = ["LRSchedule", "build_lr_scheduler", "lr_factor"]

LRSchedule = Literal["constant", "linear", "cosine"]


def lr_factor(step: int, *, warmup_steps: int, total_steps: int, schedule: LRSchedule) -> float:
    """The fraction of the peak learning rate used at ``step`` (0-based count of scheduler steps).

    * Warmup, ``step < warmup_steps``: ``step / warmup_steps``, a line from 0 that reaches the
      peak at ``step == warmup_steps``. As in HF's and veRL's schedules, step 0 of a warmup runs
      at learning rate 0 (Adam's moments still see its gradients).
    * Then ``constant``: 1; ``linear``: falls linearly to 0 at ``total_steps``; ``cosine``:
      half a cosine from 1 to 0 at ``total_steps``. Past ``total_steps`` the decaying schedules
      stay at 0.
    """
    if step < warmup_steps:
        return step / warmup_steps
    if schedule == "constant":
        return 1.0
    decay_steps = total_steps - warmup_steps
    progress = 1.0 if decay_steps <= 0 else min(1.0, (step - warmup_steps) / decay_steps)
    if schedule == "linear":
        return 1.0 - progress
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer,
    *,
    warmup_steps: int,
    total_steps: int,
    schedule: LRSchedule,
) -> torch.optim.lr_scheduler.LambdaLR:
    """A ``LambdaLR`` following :func:`lr_factor`; ``scheduler.step()`` once per RL step.

    The factor is a closure over these arguments, not a callable object, so the scheduler's
    ``state_dict`` holds only counters and learning rates: a checkpoint restores where the
    schedule is, while its shape comes from the (possibly edited) job config of the resumed run.
    """
    if schedule not in ("constant", "linear", "cosine"):
        raise ValueError(f"schedule={schedule!r} is not one of 'constant', 'linear', 'cosine'")
    if total_steps < 1:
        raise ValueError(f"total_steps={total_steps} must be at least 1")
    if not 0 <= warmup_steps <= total_steps:
        raise ValueError(f"warmup_steps={warmup_steps} must lie in [0, total_steps={total_steps}]")

    def factor(step: int) -> float:
        return lr_factor(step, warmup_steps=warmup_steps, total_steps=total_steps, schedule=schedule)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
