"""A KubeRay stand-in for the e2e harness (test code, not product): it runs the RayJobs the operator creates.

For each RayJob in the API server (the emulator), as KubeRay v1.7 does with a real cluster:

1. "create the pods": start a Ray cluster for the job's pools (``ray_host.py``; with Ray's token
   authentication when the RayJob asks for it, as KubeRay's ``authOptions`` does) and "mount" the
   head pod's volumes: the ConfigMap's keys are written under ``<root>/pods/<rayjob><mountPath>``
   and each PersistentVolumeClaim is a directory ``<root>/volumes/<claim>`` that outlives the
   attempt (so the next attempt finds the checkpoints). Pod paths in the entrypoint and in the
   mounted manifest are rewritten to those directories (a process cannot mount).
2. run the entrypoint (``hybridflow run --in-cluster ...``) as a fresh process against that Ray,
   with the head container's environment (plain values, Secrets resolved by reference as the
   kubelet does), the job's namespace and the token of the head pod's ServiceAccount (its
   progress pushes are authorized by the Role the operator made for it, as in a cluster);
3. write the RayJob's status as KubeRay does: Initializing, Running/RUNNING, then
   Complete/SUCCEEDED or Failed/FAILED with reason AppFailed and the entrypoint's last log lines
   in ``message`` (which is where the operator reads a ``Stalled`` report from);
4. follow ``spec.suspend``: SIGTERM the entrypoint (pods deleted: the controller checkpoints),
   stop the cluster, status Suspended; unsuspended, run again from the start;
5. a deleted RayJob: kill its processes.

Faults are injected through :meth:`KubeRayStandIn.kill_entrypoint`.
"""

from __future__ import annotations

import base64
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
LOG_TAIL_CHARACTERS = 20_000  # what KubeRay copies from Ray's job info into status.message


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@dataclass
class Attempt:
    """One RayJob being run: its Ray cluster and its entrypoint process."""

    name: str
    namespace: str
    host: subprocess.Popen[str]
    entrypoint: subprocess.Popen[bytes]
    log: Path
    ray_address: str = ""
    """The GCS address of the attempt's Ray (what the head pod's port 6379 serves)."""
    stopping: bool = False
    started_at: float = field(default_factory=time.monotonic)


def pod_path_mapper(mounts: dict[str, Path]) -> Callable[[str], str]:
    """Rewrites each mounted pod path in a text to its local directory, whole path segments only
    (``/data`` maps ``/data/x`` and ``"/data"``, never ``/tmp/models0/data/x``)."""
    ordered = sorted(mounts.items(), key=lambda item: -len(item[0]))

    def in_pod(text: str) -> str:
        for pod_path, local in ordered:
            pattern = r"(?<![\w./-])" + re.escape(pod_path.rstrip("/")) + r"(?=/|[\s'\"]|$)"
            text = re.sub(pattern, str(local).replace("\\", "\\\\"), text)
        return text

    return in_pod


