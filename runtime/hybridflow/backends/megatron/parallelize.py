"""Megatron's parallel state over the worker group's default process group, and its DDP wrapper.

Protocol: a worker process joins the role's ``torch.distributed`` world (NCCL on GPUs, gloo on
CPU; on CUDA it has also called ``torch.cuda.set_device(local_rank)``), then every rank calls
:func:`initialize_parallel_state` with the same sizes, before building any model. megatron-core
keeps its process groups in module globals, so there is one layout per process: the actor,
critic and reference colocated in one process must share it (calling again with the same sizes
is a no-op; other sizes raise). :func:`destroy_parallel_state` tears it down (tests switch
layouts with it).

Rank order: megatron's ``"tp-cp-ep-dp-pp"`` (tensor-parallel rank fastest, then data-parallel,
then pipeline stage), which is the controller's training layout,
:meth:`hybridflow.mesh.DeviceMesh.training`; :func:`initialize_parallel_state`
checks that every rank's megatron coordinates equal the mesh's, so the transfer protocols
(``is_output_rank``: TP rank 0 of the last stage) and the resharding plan address the ranks
megatron actually built.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.transformer.module import MegatronModule

from hybridflow.mesh import DeviceMesh, MeshCoord

__all__ = [
    "ParallelLayout",
    "current_layout",
    "destroy_parallel_state",
    "initialize_parallel_state",
    "wrap_data_parallel",
]


@dataclass(frozen=True)
class ParallelLayout:
    """This rank's place in megatron's parallel state: sizes and ranks along each axis."""

    tp_size: int
    pp_size: int
    dp_size: int
    tp_rank: int
    pp_rank: int
    dp_rank: int

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def mesh(self) -> DeviceMesh:
        """The controller's view of the same layout (:meth:`DeviceMesh.training`)."""
        return DeviceMesh.training(
            self.tp_size * self.pp_size * self.dp_size, pp=self.pp_size, tp=self.tp_size
        )


def current_layout() -> ParallelLayout:
    """The layout :func:`initialize_parallel_state` set up in this process."""
    if not parallel_state.model_parallel_is_initialized():
        raise RuntimeError(
            "megatron's parallel state is not initialised; call initialize_parallel_state first"
        )
    return ParallelLayout(
        tp_size=parallel_state.get_tensor_model_parallel_world_size(),
        pp_size=parallel_state.get_pipeline_model_parallel_world_size(),
        dp_size=parallel_state.get_data_parallel_world_size(),
        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
        pp_rank=parallel_state.get_pipeline_model_parallel_rank(),
        dp_rank=parallel_state.get_data_parallel_rank(),
    )


def initialize_parallel_state(*, tp_size: int, pp_size: int, seed: int = 0) -> ParallelLayout:
    """Build megatron's TP/PP/DP groups over the default process group; returns this rank's layout.

    Collective (every rank of the default group, same arguments). ``dp_size`` is
    ``world_size / (tp_size * pp_size)``. ``seed`` seeds megatron's tensor-parallel RNG tracker
    (``model_parallel_cuda_manual_seed``: one stream shared by a TP group's ranks, another
    offset per TP rank), which megatron's attention enters on every forward even with dropout
    0. Weights come from checkpoints, so no other randomness is involved.

    Only gloo groups for megatron's own use are skipped (``create_gloo_process_groups=False``):
    megatron's distributed optimizer needs them only for its legacy DP-gathering checkpoint
    formats, not for the ``fully_sharded_model_space`` format saved here
    (:mod:`~hybridflow.backends.megatron.checkpoint`), and on CPU every group is gloo already.
    """
    if not dist.is_initialized():
        raise RuntimeError(
            "initialize_parallel_state needs torch.distributed to be initialised (the worker joins its group first)"
        )
    world = dist.get_world_size()
    expected = DeviceMesh.training(world, pp=pp_size, tp=tp_size)  # raises MeshError on a bad layout
    if parallel_state.model_parallel_is_initialized():
        layout = current_layout()
        if (layout.tp_size, layout.pp_size) != (tp_size, pp_size):
            raise RuntimeError(
                f"megatron's parallel state is already initialised with tp={layout.tp_size} "
                f"pp={layout.pp_size}; one process holds one layout (asked for tp={tp_size} pp={pp_size})"
            )
        return layout
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp_size,
        pipeline_model_parallel_size=pp_size,
        create_gloo_process_groups=False,
    )
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    layout = current_layout()
    got = MeshCoord(pp=layout.pp_rank, tp=layout.tp_rank, dp=layout.dp_rank)
    if got != expected.coord(dist.get_rank()):
        raise RuntimeError(
            f"rank {dist.get_rank()}: megatron placed it at {got}, the controller's training mesh at "
            f"{expected.coord(dist.get_rank())}; the rank orders disagree"
        )
    return layout


