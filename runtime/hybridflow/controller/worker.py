"""The worker side: role objects and the per-GPU process that hosts them.

Protocol between the controller (``worker_group.py``) and a host, in call order:

1. The controller creates one :class:`WorkerHost` Ray actor per bundle of a resource pool
   (one process per GPU) and asks each for its node (``node_id``).
2. Rank 0 opens the rendezvous: it binds a ``TCPStore`` on an OS-chosen free port and returns
   (address, port). Binding port 0 inside the store that will actually serve it is what makes
   the choice race-free: there is no window between picking a port and listening on it.
3. All ranks call ``join_process_group`` concurrently; each initialises ``torch.distributed``
   (gloo on CPU, nccl on CUDA) over that store. Every role in the host shares this group.
4. The controller instantiates each role mapped to the pool with ``add_role``: the role class
   is constructed with a :class:`WorkerContext` and the role's keyword arguments.
5. Controller calls arrive as ``execute(role, method, keep_result, *args, **kwargs)``. Ray runs
   one call at a time per actor, so colocated roles take turns on the GPU. ``keep_result=False``
   (ranks whose output the protocol does not collect) returns None instead of shipping data back.
6. Optionally, bridges to another pool (``bridge.py``): ``open_bridge`` on the source pool's
   rank 0, then ``join_bridge`` on every member; roles find them in ``ctx.bridges``.

Every host counts the seconds it spends inside ``execute`` (its pool's work, whichever role),
and of those the seconds ``torch.compile`` took, by ``role.method``; ``busy_report`` returns
them with the wall time since the previous report (a :class:`BusyReport`), from which the
trainer derives each pool's idle fraction, the controller's overhead and the compile phase per
step.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from hybridflow.controller.batch import Batch
from hybridflow.controller.bridge import Bridge, new_process_group
from hybridflow.devices import DeviceView, device_environment, view_of_process
from hybridflow.mesh import DeviceMesh, MeshCoord

__all__ = ["BusyReport", "Worker", "WorkerContext", "WorkerHost"]


@dataclass(frozen=True)
class BusyReport:
    """One host's work since its previous report (:meth:`WorkerHost.busy_report`).

    ``busy_seconds``: inside ``execute``; ``wall_seconds``: the whole interval;
    ``compile_seconds``: of the busy seconds, those ``torch.compile`` spent, by the
    ``"role.method"`` call that triggered them (empty when nothing compiled); ``calls``: each
    ``execute``'s (start, end) and ``window`` the interval's (start, end), in wall-clock seconds
    (``time.time()``, comparable with the controller's on one machine and within the clock
    skew across nodes), from which the trainer computes what the controller adds to a step.
    """

    busy_seconds: float
    wall_seconds: float
    compile_seconds: Mapping[str, float] = field(default_factory=dict)
    calls: tuple[tuple[float, float], ...] = ()
    window: tuple[float, float] = (0.0, 0.0)


MAX_REPORTED_CALLS = 4096
"""The most ``execute`` intervals a host keeps between two reports (the newest)."""


def _compile_seconds_so_far() -> float:
    """``torch.compile``'s seconds in this process; 0 (and nothing imported) before anything compiled."""
    if "torch._dynamo.utils" not in sys.modules:
        return 0.0
    from hybridflow.compilation import compile_seconds_so_far

    return compile_seconds_so_far()


@dataclass(frozen=True)
class WorkerContext:
    """Everything a role needs to know about where it runs."""

    role: str
    pool: str
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_id: str
    mesh: DeviceMesh
    device: str
    backend: str
    colocated_roles: Mapping[str, Any] = field(default_factory=dict, repr=False, compare=False)
    bridges: Mapping[str, Bridge] = field(default_factory=dict, repr=False, compare=False)
    """The bridges to other pools this rank is a member of, by name (see ``bridge.py``)."""

    @property
    def coord(self) -> MeshCoord:
        return self.mesh.coord(self.rank)

    def colocated(self, role: str) -> Any:
        """The object of another role hosted by this same process (e.g. the rollout's actor).

        This is how colocated roles hand each other data without the controller: the rollout
        pulls the actor's new weights in-process. Roles on other pools are not reachable here.
        """
        try:
            return self.colocated_roles[role]
        except KeyError:
            hosted = ", ".join(sorted(r for r in self.colocated_roles if r != self.role)) or "none"
            raise LookupError(
                f"role {self.role!r} needs role {role!r} in the same process, but this pool hosts: {hosted}; "
                f"map both roles to the same resource pool"
            ) from None

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)


class Worker:
    """Base class of a role (actor, critic, rollout, ...).

    Subclasses take ``(ctx, **kwargs)`` in their constructor and expose methods to the
    controller with :func:`hybridflow.controller.protocols.register`. ``torch.distributed`` is
    already initialised when the constructor runs.
    """

    def __init__(self, ctx: WorkerContext) -> None:
        self.ctx = ctx


def _node_ip() -> str:
    import ray

    return str(ray.util.get_node_ip_address())


