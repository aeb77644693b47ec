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
* A bucket's ``Shard(0)`` parameters are gathered with one ``all_gather_into_tensor`` of the
  rank's local rows of all of them (each padded to equal chunks, as FSDP2 pads), through the
  ``meter`` (:class:`~hybridflow.resharding.meter.TrafficMeter`) when one is given, so the bytes
  handed to the wire are counted. A bucket thus costs one collective, not one per tensor, and
  briefly holds twice its size (the gathered rows and the full tensors cut from them).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
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


def _is_fsdp_shard(tensor: torch.Tensor) -> bool:
    return (
        isinstance(tensor, DTensor)
        and tensor.device_mesh.ndim == 1
        and tuple(tensor.placements) == (Shard(0),)
    )


def _gather_shards(
    tensors: list[DTensor], dtype: torch.dtype, meter: TrafficMeter | None
) -> list[torch.Tensor]:
    """The full tensors of FSDP2 ``Shard(0)`` DTensors on one mesh, in ``dtype``, with one all-gather.

    Each rank lays its local rows of every tensor, padded to ``ceil(rows / world)`` rows as FSDP2
    pads them and cast to ``dtype``, end to end in one flat buffer; one
    ``all_gather_into_tensor`` (through ``meter`` when given) brings every rank's buffer; each
    full tensor is then copied out of the gathered rows (rank-major, so a tensor's rows are not
    contiguous there). One collective per bucket instead of one per tensor: per-call latency
    dominates a gloo or NCCL gather of small tensors. Transient memory: the gathered buffer and
    the full tensors, two buckets' worth, until the buffer is dropped on return.
    """
    group = tensors[0].device_mesh.get_group()
    world = dist.get_world_size(group)
    chunk_rows = [-(-t.shape[0] // world) for t in tensors]  # torch.chunk's sizes: trailing ranks short
    row_numels = [math.prod(t.shape[1:]) for t in tensors]
    sizes = [rows * numel for rows, numel in zip(chunk_rows, row_numels, strict=True)]
    device = tensors[0].to_local().device
    flat = torch.zeros(sum(sizes), dtype=dtype, device=device)
    offset = 0
    for tensor, size in zip(tensors, sizes, strict=True):
        local = tensor.to_local().reshape(-1)
        flat[offset : offset + local.numel()].copy_(local)  # the padding rows stay 0
        offset += size
    output = flat.new_empty(world * flat.numel())  # the collective concatenates along dim 0
    if meter is not None:
        meter.all_gather_into_tensor(output, flat, group)
    else:
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(output, flat, group=group)
    gathered = output.view(world, flat.numel())
    full: list[torch.Tensor] = []
    offset = 0
    for tensor, size, rows in zip(tensors, sizes, chunk_rows, strict=True):
        # A copy where the rows are strided across ranks; the padding rows are cut off as a view.
        full.append(
            gathered[:, offset : offset + size].reshape(world * rows, *tensor.shape[1:])[: tensor.shape[0]]
        )
        offset += size
    return full


def _gather_bucket(
    planned: list[tuple[str, torch.Tensor]], dtype: torch.dtype | None, meter: TrafficMeter | None
) -> list[tuple[str, torch.Tensor]]:
    """``(HF name, full tensor)`` of one planned bucket, in its order: one gather per dtype among its shards."""
    shards: dict[torch.dtype, list[int]] = {}
    for index, (name, tensor) in enumerate(planned):
        if _is_fsdp_shard(tensor):
            shards.setdefault(dtype or tensor.dtype, []).append(index)
        elif isinstance(tensor, DTensor):
            raise ValueError(
                f"{name}: weight gather supports FSDP2's 1-D Shard(0) parameters, got placements "
                f"{tuple(tensor.placements)} on a {tensor.device_mesh.ndim}-D mesh"
            )
    full: dict[int, torch.Tensor] = {}
    for out_dtype, indices in shards.items():
        tensors = [cast(DTensor, planned[index][1]) for index in indices]
        if len({id(tensor.device_mesh.get_group()) for tensor in tensors}) > 1:
            raise ValueError(
                "a bucket's FSDP shards span more than one process group; expected the model's one"
            )
        full.update(zip(indices, _gather_shards(tensors, out_dtype, meter), strict=True))
    return [
        (hf_name(name), full[index] if index in full else tensor.to(dtype=dtype or tensor.dtype, copy=True))
        for index, (name, tensor) in enumerate(planned)
    ]


def iter_full_weight_buckets(
    model: nn.Module,
    *,
    bucket_bytes: int,
    dtype: torch.dtype | None = None,
    meter: TrafficMeter | None = None,
    keep: Callable[[str], bool] | None = None,
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Yield lists of ``(HF name, full tensor)`` of at most ``bucket_bytes`` each, in a fixed order.

    A tensor larger than ``bucket_bytes`` forms a bucket of its own. ``dtype`` (default: keep
    each tensor's own) converts the weights for an engine that serves in another precision, and
    is what the byte budget counts. ``keep`` (default: all) selects tensors by HF name, e.g. a
    LoRA adapter's alone; it decides from names only, so every rank gathers the same tensors.
    See the module docstring for the collective protocol and for when a bucket's tensors are
    released. Works on an unsharded model too (no collectives).
    """
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes={bucket_bytes} must be positive")
    # No torch.no_grad() here: a grad-mode context held across a yield would leak into the
    # consumer's code. state_dict() values are detached already, so nothing records a graph.
    plan: list[list[tuple[str, torch.Tensor]]] = []
    planned_bytes = 0
    for name, tensor in model.state_dict().items():
        if keep is not None and not keep(hf_name(name)):
            continue
        size = _full_bytes(tensor, dtype)
        if not plan or (plan[-1] and planned_bytes + size > bucket_bytes):
            plan.append([])
            planned_bytes = 0
        plan[-1].append((name, tensor.detach()))
        planned_bytes += size
    for planned in plan:
        bucket = _gather_bucket(planned, dtype, meter)
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
