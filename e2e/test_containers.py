"""The operator's RayJob run as real containers of the built runtime image (``make images``).

The pods are KubeRay v1.7's (``kube.kuberay_pods``: the generated ``ray start`` behind
``/bin/bash -c``, the injected environment, probes, ``/dev/shm``, the worker's ``wait-gcs-ready``
init container, the submitter's ``ray job submit``) run by a kubelet over podman (``kubelet.py``)
on a bridge network: each pod has its own address, the head Service's name resolves through a
real resolver (dnsmasq) exactly while the test says the Service exists, probes gate readiness, and
deletion runs the preStop hook, then SIGTERM to PID 1 and SIGKILL at the grace period.

Shown here: the cluster forms as on Kubernetes (the worker waits for the head's GCS by the
Service's name, then joins), the readiness probes pass only once Ray serves them, the pods
terminate as the kubelet terminates them, and the GRPO example runs to SUCCEEDED through
KubeRay's submitter, its controller pushing the RLHFJob's status with the job's ServiceAccount
(the operator's Role) and checkpointing on the claim. Suspend, eviction and SIGKILL in
containers, and the operator from its image, are issue 40's next steps (docs/operator.md).
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from cluster_dns import ClusterDNS, head_service_name
from kubelet import Engine, Kubelet, Pod, engine_from_env

from hybridflow.spec import parse_job_manifest
from hybridflow_operator.builders import JobRef, RayJobDefaults, build_children
from kube.kuberay_pods import build_cluster_pods

ROOT = Path(__file__).resolve().parents[1]
RUNTIME_IMAGE = "localhost/hybridflow-runtime:0.1.0-cpu"
NAMESPACE = "research"


@dataclass
class ContainerCluster:
    kubelet: Kubelet
    dns: ClusterDNS
    subnet: str
    children: list[dict[str, Any]]

    def ip(self, index: int) -> str:
        return f"{self.subnet}.{10 + index}"


def _children(image: str) -> list[dict[str, Any]]:
    manifest = yaml.safe_load((ROOT / "examples" / "grpo-tiny.yaml").read_text())
    manifest["metadata"].update(namespace=NAMESPACE, uid=str(uuid.uuid4()))
    job = parse_job_manifest(manifest, "e2e")
    return build_children(job, JobRef.of(job), attempt=1, defaults=RayJobDefaults(image=image))


@dataclass(frozen=True)
class PodNetwork:
    """A bridge network of its own for the pods: ``<subnet>.0/24``, the resolver on ``.1``."""

    name: str
    subnet: str

    @property
    def gateway(self) -> str:
        return f"{self.subnet}.1"


@contextlib.contextmanager
def pod_network(engine: Engine, octets: str) -> Iterator[PodNetwork]:
    """Create the network (its own DNS off: the cluster's resolver serves it), held up by an infra
    container, and remove both afterwards."""
    suffix = uuid.uuid4().hex[:6]
    network = PodNetwork(f"hf-e2e-{suffix}", f"{octets}.{100 + int(suffix, 16) % 100}")
    created = engine.run(
        "network", "create", "--disable-dns", "--subnet", f"{network.subnet}.0/24", network.name, capture=True
    )
    assert created.returncode == 0, created.stderr
    infra = f"hf-e2e-infra-{suffix}"  # keeps the bridge (and the resolver's address) up
    engine.run("run", "-d", "--name", infra, "--network", network.name, "--ip", f"{network.subnet}.254",
               RUNTIME_IMAGE, "sleep", "infinity", capture=True)  # fmt: skip
    try:
        yield network
    finally:
        engine.run("rm", "-f", "-t", "0", infra, capture=True)
        engine.run("network", "rm", "-f", network.name, capture=True)


def runtime_engine() -> Engine:
    engine = engine_from_env()
    if engine.run("image", "inspect", RUNTIME_IMAGE, capture=True).returncode != 0:
        pytest.fail(f"{RUNTIME_IMAGE} is not built: run `make images IMAGES=runtime-cpu` first")
    return engine


@pytest.fixture
def container_cluster(tmp_path: Path) -> Iterator[ContainerCluster]:
    engine = runtime_engine()
    children = _children("img:e2e")
    with (
        pod_network(engine, "10.90") as network,
        ClusterDNS(tmp_path / "dns", address=network.gateway) as dns,
    ):
        kubelet = Kubelet(
            engine, network=network.name, dns=network.gateway, root=tmp_path / "pods",
            image_for=lambda _image: RUNTIME_IMAGE, claims={}, lookup=_lookup(children),
        )  # fmt: skip
        try:
            yield ContainerCluster(kubelet, dns, network.subnet, children)
        finally:
            kubelet.close()


def _wait(predicate: Any, timeout: float, what: str) -> float:
    began = time.monotonic()
    while time.monotonic() - began < timeout:
        if predicate():
            return time.monotonic() - began
        time.sleep(0.5)
    raise AssertionError(f"not within {timeout} s: {what}")


def test_the_rayjobs_pods_form_a_cluster_and_terminate_as_on_kubernetes(
    container_cluster: ContainerCluster,
) -> None:
    cluster, kubelet = container_cluster, container_cluster.kubelet
    rayjob = next(child for child in cluster.children if child["kind"] == "RayJob")
    name = "grpo-tiny-e2e"
    (head_name, head), (worker_name, worker), *_ = build_cluster_pods(rayjob, name)
    service = head_service_name(name, NAMESPACE)
    head_pod = kubelet.start(head_name, NAMESPACE, head, cluster.ip(0))
    cluster.dns.add(service, cluster.ip(0))  # KubeRay creates the head Service with the head pod
    head_ready = _wait(lambda: head_pod.ready, 120, "the head passes its readiness probe")
    worker_pod = kubelet.start(worker_name, NAMESPACE, worker, cluster.ip(1))  # after wait-gcs-ready
    _wait(lambda: worker_pod.ready, 120, "the worker passes its readiness probe")
    status = kubelet.engine.run("exec", head_pod.container_name, "ray", "status", capture=True)
    active = status.stdout.split("Active:", 1)[1].split("Pending:", 1)[0]
    # Ray names the nodes by RAY_NODE_TYPE_NAME (the pods' ray.io/group): the worker joined
    # through the Service's name, and brought its 2 (simulated) GPUs and the pool's resource.
    assert {"headgroup", "default"} <= set(active.split()), status.stdout
    assert "/2.0 GPU" in status.stdout and "/2.0 hybridflow-pool-default" in status.stdout, status.stdout
    assert head_ready >= 10  # readinessProbe.initialDelaySeconds: not ready before the probe says so
    # The RayCluster is deleted: the head Service goes with the pods, each pod terminates.
    cluster.dns.remove(service)
    began = time.monotonic()
    ended = {pod: kubelet.delete(pod, started=began) for pod in (worker_name, head_name)}
    for pod in ended.values():
        assert pod.prestop is not None and pod.prestop.returncode == 0, pod.prestop
        assert kubelet.exit_code(pod.container_name) is not None
    seconds = time.monotonic() - began
    grace = float(head["spec"].get("terminationGracePeriodSeconds", 30))
    assert seconds < grace, (
        f"the pods took the whole grace period ({seconds:.0f} s): SIGTERM did not stop PID 1"
    )
    print(f"head ready after {head_ready:.1f} s; both pods ended {seconds:.1f} s after the deletion")
    for pod in ended.values():
        print(
            f"{pod.name}: preStop returned after {pod.prestop_seconds:.1f} s: {pod.prestop.stdout.strip()[-200:]}"
        )


def test_pid_1_of_kuberays_command_passes_sigterm_to_ray(container_cluster: ContainerCluster) -> None:
    """KubeRay's generated command is ``/bin/bash -c -- "ulimit ...; ray start ... --block"``: PID 1
    is bash unless it execs the last command. SIGTERM must reach ``ray start`` (whose handler drains
    the node) rather than stop at a shell that, as PID 1, ignores it until SIGKILL."""
    cluster, kubelet = container_cluster, container_cluster.kubelet
    rayjob = next(child for child in cluster.children if child["kind"] == "RayJob")
    (head_name, head), *_ = build_cluster_pods(rayjob, "pid1")
    pod = kubelet.start(head_name, NAMESPACE, head, cluster.ip(5))
    _wait(lambda: pod.ready, 120, "the head is ready")
    pid1 = kubelet.engine.run(
        "exec", pod.container_name, "cat", "/proc/1/cmdline", capture=True
    ).stdout.replace("\0", " ")
    began = time.monotonic()
    stopped = kubelet.engine.run("stop", "-t", "60", pod.container_name, timeout=120, capture=True)
    seconds = time.monotonic() - began
    assert stopped.returncode == 0, stopped.stderr
    assert seconds < 60, f"PID 1 ({pid1.strip()}) ignored SIGTERM: stopped by SIGKILL after {seconds:.0f} s"
    print(f"PID 1: {pid1.strip()[:120]}; stopped {seconds:.1f} s after SIGTERM")


def _job_manifest(steps: int) -> dict[str, Any]:
    """grpo-tiny as a cluster user applies it: the model and prompts on the claim ``models``, the
    checkpoints and outputs on ``ckpt``; sizes cut to this machine (as test_e2e.manifest does)."""
    doc = yaml.safe_load((ROOT / "examples" / "grpo-tiny.yaml").read_text())
    spec = doc["spec"]
    doc["metadata"] = {"name": "grpo-tiny", "namespace": NAMESPACE}
    spec["models"] = {role: {"path": "/models/model"} for role in spec["models"]}
    spec["data"]["trainFiles"] = ["/models/data/target_char.jsonl"]
    spec["rollout"]["maxResponseTokens"] = 8
    spec["training"].update(totalSteps=steps, promptsPerStep=4, miniBatchSize=32, microBatchSizePerGpu=16)
    spec["volumes"] = [{"claimName": "models", "mountPath": "/models"}]
    spec["checkpoint"] = {
        "intervalSteps": 2,
        "keepLast": 3,
        "volume": {"claimName": "ckpt", "mountPath": "/ckpt"},
    }
    spec["outputDir"] = "/ckpt/outputs"
    # No CUDA in these containers: the workers hold Ray's simulated GPUs to a GPU node's contract.
    spec["pods"] = {"env": [{"name": "HYBRIDFLOW_GPU_CONTRACT", "value": "emulate"}]}
    return doc


def _readable_copy(source: Path, target: Path) -> Path:
    """``source`` copied where the pods' user (10001) may read it (pytest's temp dirs are 0700)."""
    import shutil

    shutil.copytree(source, target)
    for path in [target, *target.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    return target


def test_the_grpo_example_runs_to_succeeded_in_containers(tmp_path: Path, tiny: Path) -> None:
    """The whole RayJob in containers: head and worker pods, then KubeRay's submitter pod, whose
    ``ray job submit`` sends the entrypoint through the head Service's dashboard; the controller
    trains in the head container, pushes the RLHFJob's status to the API server and checkpoints on
    the claim. What KubeRay would read: the Ray job SUCCEEDED."""
    from kube.harness import EmulatedCluster
    from kube.kuberay_pods import submitter_pod

    engine, cluster = runtime_engine(), "grpo-tiny-1"
    claims = {"models": _readable_copy(tiny, tmp_path / "claims" / "models")}
    claims["ckpt"] = _writable_dir(tmp_path / "claims" / "ckpt")
    with (
        pod_network(engine, "10.91") as network,
        EmulatedCluster(host=network.gateway) as api,
        ClusterDNS(tmp_path / "dns", address=network.gateway) as dns,
    ):
        children = _apply(api, _job_manifest(steps=2))
        rayjob = next(child for child in children if child["kind"] == "RayJob")
        claims["sa-kubeconfig"] = _service_account_kubeconfig(api, rayjob, tmp_path / "sa")
        kubelet = Kubelet(
            engine, network=network.name, dns=network.gateway, root=tmp_path / "pods",
            image_for=lambda _image: RUNTIME_IMAGE, claims=claims, lookup=_lookup(children),
        )  # fmt: skip
        try:
            head = _start_cluster(kubelet, dns, network, rayjob, cluster)
            began = time.monotonic()
            submitter = submitter_pod(
                rayjob, f"{head_service_name(cluster, NAMESPACE)}:8265", f"{cluster}-e2e"
            )
            run = kubelet.start("submitter", NAMESPACE, submitter, f"{network.subnet}.12")
            _wait(lambda: kubelet.exit_code(run.container_name) is not None, 900, "the submitter ends")
            seconds = time.monotonic() - began
            status = engine.run(
                "exec", head.container_name, "ray", "job", "status", f"{cluster}-e2e", capture=True
            )
            assert "succeeded" in status.stdout.lower(), status.stdout + kubelet.logs("submitter")[-3000:]
        finally:
            kubelet.close()
        metrics = (claims["ckpt"] / "outputs" / "metrics.jsonl").read_text().splitlines()
        assert [json.loads(line)["step"] for line in metrics] == [1, 2], metrics
        assert (claims["ckpt"] / "checkpoints" / "step_000002").is_dir()
        pushed = api.custom.get_namespaced_custom_object(
            "hybridflow.io", "v1alpha1", NAMESPACE, "rlhfjobs", "grpo-tiny"
        )
        assert (pushed.get("status") or {}).get("progress", {}).get("step") == 2, pushed.get("status")
    print(f"GRPO (2 steps) in containers: submitted to SUCCEEDED in {seconds:.0f} s")


def _writable_dir(path: Path) -> Path:
    """A claim the pods' user may write (pytest's temp dirs are 0700)."""
    path.mkdir(parents=True)
    path.chmod(0o777)
    return path


def _service_account_kubeconfig(api: Any, rayjob: dict[str, Any], folder: Path) -> Path:
    """A folder with the kubeconfig of the head pod's ServiceAccount (authorized by the operator's
    Role), mounted into the head by :func:`_with_credentials`."""
    account = rayjob["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["serviceAccountName"]
    folder.mkdir()
    config = api.kubeconfig_as(f"system:serviceaccount:{NAMESPACE}:{account}", NAMESPACE)
    (folder / "kubeconfig").write_text(yaml.safe_dump(config))
    (folder / "kubeconfig").chmod(0o644)
    folder.chmod(0o755)
    return folder


def _start_cluster(
    kubelet: Kubelet, dns: ClusterDNS, network: PodNetwork, rayjob: dict[str, Any], cluster: str
) -> Pod:
    """The head (with the ServiceAccount's credentials) and its Service, then the worker; both ready."""
    (head_name, head), (worker_name, worker), *_ = build_cluster_pods(rayjob, cluster)
    _with_credentials(head)
    head_pod = kubelet.start(head_name, NAMESPACE, head, f"{network.subnet}.10")
    dns.add(head_service_name(cluster, NAMESPACE), f"{network.subnet}.10")
    _wait(lambda: head_pod.ready, 120, "the head is ready")
    worker_pod = kubelet.start(worker_name, NAMESPACE, worker, f"{network.subnet}.11")
    _wait(lambda: worker_pod.ready, 120, "the worker is ready")
    return head_pod


def _apply(api: Any, doc: dict[str, Any]) -> list[dict[str, Any]]:
    """The RLHFJob, then the operator's children of it but the RayJob, as the operator makes them
    (owned by the stored RLHFJob's uid: the garbage collector deletes children of any other)."""
    from kubernetes import utils

    api.emulator.register_crd(yaml.safe_load((ROOT / "crds" / "hybridflow.io_rlhfjobs.yaml").read_text()))
    stored = api.custom.create_namespaced_custom_object(
        "hybridflow.io", "v1alpha1", NAMESPACE, "rlhfjobs", doc
    )
    job = parse_job_manifest(
        {**doc, "metadata": {**doc["metadata"], "uid": stored["metadata"]["uid"]}}, "e2e"
    )
    children = build_children(job, JobRef.of(job), attempt=1, defaults=RayJobDefaults(image="img:e2e"))
    for child in children:
        if child["kind"] != "RayJob":
            utils.create_from_dict(api.api_client, child, namespace=NAMESPACE)
    return children


def _lookup(children: list[dict[str, Any]]) -> Any:
    configs = {child["metadata"]["name"]: child["data"] for child in children if child["kind"] == "ConfigMap"}

    def lookup(kind: str, name: str, key: str) -> str | None:
        if kind == "configmap-keys" and name in configs:
            return " ".join(configs[name])
        if kind == "configmap" and name in configs:
            return str(configs[name][key])
        return None

    return lookup


def _with_credentials(pod: dict[str, Any]) -> None:
    """The pod's ServiceAccount credentials: a kubeconfig for the API-server double (a pod gets a
    token and KUBERNETES_SERVICE_HOST; the double serves plain HTTP, so a kubeconfig stands in)."""
    container = pod["spec"]["containers"][0]
    pod["spec"].setdefault("volumes", []).append(
        {"name": "sa-kubeconfig", "persistentVolumeClaim": {"claimName": "sa-kubeconfig"}}
    )
    container.setdefault("volumeMounts", []).append(
        {"name": "sa-kubeconfig", "mountPath": "/var/run/hybridflow-sa", "readOnly": True}
    )
    container["env"] = [
        {"name": "KUBECONFIG", "value": "/var/run/hybridflow-sa/kubeconfig"},
        *container.get("env", []),
    ]
