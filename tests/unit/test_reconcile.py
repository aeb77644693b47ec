"""The reconcile against an in-memory cluster that plays KubeRay: children, phases, retries, no-op passes."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml

from hybridflow_operator.builders import RayJobDefaults
from hybridflow_operator.cluster import ApiError
from hybridflow_operator.reconcile import reconcile

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
DEFAULTS = RayJobDefaults(image="example.com/hybridflow-runtime:test")
T0 = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)


def merge(target: dict[str, Any], patch: Mapping[str, Any]) -> None:
    for key, value in patch.items():
        if value is None:
            target.pop(key, None)
        elif isinstance(value, Mapping) and isinstance(target.get(key), dict):
            merge(target[key], value)
        else:
            target[key] = copy.deepcopy(value)


class FakeCluster:
    """Objects by (kind, name) in one namespace; counts every write; as strict as the API server on names.

    ``fail`` maps a (verb, kind) to the ApiError the next such request raises (and keeps raising).
    """

    def __init__(self, job: dict[str, Any]) -> None:
        self.objects: dict[tuple[str, str], dict[str, Any]] = {("RLHFJob", job["metadata"]["name"]): job}
        self.writes = 0
        self.events: list[tuple[str, str]] = []
        self.fail: dict[tuple[str, str], ApiError] = {}
        self.written: Any = None

    @property
    def job(self) -> dict[str, Any]:
        return next(v for (k, _), v in self.objects.items() if k == "RLHFJob")

    def _check(self, verb: str, kind: str) -> None:
        if (verb, kind) in self.fail:
            raise self.fail[(verb, kind)]

    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        raise AssertionError("the reconcile reads from the caches, never from the API server")

    def create(self, obj: Mapping[str, Any]) -> bool:
        self._check("create", obj["kind"])
        key = (obj["kind"], obj["metadata"]["name"])
        if key in self.objects:
            return False
        self.writes += 1
        created = copy.deepcopy(dict(obj))
        created["metadata"]["creationTimestamp"] = T0.isoformat()
        self.objects[key] = created
        return True

    def patch(self, kind: str, namespace: str, name: str, patch: Mapping[str, Any]) -> None:
        self._check("patch", kind)
        self.writes += 1
        merge(self.objects[(kind, name)], patch)

    def delete(self, kind: str, namespace: str, name: str) -> None:
        self._check("delete", kind)
        self.writes += 1
        self.objects.pop((kind, name), None)

    def patch_job_status(self, namespace: str, name: str, status: Mapping[str, Any]) -> None:
        self._check("patch", "RLHFJob/status")
        self.writes += 1
        merge(self.objects[("RLHFJob", name)].setdefault("status", {}), status)

    def emit_event(self, job: Mapping[str, Any], event: Any) -> None:
        self._check("create", "Event")
        self.writes += 1
        self.events.append((event.type, event.reason))

    def kuberay(
        self,
        name: str,
        deployment: str,
        job_status: str = "",
        reason: str = "",
        message: str = "",
        end: datetime | None = None,
    ) -> None:
        """Play KubeRay: set the RayJob's status as its controller would."""
        status = {
            "jobDeploymentStatus": deployment,
            "jobStatus": job_status,
            "reason": reason,
            "message": message,
            "startTime": T0.isoformat(),
        }
        if end is not None:
            status["endTime"] = end.isoformat()
        self.objects[("RayJob", name)]["status"] = status

    def children(self) -> list[dict[str, Any]]:
        return [copy.deepcopy(v) for (k, _), v in self.objects.items() if k != "RLHFJob"]

    def pass_(self, now: datetime = T0) -> int:
        before = self.writes
        if ("RLHFJob", self.job["metadata"]["name"]) in self.objects:
            self.result = reconcile(copy.deepcopy(self.job), self.children(), self, DEFAULTS, now=now)
        return self.writes - before


def job_body(**spec_updates: Any) -> dict[str, Any]:
    doc = yaml.safe_load((ROOT / "examples" / "grpo-tiny.yaml").read_text())
    doc["metadata"].update(namespace="team-a", uid="1111-2222", generation=1)
    doc["spec"].update(spec_updates)
    return doc


