"""A KubeRay stand-in for the e2e harness (test code, not product): it runs the RayJobs the operator creates.

What KubeRay decides, it decides as KubeRay does: every pass over every RayJob is one
``kube.kuberay_lifecycle.reconcile_rayjob`` (KubeRay v1.7's ``RayJobReconciler.Reconcile``, or
1.5.1/1.6 with ``version``): validation (``ValidationFailed``), New -> Initializing -> Running ->
Complete/Failed, suspend (Suspending -> Suspended -> New), ``activeDeadlineSeconds``,
``preRunningDeadlineSeconds``, ``backoffLimit``, shutdown + TTL, its finalizer. This module only
carries out the twin's actions on a world of processes, and observes that world for it:

* ``create-cluster``: start a Ray cluster for the job's pools (``ray_host.py``, with Ray's token
  authentication when the RayJob asks for it, as ``authOptions`` does) and "mount" the head
  pod's volumes: the ConfigMap's keys are written under ``<root>/pods/<rayjob><mountPath>`` and
  each PersistentVolumeClaim is a directory ``<root>/volumes/<claim>`` that outlives the attempt
  (so the next attempt finds the checkpoints). Pod paths in the entrypoint and in the mounted
  manifest are rewritten to those directories (a process cannot mount). The cluster is ready
  once its GCS answers.
* ``create-submitter``: run the entrypoint (``hybridflow run --in-cluster ...``) as a fresh
  process against that Ray: the Ray job's driver. It gets the head container's environment
  (plain values, Secrets resolved by reference as the kubelet does), the job's namespace and
  the token of the head pod's ServiceAccount. Ray's job status is RUNNING while it runs, then
  SUCCEEDED or FAILED by its exit code, with its last log lines as the message.
* the head Service: KubeRay makes ``<cluster>-head-svc`` with the cluster, owned by it
  (``raycluster_controller.go`` ``reconcileServices``), and the garbage collector deletes it with
  the pods; its name resolves exactly while it exists, through a real resolver
  (``cluster_dns.py``: dnsmasq), which every preStop hook uses as a pod's would. Each pod's
  ``ray_current_cluster`` holds what Ray 2.60 writes there: the head's own address on the head,
  the Service name and port a worker was started with (``--address``, ``common/pod.go``) on a
  worker; each Ray container gets the variables KubeRay sets (``RAY_CLUSTER_NAME``,
  ``RAY_CLOUD_INSTANCE_ID``, ``FQ_RAY_IP`` and ``RAY_ADDRESS``; ``setContainerEnvVars``, 1.7).
* ``delete-cluster``: KubeRay deletes the RayCluster and the garbage collector deletes every pod
  of it and its head Service at once; the RayCluster is gone at once (KubeRay goes on), its pods
  terminate as the kubelet terminates them (:meth:`KubeRayStandIn._terminate_pod`): each
  container's preStop hook runs first (the pod's command, with its environment, resolving names
  through the cluster's DNS), then its PID 1 gets SIGTERM, and the pod's
  ``terminationGracePeriodSeconds`` after the deletion everything left gets SIGKILL. PID 1 of a
  Ray container is ``ray start --block``, whose SIGTERM handler (Ray 2.60 ``_private/node.py``
  ``_drain_node_before_shutdown``) marks the node draining and waits until it is idle (here: the
  driver, whose actors it hosts, has exited) or ``RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S`` (default
  30 s) has passed, then kills the node's processes; the end of Ray SIGKILLs the driver. The
  cluster's nodes share one Ray process here, so the first pod whose Ray ends ends them all, and
  the driver with them.
* ``stop-ray-job`` (a RayJob deleted before it finished): Ray's job stop, SIGTERM to the driver
  and SIGKILL 3 s later (``RAY_JOB_STOP_WAIT_TIME_S``).

Faults are injected through :meth:`KubeRayStandIn.kill_entrypoint` and :meth:`evict_pod`.
"""

from __future__ import annotations

import base64
import contextlib
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

from cluster_dns import ClusterDNS, head_service_name
from kubernetes import client

