"""Worker groups: how the controller addresses one role across all ranks of its pool.

``group.update_actor(batch)`` looks the method up among those the role's class exposed with
``@register`` (never by generating methods from the class), runs the protocol's ``dispatch``,
launches one Ray task per executing rank on the pool's hosts, and hands the per-rank results to
the protocol's ``collect``. ``group.update_actor.submit(batch)`` returns a :class:`GroupFuture`
instead, so calls on groups that live on different pools run at the same time.

Waiting is fail-fast: the first rank that raises or dies ends the wait with an error naming the
role, method, rank, pool and node, even while its peers are still blocked (e.g. inside a
collective that can no longer complete). The controller never waits on a dead worker.

Nor forever on a live one: a deployment's ``stall_timeout_seconds`` bounds every wait that
gives no timeout of its own; a call whose ranks stay alive but silent past it raises
:class:`~hybridflow.controller.errors.WorkerStalledError` naming the role, method and ranks.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import ray
from ray.actor import ActorHandle
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from hybridflow.controller.batch import Batch
from hybridflow.controller.errors import (
    CallTimeoutError,
    RoleMappingError,
    WorkerDiedError,
    WorkerError,
    WorkerStalledError,
)
from hybridflow.controller.protocols import (
    CallArgs,
    MethodSpec,
    TransferProtocol,
    method_spec,
    registered_methods,
)
from hybridflow.mesh import DeviceMesh

__all__ = ["GroupFuture", "MethodCaller", "RankPlacement", "WorkerGroup", "wait_for_ranks"]


@dataclass(frozen=True)
class RankPlacement:
    """Where one rank of a pool runs."""

    rank: int
    node_id: str
    local_rank: int


def wait_for_ranks(
    refs: Mapping[int, ray.ObjectRef],
    *,
    what: str,
    where: Mapping[int, str],
    timeout_seconds: float | None = None,
) -> dict[int, Any]:
    """Resolve one object ref per rank, failing on the first rank that raised or died.

    ``what`` names the operation (``"actor.update_actor"``) and ``where[rank]`` the rank's
    location, both for error messages.
    """
    by_ref = {ref: rank for rank, ref in refs.items()}
    pending = list(refs.values())
    results: dict[int, Any] = {}
    deadline = None if timeout_seconds is None else time.monotonic() + timeout_seconds
    while pending:
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready, pending = ray.wait(pending, num_returns=1, timeout=remaining)
        if not ready and deadline is not None and time.monotonic() < deadline:
            continue  # ray.wait can return a few microseconds before its timeout (ms clock)
        if not ready:
            ranks = sorted(by_ref[r] for r in pending)
            raise CallTimeoutError(
                f"{what} did not finish within {timeout_seconds:g} s; still running on ranks {ranks}"
            )
        for ref in ready:
            rank = by_ref[ref]
            try:
                results[rank] = ray.get(ref)
            except RayTaskError as err:
                cause = err.cause if isinstance(err.cause, BaseException) else None
                summary = (
                    f"{type(cause).__name__}: {cause}" if cause is not None else str(err).splitlines()[0]
                )
                raise WorkerError(
                    f"{what} failed on rank {rank} ({where.get(rank, '?')}): {summary}",
                    remote_traceback=str(err),
                ) from cause
            except RayActorError as err:
                first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
                raise WorkerDiedError(
                    f"the worker process of rank {rank} ({where.get(rank, '?')}) died during {what}: {first_line}"
                ) from err
            except GetTimeoutError as err:  # pragma: no cover - ray.wait said it was ready
                raise CallTimeoutError(f"{what} on rank {rank} timed out") from err
    return results


def _shareable(value: Any) -> bool:
    """Arguments worth one ``ray.put`` shared by every rank that receives them."""
    return isinstance(value, Batch | np.ndarray)


def _readers_per_object(per_rank: Sequence[CallArgs | None]) -> dict[int, int]:
    """How many ranks receive each argument object (by identity)."""
    counts: dict[int, int] = {}
    for call in per_rank:
        if call is not None:
            for value in (*call.args, *call.kwargs.values()):
                counts[id(value)] = counts.get(id(value), 0) + 1
    return counts


class GroupFuture:
    """The pending result of one group call. ``result()`` collects it (once; later calls reuse it)."""

    def __init__(
        self,
        group: WorkerGroup,
        method: str,
        protocol: TransferProtocol,
        refs: dict[int, ray.ObjectRef],
        collect_from: tuple[int, ...],
        context: Any,
    ) -> None:
        self._group = group
        self._method = method
        self._protocol = protocol
        self._refs = refs
        self._collect_from = collect_from
        self._context = context
        self._done = False
        self._value: Any = None

    def done(self) -> bool:
        if self._done:
            return True
        ready, _ = ray.wait(list(self._refs.values()), num_returns=len(self._refs), timeout=0)
        return len(ready) == len(self._refs)

    def result(self, timeout_seconds: float | None = None) -> Any:
        """The collected result; waits at most ``timeout_seconds``, else the group's stall timeout."""
        if not self._done:
            what = f"{self._group.role}.{self._method}"
            stall = self._group.stall_timeout_seconds
            try:
                outputs = wait_for_ranks(
                    self._refs,
                    what=what,
                    where=self._group.locations(),
                    timeout_seconds=timeout_seconds if timeout_seconds is not None else stall,
                )
            except CallTimeoutError as err:
                if timeout_seconds is not None or stall is None:
                    raise
                ready, _ = ray.wait(list(self._refs.values()), num_returns=len(self._refs), timeout=0)
                silent = sorted(rank for rank, ref in self._refs.items() if ref not in ready)
                locations = self._group.locations()
                raise WorkerStalledError(
                    f"{what} stalled: ranks {silent} gave no answer within {stall:g} s and did not die "
                    f"({'; '.join(locations.get(r, '?') for r in silent)}); the stall timeout is "
                    "spec.stallTimeoutSeconds"
                ) from err
            collected = {rank: outputs[rank] for rank in self._collect_from}
            self._value = self._protocol.collect(collected, self._group.mesh, self._context)
            self._done = True
        return self._value


