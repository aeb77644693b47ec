"""A trained role's state (model, optimizer, LR scheduler) saved and restored with megatron's dist_checkpointing.

Format: a megatron-core distributed checkpoint in ``directory`` (``dist_checkpointing.save``
with its default ``torch_dist`` strategy, i.e. torch.distributed.checkpoint underneath: per-rank
``__<rank>_0.distcp`` shard files and ``.metadata``, plus megatron's ``common.pt`` and
``metadata.json``). It holds ``{"model": ..., "optimizer": ..., "scheduler": ...}``:

* ``model``: ``GPTModel.sharded_state_dict()``, every tensor a ``ShardedTensor`` with its global
  shape and this rank's offsets (TP and PP included; the fused SwiGLU ``linear_fc1`` through
  megatron's own factory), each DP replica group writing every piece once;
* ``optimizer``: the optimizer's ``sharded_state_dict``. For megatron's distributed optimizer
  (what the backend builds) in its ``fully_reshardable`` format: Adam's moments (and bf16's
  fp32 main weights) are put back into the shape of their parameters, sharded like the
  parameters, so the checkpoint does not depend on how the DP ranks split the flat buffers and
  loads into any TP/PP/DP layout. Saving first all-gathers this model-parallel shard's
  optimizer state over the DP group, a transient ``d`` times the rank's own state (what a
  non-distributed optimizer would hold all the time); loading reads each parameter's whole state
  and keeps the rank's range. ``fully_sharded_model_space``, the format that would avoid the
  gather, is refused by megatron-core 0.16's checkpointing (``flattened_range`` is no longer
  supported). The non-distributed optimizer (tests only) writes the same keys, unflattened;
  the step counter is common state;
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
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from torch import nn

from hybridflow.backends.megatron.load import unwrap

__all__ = ["load_train_state", "save_train_state"]

_COMPLETE_MARKERS = ("metadata.json", ".metadata", "common.pt")


_OPTIMIZER_FORMAT = {"distrib_optim_sharding_type": "fully_reshardable"}
"""megatron's name for the distributed optimizer's layout-independent format (ignored by the
non-distributed optimizer)."""


def _sharded_state(model: nn.Module, optimizer: MegatronOptimizer, *, is_loading: bool) -> dict[str, Any]:
    model_state = unwrap(model).sharded_state_dict()
    return {
        "model": model_state,
        "optimizer": optimizer.sharded_state_dict(
            model_state, is_loading=is_loading, metadata=dict(_OPTIMIZER_FORMAT)
        ),
    }


def _allocate_optimizer_state(optimizer: MegatronOptimizer) -> None:
    """Give a distributed optimizer that has not stepped yet its Adam state, for the load to fill.

    torch's Adam creates its state at the first step, and megatron-core 0.16's distributed
    optimizer reads the step counter from that state when it builds the sharded state dict to
    load into, so a freshly built one fails there. Its own
    ``_init_optimizer_states_with_dummy_values`` (which later megatron-core releases call from
    ``sharded_state_dict`` themselves) takes one step with zero gradients; that step may move the
    main weights (weight decay), which the load then overwrites with the saved ones, together
    with the moments and the step counter.
    """
    chained: Any = optimizer
    for inner in getattr(chained, "chained_optimizers", [optimizer]):
        if isinstance(inner, DistributedOptimizer) and not inner.optimizer.state:
            inner._init_optimizer_states_with_dummy_values()


def _load_optimizer_state(optimizer: MegatronOptimizer, state: dict[str, Any]) -> None:
    """``optimizer.load_state_dict(state)``, past a megatron-core 0.16 bug of the torch-Adam fallback.

    With torch's Adam (no Apex/Transformer Engine, as on CPU) each parameter's state holds its
    ``step``; megatron's distributed optimizer writes the saved step into it and then copies the
    ``fully_reshardable`` parameter state key by key over every key of that state, ``step``
    included, which the checkpoint keeps in the param groups only (``KeyError: 'step'``). Here
    the param groups and step are loaded first (``load_state_dict`` without the parameter
    state), the steps are set aside while megatron's own
    ``load_parameter_state_from_fully_reshardable`` copies the weights and moments, and put
    back, one tensor per parameter. With a fused Adam (no per-parameter ``step``) megatron's
    ``load_state_dict`` runs as is.
    """
    chained: Any = optimizer
    inners = list(getattr(chained, "chained_optimizers", [optimizer]))
    inner = inners[0] if len(inners) == 1 else None
    if not (
        isinstance(inner, DistributedOptimizer)
        and "param_state" in state
        and any("step" in per_param for per_param in inner.optimizer.state.values())
    ):
        optimizer.load_state_dict(state)
        return
    state = dict(state)
    param_state = state.pop("param_state")
    sharding = state.pop("param_state_sharding_type")
    if sharding != _OPTIMIZER_FORMAT["distrib_optim_sharding_type"]:
        raise ValueError(f"optimizer checkpoint in format {sharding!r}, expected {_OPTIMIZER_FORMAT}")
    inner.load_state_dict(state)
    steps = {
        key: per_param.pop("step") for key, per_param in inner.optimizer.state.items() if "step" in per_param
    }
    try:
        inner.load_parameter_state_from_fully_reshardable(param_state)
    finally:
        # One tensor per parameter: megatron hands every parameter the same step tensor, which
        # torch's Adam increments in place once per parameter at the next step.
        for key, step in steps.items():
            inner.optimizer.state[key]["step"] = step.clone()


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
    _allocate_optimizer_state(optimizer)
    state = _sharded_state(model, optimizer, is_loading=True)
    state["scheduler"] = scheduler.state_dict()
    loaded = dist_checkpointing.load(state, str(directory))
    unwrap(model).load_state_dict(loaded["model"])
    _load_optimizer_state(optimizer, loaded["optimizer"])
    scheduler.load_state_dict(loaded["scheduler"])
