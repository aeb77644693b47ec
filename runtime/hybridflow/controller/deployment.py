"""Placing roles on resource pools: the controller's entry point to a running set of workers.

``deploy(pools, roles)`` reserves every pool that has roles, starts one :class:`WorkerHost`
process per GPU bundle, joins each pool's hosts into one ``torch.distributed`` group, and
constructs every role inside the hosts of its pool. Roles that share a pool are colocated: the
same process per GPU hosts all of them (actor + rollout + reference, say) and runs their calls one
after another, while the controller still addresses each role as its own :class:`WorkerGroup`.
Roles on different pools live in different processes and run in parallel.

Bridges (``bridges=[BridgeSpec("weights", "actor", "rollout")]``) are collective groups across
two pools, built after every role (``bridge.py``): the only way data moves between pools without
the controller.

Any failure while deploying (an unknown pool, a pool that cannot be placed in time, a role whose
constructor raises) tears down what was started and raises an error naming the role or pool.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import ray
from ray.actor import ActorHandle
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from hybridflow.controller.bridge import BridgeSpec, bridge_members
from hybridflow.controller.errors import RoleMappingError
from hybridflow.controller.resource_pool import PoolPlacement, ResourcePool, place_pool
from hybridflow.controller.worker import BusyReport, Worker, WorkerHost
from hybridflow.controller.worker_group import RankPlacement, WorkerGroup, wait_for_ranks
from hybridflow.devices import DeviceView, check_one_process_per_device
from hybridflow.mesh import DeviceMesh, MeshError

__all__ = ["Deployment", "RoleSpec", "deploy"]


@dataclass(frozen=True)
class RoleSpec:
    """A role: its worker class, the pool it runs on, its mesh (default: pure DP) and constructor kwargs."""

    worker_cls: type[Worker]
    pool: str
    mesh: DeviceMesh | None = None
    kwargs: Mapping[str, Any] = field(default_factory=dict)


class Deployment:
    """The running worker groups of a job, by role. Use as a context manager or call ``shutdown``."""

    def __init__(
        self,
        groups: dict[str, WorkerGroup],
        hosts: dict[str, list[ActorHandle]],
        placements: list[PoolPlacement],
        device_views: dict[str, DeviceView] | None = None,
    ) -> None:
        self.groups = groups
        self._hosts = hosts
        self._placements = placements
        self.device_views = dict(device_views or {})
        """Each worker's view of its GPU, by ``"pool 'name' rank r"`` (``hybridflow/devices.py``)."""

    def __getitem__(self, role: str) -> WorkerGroup:
        try:
            return self.groups[role]
        except KeyError:
            raise KeyError(f"no role {role!r} in this deployment; roles: {sorted(self.groups)}") from None

    def host(self, pool: str, rank: int) -> ActorHandle:
        """The worker process of ``pool``'s rank ``rank`` (the rollout service opens its bridge there)."""
        return self._hosts[pool][rank]

    def colocated(self, role_a: str, role_b: str) -> bool:
        return self[role_a].pool == self[role_b].pool

    def busy_reports(self) -> dict[str, list[BusyReport]]:
        """Per pool, each rank's :class:`BusyReport` since the previous call (``WorkerHost.busy_report``).

        Queued behind the calls already submitted to each host, so the interval of a host ends
        after its pending work: call it where the pools meet (the end of a step).
        """
        refs = {pool: [host.busy_report.remote() for host in hosts] for pool, hosts in self._hosts.items()}
        return {pool: list(ray.get(pool_refs)) for pool, pool_refs in refs.items()}

    def shutdown(self) -> None:
        for hosts in self._hosts.values():
            for host in hosts:
                ray.kill(host, no_restart=True)
        for placement in self._placements:
            placement.release()
        self._hosts, self._placements = {}, []

    def __enter__(self) -> Deployment:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.shutdown()


