"""An embedded single-node Ray cluster that hosts resource pools on a laptop or a CI machine.

Without GPUs the pools' GPUs are simulated: Ray schedules ``GPU`` as a plain counted resource,
the workers run on the CPU and use gloo. With GPUs, the real device count is used and must cover
the pools. The node also declares each pool's custom resource (one unit per GPU), exactly what a
KubeRay worker group for that pool advertises, so the placement code is the same in both places.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import ray
import torch

from hybridflow.controller.resource_pool import ResourcePool, simulated_cluster_resources

__all__ = ["init_local_ray"]


def init_local_ray(pools: Sequence[ResourcePool], *, num_cpus: int | None = None) -> None:
    """Start (or join, if already running in this process) an embedded Ray sized for ``pools``."""
    if ray.is_initialized():
        return
    wanted_gpus = sum(p.world_size for p in pools)
    real_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if real_gpus and real_gpus < wanted_gpus:
        raise RuntimeError(
            f"the resource pools need {wanted_gpus} GPUs but this machine has {real_gpus}; "
            "shrink spec.resourcePools or run on a cluster"
        )
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(
        num_cpus=num_cpus or os.cpu_count() or 1,
        num_gpus=real_gpus or wanted_gpus,
        resources=simulated_cluster_resources(pools),
        include_dashboard=False,
        log_to_driver=True,
        configure_logging=False,
    )
