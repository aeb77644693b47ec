"""The operator (kopf, the real handlers) against the API-server emulator, with the test playing KubeRay.

The emulator serves the generated RLHFJob CRD and the real KubeRay v1.7 RayJob CRD; the test moves
each RayJob through KubeRay's states by writing its status, and checks the RLHFJob's phase,
conditions, events, the children it owns, and that reconciles with nothing to do write nothing.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes.client import CoreV1Api, CustomObjectsApi
from kubernetes.client.exceptions import ApiException

from hybridflow_operator.cluster import ApiCluster
from hybridflow_operator.main import OperatorConfig, register
from kube.emulator import WriteFault, WriteSeen
from kube.harness import EmulatedCluster, load_crd, operator_registry, wait_until
from kube.kueue import register_kueue

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
RAYJOB_CRD = ROOT.parent / "shared" / "kuberay" / "ray.io_rayjobs.yaml"
NS = "default"
GROUP, VERSION, PLURAL = "hybridflow.io", "v1alpha1", "rlhfjobs"


def rayjob_crd() -> dict[str, Any]:
    if RAYJOB_CRD.is_file():
        return dict(load_crd(RAYJOB_CRD))
    # Without ../shared the emulator only needs the names, not KubeRay's schema.
    return {
        "spec": {
            "group": "ray.io",
            "names": {"kind": "RayJob", "plural": "rayjobs"},
            "scope": "Namespaced",
            "versions": [{"name": "v1", "served": True, "subresources": {"status": {}}}],
        }
    }


@pytest.fixture(scope="module")
def cluster() -> Any:
    with EmulatedCluster() as cluster:
        cluster.emulator.register_crd(load_crd(ROOT / "crds" / "hybridflow.io_rlhfjobs.yaml"))
        cluster.emulator.register_crd(rayjob_crd())
        register_kueue(cluster.emulator)
        registry = operator_registry()
        config = OperatorConfig(
            {"HYBRIDFLOW_RETRY_BACKOFF_SECONDS": "1", "HYBRIDFLOW_RUNTIME_IMAGE": "img:test"}
        )
        cluster.metrics = register(
            registry, config=config, cluster=ApiCluster(cluster.api_client), serve_metrics=False
        )
        with cluster.run_operator(registry):
            yield cluster


def create_job(cluster: Any, name: str, **spec: Any) -> None:
    doc = yaml.safe_load((ROOT / "examples" / "grpo-cluster.yaml").read_text())
    doc["metadata"] = {"name": name, "namespace": NS}
    doc["spec"].update(spec)
    cluster.custom.create_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, doc)


def job(cluster: Any, name: str) -> dict[str, Any]:
    return dict(cluster.custom.get_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, name))


def phase(cluster: Any, name: str) -> str | None:
    return (job(cluster, name).get("status") or {}).get("phase")


def rayjob(cluster: Any, name: str) -> dict[str, Any] | None:
    try:
        return dict(cluster.custom.get_namespaced_custom_object("ray.io", "v1", NS, "rayjobs", name))
    except Exception:
        return None


def kuberay(cluster: Any, name: str, deployment: str, job_status: str = "", reason: str = "") -> None:
    status = {"jobDeploymentStatus": deployment, "jobStatus": job_status, "reason": reason}
    cluster.custom.patch_namespaced_custom_object_status(
        "ray.io", "v1", NS, "rayjobs", name, {"status": status}
    )


def event_reasons(cluster: Any, name: str) -> list[str]:
    events = cluster.core.list_namespaced_event(NS).items
    return [e.reason for e in events if e.involved_object.name == name]


def test_rlhfjob_lifecycle_through_kuberay_states(cluster: Any) -> None:
    create_job(cluster, "life", maxRestarts=1)
    wait_until(lambda: rayjob(cluster, "life-1"), message="the first attempt's RayJob")
    uid = job(cluster, "life")["metadata"]["uid"]
    for read in (
        cluster.core.read_namespaced_config_map("life-config", NS),
        cluster.core.read_namespaced_service_account("life-controller", NS),
        cluster.rbac.read_namespaced_role("life-controller", NS),
        cluster.rbac.read_namespaced_role_binding("life-controller", NS),
    ):
        assert [ref.uid for ref in read.metadata.owner_references] == [uid]
    first = rayjob(cluster, "life-1")
    assert (
        first is not None and first["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["groupName"] == "default"
    )

    kuberay(cluster, "life-1", "Initializing")
    wait_until(lambda: phase(cluster, "life") == "Initializing")
    kuberay(cluster, "life-1", "Running", "RUNNING")
    wait_until(lambda: phase(cluster, "life") == "Running")
    status = job(cluster, "life")["status"]
    assert status["jobDeploymentStatus"] == "Running" and status["attempts"] == 1

    kuberay(cluster, "life-1", "Failed", "FAILED", reason="AppFailed")
    wait_until(lambda: rayjob(cluster, "life-2"), message="a retry as a new RayJob")
    # The status is patched after the new attempt's children are created: wait for it too.
    wait_until(lambda: phase(cluster, "life") == "Retrying")
    kuberay(cluster, "life-2", "Running", "RUNNING")
    wait_until(lambda: phase(cluster, "life") == "Running")
    kuberay(cluster, "life-2", "Complete", "SUCCEEDED")
    wait_until(lambda: phase(cluster, "life") == "Succeeded")
    conditions = {c["type"]: c["status"] for c in job(cluster, "life")["status"]["conditions"]}
    assert conditions["Succeeded"] == "True" and conditions["Failed"] == "False"
    reasons = event_reasons(cluster, "life")
    for reason in ("Retrying", "Succeeded"):
        assert reason in reasons


def test_reconciles_with_nothing_to_do_write_nothing(cluster: Any) -> None:
    create_job(cluster, "quiet")
    wait_until(lambda: rayjob(cluster, "quiet-1"))
    kuberay(cluster, "quiet-1", "Running", "RUNNING")
    wait_until(lambda: phase(cluster, "quiet") == "Running")
    cluster.wait_until_idle()
    writes = len(cluster.emulator.write_requests())
    before = reconciles(cluster, "rayjob")
    for touch in range(3):  # RayJob events that change nothing the operator acts on
        cluster.custom.patch_namespaced_custom_object(
            "ray.io", "v1", NS, "rayjobs", "quiet-1", {"metadata": {"annotations": {"touch": str(touch)}}}
        )
    wait_until(lambda: reconciles(cluster, "rayjob") >= before + 3, message="a pass per RayJob event")
    cluster.wait_until_idle()
    extra = [r for r in cluster.emulator.write_requests()[writes:] if "touch" not in str(r.data)]
    assert extra == [], [(r.method, r.name, r.subresource, r.data) for r in extra[:4]]


def test_the_api_server_rejects_an_invalid_spec_before_the_operator_sees_it(cluster: Any) -> None:
    """The CRD's schema and CEL rules answer 422 naming the field; nothing is stored or created.

    (A spec the operator cannot parse after admission, e.g. from an older CRD, sets
    ``Validated=False``: tests/unit/test_reconcile.py covers that path.)
    """
    with pytest.raises(ApiException) as rejected:
        create_job(cluster, "bad", algorithm={"name": "ppo2"})
    assert rejected.value.status == 422
    body = json.loads(rejected.value.body)
    assert body["reason"] == "Invalid"
    assert [c["field"] for c in body["details"]["causes"]] == ["spec.algorithm.name"]
    with pytest.raises(ApiException) as cel:
        create_job(cluster, "bad", resourcePools=[{"name": "pool", "nodes": 1, "gpusPerNode": 1}])
    assert cel.value.status == 422 and "spec.roles" in cel.value.body  # a CEL rule: the actor's pool
    assert rayjob(cluster, "bad-1") is None


def test_suspend_reaches_the_rayjob_and_deletion_cascades(cluster: Any) -> None:
    create_job(cluster, "pause")
    wait_until(lambda: rayjob(cluster, "pause-1"))
    kuberay(cluster, "pause-1", "Running", "RUNNING")
    cluster.custom.patch_namespaced_custom_object(
        GROUP, VERSION, NS, PLURAL, "pause", {"spec": {"suspend": True}}
    )
    wait_until(lambda: (rayjob(cluster, "pause-1") or {}).get("spec", {}).get("suspend") is True)
    cluster.custom.delete_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, "pause")
    wait_until(lambda: rayjob(cluster, "pause-1") is None, message="owner-reference garbage collection")


def test_a_queued_job_is_held_and_released_through_its_kueue_workload(cluster: Any) -> None:
    """With the Kueue stand-in: Kueue undoes a suspend written on an admitted RayJob, so the user's
    suspend goes through the Workload's spec.active, and the job stays held until resumed."""
    from kube.kueue import KueueStandIn

    def workload() -> dict[str, Any] | None:
        uid = ((rayjob(cluster, "kq-1") or {}).get("metadata") or {}).get("uid")
        found = cluster.custom.list_namespaced_custom_object(
            "kueue.x-k8s.io", "v1beta2", NS, "workloads", label_selector=f"kueue.x-k8s.io/job-uid={uid}"
        )["items"]
        return found[0] if uid and found else None

    def suspended() -> bool:
        return bool((rayjob(cluster, "kq-1") or {}).get("spec", {}).get("suspend"))

    def set_suspend(suspend: bool) -> None:
        cluster.custom.patch_namespaced_custom_object(
            GROUP, VERSION, NS, PLURAL, "kq", {"spec": {"suspend": suspend}}
        )

    with KueueStandIn(cluster.api_client, namespace=NS) as kueue:
        create_job(cluster, "kq", queueName="research")
        wait_until(lambda: rayjob(cluster, "kq-1") is not None and not suspended())  # Kueue admitted it
        kuberay(cluster, "kq-1", "Running", "RUNNING")
        set_suspend(True)
        wait_until(lambda: (workload() or {}).get("spec", {}).get("active") is False)
        wait_until(suspended)  # Kueue evicts the deactivated Workload and suspends the RayJob
        kuberay(cluster, "kq-1", "Suspended")  # KubeRay deletes its cluster
        wait_until(lambda: phase(cluster, "kq") == "Suspended")
        time.sleep(1.0)
        assert suspended()  # held: Kueue does not readmit an inactive Workload
        set_suspend(False)
        wait_until(lambda: (workload() or {}).get("spec", {}).get("active") is True)
        wait_until(lambda: not suspended())  # requeued, admitted, unsuspended: Kueue's to do
        annotations = (rayjob(cluster, "kq-1") or {})["metadata"]["annotations"]
        assert annotations["hybridflow.io/workload-active"] == "true"
        assert not kueue.errors, kueue.errors


