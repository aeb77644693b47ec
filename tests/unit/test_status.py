"""Status mapping: every KubeRay state, retries and their limit, suspension and Kueue, deadlines, idempotence."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml

from hybridflow.spec import RLHFJob, parse_job_manifest
from hybridflow_operator.status import (
    ACTIVE_TIME_ANNOTATION,
    CONDITION_TYPES,
    OPERATOR_OWNED_KEYS,
    STOPPED_ANNOTATION,
    ActiveTime,
    Condition,
    ObservedRayJob,
    Progress,
    RetryPolicy,
    RLHFJobStatus,
    StatusDecision,
    active_seconds,
    close_running_period,
    desired_status,
    invalid_spec_status,
    remaining_deadline_seconds,
    status_patch,
    ttl_remaining_seconds,
)

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
T0 = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
NO_BACKOFF = RetryPolicy(base_seconds=0, max_seconds=0)


def job(**spec_changes: Any) -> RLHFJob:
    manifest = yaml.safe_load((ROOT / "examples" / "grpo-tiny.yaml").read_text())
    manifest["spec"].update(spec_changes)
    return parse_job_manifest(manifest, "test")


def rayjob(
    deployment: str = "",
    ray: str = "",
    *,
    name: str = "grpo-tiny-1",
    suspend: bool = False,
    reason: str = "",
    message: str = "",
    start: datetime | None = T0,
    end: datetime | None = None,
    generation: int = 1,
    record: ActiveTime | None = None,
    queue: str | None = None,
    stopped: str = "",
) -> ObservedRayJob:
    """A RayJob as KubeRay leaves it (``start``: its startTime), with the operator's records."""
    annotations = {STOPPED_ANNOTATION: stopped} if stopped else {}
    if record is not None:
        annotations[ACTIVE_TIME_ANNOTATION] = record.to_annotation()
    status: dict[str, Any] = {"jobDeploymentStatus": deployment, "jobStatus": ray, "reason": reason}
    status["message"] = message
    if start is not None:
        status["startTime"] = start.isoformat()
    if end is not None:
        status["endTime"] = end.isoformat()
    return ObservedRayJob.from_body(
        {
            "metadata": {
                "name": name,
                "generation": generation,
                "labels": {"kueue.x-k8s.io/queue-name": queue} if queue else {},
                "annotations": annotations,
            },
            "spec": {"suspend": suspend},
            "status": status,
        }
    )


def step(
    current: RLHFJobStatus,
    observed: ObservedRayJob | None,
    the_job: RLHFJob | None = None,
    at: datetime = T0,
) -> StatusDecision:
    """One decision with the RayJobs the operator owns: the earlier attempts (failed, as only a failure
    starts the next one) and ``observed``, the current attempt; no retry backoff, so a failure starts
    the next attempt at once as far as these tests are concerned."""
    attempts = (
        []
        if observed is None
        else [
            rayjob("Failed", "FAILED", name=f"grpo-tiny-{n}", reason="LostNode", message=f"node {n} lost")
            for n in range(1, observed.attempt)
        ]
        + [observed]
    )
    return desired_status(the_job or job(), current, attempts, now=at, generation=1, retry_policy=NO_BACKOFF)


def conditions(status: RLHFJobStatus) -> dict[str, str]:
    return {c.type: c.status for c in status.conditions}


# --------------------------------------------------------------------------- first reconcile


def test_first_reconcile_creates_attempt_one() -> None:
    decision = step(RLHFJobStatus(), None)
    assert decision.start_attempt == 1 and not decision.retrying
    status = decision.status
    assert status.phase == "Pending" and status.attempts == 1 and status.ray_job_name == "grpo-tiny-1"
    assert status.observed_generation == 1
    assert [c.type for c in status.conditions] == list(CONDITION_TYPES)
    assert conditions(status)["Validated"] == "True" and conditions(status)["RayJobCreated"] == "False"
    assert decision.events == ()  # Pending, Initializing, Running: in the status, no Event


