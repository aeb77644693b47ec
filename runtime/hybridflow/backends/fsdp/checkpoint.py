"""Sharded train state (model, optimizer, scheduler) with torch.distributed.checkpoint.

Collective: every rank writes its own shard into ``directory`` (a shared filesystem on a
cluster). The caller publishes the directory atomically (``hybridflow.checkpoint``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

__all__ = ["load_train_state", "save_train_state"]

SCHEDULER_FILE = "scheduler.pt"


def save_train_state(
    directory: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=str(directory))
    if dist.get_rank() == 0:
        torch.save(scheduler.state_dict(), directory / SCHEDULER_FILE)
    dist.barrier()


def load_train_state(
    directory: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
) -> None:
    if not (directory / SCHEDULER_FILE).is_file():
        raise FileNotFoundError(f"no train state in {directory} (missing {SCHEDULER_FILE})")
    model_state, optim_state = get_state_dict(model, optimizer)
    state: dict[str, Any] = {"model": model_state, "optimizer": optim_state}
    dcp.load(state, checkpoint_id=str(directory))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    scheduler.load_state_dict(torch.load(directory / SCHEDULER_FILE, weights_only=True))
