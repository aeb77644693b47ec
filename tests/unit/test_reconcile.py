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
    """Objects by (kind, name) in one namespace; counts every write."""

    def __init__(self, job: dict[str, Any]) -> None:
        self.objects: dict[tuple[str, str], dict[str, Any]] = {("RLHFJob", job["metadata"]["name"]): job}
        self.writes = 0
        self.events: list[tuple[str, str]] = []

    @property
    def job(self) -> dict[str, Any]:
        return next(v for (k, _), v in self.objects.items() if k == "RLHFJob")

    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        found = self.objects.get((kind, name))
        return copy.deepcopy(found) if found is not None else None

    def create(self, obj: Mapping[str, Any]) -> None:
        self.writes += 1
        self.objects.setdefault((obj["kind"], obj["metadata"]["name"]), copy.deepcopy(dict(obj)))

    def patch(self, kind: str, namespace: str, name: str, patch: Mapping[str, Any]) -> None:
        self.writes += 1
        merge(self.objects[(kind, name)], patch)

    def delete(self, kind: str, namespace: str, name: str) -> None:
        self.writes += 1
        self.objects.pop((kind, name), None)

    def patch_job_status(self, namespace: str, name: str, status: Mapping[str, Any]) -> None:
        self.writes += 1
        merge(self.objects[("RLHFJob", name)].setdefault("status", {}), status)

    def emit_event(self, job: Mapping[str, Any], event: Any) -> None:
        self.writes += 1
        self.events.append((event.type, event.reason))

    def kuberay(self, name: str, deployment: str, job_status: str = "", reason: str = "") -> None:
        """Play KubeRay: set the RayJob's status as its controller would."""
        self.objects[("RayJob", name)]["status"] = {
            "jobDeploymentStatus": deployment,
            "jobStatus": job_status,
            "reason": reason,
            "startTime": T0.isoformat(),
        }

    def pass_(self, now: datetime = T0) -> int:
        before = self.writes
        if ("RLHFJob", self.job["metadata"]["name"]) in self.objects:
            reconcile(copy.deepcopy(self.job), self, DEFAULTS, now=now)
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
    assert cluster.pass_() == 1  # the next pass observes the created RayJob: RayJobCreated=True
    created = [c for c in cluster.job["status"]["conditions"] if c["type"] == "RayJobCreated"]
    assert created[0]["status"] == "True"
    assert cluster.pass_() == 0  # level-triggered: nothing changed, nothing written


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


def test_failed_attempts_retry_with_a_new_rayjob_until_max_restarts() -> None:
    cluster = FakeCluster(job_body(maxRestarts=1))
    cluster.pass_()
    cluster.kuberay("grpo-tiny-1", "Failed", "FAILED", reason="AppFailed")
    cluster.pass_()
    status = cluster.job["status"]
    assert status["phase"] == "Retrying" and status["attempts"] == 2
    assert ("RayJob", "grpo-tiny-2") in cluster.objects
    assert cluster.objects[("RayJob", "grpo-tiny-2")]["metadata"]["labels"]["hybridflow.io/attempt"] == "2"
    cluster.kuberay("grpo-tiny-2", "Failed", "FAILED", reason="AppFailed")
    cluster.pass_()
    status = cluster.job["status"]
    assert status["phase"] == "Failed" and status["reason"] == "AppFailed"
    assert ("RayJob", "grpo-tiny-3") not in cluster.objects
    assert ("Warning", "Failed") in cluster.events


def test_suspend_is_mirrored_onto_the_rayjob() -> None:
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


def test_deadline_fails_the_job_and_releases_the_rayjob() -> None:
    cluster = FakeCluster(job_body(activeDeadlineSeconds=600))
    cluster.pass_()
    cluster.kuberay("grpo-tiny-1", "Running", "RUNNING")
    cluster.pass_(T0 + timedelta(seconds=60))
    cluster.pass_(T0 + timedelta(seconds=601))
    status = cluster.job["status"]
    assert status["phase"] == "Failed" and status["reason"] == "DeadlineExceeded"
    assert ("RayJob", "grpo-tiny-1") not in cluster.objects


def test_ttl_after_finished_deletes_the_job() -> None:
    cluster = FakeCluster(job_body(ttlSecondsAfterFinished=60))
    cluster.pass_()
    cluster.kuberay("grpo-tiny-1", "Complete", "SUCCEEDED")
    cluster.pass_()
    cluster.pass_(T0 + timedelta(seconds=30))
    assert ("RLHFJob", "grpo-tiny") in cluster.objects
    cluster.pass_(T0 + timedelta(seconds=61))
    assert ("RLHFJob", "grpo-tiny") not in cluster.objects