def test_a_repeated_create_keeps_asking_for_the_same_attempt() -> None:
    first = step(RLHFJobStatus(), None)
    again = step(first.status, None)
    assert again.start_attempt == 1 and again.status == first.status and again.events == ()


# --------------------------------------------------------------------------- each KubeRay state

RUNNING_STATES: list[tuple[str, str, bool, str]] = [
    # jobDeploymentStatus, Ray jobStatus, RayJob suspended, expected phase
    ("", "", False, "Pending"),
    ("Scheduling", "", False, "Pending"),
    ("Scheduled", "", False, "Pending"),
    ("Initializing", "", False, "Initializing"),
    ("Waiting", "", False, "Initializing"),
    ("Running", "", False, "Initializing"),
    ("Running", "PENDING", False, "Initializing"),
    ("Running", "RUNNING", False, "Running"),
    ("Running", "SUCCEEDED", False, "Running"),
    ("Running", "FAILED", False, "Running"),
    ("Running", "STOPPED", False, "Running"),
    ("Suspending", "", True, "Suspended"),
    ("Suspended", "", True, "Suspended"),
    ("Retrying", "", False, "Retrying"),
    ("Complete", "SUCCEEDED", False, "Succeeded"),
    ("SomethingNew", "", False, "Initializing"),
]


@pytest.mark.parametrize(("deployment", "ray", "suspended", "phase"), RUNNING_STATES)
def test_kuberay_states_map_to_phases(deployment: str, ray: str, suspended: bool, phase: str) -> None:
    current = step(RLHFJobStatus(), None).status
    decision = step(current, rayjob(deployment=deployment, ray=ray, suspend=suspended))
    status = decision.status
    assert status.phase == phase
    assert decision.start_attempt is None
    assert status.job_deployment_status == (deployment or None) and status.job_status == (ray or None)
    assert conditions(status)["RayJobCreated"] == "True"
    assert conditions(status)["Running"] == ("True" if phase == "Running" else "False")
    assert conditions(status)["Succeeded"] == ("True" if phase == "Succeeded" else "False")
    if phase == "Succeeded":
        assert status.completion_time == T0
    if phase in ("Initializing", "Running", "Succeeded"):
        assert status.start_time == T0


FAILURES: list[tuple[str, str, str, str, bool]] = [
    # jobDeploymentStatus, jobStatus, reason, expected reason, retried
    ("Complete", "FAILED", "", "AppFailed", True),
    ("Complete", "STOPPED", "", "Stopped", True),
    ("Complete", "", "", "Incomplete", True),
    ("Complete", "", "DeadlineExceeded", "DeadlineExceeded", False),
    ("Failed", "FAILED", "AppFailed", "AppFailed", True),
    ("Failed", "", "SubmissionFailed", "SubmissionFailed", True),
    (
        "Failed",
        "",
        "JobDeploymentStatusTransitionGracePeriodExceeded",
        "JobDeploymentStatusTransitionGracePeriodExceeded",
        True,
    ),
    ("Failed", "", "", "Failed", True),
    ("Failed", "RUNNING", "DeadlineExceeded", "DeadlineExceeded", False),
    ("Failed", "", "ValidationFailed", "ValidationFailed", False),
    ("ValidationFailed", "", "ValidationFailed", "ValidationFailed", False),
]


