"""The Kueue stand-in (``tests/kube/kueue.py``) follows Kueue's rules for queued RayJobs.

Each test drives one rule with a hand-made RayJob (the operator's builder on
``examples/grpo-tiny.yaml``: a head, one worker group of 2 GPUs, a K8sJobMode submitter) against
the API-server emulator serving KubeRay v1.7's RayJob CRD and Kueue's Workload, and plays KubeRay
by writing the RayJob's status where Kueue waits for it (a suspended job's pods going away). The
operator itself is not involved.
"""

from __future__ import annotations

import contextlib
import copy
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes.config
import pytest
import yaml
from kubernetes.client.exceptions import ApiException

from hybridflow.spec import parse_job_manifest
from hybridflow_operator.builders import JobRef, RayJobDefaults, build_rayjob
from kube.harness import EmulatedCluster, load_crd, wait_until
from kube.kueue import (
    GROUP,
    JOB_UID_LABEL,
    MAX_EXEC_TIME_LABEL,
    PODSET_LABEL,
    QUEUE_LABEL,
    RESOURCE_IN_USE_FINALIZER,
    WEBHOOK_NAME,
    WORKLOAD_PLURAL,
    WORKLOAD_VERSION,
    KueueStandIn,
    WaitForPodsReady,
    condition,
    is_true,
    kueue_rayjob_webhook,
    owner_workload_name,
    register_kueue,
    workload_name,
)

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
RAYJOB_CRD = ROOT.parent / "shared" / "kuberay" / "ray.io_rayjobs.yaml"
NS = "default"
QUIET_SECONDS = 0.6  # several stand-in passes (0.1 s apart): long enough to see it leave a job alone

# --- the cluster ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster() -> Iterator[EmulatedCluster]:
    with EmulatedCluster() as cluster:
        cluster.emulator.register_crd(load_crd(RAYJOB_CRD))
        register_kueue(cluster.emulator)
        cluster.emulator.validating_webhooks.append(kueue_rayjob_webhook("0.19"))
        yield cluster


def api(cluster: EmulatedCluster) -> Any:
    """The cluster's CustomObjectsApi (its answers are plain JSON dicts)."""
    return cluster.custom


def stand_in(cluster: EmulatedCluster, namespace: str = NS, **options: Any) -> KueueStandIn:
    """A stand-in whose requests carry a token of its own (an admin: not in ``identities``)."""
    config = cluster.kubeconfig_with_token(f"kueue-{namespace}", namespace)
    api = kubernetes.config.new_client_from_config_dict(config)
    return KueueStandIn(api, namespace=namespace, **options)


@pytest.fixture(scope="module")
def module_kueue(cluster: EmulatedCluster) -> Iterator[KueueStandIn]:
    with stand_in(cluster) as kueue:
        yield kueue


@pytest.fixture
def kueue(module_kueue: KueueStandIn) -> Iterator[KueueStandIn]:
    yield module_kueue
    module_kueue.release()
    assert module_kueue.errors == []


@contextlib.contextmanager
def webhook_of(cluster: EmulatedCluster, version: str) -> Iterator[None]:
    hooks = cluster.emulator.validating_webhooks
    saved = list(hooks)
    hooks[:] = [h for h in hooks if h.name != WEBHOOK_NAME] + [kueue_rayjob_webhook(version)]
    try:
        yield
    finally:
        hooks[:] = saved


# --- RayJobs and Workloads --------------------------------------------------------------------------


