"""A trained role's state (model, optimizer, LR scheduler) saved and restored, sharded.

Format: one torch.distributed.checkpoint (DCP) checkpoint in ``directory`` holding
``{"model": ..., "optimizer": ...}`` as produced by
``torch.distributed.checkpoint.state_dict.get_state_dict`` (``DTensor`` shards: each rank writes
the slices it owns, ``__<rank>_0.distcp``, and rank 0 the ``.metadata``), plus
:data:`SCHEDULER_FILE`, a small ``torch.save`` of the scheduler's ``state_dict`` (counters and
learning rates; identical on every rank, so rank 0 writes it). DCP reshards on load: a
checkpoint saved by N ranks loads into M.

Protocol (callers: the workers' ``save_checkpoint`` / ``load_checkpoint``, driven by
:mod:`hybridflow.checkpoint`):

* Both functions are collectives: every rank of the role's group calls them with the same
  ``directory``, which every rank can read and write (a shared volume on a cluster).
* :func:`save_train_state` returns on each rank only once every rank's shard and the scheduler
  file are written (a barrier ends it), so the caller may publish the directory right after.
* Atomic publication is the caller's job: it saves into a fresh temporary directory and renames
  it into place once every role has saved, so a crash mid-save never leaves a directory that
  looks complete. This module writes into ``directory`` as given and never renames or deletes.
* :func:`load_train_state` expects a model and optimizer built exactly as for training (loaded,
  sharded, :func:`~hybridflow.backends.fsdp.optim.build_optimizer`, before any step) and a
  scheduler from :func:`~hybridflow.backends.fsdp.optim.build_lr_scheduler`; it overwrites
  their state in place.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

__all__ = ["SCHEDULER_FILE", "load_train_state", "save_train_state"]

SCHEDULER_FILE = "scheduler.pt"
_DCP_METADATA_FILE = ".metadata"


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def save_train_state(
    directory: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
) -> None:
    """Write the sharded model and optimizer state and the scheduler state into ``directory``.

    Collective; see the module docstring for the format and the protocol. ``directory`` is
    created if needed.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=directory)
    if _rank() == 0:
        torch.save(scheduler.state_dict(), directory / SCHEDULER_FILE)
    _barrier()


def load_train_state(
    directory: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
) -> None:
    """Restore what :func:`save_train_state` wrote into ``model``, ``optimizer`` and ``scheduler``.

    Collective; see the module docstring. Raises ``FileNotFoundError`` naming the missing file
    when ``directory`` is not a complete train-state checkpoint (every rank checks the same
    files, so all ranks raise together instead of some waiting in a collective).

    Order matters: the optimizer's parameter groups (learning rate included) come back with the
    optimizer state, then the scheduler's counters, so the next ``scheduler.step()`` continues
    the schedule from the saved step.
    """
    directory = Path(directory)
    for required in (_DCP_METADATA_FILE, SCHEDULER_FILE):
        if not (directory / required).is_file():
            raise FileNotFoundError(f"{directory} is not a train-state checkpoint: {required} is missing")
    # get_state_dict gives state dicts of the right structure and sharding (for a fresh optimizer it
    # first materialises Adam's state with a zero-learning-rate step, which leaves the weights as
    # they are); DCP fills them in place from the files, resharding as needed.
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state: dict[str, Any] = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(state, checkpoint_id=directory)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    scheduler.load_state_dict(torch.load(directory / SCHEDULER_FILE, weights_only=True))
