"""Resource pools: sets of GPUs reserved as Ray placement-group bundles.

A :class:`ResourcePool` is ``nodes x gpus_per_node`` bundles, one bundle per GPU. Each node's
bundles form one STRICT_PACK placement group, so a worker's local rank is meaningful and its
peers on the node can use shared memory / NVLink.

Binding to a Kubernetes node pool: on KubeRay every worker group that serves pool ``name``
advertises the custom resource :func:`node_pool_resource` (one unit per GPU) through its
``rayStartParams``; every bundle asks for one unit, so the bundles can only land on that worker
group's nodes. The embedded local cluster declares the same resources (see
:func:`simulated_cluster_resources`), so the same code places pools on a laptop.

Placement never hangs: :func:`place_pool` waits at most ``timeout_seconds`` and then removes what
it created and raises :class:`PlacementError` naming the pending demand and what the cluster has.
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass

import ray
from ray.util.placement_group import (
    PlacementGroup,
    placement_group,
    placement_group_table,
    remove_placement_group,
)

__all__ = [
    "PlacementError",
    "PoolPlacement",
    "ResourcePool",
    "node_pool_resource",
    "place_pool",
    "simulated_cluster_resources",
]

_POOL_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")


class PlacementError(RuntimeError):
    """A pool could not be reserved (names the pool, the demand and the cluster's resources)."""


def node_pool_resource(pool_name: str) -> str:
    """The Ray custom resource that ties a pool's bundles to its Kubernetes worker group."""
    return f"hybridflow-pool-{pool_name}"


@dataclass(frozen=True)
class ResourcePool:
    """``nodes`` x ``gpus_per_node`` GPUs for the roles mapped to this pool.

    ``cpus_per_gpu`` is reserved with each GPU bundle (data loading, tokenization, the Ray
    worker itself). ``bind_to_node_pool=False`` drops the custom resource, for plain Ray
    clusters that do not advertise it. ``torch_threads`` is each worker's torch intra-op thread
    count; None means ``int(cpus_per_gpu)`` (at least 1). Simulated pools on a CPU machine
    reserve a token CPU share but set it to their share of the cores, so the workers neither
    oversubscribe nor leave cores idle.
    """

    name: str
    nodes: int = 1
    gpus_per_node: int = 1
    cpus_per_gpu: float = 1.0
    bind_to_node_pool: bool = True
    torch_threads: int | None = None

    def __post_init__(self) -> None:
        if not _POOL_NAME.match(self.name):
            raise ValueError(
                f"resource pool name {self.name!r} is not a DNS-1123 label "
                "(lowercase letters, digits and '-', at most 63 characters)"
            )
        if self.nodes < 1:
            raise ValueError(f"resource pool {self.name!r}: nodes must be >= 1, got {self.nodes}")
        if self.gpus_per_node < 1:
            raise ValueError(
                f"resource pool {self.name!r}: gpus_per_node must be >= 1, got {self.gpus_per_node}"
            )
        if self.cpus_per_gpu <= 0:
            raise ValueError(
                f"resource pool {self.name!r}: cpus_per_gpu must be > 0, got {self.cpus_per_gpu}"
            )

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def threads_per_worker(self) -> int:
        return max(1, self.torch_threads if self.torch_threads is not None else int(self.cpus_per_gpu))

    def bundle(self) -> dict[str, float]:
        """Resources of one bundle (one GPU)."""
        resources = {"GPU": 1.0, "CPU": float(self.cpus_per_gpu)}
        if self.bind_to_node_pool:
            resources[node_pool_resource(self.name)] = 1.0
        return resources

    def demand(self) -> dict[str, float]:
        """Total resources of the pool."""
        return {k: v * self.world_size for k, v in self.bundle().items()}

    def describe(self) -> str:
        return f"{self.nodes} node(s) x {self.gpus_per_node} GPU(s), each bundle {self.bundle()}"


def simulated_cluster_resources(pools: Iterable[ResourcePool]) -> dict[str, float]:
    """Custom resources a single local Ray node declares to host ``pools`` (GPUs simulated)."""
    resources: dict[str, float] = {}
    for pool in pools:
        if pool.bind_to_node_pool:
            key = node_pool_resource(pool.name)
            resources[key] = resources.get(key, 0.0) + pool.world_size
    return resources


@dataclass(frozen=True)
class PoolPlacement:
    """The reserved bundles of one pool, in global-rank order: (placement group, bundle index)."""

    pool: ResourcePool
    groups: tuple[PlacementGroup, ...]

    @property
    def bundles(self) -> list[tuple[PlacementGroup, int]]:
        return [(pg, i) for pg in self.groups for i in range(self.pool.gpus_per_node)]

    def release(self, *, wait_seconds: float = 10.0) -> None:
        """Remove the placement groups and wait (bounded) until Ray reports them removed.

        Waiting makes a following deployment see the freed GPUs instead of racing the removal.
        """
        for pg in self.groups:
            # Best effort during teardown: the group may already be gone with the cluster.
            with contextlib.suppress(Exception):
                remove_placement_group(pg)
        deadline = time.monotonic() + wait_seconds
        for pg in self.groups:
            while time.monotonic() < deadline:
                try:
                    state = placement_group_table(pg).get("state")
                except Exception:  # the cluster is shutting down: nothing left to wait for
                    break
                if state == "REMOVED":
                    break
                time.sleep(0.05)


def _format_resources(resources: dict[str, float]) -> str:
    shown = {
        k: round(v, 3)
        for k, v in sorted(resources.items())
        if not k.startswith(("node:", "memory", "object_store"))
    }
    return str(shown)


def place_pool(pool: ResourcePool, *, timeout_seconds: float) -> PoolPlacement:
    """Reserve ``pool``: one STRICT_PACK placement group per node, all ready within the timeout.

    On timeout every group created here is removed and :class:`PlacementError` explains the
    pending demand against the cluster's total and currently available resources.
    """
    groups = tuple(
        placement_group(
            [pool.bundle()] * pool.gpus_per_node, strategy="STRICT_PACK", name=f"hybridflow-{pool.name}-{n}"
        )
        for n in range(pool.nodes)
    )
    ready_refs = [pg.ready() for pg in groups]
    _, pending = ray.wait(ready_refs, num_returns=len(ready_refs), timeout=timeout_seconds)
    if pending:
        placed = len(groups) - len(pending)
        PoolPlacement(pool, groups).release()
        total = ray.cluster_resources()
        available = ray.available_resources()
        raise PlacementError(
            f"resource pool {pool.name!r} could not be placed within {timeout_seconds:g} s: it needs "
            f"{pool.describe()} (in all {_format_resources(pool.demand())}); {placed} of {pool.nodes} "
            f"node group(s) were placed. Cluster total: {_format_resources(total)}; available now: "
            f"{_format_resources(available)}. Add nodes or GPUs, shrink the pool, or check that the "
            f"nodes advertise the custom resource {node_pool_resource(pool.name)!r}."
        )
    return PoolPlacement(pool, groups)
