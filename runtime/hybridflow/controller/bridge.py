"""A collective group spanning two resource pools: how weights travel from the trainer's GPUs to the rollout's.

Each pool's processes share one ``torch.distributed`` world (``worker.py``); nothing in it
reaches another pool. A *bridge* is a second, independent process group over the members of two
pools, for data that must go from one pool to the other without passing through the controller
(the driver only tells both sides to start; the bytes go worker to worker, over NCCL on GPUs and
gloo on CPUs).

Members and ranks (:func:`bridge_members`): the source pool's rank 0 is bridge rank 0, the root of
every broadcast; the target pool's rank ``r`` is bridge rank ``1 + r``. The other source ranks are
not members: the weights they would send are the same full tensors rank 0 already holds
(FSDP gathers them on every rank), so including them would only add traffic.

Protocol, driven by :func:`hybridflow.controller.deployment.deploy` after every role is built:

1. The source pool's rank 0 opens a ``TCPStore`` for the bridge on a free port
   (``WorkerHost.open_bridge``), exactly as it does for its own pool.
2. Every member joins concurrently (``WorkerHost.join_bridge``): a ``ProcessGroupGloo`` (or
   ``ProcessGroupNCCL``) over a prefix of that store. The group is not registered with
   ``torch.distributed``'s default world (each pool already has one), so it is used through
   its own object, :meth:`Bridge.broadcast`, never the ``dist.*`` functions.
3. Roles reach their bridges as ``ctx.bridges[name]`` (members only). A collective on a bridge
   needs every member inside the same call: the controller submits the sending method on the
   source pool and the receiving method on the target pool together.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["Bridge", "BridgeMember", "BridgeSpec", "bridge_members", "new_process_group"]


@dataclass(frozen=True)
class BridgeSpec:
    """A bridge named ``name`` from the pool of ``source_role`` to the pool of ``target_role``."""

    name: str
    source_role: str
    target_role: str


@dataclass(frozen=True)
class BridgeMember:
    """One member of a bridge: which pool and pool rank, and its rank in the bridge."""

    side: str
    """``"source"`` or ``"target"``."""
    pool_rank: int
    bridge_rank: int


def bridge_members(target_world_size: int) -> list[BridgeMember]:
    """Every member of a bridge to a pool of ``target_world_size`` ranks, in bridge-rank order.

    >>> [(m.side, m.pool_rank, m.bridge_rank) for m in bridge_members(2)]
    [('source', 0, 0), ('target', 0, 1), ('target', 1, 2)]
    """
    if target_world_size < 1:
        raise ValueError(f"a bridge needs a target pool with ranks, got {target_world_size}")
    return [
        BridgeMember("source", 0, 0),
        *(BridgeMember("target", rank, 1 + rank) for rank in range(target_world_size)),
    ]


def new_process_group(store: dist.Store, rank: int, world_size: int, backend: str, timeout: timedelta) -> Any:
    """An unregistered process group of ``backend`` over ``store`` (see the module docstring).

    A c10d backend object (``ProcessGroupGloo``, ``ProcessGroupNCCL``): its collectives take a
    list of tensors and options and return a work handle.
    """
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world_size, timeout)
    if backend == "nccl":
        nccl = getattr(dist, "ProcessGroupNCCL", None)
        if nccl is None:
            raise RuntimeError("this torch build has no NCCL; a bridge over nccl needs the CUDA build")
        options = nccl.Options()
        options._timeout = timeout
        return nccl(store, rank, world_size, options)
    raise ValueError(f"bridge backend {backend!r}: expected 'gloo' or 'nccl'")


class Bridge:
    """A member's handle on a bridge: broadcasts from one bridge rank to all others."""

    def __init__(self, name: str, group: Any, rank: int, world_size: int) -> None:
        self.name = name
        self.rank = rank
        self.world_size = world_size
        self._group = group

    def broadcast(self, tensor: torch.Tensor, root: int) -> None:
        """Blocking broadcast of ``tensor`` (in place on the receivers) from bridge rank ``root``."""
        options = dist.BroadcastOptions()
        options.rootRank = root
        options.rootTensor = 0
        self._group.broadcast([tensor], options).wait()

    def __repr__(self) -> str:
        return f"Bridge({self.name!r}, rank {self.rank} of {self.world_size})"