def kinds(cluster: FakeCluster) -> list[tuple[str, str]]:
    return sorted(k for k in cluster.objects if k[0] != "RLHFJob")


def test_first_pass_creates_the_children_and_a_second_writes_nothing() -> None:
    cluster = FakeCluster(job_body())
    assert cluster.pass_() > 0
    assert kinds(cluster) == [
        ("ConfigMap", "grpo-tiny-config"),
        ("RayJob", "grpo-tiny-1"),
        ("Role", "grpo-tiny-controller"),
        ("RoleBinding", "grpo-tiny-controller"),
        ("ServiceAccount", "grpo-tiny-controller"),
    ]
    status = cluster.job["status"]
    assert status["attempts"] == 1 and status["rayJobName"] == "grpo-tiny-1"
    created = [c for c in cluster.job["status"]["conditions"] if c["type"] == "RayJobCreated"]
    assert created[0]["status"] == "True"  # set by the pass that created it: no second status write
    assert cluster.writes == 6  # 5 children + 1 status; Pending has no Event
    assert cluster.pass_() == 0  # level-triggered: the next pass observes the RayJob, changes nothing


def test_phases_follow_kuberay_and_the_run_succeeds() -> None:
    cluster = FakeCluster(job_body())
    cluster.pass_()
    cluster.kuberay("grpo-tiny-1", "Initializing")
    cluster.pass_()
    assert cluster.job["status"]["phase"] == "Initializing"
    cluster.kuberay("grpo-tiny-1", "Running", "RUNNING")
    cluster.pass_()
    assert cluster.job["status"]["phase"] == "Running"
    assert cluster.pass_() == 0
    cluster.kuberay("grpo-tiny-1", "Complete", "SUCCEEDED")
    cluster.pass_()
    status = cluster.job["status"]
    assert status["phase"] == "Succeeded" and status["jobStatus"] == "SUCCEEDED"
    assert ("Normal", "Succeeded") in cluster.events
    assert cluster.pass_() == 0


def test_failed_attempts_retry_after_an_exponential_backoff_until_max_restarts() -> None:
    cluster = FakeCluster(job_body(maxRestarts=2))
    cluster.pass_()
    cluster.kuberay("grpo-tiny-1", "Failed", "FAILED", reason="AppFailed", message="OOM at step 3", end=T0)
    cluster.pass_(T0 + timedelta(seconds=1))
    status = cluster.job["status"]
    assert status["phase"] == "Retrying" and status["attempts"] == 1
    assert ("RayJob", "grpo-tiny-2") not in cluster.objects  # not at once: 10 s of backoff first
    assert cluster.result.recheck_after_seconds == 9
    assert ("Warning", "Retrying") in cluster.events
    cluster.pass_(T0 + timedelta(seconds=10))
    assert cluster.job["status"]["attempts"] == 2
    assert cluster.objects[("RayJob", "grpo-tiny-2")]["metadata"]["labels"]["hybridflow.io/attempt"] == "2"
    assert ("RayJob", "grpo-tiny-1") in cluster.objects  # kept for `kubectl describe` and logs
    end = T0 + timedelta(seconds=100)
    cluster.kuberay("grpo-tiny-2", "Failed", "FAILED", reason="SubmissionFailed", message="timeout", end=end)
    cluster.pass_(end + timedelta(seconds=19))
    assert ("RayJob", "grpo-tiny-3") not in cluster.objects  # the second wait doubles: 20 s
    cluster.pass_(end + timedelta(seconds=20))
    assert ("RayJob", "grpo-tiny-3") in cluster.objects
    cluster.kuberay("grpo-tiny-3", "Failed", "FAILED", reason="AppFailed", end=end + timedelta(seconds=60))
    cluster.pass_(end + timedelta(seconds=3600))
    status = cluster.job["status"]
    assert status["phase"] == "Failed" and status["reason"] == "AppFailed" and status["attempts"] == 3
    assert ("RayJob", "grpo-tiny-4") not in cluster.objects
    assert ("Warning", "Failed") in cluster.events


