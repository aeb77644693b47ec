"""The reconcile against an in-memory cluster that plays KubeRay: children, phases, retries, no-op passes."""

from __future__ import annotations

import copy
import json
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml

from hybridflow_operator.cluster import ApiError
from hybridflow_operator.kueue import QUEUED_RECHECK_SECONDS
from hybridflow_operator.status import PENDING_WRITE_DELAY_SECONDS
from kube.fake_cluster import T0, FakeCluster

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


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
        ("NetworkPolicy", "grpo-tiny-ray"),
        ("RayJob", "grpo-tiny-1"),
        ("Role", "grpo-tiny-controller"),
        ("RoleBinding", "grpo-tiny-controller"),
        ("ServiceAccount", "grpo-tiny-controller"),
    ]
    assert cluster.writes == 6  # the children; the status waits for KubeRay's first word
    assert "status" not in cluster.job
    assert cluster.result.recheck_after_seconds == PENDING_WRITE_DELAY_SECONDS
    assert cluster.pass_() == 0  # level-triggered: the next pass observes the RayJob, changes nothing
    assert cluster.pass_(T0 + timedelta(seconds=PENDING_WRITE_DELAY_SECONDS - 1)) == 0
    assert cluster.reads == 0  # everything from the caches


def test_a_new_jobs_first_status_comes_with_kuberays_first_state_in_one_write() -> None:
    """Pending is not written when KubeRay moves the RayJob on within the delay: one write, not two."""
    cluster = FakeCluster(job_body())
    cluster.pass_()
    cluster.kuberay("grpo-tiny-1", "Initializing")
    assert cluster.pass_(T0 + timedelta(seconds=1)) == 1
    status = cluster.job["status"]
    assert status["phase"] == "Initializing" and status["attempts"] == 1
    assert status["rayJobName"] == "grpo-tiny-1"
    conditions = {c["type"]: c["status"] for c in status["conditions"]}
    assert conditions["RayJobCreated"] == "True" and conditions["ChildrenReady"] == "True"
    assert cluster.pass_(T0 + timedelta(seconds=PENDING_WRITE_DELAY_SECONDS)) == 0


def test_a_rayjob_kuberay_has_not_moved_makes_the_job_pending_after_the_delay() -> None:
    """KubeRay slow, down, or its controller missing: the job says Pending, and why it waits."""
    cluster = FakeCluster(job_body())
    cluster.pass_()
    assert cluster.pass_(T0 + timedelta(seconds=PENDING_WRITE_DELAY_SECONDS)) == 1  # no Event: quiet
    status = cluster.job["status"]
    assert status["phase"] == "Pending" and status["attempts"] == 1
    created = next(c for c in status["conditions"] if c["type"] == "RayJobCreated")
    assert created["status"] == "True" and "grpo-tiny-1" in created["message"]
    assert cluster.pass_(T0 + timedelta(seconds=60)) == 0
    assert cluster.events == []


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


def workload_of(cluster: FakeCluster, rayjob: str) -> dict[str, Any]:
    """Play Kueue: the Workload it makes for a queued RayJob (labelled with the RayJob's uid), active."""
    uid = cluster.objects[("RayJob", rayjob)]["metadata"]["uid"]
    workload = {
        "kind": "Workload",
        "metadata": {"name": f"rayjob-{rayjob}-abcde", "labels": {"kueue.x-k8s.io/job-uid": uid}},
        "spec": {"active": True},
    }
    cluster.objects[("Workload", workload["metadata"]["name"])] = workload
    return workload


def test_a_queued_job_is_held_through_its_workload_never_its_suspend() -> None:
    """Kueue unsuspends an admitted RayJob whoever suspended it: the hold goes through spec.active."""
    cluster = FakeCluster(job_body(queueName="research"))
    cluster.pass_()
    rayjob = cluster.objects[("RayJob", "grpo-tiny-1")]
    assert rayjob["spec"]["suspend"] is True  # created suspended: Kueue admits it
    workload = workload_of(cluster, "grpo-tiny-1")
    rayjob["spec"]["suspend"] = False  # Kueue admits
    cluster.kuberay("grpo-tiny-1", "Running", "RUNNING")
    assert cluster.pass_() == 1  # the status; nothing written to the RayJob or the Workload
    cluster.job["spec"]["suspend"] = True  # the user suspends
    cluster.pass_()
    assert workload["spec"]["active"] is False
    assert rayjob["spec"]["suspend"] is False  # Kueue's field: Kueue suspends it on the eviction
    annotations = rayjob["metadata"]["annotations"]
    assert annotations["hybridflow.io/workload-active"] == "false"
    assert annotations["hybridflow.io/user-suspend"] == "true"
    assert cluster.pass_() == 0  # the records say it is done
    rayjob["spec"]["suspend"] = True  # Kueue evicts it
    cluster.kuberay("grpo-tiny-1", "Suspended")
    cluster.pass_()
    assert cluster.job["status"]["phase"] == "Suspended" and workload["spec"]["active"] is False
    cluster.job["spec"]["suspend"] = False  # the user resumes: Kueue requeues and admits it
    cluster.pass_()
    assert workload["spec"]["active"] is True and rayjob["spec"]["suspend"] is True
    assert rayjob["metadata"]["annotations"]["hybridflow.io/workload-active"] == "true"
    assert cluster.job["status"]["phase"] == "Queued"
    assert cluster.pass_() == 0


