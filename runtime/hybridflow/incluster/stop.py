"""Stopping the controller when its pods go: the preStop hook's side and the controller's side.

Why. KubeRay deletes an attempt's whole cluster at once to suspend it (the user's suspend, a
Kueue preemption, a deadline), and a drained or preempted node deletes its pods; nothing stops
the Ray job first (KubeRay ``rayjob_controller.go``: users must set a preStop hook). The kubelet
runs each container's preStop hook, then SIGTERMs its PID 1 (``ray start --block``) and SIGKILLs
what is left when the pod's grace period ends. When Ray goes, the driver's process group is
killed with it: a controller that waited for its own SIGTERM would never get one.

The protocol, between ``hybridflow stop`` (every Ray container's preStop hook, built by
``hybridflow_operator.builders.rayjob``) and the controller (``hybridflow run --in-cluster``):

1. the hook sends ``POST /stop`` to the controller's HTTP port (the one serving /metrics), with
   ``Authorization: Bearer $RAY_AUTH_TOKEN`` when the cluster has Ray token authentication (the
   controller then refuses a request without it, 401); the head's hook reaches it at 127.0.0.1,
   a worker's at the head's address as its own Ray node knows it (``/tmp/ray/ray_current_cluster``:
   the head pod's IP, which stays reachable while that pod terminates, unlike its Service's name);
2. the controller treats it as SIGTERM: it finishes the current step, saves a checkpoint and
   exits (``EXIT_PREEMPTED``). While it stops, a marker on the checkpoint volume
   (:data:`STOPPING_MARKER`) says until when it may take;
3. the hook polls ``GET /stop`` until the controller no longer answers (it exited: its
   checkpoint is complete), or until its timeout, a few seconds before the kubelet's SIGKILL;
   then the kubelet stops Ray. Every Ray container runs the hook, so no worker's Ray, which the
   checkpoint's shards are written through, goes before the controller is done;
4. a controller starting while the marker is there and not expired (a resumed job whose previous
   pods are still saving) waits until it is gone before it reads the newest checkpoint, so it
   resumes from the step the stopping one saves, not from the one before.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import MetricsHandler

__all__ = [
    "ControllerServer",
    "StopMarker",
    "controller_address",
    "stop_controller",
]

STOP_PATH = "/stop"
STOPPING_MARKER = ".controller-stopping"
"""In the checkpoint directory while a controller stops: JSON ``{"until": <unix seconds>, "host": ...}``."""
RAY_CURRENT_CLUSTER = "ray/ray_current_cluster"
"""Where, under its temporary root, every Ray node (``ray start``, head or worker) writes its
cluster's GCS address, ``<head ip>:<port>`` (``ray._private.utils.write_ray_address``)."""


def ray_address_file(env: Mapping[str, str]) -> Path:
    """The node's address file: under ``$RAY_TMPDIR``, else ``$TMPDIR``, else ``/tmp``, as Ray finds
    its temporary root (``ray._common.utils.get_default_system_temp_dir``)."""
    return Path(env.get("RAY_TMPDIR") or env.get("TMPDIR") or "/tmp") / RAY_CURRENT_CLUSTER


DEFAULT_PORT = 8081
AUTH_TOKEN_ENV = "RAY_AUTH_TOKEN"