class MethodCaller:
    """``group.method(...)`` calls (blocking unless registered otherwise); ``.submit(...)`` returns a future."""

    def __init__(self, group: WorkerGroup, method: str, spec: MethodSpec) -> None:
        self._group, self._method, self._spec = group, method, spec

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        future = self.submit(*args, **kwargs)
        return future.result() if self._spec.blocking else future

    def submit(self, *args: Any, **kwargs: Any) -> GroupFuture:
        return self._group.submit(self._method, *args, **kwargs)


class WorkerGroup:
    """One role on all ranks of its pool. Colocated roles share the pool's host processes."""

    def __init__(
        self,
        role: str,
        pool: str,
        worker_cls: type,
        mesh: DeviceMesh,
        hosts: Sequence[ActorHandle],
        placements: Sequence[RankPlacement],
        stall_timeout_seconds: float | None = None,
    ) -> None:
        if len(hosts) != mesh.world_size:
            raise RoleMappingError(
                f"role {role!r}: mesh {mesh.describe()} does not match the {len(hosts)} ranks of pool {pool!r}"
            )
        self.role = role
        self.pool = pool
        self.worker_cls = worker_cls
        self.mesh = mesh
        self._hosts = list(hosts)
        self._placements = list(placements)
        self.stall_timeout_seconds = stall_timeout_seconds

    @property
    def world_size(self) -> int:
        return len(self._hosts)

    @property
    def placements(self) -> list[RankPlacement]:
        return list(self._placements)

    def locations(self) -> dict[int, str]:
        return {
            p.rank: f"role {self.role!r}, pool {self.pool!r}, node {p.node_id[:12]}, local rank {p.local_rank}"
            for p in self._placements
        }

    def _spec(self, method: str) -> MethodSpec:
        spec = method_spec(self.worker_cls, method)
        if spec is None:
            exposed = ", ".join(registered_methods(self.worker_cls)) or "none"
            raise AttributeError(
                f"{self.worker_cls.__name__} (role {self.role!r}) has no method {method!r} registered "
                f"for the controller; registered: {exposed}"
            )
        return spec

    def __getattr__(self, method: str) -> MethodCaller:
        if method.startswith("_"):
            raise AttributeError(method)
        return MethodCaller(self, method, self._spec(method))

    def submit(self, method: str, *args: Any, **kwargs: Any) -> GroupFuture:
        protocol = self._spec(method).protocol
        dispatched = protocol.dispatch(CallArgs(args, kwargs), self.mesh)
        if len(dispatched.per_rank) != self.world_size:
            raise RoleMappingError(
                f"protocol {protocol.name!r} dispatched to {len(dispatched.per_rank)} ranks; "
                f"role {self.role!r} has {self.world_size}"
            )
        keep = set(dispatched.collect_from)
        readers = _readers_per_object(dispatched.per_rank)
        object_refs: dict[int, ray.ObjectRef] = {}

        def as_ref(value: Any) -> Any:
            if not _shareable(value):
                return value
            key = id(value)
            if readers[key] == 1:
                # One reader: passed by value, which Ray sends inline with the call when small
                # and puts into the object store itself when not; a ray.put first would cost
                # a round trip to the store on every call (1.6 ms of 2.4 for a small batch on
                # 2 cores). A batch only one rank reads may arrive as zero-copy views (batch.py).
                return value.single_reader() if isinstance(value, Batch) else value
            if key not in object_refs:
                object_refs[key] = ray.put(value)  # one copy in the store, read by every rank
            return object_refs[key]

        refs: dict[int, ray.ObjectRef] = {}
        for rank, call in enumerate(dispatched.per_rank):
            if call is None:
                continue
            args_out = [as_ref(a) for a in call.args]
            kwargs_out = {k: as_ref(v) for k, v in call.kwargs.items()}
            refs[rank] = self._hosts[rank].execute.remote(
                self.role, method, rank in keep, *args_out, **kwargs_out
            )
        missing = keep - set(refs)
        if missing:
            raise RoleMappingError(
                f"protocol {protocol.name!r} collects from ranks {sorted(missing)} that do not run"
            )
        return GroupFuture(self, method, protocol, refs, dispatched.collect_from, dispatched.context)

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return self.submit(method, *args, **kwargs).result()

    def __repr__(self) -> str:
        return f"WorkerGroup(role={self.role!r}, pool={self.pool!r}, {self.mesh.describe()})"