def test_a_workload_kueue_deactivated_itself_says_why_and_the_way_out() -> None:
    """Kueue deactivates a Workload for its own reasons and never queues it again: the job says so
    (phase Suspended, Kueue's reason and message, the Workload to delete), once, and the operator
    writes nothing to the Workload or the RayJob (it is not the operator's hold to undo)."""
    cluster = FakeCluster(job_body(queueName="research"))
    cluster.pass_()
    rayjob = cluster.objects[("RayJob", "grpo-tiny-1")]
    workload = workload_of(cluster, "grpo-tiny-1")
    workload["metadata"]["namespace"] = "research"
    rayjob["spec"]["suspend"] = False  # admitted, running
    cluster.kuberay("grpo-tiny-1", "Running", "RUNNING")
    cluster.pass_()
    workload["spec"]["active"] = False  # RequeuingLimitExceeded: Kueue's own deactivation
    workload["status"] = {
        "conditions": [
            {
                "type": "Evicted",
                "status": "True",
                "reason": "DeactivatedDueToRequeuingLimitExceeded",
                "message": "The workload is deactivated due to exceeding the maximum number of re-queuing retries",
            }
        ]
    }
    rayjob["spec"]["suspend"] = True  # Kueue stops the job
    cluster.kuberay("grpo-tiny-1", "Suspended")
    cluster.pass_()
    status = cluster.job["status"]
    assert status["phase"] == "Suspended" and status["reason"] == "DeactivatedDueToRequeuingLimitExceeded"
    suspended = next(c for c in status["conditions"] if c["type"] == "Suspended")
    assert suspended["status"] == "True" and suspended["reason"] == "DeactivatedDueToRequeuingLimitExceeded"
    assert "exceeding the maximum number of re-queuing retries" in suspended["message"]
    assert "kubectl delete workload -n research rayjob-grpo-tiny-1-abcde" in suspended["message"]
    assert cluster.events[-1] == ("Warning", "KueueDeactivated")
    assert workload["spec"]["active"] is False and "hybridflow.io/workload-active" not in rayjob[
        "metadata"
    ].get("annotations", {})
    assert cluster.pass_() == 0  # said once
    del cluster.objects[("Workload", "rayjob-grpo-tiny-1-abcde")]  # the way out: Kueue makes a new one
    workload_of(cluster, "grpo-tiny-1")
    cluster.pass_()
    assert (
        cluster.job["status"]["phase"] == "Queued"
        and cluster.result.recheck_after_seconds == QUEUED_RECHECK_SECONDS
    )


def test_a_queued_job_suspended_before_it_starts_gets_no_rayjob_until_resumed() -> None:
    """A new RayJob's Workload starts active, and Kueue would start it against the user's suspend."""
    cluster = FakeCluster(job_body(queueName="research", suspend=True))
    cluster.pass_()
    assert ("RayJob", "grpo-tiny-1") not in cluster.objects
    assert cluster.job["status"]["phase"] == "Suspended" and cluster.job["status"].get("attempts", 0) == 0
    assert cluster.pass_() == 0
    cluster.job["spec"]["suspend"] = False
    cluster.pass_()
    assert cluster.objects[("RayJob", "grpo-tiny-1")]["spec"]["suspend"] is True  # for Kueue to admit
    assert cluster.job["status"]["phase"] == "Queued"


def test_a_queued_job_without_its_workload_says_so_and_retries() -> None:
    cluster = FakeCluster(job_body(queueName="research"))
    cluster.pass_()
    cluster.objects[("RayJob", "grpo-tiny-1")]["spec"]["suspend"] = False
    cluster.kuberay("grpo-tiny-1", "Running", "RUNNING")
    cluster.pass_()
    cluster.job["spec"]["suspend"] = True
    cluster.pass_()
    ready = next(c for c in cluster.job["status"]["conditions"] if c["type"] == "ChildrenReady")
    assert ready["status"] == "False" and ready["reason"] == "KueueWorkloadMissing"
    assert cluster.result.failed  # retried with backoff
    workload = workload_of(cluster, "grpo-tiny-1")
    cluster.pass_()
    assert workload["spec"]["active"] is False


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