from kube.kuberay_lifecycle import FINALIZER, ClusterObservation, reconcile_rayjob

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
LOG_TAIL_CHARACTERS = 20_000  # what KubeRay copies from Ray's job info into status.message
RAY_JOB_STOP_WAIT_SECONDS = 3.0
DEFAULT_GRACE_SECONDS = 30  # a pod spec's terminationGracePeriodSeconds default
DEFAULT_DRAIN_SECONDS = 30.0  # ray_constants.RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S, Ray 2.60
GCS_PORT = 6379
SHARED_PATHS = ("/tmp", "/dev/shm")
"""emptyDirs left as this machine's own: the test's files live under /tmp, which a rewrite of
"/tmp" in the manifest would move away (the pods' Ray keeps its own temp root, ``Pod.ray_tmpdir``)."""


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


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


def _command(argv: list[str]) -> list[str]:
    """The image's ``hybridflow`` console script, as this interpreter runs it."""
    return [sys.executable, "-m", "hybridflow.cli", *argv[1:]] if argv and argv[0] == "hybridflow" else argv


@dataclass
class Pod:
    """One pod of a cluster: its name, container (as the RayJob's template has it) and grace period."""

    name: str
    container: dict[str, Any]
    grace_seconds: float
    ray_tmpdir: Path
    """The pod's /tmp as its Ray node sees it (``RAY_TMPDIR``): ``ray/ray_current_cluster`` lives there."""

    @property
    def head(self) -> bool:
        return self.name == "head"


@dataclass
class Cluster:
    """The RayCluster of one RayJob: its Ray (all nodes in one process), its pods and its driver."""

    rayjob: str
    name: str
    host: subprocess.Popen[str]
    pods: list[Pod]
    pod_root: Path
    in_pod: Callable[[str], str]
    head_env: dict[str, str]
    ray_auth: dict[str, str]
    controller_port: int
    address: str = ""
    entrypoint: subprocess.Popen[bytes] | None = None
    log: Path | None = None
    submitter: str = "absent"
    """absent, created (the K8s Job exists) or deleted."""
    started_ms: int = 0
    ended_ms: int = 0
    exit_code: int | None = None
    ray_ended: threading.Event = field(default_factory=threading.Event)
    hooks: list[tuple[str, int | None]] = field(default_factory=list)
    """(pod, preStop exit code) for every hook run, for the tests."""
    hook_returned: dict[str, float] = field(default_factory=dict)
    """When each pod's preStop hook returned (``time.time``, to compare with files' times)."""
    driver_exited_at: float | None = None
    """When the driver's process ended, however it ended (``time.monotonic``)."""
    namespace: str = "default"

    @property
    def head_service(self) -> str:
        """The head Service's name as every worker knows it."""
        return head_service_name(self.name, self.namespace)

    def kuberay_env(self, pod: Pod) -> dict[str, str]:
        """What KubeRay's ``setContainerEnvVars`` (1.7) adds to a Ray container of this cluster."""
        head = self.address or f"127.0.0.1:{GCS_PORT}"
        env = {"RAY_CLUSTER_NAME": self.name, "RAY_CLOUD_INSTANCE_ID": f"{self.name}-{pod.name}"}
        if pod.head:
            return {**env, "RAY_ADDRESS": head}
        port = head.rsplit(":", 1)[1]
        return {**env, "FQ_RAY_IP": self.head_service, "RAY_ADDRESS": f"{self.head_service}:{port}"}

    @property
    def ray_address(self) -> str:
        """The GCS address of the cluster's Ray (what the head pod's port 6379 serves)."""
        return self.address


