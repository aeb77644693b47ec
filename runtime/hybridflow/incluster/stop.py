"""Stopping the controller when its pods go: the preStop hook's side and the controller's side.

Why. KubeRay deletes an attempt's whole RayCluster at once to suspend it (the user's suspend, a
Kueue preemption, a deadline), and a drained or preempted node deletes its pods; nothing stops
the Ray job first (KubeRay ``rayjob_controller.go``: users must set a preStop hook). The kubelet
runs each container's preStop hook, then SIGTERMs its PID 1 (``ray start --block``), whose handler
drains the node for at most ``RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S`` and then kills its processes
(Ray 2.60 ``_private/node.py``), and SIGKILLs what is left when the pod's grace period ends. When
Ray goes, the driver's process group goes with it: a controller that waited for its own SIGTERM
would never get one, and a worker whose Ray ends takes the shards of the checkpoint with it.

Why the checkpoint volume, and no network. When the whole cluster is deleted, the garbage
collector deletes KubeRay's head Service (owned by the RayCluster) with the pods, and the name a
worker knows its head by (``<cluster>-head-svc.<ns>.svc.cluster.local``, which KubeRay passes to
``ray start --address`` and Ray writes unchanged into ``ray_current_cluster``) stops resolving
while the pods sit in their hooks. Every pod of the job mounts the checkpoint volume, and that is
where the shards are written anyway, so the protocol runs there, under :data:`CONTROL_DIR` of the
checkpoint directory (``HYBRIDFLOW_CHECKPOINT_DIR`` in every Ray container), per RayCluster
(``RAY_CLUSTER_NAME``, which KubeRay sets in every Ray container; a new name for every cluster it
makes, a resumed attempt's included):

1. the controller (``hybridflow run --in-cluster``) keeps a record, ``<cluster>.json``: its state
   (``running``, ``stopping``, ``exited``) and a counter it rewrites every
   :data:`BEAT_SECONDS`, so a reader on any node can tell it is alive without comparing clocks;
2. every Ray container's preStop hook (``hybridflow stop``) writes a request,
   ``<cluster>.requests/<pod name>``; the controller reads the requests at every beat and treats
   one as SIGTERM: it finishes the current step, saves a checkpoint (``stopping``, with until when
   its grace period lets it) and exits (``EXIT_PREEMPTED``), printing :data:`STOPPED_ON_REQUEST`
   with who asked, which the operator reads in the RayJob's message (the stop of a drained node is
   not a failure: it does not count against ``spec.maxRestarts``);
3. the hook waits while the record says ``running`` or ``stopping`` and its counter moves; it
   returns once the record says ``exited``, when the counter has stood still for
   :data:`STALE_SECONDS` (the controller was killed), when there is no record (no controller ran
   in this cluster), or a few seconds before the kubelet's SIGKILL. A name that does not resolve,
   an unreachable head: none of them is read as "the controller is gone";
4. a controller starting while another cluster's controller of the same job is still ``stopping``
   (a resumed job whose previous pods are still saving: KubeRay reports Suspended as soon as the
   RayCluster object is gone) waits until that one exited or went still before it reads the
   newest checkpoint, so it resumes from the step the stopping one saves.

Without a checkpoint volume nothing a stop saves outlives the pods, and the hook returns at once.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any, Literal

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import MetricsHandler

__all__ = [
    "ControllerBeat",
    "ControllerRecord",
    "MetricsServer",
    "RecordState",
    "StopRequests",
    "stop_pod",
    "wait_for_stopping_controllers",
]

CONTROL_DIR = ".controller"
"""Under the checkpoint directory: the controllers' records and the hooks' requests."""
CHECKPOINT_DIR_ENV = "HYBRIDFLOW_CHECKPOINT_DIR"
CLUSTER_ENV = "RAY_CLUSTER_NAME"
"""KubeRay's name for the RayCluster, set in every Ray container (``common/pod.go`` ``setContainerEnvVars``)."""
POD_ENV = "RAY_CLOUD_INSTANCE_ID"
"""The pod's name, set by KubeRay in every Ray container (the same function)."""
BEAT_SECONDS = 2.0
STALE_SECONDS = 20.0
"""A record whose counter has not moved for this long belongs to a controller that is gone."""
STOPPED_ON_REQUEST = "stopped on request: "
"""The controller's last line after a requested stop; the operator looks for it in the RayJob's
message (KubeRay copies the entrypoint's last log lines there), as for ``error: Stalled: ``."""

RecordState = Literal["running", "stopping", "exited"]