@pytest.mark.parametrize(("deployment", "ray", "reason", "expected", "retried"), FAILURES)
def test_failed_attempts_retry_unless_a_retry_cannot_help(
    deployment: str, ray: str, reason: str, expected: str, retried: bool
) -> None:
    current = step(step(RLHFJobStatus(), None).status, rayjob(deployment="Running", ray="RUNNING")).status
    decision = step(current, rayjob(deployment=deployment, ray=ray, reason=reason, message="boom"))
    status = decision.status
    assert status.reason == expected
    if retried:
        assert status.phase == "Retrying" and decision.retrying
        assert decision.start_attempt == 2 and status.attempts == 2 and status.ray_job_name == "grpo-tiny-2"
        assert conditions(status)["RayJobCreated"] == "False"
        [event] = decision.events
        assert event.type == "Warning" and event.reason == "Retrying"
        assert "attempt 1 of 4 failed" in event.message and expected in event.message
    else:
        assert status.phase == "Failed" and decision.start_attempt is None and status.attempts == 1
        assert conditions(status)["Failed"] == "True"
        assert status.condition("Failed") == Condition(
            type="Failed",
            status="True",
            reason=expected,
            message=f"{expected}: {status.message}",
            last_transition_time=T0,
        )
        assert status.completion_time == T0
        [event] = decision.events
        assert event.type == "Warning" and event.reason == "Failed"


def decide(
    attempts: list[ObservedRayJob], current: RLHFJobStatus, the_job: RLHFJob, at: datetime = T0
) -> StatusDecision:
    return desired_status(the_job, current, attempts, now=at, generation=1, retry_policy=NO_BACKOFF)


def test_retries_stop_at_max_restarts_with_the_last_reason() -> None:
    the_job = job(maxRestarts=1)
    status = step(RLHFJobStatus(), None, the_job).status
    status = step(status, rayjob(deployment="Running", ray="RUNNING"), the_job).status
    failed = rayjob(deployment="Failed", reason="AppFailed", message="worker died")
    retry = decide([failed], status, the_job)
    assert retry.start_attempt == 2 and retry.status.phase == "Retrying"

    # The retry's RayJob is not there yet, then it comes up: Retrying until it initializes.
    waiting = decide([failed], retry.status, the_job)
    assert waiting.start_attempt == 2 and waiting.status.phase == "Retrying" and waiting.events == ()
    assert waiting.status.reason == "AppFailed"
    new = decide([failed, rayjob("", name="grpo-tiny-2")], waiting.status, the_job)
    assert new.status.phase == "Retrying" and new.start_attempt is None
    running = decide([failed, rayjob("Running", "RUNNING", name="grpo-tiny-2")], new.status, the_job)
    assert running.status.phase == "Running" and running.status.reason is None
    assert running.status.start_time == T0  # the job's clock does not restart with the attempt

    oom = rayjob("Failed", "FAILED", name="grpo-tiny-2", reason="AppFailed", message="oom")
    final = decide([failed, oom], running.status, the_job)
    assert final.start_attempt is None and final.status.phase == "Failed"
    assert final.status.reason == "AppFailed"
    assert "attempt 2 of 2" in (final.status.message or "") and "maxRestarts 1" in (
        final.status.message or ""
    )


def test_max_restarts_zero_fails_on_the_first_failure() -> None:
    the_job = job(maxRestarts=0)
    status = step(RLHFJobStatus(), None, the_job).status
    decision = step(status, rayjob(deployment="Failed", reason="AppFailed"), the_job)
    assert decision.status.phase == "Failed" and decision.start_attempt is None


def test_the_highest_attempt_is_the_current_one() -> None:
    status = step(RLHFJobStatus(), None).status
    earlier = rayjob("Failed", "FAILED", reason="AppFailed", message="a")
    decision = decide([rayjob("Running", "RUNNING", name="grpo-tiny-2"), earlier], status, job())
    assert decision.start_attempt is None and decision.status.phase == "Running"
    assert decision.status.attempts == 2 and decision.status.ray_job_name == "grpo-tiny-2"


def test_terminal_phases_stay_terminal() -> None:
    status = step(RLHFJobStatus(), None).status
    done = step(status, rayjob(deployment="Complete", ray="SUCCEEDED")).status
    later = step(done, rayjob(deployment="Complete", ray="SUCCEEDED"), at=T0 + timedelta(hours=1))
    assert later.status == done and later.start_attempt is None and later.events == ()
    assert later.recheck_after_seconds is None