def active_time(cluster: FakeCluster, name: str) -> dict[str, Any]:
    annotations = cluster.objects[("RayJob", name)]["metadata"].get("annotations") or {}
    record: dict[str, Any] = json.loads(annotations.get("hybridflow.io/active-time", "{}"))
    return record


def test_the_deadline_does_not_count_while_the_job_is_suspended() -> None:
    cluster = FakeCluster(job_body(activeDeadlineSeconds=600))
    cluster.pass_()
    cluster.kuberay("grpo-tiny-1", "Running", "RUNNING")
    cluster.pass_(T0 + timedelta(seconds=300))
    assert cluster.result.recheck_after_seconds == 300
    cluster.job["spec"]["suspend"] = True
    cluster.pass_(T0 + timedelta(seconds=300))
    rayjob = cluster.objects[("RayJob", "grpo-tiny-1")]
    assert rayjob["spec"]["suspend"] is True
    assert active_time(cluster, "grpo-tiny-1")["seconds"] == 300  # recorded in the suspending patch
    cluster.kuberay("grpo-tiny-1", "Suspended")
    cluster.pass_(T0 + timedelta(days=1))
    assert cluster.job["status"]["phase"] == "Suspended" and cluster.result.recheck_after_seconds is None
    assert cluster.pass_(T0 + timedelta(days=2)) == 0  # a day suspended spent nothing of the budget

    resumed = T0 + timedelta(days=2)
    cluster.job["spec"]["suspend"] = False
    cluster.pass_(resumed)
    assert rayjob["spec"]["suspend"] is False
    cluster.kuberay("grpo-tiny-1", "Running", "RUNNING", start=resumed)  # KubeRay restarts its clock
    cluster.pass_(resumed + timedelta(seconds=100))
    assert cluster.job["status"]["phase"] == "Running" and cluster.result.recheck_after_seconds == 200
    cluster.pass_(resumed + timedelta(seconds=300))
    assert cluster.job["status"]["reason"] == "DeadlineExceeded"
    assert rayjob["metadata"]["annotations"]["hybridflow.io/stopped"] == "DeadlineExceeded"
    assert cluster.job["status"]["completionTime"] == (resumed + timedelta(seconds=300)).isoformat().replace(
        "+00:00", "Z"
    )
    assert cluster.pass_(resumed + timedelta(hours=1)) == 0


def test_kueue_queueing_and_preemption_spend_no_budget() -> None:
    cluster = FakeCluster(job_body(activeDeadlineSeconds=600, queueName="research"))
    cluster.pass_()
    rayjob = cluster.objects[("RayJob", "grpo-tiny-1")]
    cluster.kuberay("grpo-tiny-1", "Suspended")  # startTime from KubeRay's pass through Initializing
    cluster.pass_(T0 + timedelta(hours=1))
    # The deadline clock stands still while queued; the only pass due is the look at the Workload.
    assert cluster.job["status"]["phase"] == "Queued"
    assert cluster.result.recheck_after_seconds == QUEUED_RECHECK_SECONDS
    assert active_time(cluster, "grpo-tiny-1") == {}  # never let run: nothing to record, no write
    assert cluster.pass_(T0 + timedelta(hours=2)) == 0

    admitted = T0 + timedelta(hours=2)
    rayjob["spec"]["suspend"] = False  # Kueue admits (a spec change: the generation grows)
    rayjob["metadata"]["generation"] = 2
    cluster.kuberay("grpo-tiny-1", "Running", "RUNNING", start=admitted)
    cluster.pass_(admitted + timedelta(seconds=10))
    assert cluster.result.recheck_after_seconds == 590

    rayjob["spec"]["suspend"] = True  # Kueue preempts it
    rayjob["metadata"]["generation"] = 3
    cluster.kuberay("grpo-tiny-1", "Suspended", start=admitted)
    cluster.pass_(admitted + timedelta(seconds=100))
    assert cluster.job["status"]["phase"] == "Queued"
    assert active_time(cluster, "grpo-tiny-1")["seconds"] == 100  # the period Kueue ended, recorded once
    assert rayjob["spec"]["suspend"] is True  # and Kueue's suspend left alone
    assert cluster.pass_(admitted + timedelta(days=1)) == 0


