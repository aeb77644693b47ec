"""A kubelet over podman for the e2e harness (test code): runs a pod as real containers.

A pod (as ``kube.kuberay_pods`` builds KubeRay's) runs on a bridge network of its own address,
with the cluster's resolver (``cluster_dns.py``) as its DNS, the way the kubelet runs it:

* **Start**: init containers one after another, each to exit 0 (``restartPolicy`` aside), then the
  first container, detached, its PID 1 the container's command and args.
* **Environment**: ``env`` and ``envFrom`` resolved as the kubelet does: plain values, ``fieldRef``
  (``metadata.name``, ``metadata.namespace``, ``metadata.labels['k']``), and the Secrets and
  ConfigMaps the caller resolves (``lookup``).
* **Volumes**: ``configMap`` (its keys as files, read-only), ``persistentVolumeClaim`` (a directory
  of the harness that outlives the pod), ``emptyDir`` (a fresh directory of mode 0777 per pod;
  medium Memory at ``/dev/shm`` becomes the container's shm size).
* **Security context**: ``runAsUser``/``runAsGroup`` (pod or container), ``capabilities.drop``,
  ``allowPrivilegeEscalation: false`` (no-new-privileges), ``readOnlyRootFilesystem``.
* **Resources**: the memory limit (``--memory``); CPU limits are not applied (this machine has 2
  cores and the pods ask for more: the scheduler's part, not the kubelet's).
* **Probes**: readiness as declared (initial delay, period, timeout, failure and success
  thresholds), HTTP GET to the pod's address or exec in the container; :attr:`Pod.ready` follows it.
* **Deletion**: the preStop hook (``podman exec``) with the grace period as its deadline, then
  SIGTERM to PID 1 and SIGKILL when the grace period (counted from the deletion) runs out
  (``podman stop -t``), as the kubelet's ``killContainer`` does (Kubernetes v1.33
  ``pkg/kubelet/kuberuntime/kuberuntime_container.go``: the hook's time counts against the grace
  period). Readiness follows ``pkg/kubelet/prober/worker.go`` (``doProbe``: initial delay, then
  one probe a period, ready after ``successThreshold`` successes, unready after
  ``failureThreshold`` failures).
"""

from __future__ import annotations

import contextlib
import re
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "images"))
import build

sys.path.pop(0)
Engine = build.Engine
JsonObject = dict[str, Any]
Lookup = Callable[[str, str, str], str | None]
"""``lookup(kind, name, key)``: a Secret's or ConfigMap's value (kind ``secret`` or ``configmap``)."""


@dataclass
class Pod:
    """One pod run as containers: its spec, where its volumes live, its address and readiness."""

    name: str
    namespace: str
    manifest: JsonObject
    root: Path
    ip: str
    container_name: str = ""
    ready: bool = False
    probe_log: list[str] = field(default_factory=list)
    prestop: subprocess.CompletedProcess[str] | None = None
    prestop_seconds: float | None = None
    _stop: threading.Event = field(default_factory=threading.Event)

    @property
    def spec(self) -> JsonObject:
        return dict(self.manifest["spec"])

    @property
    def container(self) -> JsonObject:
        return dict(self.spec["containers"][0])


