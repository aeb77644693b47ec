"""``spec.resourcePools`` and ``spec.roles``: the GPUs of the job, and which role runs where.

A resource pool is a set of identical GPU nodes; in a cluster it becomes one KubeRay worker
group (replicas = nodes) carrying a Ray custom resource named after the pool, so the placement
groups of its roles land on exactly those pods. Roles on the same pool are colocated: one
process per GPU hosts all of them and runs their calls one after another. Roles on different
pools run in parallel. Small clusters do best with everything colocated, which is the default.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, StringConstraints

from hybridflow.spec.base import SpecModel
from hybridflow.spec.security import ContainerSecurityOverride

DNS_LABEL_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
"""RFC 1123 label: pool names become parts of Kubernetes object names and Ray resource names."""

MEMORY_QUANTITY_PATTERN = r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$"
"""A positive Kubernetes memory quantity such as ``80Gi`` or ``500M``."""

DEVICE_COUNT_PATTERN = r"^[1-9][0-9]{0,5}$"
"""A whole, positive count: Kubernetes takes extended resources (RDMA, EFA) only as integers."""

PoolName = Annotated[str, StringConstraints(pattern=DNS_LABEL_PATTERN, max_length=63)]

RoleName = Literal["actor", "rollout", "reference", "critic", "reward", "cost"]

DEFAULT_POOL_NAME = "default"

GpuType = Literal[
    "A100-40GB",
    "A100-80GB",
    "A100-PCIe-40GB",
    "A100-PCIe-80GB",
    "H100-80GB",
    "H100-PCIe",
    "H200",
    "L40S",
    "L4",
    "A10G",
    "A10",
]
"""``spec.resourcePools[].gpuType``: the GPUs the placement planner knows (``hybridflow.planner.gpus``
holds each one's datasheet constants; a test keeps the two lists equal). Without a suffix the A100s,
the H100 and the H200 are the SXM modules (NVLink in the node); the PCIe cards talk over PCIe."""

GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"
"""The node label NVIDIA GPU feature discovery sets to the GPU's name with dashes for spaces
(``NVIDIA-H100-80GB-HBM3``); a pool's ``nodeSelector`` on it tells the planner the GPU type."""


class ResourcePoolSpec(SpecModel):
    """A set of identical GPU nodes, and how to schedule pods onto them."""

    name: PoolName = Field(
        description="Pool name, referenced from spec.roles; a DNS-1123 label (lowercase, digits, '-').",
    )
    nodes: int = Field(
        default=1,
        ge=1,
        description="Number of nodes (pods, one per node) in the pool.",
    )
    gpus_per_node: int = Field(
        default=1,
        ge=1,
        le=64,
        description=(
            "GPUs used on each node; one worker process per GPU. Local runs without GPUs simulate them "
            "and train on the CPU."
        ),
    )
    cpus_per_gpu: int = Field(
        default=4,
        ge=1,
        description="CPU cores requested per GPU in each pod (data loading, tokenization). Cluster only.",
    )
    memory_per_gpu: str | None = Field(
        default=None,
        pattern=MEMORY_QUANTITY_PATTERN,
        max_length=32,
        description=(
            "Host memory requested and limited per GPU in each pod, as a Kubernetes quantity such as "
            "'64Gi'. Unset: no memory request or limit. Cluster only."
        ),
    )
    gpu_type: GpuType | None = Field(
        default=None,
        description=(
            "The pool's GPU model, which spec.placement auto and `hybridflow plan` plan for "
            f"(docs/placement.md). Unset: read from the nodeSelector label {GPU_PRODUCT_LABEL} that NVIDIA "
            "GPU feature discovery sets (e.g. NVIDIA-H100-80GB-HBM3); a local `hybridflow run` reads its "
            "CUDA device instead, whose name this field overrides. It schedules nothing: pair it with a "
            "nodeSelector."
        ),
    )
    node_selector: dict[str, str] = Field(
        default_factory=dict,
        description=(
            "Node labels the pool's pods require, e.g. {cloud.google.com/gke-accelerator: nvidia-h100-80gb}."
        ),
    )
    tolerations: tuple[dict[str, Any], ...] = Field(
        default=(),
        max_length=32,
        description=(
            "Kubernetes tolerations for the pool's pods (core/v1 Toleration objects), e.g. for "
            "tainted GPU nodes."
        ),
    )
    affinity: dict[str, Any] = Field(
        default_factory=dict,
        description="Kubernetes affinity for the pool's pods (a core/v1 Affinity object).",
    )

    extra_resources: dict[str, Annotated[str, StringConstraints(pattern=DEVICE_COUNT_PATTERN)]] = Field(
        default_factory=dict,
        description=(
            "Extra extended resources each worker pod requests and limits, e.g. "
            "{rdma/ib: '1', vpc.amazonaws.com/efa: '4'} for RDMA or EFA networking."
        ),
    )
    container_security_context: ContainerSecurityOverride = Field(
        default_factory=ContainerSecurityOverride,
        description=(
            "Keys merged over the workers' restricted container security context, from an allow-list, "
            "e.g. {capabilities: {add: [IPC_LOCK]}} for RDMA; the namespace must then admit the pod."
        ),
    )

    @property
    def world_size(self) -> int:
        """GPUs in the pool, hence worker processes: nodes * gpusPerNode."""
        return self.nodes * self.gpus_per_node


class RolePlacementSpec(SpecModel):
    """The pool each role runs on. Unset roles share the actor's pool (colocated)."""

    actor: PoolName = Field(
        default=DEFAULT_POOL_NAME,
        description="Pool of the actor (the trained policy).",
    )
    rollout: PoolName | None = Field(
        default=None,
        description=(
            "Pool of generation. Default: the actor's pool, where the 3D-HybridEngine reshards the "
            "actor's weights in place instead of sending them over the network."
        ),
    )
    reference: PoolName | None = Field(
        default=None,
        description="Pool of the reference model. Default: the actor's pool.",
    )
    critic: PoolName | None = Field(
        default=None,
        description="Pool of the critic; needs spec.models.critic. Default: the actor's pool.",
    )
    reward: PoolName | None = Field(
        default=None,
        description="Pool of the reward model; needs spec.models.reward. Default: the actor's pool.",
    )
    cost: PoolName | None = Field(
        default=None,
        description="Pool of the cost model; needs spec.models.cost. Default: the actor's pool.",
    )

    def pool_of(self, role: RoleName) -> str:
        """The pool ``role`` runs on, after applying the colocate-with-the-actor default."""
        explicit: str | None = getattr(self, role)
        return explicit if explicit is not None else self.actor


PlacementMode = Literal["manual", "auto"]
"""``spec.placement``: ``manual`` runs the pools, roles and parallel sizes as written; ``auto``
treats the single pool of ``spec.resourcePools`` as the GPU budget and node shape and lets the
placement planner (``hybridflow plan``, ``docs/placement.md``) choose pools, roles and
parallel sizes before the job starts."""

PLACEMENT_DESCRIPTION = (
    "How pools, roles and parallel sizes are chosen. 'manual' (default): as written in "
    "spec.resourcePools, spec.roles, spec.training and spec.rollout. 'auto': the single pool of "
    "spec.resourcePools is the GPU budget (nodes * gpusPerNode) and node shape; the placement "
    "planner cuts it into pools, places the roles and sets training.tensorParallelSize, "
    "training.pipelineParallelSize and rollout.tensorParallelSize from the best plan of its cost "
    "model (see `hybridflow plan`). The chosen plan is printed in the job's log."
)