class MetricsServer:
    """The controller's HTTP endpoint: ``GET /metrics`` (Prometheus), on its own thread."""

    def __init__(self, port: int, registry: CollectorRegistry, *, host: str = "") -> None:
        class Handler(MetricsHandler):
            pass

        Handler.registry = registry
        self._httpd = ThreadingHTTPServer((host, port), Handler)
        self._httpd.daemon_threads = True
        self.port = int(self._httpd.server_address[1])
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="hybridflow-http", daemon=True)

    def start(self) -> MetricsServer:
        self._thread.start()
        return self

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()


def _key(cluster: str) -> str:
    """The name a RayCluster's files go by (a run outside KubeRay has no ``RAY_CLUSTER_NAME``)."""
    return cluster or "cluster"


def _write_atomically(path: Path, text: str) -> None:
    staging = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    staging.write_text(text, encoding="utf-8")
    staging.replace(path)


@dataclass(frozen=True)
class RecordView:
    """One read of a controller's record."""

    state: RecordState
    beat: int
    until: float | None
    host: str


class ControllerRecord:
    """``<checkpoint dir>/.controller/<cluster>.json``: what the controller of ``cluster`` is doing."""

    def __init__(self, checkpoint_dir: str | os.PathLike[str], cluster: str) -> None:
        self.directory = Path(checkpoint_dir) / CONTROL_DIR
        self.cluster = _key(cluster)
        self.path = self.directory / f"{self.cluster}.json"
        self._beat = 0
        self._state: RecordState = "running"
        self._until: float | None = None
        self._lock = threading.Lock()

    def write(self, state: RecordState | None = None, *, until: float | None = None) -> None:
        """Rewrite the record with the counter moved on (best effort: a full volume must not stop a run)."""
        with self._lock:
            if state is not None:
                self._state, self._until = state, until
            self._beat += 1
            body = {
                "state": self._state,
                "beat": self._beat,
                "until": self._until,
                "host": socket.gethostname(),
            }
            with contextlib.suppress(OSError):
                self.directory.mkdir(parents=True, exist_ok=True)
                _write_atomically(self.path, json.dumps(body))

    def read(self) -> RecordView | None:
        return read_record(self.path)