class Kubelet:
    """Runs pods on one podman network; ``image_for`` maps a pod's image to a built one."""

    def __init__(
        self,
        engine: Engine,
        *,
        network: str,
        dns: str,
        root: Path,
        image_for: Callable[[str], str],
        claims: dict[str, Path],
        lookup: Lookup,
    ) -> None:
        self.engine, self.network, self.dns, self.root = engine, network, dns, root
        self.image_for, self.claims, self.lookup = image_for, claims, lookup
        self.pods: dict[str, Pod] = {}
        self._started: list[str] = []

    # ------------------------------------------------------------------ start

    def start(self, name: str, namespace: str, manifest: JsonObject, ip: str) -> Pod:
        """Run the pod's init containers to completion, then its container; probes start."""
        pod = Pod(name, namespace, manifest, self.root / name, ip)
        pod.root.mkdir(parents=True, exist_ok=True)
        self.pods[name] = pod
        for index, init in enumerate(pod.spec.get("initContainers") or []):
            args = self._run_args(pod, init, f"{name}-init-{index}-{uuid.uuid4().hex[:6]}")
            result = self.engine.run("run", "--rm", *args, capture=True, timeout=600)
            if result.returncode != 0:
                raise RuntimeError(f"init container {init['name']} of {name} failed: {result.stderr[-2000:]}")
        pod.container_name = f"{name}-{uuid.uuid4().hex[:6]}"
        self._started.append(pod.container_name)
        started = self.engine.run(
            "run", "-d", *self._run_args(pod, pod.container, pod.container_name), capture=True
        )
        if started.returncode != 0:
            raise RuntimeError(f"pod {name} did not start: {started.stderr[-2000:]}")
        threading.Thread(target=self._probe_loop, args=(pod,), name=f"probe-{name}", daemon=True).start()
        return pod

    def _run_args(self, pod: Pod, container: JsonObject, name: str) -> list[str]:
        args = ["--name", name, "--network", self.network, "--ip", pod.ip, "--dns", self.dns]
        args += ["--hostname", pod.name, *self._security(pod, container), *self._volumes(pod, container)]
        memory = ((container.get("resources") or {}).get("limits") or {}).get("memory")
        if memory:
            args += ["--memory", _bytes(memory)]
        for key, value in self._env(pod, container).items():
            args += ["-e", f"{key}={value}"]
        command = container.get("command") or []
        if command:
            args += ["--entrypoint", command[0]]
        image = self.image_for(container["image"])
        return [*args, image, *command[1:], *(container.get("args") or [])]

    def _security(self, pod: Pod, container: JsonObject) -> list[str]:
        context = {**(pod.spec.get("securityContext") or {}), **(container.get("securityContext") or {})}
        args = []
        if "runAsUser" in context:
            args += ["--user", f"{context['runAsUser']}:{context.get('runAsGroup', context['runAsUser'])}"]
        for capability in (context.get("capabilities") or {}).get("drop") or []:
            args += ["--cap-drop", capability]
        if context.get("allowPrivilegeEscalation") is False:
            args += ["--security-opt", "no-new-privileges"]
        if context.get("readOnlyRootFilesystem"):
            args += ["--read-only"]
        return args

    def _volumes(self, pod: Pod, container: JsonObject) -> list[str]:
        volumes = {volume["name"]: volume for volume in pod.spec.get("volumes") or []}
        args: list[str] = []
        for mount in container.get("volumeMounts") or []:
            volume = volumes[mount["name"]]
            target, read_only = mount["mountPath"], bool(mount.get("readOnly"))
            if "emptyDir" in volume and target == "/dev/shm" and volume["emptyDir"].get("medium") == "Memory":
                args += ["--shm-size", _bytes(volume["emptyDir"].get("sizeLimit") or "1Gi")]
                continue
            source = self._volume_source(pod, mount["name"], volume)
            args += ["-v", f"{source}:{target}{':ro' if read_only else ''}"]
        return args

    def _volume_source(self, pod: Pod, name: str, volume: JsonObject) -> Path:
        if "persistentVolumeClaim" in volume:
            return self.claims[volume["persistentVolumeClaim"]["claimName"]]
        directory = pod.root / "volumes" / name
        directory.mkdir(parents=True, exist_ok=True)
        directory.chmod(0o777)  # an emptyDir: a fresh directory every container may write
        if "configMap" in volume:
            config = volume["configMap"]["name"]
            for item in volume["configMap"].get("items") or []:
                (directory / item["path"]).write_text(self.lookup("configmap", config, item["key"]) or "")
            if not volume["configMap"].get("items"):
                for key in (self.lookup("configmap-keys", config, "") or "").split():
                    (directory / key).write_text(self.lookup("configmap", config, key) or "")
        return directory

    def _env(self, pod: Pod, container: JsonObject) -> dict[str, str]:
        labels = self._labels(pod)
        env: dict[str, str] = {}
        for source in container.get("envFrom") or []:
            kind = "secret" if "secretRef" in source else "configmap"
            ref = source.get("secretRef") or source.get("configMapRef") or {}
            for key in (self.lookup(f"{kind}-keys", ref["name"], "") or "").split():
                env[source.get("prefix", "") + key] = self.lookup(kind, ref["name"], key) or ""
        for item in container.get("env") or []:
            if "value" in item:
                env[item["name"]] = _expand(str(item["value"]), env)
                continue
            source = item.get("valueFrom") or {}
            if "fieldRef" in source:
                env[item["name"]] = self._field(pod, source["fieldRef"]["fieldPath"], labels)
            elif "secretKeyRef" in source:
                ref = source["secretKeyRef"]
                env[item["name"]] = self.lookup("secret", ref["name"], ref["key"]) or ""
            elif "configMapKeyRef" in source:
                ref = source["configMapKeyRef"]
                env[item["name"]] = self.lookup("configmap", ref["name"], ref["key"]) or ""
        return env

    def _labels(self, pod: Pod) -> dict[str, str]:
        return dict((pod.manifest.get("metadata") or {}).get("labels") or {})

    def _field(self, pod: Pod, path: str, labels: dict[str, str]) -> str:
        if path == "metadata.name":
            return pod.name
        if path == "metadata.namespace":
            return pod.namespace
        label = re.fullmatch(r"metadata\.labels\['([^']+)'\]", path)
        if label:
            return labels.get(label.group(1), "")
        if path == "status.podIP":
            return pod.ip
        raise ValueError(f"fieldRef {path} is not modelled")

    # ------------------------------------------------------------------ probes

    def _probe_loop(self, pod: Pod) -> None:
        probe = pod.container.get("readinessProbe")
        if probe is None:
            pod.ready = True
            return
        if pod._stop.wait(float(probe.get("initialDelaySeconds", 0))):
            return
        successes = failures = 0
        while not pod._stop.is_set():
            ok = self._probe_once(pod, probe)
            successes, failures = (successes + 1, 0) if ok else (0, failures + 1)
            if ok and successes >= int(probe.get("successThreshold", 1)):
                pod.ready = True
            elif not ok and failures >= int(probe.get("failureThreshold", 3)):
                pod.ready = False
            pod.probe_log.append(f"{time.time():.1f} {'ok' if ok else 'fail'}")
            pod._stop.wait(float(probe.get("periodSeconds", 10)))

    def _probe_once(self, pod: Pod, probe: JsonObject) -> bool:
        timeout = float(probe.get("timeoutSeconds", 1))
        if "httpGet" in probe:
            get = probe["httpGet"]
            url = f"http://{pod.ip}:{get['port']}{get.get('path', '/')}"
            try:
                return 200 <= urllib.request.urlopen(url, timeout=timeout).status < 400
            except OSError:
                return False
        try:
            result = self.engine.run(
                "exec", pod.container_name, *probe["exec"]["command"], capture=True, timeout=timeout + 5
            )
        except subprocess.TimeoutExpired:
            return False
        return result.returncode == 0

    # ------------------------------------------------------------------ deletion

    def delete(self, name: str, *, started: float | None = None) -> Pod:
        """The kubelet's ``killContainer``: preStop, then SIGTERM to PID 1 and SIGKILL at the end
        of the grace period counted from ``started`` (the deletion's time, ``time.monotonic``)."""
        pod = self.pods.pop(name)
        pod._stop.set()
        began = time.monotonic() if started is None else started
        grace = float(pod.spec.get("terminationGracePeriodSeconds", 30))
        hook = (((pod.container.get("lifecycle") or {}).get("preStop") or {}).get("exec") or {}).get(
            "command"
        )
        if hook:
            try:
                pod.prestop = self.engine.run(
                    "exec", pod.container_name, *hook, capture=True, timeout=max(1.0, grace)
                )
            except subprocess.TimeoutExpired:
                pod.prestop = None
            pod.prestop_seconds = time.monotonic() - began
        left = max(0, int(grace - (time.monotonic() - began)))
        self.engine.run("stop", "-t", str(left), pod.container_name, capture=True, timeout=left + 60)
        return pod

    def logs(self, name: str) -> str:
        pod = self.pods.get(name)
        container = pod.container_name if pod else name
        result = self.engine.run("logs", container, capture=True)
        return result.stdout + result.stderr

    def exit_code(self, container_name: str) -> int | None:
        result = self.engine.run(
            "inspect", "--format", "{{.State.ExitCode}} {{.State.Running}}", container_name, capture=True
        )
        code, _, running = result.stdout.strip().partition(" ")
        return None if running == "true" or not code else int(code)

    def close(self) -> None:
        """Remove every container this kubelet started (init containers remove themselves)."""
        for container in self._started:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.engine.run("rm", "-f", "-t", "0", container, capture=True, timeout=60)


def _bytes(quantity: str) -> str:
    """A memory quantity (``8Gi``) as podman takes it (bytes)."""
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 10**3, "M": 10**6, "G": 10**9}
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([A-Za-z]*)", str(quantity))
    if match is None:
        raise ValueError(f"memory quantity {quantity!r}")
    return str(int(float(match.group(1)) * units.get(match.group(2), 1)))


def _expand(value: str, env: dict[str, str]) -> str:
    """``$(VAR)`` references to variables defined before, as the kubelet expands them."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), value)


def engine_from_env() -> Engine:
    """The engine ``make images`` used (images/build.py): podman with the project's settings here."""
    return build.find_engine()