# --------------------------------------------------------------------------- suspend and Kueue


def test_user_suspension_and_resume() -> None:
    suspended_job = job(suspend=True)
    first = step(RLHFJobStatus(), None, suspended_job)
    assert first.status.phase == "Suspended" and first.start_attempt == 1
    held = step(first.status, rayjob(deployment="Suspended", suspend=True), suspended_job)
    assert held.status.phase == "Suspended" and conditions(held.status)["Suspended"] == "True"
    resumed = step(held.status, rayjob(deployment="Initializing"), job())
    assert resumed.status.phase == "Initializing" and resumed.status.attempts == 1
    assert conditions(resumed.status)["Suspended"] == "False"


def test_kueue_queued_job() -> None:
    queued_job = job(queueName="team-a")
    first = step(RLHFJobStatus(), None, queued_job)
    assert first.status.phase == "Queued"  # its RayJob is created suspended for Kueue
    assert [e.reason for e in first.events] == ["Queued"]
    new = step(first.status, rayjob(deployment="", suspend=True), queued_job)
    assert new.status.phase == "Queued" and new.events == ()  # the RayJob appearing: no second Event
    held = step(new.status, rayjob(deployment="Suspended", suspend=True), queued_job)
    assert held.status.phase == "Queued" and held.status.condition("Suspended") is not None
    assert held.events == ()
    admitted = step(held.status, rayjob(deployment="Initializing"), queued_job)
    assert admitted.status.phase == "Initializing"
    assert admitted.events == ()


# --------------------------------------------------------------------------- deadline and TTL


def test_active_deadline_counts_running_time_across_attempts() -> None:
    """The budget is spent only while an attempt runs: the wait between attempts does not count."""
    the_job = job(activeDeadlineSeconds=3600)
    status = step(RLHFJobStatus(), None, the_job).status
    assert remaining_deadline_seconds(the_job.spec, [], T0) == 3600
    running = rayjob(deployment="Running", ray="RUNNING")
    at = T0 + timedelta(seconds=1000)
    decision = decide([running], step(status, running, the_job).status, the_job, at=at)
    assert decision.recheck_after_seconds == 2600  # the deadline schedules the next pass
    failed = rayjob(deployment="Failed", reason="AppFailed", end=at)
    retry = decide([failed], decision.status, the_job, at=at + timedelta(hours=5))
    assert retry.start_attempt == 2 and retry.recheck_after_seconds is None
    assert remaining_deadline_seconds(the_job.spec, [failed], at + timedelta(hours=5)) == 2600
    second_start = at + timedelta(hours=5)
    second = rayjob("Running", "RUNNING", name="grpo-tiny-2", start=second_start)
    going = decide([failed, second], retry.status, the_job, at=second_start + timedelta(seconds=2599))
    assert going.status.phase == "Running" and going.recheck_after_seconds == 1
    expired = decide([failed, second], going.status, the_job, at=second_start + timedelta(seconds=2600))
    assert expired.status.phase == "Failed" and expired.status.reason == "DeadlineExceeded"
    assert expired.stop_rayjob == "grpo-tiny-2" and expired.start_attempt is None
    assert expired.status.completion_time == second_start + timedelta(seconds=2600)
    assert remaining_deadline_seconds(job().spec, [failed], at) is None


