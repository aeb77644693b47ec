"""An embedded single-node Ray cluster that hosts resource pools on a laptop or a CI machine.

Without GPUs the pools' GPUs are simulated: Ray schedules ``GPU`` as a plain counted resource,
the workers run on the CPU and use gloo. With GPUs, the real device count is used and must cover
the pools. The node also declares each pool's custom resource (one unit per GPU), exactly what a
KubeRay worker group for that pool advertises, so the placement code is the same in both places.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import ray
import torch

from hybridflow.controller.resource_pool import ResourcePool, simulated_cluster_resources

__all__ = ["init_local_ray", "start_reaper"]

# The write end of the reaper's pipe: held open (never written) for the life of the driver.
_reaper_pipe: int | None = None
_reaper: subprocess.Popen[bytes] | None = None


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
    start_reaper()
    ray.init(
        num_cpus=num_cpus or os.cpu_count() or 1,
        num_gpus=real_gpus or wanted_gpus,
        resources=simulated_cluster_resources(pools),
        include_dashboard=False,
        log_to_driver=True,
        configure_logging=False,
    )
    _tell_reaper_the_session()


def start_reaper() -> str:
    """Mark this process's future children and start the reaper that kills them when it exits.

    See ``hybridflow/controller/reaper.py`` for the protocol. Returns the run id the children
    carry in ``HYBRIDFLOW_RUN_ID``. Called once per driver, before Ray starts its processes.
    """
    global _reaper_pipe, _reaper
    from hybridflow.controller.reaper import RUN_ID_VARIABLE

    if _reaper_pipe is not None:
        return os.environ[RUN_ID_VARIABLE]
    run_id = secrets.token_hex(8)
    read_end, write_end = os.pipe()  # not inheritable: only this process holds the write end
    _reaper = subprocess.Popen(
        [sys.executable, "-I", str(Path(__file__).with_name("reaper.py")), run_id],
        stdin=read_end,
        stdout=subprocess.DEVNULL,
        start_new_session=True,  # outlives a kill of the driver's process group
        close_fds=True,
    )
    os.close(read_end)
    _reaper_pipe = write_end
    os.environ[RUN_ID_VARIABLE] = run_id
    return run_id


def _tell_reaper_the_session() -> None:
    """Hand Ray's session directory to the reaper: every Ray process keeps files open under it."""
    node = getattr(ray._private.worker, "_global_node", None)
    if _reaper_pipe is None or node is None:
        return
    os.write(_reaper_pipe, (node.get_session_dir_path() + "\n").encode())
