"""Full weights out of FSDP2 shards, a bounded bucket at a time (weight sync, export, tests).

The actor's weights live as ``DTensor`` shards (``Shard(0)``) across its group; the rollout
engine wants plain full tensors under HF names. :func:`iter_full_weight_buckets` gathers them in
buckets so that no rank ever holds more than the shards plus about one bucket of full tensors,
which is what lets a colocated engine receive a model larger than one rank's free memory.

Protocol (the caller is the actor worker's ``weight_buckets``, driven by the colocated rollout
worker on every rank):

* Collective and lockstep: each ``DTensor.full_tensor()`` is an all-gather over the group. Every
  rank must create the iterator and advance it to the end (or stop at the same bucket), in the
  same order relative to its other collectives. The order is the module's ``state_dict`` order,
  identical on all ranks, and the bucket boundaries are computed from shapes alone, before any
  communication, so every rank issues the same gathers.
* A yielded bucket is cleared in place (``list.clear()``) when the consumer asks for the next
  one, so its tensors are freed even if the consumer still holds the list. Consume a bucket
  (copy it into the engine) before advancing; keep a reference to a tensor only if you mean
  to keep that tensor alive.
* Names are ``state_dict`` keys, i.e. HF names (``model.layers.0.mlp.up_proj.weight``): FSDP2
  adds no prefix of its own, and wrapper prefixes that other tools add (activation
  checkpointing's ``_checkpoint_wrapped_module.``, ``torch.compile``'s ``_orig_mod.``, FSDP1's
  ``_fsdp_wrapped_module.``) are removed. Persistent buffers are included, as in a saved
  checkpoint. A tied weight appears under each of its names (gathered once per name), which is
  what ``load_state_dict``-style consumers expect.
* Tensors are fresh (never views of the live parameters) and lie on the parameters' device.
* With a ``meter`` (:class:`~hybridflow.resharding.meter.TrafficMeter`), each ``Shard(0)``
  parameter is gathered with an explicit ``all_gather_into_tensor`` of its local rows (padded
  to equal chunks, as FSDP2 pads) through the meter, so the bytes handed to the wire are
  counted; without one, ``DTensor.full_tensor()`` gathers it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from hybridflow.resharding.meter import TrafficMeter

__all__ = ["full_state_dict", "hf_name", "iter_full_weight_buckets"]

_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")

_FULL_STATE_DICT_BUCKET_BYTES = 1 << 30
""":func:`full_state_dict` keeps every tensor anyway, so its bucket size bounds no memory; a
large one just means fewer generator round trips."""


def hf_name(state_dict_key: str) -> str:
    """``state_dict_key`` without the module-wrapper prefixes listed in the module docstring."""
    for prefix in _WRAPPER_PREFIXES:
        state_dict_key = state_dict_key.replace(prefix, "")
    return state_dict_key


def _full_bytes(tensor: torch.Tensor, dtype: torch.dtype | None) -> int:
    # A DTensor's shape and numel are the global (full) ones, not the local shard's.
    return tensor.numel() * (dtype or tensor.dtype).itemsize


def _metered_gather(tensor: DTensor, dtype: torch.dtype | None, meter: TrafficMeter) -> torch.Tensor:
    """The full tensor of a 1-D ``Shard(0)`` DTensor, gathered through ``meter``."""
    if tensor.device_mesh.ndim != 1 or tuple(tensor.placements) != (Shard(0),):
        raise ValueError(
            f"metered weight gather supports FSDP2's 1-D Shard(0) parameters, got placements "
            f"{tuple(tensor.placements)} on a {tensor.device_mesh.ndim}-D mesh"
        )
    group = tensor.device_mesh.get_group()
    world = dist.get_world_size(group)
    local = tensor.to_local()
    if dtype is not None:
        local = local.to(dtype)
    rows = tensor.shape[0]
    chunk = -(-rows // world)  # torch.chunk's sizes: full chunks first, the trailing ranks short
    if local.shape[0] == chunk and local.is_contiguous():
        padded = local
    else:
        padded = local.new_zeros((chunk, *local.shape[1:]))
        padded[: local.shape[0]].copy_(local)
    out = local.new_empty((chunk * world, *local.shape[1:]))
    meter.all_gather_into_tensor(out, padded, group)
    return out if chunk * world == rows else out[:rows]


def _gather(
    tensor: torch.Tensor, dtype: torch.dtype | None, meter: TrafficMeter | None = None
) -> torch.Tensor:
    if isinstance(tensor, DTensor):
        if meter is not None:
            return _metered_gather(tensor, dtype, meter)
        # Cast the local shard before gathering: half the traffic when sending fp32 as bf16.
        local = tensor if dtype is None else cast(DTensor, tensor.to(dtype))
        return local.full_tensor()
    return tensor.to(dtype=dtype or tensor.dtype, copy=True)


def iter_full_weight_buckets(
    model: nn.Module,
    *,
    bucket_bytes: int,
    dtype: torch.dtype | None = None,
    meter: TrafficMeter | None = None,
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Yield lists of ``(HF name, full tensor)`` of at most ``bucket_bytes`` each, in a fixed order.

    A tensor larger than ``bucket_bytes`` forms a bucket of its own. ``dtype`` (default: keep
    each tensor's own) converts the weights for an engine that serves in another precision, and
    is what the byte budget counts. See the module docstring for the collective protocol and
    for when a bucket's tensors are released. Works on an unsharded model too (no collectives).
    """
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes={bucket_bytes} must be positive")
    # No torch.no_grad() here: a grad-mode context held across a yield would leak into the
    # consumer's code. state_dict() values are detached already, so nothing records a graph.
    plan: list[list[tuple[str, torch.Tensor]]] = []
    planned_bytes = 0
    for name, tensor in model.state_dict().items():
        size = _full_bytes(tensor, dtype)
        if not plan or (plan[-1] and planned_bytes + size > bucket_bytes):
            plan.append([])
            planned_bytes = 0
        plan[-1].append((name, tensor.detach()))
        planned_bytes += size
    for planned in plan:
        bucket = [(hf_name(name), _gather(tensor, dtype, meter)) for name, tensor in planned]
        yield bucket
        bucket.clear()


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every full weight, by HF name, on every rank (tests, export). Collective, like the above.

    Holds the whole model on every rank: fine for tests and small exports; weight sync should
    stream :func:`iter_full_weight_buckets` instead.
    """
    state: dict[str, torch.Tensor] = {}
    for bucket in iter_full_weight_buckets(model, bucket_bytes=_FULL_STATE_DICT_BUCKET_BYTES):
        state.update(bucket)
    return state