class KubeRayStandIn:
    def __init__(
        self,
        api: client.ApiClient,
        kubeconfig_for: Callable[[str, str], Path],
        root: Path,
        dns: ClusterDNS,
        namespace: str = "default",
        version: str = "1.7",
    ) -> None:
        """``kubeconfig_for(service_account, namespace)`` is the kubeconfig a pod of that
        ServiceAccount sees (its token authorized by RBAC); ``dns`` the cluster's resolver."""
        self.dns = dns
        self.custom = client.CustomObjectsApi(api)
        self.core = client.CoreV1Api(api)
        self.kubeconfig_for = kubeconfig_for
        self.root = root
        self.namespace = namespace
        self.version = version
        self.clusters: dict[str, Cluster] = {}
        """Live clusters by RayJob name (a cluster being deleted is not one)."""
        self.terminated: list[Cluster] = []
        self.finished: dict[str, int] = {}  # RayJob name -> entrypoint exit code
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._thread = threading.Thread(target=self._loop, name="kuberay-stand-in", daemon=True)

    @property
    def attempts(self) -> dict[str, Cluster]:
        """The live clusters by RayJob name (one per running attempt)."""
        return self.clusters

    def cluster_of(self, rayjob: str) -> Cluster:
        """The cluster of ``rayjob``, live or terminated (the newest)."""
        if rayjob in self.clusters:
            return self.clusters[rayjob]
        return next(c for c in reversed(self.terminated) if c.rayjob == rayjob)

    # ------------------------------------------------------------------ lifecycle

    def __enter__(self) -> KubeRayStandIn:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        for cluster in [*self.clusters.values(), *self.terminated]:
            self._kill(cluster)
        for thread in self._threads:
            thread.join(timeout=10)

    def kill_entrypoint(self, rayjob: str, sig: signal.Signals = signal.SIGKILL) -> None:
        """Fault injection: the head pod's driver dies (SIGKILL) or is asked to stop (SIGTERM)."""
        entrypoint = self.clusters[rayjob].entrypoint
        assert entrypoint is not None, f"RayJob {rayjob} has no driver yet"
        entrypoint.send_signal(sig)

    def evict_pod(self, rayjob: str, pod: str = "worker") -> threading.Thread:
        """Fault injection: one pod of the cluster is deleted (a drained node, an eviction): its
        preStop hook, SIGTERM, its grace period, SIGKILL. ``pod`` is ``head`` or ``worker`` (the
        first worker pod)."""
        cluster = self.clusters[rayjob]
        chosen = next(p for p in cluster.pods if (p.name == "head") == (pod == "head"))
        return self._spawn(lambda: self._terminate_pod(cluster, chosen, time.monotonic()), f"evict-{rayjob}")

    # ------------------------------------------------------------------ the control loop

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._reconcile_all()
            except Exception as error:  # keep going; the test reads errors
                self.errors.append(repr(error))
            self._stop.wait(0.3)

    def _reconcile_all(self) -> None:
        items = self.custom.list_namespaced_custom_object("ray.io", "v1", self.namespace, "rayjobs")["items"]
        present = {item["metadata"]["name"] for item in items}
        for name in [n for n in self.clusters if n not in present]:  # gone: the GC deletes its RayCluster
            self._delete_cluster(self.clusters.pop(name))
        for rayjob in items:
            self._reconcile(rayjob)

    def _observe(self, name: str) -> ClusterObservation:
        cluster = self.clusters.get(name)
        if cluster is None:
            return ClusterObservation(exists=False, submitter_exists=False)
        running = cluster.entrypoint is not None and cluster.exit_code is None
        if cluster.entrypoint is None:
            job_status, message = "", ""
        elif running:
            job_status, message = "RUNNING", ""
        elif cluster.exit_code == 0:
            job_status, message = "SUCCEEDED", "Job finished successfully."
        else:
            tail = cluster.log.read_text(errors="replace")[-LOG_TAIL_CHARACTERS:] if cluster.log else ""
            job_status = "FAILED"
            message = (
                f"Job entrypoint command failed with exit code {cluster.exit_code}, last available logs "
                f"(truncated to 20,000 chars):\n{tail}"
            )
        submitter = cluster.submitter == "created"
        return ClusterObservation(
            exists=True,
            ready=bool(cluster.address),
            job_status=job_status,
            job_message=message,
            submitter_exists=submitter,
            submitter_finished=submitter and cluster.entrypoint is not None and not running,
            job_start_ms=cluster.started_ms,
            job_end_ms=cluster.ended_ms,
        )

    def _reconcile(self, rayjob: dict[str, Any]) -> None:
        name = rayjob["metadata"]["name"]
        cluster = self.clusters.get(name)
        if cluster is not None and cluster.entrypoint is not None and cluster.exit_code is None:
            code = cluster.entrypoint.poll()
            if code is not None:
                cluster.exit_code, cluster.ended_ms = code, int(time.time() * 1000)
                self.finished[name] = code
        observation = self._observe(name)
        step = reconcile_rayjob(rayjob, observation, now=datetime.now(UTC), version=self.version)
        current = rayjob.get("status") or {}
        if step.actions or step.status.get("jobDeploymentStatus") != current.get("jobDeploymentStatus"):
            with open(self.root / "kuberay.log", "a") as log:  # what KubeRay did, for a failing test's reader
                log.write(
                    f"{datetime.now(UTC).isoformat()} {name} {current.get('jobDeploymentStatus')!r} -> "
                    f"{step.status.get('jobDeploymentStatus')!r} actions={list(step.actions)} "
                    f"suspend={rayjob['spec'].get('suspend')} job={observation.job_status!r}\n"
                )
        for action in step.actions:
            self._act(action, rayjob)
        if step.status != current:
            patch = {key: step.status.get(key) for key in {*current, *step.status}}
            self.custom.patch_namespaced_custom_object_status(
                "ray.io", "v1", self.namespace, "rayjobs", name, {"status": patch}
            )

    def _act(self, action: str, rayjob: dict[str, Any]) -> None:
        name = rayjob["metadata"]["name"]
        finalizers = list(rayjob["metadata"].get("finalizers") or [])
        if action == "add-finalizer":
            self._patch_metadata(name, {"finalizers": [*finalizers, FINALIZER]})
        elif action == "remove-finalizer":
            self._patch_metadata(name, {"finalizers": [f for f in finalizers if f != FINALIZER]})
        elif action == "create-cluster" and name not in self.clusters:
            self.clusters[name] = self._create_cluster(rayjob)
        elif action == "create-submitter" and name in self.clusters:
            self._start_driver(self.clusters[name], rayjob)
        elif action == "delete-submitter" and name in self.clusters:
            self.clusters[name].submitter = "deleted"
        elif action == "delete-cluster" and name in self.clusters:
            self._delete_cluster(self.clusters.pop(name))
        elif action == "stop-ray-job" and name in self.clusters:
            self._spawn(lambda: self._stop_driver(self.clusters.get(name)), f"stop-{name}")

    def _patch_metadata(self, name: str, metadata: dict[str, Any]) -> None:
        self.custom.patch_namespaced_custom_object(
            "ray.io", "v1", self.namespace, "rayjobs", name, {"metadata": metadata}
        )

    def _spawn(self, target: Callable[[], object], name: str) -> threading.Thread:
        thread = threading.Thread(target=target, name=name, daemon=True)
        thread.start()
        self._threads.append(thread)
        return thread

    # ------------------------------------------------------------------ clusters and pods

    def _create_cluster(self, rayjob: dict[str, Any]) -> Cluster:
        name = rayjob["metadata"]["name"]
        cluster_spec = rayjob["spec"]["rayClusterSpec"]
        pod_root = self.root / "pods" / name
        head = cluster_spec["headGroupSpec"]["template"]["spec"]
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
                mounts[mount["mountPath"]] = (
                    self.root / "volumes" / volume["persistentVolumeClaim"]["claimName"]
                )
            elif "emptyDir" in volume and mount["mountPath"] not in SHARED_PATHS:
                mounts[mount["mountPath"]] = pod_root / "emptydir" / mount["name"]  # HOME
        in_pod = pod_path_mapper(mounts)
        for target in mounts.values():
            target.mkdir(parents=True, exist_ok=True)
        for path, text in files.items():  # the mounted manifest names pod paths (the checkpoint volume)
            path.write_text(in_pod(text))

        # authOptions.mode token: KubeRay makes a token Secret for the cluster and sets
        # RAY_AUTH_MODE/RAY_AUTH_TOKEN on every Ray container (common/pod.go configureTokenAuth).
        auth = (cluster_spec.get("authOptions") or {}).get("mode", "disabled")
        ray_auth = {"RAY_AUTH_MODE": "disabled"}
        if auth == "token":
            ray_auth = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(16)}
        manifest = next(arg for arg in in_pod(rayjob["spec"]["entrypoint"]).split() if arg.endswith(".yaml"))
        host = subprocess.Popen(
            [sys.executable, str(HERE / "ray_host.py"), manifest],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=pod_root,
            env={**os.environ, **ray_auth},
        )
        pods = [self._pod("head", head, pod_root)]
        for group in cluster_spec.get("workerGroupSpecs") or []:
            for index in range(int(group.get("replicas", 1))):
                pods.append(self._pod(f"{group['groupName']}-{index}", group["template"]["spec"], pod_root))
        cluster = Cluster(
            rayjob=name,
            name=str((rayjob.get("status") or {}).get("rayClusterName") or name),
            host=host,
            pods=pods,
            pod_root=pod_root,
            in_pod=in_pod,
            head_env={key: in_pod(value) for key, value in self._container_env(container).items()},
            ray_auth=ray_auth,
            controller_port=_free_port(),
            namespace=self.namespace,
        )
        self.dns.add(cluster.head_service, "127.0.0.1")  # the head Service, made with the cluster
        self._spawn(lambda: self._await_ray(cluster), f"ray-{name}")
        return cluster

    def _pod(self, name: str, spec: dict[str, Any], pod_root: Path) -> Pod:
        tmpdir = pod_root / "tmp" / name
        tmpdir.mkdir(parents=True, exist_ok=True)
        grace = float(spec.get("terminationGracePeriodSeconds", DEFAULT_GRACE_SECONDS))
        return Pod(name, spec["containers"][0], grace, tmpdir)

    def _await_ray(self, cluster: Cluster) -> None:
        """The pods start: the Ray nodes join (each writes the GCS address where its Ray node keeps it)."""
        assert cluster.host.stdout is not None
        address = cluster.host.stdout.readline().strip()
        if not address:
            cluster.ray_ended.set()
            self.errors.append(f"the Ray cluster of RayJob {cluster.rayjob} did not start")
            return
        port = address.rsplit(":", 1)[1]
        for pod in cluster.pods:  # the head writes its own address, a worker the name it was given
            (pod.ray_tmpdir / "ray").mkdir(exist_ok=True)
            known = address if pod.head else f"{cluster.head_service}:{port}"
            (pod.ray_tmpdir / "ray" / "ray_current_cluster").write_text(known)
        cluster.address = address

    def _start_driver(self, cluster: Cluster, rayjob: dict[str, Any]) -> None:
        if cluster.entrypoint is not None or not cluster.address:
            return
        cluster.submitter = "created"
        head = rayjob["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]
        account = head.get("serviceAccountName") or "default"
        env = {
            **os.environ,
            **cluster.head_env,
            **cluster.ray_auth,
            "RAY_ADDRESS": cluster.address,
            "KUBECONFIG": str(self.kubeconfig_for(account, self.namespace)),
            "POD_NAMESPACE": self.namespace,
            "HYBRIDFLOW_METRICS_PORT": str(cluster.controller_port),  # pods' ports share one host here
            "RAY_CLUSTER_NAME": cluster.name,
            "PYTHONUNBUFFERED": "1",
        }
        env.pop("KUBERNETES_SERVICE_HOST", None)
        cluster.log = cluster.pod_root / "entrypoint.log"
        with open(cluster.log, "ab") as output:
            cluster.entrypoint = subprocess.Popen(
                _command(cluster.in_pod(rayjob["spec"]["entrypoint"]).split()),
                stdout=output,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=cluster.pod_root,
                start_new_session=True,  # its own process group: Ray's end takes the whole group
            )
        cluster.started_ms = int(time.time() * 1000)
        self._note(f"{cluster.rayjob}: driver pid {cluster.entrypoint.pid} on port {cluster.controller_port}")
        driver = cluster.entrypoint

        def watch() -> None:
            driver.wait()
            cluster.driver_exited_at = time.monotonic()

        self._spawn(watch, f"driver-{cluster.rayjob}")

    def _delete_cluster(self, cluster: Cluster) -> None:
        """The RayCluster is deleted: all its pods and its head Service at once (module docstring)."""
        self.terminated.append(cluster)
        self.dns.remove(cluster.head_service)
        started = time.monotonic()
        for pod in cluster.pods:
            self._spawn(lambda pod=pod: self._terminate_pod(cluster, pod, started), f"terminate-{pod.name}")

    def _terminate_pod(self, cluster: Cluster, pod: Pod, started: float) -> None:
        """The kubelet: preStop hook, SIGTERM to PID 1 (this node's Ray drains, then ends), SIGKILL
        at the grace period."""
        deadline = started + pod.grace_seconds
        env = {key: cluster.in_pod(value) for key, value in self._container_env(pod.container).items()}
        command = (((pod.container.get("lifecycle") or {}).get("preStop") or {}).get("exec") or {}).get(
            "command"
        )
        if command and not cluster.ray_ended.is_set():
            hook = subprocess.Popen(
                self.dns.command(_command(list(command))),
                stdout=open(cluster.pod_root / f"prestop-{pod.name}.log", "ab"),  # noqa: SIM115
                stderr=subprocess.STDOUT,
                env={
                    **os.environ,
                    **env,
                    **cluster.ray_auth,
                    **cluster.kuberay_env(pod),
                    "RAY_TMPDIR": str(pod.ray_tmpdir),
                    "HYBRIDFLOW_METRICS_PORT": str(cluster.controller_port),  # pods' ports share one host
                },
            )
            try:
                code: int | None = hook.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                hook.kill()  # the kubelet gives up on the hook at the grace period
                code = None
            cluster.hook_returned[pod.name] = time.time()
            cluster.hooks.append((pod.name, code))
        # SIGTERM to `ray start --block`: the node drains until idle (the driver, whose actors it
        # hosts, has exited) or its drain timeout, then its Ray ends, and the cluster's here.
        drain = float(env.get("RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S", DEFAULT_DRAIN_SECONDS))
        until = min(time.monotonic() + drain, deadline)
        while (
            cluster.driver_exited_at is None and cluster.entrypoint is not None and time.monotonic() < until
        ):
            time.sleep(0.1)
        self._end_ray(cluster)
        if cluster.entrypoint is not None and cluster.entrypoint.poll() is None:
            # The driver outlived Ray only until Ray's end reaches it (or the grace period: SIGKILL).
            self._kill_driver(cluster)

    def _note(self, text: str) -> None:
        with open(self.root / "kuberay.log", "a") as log:
            log.write(f"{datetime.now(UTC).isoformat()} {text}\n")

    def _end_ray(self, cluster: Cluster) -> None:
        with self._lock:  # the first of the pods' threads ends it
            if cluster.ray_ended.is_set():
                return
            cluster.ray_ended.set()
        driver = cluster.entrypoint
        self._note(
            f"{cluster.rayjob}: Ray ends (driver pid {driver.pid if driver else None}, running {driver is not None and driver.poll() is None})"
        )
        self._kill_driver(cluster)  # the job supervisor's death kills the driver's process group
        if cluster.host.poll() is None:
            assert cluster.host.stdin is not None
            try:
                cluster.host.stdin.close()
                cluster.host.wait(timeout=60)
            except (subprocess.TimeoutExpired, OSError):
                cluster.host.kill()
                cluster.host.wait()

    def _kill_driver(self, cluster: Cluster) -> None:
        entrypoint = cluster.entrypoint
        if entrypoint is not None and entrypoint.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(entrypoint.pid, signal.SIGKILL)
            entrypoint.wait()
        if entrypoint is not None and cluster.exit_code is None:
            cluster.exit_code, cluster.ended_ms = entrypoint.returncode, int(time.time() * 1000)
            self.finished[cluster.rayjob] = entrypoint.returncode

    def _stop_driver(self, cluster: Cluster | None) -> None:
        """Ray's job stop: SIGTERM, then SIGKILL after ``RAY_JOB_STOP_WAIT_TIME_S``."""
        if cluster is None or cluster.entrypoint is None or cluster.entrypoint.poll() is not None:
            return
        cluster.entrypoint.send_signal(signal.SIGTERM)
        try:
            cluster.entrypoint.wait(timeout=RAY_JOB_STOP_WAIT_SECONDS)
        except subprocess.TimeoutExpired:
            self._kill_driver(cluster)

    def _kill(self, cluster: Cluster) -> None:
        with self._lock:
            cluster.ray_ended.clear()
        self._end_ray(cluster)

    # ------------------------------------------------------------------ the kubelet's environment

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


def write_kubeconfig(config: dict[str, Any], path: Path) -> Path:
    import yaml

    path.write_text(yaml.safe_dump(config))
    return path