class WorkerHost:
    """One process per GPU bundle; hosts every role of its pool (wrapped by ``ray.remote``)."""

    def __init__(self, pool: str, rank: int, world_size: int, cpu_threads: int) -> None:
        self.pool = pool
        self.rank = rank
        self.world_size = world_size
        self.local_rank = 0
        self.local_world_size = 1
        self._device_view = DeviceView(node_id="", visible=None, assigned=(), device_count=0, enforced=False)
        self.roles: dict[str, Any] = {}
        self.bridges: dict[str, Bridge] = {}
        self._store: dist.TCPStore | None = None
        self._bridge_stores: dict[str, dist.TCPStore] = {}
        self._busy_seconds = 0.0
        self._compile_seconds: dict[str, float] = {}
        # The calls since the last report; bounded for a deployment nobody asks (a user's own loop).
        self._calls: deque[tuple[float, float]] = deque(maxlen=MAX_REPORTED_CALLS)
        self._reported_at = time.monotonic()
        self._reported_at_wall = time.time()
        torch.set_num_threads(max(1, cpu_threads))
        os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size)})

    def node_id(self) -> str:
        import ray

        return str(ray.get_runtime_context().get_node_id())

    def set_local_rank(self, local_rank: int, local_world_size: int) -> DeviceView:
        """Record the rank's place on its node and export the launcher variables for its device.

        ``local_rank`` is the rank's position among the pool's ranks on this node. What is
        exported as ``LOCAL_RANK`` is the device index among the devices this process sees
        (``hybridflow.devices``: vLLM's GPU worker and torch hold the process to
        it). Returns the process's device view, from which the controller checks that no two
        workers share a device.
        """
        import ray

        self.local_rank, self.local_world_size = local_rank, local_world_size
        self._device_view = view_of_process(self.node_id(), ray.get_gpu_ids())
        os.environ.update(device_environment(self._device_view, local_rank, local_world_size))
        return self._device_view

    def device(self) -> str:
        # Ray restricts CUDA_VISIBLE_DEVICES to the bundle's GPU, so the index is 0 on a GPU node.
        return f"cuda:{self._device_view.device_index()}" if torch.cuda.is_available() else "cpu"

    def open_rendezvous(self, timeout_seconds: float) -> tuple[str, int]:
        """Rank 0 only: serve the process group's store on a free port chosen by the OS."""
        address = _node_ip()
        self._store = dist.TCPStore(
            address,
            0,
            self.world_size,
            is_master=True,
            timeout=timedelta(seconds=timeout_seconds),
            wait_for_workers=False,  # the peers connect in join_process_group
        )
        return address, int(self._store.port)

    def join_process_group(self, address: str, port: int, backend: str, timeout_seconds: float) -> str:
        timeout = timedelta(seconds=timeout_seconds)
        if self._store is None:
            self._store = dist.TCPStore(address, port, self.world_size, is_master=False, timeout=timeout)
        os.environ.update({"MASTER_ADDR": address, "MASTER_PORT": str(port)})
        if backend == "nccl":
            torch.cuda.set_device(self._device_view.device_index())
        dist.init_process_group(
            backend=backend, store=self._store, rank=self.rank, world_size=self.world_size, timeout=timeout
        )
        return socket.gethostname()

    def open_bridge(self, name: str, world_size: int, timeout_seconds: float) -> tuple[str, int]:
        """The source pool's rank 0 only: serve bridge ``name``'s store on a free port."""
        address = _node_ip()
        self._bridge_stores[name] = dist.TCPStore(
            address,
            0,
            world_size,
            is_master=True,
            timeout=timedelta(seconds=timeout_seconds),
            wait_for_workers=False,
        )
        return address, int(self._bridge_stores[name].port)

    def join_bridge(
        self,
        name: str,
        address: str,
        port: int,
        rank: int,
        world_size: int,
        backend: str,
        timeout_seconds: float,
    ) -> None:
        """Join bridge ``name`` as bridge rank ``rank``; returns when every member has joined."""
        timeout = timedelta(seconds=timeout_seconds)
        store = self._bridge_stores.get(name)
        if store is None:
            store = dist.TCPStore(address, port, world_size, is_master=False, timeout=timeout)
            self._bridge_stores[name] = store
        group = new_process_group(
            dist.PrefixStore(f"bridge/{name}", store), rank, world_size, backend, timeout
        )
        self.bridges[name] = Bridge(name, group, rank, world_size)

    def add_role(
        self, role: str, worker_cls: type, mesh: DeviceMesh, backend: str, kwargs: dict[str, Any]
    ) -> None:
        ctx = WorkerContext(
            role=role,
            pool=self.pool,
            rank=self.rank,
            world_size=self.world_size,
            local_rank=self.local_rank,
            local_world_size=self.local_world_size,
            node_id=self.node_id(),
            mesh=mesh,
            device=self.device(),
            backend=backend,
            colocated_roles=self.roles,
            bridges=self.bridges,
        )
        self.roles[role] = worker_cls(ctx, **kwargs)

    def execute(self, role: str, method: str, keep_result: bool, *args: Any, **kwargs: Any) -> Any:
        started, started_wall, compiled_before = time.monotonic(), time.time(), _compile_seconds_so_far()
        try:
            result = getattr(self.roles[role], method)(*args, **kwargs)
        finally:
            self._busy_seconds += time.monotonic() - started
            self._calls.append((started_wall, time.time()))
            compiled = _compile_seconds_so_far() - compiled_before
            if compiled > 0:
                call = f"{role}.{method}"
                self._compile_seconds[call] = self._compile_seconds.get(call, 0.0) + compiled
        if not keep_result:
            return None
        # Only the controller reads a result, so it may arrive there without a copy.
        return result.single_reader() if isinstance(result, Batch) else result

    def busy_report(self) -> BusyReport:
        """This host's work since the previous report (:class:`BusyReport`); starts a new interval."""
        now, now_wall = time.monotonic(), time.time()
        report = BusyReport(
            self._busy_seconds,
            now - self._reported_at,
            dict(self._compile_seconds),
            tuple(self._calls),
            (self._reported_at_wall, now_wall),
        )
        self._busy_seconds, self._compile_seconds = 0.0, {}
        self._calls.clear()
        self._reported_at, self._reported_at_wall = now, now_wall
        return report

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