def _validate(pools: Sequence[ResourcePool], roles: Mapping[str, RoleSpec]) -> dict[str, DeviceMesh]:
    by_name = {p.name: p for p in pools}
    if len(by_name) != len(pools):
        names = [p.name for p in pools]
        raise RoleMappingError(f"resource pool names must be unique, got {names}")
    if not roles:
        raise RoleMappingError("no roles to deploy")
    meshes: dict[str, DeviceMesh] = {}
    for role, spec in roles.items():
        if spec.pool not in by_name:
            known = ", ".join(repr(n) for n in by_name) or "none"
            raise RoleMappingError(
                f"role {role!r} is mapped to pool {spec.pool!r}, which is not one of the pools: {known}"
            )
        if not (isinstance(spec.worker_cls, type) and issubclass(spec.worker_cls, Worker)):
            raise RoleMappingError(
                f"role {role!r}: worker class {spec.worker_cls!r} is not a subclass of Worker"
            )
        world = by_name[spec.pool].world_size
        try:
            mesh = spec.mesh or DeviceMesh.data_parallel(world)
        except MeshError as err:
            raise RoleMappingError(f"role {role!r} on pool {spec.pool!r}: {err}") from err
        if mesh.world_size != world:
            raise RoleMappingError(
                f"role {role!r}: mesh {mesh.describe()} has {mesh.world_size} ranks but pool "
                f"{spec.pool!r} has {world} GPUs"
            )
        meshes[role] = mesh
    return meshes


def _local_ranks(node_ids: list[str]) -> list[tuple[int, int]]:
    """(local rank, local world size) of each rank from the nodes the ranks landed on."""
    seen: dict[str, int] = {}
    local = []
    for node in node_ids:
        local.append(seen.get(node, 0))
        seen[node] = seen.get(node, 0) + 1
    return [(lr, seen[node]) for lr, node in zip(local, node_ids, strict=True)]


def deploy(
    pools: Sequence[ResourcePool],
    roles: Mapping[str, RoleSpec],
    *,
    placement_timeout_seconds: float = 300.0,
    setup_timeout_seconds: float = 600.0,
    collective_timeout_seconds: float = 1800.0,
    stall_timeout_seconds: float | None = None,
    backend: str | None = None,
    bridges: Sequence[BridgeSpec] = (),
) -> Deployment:
    """Start the roles on their pools and return their worker groups (see the module docstring).

    ``backend`` overrides the torch.distributed backend (default: nccl on CUDA, else gloo).
    ``collective_timeout_seconds`` bounds every collective, so that ranks blocked on a dead
    peer eventually fail too. ``stall_timeout_seconds`` bounds every group call's wait
    (:class:`~hybridflow.controller.errors.WorkerStalledError` past it); None waits forever.
    """
    if not ray.is_initialized():
        raise RoleMappingError(
            "Ray is not initialised: call ray.init() (or hybridflow's local cluster) first"
        )
    meshes = _validate(pools, roles)
    for bridge in bridges:
        for role in (bridge.source_role, bridge.target_role):
            if role not in roles:
                raise RoleMappingError(f"bridge {bridge.name!r} names role {role!r}, which is not deployed")
        if roles[bridge.source_role].pool == roles[bridge.target_role].pool:
            raise RoleMappingError(
                f"bridge {bridge.name!r}: roles {bridge.source_role!r} and {bridge.target_role!r} share pool "
                f"{roles[bridge.source_role].pool!r}; a bridge joins two different pools"
            )
    used = [p for p in pools if any(spec.pool == p.name for spec in roles.values())]
    placements: list[PoolPlacement] = []
    hosts: dict[str, list[ActorHandle]] = {}
    try:
        for pool in used:
            placements.append(place_pool(pool, timeout_seconds=placement_timeout_seconds))
        host_cls: Any = ray.remote(WorkerHost)
        for placement in placements:
            pool = placement.pool
            threads = pool.threads_per_worker
            hosts[pool.name] = [
                host_cls.options(
                    num_cpus=pool.cpus_per_gpu,
                    num_gpus=1,
                    name=None,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        placement_group=pg, placement_group_bundle_index=index
                    ),
                ).remote(pool.name, rank, pool.world_size, threads)
                for rank, (pg, index) in enumerate(placement.bundles)
            ]
        groups: dict[str, WorkerGroup] = {}
        backends: dict[str, str] = {}
        device_views: dict[str, DeviceView] = {}  # every pool's: no two workers on one device
        for placement in placements:
            pool = placement.pool
            pool_hosts = hosts[pool.name]
            where = {r: f"pool {pool.name!r}, rank {r}" for r in range(pool.world_size)}

            def setup(what: str, refs: list[ray.ObjectRef], where: dict[int, str] = where) -> dict[int, Any]:
                return wait_for_ranks(
                    dict(enumerate(refs)), what=what, where=where, timeout_seconds=setup_timeout_seconds
                )

            node_ids = setup("starting worker processes", [h.node_id.remote() for h in pool_hosts])
            ordered_nodes = [node_ids[r] for r in range(pool.world_size)]
            local = _local_ranks(ordered_nodes)
            views = setup(
                "setting local ranks", [h.set_local_rank.remote(*local[r]) for r, h in enumerate(pool_hosts)]
            )
            device_views.update({f"pool {pool.name!r} rank {r}": view for r, view in views.items()})
            check_one_process_per_device(device_views)
            chosen = backend or (
                "nccl"
                if setup("probing devices", [pool_hosts[0].device.remote()])[0].startswith("cuda")
                else "gloo"
            )
            backends[pool.name] = chosen
            address, port = setup(
                "opening the rendezvous", [pool_hosts[0].open_rendezvous.remote(setup_timeout_seconds)]
            )[0]
            setup(
                f"joining the {chosen} process group",
                [
                    h.join_process_group.remote(address, port, chosen, collective_timeout_seconds)
                    for h in pool_hosts
                ],
            )
            rank_placements = [
                RankPlacement(r, ordered_nodes[r], local[r][0]) for r in range(pool.world_size)
            ]
            for role, spec in roles.items():
                if spec.pool != pool.name:
                    continue
                setup(
                    f"constructing role {role!r} ({spec.worker_cls.__name__})",
                    [
                        h.add_role.remote(role, spec.worker_cls, meshes[role], chosen, dict(spec.kwargs))
                        for h in pool_hosts
                    ],
                )
                groups[role] = WorkerGroup(
                    role,
                    pool.name,
                    spec.worker_cls,
                    meshes[role],
                    pool_hosts,
                    rank_placements,
                    stall_timeout_seconds=stall_timeout_seconds,
                )
        for bridge in bridges:
            _build_bridge(bridge, roles, hosts, backends, setup_timeout_seconds, collective_timeout_seconds)
        return Deployment(groups, hosts, placements, device_views)
    except BaseException:
        Deployment({}, hosts, placements).shutdown()
        raise