def test_time_suspended_or_queued_does_not_count_toward_the_deadline() -> None:
    """batch/v1 Job semantics: a suspended job's clock stands still, and it schedules no recheck."""
    the_job = job(activeDeadlineSeconds=600)
    status = step(RLHFJobStatus(), None, the_job).status
    running = rayjob("Running", "RUNNING")
    suspended_at = T0 + timedelta(seconds=400)
    record = close_running_period(running, suspended_at)  # written with the user's suspend
    assert record.seconds == 400 and record.started == T0 and record.period_end == suspended_at
    held = rayjob("Suspended", suspend=True, generation=2, record=record)
    for later in (suspended_at, T0 + timedelta(days=3)):
        decision = decide([held], status, job(activeDeadlineSeconds=600, suspend=True), at=later)
        assert decision.status.phase == "Suspended" and decision.recheck_after_seconds is None
        assert decision.stop_rayjob is None and decision.record_active_time is None
    resumed_at = T0 + timedelta(days=3)
    resumed = rayjob("Running", "RUNNING", start=resumed_at, generation=3, record=record)
    decision = decide([resumed], status, the_job, at=resumed_at + timedelta(seconds=50))
    assert decision.status.phase == "Running" and decision.recheck_after_seconds == 150
    assert decision.status.start_time == T0  # the first start, kept by the record
    expired = decide([resumed], decision.status, the_job, at=resumed_at + timedelta(seconds=200))
    assert expired.status.reason == "DeadlineExceeded" and expired.stop_rayjob == "grpo-tiny-1"


def test_a_job_queued_in_kueue_spends_no_budget_until_admitted() -> None:
    """KubeRay passes a RayJob created suspended through Initializing (setting startTime) on its way to
    Suspended; at its first generation it has never been let run."""
    the_job = job(activeDeadlineSeconds=600, queueName="team-a")
    status = step(RLHFJobStatus(), None, the_job).status
    queued = rayjob("Suspended", suspend=True, queue="team-a")
    decision = decide([queued], status, the_job, at=T0 + timedelta(hours=2))
    assert decision.status.phase == "Queued" and decision.recheck_after_seconds is None
    assert decision.record_active_time is None and active_seconds([queued], T0 + timedelta(hours=2)) == 0
    assert decision.status.start_time is None
    admitted_at = T0 + timedelta(hours=2)
    admitted = rayjob("Running", "RUNNING", start=admitted_at, generation=2, queue="team-a")
    running = decide([admitted], decision.status, the_job, at=admitted_at + timedelta(seconds=100))
    assert running.recheck_after_seconds == 500

    # Kueue preempts it: a suspension the operator did not write, so it records the period itself.
    preempted = rayjob("Suspended", suspend=True, start=admitted_at, generation=3, queue="team-a")
    seen_at = admitted_at + timedelta(seconds=300)
    held = decide([preempted], running.status, the_job, at=seen_at)
    assert held.status.phase == "Queued" and held.recheck_after_seconds is None
    assert held.record_active_time == ActiveTime(
        seconds=300, started=admitted_at, period_start=admitted_at, period_end=seen_at
    )
    recorded = rayjob(
        "Suspended",
        suspend=True,
        start=admitted_at,
        generation=3,
        queue="team-a",
        record=held.record_active_time,
    )
    later = decide([recorded], held.status, the_job, at=seen_at + timedelta(hours=1))
    assert (
        later.record_active_time is None and active_seconds([recorded], seen_at + timedelta(hours=1)) == 300
    )


def test_completion_time_comes_from_the_rayjob_not_the_stored_status() -> None:
    """``status.completionTime`` is writable by the workload's token; the TTL must not trust it."""
    the_job = job(ttlSecondsAfterFinished=60)
    status = step(RLHFJobStatus(), None, the_job).status
    ended = T0 + timedelta(seconds=90)
    done = rayjob("Complete", "SUCCEEDED", end=ended)
    forged = status.model_copy(update={"phase": "Succeeded", "completion_time": T0 + timedelta(days=365)})
    decision = decide([done], forged, the_job, at=ended + timedelta(seconds=5))
    assert decision.status.completion_time == ended
    assert ttl_remaining_seconds(the_job.spec, decision.status, ended + timedelta(seconds=5)) == 55

    # A job the operator stopped at its deadline ended when the stop's record says.
    deadline_job = job(activeDeadlineSeconds=60)
    stopped_at = T0 + timedelta(seconds=75)
    record = close_running_period(rayjob("Running", "RUNNING"), stopped_at)
    stopped = rayjob("Suspended", suspend=True, generation=2, record=record, stopped="DeadlineExceeded")
    for at in (stopped_at, stopped_at + timedelta(hours=1)):
        final = decide([stopped], forged, deadline_job, at=at)
        assert final.status.phase == "Failed" and final.status.completion_time == stopped_at