def make_rayjob(
    name: str, *, groups: int = 1, suspend: bool = True, queue: str | None = "team-a"
) -> dict[str, Any]:
    """The operator's RayJob for grpo-tiny (queued on ``queue``), renamed, without its owner
    (the RLHFJob does not exist here: the emulator would collect an orphan)."""
    manifest = yaml.safe_load((ROOT / "examples" / "grpo-tiny.yaml").read_text())
    manifest["metadata"].update(namespace=NS, uid="5f0c6b7e-2a4d-4c1e-9a53-0d1e2f3a4b5c", generation=1)
    if queue is not None:
        manifest["spec"]["queueName"] = queue
    job = parse_job_manifest(manifest, "grpo-tiny")
    rayjob = build_rayjob(job, JobRef.of(job), attempt=1, defaults=RayJobDefaults(image="img:test"))
    rayjob["metadata"].pop("ownerReferences")
    rayjob["metadata"]["name"] = name
    rayjob["metadata"].pop("namespace")
    rayjob["spec"]["suspend"] = suspend
    worker = rayjob["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]
    rayjob["spec"]["rayClusterSpec"]["workerGroupSpecs"] = [
        {**copy.deepcopy(worker), "groupName": f"g{index}" if groups > 1 else worker["groupName"]}
        for index in range(groups)
    ]
    return rayjob


def create(cluster: EmulatedCluster, rayjob: dict[str, Any], namespace: str = NS) -> dict[str, Any]:
    created: dict[str, Any] = api(cluster).create_namespaced_custom_object(
        "ray.io", "v1", namespace, "rayjobs", rayjob
    )
    return created


def rayjob(cluster: EmulatedCluster, name: str, namespace: str = NS) -> dict[str, Any]:
    found: dict[str, Any] = api(cluster).get_namespaced_custom_object(
        "ray.io", "v1", namespace, "rayjobs", name
    )
    return found


def patch_rayjob(cluster: EmulatedCluster, name: str, body: dict[str, Any], namespace: str = NS) -> None:
    api(cluster).patch_namespaced_custom_object("ray.io", "v1", namespace, "rayjobs", name, body)


def kuberay(
    cluster: EmulatedCluster, name: str, deployment: str, job_status: str = "", namespace: str = NS
) -> None:
    """Play KubeRay: write the RayJob's status (Running, Suspended once its pods are gone, ...)."""
    status = {"jobDeploymentStatus": deployment, "jobStatus": job_status}
    api(cluster).patch_namespaced_custom_object_status(
        "ray.io", "v1", namespace, "rayjobs", name, {"status": status}
    )


def suspended(cluster: EmulatedCluster, name: str, namespace: str = NS) -> bool:
    return bool(rayjob(cluster, name, namespace)["spec"].get("suspend"))


def workloads_of(cluster: EmulatedCluster, name: str, namespace: str = NS) -> list[dict[str, Any]]:
    """The RayJob's Workloads as an operator finds them: one LIST by Kueue's job-uid label."""
    uid = rayjob(cluster, name, namespace)["metadata"]["uid"]
    listed = api(cluster).list_namespaced_custom_object(
        GROUP, WORKLOAD_VERSION, namespace, WORKLOAD_PLURAL, label_selector=f"{JOB_UID_LABEL}={uid}"
    )
    items: list[dict[str, Any]] = listed["items"]
    return items


def workload(cluster: EmulatedCluster, name: str, namespace: str = NS) -> dict[str, Any]:
    return wait_until(
        lambda: next(iter(workloads_of(cluster, name, namespace)), None), message=f"{name}'s Workload"
    )


def set_active(cluster: EmulatedCluster, name: str, active: bool) -> None:
    """What an operator does to hold or resume a queued job: patch the Workload's spec.active (v1beta2)."""
    found = workload(cluster, name)
    api(cluster).patch_namespaced_custom_object(
        GROUP, WORKLOAD_VERSION, NS, WORKLOAD_PLURAL, found["metadata"]["name"], {"spec": {"active": active}}
    )


def reason(found: dict[str, Any], kind: str) -> tuple[str | None, str | None]:
    cond = condition(found, kind)
    return (None, None) if cond is None else (cond["status"], cond["reason"])


def admitted_and_running(cluster: EmulatedCluster, name: str) -> None:
    create(cluster, make_rayjob(name))
    wait_until(lambda: not suspended(cluster, name), message=f"{name} unsuspended")
    kuberay(cluster, name, "Running", "RUNNING")


def stays(predicate: Any, seconds: float = QUIET_SECONDS) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not predicate():
            return False
        time.sleep(0.05)
    return True


def webhook_denial(error: ApiException) -> str:
    assert error.status == 403, error.body
    body = str(error.body)
    assert f'admission webhook \\"{WEBHOOK_NAME}\\" denied the request' in body
    return body


# --- the job reconciler -------------------------------------------------------------------------------


def test_workload_name_is_kueues_owner_hash() -> None:
    # The vector of Kueue's TestGenerateWorkloadNameWithExtra (batch/v1 Job "name", uid "uid").
    assert owner_workload_name("name", "uid", "Job", "batch") == "job-name-ef3a1"
    assert workload_name("a" * 300, "u").startswith("rayjob-" + "a" * 240)
    assert len(workload_name("a" * 300, "u")) == 253


def test_suspended_rayjob_gets_one_workload_and_is_unsuspended_once_admitted(
    cluster: EmulatedCluster, kueue: KueueStandIn
) -> None:
    created = create(cluster, make_rayjob("admit"))
    wait_until(lambda: not suspended(cluster, "admit"), message="admit unsuspended")
    [found] = workloads_of(cluster, "admit")
    uid = created["metadata"]["uid"]
    assert found["metadata"]["name"] == workload_name("admit", uid)
    assert found["metadata"]["ownerReferences"] == [
        {
            "apiVersion": "ray.io/v1",
            "kind": "RayJob",
            "name": "admit",
            "uid": uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }
    ]
    assert found["metadata"]["finalizers"] == [RESOURCE_IN_USE_FINALIZER]
    assert found["spec"]["active"] is True and found["spec"]["queueName"] == "team-a"
    assert [(p["name"], p["count"]) for p in found["spec"]["podSets"]] == [
        ("head", 1),
        ("default", 1),
        ("submitter", 1),
    ]
    assert reason(found, "QuotaReserved") == ("True", "QuotaReserved")
    assert reason(found, "Admitted") == ("True", "Admitted")
    assert found["status"]["admission"]["clusterQueue"] == "cluster-queue"
    # Kueue's start writes the pod set's name into each pod template (podset.Merge).
    spec = rayjob(cluster, "admit")["spec"]
    templates = [
        spec["rayClusterSpec"]["headGroupSpec"]["template"],
        spec["rayClusterSpec"]["workerGroupSpecs"][0]["template"],
        spec["submitterPodTemplate"],
    ]
    assert [t["metadata"]["labels"][PODSET_LABEL] for t in templates] == ["head", "default", "submitter"]
    wait_until(
        lambda: [e.reason for e in kueue.events if e.rayjob == "admit"] == ["CreatedWorkload", "Started"]
    )


def test_suspend_written_by_someone_else_on_an_admitted_job_is_undone(
    cluster: EmulatedCluster, kueue: KueueStandIn
) -> None:
    admitted_and_running(cluster, "resuspend")
    patch_rayjob(cluster, "resuspend", {"spec": {"suspend": True}})  # e.g. the operator pausing it
    wait_until(lambda: not suspended(cluster, "resuspend"), message="Kueue unsuspends it again")
    wait_until(lambda: [e.reason for e in kueue.events if e.rayjob == "resuspend"].count("Started") == 2)


def test_running_rayjob_without_an_admitted_workload_is_suspended(
    cluster: EmulatedCluster, kueue: KueueStandIn
) -> None:
    kueue.hold()
    create(cluster, make_rayjob("unsuspended", suspend=False))
    wait_until(lambda: suspended(cluster, "unsuspended"), message="Kueue suspends it")
    pending = workload(cluster, "unsuspended")
    assert reason(pending, "QuotaReserved") in ((None, None), ("False", "Pending"))
    kueue.release()
    wait_until(lambda: not suspended(cluster, "unsuspended"), message="admitted after release")


def test_hold_keeps_a_queued_job_suspended_until_released(
    cluster: EmulatedCluster, kueue: KueueStandIn
) -> None:
    kueue.hold()
    create(cluster, make_rayjob("held"))
    wait_until(lambda: reason(workload(cluster, "held"), "QuotaReserved") == ("False", "Pending"))
    assert stays(lambda: suspended(cluster, "held"))
    assert "admission" not in workload(cluster, "held").get("status", {})
    kueue.release()
    wait_until(lambda: not suspended(cluster, "held"), message="admitted after release")


def test_deactivated_workload_suspends_the_job_and_is_not_readmitted(
    cluster: EmulatedCluster, kueue: KueueStandIn
) -> None:
    admitted_and_running(cluster, "deactivate")
    set_active(cluster, "deactivate", False)
    wait_until(lambda: suspended(cluster, "deactivate"), message="Kueue suspends it")
    assert reason(workload(cluster, "deactivate"), "Evicted") == ("True", "Deactivated")
    # Quota stays reserved while KubeRay still reports the job's pods.
    assert stays(lambda: is_true(workload(cluster, "deactivate"), "QuotaReserved"))
    kuberay(cluster, "deactivate", "Suspended")
    wait_until(
        lambda: not is_true(workload(cluster, "deactivate"), "QuotaReserved"), message="quota released"
    )
    released = workload(cluster, "deactivate")
    assert "admission" not in released["status"]
    assert reason(released, "Requeued") == ("False", "Deactivated")
    assert reason(released, "Admitted") == ("False", "NoReservation")
    assert stays(
        lambda: suspended(cluster, "deactivate") and not is_true(workload(cluster, "deactivate"), "Admitted")
    )


def test_reactivated_workload_is_readmitted_and_unsuspended(
    cluster: EmulatedCluster, kueue: KueueStandIn
) -> None:
    admitted_and_running(cluster, "reactivate")
    set_active(cluster, "reactivate", False)
    wait_until(lambda: suspended(cluster, "reactivate"))
    kuberay(cluster, "reactivate", "Suspended")
    wait_until(lambda: reason(workload(cluster, "reactivate"), "Requeued") == ("False", "Deactivated"))
    set_active(cluster, "reactivate", True)
    wait_until(lambda: not suspended(cluster, "reactivate"), message="unsuspended once reactivated")
    found = workload(cluster, "reactivate")
    assert reason(found, "Requeued") == ("True", "Reactivated")
    assert reason(found, "Evicted") == ("False", "QuotaReserved")
    assert reason(found, "Admitted") == ("True", "Admitted")


def test_preempted_workload_suspends_the_job_then_is_requeued_and_readmitted(
    cluster: EmulatedCluster, kueue: KueueStandIn
) -> None:
    admitted_and_running(cluster, "preempt")
    kueue.evict("preempt")
    wait_until(lambda: suspended(cluster, "preempt"), message="Kueue suspends it")
    evicted = workload(cluster, "preempt")
    assert reason(evicted, "Evicted") == ("True", "Preempted")
    assert reason(evicted, "Preempted") == ("True", "InClusterQueue")
    assert stays(lambda: is_true(workload(cluster, "preempt"), "QuotaReserved"))  # pods still there
    kuberay(cluster, "preempt", "Suspended")
    wait_until(lambda: not suspended(cluster, "preempt"), message="readmitted and unsuspended")
    found = workload(cluster, "preempt")
    assert reason(found, "Requeued") == ("True", "Preempted")
    assert reason(found, "Evicted") == ("False", "QuotaReserved")
    assert reason(found, "Preempted") == ("False", "QuotaReserved")


def test_gpu_quota_admits_what_fits_and_a_finished_job_releases_it(cluster: EmulatedCluster) -> None:
    with stand_in(cluster, "quota", gpus=2) as kueue:  # each grpo-tiny RayJob asks for 2 GPUs
        for name in ("quota-1", "quota-2"):
            create(cluster, make_rayjob(name), "quota")
        wait_until(lambda: not suspended(cluster, "quota-1", "quota"), message="the first fits")
        wait_until(
            lambda: reason(workload(cluster, "quota-2", "quota"), "QuotaReserved") == ("False", "Pending")
        )
        assert stays(lambda: suspended(cluster, "quota-2", "quota"))
        kuberay(cluster, "quota-1", "Complete", "SUCCEEDED", "quota")
        wait_until(
            lambda: not suspended(cluster, "quota-2", "quota"), message="the second gets the freed GPUs"
        )
        finished = workload(cluster, "quota-1", "quota")
        assert reason(finished, "Finished") == ("True", "Succeeded")
        assert not finished["metadata"].get("finalizers")
        assert kueue.errors == []


def test_deleted_rayjob_takes_its_workload(cluster: EmulatedCluster, kueue: KueueStandIn) -> None:
    admitted_and_running(cluster, "delete-job")
    uid = rayjob(cluster, "delete-job")["metadata"]["uid"]
    api(cluster).delete_namespaced_custom_object("ray.io", "v1", NS, "rayjobs", "delete-job")

    def workloads_left() -> list[Any]:
        selector = f"{JOB_UID_LABEL}={uid}"
        return list(
            api(cluster).list_namespaced_custom_object(
                GROUP, WORKLOAD_VERSION, NS, WORKLOAD_PLURAL, label_selector=selector
            )["items"]
        )

    wait_until(
        lambda: not workloads_left(), message="the Workload is collected once Kueue drops its finalizer"
    )


def test_deleted_workload_stops_the_job_and_a_new_one_admits_it(
    cluster: EmulatedCluster, kueue: KueueStandIn
) -> None:
    admitted_and_running(cluster, "delete-wl")
    first = workload(cluster, "delete-wl")
    api(cluster).delete_namespaced_custom_object(
        GROUP, WORKLOAD_VERSION, NS, WORKLOAD_PLURAL, first["metadata"]["name"]
    )
    wait_until(lambda: suspended(cluster, "delete-wl"), message="Kueue stops the job")
    kuberay(cluster, "delete-wl", "Suspended")
    wait_until(lambda: not suspended(cluster, "delete-wl"), message="a new Workload admits it")
    assert workload(cluster, "delete-wl")["metadata"]["uid"] != first["metadata"]["uid"]


def test_queue_change_of_a_suspended_job_moves_its_workload(
    cluster: EmulatedCluster, kueue: KueueStandIn
) -> None:
    kueue.hold()
    create(cluster, make_rayjob("requeue"))
    workload(cluster, "requeue")
    patch_rayjob(cluster, "requeue", {"metadata": {"labels": {QUEUE_LABEL: "team-b"}}})
    wait_until(lambda: workload(cluster, "requeue")["spec"]["queueName"] == "team-b")


def test_seven_worker_groups_pass_the_017_webhook_but_overflow_its_workload(cluster: EmulatedCluster) -> None:
    # Kueue 0.17 lets 7 worker groups through (head + 7 = 8 pod sets), but in K8sJobMode the
    # Workload also holds the submitter: 9 pod sets, over the Workload CRD's maxItems of 8.
    with webhook_of(cluster, "0.17"), stand_in(cluster, "kueue-017", kueue_version="0.17") as kueue:
        create(cluster, make_rayjob("seven", groups=7), "kueue-017")
        create(cluster, make_rayjob("six", groups=6), "kueue-017")
        wait_until(lambda: not suspended(cluster, "six", "kueue-017"), message="6 groups: 8 pod sets fit")
        assert "9 pod sets" in wait_until(lambda: kueue.refused.get("seven", ""))
        assert suspended(cluster, "seven", "kueue-017") and not workloads_of(cluster, "seven", "kueue-017")
        assert kueue.errors == []


def test_a_worker_group_named_submitter_passes_the_webhook_but_its_workload_is_refused(
    cluster: EmulatedCluster,
) -> None:
    # Kueue's webhook only reserves "head"; in K8sJobMode the Workload also gets a pod set named
    # "submitter", and spec.podSets is a list map keyed by name: the API server refuses the create.
    with stand_in(cluster, "kueue-submitter") as kueue:
        body = make_rayjob("submitter-group")
        body["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["groupName"] = "submitter"
        create(cluster, body, "kueue-submitter")
        assert "Duplicate value" in wait_until(lambda: kueue.refused.get("submitter-group", ""))
        assert stays(lambda: suspended(cluster, "submitter-group", "kueue-submitter"))
        assert not workloads_of(cluster, "submitter-group", "kueue-submitter") and kueue.errors == []


@pytest.mark.parametrize(("version", "released"), [("0.17", False), ("0.18", True), ("0.19", True)])
def test_a_validation_failed_job_releases_its_quota_only_from_0_18(
    cluster: EmulatedCluster, version: str, released: bool
) -> None:
    # RayJob.IsOnHold exists from 0.18: before, a ValidationFailed RayJob is neither finished nor
    # inactive, and its Workload keeps the quota (so admission must refuse what KubeRay would).
    namespace = f"on-hold-{version.replace('.', '')}"
    with stand_in(cluster, namespace, kueue_version=version) as kueue:
        create(cluster, make_rayjob("invalid"), namespace)
        wait_until(lambda: not suspended(cluster, "invalid", namespace), message="admitted")
        kuberay(cluster, "invalid", "ValidationFailed", namespace=namespace)
        holding = lambda: is_true(workload(cluster, "invalid", namespace), "QuotaReserved")  # noqa: E731
        if released:
            wait_until(lambda: not holding(), message="quota released")
            assert reason(workload(cluster, "invalid", namespace), "QuotaReserved") == ("False", "OnHold")
        else:
            assert stays(holding)
        assert kueue.errors == []


class PlayKubeRay:
    """KubeRay for one namespace's RayJobs, on a thread: a suspended RayJob's pods go (Suspended), an
    unsuspended one's cluster starts (Running), and is ready (``rayClusterStatus.state``) once
    ``ready_after(name)`` says so, which a test uses to model GPUs that are not free yet."""

    def __init__(self, cluster: EmulatedCluster, namespace: str, ready_after: Any = lambda name: 0.0) -> None:
        self.cluster, self.namespace, self.ready_after = cluster, namespace, ready_after
        self.started: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> PlayKubeRay:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            items = api(self.cluster).list_namespaced_custom_object("ray.io", "v1", self.namespace, "rayjobs")
            for item in items["items"]:
                name, status = item["metadata"]["name"], item.get("status") or {}
                deployment = status.get("jobDeploymentStatus", "")
                if item["spec"].get("suspend"):
                    self.started.pop(name, None)
                    if deployment not in ("", "Suspended"):
                        kuberay(self.cluster, name, "Suspended", namespace=self.namespace)
                    continue
                since = self.started.setdefault(name, time.monotonic())
                ready = time.monotonic() >= since + self.ready_after(name)
                want = {
                    "jobDeploymentStatus": "Running",
                    "rayClusterStatus": {"state": "ready" if ready else ""},
                }
                if {k: status.get(k) for k in want} != want:
                    api(self.cluster).patch_namespaced_custom_object_status(
                        "ray.io", "v1", self.namespace, "rayjobs", name, {"status": want}
                    )


def test_kueue_deactivates_a_job_past_its_maximum_execution_time_and_only_a_new_workload_requeues_it(
    cluster: EmulatedCluster,
) -> None:
    namespace = "max-exec"
    body = make_rayjob("slow")
    body["metadata"]["labels"][MAX_EXEC_TIME_LABEL] = "1"
    with stand_in(cluster, namespace) as kueue, PlayKubeRay(cluster, namespace):
        create(cluster, body, namespace)
        wait_until(
            lambda: suspended(cluster, "slow", namespace),
            message="deactivated and suspended",
            timeout_seconds=15,
        )
        evicted = wait_until(lambda: condition(workload(cluster, "slow", namespace), "Evicted"))
        found = workload(cluster, "slow", namespace)
        assert found["spec"]["active"] is False
        assert evicted is not None and evicted["reason"] == "DeactivatedDueToMaximumExecutionTimeExceeded"
        assert evicted["message"] == "The workload is deactivated due to exceeding the maximum execution time"
        assert condition(found, "DeactivationTarget") is None
        wait_until(lambda: reason(workload(cluster, "slow", namespace), "Requeued")[1] == evicted["reason"])
        # Made active again it stays Requeued=False (0.19.2 reactivates only reason "Deactivated"):
        api(cluster).patch_namespaced_custom_object(
            GROUP,
            WORKLOAD_VERSION,
            namespace,
            WORKLOAD_PLURAL,
            found["metadata"]["name"],
            {"spec": {"active": True}},
        )
        assert stays(lambda: suspended(cluster, "slow", namespace), seconds=1.0)
        # Deleted, it is replaced by a new Workload, which is admitted.
        api(cluster).delete_namespaced_custom_object(
            GROUP, WORKLOAD_VERSION, namespace, WORKLOAD_PLURAL, found["metadata"]["name"]
        )
        wait_until(lambda: not suspended(cluster, "slow", namespace), message="a new Workload admits it")
        assert kueue.errors == []


def test_a_rejected_admission_check_deactivates_the_workload(cluster: EmulatedCluster) -> None:
    namespace = "checks"
    with stand_in(cluster, namespace) as kueue, PlayKubeRay(cluster, namespace):
        create(cluster, make_rayjob("checked"), namespace)
        wait_until(lambda: not suspended(cluster, "checked", namespace))
        kueue.reject_admission_check("checked", "provisioning", "no capacity in zone a")
        wait_until(lambda: suspended(cluster, "checked", namespace), message="deactivated and suspended")
        evicted = condition(workload(cluster, "checked", namespace), "Evicted")
        assert evicted is not None and evicted["reason"] == "DeactivatedDueToAdmissionCheck"
        assert evicted["message"] == (
            'The workload is deactivated due to AdmissionCheck in Rejected state: "provisioning" (no capacity in zone a)'
        )
        assert kueue.errors == []


def test_pods_never_ready_are_requeued_until_kueue_deactivates_the_workload(cluster: EmulatedCluster) -> None:
    namespace = "never-ready"
    config = WaitForPodsReady(timeout_seconds=1, backoff_limit_count=1, backoff_base_seconds=1)
    with (
        stand_in(cluster, namespace, wait_for_pods_ready=config) as kueue,
        PlayKubeRay(cluster, namespace, ready_after=lambda name: 3600),
    ):
        create(cluster, make_rayjob("stuck"), namespace)
        wait_until(
            lambda: workload(cluster, "stuck", namespace)["spec"]["active"] is False,
            message="deactivated after one requeue",
            timeout_seconds=20,
        )

        def evicted_workload() -> dict[str, Any] | None:
            found = workload(cluster, "stuck", namespace)
            return found if is_true(found, "Evicted") else None

        found = wait_until(evicted_workload)
        assert condition(found, "Evicted")["reason"] == "DeactivatedDueToRequeuingLimitExceeded"  # type: ignore[index]
        assert [e.reason for e in kueue.events if e.rayjob == "stuck"].count(
            "EvictedDueToPodsReadyTimeout"
        ) == 1
        assert kueue.errors == []


@pytest.mark.parametrize(("timeout", "flaps"), [(1, True), (6, False)])
def test_a_preemptor_admitted_onto_gpus_still_held_flaps_unless_pods_ready_waits_longer(
    cluster: EmulatedCluster, timeout: int, flaps: bool
) -> None:
    """KubeRay reports a preempted RayJob Suspended once its RayCluster object is gone, so Kueue
    (``IsActive``) frees the quota while its pods still hold the GPUs in their preStop hooks. The
    preemptor (higher priority) is admitted at once, and its pods wait for those GPUs (here 3 s).
    With waitForPodsReady's timeout below that wait the preemptor is evicted, and while it backs
    off the preempted job is admitted again: admission flaps. Above it, the preemptor starts once."""
    namespace = f"overlap-{timeout}"
    held_until = {"gpus": 0.0}
    # The preemptor's requeue waits 20 s: long enough that the preempted job is seen readmitted
    # before it, however slow the machine (10 s was not, under the full suite's load).
    config = WaitForPodsReady(timeout_seconds=timeout, backoff_base_seconds=20)

    def ready_after(name: str) -> float:
        return max(0.0, held_until["gpus"] - time.monotonic())  # nothing starts on GPUs still held

    with (
        stand_in(
            cluster, namespace, gpus=2, wait_for_pods_ready=config, priority_classes={"high": 100}
        ) as kueue,
        PlayKubeRay(cluster, namespace, ready_after=ready_after),
    ):
        create(cluster, make_rayjob("first"), namespace)
        wait_until(lambda: is_true(workload(cluster, "first", namespace), "PodsReady"), message="first runs")
        preemptor = make_rayjob("preemptor")
        preemptor["metadata"]["labels"]["kueue.x-k8s.io/priority-class"] = "high"
        create(cluster, preemptor, namespace)
        held_until["gpus"] = time.monotonic() + 3  # from the eviction: first's pods in their hooks
        kueue.evict("first")
        # Kueue's "Started" event, not the RayJob's state: with a 1 s timeout the preemptor may be
        # admitted and evicted again between two polls on a busy machine. The admission waits for
        # KubeRay's and Kueue's loops to release the first job's quota: 30 s, as the full suite's
        # load made 10 s too short (CI, 2026-12-07).
        wait_until(
            lambda: any(e.rayjob == "preemptor" and e.reason == "Started" for e in kueue.events),
            timeout_seconds=30,
            message="the preemptor is admitted",
        )

        def timeouts() -> list[Any]:
            return [
                e
                for e in kueue.events
                if e.rayjob == "preemptor" and e.reason == "EvictedDueToPodsReadyTimeout"
            ]

        if flaps:
            wait_until(timeouts, timeout_seconds=15, message="the preemptor evicted: its pods were not ready")
            wait_until(
                lambda: not suspended(cluster, "first", namespace),
                timeout_seconds=20,
                message="the preempted job readmitted",
            )
        else:
            wait_until(
                lambda: is_true(workload(cluster, "preemptor", namespace), "PodsReady"), timeout_seconds=15
            )
            assert not timeouts() and stays(lambda: suspended(cluster, "first", namespace), seconds=1.0)
        assert kueue.errors == []


# --- the webhook (no stand-in runs in namespace "webhook") ----------------------------------------------


@pytest.mark.parametrize(
    ("version", "refused", "accepted"), [("0.17", 8, 7), ("0.18", 10, 9), ("0.19", 18, 17)]
)
def test_webhook_limits_pod_sets_per_kueue_version(
    cluster: EmulatedCluster, version: str, refused: int, accepted: int
) -> None:
    with webhook_of(cluster, version):
        with pytest.raises(ApiException) as denied:
            create(
                cluster,
                make_rayjob(f"groups-{version.replace('.', '')}-{refused}", groups=refused),
                "webhook",
            )
        assert "spec.rayClusterSpec.workerGroupSpecs" in webhook_denial(denied.value)
        create(
            cluster, make_rayjob(f"groups-{version.replace('.', '')}-{accepted}", groups=accepted), "webhook"
        )


def test_webhook_refuses_a_worker_group_named_head(cluster: EmulatedCluster) -> None:
    body = make_rayjob("named-head")
    body["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["groupName"] = "head"
    with pytest.raises(ApiException) as denied:
        create(cluster, body, "webhook")
    assert "workerGroupSpecs[0].groupName" in webhook_denial(denied.value)


def test_webhook_refuses_specs_kueue_cannot_manage(cluster: EmulatedCluster) -> None:
    def refused(name: str, change: Any, version: str = "0.19", queue: str | None = "team-a") -> str | None:
        body = make_rayjob(name, queue=queue)
        change(body)
        with webhook_of(cluster, version):
            try:
                create(cluster, body, "webhook")
            except ApiException as error:
                return webhook_denial(error)
        return None

    def no_shutdown(body: Any) -> None:
        body["spec"]["shutdownAfterJobFinishes"] = False

    def selector_and_cluster(body: Any) -> None:
        body["spec"]["clusterSelector"] = {"ray.io/cluster": "shared"}

    def no_cluster(body: Any) -> None:
        del body["spec"]["rayClusterSpec"]
        body["spec"].pop("submitterPodTemplate")

    def autoscaling(body: Any) -> None:
        body["spec"]["rayClusterSpec"]["enableInTreeAutoscaling"] = True

    def elastic_autoscaling(body: Any) -> None:
        autoscaling(body)
        body["metadata"]["annotations"]["kueue.x-k8s.io/elastic-job"] = "true"

    assert "spec.shutdownAfterJobFinishes" in (refused("no-shutdown", no_shutdown) or "")
    assert "spec.clusterSelector" in (refused("selector", selector_and_cluster) or "")
    assert "spec.rayClusterSpec" in (refused("no-cluster", no_cluster) or "")
    assert "enableInTreeAutoscaling" in (refused("autoscale", autoscaling) or "")
    assert "enableInTreeAutoscaling" in (refused("autoscale-017", elastic_autoscaling, "0.17") or "")
    assert refused("autoscale-elastic", elastic_autoscaling) is None  # elastic jobs, beta from 0.18
    assert refused("not-queued", no_shutdown, queue=None) is None  # Kueue leaves it alone


@pytest.mark.parametrize("version", ["0.17", "0.19"])
def test_webhook_keeps_the_queue_name_of_an_unsuspended_job(cluster: EmulatedCluster, version: str) -> None:
    name = f"running-{version.replace('.', '')}"
    with webhook_of(cluster, version):
        create(cluster, make_rayjob(name, suspend=False), "webhook")
        with pytest.raises(ApiException) as denied:
            patch_rayjob(cluster, name, {"metadata": {"labels": {QUEUE_LABEL: "team-b"}}}, "webhook")
        assert QUEUE_LABEL in webhook_denial(denied.value)
        removal = {"metadata": {"labels": {QUEUE_LABEL: None}}}
        if version == "0.17":  # only the new object is checked: without the label, nothing is
            patch_rayjob(cluster, name, removal, "webhook")
            patch_rayjob(
                cluster,
                name,
                {"metadata": {"labels": {QUEUE_LABEL: "team-a"}}, "spec": {"suspend": True}},
                "webhook",
            )
        else:  # 0.18+: a job that was queued is checked too (ValidateRayAndSparkJobUpdates)
            with pytest.raises(ApiException) as denied:
                patch_rayjob(cluster, name, removal, "webhook")
            webhook_denial(denied.value)
            patch_rayjob(cluster, name, {"spec": {"suspend": True}}, "webhook")
        patch_rayjob(
            cluster, name, {"metadata": {"labels": {QUEUE_LABEL: "team-b"}}}, "webhook"
        )  # suspended: free