def _build_bridge(
    bridge: BridgeSpec,
    roles: Mapping[str, RoleSpec],
    hosts: Mapping[str, list[ActorHandle]],
    backends: Mapping[str, str],
    setup_timeout_seconds: float,
    collective_timeout_seconds: float,
) -> None:
    """Steps 1-2 of ``bridge.py``'s protocol: rank 0 of the source pool opens, every member joins."""
    source_pool, target_pool = roles[bridge.source_role].pool, roles[bridge.target_role].pool
    members = bridge_members(len(hosts[target_pool]))
    world = len(members)
    host_of = {
        m.bridge_rank: hosts[source_pool if m.side == "source" else target_pool][m.pool_rank] for m in members
    }
    where = {
        m.bridge_rank: f"pool {source_pool if m.side == 'source' else target_pool!r}, rank {m.pool_rank}"
        for m in members
    }
    what = f"bridge {bridge.name!r} ({source_pool!r} -> {target_pool!r})"
    address, port = wait_for_ranks(
        {0: host_of[0].open_bridge.remote(bridge.name, world, setup_timeout_seconds)},
        what=f"opening {what}",
        where=where,
        timeout_seconds=setup_timeout_seconds,
    )[0]
    # One backend for the whole group: nccl only when both pools run on CUDA.
    backend = "nccl" if backends[source_pool] == backends[target_pool] == "nccl" else "gloo"
    wait_for_ranks(
        {
            rank: host.join_bridge.remote(
                bridge.name, address, port, rank, world, backend, collective_timeout_seconds
            )
            for rank, host in host_of.items()
        },
        what=f"joining {what} over {backend}",
        where=where,
        timeout_seconds=setup_timeout_seconds,
    )