def test_ttl_counts_from_completion() -> None:
    the_job = job(ttlSecondsAfterFinished=60)
    status = step(RLHFJobStatus(), None, the_job).status
    assert ttl_remaining_seconds(the_job.spec, status, T0) is None
    done = step(status, rayjob(deployment="Complete", ray="SUCCEEDED"), the_job).status
    assert ttl_remaining_seconds(the_job.spec, done, T0 + timedelta(seconds=20)) == 40
    assert ttl_remaining_seconds(job().spec, done, T0) is None


# --------------------------------------------------------------------------- idempotence and ownership


def _walk_to_running() -> list[tuple[RLHFJobStatus, ObservedRayJob | None]]:
    status = RLHFJobStatus()
    seen = []
    for observed in (None, rayjob(""), rayjob("Initializing"), rayjob("Running", "RUNNING")):
        seen.append((status, observed))
        status = step(status, observed).status
    return seen


@pytest.mark.parametrize("index", range(4))
def test_a_second_reconcile_writes_nothing(index: int) -> None:
    current, observed = _walk_to_running()[index]
    first = step(current, observed)
    second = step(first.status, observed, at=T0 + timedelta(minutes=5))
    assert status_patch(first.status, second.status) == {}
    assert second.events == ()


def test_progress_is_never_touched_or_patched() -> None:
    progress = Progress(step=12, total_steps=40, reward=0.5, tokens_per_second=1234.5, updated_at=T0)
    current = step(RLHFJobStatus(), None).status.model_copy(update={"progress": progress})
    decision = step(current, rayjob("Running", "RUNNING"))
    assert decision.status.progress == progress
    patch = status_patch(current, decision.status)
    assert "progress" not in patch and patch["phase"] == "Running"
    assert "progress" not in status_patch(current, current.model_copy(update={"progress": None}))
    assert "progress" not in OPERATOR_OWNED_KEYS


def test_status_patch_deletes_unset_keys_with_null() -> None:
    running = step(step(RLHFJobStatus(), None).status, rayjob("Running", "RUNNING")).status
    retry = decide([rayjob("Failed", "FAILED", reason="AppFailed")], running, job()).status
    assert status_patch(running, retry)["jobDeploymentStatus"] is None  # the new attempt has no state yet
    assert status_patch(retry, retry) == {}


def test_condition_times_move_only_when_the_status_flips() -> None:
    first = step(RLHFJobStatus(), None).status
    later = T0 + timedelta(minutes=1)
    running = step(first, rayjob("Running", "RUNNING"), at=later).status
    times = {c.type: c.last_transition_time for c in running.conditions}
    assert times["Validated"] == T0 and times["Succeeded"] == T0
    assert times["Running"] == later and times["RayJobCreated"] == later


def test_status_round_trips_through_the_api_body() -> None:
    status = step(step(RLHFJobStatus(), None).status, rayjob("Running", "RUNNING")).status
    body = status.model_copy(update={"progress": Progress(step=3)}).to_json()
    assert body["conditions"][0]["lastTransitionTime"] == "2026-01-02T03:04:05Z"
    assert RLHFJobStatus.from_body(body) == status.model_copy(update={"progress": Progress(step=3)})


def test_from_body_drops_only_what_does_not_validate() -> None:
    body = {"phase": "Exploded", "attempts": 2, "rayJobName": "x-2", "progress": {"step": 5}, "extra": 1}
    status = RLHFJobStatus.from_body(body)
    assert status.phase is None and status.attempts == 2 and status.progress == Progress(step=5)
    assert RLHFJobStatus.from_body(None) == RLHFJobStatus()
    assert RLHFJobStatus.from_body({"attempts": -1, "conditions": "nope"}) == RLHFJobStatus()