def test_a_workload_kueue_deactivates_itself_shows_on_the_job_and_a_new_one_requeues_it(cluster: Any) -> None:
    """With the Kueue stand-in: Kueue deactivates the Workload of a job past its maximum execution
    time (the kueue.x-k8s.io/max-exec-time-seconds label, through spec.schedulerLabels) and never
    queues it again; the job says so with Kueue's reason and the way out, which works."""
    from kube.kueue import KueueStandIn

    def uid() -> str | None:
        return ((rayjob(cluster, "kd-1") or {}).get("metadata") or {}).get("uid")

    def workloads() -> list[dict[str, Any]]:
        return list(
            cluster.custom.list_namespaced_custom_object(
                "kueue.x-k8s.io", "v1beta2", NS, "workloads", label_selector=f"kueue.x-k8s.io/job-uid={uid()}"
            )["items"]
        )

    def suspended() -> bool:
        return bool((rayjob(cluster, "kd-1") or {}).get("spec", {}).get("suspend"))

    with KueueStandIn(cluster.api_client, namespace=NS) as kueue:
        create_job(
            cluster, "kd", queueName="research", schedulerLabels={"kueue.x-k8s.io/max-exec-time-seconds": "2"}
        )
        wait_until(lambda: rayjob(cluster, "kd-1") is not None and not suspended())  # admitted
        kuberay(cluster, "kd-1", "Running", "RUNNING")
        wait_until(suspended, timeout_seconds=15, message="Kueue deactivates and stops it")
        kuberay(cluster, "kd-1", "Suspended")
        wait_until(lambda: phase(cluster, "kd") == "Suspended", message="the job says Kueue holds it")
        status = job(cluster, "kd")["status"]
        assert status["reason"] == "DeactivatedDueToMaximumExecutionTimeExceeded", status
        (name,) = [w["metadata"]["name"] for w in workloads()]
        assert f"kubectl delete workload -n {NS} {name}" in status["message"]
        events = CoreV1Api(cluster.api_client).list_namespaced_event(NS).items
        assert [e.reason for e in events if e.involved_object.name == "kd"].count("KueueDeactivated") == 1
        cluster.custom.delete_namespaced_custom_object("kueue.x-k8s.io", "v1beta2", NS, "workloads", name)
        wait_until(lambda: not suspended(), message="a new Workload is admitted")  # the way out
        kuberay(cluster, "kd-1", "Running", "RUNNING")
        wait_until(lambda: phase(cluster, "kd") == "Running")
        assert not kueue.errors, kueue.errors