def test_the_same_application_error_twice_stops_retrying() -> None:
    cluster = FakeCluster(job_body(maxRestarts=5))
    cluster.pass_()
    error = "ValueError: reward function returned NaN"
    cluster.kuberay("grpo-tiny-1", "Failed", "FAILED", reason="AppFailed", message=error, end=T0)
    cluster.pass_(T0 + timedelta(seconds=10))
    cluster.kuberay("grpo-tiny-2", "Failed", "FAILED", reason="AppFailed", message=error, end=T0)
    cluster.pass_(T0 + timedelta(seconds=600))
    status = cluster.job["status"]
    assert (
        status["phase"] == "Failed" and status["reason"] == "RepeatedFailure" and error in status["message"]
    )
    assert ("RayJob", "grpo-tiny-3") not in cluster.objects


def test_suspend_is_written_only_for_the_users_own_changes() -> None:
    cluster = FakeCluster(job_body(queueName="research"))
    cluster.pass_()
    rayjob = cluster.objects[("RayJob", "grpo-tiny-1")]
    assert rayjob["spec"]["suspend"] is True  # created suspended: Kueue admits it
    rayjob["spec"]["suspend"] = False  # Kueue admits
    cluster.kuberay("grpo-tiny-1", "Running", "RUNNING")
    assert cluster.pass_() == 1  # the status; nothing written to the RayJob
    cluster.job["spec"]["suspend"] = True  # the user suspends
    cluster.pass_()
    assert rayjob["spec"]["suspend"] is True
    rayjob["spec"]["suspend"] = False  # Kueue re-admits: the operator does not fight it
    assert cluster.pass_() == 0
    cluster.job["spec"]["suspend"] = False  # the user resumes
    cluster.pass_()
    assert rayjob["metadata"]["annotations"]["hybridflow.io/user-suspend"] == "false"


def test_suspend_without_a_queue_is_mirrored() -> None:
    cluster = FakeCluster(job_body())
    cluster.pass_()
    cluster.kuberay("grpo-tiny-1", "Running", "RUNNING")
    cluster.pass_()
    cluster.job["spec"]["suspend"] = True
    cluster.pass_()
    assert cluster.objects[("RayJob", "grpo-tiny-1")]["spec"]["suspend"] is True
    cluster.job["spec"]["suspend"] = False
    cluster.pass_()
    assert cluster.objects[("RayJob", "grpo-tiny-1")]["spec"]["suspend"] is False
    assert cluster.pass_() == 0


def test_an_invalid_spec_sets_validated_false_and_creates_nothing() -> None:
    body = job_body()
    body["spec"]["algorithm"]["name"] = "ppo2"
    cluster = FakeCluster(body)
    cluster.pass_()
    assert kinds(cluster) == []
    (validated,) = [c for c in cluster.job["status"]["conditions"] if c["type"] == "Validated"]
    assert (
        validated["status"] == "False" and "spec.algorithm.name: 'ppo2' is not one of" in validated["message"]
    )
    assert cluster.pass_() == 0


def test_deadline_stops_the_rayjob_and_keeps_it_as_the_record() -> None:
    cluster = FakeCluster(job_body(activeDeadlineSeconds=600))
    cluster.pass_()
    cluster.kuberay("grpo-tiny-1", "Running", "RUNNING")
    cluster.pass_(T0 + timedelta(seconds=60))
    assert cluster.result.recheck_after_seconds == 540  # the deadline schedules the next pass
    cluster.pass_(T0 + timedelta(seconds=601))
    status = cluster.job["status"]
    assert status["phase"] == "Failed" and status["reason"] == "DeadlineExceeded"
    rayjob = cluster.objects[("RayJob", "grpo-tiny-1")]
    assert rayjob["spec"]["suspend"] is True  # the pods go, the GPUs are released
    assert rayjob["metadata"]["annotations"]["hybridflow.io/stopped"] == "DeadlineExceeded"
    assert cluster.pass_(T0 + timedelta(seconds=700)) == 0


def test_ttl_after_finished_deletes_the_job() -> None:
    cluster = FakeCluster(job_body(ttlSecondsAfterFinished=60))
    cluster.pass_()
    cluster.kuberay("grpo-tiny-1", "Complete", "SUCCEEDED", end=T0)
    cluster.pass_()
    assert cluster.result.recheck_after_seconds == 60
    cluster.pass_(T0 + timedelta(seconds=30))
    assert ("RLHFJob", "grpo-tiny") in cluster.objects
    cluster.pass_(T0 + timedelta(seconds=61))
    assert ("RLHFJob", "grpo-tiny") not in cluster.objects