def read_record(path: Path) -> RecordView | None:
    try:
        data: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
        state = data["state"]
        if state not in ("running", "stopping", "exited"):
            return None
        until = data.get("until")
        return RecordView(
            state, int(data["beat"]), None if until is None else float(until), str(data.get("host", ""))
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None


class StopRequests:
    """``<checkpoint dir>/.controller/<cluster>.requests/``: one file per pod whose hook asked for a stop."""

    def __init__(self, checkpoint_dir: str | os.PathLike[str], cluster: str) -> None:
        self.directory = Path(checkpoint_dir) / CONTROL_DIR / f"{_key(cluster)}.requests"

    def ask(self, pod: str) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        _write_atomically(self.directory / (pod or socket.gethostname()), json.dumps({"at": time.time()}))

    def askers(self) -> list[str]:
        try:
            return sorted(p.name for p in self.directory.iterdir() if not p.name.startswith("."))
        except OSError:
            return []


def prune_other_clusters(checkpoint_dir: str | os.PathLike[str], cluster: str) -> None:
    """Remove what earlier clusters of the job left that nobody waits on: exited records, requests
    with no record (their controller never started), and their requests (a record still
    ``running`` or ``stopping`` may be a stop under way)."""
    directory = Path(checkpoint_dir) / CONTROL_DIR
    with contextlib.suppress(OSError):
        names = {p.name.removesuffix(".json").removesuffix(".requests") for p in directory.iterdir()}
        for name in names - {_key(cluster)}:
            view = read_record(directory / f"{name}.json")
            if view is None or view.state == "exited":
                (directory / f"{name}.json").unlink(missing_ok=True)
                shutil.rmtree(directory / f"{name}.requests", ignore_errors=True)


def _still(
    views: Callable[[], RecordView | None],
    *,
    deadline: float,
    clock: Callable[[], float],
    poll_seconds: float,
    stale_seconds: float,
) -> str:
    """Wait while the record says ``running``/``stopping`` and its counter moves; why the wait ended:
    ``exited``, ``absent``, ``stale`` or ``timeout``."""
    view = views()
    last_beat, moved_at = (view.beat if view else None), clock()
    while clock() < deadline:
        if view is None:
            return "absent"
        if view.state == "exited":
            return "exited"
        if view.beat != last_beat:
            last_beat, moved_at = view.beat, clock()
        elif clock() - moved_at >= stale_seconds:
            return "stale"
        time.sleep(max(0.0, min(poll_seconds, deadline - clock())))
        view = views()
    return "timeout"


def stop_pod(
    env: Mapping[str, str],
    *,
    timeout_seconds: float,
    poll_seconds: float = 1.0,
    stale_seconds: float = STALE_SECONDS,
    say: Callable[[str], None] = print,
    clock: Callable[[], float] = time.monotonic,
) -> int:
    """The preStop hook (steps 2 and 3 of the module docstring): 0 once the controller of this pod's
    cluster has exited (or there is none, or nothing to save), 1 when ``timeout_seconds`` passed first."""
    deadline = clock() + timeout_seconds
    checkpoint_dir = env.get(CHECKPOINT_DIR_ENV)
    if not checkpoint_dir:
        say(
            "hybridflow stop: the job has no checkpoint volume; a stop would save nothing that outlives the pods"
        )
        return 0
    cluster, pod = env.get(CLUSTER_ENV, ""), env.get(POD_ENV) or socket.gethostname()
    try:
        StopRequests(checkpoint_dir, cluster).ask(pod)
    except OSError as err:
        say(
            f"hybridflow stop: could not write the stop request under {checkpoint_dir} ({err}); waiting anyway"
        )
    record = ControllerRecord(checkpoint_dir, cluster)
    why = _still(
        record.read, deadline=deadline, clock=clock, poll_seconds=poll_seconds, stale_seconds=stale_seconds
    )
    messages = {
        "exited": "the controller has exited",
        "absent": f"no controller ran in cluster {cluster!r}; nothing to wait for",
        "stale": f"the controller's record has not moved for {stale_seconds:.0f} s: it is gone",
        "timeout": f"the controller still runs after {timeout_seconds:.0f} s; leaving it to the kubelet",
    }
    say(f"hybridflow stop ({pod}): {messages[why]}")
    return 1 if why == "timeout" else 0


def wait_for_stopping_controllers(
    checkpoint_dir: str | os.PathLike[str],
    cluster: str,
    *,
    poll_seconds: float = 2.0,
    stale_seconds: float = STALE_SECONDS,
    say: Callable[[str], None] = print,
    clock: Callable[[], float] = time.monotonic,
) -> float:
    """Step 4: wait while a controller of another cluster of this job is ``stopping``; seconds waited.

    Bounded by the stopping controller's ``until`` (its grace period: the kubelet kills it then;
    wall-clock time of another node, which keeps NTP time as this one does), and ended sooner by
    its exit or by its record standing still for ``stale_seconds``.
    """
    started = clock()
    for path in sorted((Path(checkpoint_dir) / CONTROL_DIR).glob("*.json")):
        view = read_record(path)
        if path.name == f"{_key(cluster)}.json" or view is None or view.state != "stopping":
            continue
        left = max(0.0, view.until - time.time()) if view.until is not None else stale_seconds
        say(
            f"a previous attempt ({path.name.removesuffix('.json')}) is still saving its checkpoint; "
            f"waiting up to {left:.0f} s for it"
        )
        _still(
            functools.partial(read_record, path),
            deadline=clock() + left,
            clock=clock,
            poll_seconds=poll_seconds,
            stale_seconds=stale_seconds,
        )
    return clock() - started


class ControllerBeat:
    """The controller's side (steps 1 and 2): a thread that rewrites the record every
    :data:`BEAT_SECONDS` and sets ``stop_requested`` when a hook asked."""

    def __init__(
        self,
        checkpoint_dir: str | os.PathLike[str],
        cluster: str,
        stop_requested: threading.Event,
        *,
        beat_seconds: float = BEAT_SECONDS,
    ) -> None:
        self.beat_seconds = beat_seconds
        self.record = ControllerRecord(checkpoint_dir, cluster)
        self.requests = StopRequests(checkpoint_dir, cluster)
        self.stop_requested = stop_requested
        self.asked_by: str | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hybridflow-stop-beat", daemon=True)

    def start(self) -> ControllerBeat:
        self.record.write()  # running, or stopping already if a SIGTERM came first
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._done.wait(self.beat_seconds):
            askers = self.requests.askers()
            if askers and not self.stop_requested.is_set():
                self.asked_by = f"the preStop hook of pod {askers[0]}"
                self.stop_requested.set()
            self.record.write()

    def stopping(self, grace_seconds: float) -> None:
        self.record.write("stopping", until=time.time() + grace_seconds)

    def exited(self) -> None:
        self._done.set()
        self._thread.join(timeout=self.beat_seconds * 2)
        self.record.write("exited")
