"""The single controller: resource pools, worker groups, transfer protocols and the batch container.

The driver process writes the RL algorithm as plain sequential code over :class:`WorkerGroup`
objects; each group is an SPMD program across the GPUs of its :class:`ResourcePool`. See
``docs/architecture.md`` for the whole picture.
"""

from hybridflow.controller.batch import Batch, BatchError
from hybridflow.controller.bridge import Bridge, BridgeSpec
from hybridflow.controller.deployment import Deployment, RoleSpec, deploy
from hybridflow.controller.errors import (
    CallTimeoutError,
    ControllerError,
    RoleMappingError,
    WorkerDiedError,
    WorkerError,
    WorkerStalledError,
)
from hybridflow.controller.local_cluster import init_local_ray
from hybridflow.controller.protocols import (
    BROADCAST,
    DP_SPLIT,
    DP_SPLIT_EXACT,
    PER_RANK,
    RANK_ZERO,
    CallArgs,
    Dispatched,
    ProtocolError,
    TransferProtocol,
    register,
    split_by_dp,
)
from hybridflow.controller.resource_pool import PlacementError, ResourcePool, node_pool_resource
from hybridflow.controller.worker import BusyReport, Worker, WorkerContext
from hybridflow.controller.worker_group import GroupFuture, WorkerGroup
from hybridflow.mesh import DeviceMesh, MeshCoord, MeshError

__all__ = [
    "BROADCAST",
    "DP_SPLIT",
    "DP_SPLIT_EXACT",
    "PER_RANK",
    "RANK_ZERO",
    "Batch",
    "BatchError",
    "Bridge",
    "BridgeSpec",
    "BusyReport",
    "CallArgs",
    "CallTimeoutError",
    "ControllerError",
    "Deployment",
    "DeviceMesh",
    "Dispatched",
    "GroupFuture",
    "MeshCoord",
    "MeshError",
    "PlacementError",
    "ProtocolError",
    "ResourcePool",
    "RoleMappingError",
    "RoleSpec",
    "TransferProtocol",
    "Worker",
    "WorkerContext",
    "WorkerDiedError",
    "WorkerError",
    "WorkerGroup",
    "WorkerStalledError",
    "deploy",
    "init_local_ray",
    "node_pool_resource",
    "register",
    "split_by_dp",
]