def test_a_deadline_stop_of_a_queued_job_deactivates_its_workload_and_stays_stopped() -> None:
    cluster = FakeCluster(job_body(activeDeadlineSeconds=600, queueName="research"))
    cluster.pass_()
    rayjob = cluster.objects[("RayJob", "grpo-tiny-1")]
    workload = workload_of(cluster, "grpo-tiny-1")
    rayjob["spec"]["suspend"] = False  # Kueue admits
    rayjob["metadata"]["generation"] = 2
    cluster.kuberay("grpo-tiny-1", "Running", "RUNNING")
    cluster.pass_(T0 + timedelta(seconds=10))
    cluster.pass_(T0 + timedelta(seconds=601))
    assert cluster.job["status"]["reason"] == "DeadlineExceeded"
    assert workload["spec"]["active"] is False  # Kueue evicts it and does not requeue it
    assert rayjob["spec"]["suspend"] is False  # never written by the operator: Kueue would undo it
    annotations = rayjob["metadata"]["annotations"]
    assert annotations["hybridflow.io/stopped"] == "DeadlineExceeded"
    assert annotations["hybridflow.io/workload-active"] == "false"
    assert json.loads(annotations["hybridflow.io/active-time"])["seconds"] == 601
    assert cluster.pass_(T0 + timedelta(seconds=700)) == 0


def reconcile_with(cluster: FakeCluster, kuberay: Any, now: Any = T0) -> int:
    from hybridflow_operator.reconcile import reconcile
    from kube.fake_cluster import DEFAULTS

    before = cluster.writes
    cluster.result = reconcile(
        copy.deepcopy(cluster.job), cluster.children(), cluster, DEFAULTS, now=now, kuberay=kuberay
    )
    return cluster.writes - before


def test_on_kuberay_1_5_the_operator_keeps_the_startup_timeout_itself() -> None:
    """KubeRay 1.5 serves no preRunningDeadlineSeconds (the API server would prune it): the operator
    stops an attempt whose cluster has not started in time, and retries it."""
    from hybridflow_operator.kuberay import KubeRayFeatures

    kuberay_1_5 = KubeRayFeatures(installed=True, token_auth=True, pre_running_deadline=False)
    cluster = FakeCluster(job_body(startupTimeoutSeconds=300, maxRestarts=1))
    reconcile_with(cluster, kuberay_1_5)
    rayjob = cluster.objects[("RayJob", "grpo-tiny-1")]
    assert "preRunningDeadlineSeconds" not in rayjob["spec"]
    cluster.kuberay("grpo-tiny-1", "Initializing")
    reconcile_with(cluster, kuberay_1_5, T0 + timedelta(seconds=100))
    assert cluster.result.recheck_after_seconds == 200
    reconcile_with(cluster, kuberay_1_5, T0 + timedelta(seconds=300))
    assert rayjob["spec"]["suspend"] is True
    assert rayjob["metadata"]["annotations"]["hybridflow.io/stopped"] == "StartupTimeout"
    status = cluster.job["status"]
    assert status["phase"] == "Retrying" and status["reason"] == "StartupTimeout"
    reconcile_with(cluster, kuberay_1_5, T0 + timedelta(seconds=400))  # after the retry backoff
    assert ("RayJob", "grpo-tiny-2") in cluster.objects
    # KubeRay 1.6 keeps it itself: no timer, and the field is sent.
    cluster = FakeCluster(job_body(startupTimeoutSeconds=300))
    cluster.pass_()
    assert cluster.objects[("RayJob", "grpo-tiny-1")]["spec"]["preRunningDeadlineSeconds"] == 300
    cluster.kuberay("grpo-tiny-1", "Initializing")
    cluster.pass_(T0 + timedelta(seconds=301))
    assert cluster.job["status"]["phase"] == "Initializing"


def test_a_kuberay_without_token_auth_is_refused_naming_the_minimum_version() -> None:
    from hybridflow_operator.kuberay import KubeRayFeatures

    old = KubeRayFeatures(installed=True, token_auth=False, pre_running_deadline=False)
    cluster = FakeCluster(job_body())
    reconcile_with(cluster, old)
    assert ("RayJob", "grpo-tiny-1") not in cluster.objects
    ready = next(c for c in cluster.job["status"]["conditions"] if c["type"] == "ChildrenReady")
    assert ready["reason"] == "KubeRayUnsupported" and "1.5.1" in ready["message"]
    assert ("Warning", "KubeRayUnsupported") in cluster.events


