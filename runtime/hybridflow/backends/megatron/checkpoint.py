"""A trained role's state (model, optimizer, LR scheduler) saved and restored with megatron's dist_checkpointing.

Format: a megatron-core distributed checkpoint in ``directory`` (``dist_checkpointing.save``
with its default ``torch_dist`` strategy, i.e. torch.distributed.checkpoint underneath: per-rank
``__<rank>_0.distcp`` shard files and ``.metadata``, plus megatron's ``common.pt`` and
``metadata.json``). It holds ``{"model": ..., "optimizer": ..., "scheduler": ...}``:

* ``model``: ``GPTModel.sharded_state_dict()``, every tensor a ``ShardedTensor`` with its global
  shape and this rank's offsets (TP and PP included; the fused SwiGLU ``linear_fc1`` through
  megatron's own factory), each DP replica group writing every piece once;
* ``optimizer``: the non-distributed optimizer's ``sharded_state_dict`` (Adam's moments sharded
  like their parameters; the step counter as common state);
* ``scheduler``: the ``LambdaLR`` counters, identical on every rank, kept in ``common.pt``.

Why dist_checkpointing and not torch DCP directly (as the FSDP backend does): megatron's
parameters are plain per-rank tensors, not DTensors, so DCP alone would see the same key with
different contents on every TP rank. ``sharded_state_dict`` supplies the global offsets, which
also makes the checkpoint loadable into another TP/PP layout. It runs the same on CPU (gloo,
in the tests) and CUDA.

Protocol (same as :mod:`hybridflow.backends.fsdp.checkpoint`): both functions are collectives
over the whole world with the same ``directory``, visible to every rank; :func:`save_train_state`
returns once everything is written (a barrier ends it); publishing atomically (save into a
temporary directory, rename) is the caller's job. :func:`load_train_state` expects a model,
optimizer and scheduler built exactly as for training (loaded, wrapped in DDP,
:func:`~hybridflow.backends.megatron.optim.build_optimizer`,
:func:`~hybridflow.backends.megatron.optim.build_lr_scheduler`) and overwrites their state.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.optimizer import MegatronOptimizer
from torch import nn

from hybridflow.backends.megatron.load import unwrap

__all__ = ["load_train_state", "save_train_state"]

_COMPLETE_MARKERS = ("metadata.json", ".metadata", "common.pt")


def _sharded_state(model: nn.Module, optimizer: MegatronOptimizer, *, is_loading: bool) -> dict[str, Any]:
    model_state = unwrap(model).sharded_state_dict()
    return {
        "model": model_state,
        "optimizer": optimizer.sharded_state_dict(model_state, is_loading=is_loading),
    }


def save_train_state(
    directory: Path,
    model: nn.Module,
    optimizer: MegatronOptimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
) -> None:
    """Write the model's and optimizer's shards and the scheduler's counters into ``directory``.

    Collective; see the module docstring. ``directory`` is created if needed and should be
    empty: dist_checkpointing writes over whatever is there (it only warns), and a stale shard
    file of a larger world would survive next to the new ones.
    """
    directory = Path(directory)
    if dist.get_rank() == 0:
        directory.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    state = _sharded_state(model, optimizer, is_loading=False)
    state["scheduler"] = scheduler.state_dict()
    dist_checkpointing.save(state, str(directory))
    dist.barrier()


def load_train_state(
    directory: Path,
    model: nn.Module,
    optimizer: MegatronOptimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
) -> None:
    """Restore what :func:`save_train_state` wrote into ``model``, ``optimizer`` and ``scheduler``.

    Collective; see the module docstring. Raises ``FileNotFoundError`` naming the missing file
    when ``directory`` is not a complete checkpoint (every rank checks the same files, so all
    raise together). The optimizer state is restored before the scheduler's, as in the FSDP
    backend, so the next ``scheduler.step()`` continues from the saved step.
    """
    directory = Path(directory)
    for required in _COMPLETE_MARKERS:
        if not (directory / required).is_file():
            raise FileNotFoundError(f"{directory} is not a train-state checkpoint: {required} is missing")
    state = _sharded_state(model, optimizer, is_loading=True)
    state["scheduler"] = scheduler.state_dict()
    loaded = dist_checkpointing.load(state, str(directory))
    unwrap(model).load_state_dict(loaded["model"])
    optimizer.load_state_dict(loaded["optimizer"])
    scheduler.load_state_dict(loaded["scheduler"])