def errors(cluster: Any, reason: str) -> float:
    return float(cluster.metrics.errors.labels(error=reason)._value.get())


def test_a_failed_status_patch_is_logged_counted_and_retried(
    cluster: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """The status patch cannot carry a condition about itself: the log and the metric show it."""
    failed: list[str] = []

    def status_patch_fails_twice(write: WriteSeen) -> WriteFault | None:
        if write.plural == "rlhfjobs/status" and write.name == "flaky" and len(failed) < 2:
            failed.append(write.verb)
            return "lost"
        return None

    before = errors(cluster, "ServiceUnavailable")
    caplog.set_level(logging.WARNING, logger="hybridflow_operator")
    cluster.emulator.write_faults = status_patch_fails_twice
    try:
        create_job(cluster, "flaky")
        # The first status is written after status.PENDING_WRITE_DELAY_SECONDS (nothing moves the
        # RayJob here), then fails twice and is retried after 1 s and 2 s of backoff.
        wait_until(
            lambda: phase(cluster, "flaky") == "Pending",
            timeout_seconds=30,
            message="written after the backoff",
        )
    finally:
        cluster.emulator.write_faults = None
    assert len(failed) == 2 and errors(cluster, "ServiceUnavailable") >= before + 2
    logged = [r.getMessage() for r in caplog.records if "default/flaky" in r.getMessage()]
    assert logged and "patch RLHFJob/status flaky: 503 ServiceUnavailable" in logged[0]


def reconciles(cluster: Any, trigger: str) -> float:
    return float(cluster.metrics.reconciles.labels(trigger=trigger)._value.get())


def test_the_controllers_identity_can_push_progress_and_nothing_it_writes_steers_the_job(
    cluster: Any,
) -> None:
    """The head pod's token: RBAC allows its status patches only; the operator's decisions ignore them."""
    create_job(cluster, "ctl", maxRestarts=1)
    wait_until(lambda: rayjob(cluster, "ctl-1"))
    kuberay(cluster, "ctl-1", "Running", "RUNNING")
    wait_until(lambda: phase(cluster, "ctl") == "Running")
    controller = cluster.api_client_as(f"system:serviceaccount:{NS}:ctl-controller")
    as_controller = CustomObjectsApi(controller)
    cluster.wait_until_idle()
    before = reconciles(cluster, "rlhfjob")
    as_controller.patch_namespaced_custom_object_status(
        GROUP, VERSION, NS, PLURAL, "ctl", {"status": {"progress": {"step": 3, "reward": 0.5}}}
    )
    cluster.wait_until_idle()
    assert reconciles(cluster, "rlhfjob") == before  # a progress push triggers no reconcile

    # The Role allows patching status, so a forged lifecycle gets in; the operator puts it back.
    as_controller.patch_namespaced_custom_object_status(
        GROUP, VERSION, NS, PLURAL, "ctl", {"status": {"attempts": 2, "phase": "Succeeded"}}
    )
    wait_until(lambda: phase(cluster, "ctl") == "Running", message="the operator restores its own keys")
    assert job(cluster, "ctl")["status"]["attempts"] == 1
    assert rayjob(cluster, "ctl-2") is None
    assert job(cluster, "ctl")["status"]["progress"]["step"] == 3

    for forbidden in (
        lambda: as_controller.patch_namespaced_custom_object(
            GROUP, VERSION, NS, PLURAL, "ctl", {"spec": {"suspend": True}}
        ),
        lambda: as_controller.patch_namespaced_custom_object_status(
            GROUP, VERSION, NS, PLURAL, "life", {"status": {}}
        ),
        lambda: as_controller.patch_namespaced_custom_object(
            "ray.io", "v1", NS, "rayjobs", "ctl-1", {"spec": {"suspend": True}}
        ),
        lambda: CoreV1Api(controller).read_namespaced_config_map("ctl-config", NS),
    ):
        with pytest.raises(ApiException) as denied:
            forbidden()
        assert denied.value.status == 403


def test_a_leftover_child_of_a_deleted_namesake_is_never_adopted(cluster: Any) -> None:
    """A RayJob left by a deleted job of the same name (not yet garbage-collected) is not this job's."""
    # The garbage collector deletes an object none of whose owners exists; until it gets to it the
    # owner's uid is still known to it. A live stand-in's uid keeps the leftover for the test.
    stand_in = cluster.core.create_namespaced_config_map(
        NS, {"metadata": {"name": "again-old-owner"}, "data": {}}
    )
    leftover = {
        "apiVersion": "ray.io/v1",
        "kind": "RayJob",
        "metadata": {
            "name": "again-1",
            "namespace": NS,
            "labels": {"app.kubernetes.io/managed-by": "hybridflow-operator", "hybridflow.io/job": "again"},
            "ownerReferences": [
                {
                    "apiVersion": f"{GROUP}/{VERSION}",
                    "kind": "RLHFJob",
                    "name": "again",
                    "uid": stand_in.metadata.uid,
                }
            ],
        },
        "spec": {"entrypoint": "python old.py", "suspend": True},
    }
    cluster.custom.create_namespaced_custom_object("ray.io", "v1", NS, "rayjobs", leftover)
    kuberay(cluster, "again-1", "Complete", "SUCCEEDED")
    create_job(cluster, "again")

    def children_ready() -> dict[str, Any] | None:
        conditions = (job(cluster, "again").get("status") or {}).get("conditions") or []
        return next((c for c in conditions if c["type"] == "ChildrenReady"), None)

    condition = wait_until(children_ready)
    assert condition["status"] == "False" and condition["reason"] == "NameConflict"
    assert phase(cluster, "again") == "Pending"  # not Succeeded: the old run is not this job's
    wait_until(lambda: "NameConflict" in event_reasons(cluster, "again"))  # emitted after the status patch
    cluster.custom.delete_namespaced_custom_object("ray.io", "v1", NS, "rayjobs", "again-1")
    wait_until(
        lambda: (
            (rayjob(cluster, "again-1") or {}).get("metadata", {}).get("ownerReferences", [{}])[0].get("uid")
            == job(cluster, "again")["metadata"]["uid"]
        )
    )
    wait_until(lambda: (children_ready() or {}).get("status") == "True")


def test_a_deleted_child_is_recreated_from_the_watch_alone(cluster: Any) -> None:
    create_job(cluster, "heal")
    wait_until(lambda: rayjob(cluster, "heal-1"))
    cluster.core.delete_namespaced_config_map("heal-config", NS)

    def config_map() -> Any:
        try:
            return cluster.core.read_namespaced_config_map("heal-config", NS)
        except ApiException:
            return None

    recreated = wait_until(config_map, message="the ConfigMap's deletion event triggers a pass")
    assert recreated.metadata.owner_references[0].uid == job(cluster, "heal")["metadata"]["uid"]