def test_completion_time_written_by_the_workload_does_not_move_the_ttl() -> None:
    cluster = FakeCluster(job_body(ttlSecondsAfterFinished=60))
    cluster.pass_()
    cluster.kuberay("grpo-tiny-1", "Complete", "SUCCEEDED", end=T0)
    cluster.pass_()
    cluster.job["status"]["completionTime"] = "2030-01-01T00:00:00Z"  # the head pod's token can patch it
    cluster.pass_(T0 + timedelta(seconds=61))
    assert ("RLHFJob", "grpo-tiny") not in cluster.objects  # 60 s after the RayJob's endTime


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


def test_a_409_for_our_own_child_is_the_cache_behind_not_a_name_conflict() -> None:
    cluster = FakeCluster(job_body())
    cluster.pass_()
    events = list(cluster.events)
    assert cluster.pass_(children=[]) == 0  # a pass before the watch delivered its own creates
    assert cluster.reads == 6  # each 409 reads the object: owned by this uid, so it is the job's
    assert not cluster.result.failed and cluster.events == events
    assert "status" not in cluster.job  # nothing to report: the first status waits for KubeRay
    cluster.pass_(T0 + timedelta(seconds=PENDING_WRITE_DELAY_SECONDS))
    conditions = {c["type"]: (c["status"], c["reason"]) for c in cluster.job["status"]["conditions"]}
    assert conditions["ChildrenReady"] == ("True", "Ready")
    assert conditions["RayJobCreated"] == ("True", "Created")


def test_a_409_for_a_strangers_object_is_a_name_conflict() -> None:
    """An object the caches never saw (no job label) that holds a child's name is someone else's."""
    cluster = FakeCluster(job_body())
    stranger = {"kind": "ServiceAccount", "metadata": {"name": "grpo-tiny-controller", "namespace": "team-a"}}
    cluster.objects[("ServiceAccount", "grpo-tiny-controller")] = stranger
    cluster.pass_(children=[])
    ready = next(c for c in cluster.job["status"]["conditions"] if c["type"] == "ChildrenReady")
    assert ready["status"] == "False" and ready["reason"] == "NameConflict"
    assert ("Warning", "NameConflict") in cluster.events and cluster.result.failed
    assert ("RayJob", "grpo-tiny-1") not in cluster.objects
    assert "ownerReferences" not in stranger["metadata"]  # left alone


def test_a_failed_ttl_delete_is_reported() -> None:
    cluster = FakeCluster(job_body(ttlSecondsAfterFinished=60))
    cluster.pass_()
    cluster.kuberay("grpo-tiny-1", "Complete", "SUCCEEDED", end=T0)
    cluster.pass_()
    denied = ApiError("delete", "RLHFJob", "grpo-tiny", 403, "Forbidden", "cannot delete rlhfjobs")
    cluster.fail[("delete", "RLHFJob")] = denied
    cluster.pass_(T0 + timedelta(seconds=61))
    assert ("RLHFJob", "grpo-tiny") in cluster.objects
    ready = next(c for c in cluster.job["status"]["conditions"] if c["type"] == "ChildrenReady")
    assert ready["status"] == "False" and ready["reason"] == "Forbidden"
    assert "ttlSecondsAfterFinished" in ready["message"] and "cannot delete rlhfjobs" in ready["message"]
    assert ("Warning", "Forbidden") in cluster.events
    assert cluster.result.failed and cluster.result.failures == (denied,)
    del cluster.fail[("delete", "RLHFJob")]
    cluster.pass_(T0 + timedelta(seconds=62))
    assert ("RLHFJob", "grpo-tiny") not in cluster.objects


def test_failed_status_patches_and_events_are_returned_to_the_caller() -> None:
    """No condition can report a failed status patch: the result carries it for the log and metrics."""
    cluster = FakeCluster(job_body())
    invalid = ApiError(
        "patch", "RLHFJob/status", "grpo-tiny", 422, "Invalid", "status.attempts: Invalid value"
    )
    cluster.pass_()  # the children; the first status waits for KubeRay
    cluster.fail[("patch", "RLHFJob/status")] = invalid
    later = T0 + timedelta(seconds=PENDING_WRITE_DELAY_SECONDS)
    cluster.pass_(later)
    assert cluster.result.failed and cluster.result.failures == (invalid,) and cluster.result.status is None
    del cluster.fail[("patch", "RLHFJob/status")]
    cluster.pass_(later)
    assert not cluster.result.failed and cluster.result.failures == ()
    cluster.kuberay("grpo-tiny-1", "Complete", "SUCCEEDED", end=T0)
    forbidden = ApiError("create", "Event", "grpo-tiny", 403, "Forbidden", "cannot create events")
    cluster.fail[("create", "Event")] = forbidden
    cluster.pass_()
    assert cluster.job["status"]["phase"] == "Succeeded"
    assert cluster.result.failed and cluster.result.failures == (forbidden,)


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