class ControllerServer:
    """The controller's HTTP endpoint: ``GET /metrics`` (Prometheus), ``GET|POST /stop``.

    ``POST /stop`` sets ``stop_requested`` (the same event SIGTERM sets) and answers 202;
    ``GET /stop`` answers ``{"stopping": bool}``. With ``token`` set, ``POST /stop`` needs it as a
    bearer token (401 otherwise): the port is reachable from every pod the job's NetworkPolicy
    admits (its own, Prometheus).
    """

    def __init__(
        self,
        port: int,
        registry: CollectorRegistry,
        stop_requested: threading.Event,
        *,
        token: str | None = None,
        host: str = "",
    ) -> None:
        self.stop_requested = stop_requested
        server = self

        class Handler(MetricsHandler):
            def do_GET(self) -> None:
                if self.path.split("?")[0] == STOP_PATH:
                    self._answer(200, {"stopping": server.stop_requested.is_set()})
                else:
                    super().do_GET()

            def do_POST(self) -> None:
                if self.path.split("?")[0] != STOP_PATH:
                    self._answer(404, {"error": f"POST {self.path}: only {STOP_PATH} takes requests"})
                    return
                if token and self.headers.get("Authorization", "") != f"Bearer {token}":
                    self._answer(401, {"error": "a stop needs the cluster's Ray token as a bearer token"})
                    return
                server.stop_requested.set()
                self._answer(202, {"stopping": True})

            def _answer(self, code: int, body: Mapping[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        Handler.registry = registry
        self._httpd = ThreadingHTTPServer((host, port), Handler)
        self._httpd.daemon_threads = True
        self.port = int(self._httpd.server_address[1])
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="hybridflow-http", daemon=True)

    def start(self) -> ControllerServer:
        self._thread.start()
        return self

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()


def controller_address(env: Mapping[str, str]) -> str:
    """Where this pod's preStop hook finds the controller (see the module docstring, step 1)."""
    explicit = env.get("HYBRIDFLOW_CONTROLLER_ADDRESS")
    if explicit:
        return explicit
    try:
        gcs = ray_address_file(env).read_text(encoding="utf-8").strip()
    except OSError:
        gcs = ""
    if gcs:
        return gcs.rsplit(":", 1)[0]
    return env.get("FQ_RAY_IP") or "127.0.0.1"


def _request(url: str, *, method: str, token: str | None, timeout: float) -> int:
    request = urllib.request.Request(url, method=method, data=b"" if method == "POST" else None)
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            return int(answer.status)
    except urllib.error.HTTPError as err:
        return int(err.code)


def _gone(err: BaseException) -> bool:
    """The controller no longer answers: refused (its process exited) or unreachable; a timeout
    is a busy controller, not a gone one."""
    reason = getattr(err, "reason", err)
    return isinstance(reason, OSError) and not isinstance(reason, TimeoutError)


def stop_controller(
    address: str,
    port: int,
    *,
    token: str | None,
    timeout_seconds: float,
    poll_seconds: float = 1.0,
    say: Callable[[str], None] = print,
    clock: Callable[[], float] = time.monotonic,
) -> int:
    """The preStop hook (steps 1 and 3 of the module docstring): 0 once the controller is gone
    (or was never there), 1 when ``timeout_seconds`` passed first, 2 when it refused the request."""
    base = f"http://{address}:{port}{STOP_PATH}"
    deadline = clock() + timeout_seconds
    asked = False
    while clock() < deadline:
        try:
            code = _request(
                base,
                method="GET" if asked else "POST",
                token=token,
                timeout=min(10.0, max(0.1, deadline - clock())),
            )
        except (urllib.error.URLError, OSError) as err:
            if not _gone(err):
                continue  # busy: ask again
            if asked:
                say("hybridflow stop: the controller has exited")
            else:
                say(
                    f"hybridflow stop: no controller answers at {address}:{port} ({err}); nothing to wait for"
                )
            return 0
        if not asked:
            if code == 401:
                say(
                    f"hybridflow stop: the controller at {address}:{port} refused the stop (401: wrong token)"
                )
                return 2
            say(f"hybridflow stop: asked the controller at {address}:{port} to checkpoint and stop ({code})")
            asked = True
        time.sleep(poll_seconds)
    say(
        f"hybridflow stop: the controller still runs after {timeout_seconds:.0f} s; leaving it to the kubelet"
    )
    return 1


class StopMarker:
    """The marker of step 2 and the wait of step 4, in ``checkpoint_dir``."""

    def __init__(
        self, checkpoint_dir: str | os.PathLike[str], *, clock: Callable[[], float] = time.time
    ) -> None:
        self.path = Path(checkpoint_dir) / STOPPING_MARKER
        self.clock = clock

    def write(self, grace_seconds: float) -> None:
        """Say that a stop is under way and may take up to ``grace_seconds`` (best effort)."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            staging = self.path.with_name(self.path.name + ".tmp")
            staging.write_text(
                json.dumps({"until": self.clock() + grace_seconds, "host": socket.gethostname()})
            )
            staging.replace(self.path)
        except OSError:
            pass

    def clear(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    def until(self) -> float | None:
        """When the stop under way must be over (unix seconds), or None when none is."""
        try:
            return float(json.loads(self.path.read_text())["until"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def wait(self, *, poll_seconds: float = 2.0, say: Callable[[str], None] = print) -> float:
        """Wait while a previous controller is still stopping (step 4); the seconds waited."""
        started = self.clock()
        until = self.until()
        if until is not None and until > self.clock():
            say(
                f"a previous attempt is still saving its checkpoint ({self.path}); waiting up to "
                f"{until - self.clock():.0f} s for it"
            )
        while until is not None and until > self.clock():
            time.sleep(poll_seconds)
            until = self.until()
        return self.clock() - started
