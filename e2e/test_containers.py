"""The operator's RayJob run as real containers of the built runtime image (``make images``).

The pods are KubeRay v1.7's (``kube.kuberay_pods``: the generated ``ray start`` behind
``/bin/bash -c``, the injected environment, probes, ``/dev/shm`` and the worker's
``wait-gcs-ready`` init container) run by a kubelet over podman (``kubelet.py``) on a bridge
network: each pod has its own address, the head Service's name resolves through a real resolver
(dnsmasq) exactly while the test says the Service exists, probes gate readiness, and deletion
runs the preStop hook, then SIGTERM to PID 1 and SIGKILL at the grace period.

Shown here: the cluster forms as on Kubernetes (the worker waits for the head's GCS by the
Service's name, then joins), the readiness probes pass only once Ray serves them, and the pods
terminate as the kubelet terminates them, with the time each step took. Running the GRPO example
to Succeeded in containers, and suspend, eviction and SIGKILL there, are issue 40's next steps
(see docs/operator.md).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from cluster_dns import ClusterDNS, head_service_name
from kubelet import Kubelet, engine_from_env

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


@pytest.fixture
def container_cluster(tmp_path: Path) -> Iterator[ContainerCluster]:
    engine = engine_from_env()
    if engine.run("image", "inspect", RUNTIME_IMAGE, capture=True).returncode != 0:
        pytest.fail(f"{RUNTIME_IMAGE} is not built: run `make images IMAGES=runtime-cpu` first")
    suffix = uuid.uuid4().hex[:6]
    network, octet = f"hf-e2e-{suffix}", 100 + int(suffix, 16) % 100
    subnet = f"10.90.{octet}"
    created = engine.run(
        "network", "create", "--disable-dns", "--subnet", f"{subnet}.0/24", network, capture=True
    )
    assert created.returncode == 0, created.stderr
    infra = f"hf-e2e-infra-{suffix}"  # keeps the bridge (and the resolver's address) up
    engine.run("run", "-d", "--name", infra, "--network", network, "--ip", f"{subnet}.254",
               RUNTIME_IMAGE, "sleep", "infinity", capture=True)  # fmt: skip
    children = _children("img:e2e")
    config = next(child for child in children if child["kind"] == "ConfigMap")

    def lookup(kind: str, name: str, key: str) -> str | None:
        if kind == "configmap-keys" and name == config["metadata"]["name"]:
            return " ".join(config["data"])
        if kind == "configmap" and name == config["metadata"]["name"]:
            return str(config["data"][key])
        return None

    try:
        with ClusterDNS(tmp_path / "dns", address=f"{subnet}.1") as dns:
            kubelet = Kubelet(
                engine, network=network, dns=f"{subnet}.1", root=tmp_path / "pods",
                image_for=lambda _image: RUNTIME_IMAGE, claims={}, lookup=lookup,
            )  # fmt: skip
            yield ContainerCluster(kubelet, dns, subnet, children)
    finally:
        for name in list(kubelet.pods) if "kubelet" in locals() else []:
            kubelet.engine.run("rm", "-f", "-t", "0", kubelet.pods[name].container_name, capture=True)
        engine.run("rm", "-f", "-t", "0", infra, capture=True)
        engine.run("network", "rm", "-f", network, capture=True)


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