def destroy_parallel_state() -> None:
    """Tear down megatron's process groups and global buffers (the default group stays).

    megatron's ``destroy_model_parallel`` only forgets its groups; each gloo group it built keeps
    its transport threads (three per group) and sockets alive, so a process that builds and
    tears down layouts again and again (a test that checks many layouts) gathers thousands of
    threads and slows to a crawl. The groups it held are therefore destroyed here too (a local
    operation: each rank shuts down its own end).
    """
    groups: dict[int, dist.ProcessGroup] = {}
    for value in vars(parallel_state).values():
        for item in value if isinstance(value, list | tuple) else (value,):
            if isinstance(item, dist.ProcessGroup) and item is not dist.GroupMember.WORLD:
                groups[id(item)] = item
    parallel_state.destroy_model_parallel()
    for group in groups.values():
        # ValueError: already destroyed, or a group another owner tore down.
        with contextlib.suppress(ValueError):
            dist.destroy_process_group(group)


def wrap_data_parallel(
    model: MegatronModule, *, grad_reduce_in_fp32: bool = True, distributed_optimizer: bool = True
) -> DistributedDataParallel:
    """Megatron's DDP around ``model`` (contiguous gradient buffers, reduced over DP), ready for training.

    Collective over the data-parallel group (DDP broadcasts nothing, but builds its buffers the
    same way on every rank). Gradients accumulate into each parameter's ``main_grad`` (fp32 with
    ``grad_reduce_in_fp32``, what bf16 training needs) across micro-batches and are reduced over
    the DP ranks once per mini-batch, by ``finalize_model_grads`` at the end of the
    forward/backward schedule (:func:`~hybridflow.backends.megatron.optim.forward_backward`).

    ``distributed_optimizer`` (the default; the job always uses it) prepares the buffers for
    megatron's distributed optimizer, which
    :func:`~hybridflow.backends.megatron.optim.build_optimizer` then builds (it reads the choice
    from the wrapper): DDP keeps every parameter as a view of one flat parameter buffer,
    reduce-scatters the gradients so that each DP rank gets the sum for the ``1/d`` of the
    buffer it owns, the optimizer keeps Adam's moments (and, under bf16, the fp32 main weights)
    for that ``1/d`` only, and after its step all-gathers the updated parameters over DP. With
    ``d = 1`` this holds the same bytes as the non-distributed optimizer. It is used at every DP
    size so that one checkpoint format serves every layout (a run resumes into another DP size).
    ``False`` builds megatron's non-distributed optimizer (every DP rank holds the whole state of
    its model-parallel shard): the tests compare the two.

    This installs on the shared ``TransformerConfig``: ``no_sync_func`` (no reduction until the
    last micro-batch) and ``finalize_model_grads_func``; the schedule reads both from there.
    """
    config = model.config
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=grad_reduce_in_fp32,
        overlap_grad_reduce=False,
        use_distributed_optimizer=distributed_optimizer,
        check_for_nan_in_grad=False,
    )
    wrapped = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
    config.no_sync_func = wrapped.no_sync
    config.finalize_model_grads_func = finalize_model_grads
    return wrapped