class KubeRayStandIn:
    def __init__(
        self,
        api: client.ApiClient,
        kubeconfig_for: Callable[[str, str], Path],
        root: Path,
        namespace: str = "default",
    ) -> None:
        """``kubeconfig_for(service_account, namespace)`` is the kubeconfig a pod of that
        ServiceAccount sees (its token authorized by RBAC)."""
        self.custom = client.CustomObjectsApi(api)
        self.core = client.CoreV1Api(api)
        self.kubeconfig_for = kubeconfig_for
        self.root = root
        self.namespace = namespace
        self.attempts: dict[str, Attempt] = {}
        self.finished: dict[str, int] = {}  # RayJob name -> entrypoint exit code
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kuberay-stand-in", daemon=True)

    # ------------------------------------------------------------------ lifecycle

    def __enter__(self) -> KubeRayStandIn:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        for attempt in list(self.attempts.values()):
            self._stop_attempt(attempt, signal.SIGKILL)

    def kill_entrypoint(self, rayjob: str, sig: signal.Signals = signal.SIGKILL) -> None:
        """Fault injection: the head pod's driver dies (SIGKILL) or is asked to stop (SIGTERM)."""
        self.attempts[rayjob].entrypoint.send_signal(sig)

    # ------------------------------------------------------------------ the control loop

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._reconcile()
            except Exception as error:  # keep going; the test reads errors
                self.errors.append(repr(error))
            self._stop.wait(0.3)

    def _reconcile(self) -> None:
        items = self.custom.list_namespaced_custom_object("ray.io", "v1", self.namespace, "rayjobs")["items"]
        present = {item["metadata"]["name"] for item in items}
        for name in [n for n in self.attempts if n not in present]:  # deleted: pods go away
            self._stop_attempt(self.attempts.pop(name), signal.SIGKILL)
        for rayjob in items:
            name = rayjob["metadata"]["name"]
            suspended = bool(rayjob.get("spec", {}).get("suspend"))
            status = rayjob.get("status") or {}
            attempt = self.attempts.get(name)
            if attempt is None:
                if suspended:
                    if status.get("jobDeploymentStatus") != "Suspended":
                        self._status(name, {"jobDeploymentStatus": "Suspended", "jobStatus": ""})
                elif status.get("jobDeploymentStatus") in (None, "", "Suspended"):
                    self._start(rayjob)
                continue
            if suspended:
                self._stop_attempt(self.attempts.pop(name), signal.SIGTERM)
                self._status(name, {"jobDeploymentStatus": "Suspended", "jobStatus": "STOPPED"})
                continue
            code = attempt.entrypoint.poll()
            if code is None:
                continue
            self.attempts.pop(name)
            self._stop_attempt(attempt, signal.SIGKILL)
            self.finished[name] = code
            if code == 0:
                self._status(
                    name, {"jobDeploymentStatus": "Complete", "jobStatus": "SUCCEEDED", "endTime": _now()}
                )
            else:
                tail = attempt.log.read_text(errors="replace")[-LOG_TAIL_CHARACTERS:]
                message = (
                    f"Job entrypoint command failed with exit code {code}, last available logs (truncated to "
                    f"20,000 chars):\n{tail}"
                )
                self._status(
                    name,
                    {
                        "jobDeploymentStatus": "Failed",
                        "jobStatus": "FAILED",
                        "reason": "AppFailed",
                        "message": message,
                        "endTime": _now(),
                    },
                )

    # ------------------------------------------------------------------ pods

    def _start(self, rayjob: dict[str, Any]) -> None:
        name = rayjob["metadata"]["name"]
        self._status(name, {"jobDeploymentStatus": "Initializing", "startTime": _now()})
        pod_root = self.root / "pods" / name
        head = rayjob["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]
        container = head["containers"][0]
        volumes = {volume["name"]: volume for volume in head.get("volumes", [])}
        mounts: dict[str, Path] = {}
        files: dict[Path, str] = {}
        for mount in container.get("volumeMounts", []):
            volume = volumes.get(mount["name"], {})
            if "configMap" in volume:
                target = pod_root / mount["mountPath"].lstrip("/")
                data = self.core.read_namespaced_config_map(volume["configMap"]["name"], self.namespace).data
                files.update({target / key: text for key, text in (data or {}).items()})
                mounts[mount["mountPath"]] = target
            elif "persistentVolumeClaim" in volume:
                target = self.root / "volumes" / volume["persistentVolumeClaim"]["claimName"]
                mounts[mount["mountPath"]] = target

        in_pod = pod_path_mapper(mounts)
        for target in mounts.values():
            target.mkdir(parents=True, exist_ok=True)
        for path, text in files.items():  # the mounted manifest names pod paths (the checkpoint volume)
            path.write_text(in_pod(text))
        entrypoint = in_pod(rayjob["spec"]["entrypoint"]).split()
        manifest = next(arg for arg in entrypoint if arg.endswith(".yaml"))

        # authOptions.mode token: KubeRay makes a token Secret for the cluster and sets
        # RAY_AUTH_MODE/RAY_AUTH_TOKEN on every Ray container; the Ray here and the entrypoint
        # get the same, so every call the controller makes to Ray carries the token.
        auth = (rayjob["spec"]["rayClusterSpec"].get("authOptions") or {}).get("mode", "disabled")
        ray_auth = {"RAY_AUTH_MODE": "disabled"}
        if auth == "token":
            ray_auth = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(16)}
        host = subprocess.Popen(
            [sys.executable, str(HERE / "ray_host.py"), manifest],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=pod_root,
            env={**os.environ, **ray_auth},
        )
        assert host.stdout is not None
        address = host.stdout.readline().strip()
        if not address:
            host.kill()
            raise RuntimeError(f"the Ray cluster of RayJob {name} did not start")
        log = pod_root / "entrypoint.log"
        account = head.get("serviceAccountName") or "default"
        env = {
            **os.environ,
            **{key: in_pod(value) for key, value in self._container_env(container).items()},
            **ray_auth,
            "RAY_ADDRESS": address,
            "KUBECONFIG": str(self.kubeconfig_for(account, self.namespace)),
            "POD_NAMESPACE": self.namespace,
            "HYBRIDFLOW_METRICS_PORT": str(_free_port()),
            "PYTHONUNBUFFERED": "1",
        }
        env.pop("KUBERNETES_SERVICE_HOST", None)
        command = (
            [sys.executable, "-m", "hybridflow.cli", *entrypoint[1:]]
            if entrypoint[0] == "hybridflow"
            else entrypoint
        )
        with open(log, "wb") as output:
            process = subprocess.Popen(
                command, stdout=output, stderr=subprocess.STDOUT, env=env, cwd=pod_root
            )
        self.attempts[name] = Attempt(name, self.namespace, host, process, log, ray_address=address)
        self._status(name, {"jobDeploymentStatus": "Running", "jobStatus": "RUNNING", "jobId": name})

    def _secret_data(self, name: str) -> dict[str, str]:
        secret = self.core.read_namespaced_secret(name, self.namespace)
        return {key: base64.b64decode(value).decode() for key, value in (secret.data or {}).items()}

    def _container_env(self, container: dict[str, Any]) -> dict[str, str]:
        """The container's environment as the kubelet resolves it: ``envFrom`` Secrets and
        ConfigMaps first, then ``env`` (plain values and ``secretKeyRef``) over them."""
        env: dict[str, str] = {}
        for source in container.get("envFrom") or []:
            prefix = source.get("prefix", "")
            if "secretRef" in source:
                env.update({prefix + k: v for k, v in self._secret_data(source["secretRef"]["name"]).items()})
            elif "configMapRef" in source:
                data = self.core.read_namespaced_config_map(
                    source["configMapRef"]["name"], self.namespace
                ).data
                env.update({prefix + k: v for k, v in (data or {}).items()})
        for item in container.get("env") or []:
            if "value" in item:
                env[item["name"]] = str(item["value"])
            elif "secretKeyRef" in (item.get("valueFrom") or {}):
                ref = item["valueFrom"]["secretKeyRef"]
                env[item["name"]] = self._secret_data(ref["name"])[ref["key"]]
        return env

    def _stop_attempt(self, attempt: Attempt, sig: signal.Signals) -> None:
        if attempt.entrypoint.poll() is None:
            attempt.entrypoint.send_signal(sig)
            try:
                attempt.entrypoint.wait(timeout=120)
            except subprocess.TimeoutExpired:
                attempt.entrypoint.kill()
                attempt.entrypoint.wait()
        if attempt.host.poll() is None:
            assert attempt.host.stdin is not None
            attempt.host.stdin.close()  # the cluster's pods are deleted
            try:
                attempt.host.wait(timeout=60)
            except subprocess.TimeoutExpired:
                attempt.host.kill()
                attempt.host.wait()

    def _status(self, name: str, fields: dict[str, Any]) -> None:
        self.custom.patch_namespaced_custom_object_status(
            "ray.io", "v1", self.namespace, "rayjobs", name, {"status": fields}
        )


def write_kubeconfig(config: dict[str, Any], path: Path) -> Path:
    path.write_text(yaml.safe_dump(config))
    return path