def test_a_leftover_child_of_another_uid_is_reported_never_adopted() -> None:
    """A new job with a deleted job's name must not take over its finished RayJob."""
    cluster = FakeCluster(job_body())
    leftover = copy.deepcopy(cluster.job)
    leftover["metadata"]["uid"] = "old-uid"
    old = FakeCluster(leftover)
    old.pass_()
    old.kuberay("grpo-tiny-1", "Complete", "SUCCEEDED")
    cluster.objects[("RayJob", "grpo-tiny-1")] = old.objects[("RayJob", "grpo-tiny-1")]
    cluster.pass_()
    status = cluster.job["status"]
    assert status["phase"] == "Pending" and status["attempts"] == 1
    ready = next(c for c in status["conditions"] if c["type"] == "ChildrenReady")
    assert (
        ready["status"] == "False" and ready["reason"] == "NameConflict" and "old-uid" not in ready["message"]
    )
    assert ("Warning", "NameConflict") in cluster.events
    assert cluster.result.failed  # retried with backoff until the garbage collector removes it
    assert cluster.pass_() == 0  # one Event per problem, not one per pass
    del cluster.objects[("RayJob", "grpo-tiny-1")]
    cluster.pass_()
    assert cluster.objects[("RayJob", "grpo-tiny-1")]["metadata"]["ownerReferences"][0]["uid"] == "1111-2222"
    assert (
        next(c for c in cluster.job["status"]["conditions"] if c["type"] == "ChildrenReady")["status"]
        == "True"
    )


def test_a_missing_kuberay_is_reported_and_nothing_is_half_made() -> None:
    cluster = FakeCluster(job_body())
    cluster.fail[("create", "RayJob")] = ApiError(
        "create", "RayJob", "grpo-tiny-1", 404, "NotFound", "the server could not find the requested resource"
    )
    cluster.pass_()
    ready = next(c for c in cluster.job["status"]["conditions"] if c["type"] == "ChildrenReady")
    assert ready["reason"] == "KubeRayMissing" and "404" in ready["message"]
    assert ("Warning", "KubeRayMissing") in cluster.events and cluster.result.failed
    del cluster.fail[("create", "RayJob")]
    cluster.pass_()
    assert ("RayJob", "grpo-tiny-1") in cluster.objects


def test_a_forbidden_role_stops_before_the_rayjob() -> None:
    cluster = FakeCluster(job_body())
    cluster.fail[("create", "Role")] = ApiError(
        "create", "Role", "r", 403, "Forbidden", "cannot create roles"
    )
    cluster.pass_()
    assert ("RayJob", "grpo-tiny-1") not in cluster.objects  # no RayJob without its head's RBAC
    ready = next(c for c in cluster.job["status"]["conditions"] if c["type"] == "ChildrenReady")
    assert ready["reason"] == "Forbidden" and "cannot create roles" in ready["message"]


def test_status_written_by_the_workload_changes_no_decision() -> None:
    """The controller's token can patch status.attempts/phase; the operator decides from its RayJobs."""
    cluster = FakeCluster(job_body(maxRestarts=1))
    cluster.pass_()
    cluster.kuberay("grpo-tiny-1", "Running", "RUNNING")
    cluster.pass_()
    cluster.job["status"].update(attempts=2, phase="Succeeded", rayJobName="grpo-tiny-2")
    cluster.pass_()
    status = cluster.job["status"]
    assert (status["phase"], status["attempts"], status["rayJobName"]) == ("Running", 1, "grpo-tiny-1")
    cluster.kuberay("grpo-tiny-1", "Failed", "FAILED", reason="AppFailed", end=T0)
    cluster.job["status"]["attempts"] = 7  # forged again: retries must still happen
    cluster.pass_(T0 + timedelta(seconds=10))
    assert ("RayJob", "grpo-tiny-2") in cluster.objects and cluster.job["status"]["attempts"] == 2
