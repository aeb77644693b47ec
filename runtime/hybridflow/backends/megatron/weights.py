"""HF-named weights out of a TP/PP-sharded megatron model: full tensors bucket by bucket, or each rank's own shards.

Two views, for two consumers:

* :func:`iter_full_weight_buckets` (weight sync to an engine that wants whole tensors, export,
  tests): the same protocol as the FSDP backend's function of that name, so a worker can switch
  backends by import. Every rank ends up with every full tensor of the bucket.
* :func:`local_shards` (the 3D-HybridEngine, :mod:`hybridflow.resharding`): this rank's own
  pieces of the HF parameters, with where they sit in the full tensors, without communication.
  Megatron's TP rank ``r`` holds exactly the HF slices the resharding layout assigns to ``r``
  (see :mod:`~hybridflow.backends.megatron.convert`), so :func:`training_shard` hands them to
  the transfer as they are: views of the parameters, no copy where the layout allows.

Protocol of :func:`iter_full_weight_buckets` (callers: the actor worker's weight sync on every
rank, or a test):

* Collective over the whole world and lockstep: every rank creates the iterator and advances it
  to the end (or stops at the same bucket). Bucket boundaries and the order are computed from
  the architecture alone (HF ``state_dict`` order; the conversion units of
  :func:`~hybridflow.backends.megatron.convert.units`), identical on every rank, before any
  communication.
* Per bucket and per pipeline stage that owns part of it: the stage's ranks flatten their
  megatron tensors of those units into one buffer (cast to ``dtype`` first, so bf16 sync moves
  half the bytes), all-gather it across their TP group, and the stage broadcasts the gathered
  buffer to the other stages over each PP group. Every rank then converts the gathered megatron
  tensors to HF tensors locally (q/k/v and gate/up unfused, vocab padding dropped). DP replicas
  hold identical weights and do the same work independently: no traffic crosses DP.
* A bucket holds at most ``bucket_bytes`` of full HF tensors (a larger unit forms a bucket of
  its own; a unit, e.g. a layer's q/k/v, is never split). Peak extra memory is about twice a
  bucket (the gathered buffer and the HF tensors made from it).
* A yielded bucket is cleared in place (``list.clear()``) when the consumer asks for the next
  one; consume it before advancing.
* Names are HF names (``model.layers.0.self_attn.q_proj.weight``); a critic yields its backbone
  and ``value_head.weight`` / ``value_head.bias``. Tensors are fresh and lie on the parameters'
  device.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from torch import nn

from hybridflow.backends.megatron.convert import (
    Unit,
    hf_shapes,
    megatron_local_shapes,
    megatron_to_hf,
    megatron_to_hf_shards,
    units,
)
from hybridflow.backends.megatron.load import first_layer, model_info, owned_units, unwrap
from hybridflow.resharding.layout import Block
from hybridflow.resharding.transfer import TrainingShard

__all__ = [
    "LocalShard",
    "full_state_dict",
    "iter_full_weight_buckets",
    "local_shards",
    "shard_copy_bytes",
    "training_shard",
]

_FULL_STATE_DICT_BUCKET_BYTES = 1 << 30


@dataclass(frozen=True)
class LocalShard:
    """This rank's piece of one HF parameter and where it sits.

    ``full[index()] == tensor`` where ``full`` is the HF parameter: ``dim`` is the partition
    dimension (0 for column-parallel and vocab-parallel tensors, 1 for row-parallel ones,
    ``None`` for tensors every TP rank holds whole) and ``[start, stop)`` the range along it.
    ``tp_rank``/``tp_size`` and ``pp_rank``/``pp_size`` are megatron's coordinates of the rank,
    ``pp_rank`` being the stage that owns the parameter.

    ``tensor`` may be a view of the live parameter (norms, gate/up halves, vocab rows, row-
    parallel columns) or a copy (q/k/v when the rank holds several key/value groups): never
    write to it, and copy what must outlive the next optimizer step.
    """

    tensor: torch.Tensor
    dim: int | None
    start: int
    stop: int
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int

    def index(self) -> tuple[slice, ...]:
        """The tensor index of this piece in the full HF parameter."""
        if self.dim is None:
            return (slice(None),)
        return (*(slice(None),) * self.dim, slice(self.start, self.stop))


def local_shards(model: nn.Module) -> dict[str, LocalShard]:
    """This rank's HF pieces of the parameters its pipeline stage holds, by HF name, in HF order.

    Local: no communication. Works on the bare ``GPTModel`` and on its DDP wrapper.
    """
    info = model_info(model)
    gpt = unwrap(model)
    parameters = dict(gpt.named_parameters())
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    pp_size = parallel_state.get_pipeline_model_parallel_world_size()
    start = first_layer(model)
    shards: dict[str, LocalShard] = {}
    for unit in owned_units(model):
        local = {
            suffix: parameters[name].detach()
            for suffix, name in zip(unit.megatron_suffixes, unit.megatron_names(start), strict=True)
        }
        pieces = megatron_to_hf_shards(
            info.arch, unit, local, tp_rank=tp_rank, tp_size=tp_size, vocab_multiple=info.vocab_multiple
        )
        for name, piece in pieces.items():
            shards[name] = LocalShard(
                piece.tensor, piece.dim, piece.start, piece.stop, tp_rank, tp_size, pp_rank, pp_size
            )
    return shards


def training_shard(model: nn.Module, blocks: Sequence[Block]) -> TrainingShard:
    """This rank's slices as the resharding plan's training shard, handed over without a copy where the layout allows.

    Local, no communication. Each block is :func:`local_shards`' tensor for it: a view of the
    live parameter (norms, gate/up halves of ``linear_fc1``, vocabulary rows, row-parallel
    weights whole, and q/k/v when the rank holds one key/value group, whose rows of
    ``linear_qkv`` are then [q; k; v] back to back). Only q/k/v of a rank holding several groups
    is a copy: megatron interleaves them per group, so the rank's HF q rows are not contiguous
    there; :func:`shard_copy_bytes` counts it. The views read the parameters' current values:
    use the shard before the next optimizer step changes them.
    """
    pieces = {name: shard.tensor for name, shard in local_shards(model).items()}
    return TrainingShard.of_tensors(blocks, pieces)


def shard_copy_bytes(model: nn.Module, shard: TrainingShard) -> int:
    """Bytes of ``shard``'s tensors that do not live in ``model``'s parameter storages: its copies (by storage pointer)."""
    live = {param.untyped_storage().data_ptr() for param in model.parameters()}
    return sum(
        tensor.numel() * tensor.element_size()
        for _, tensor in shard.tensors()
        if tensor.untyped_storage().data_ptr() not in live
    )


def _owner_stage(unit: Unit, *, num_layers: int, pp_size: int) -> int:
    if unit.section == "embedding":
        return 0
    if unit.section == "head":
        return pp_size - 1
    assert unit.layer is not None
    return unit.layer // (num_layers // pp_size)


def _plan(model_units: list[Unit], unit_bytes: list[int], bucket_bytes: int) -> list[list[int]]:
    """Unit indices grouped into buckets of at most ``bucket_bytes`` (one oversized unit alone)."""
    plan: list[list[int]] = []
    planned = 0
    for index, size in enumerate(unit_bytes):
        if not plan or (plan[-1] and planned + size > bucket_bytes):
            plan.append([])
            planned = 0
        plan[-1].append(index)
        planned += size
    return plan


def iter_full_weight_buckets(
    model: nn.Module, *, bucket_bytes: int, dtype: torch.dtype | None = None
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Yield lists of ``(HF name, full tensor)`` of at most ``bucket_bytes`` each, in HF order, on every rank.

    ``dtype`` (default: the parameters' own) converts the weights, and is what the byte budget
    counts. See the module docstring for the collective protocol. Works on the bare
    ``GPTModel`` and on its DDP wrapper.
    """
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes={bucket_bytes} must be positive")
    info = model_info(model)
    arch = info.arch
    gpt = unwrap(model)
    parameters = dict(gpt.named_parameters())
    any_parameter = next(iter(parameters.values()))
    device = any_parameter.device
    out_dtype = dtype or any_parameter.dtype
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    pp_size = parallel_state.get_pipeline_model_parallel_world_size()
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    tp_group = parallel_state.get_tensor_model_parallel_group()
    pp_group = parallel_state.get_pipeline_model_parallel_group()
    pp_ranks = dist.get_process_group_ranks(pp_group) if pp_size > 1 else []
    start = first_layer(model)
    model_units = units(arch, value_head=info.value_head)
    local_shapes = [
        megatron_local_shapes(arch, unit, tp_size=tp_size, vocab_multiple=info.vocab_multiple)
        for unit in model_units
    ]
    unit_bytes = [
        sum(torch.Size(shape).numel() for shape in hf_shapes(arch, unit).values()) * out_dtype.itemsize
        for unit in model_units
    ]
    owners = [_owner_stage(unit, num_layers=arch.num_layers, pp_size=pp_size) for unit in model_units]

    for bucket_units in _plan(model_units, unit_bytes, bucket_bytes):
        gathered: dict[int, list[dict[str, torch.Tensor]]] = {}
        for stage in sorted({owners[index] for index in bucket_units}):
            stage_units = [index for index in bucket_units if owners[index] == stage]
            sizes = [
                (index, suffix, shape)
                for index in stage_units
                for suffix, shape in local_shapes[index].items()
            ]
            numel = sum(torch.Size(shape).numel() for _, _, shape in sizes)
            if stage == pp_rank:
                flat = torch.cat(
                    [
                        parameters[name].detach().to(out_dtype).reshape(-1)
                        for index in stage_units
                        for name in model_units[index].megatron_names(start)
                    ]
                )
                if tp_size > 1:
                    chunks = [torch.empty_like(flat) for _ in range(tp_size)]
                    dist.all_gather(chunks, flat, group=tp_group)
                    stacked = torch.cat(chunks)
                else:
                    stacked = flat
            else:
                stacked = torch.empty(tp_size * numel, dtype=out_dtype, device=device)
            if pp_size > 1:
                dist.broadcast(stacked, src=pp_ranks[stage], group=pp_group)
            per_rank = stacked.view(tp_size, numel)
            for index in stage_units:
                gathered[index] = [{} for _ in range(tp_size)]
            offset = 0
            for index, suffix, shape in sizes:
                width = torch.Size(shape).numel()
                for rank in range(tp_size):
                    gathered[index][rank][suffix] = per_rank[rank, offset : offset + width].view(shape)
                offset += width
        bucket: list[tuple[str, torch.Tensor]] = []
        for index in bucket_units:
            full = megatron_to_hf(
                arch, model_units[index], gathered[index], vocab_multiple=info.vocab_multiple
            )
            bucket.extend(full.items())
        del gathered
        yield bucket
        bucket.clear()


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every full weight, by HF name, on every rank (tests, export). Collective, like the above."""
    state: dict[str, torch.Tensor] = {}
    for bucket in iter_full_weight_buckets(model, bucket_bytes=_FULL_STATE_DICT_BUCKET_BYTES):
        state.update(bucket)
    return state