# --------------------------------------------------------------------------- invalid spec


def test_invalid_spec_sets_validated_false_once() -> None:
    decision = invalid_spec_status(RLHFJobStatus(), ["spec.rollout.topK: must be -1"], now=T0, generation=3)
    status = decision.status
    assert status.phase == "Pending" and decision.start_attempt is None
    assert status.condition("Validated") == Condition(
        type="Validated",
        status="False",
        reason="InvalidSpec",
        message="spec.rollout.topK: must be -1",
        last_transition_time=T0,
    )
    assert [(e.type, e.reason) for e in decision.events] == [("Warning", "InvalidSpec")]
    again = invalid_spec_status(
        status, ["spec.rollout.topK: must be -1"], now=T0 + timedelta(1), generation=3
    )
    assert again.events == () and status_patch(status, again.status) == {}


def test_fixing_the_spec_resumes_normal_reconciling() -> None:
    invalid = invalid_spec_status(RLHFJobStatus(), ["bad"], now=T0).status
    fixed = step(invalid, None, at=T0 + timedelta(minutes=1))
    assert fixed.start_attempt == 1
    assert fixed.status.condition("Validated") == Condition(
        type="Validated",
        status="True",
        reason="SpecValid",
        message="the spec passed the operator's checks",
        last_transition_time=T0 + timedelta(minutes=1),
    )


def test_a_deleted_rayjob_is_recreated() -> None:
    """The attempt count comes from the RayJobs that exist: a deleted current one is made again."""
    running = step(step(RLHFJobStatus(), None).status, rayjob("Running", "RUNNING")).status
    decision = step(running, None)
    assert decision.start_attempt == 1 and decision.status.attempts == 1


def test_an_unknown_kuberay_state_is_reported_not_guessed() -> None:
    status = step(step(RLHFJobStatus(), None).status, rayjob("Teleporting")).status
    assert status.phase == "Initializing" and status.reason == "UnknownRayJobState"
    assert status.message == "jobDeploymentStatus 'Teleporting'"


def test_each_rollout_replica_replacement_is_one_event_and_counted_over_attempts() -> None:
    from hybridflow_operator.status import RolloutProgress, rollout_replacement_events

    def with_rollout(status: RLHFJobStatus, started: str, replaced: int) -> RLHFJobStatus:
        rollout = RolloutProgress.model_validate(
            {
                "startedAt": started,
                "replicasServing": 2,
                "replicasReplaced": replaced,
                "lastReplacement": "replica 1",
            }
        )
        return status.model_copy(update={"progress": Progress(step=3, rollout=rollout)})

    status, events = rollout_replacement_events(with_rollout(RLHFJobStatus(), "2026-01-02T03:00:00Z", 0))
    assert events == () and status.rollout_replicas_replaced == 0
    status, events = rollout_replacement_events(with_rollout(status, "2026-01-02T03:00:00Z", 2))
    assert [(e.type, e.reason) for e in events] == [("Warning", "RolloutReplicaReplaced")]
    assert "2 rollout replicas replaced" in events[0].message and "replica 1" in events[0].message
    assert status.rollout_replicas_replaced == 2
    again, events = rollout_replacement_events(status)  # the next pass: nothing new, nothing written
    assert events == () and again == status
    # A new attempt's service counts from 0 again; the total goes on.
    status, events = rollout_replacement_events(with_rollout(status, "2026-01-02T04:00:00Z", 1))
    assert len(events) == 1 and status.rollout_replicas_replaced == 3
    status, events = rollout_replacement_events(status.model_copy(update={"progress": Progress(step=4)}))
    assert events == () and status.rollout_replicas_replaced == 3  # batch mode: no rollout progress
