"""RLHFJob status: its typed model, and the pure mapping from what was observed to what it should say.

Who writes what. The status has two writers that never touch each other's keys:

* the operator owns everything except ``progress``: ``phase``, ``conditions``, the attempt
  bookkeeping (``attempts``, ``rayJobName``, ``startTime``, ``completionTime``), the
  mirrors of the current RayJob (``jobDeploymentStatus``, ``jobStatus``, ``reason``,
  ``message``) and ``observedGeneration``;
* the controller in the head pod owns ``progress`` and ``artifacts`` (the exports that passed
  their parity gate) and merge-patches only those keys, through the ServiceAccount the RBAC
  builder grants (get/patch on this one job's status).

So :func:`status_patch` never emits them, and :func:`desired_status` copies them
through untouched. The models below are also the source of the CRD's status schema
(``hybridflow_operator.crd``), so the keys the controller writes are documented and
validated by the API server; the controller must use the camelCase keys of
:class:`Progress` and must not send NaN or infinities (JSON has no such numbers).

The controller's Role grants ``patch`` on the whole status subresource (RBAC cannot narrow it to
one key), so ``progress`` being the controller's only key holds *in effect*: no decision here
reads a key the workload can write. Attempts, phase, start time and final outcomes are derived
from the RayJobs the job owns (:func:`desired_status`); the stored status only keeps condition
times stable and tells phase changes for Events.

Protocol of one reconcile (``hybridflow_operator.reconcile`` is the caller; this module does no I/O):

1. parse the RLHFJob (``hybridflow.spec.parse_job_manifest``); on ``SpecError`` call
   :func:`invalid_spec_status` and stop: no children are created;
2. parse every RayJob owned by the job's uid with :meth:`ObservedRayJob.from_body`;
3. call :func:`desired_status`; if ``start_attempt`` is set, create that attempt's children,
   with the RayJob's ``activeDeadlineSeconds`` from :func:`remaining_deadline_seconds`; stop
   ``stop_rayjob`` if set; write ``record_active_time`` onto the current RayJob if set, and
   :func:`close_running_period` with any patch that suspends it; schedule the next pass after
   ``recheck_after_seconds``;
4. write :func:`status_patch` (nothing when it is empty, so a second pass writes nothing)
   and emit ``events``.

The deadline clock. ``spec.activeDeadlineSeconds`` is a budget of *running* time: the time from
KubeRay starting an attempt's cluster (the RayJob's ``startTime``, which KubeRay sets again each
time it resumes a suspended RayJob) until the attempt ends (``endTime``) or is suspended, summed
over the attempts (:func:`active_seconds`). Time suspended by the user, queued in Kueue (created
suspended, or preempted) and waiting between attempts does not count. KubeRay keeps only the
current period's ``startTime``, so when a period ends by suspension the operator records what it
counted in the RayJob's :data:`ACTIVE_TIME_ANNOTATION` (:class:`ActiveTime`): in the patch that
suspends it (user suspend, deadline stop), or in a patch of its own when Kueue suspended it; a
RayJob still at its first ``metadata.generation`` and suspended has never been let run (created
suspended, never admitted or resumed), so it needs no record. A period whose end the operator
sees late (it was down) counts until it sees it. The record is on a child, which only the
operator, KubeRay and Kueue write, never the workload.

A KubeRay state maps to a phase as follows (KubeRay v1.7 ``JobDeploymentStatus`` and Ray
``JobStatus``, ray-operator/apis/ray/v1/rayjob_types.go):

=====================================  =========================================
RayJob ``jobDeploymentStatus``          RLHFJob phase
=====================================  =========================================
``""`` (New), ``Scheduling``,           Pending (Queued/Suspended when the RayJob
``Scheduled``                           is created suspended); a new job's first
                                        status waits up to 5 s for KubeRay's first
                                        word (:func:`pending_hold_seconds`)
``Initializing``, ``Waiting``           Initializing
``Running``                             Running once Ray's ``jobStatus`` is RUNNING
                                        (or terminal, until KubeRay catches up);
                                        Initializing while PENDING or empty
``Suspending``, ``Suspended``           Suspended, or Queued when Kueue holds it
``Retrying``                            Retrying (KubeRay's own backoffLimit; the
                                        operator sets it to 0, so only mirrored)
``Complete`` + ``SUCCEEDED``            Succeeded
``Complete`` + FAILED/STOPPED/other,    the attempt failed: Retrying with the next
``Failed``                              attempt while attempts remain, else Failed
``Failed`` with reason                  Failed at once: a new attempt would hit the
``DeadlineExceeded``/``ValidationFailed``  same deadline or the same invalid spec
``ValidationFailed``                    Failed at once (same reason)
a failure whose message holds the       the attempt failed with reason ``Stalled``
controller's ``error: Stalled:`` line   (retried like any other failure)
a failure whose message holds the       reason ``StopRequested``: retried (a Normal
controller's ``stopped on request:``    Event ``StopRequested``), not counted against ``maxRestarts``
line (a pod deleted: a drained node)    (:func:`stopped_attempts`)
(the current RayJob deleted)            that attempt starts again, under the same
                                        name (attempts come from the RayJobs there are)
=====================================  =========================================
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic.alias_generators import to_camel

from hybridflow.spec import RLHFJob, RLHFJobSpec
from hybridflow_operator.builders.metadata import (
    ATTEMPT_LABEL,
    STOPPED_ANNOTATION,
    USER_SUSPEND_ANNOTATION,
    WORKLOAD_ACTIVE_ANNOTATION,
)
from hybridflow_operator.builders.rayjob import KUEUE_QUEUE_LABEL
from hybridflow_operator.events import Event
from hybridflow_operator.kuberay import ASSUMED_CURRENT, KubeRayFeatures
from hybridflow_operator.names import rayjob_name

Phase = Literal[
    "Pending", "Suspended", "Queued", "Initializing", "Running", "Retrying", "Succeeded", "Failed"
]
PHASES: tuple[Phase, ...] = (
    "Pending",
    "Suspended",
    "Queued",
    "Initializing",
    "Running",
    "Retrying",
    "Succeeded",
    "Failed",
)
TERMINAL_PHASES: tuple[Phase, ...] = ("Succeeded", "Failed")
QUIET_PHASES: tuple[Phase, ...] = ("Pending", "Initializing", "Running")
"""Phases every job passes through: reported in the status only, without an Event."""

ConditionStatus = Literal["True", "False", "Unknown"]
CONDITION_TYPES: tuple[str, ...] = (
    "Validated",
    "RayJobCreated",
    "Running",
    "Suspended",
    "Succeeded",
    "Failed",
    "Stalled",
)
"""Every reconciled job carries each of these, True or False, so ``kubectl wait --for=condition=X`` works.

``Stalled`` is True while the job is retrying or has failed because its last attempt stalled (a
worker stopped answering for ``spec.stallTimeoutSeconds``; the controller's ``error: Stalled:``
report names the call and the silent ranks), False otherwise; its transition time is when the
stall was seen."""

# KubeRay v1.7 JobDeploymentStatus values (rayjob_types.go); "" is JobDeploymentStatusNew.
DEPLOYMENT_NEW = ""
DEPLOYMENT_INITIALIZING = "Initializing"
DEPLOYMENT_RUNNING = "Running"
DEPLOYMENT_COMPLETE = "Complete"
DEPLOYMENT_FAILED = "Failed"
DEPLOYMENT_VALIDATION_FAILED = "ValidationFailed"
DEPLOYMENT_SUSPENDING = "Suspending"
DEPLOYMENT_SUSPENDED = "Suspended"
DEPLOYMENT_RETRYING = "Retrying"
DEPLOYMENT_WAITING = "Waiting"
DEPLOYMENT_SCHEDULING = "Scheduling"
DEPLOYMENT_SCHEDULED = "Scheduled"
"""Scheduling/Scheduled belong to RayJob's cron ``schedule`` feature, which the operator never sets."""

# Ray JobStatus values; "" is JobStatusNew (not submitted yet).
RAY_PENDING = "PENDING"
RAY_RUNNING = "RUNNING"
RAY_STOPPED = "STOPPED"
RAY_SUCCEEDED = "SUCCEEDED"
RAY_FAILED = "FAILED"

FINAL_FAILURE_REASONS: tuple[str, ...] = ("DeadlineExceeded", "ValidationFailed")
"""KubeRay failure reasons a new attempt cannot fix. Every other reason (AppFailed,
SubmissionFailed, JobDeploymentStatusTransitionGracePeriodExceeded, a pre-running deadline, a
lost node) is worth a fresh cluster resuming from the checkpoint, unless it repeats."""
STOP_DEADLINE = "DeadlineExceeded"
"""The operator stopped the attempt: ``spec.activeDeadlineSeconds`` is spent (final)."""
STOP_STARTUP_TIMEOUT = "StartupTimeout"
"""The operator stopped the attempt: on a KubeRay without ``preRunningDeadlineSeconds`` (1.5.x) its
cluster did not start within ``spec.startupTimeoutSeconds`` (retried, like KubeRay's own
PreRunningDeadlineExceeded)."""
RETRYABLE_STOPS: tuple[str, ...] = (STOP_STARTUP_TIMEOUT,)
APPLICATION_FAILURE_REASONS: tuple[str, ...] = ("AppFailed", "Failed")
"""Failure reasons of the application itself (the Ray job failed): a repeat with the same message
is deterministic (:func:`repeated_failure`)."""


class StatusModel(BaseModel):
    """Base of the status models: camelCase on the wire, frozen, unknown keys ignored.

    Unknown keys are ignored rather than rejected because status bodies come from the API
    server, possibly written by another version of the operator or controller; the spec
    models forbid them instead, since there a typo is a user error.
    """

    model_config = ConfigDict(
        frozen=True,
        extra="ignore",
        alias_generator=to_camel,
        validate_by_alias=True,
        validate_by_name=True,
    )

    def to_json(self) -> dict[str, Any]:
        """The wire form: camelCase keys, unset optionals left out, datetimes as RFC 3339 strings."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)


class Condition(StatusModel):
    """One aspect of the job's state, in the shape of Kubernetes' metav1.Condition."""

    type: str = Field(
        min_length=1,
        max_length=316,
        description="Condition type: Validated, RayJobCreated, Running, Suspended, Succeeded or Failed.",
    )
    status: ConditionStatus = Field(description="True, False or Unknown.")
    reason: str = Field(
        min_length=1,
        max_length=1024,
        description="Machine-readable CamelCase reason of the last transition or update.",
    )
    message: str = Field(default="", max_length=32768, description="Human-readable details.")
    last_transition_time: datetime = Field(description="When status last changed (not reason or message).")


class PlannedPlacement(StatusModel):
    """The plan ``spec.placement: auto`` chose, as the controller runs it (docs/placement.md)."""

    kind: str = Field(max_length=64, description="Placement kind: colocate, split or standalone.")
    summary: str = Field(
        max_length=4096,
        description="Each pool's roles, GPUs and parallel layouts, and the estimates (the line the job logs).",
    )
    estimated_step_seconds: float | None = Field(
        default=None,
        ge=0,
        description="The cost model's step time for this plan (an estimate, not a measurement).",
    )
    device: str | None = Field(
        default=None, max_length=256, description="The device constants the plan was costed with."
    )


class ReplicaHealth(StatusModel):
    """One rollout replica of a server-mode job, as the controller last saw it."""

    index: int = Field(ge=0, description="The replica's index: its GPU bundle in the rollout's pool.")
    state: Literal["Serving", "Starting"] = Field(
        description="Serving: in the routing. Starting: a replacement loading its model or waiting for weights."
    )
    tokens_per_second: float | None = Field(
        default=None, ge=0, description="Tokens it generated per second over the last step."
    )
    replaced: int = Field(default=0, ge=0, description="Times this replica was replaced in this attempt.")


class RolloutProgress(StatusModel):
    """Server mode (spec.rollout.mode server): the rollout replicas' health, pushed with the progress."""

    started_at: datetime | None = Field(
        default=None,
        description="When this attempt's rollout service started (a new attempt starts counting anew).",
    )
    replicas_serving: int = Field(default=0, ge=0, description="Replicas in the routing.")
    replicas_replaced: int = Field(
        default=0,
        ge=0,
        description="Replicas replaced in this attempt (died, or no token for replicaTimeoutSeconds).",
    )
    last_replacement: str | None = Field(
        default=None,
        max_length=1024,
        description="Which replica was replaced last, why, and how long it took.",
    )
    replicas: tuple[ReplicaHealth, ...] = Field(
        default=(),
        max_length=1024,
        description="Each replica's health.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["index"]},
    )


class ReplacementsSeen(StatusModel):
    """The rollout replacements the operator has reported as Events (to emit each once)."""

    started_at: datetime | None = Field(
        default=None, description="The rollout service (attempt) they belong to."
    )
    count: int = Field(default=0, ge=0, description="Replacements of that service reported so far.")


class Progress(StatusModel):
    """Training progress, pushed (throttled) by the controller in the head pod; the operator never writes it."""

    step: int | None = Field(default=None, ge=0, description="Training steps completed.")
    total_steps: int | None = Field(
        default=None, ge=0, description="Steps the job runs (spec.training.totalSteps)."
    )
    percent: float | None = Field(default=None, ge=0, le=100, description="step / totalSteps, in percent.")
    reward: float | None = Field(default=None, description="Mean reward of the last step's responses.")
    tokens_per_second: float | None = Field(
        default=None,
        ge=0,
        description="Throughput of the last step: prompt plus response tokens per second of wall-clock time.",
    )
    eta_seconds: float | None = Field(
        default=None, ge=0, description="Estimated seconds until the last step, at the recent step rate."
    )
    last_checkpoint_step: int | None = Field(
        default=None, ge=0, description="Step of the newest complete checkpoint; a restart resumes after it."
    )
    updated_at: datetime | None = Field(default=None, description="When the controller last pushed progress.")
    placement: PlannedPlacement | None = Field(
        default=None,
        description="With spec.placement auto: the plan the controller chose and runs, pushed when the attempt starts.",
    )
    rollout: RolloutProgress | None = Field(
        default=None, description="Server mode: the rollout replicas' health and replacements."
    )


class Artifact(StatusModel):
    """One export of the actor that passed its parity gate (``spec.checkpoint.export``), written by the controller."""

    step: int = Field(ge=0, description="The training step exported.")
    kind: Literal["full", "merged", "adapter"] = Field(
        description="full or merged: a plain Hugging Face model; adapter: a PEFT LoRA adapter."
    )
    path: str = Field(max_length=4096, description="The export's directory on the checkpoint volume.")
    manifest_sha256: str = Field(
        pattern=r"^[0-9a-f]{64}$",
        description="sha256 of the export's hybridflow-export.json, which lists every file with its own sha256.",
    )
    parity_max_abs_diff: float = Field(
        ge=0,
        description="Largest log-prob gap (nats) between the export, loaded with transformers, and the trainer.",
    )


class RLHFJobStatus(StatusModel):
    """Observed state of an RLHFJob: phase, conditions, attempts, the current RayJob, and progress."""

    phase: Phase | None = Field(
        default=None,
        description=(
            "Pending, Suspended, Queued (held by Kueue), Initializing (cluster starting), Running, "
            "Retrying (an attempt failed; the next resumes from the newest checkpoint), Succeeded or Failed."
        ),
    )
    conditions: tuple[Condition, ...] = Field(
        default=(),
        max_length=32,
        description="Validated, RayJobCreated, Running, Suspended, Succeeded and Failed, each True or False.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )
    ray_job_name: str | None = Field(default=None, description="The RayJob of the current attempt.")
    attempts: int = Field(
        default=0,
        ge=0,
        description="Attempts started so far, the current one included; at most spec.maxRestarts + 1.",
    )
    start_time: datetime | None = Field(
        default=None,
        description=(
            "When KubeRay first started the cluster of the job's first attempt that ran; "
            "spec.activeDeadlineSeconds counts running time only (not suspended, queued or between attempts)."
        ),
    )
    completion_time: datetime | None = Field(
        default=None,
        description=(
            "When the job succeeded or failed (the last RayJob's endTime, or when the operator stopped it); "
            "spec.ttlSecondsAfterFinished counts from here."
        ),
    )
    observed_generation: int | None = Field(
        default=None, ge=0, description="metadata.generation of the spec this status was computed from."
    )
    job_deployment_status: str | None = Field(
        default=None, description="Mirror of the current RayJob's status.jobDeploymentStatus (KubeRay)."
    )
    job_status: str | None = Field(
        default=None, description="Mirror of the current RayJob's status.jobStatus (Ray)."
    )
    reason: str | None = Field(
        default=None, description="Mirror of the current RayJob's status.reason, or why the job failed."
    )
    message: str | None = Field(
        default=None, description="Mirror of the current RayJob's status.message, or details of the failure."
    )
    rollout_replicas_replaced: int | None = Field(
        default=None,
        ge=0,
        description=(
            "Server mode: rollout replicas replaced over every attempt (each also a RolloutReplicaReplaced "
            "Event); the attempt's own replicas are in progress.rollout."
        ),
    )
    rollout_replacements_seen: ReplacementsSeen | None = Field(
        default=None, description="The controller's replacement count the operator last turned into Events."
    )
    progress: Progress | None = Field(
        default=None, description="Training progress, written by the controller in the head pod."
    )
    artifacts: tuple[Artifact, ...] = Field(
        default=(),
        max_length=100,
        description=(
            "The newest 100 exports of the actor that passed their parity gate (spec.checkpoint.export), "
            "oldest first; written by the controller in the head pod. Every export is listed in "
            "exports/artifacts.json on the checkpoint volume."
        ),
    )

    @classmethod
    def from_body(cls, status: object) -> RLHFJobStatus:
        """Parse ``status`` as read from the API server, dropping any top-level key that does not validate.

        The API server validates status writes against the CRD, so a bad key is rare (an older
        writer, a hand edit); losing that one key is better than failing every reconcile.
        """
        if not isinstance(status, Mapping):
            return cls()
        data = dict(status)
        for _ in range(len(data) + 1):
            try:
                return cls.model_validate(data)
            except ValidationError as error:
                bad = {str(detail["loc"][0]) for detail in error.errors() if detail["loc"]}
                if not bad & set(data):
                    break
                data = {key: value for key, value in data.items() if key not in bad}
        return cls()

    def condition(self, condition_type: str) -> Condition | None:
        """The condition of ``condition_type``, if present."""
        return next((c for c in self.conditions if c.type == condition_type), None)


CONTROLLER_OWNED_KEYS = ("progress", "artifacts")
"""Top-level status keys the controller in the head pod writes (``runtime/hybridflow/incluster/status.py``)."""

OPERATOR_OWNED_KEYS: tuple[str, ...] = tuple(
    field.alias or name
    for name, field in RLHFJobStatus.model_fields.items()
    if (field.alias or name) not in CONTROLLER_OWNED_KEYS
)
"""Top-level status keys the operator writes; :data:`CONTROLLER_OWNED_KEYS` belong to the controller."""


ACTIVE_TIME_ANNOTATION = "hybridflow.io/active-time"
"""On a RayJob: the operator's record of the attempt's running time (:class:`ActiveTime` as
JSON), written when a running period ends by suspension; see "The deadline clock" above."""


class ActiveTime(StatusModel):
    """What an attempt ran before its current period: the value of :data:`ACTIVE_TIME_ANNOTATION`."""

    seconds: int = Field(ge=0, description="Running seconds of every period up to periodStart's, included.")
    started: datetime | None = Field(default=None, description="startTime of the first period that ran.")
    period_start: datetime | None = Field(
        default=None, description="startTime of the last period counted (KubeRay's, of that period)."
    )
    period_end: datetime = Field(
        description="When the operator closed that period (suspended or stopped it)."
    )

    @classmethod
    def from_annotation(cls, value: object) -> ActiveTime | None:
        """Parse the annotation; None when absent or not a record (the periods then count from KubeRay's times)."""
        if not isinstance(value, str):
            return None
        try:
            return cls.model_validate(json.loads(value))
        except (ValueError, ValidationError):
            return None

    def to_annotation(self) -> str:
        return json.dumps(self.to_json(), separators=(",", ":"))


class ObservedRayJob(StatusModel):
    """The parts of one attempt's RayJob the status mapping reads; parsed once from the API body.

    Only RayJobs owned by the job's uid are ever parsed into this (see ``reconcile``): they,
    their labels and annotations are written by the operator and KubeRay alone, so everything
    the lifecycle decides from them is out of the workload's reach.
    """

    name: str = Field(description="metadata.name")
    uid: str = Field(default="", description="metadata.uid (Kueue's Workload names it in a label)")
    attempt: int = Field(default=1, ge=1, description="metadata.labels[hybridflow.io/attempt]")
    created_at: datetime | None = Field(default=None, description="metadata.creationTimestamp")
    generation: int = Field(default=1, ge=1, description="metadata.generation (grows on spec changes)")
    queue_name: str | None = Field(default=None, description="metadata.labels[kueue.x-k8s.io/queue-name]")
    active_time: ActiveTime | None = Field(
        default=None, description="metadata.annotations[hybridflow.io/active-time]"
    )
    suspend: bool = Field(default=False, description="spec.suspend")
    user_suspend: bool | None = Field(
        default=None, description="metadata.annotations[hybridflow.io/user-suspend]"
    )
    stopped_reason: str = Field(default="", description="metadata.annotations[hybridflow.io/stopped]")
    workload_active: bool | None = Field(
        default=None, description="metadata.annotations[hybridflow.io/workload-active]"
    )
    job_deployment_status: str = Field(default="", description="status.jobDeploymentStatus")
    job_status: str = Field(default="", description="status.jobStatus")
    reason: str = Field(default="", description="status.reason")
    message: str = Field(default="", description="status.message")
    start_time: datetime | None = Field(default=None, description="status.startTime")
    end_time: datetime | None = Field(default=None, description="status.endTime")

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> ObservedRayJob:
        """Read a RayJob object as the API server returns it (missing sections read as empty)."""
        metadata = body.get("metadata") or {}
        labels = metadata.get("labels") or {}
        annotations = metadata.get("annotations") or {}
        spec = body.get("spec") or {}
        status = body.get("status") or {}
        name = str(metadata.get("name", ""))
        attempt_label = str(labels.get(ATTEMPT_LABEL, ""))
        suffix = name.rsplit("-", 1)[-1]
        attempt = int(attempt_label) if attempt_label.isdigit() else int(suffix) if suffix.isdigit() else 1
        user_suspend = annotations.get(USER_SUSPEND_ANNOTATION)
        workload_active = annotations.get(WORKLOAD_ACTIVE_ANNOTATION)
        return cls(
            name=name,
            uid=str(metadata.get("uid") or ""),
            attempt=max(1, attempt),
            created_at=metadata.get("creationTimestamp"),
            generation=max(1, int(metadata.get("generation") or 1)),
            queue_name=labels.get(KUEUE_QUEUE_LABEL),
            active_time=ActiveTime.from_annotation(annotations.get(ACTIVE_TIME_ANNOTATION)),
            suspend=bool(spec.get("suspend", False)),
            user_suspend=None if user_suspend is None else user_suspend == "true",
            stopped_reason=str(annotations.get(STOPPED_ANNOTATION) or ""),
            workload_active=None if workload_active is None else workload_active == "true",
            job_deployment_status=str(status.get("jobDeploymentStatus") or ""),
            job_status=str(status.get("jobStatus") or ""),
            reason=str(status.get("reason") or ""),
            message=str(status.get("message") or ""),
            start_time=status.get("startTime"),
            end_time=status.get("endTime"),
        )

    @property
    def finished(self) -> bool:
        """KubeRay is done with it: no pods run or will run for this attempt."""
        return self.job_deployment_status in (
            DEPLOYMENT_COMPLETE,
            DEPLOYMENT_FAILED,
            DEPLOYMENT_VALIDATION_FAILED,
        )

    @property
    def period_open(self) -> bool:
        """KubeRay started a period (``startTime``) that the operator's record does not hold yet."""
        recorded = self.active_time.period_start if self.active_time is not None else None
        return self.start_time is not None and self.start_time != recorded

    @property
    def held(self) -> bool:
        """Suspended (by the user, Kueue or the operator's stop), or on its way there: no time counts."""
        return (
            self.suspend
            or bool(self.stopped_reason)
            or self.job_deployment_status in (DEPLOYMENT_SUSPENDING, DEPLOYMENT_SUSPENDED)
        )

    @property
    def never_ran(self) -> bool:
        """Suspended since its creation (queued for Kueue, or the user's suspend): KubeRay's
        ``startTime`` is of its pass through Initializing on the way to Suspended, not of a run."""
        return self.suspend and self.generation <= 1

    @property
    def counting(self) -> bool:
        """The deadline clock runs: KubeRay started this period, and nothing holds or ended it."""
        return self.period_open and not self.finished and not self.held


def attempt_active_seconds(rayjob: ObservedRayJob, now: datetime) -> int:
    """Seconds ``rayjob``'s attempt has run by ``now``: its record plus the period not recorded yet.

    That period ends at KubeRay's ``endTime`` when the attempt finished, and at ``now`` while it
    runs or when it was suspended and the operator has not recorded it yet.
    """
    counted = rayjob.active_time.seconds if rayjob.active_time is not None else 0
    start = rayjob.start_time
    if start is None or not rayjob.period_open or rayjob.never_ran:
        return counted
    end = (rayjob.end_time or start) if rayjob.finished else _now(now)
    return counted + max(0, int((_now(end) - _now(start)).total_seconds()))


def active_seconds(attempts: Sequence[ObservedRayJob], now: datetime) -> int:
    """Running seconds of the whole job by ``now``, every attempt included (see "The deadline clock")."""
    return sum(attempt_active_seconds(rayjob, now) for rayjob in attempts)


def close_running_period(rayjob: ObservedRayJob, now: datetime) -> ActiveTime:
    """``rayjob``'s record with its open period counted up to ``now``: written when the operator
    suspends or stops it, or sees it suspended by Kueue (:attr:`StatusDecision.record_active_time`)."""
    started = rayjob.active_time.started if rayjob.active_time is not None else None
    return ActiveTime(
        seconds=attempt_active_seconds(rayjob, now),
        started=started or (None if rayjob.never_ran else rayjob.start_time),
        period_start=rayjob.start_time,
        period_end=_now(now),
    )


def _record_due(rayjob: ObservedRayJob) -> bool:
    """A period that ran ended by a suspension the operator did not write (Kueue's preemption)."""
    return rayjob.period_open and not rayjob.finished and rayjob.held and not rayjob.never_ran


@dataclass(frozen=True)
class RetryPolicy:
    """How long to wait before attempt n+1: ``min(base * 2**(n-1), max)`` after attempt n ended.

    Immediate retries hammer a cluster that is failing for a reason that needs time (a node
    being replaced, a quota, a flaky storage mount); the wait doubles with every failed attempt
    up to a bound. The operator's settings (``HYBRIDFLOW_RETRY_BACKOFF_*``) set both.
    """

    base_seconds: float = 10.0
    max_seconds: float = 600.0

    def backoff_seconds(self, failed_attempt: int) -> float:
        return float(min(self.max_seconds, self.base_seconds * 2 ** max(0, failed_attempt - 1)))


DEFAULT_RETRY_POLICY = RetryPolicy()


@dataclass(frozen=True)
class StatusDecision:
    """What one reconcile should converge to: the status, the attempt to create (if any), the events."""

    status: RLHFJobStatus
    start_attempt: int | None = None
    """Attempt number whose children must exist now (create them; 409 means already there)."""
    events: tuple[Event, ...] = ()
    recheck_after_seconds: float | None = None
    """When a time-based transition is due (retry backoff, deadline); None: nothing scheduled."""
    stop_rayjob: str | None = None
    """A RayJob to stop now (suspend it, recording :data:`STOPPED_ANNOTATION`): the deadline passed,
    or (KubeRay 1.5) its startup timeout."""
    stop_reason: str = STOP_DEADLINE
    """What :data:`STOPPED_ANNOTATION` records for ``stop_rayjob``."""
    record_active_time: ActiveTime | None = None
    """A record to write onto the current RayJob (:data:`ACTIVE_TIME_ANNOTATION`): Kueue suspended it,
    ending a running period the operator did not end itself."""
    hold_status_seconds: float | None = None
    """Set when the status need not be written yet (:func:`pending_hold_seconds`): a new job whose
    first RayJob waits for KubeRay's first status. The pass writes nothing to the status unless
    it has a problem to report; the recheck comes when this runs out."""

    @property
    def retrying(self) -> bool:
        """True when this decision starts a new attempt after a failed one."""
        return self.start_attempt is not None and self.start_attempt > 1 and self.status.phase == "Retrying"


# --------------------------------------------------------------------------- the mapping


@dataclass(frozen=True)
class _Outcome:
    """How the current attempt stands: still going (``phase``), succeeded, or failed (retryable or not)."""

    phase: Phase
    failed: bool = False
    retryable: bool = False
    reason: str = ""
    message: str = ""
    counted: bool = True
    """A failure that spends one of ``spec.maxRestarts``; a stop the controller was asked for does not."""


PENDING_WRITE_DELAY_SECONDS = 5.0
"""How long a new job's first RayJob may wait for KubeRay before the job's status says Pending."""


def pending_hold_seconds(
    current: RLHFJobStatus,
    phase: Phase,
    attempt: int,
    latest: ObservedRayJob | None,
    *,
    creating: bool,
    now: datetime,
) -> float | None:
    """Seconds the status write of a brand-new job may wait for KubeRay's first word, or None.

    A job's first status would say Pending: its first RayJob exists (or is created by this pass)
    and KubeRay has not written the RayJob's status yet. KubeRay does that on its first look at
    the RayJob, normally within a second (Initializing; Suspended for a queued job, which is not
    Pending here), and the pass that RayJob event triggers writes the whole status then: a
    Pending written before it would show for no time a person can see and cost one write per
    job. So a job that has no phase yet stays without one for up to
    :data:`PENDING_WRITE_DELAY_SECONDS` from its first RayJob's creation; if KubeRay has not moved
    it by then, the recheck writes Pending (KubeRay is slow, down or missing its controller). Only
    for a job with no phase (nothing written yet, nothing to keep up to date), attempt 1 and
    KubeRay's New state; any problem (a failed child, a name conflict) is written at once.
    """
    if current.phase is not None or phase != "Pending" or attempt != 1:
        return None
    if creating:
        return PENDING_WRITE_DELAY_SECONDS
    if latest is None or latest.job_deployment_status != DEPLOYMENT_NEW or latest.created_at is None:
        return None
    waited = max(0.0, (_now(now) - _now(latest.created_at)).total_seconds())
    left = PENDING_WRITE_DELAY_SECONDS - waited
    return left if left > 0 else None


def _waiting_phase(spec: RLHFJobSpec, suspended: bool) -> Phase:
    """Phase of a job whose cluster is not running: Suspended by the user, Queued by Kueue, else Pending."""
    if spec.suspend:
        return "Suspended"
    if suspended:
        return "Queued" if spec.queue_name is not None else "Suspended"
    return "Pending"


STALLED_MARKER = "error: Stalled: "
"""The line ``hybridflow run --in-cluster`` ends with when a worker call stalled (its
``STALLED_PREFIX``); KubeRay copies the entrypoint's last log lines into the RayJob's message."""
STALLED_REASON = "Stalled"


STOP_MARKER = "stopped on request: "
"""The line ``hybridflow run --in-cluster`` ends with after a stop a pod's preStop hook asked for
(``hybridflow.incluster.stop.STOPPED_ON_REQUEST``): a drained node, an eviction, a pod deleted."""
STOP_REQUESTED_REASON = "StopRequested"


def _stalled(reason: str, message: str) -> str:
    """``Stalled`` when the failed run's last words were a stall report, else ``reason`` (retryable)."""
    stalled = STALLED_MARKER in message and reason not in FINAL_FAILURE_REASONS
    return STALLED_REASON if stalled else reason


def _failure(reason: str, message: str, *, retryable: bool) -> _Outcome:
    return _Outcome(phase="Failed", failed=True, retryable=retryable, reason=reason, message=message)


def _ended_failure(reason: str, message: str) -> _Outcome:
    """A Ray job that ended without success: a stop the controller was asked for (its last line
    says so: retried without spending ``maxRestarts``), a stall, or a failure."""
    if reason not in FINAL_FAILURE_REASONS and STOP_MARKER in message:
        line = message[message.rindex(STOP_MARKER) :].splitlines()[0]
        return _Outcome("Failed", True, True, STOP_REQUESTED_REASON, line, counted=False)
    reason = _stalled(reason, message)
    return _failure(reason, message, retryable=reason not in FINAL_FAILURE_REASONS)


def stopped_attempts(spec: RLHFJobSpec, attempts: Sequence[ObservedRayJob]) -> int:
    """Attempts that ended by a stop the controller was asked for: each adds an attempt to the
    ``maxRestarts + 1`` the job may make (a drained node is not the job's failure)."""
    return sum(1 for rayjob in attempts if not _classify(spec, rayjob).counted)


def _classify(spec: RLHFJobSpec, rayjob: ObservedRayJob) -> _Outcome:
    """Map one RayJob state to the attempt's outcome (see the module docstring's table)."""
    if rayjob.stopped_reason:
        retryable = rayjob.stopped_reason in RETRYABLE_STOPS
        detail = (
            "its cluster did not start within spec.startupTimeoutSeconds"
            if retryable
            else rayjob.message or "stopped by the operator"
        )
        return _failure(rayjob.stopped_reason, detail, retryable=retryable)
    deployment, ray_status = rayjob.job_deployment_status, rayjob.job_status
    if deployment in (DEPLOYMENT_NEW, DEPLOYMENT_SCHEDULING, DEPLOYMENT_SCHEDULED):
        return _Outcome(_waiting_phase(spec, rayjob.suspend))
    if deployment in (DEPLOYMENT_INITIALIZING, DEPLOYMENT_WAITING):
        return _Outcome("Initializing")
    if deployment == DEPLOYMENT_RUNNING:
        # A terminal Ray status under a Running deployment is KubeRay catching up: wait for it.
        started = ray_status in (RAY_RUNNING, RAY_SUCCEEDED, RAY_FAILED, RAY_STOPPED)
        return _Outcome("Running" if started else "Initializing")
    if deployment in (DEPLOYMENT_SUSPENDING, DEPLOYMENT_SUSPENDED):
        return _Outcome(_waiting_phase(spec, suspended=True))
    if deployment == DEPLOYMENT_RETRYING:
        return _Outcome("Retrying")
    if deployment == DEPLOYMENT_COMPLETE:
        if ray_status == RAY_SUCCEEDED:
            return _Outcome("Succeeded")
        reason = rayjob.reason or {RAY_FAILED: "AppFailed", RAY_STOPPED: "Stopped"}.get(
            ray_status, "Incomplete"
        )
        message = rayjob.message or f"the Ray job ended with status {ray_status or 'unknown'}"
        return _ended_failure(reason, message)
    if deployment == DEPLOYMENT_FAILED:
        reason = rayjob.reason or "Failed"
        message = rayjob.message or "KubeRay marked the RayJob Failed"
        return _ended_failure(reason, message)
    if deployment == DEPLOYMENT_VALIDATION_FAILED:
        return _failure("ValidationFailed", rayjob.message or "KubeRay rejected the RayJob", retryable=False)
    # A state newer than KubeRay v1.7: report it, do not guess an outcome.
    return _Outcome(
        "Initializing", reason="UnknownRayJobState", message=f"jobDeploymentStatus {deployment!r}"
    )


def repeated_failure(spec: RLHFJobSpec, attempts: Sequence[ObservedRayJob]) -> bool:
    """True when the last two attempts failed the same deterministic way: a retry would too.

    Deterministic means the application itself failed (``AppFailed``, or a Ray job FAILED)
    with the very same message twice in a row: the same exception at the same place, which a
    fresh cluster will not change. Infrastructure failures (a lost node, a submitter that timed
    out, a pre-running deadline) are retried to the end of ``maxRestarts``.
    """
    if len(attempts) < 2:
        return False
    last, previous = _classify(spec, attempts[-1]), _classify(spec, attempts[-2])
    return (
        last.failed
        and previous.failed
        and last.reason in APPLICATION_FAILURE_REASONS
        and last.reason == previous.reason
        and bool(last.message)
        and last.message == previous.message
    )


def _now(now: datetime) -> datetime:
    """Second precision, UTC: what Kubernetes stores for times, so a re-read compares equal."""
    return now.astimezone(UTC).replace(microsecond=0)


def _set_condition(
    previous: RLHFJobStatus,
    condition_type: str,
    status: ConditionStatus,
    reason: str,
    message: str,
    now: datetime,
) -> Condition:
    """The condition, keeping the previous ``lastTransitionTime`` unless ``status`` changed."""
    old = previous.condition(condition_type)
    since = old.last_transition_time if old is not None and old.status == status else now
    return Condition(
        type=condition_type, status=status, reason=reason, message=message, last_transition_time=since
    )


def _conditions(
    previous: RLHFJobStatus,
    phase: Phase,
    *,
    created: bool,
    rayjob: str,
    attempt_text: str,
    reason: str,
    message: str,
    now: datetime,
) -> tuple[Condition, ...]:
    """The conditions (:data:`CONDITION_TYPES`) of a validated job in ``phase``."""

    def when(true: bool, true_reason: str, true_message: str) -> tuple[ConditionStatus, str, str]:
        return ("True", true_reason, true_message) if true else ("False", phase, f"phase is {phase}")

    failure_text = f"{reason}: {message}" if reason and message else reason or message
    values: dict[str, tuple[ConditionStatus, str, str]] = {
        "Validated": ("True", "SpecValid", "the spec passed the operator's checks"),
        "RayJobCreated": (
            ("True", "Created", f"RayJob {rayjob} ({attempt_text})")
            if created
            else ("False", "Creating", f"creating RayJob {rayjob} ({attempt_text})")
        ),
        "Running": when(phase == "Running", "RayJobRunning", f"RayJob {rayjob} is running the controller"),
        "Suspended": when(
            phase in ("Suspended", "Queued"),
            phase,
            "held by Kueue until admitted" if phase == "Queued" else "spec.suspend is true; no pods run",
        ),
        "Succeeded": when(phase == "Succeeded", "Succeeded", f"the controller finished ({attempt_text})"),
        "Failed": when(phase == "Failed", reason or "Failed", failure_text),
        "Stalled": when(
            phase in ("Retrying", "Failed") and reason == STALLED_REASON, STALLED_REASON, failure_text
        ),
    }
    kept = tuple(c for c in previous.conditions if c.type not in CONDITION_TYPES)
    return (
        *(
            _set_condition(previous, condition_type, *values[condition_type], now)
            for condition_type in CONDITION_TYPES
        ),
        *kept,
    )


def _phase_event(
    old: Phase | None, new: Phase, rayjob: str, attempt_text: str, detail: str
) -> tuple[Event, ...]:
    """One event per phase change a person acts on: Warning for failures and retries, Normal for
    Succeeded, Suspended and Queued.

    Pending, Initializing and Running, which every job passes through, get no Event: their times
    are in ``status.conditions``, and an Event is one more API write per job (the write budget of
    a job's whole lifecycle is 10, see ``docs/operator.md``).
    """
    if old == new or new in QUIET_PHASES:
        return ()
    messages: dict[Phase, str] = {
        "Pending": f"waiting for RayJob {rayjob} ({attempt_text})",
        "Suspended": "spec.suspend is true: the cluster is deleted and nothing runs",
        "Queued": "waiting for Kueue to admit the job",
        "Initializing": f"RayJob {rayjob} is starting its cluster ({attempt_text})",
        "Running": f"the controller is running in RayJob {rayjob} ({attempt_text})",
        "Retrying": detail,
        "Succeeded": f"training finished in RayJob {rayjob} ({attempt_text})",
        "Failed": detail,
    }
    kind: Literal["Normal", "Warning"] = "Warning" if new in ("Retrying", "Failed") else "Normal"
    return (Event(kind, new, messages[new]),)


def job_start_time(attempts: Sequence[ObservedRayJob]) -> datetime | None:
    """When KubeRay first started a cluster of the job that ran: the first period of the earliest
    attempt, from the operator's record once a suspension moved KubeRay's ``startTime`` on."""
    times: list[datetime] = []
    for rayjob in attempts:
        if rayjob.active_time is not None and rayjob.active_time.started is not None:
            times.append(rayjob.active_time.started)
        elif rayjob.start_time is not None and not rayjob.never_ran:
            times.append(rayjob.start_time)
    return _now(min(times)) if times else None


def _completion_time(latest: ObservedRayJob | None, now: datetime) -> datetime:
    """When the job finished, from its last RayJob: KubeRay's ``endTime``, or when the operator
    stopped it (the stop patch's record); ``now`` in the pass that decides it (and writes that record)."""
    if latest is None:
        return now
    if latest.stopped_reason and latest.active_time is not None:
        return _now(latest.active_time.period_end)
    if latest.end_time is not None:
        return _now(latest.end_time)
    if latest.finished:  # KubeRay failed it without an endTime (an invalid spec): its last known time
        return _now(latest.start_time or latest.created_at or now)
    return now


def rollout_replacement_events(status: RLHFJobStatus) -> tuple[RLHFJobStatus, tuple[Event, ...]]:
    """One ``RolloutReplicaReplaced`` Event for the replacements the controller reported since the last pass.

    The controller counts its attempt's replacements in ``progress.rollout`` (from 0 for each
    rollout service, identified by ``startedAt``); the operator keeps what it has reported in
    ``rolloutReplacementsSeen`` and the total over attempts in ``rolloutReplicasReplaced``. Fed
    its own result, the function returns no Event: each replacement is reported once. A count
    the controller pushes is advisory (it decides no phase), so a forged one forges an Event only.
    """
    rollout = status.progress.rollout if status.progress is not None else None
    if rollout is None or rollout.started_at is None:
        return status, ()
    seen = status.rollout_replacements_seen
    same_service = seen is not None and seen.started_at == rollout.started_at
    reported = seen.count if seen is not None and same_service else 0
    new = rollout.replicas_replaced - reported
    if new <= 0 and same_service:
        return status, ()
    updated = status.model_copy(
        update={
            "rollout_replicas_replaced": (status.rollout_replicas_replaced or 0) + max(0, new),
            "rollout_replacements_seen": ReplacementsSeen(
                started_at=rollout.started_at, count=rollout.replicas_replaced
            ),
        }
    )
    if new <= 0:
        return updated, ()
    last = f"; last: {rollout.last_replacement}" if rollout.last_replacement else ""
    message = (
        f"{new} rollout replica{'s' if new > 1 else ''} replaced, {rollout.replicas_replaced} in this attempt, "
        f"{rollout.replicas_serving} serving{last}"
    )
    return updated, (Event("Warning", "RolloutReplicaReplaced", message[:1024]),)


def desired_status(
    job: RLHFJob,
    current: RLHFJobStatus,
    attempts: Sequence[ObservedRayJob],
    *,
    now: datetime,
    generation: int | None = None,
    retry_policy: RetryPolicy = DEFAULT_RETRY_POLICY,
    kuberay: KubeRayFeatures = ASSUMED_CURRENT,
) -> StatusDecision:
    """The status ``job`` should have, decided from its own RayJobs only.

    ``attempts`` are the RayJobs owned by the job's uid, one per attempt started. Every
    lifecycle fact comes from them: the attempt count (the highest attempt label), the
    current attempt's state (KubeRay's status), the start, end and running times (KubeRay's
    ``startTime``/``endTime`` and the operator's :data:`ACTIVE_TIME_ANNOTATION`), and the
    operator's final decisions (:data:`STOPPED_ANNOTATION`). ``current`` (the status as
    stored, which the controller in the head pod can write) is read only to keep condition
    times stable and to tell phase changes for events; forging ``status.attempts``,
    ``status.phase`` or ``status.completionTime`` changes no decision.

    ``now`` is the reconcile's clock, passed in so the function is pure. Feeding the result's
    status back as ``current`` with the same ``attempts`` yields the same status again, which
    is what makes a second reconcile write nothing.

    ``kuberay`` is what the installed KubeRay serves: without ``preRunningDeadlineSeconds``
    (1.5.x) the operator keeps ``spec.startupTimeoutSeconds`` itself (:func:`startup_wait_seconds`).
    """
    now = _now(now)
    spec = job.spec
    ordered = sorted(attempts, key=lambda a: a.attempt)
    stops = stopped_attempts(spec, ordered)
    max_attempts = spec.max_restarts + 1 + stops
    latest = ordered[-1] if ordered else None
    attempt = latest.attempt if latest is not None else 1
    base = current.model_copy(update={"observed_generation": generation})
    start_time = job_start_time(ordered)

    outcome = _classify(spec, latest) if latest is not None else None
    stop_rayjob: str | None = None
    recheck: float | None = None
    deadline = spec.active_deadline_seconds
    if deadline is not None and not (outcome and outcome.phase == "Succeeded"):
        ran = active_seconds(ordered, now)
        final = outcome is not None and outcome.failed and not outcome.retryable
        if ran >= deadline and (not final or (outcome is not None and outcome.reason == "DeadlineExceeded")):
            detail = (
                f"the job ran for spec.activeDeadlineSeconds ({deadline}s), not counting time suspended, "
                "queued or between attempts"
            )
            outcome = _failure("DeadlineExceeded", detail, retryable=False)
            if latest is not None and not latest.finished:
                stop_rayjob = latest.name
        elif latest is not None and latest.counting:
            recheck = float(deadline - ran)  # while nothing runs the clock stands still: no recheck
    stop_reason = STOP_DEADLINE
    if stop_rayjob is None and latest is not None and not kuberay.pre_running_deadline:
        wait = startup_wait_seconds(spec, latest, now)
        if wait is not None and wait <= 0:
            stop_rayjob, stop_reason = latest.name, STOP_STARTUP_TIMEOUT
            outcome = _failure(
                STOP_STARTUP_TIMEOUT,
                f"its cluster did not start within spec.startupTimeoutSeconds ({spec.startup_timeout_seconds}s)",
                retryable=True,
            )
        elif wait is not None:
            recheck = wait if recheck is None else min(recheck, wait)

    start_attempt: int | None = None
    attempts_started = attempt
    if outcome is None:
        # No RayJob yet: the first reconcile, or a create that has not landed. The RayJob this pass
        # creates is suspended for Kueue when the job names a queue: it is Queued from the start
        # (saying Pending first would cost a second status write for nothing).
        phase: Phase = _waiting_phase(spec, suspended=spec.queue_name is not None)
        start_attempt = 1
        reason, message = "", ""
    elif outcome.failed and outcome.retryable and repeated_failure(spec, ordered):
        phase = "Failed"
        reason = "RepeatedFailure"
        message = (
            f"attempts {attempt - 1} and {attempt} failed with the same error, so another attempt would "
            f"too ({outcome.reason}: {outcome.message})"
        )
    elif outcome.failed and outcome.retryable and attempt < max_attempts:
        phase = "Retrying"
        reason, message = outcome.reason, outcome.message
        ended = _now(latest.end_time or latest.created_at or now) if latest is not None else now
        retry_at = ended + timedelta(seconds=retry_policy.backoff_seconds(max(1, attempt - stops)))
        if now >= retry_at:
            attempts_started = attempt + 1
            start_attempt = attempts_started
        else:
            wait = (retry_at - now).total_seconds()
            recheck = wait if recheck is None else min(recheck, wait)
            message = f"{message}; attempt {attempt + 1} starts at {retry_at.isoformat()}"
    elif outcome.failed:
        phase = "Failed"
        reason, message = outcome.reason, outcome.message
        if outcome.retryable:
            message = f"{message} (attempt {attempt} of {max_attempts}; spec.maxRestarts {spec.max_restarts} reached)"
    else:
        phase = outcome.phase
        if phase == "Pending" and attempt > 1:
            phase = "Retrying"  # the next attempt's RayJob exists but has not started yet
        reason, message = outcome.reason, outcome.message
    if start_attempt is not None and spec.suspend and spec.queue_name is not None:
        # A new RayJob's Workload starts active, and Kueue would admit and start it against the
        # user's suspend: a queued job's next RayJob is created when it is resumed.
        start_attempt = None
        attempts_started = attempt if ordered else 0
        phase = "Suspended"
    if phase in TERMINAL_PHASES:
        recheck = None
    record = (
        close_running_period(latest, now)
        if latest is not None and phase not in TERMINAL_PHASES and _record_due(latest)
        else None
    )

    new_name = rayjob_name(job.metadata.name, max(1, attempts_started))
    attempt_text = f"attempt {max(1, attempts_started)} of {max_attempts}"
    mirrors: dict[str, Any] = {
        "job_deployment_status": (latest.job_deployment_status or None) if latest else None,
        "job_status": (latest.job_status or None) if latest else None,
        "reason": (latest.reason or None) if latest else None,
        "message": (latest.message or None) if latest else None,
    }
    if start_attempt is not None and start_attempt > 1:
        mirrors = dict.fromkeys(mirrors)  # the new attempt has no RayJob state yet
    if reason:  # a failure, a retry, or a state this mapping does not know: say why
        mirrors.update(reason=reason, message=message or None)
    if phase == "Retrying" and reason == STOP_REQUESTED_REASON:
        event_detail = (
            f"attempt {attempt} {message.removeprefix(STOP_MARKER).join(('stopped on request (', ')'))}; "
            f"not counted against spec.maxRestarts: RayJob {new_name} ({attempt_text}) resumes from it"
        )
    elif phase == "Retrying":
        event_detail = (
            f"attempt {attempt} of {max_attempts} failed ({reason}: {message}); RayJob {new_name} "
            f"({attempt_text}) resumes from the newest checkpoint"
            if reason
            else f"KubeRay is retrying RayJob {new_name}"
        )
    else:
        event_detail = f"{reason}: {message}"
    status = base.model_copy(
        update={
            "phase": phase,
            "attempts": attempts_started,
            "ray_job_name": new_name,
            "start_time": start_time,
            "completion_time": _completion_time(latest, now) if phase in TERMINAL_PHASES else None,
            "conditions": _conditions(
                current,
                phase,
                created=latest is not None and start_attempt is None,
                rayjob=new_name,
                attempt_text=attempt_text,
                reason=reason if phase in ("Failed", "Retrying") else "",
                message=message if phase in ("Failed", "Retrying") else "",
                now=now,
            ),
            **mirrors,
        }
    )
    events = _phase_event(current.phase, phase, new_name, attempt_text, event_detail)
    if events and phase == "Retrying" and reason == STOP_REQUESTED_REASON:
        events = (Event("Normal", STOP_REQUESTED_REASON, event_detail),)
    hold = (
        None
        if reason
        else pending_hold_seconds(
            current, phase, attempts_started, latest, creating=start_attempt == 1, now=now
        )
    )
    if hold is not None:
        recheck = hold if recheck is None else min(recheck, hold)
    return StatusDecision(
        status,
        start_attempt,
        events,
        recheck,
        stop_rayjob,
        stop_reason,
        record_active_time=record,
        hold_status_seconds=hold,
    )


def held_inactive_by_kueue(
    decision: StatusDecision, current: RLHFJobStatus, reason: str, message: str, *, now: datetime
) -> StatusDecision:
    """``decision`` for a job whose Workload Kueue deactivated itself (``hybridflow_operator.kueue``):
    phase Suspended (nothing will admit it), the ``Suspended`` condition with Kueue's reason and a
    message saying the way out, the same in ``status.reason``/``message``, and one Warning Event
    ``KueueDeactivated`` when the reason is new."""
    now = _now(now)
    reason = reason or "Deactivated"
    suspended = _set_condition(current, "Suspended", "True", reason, message, now)
    status = decision.status.model_copy(
        update={
            "phase": "Suspended",
            "reason": reason,
            "message": message,
            "conditions": tuple(
                suspended if c.type == "Suspended" else c for c in decision.status.conditions
            ),
        }
    )
    seen = current.condition("Suspended")
    known = current.phase == "Suspended" and seen is not None and seen.reason == reason
    events = () if known else (Event("Warning", "KueueDeactivated", message[:1024]),)
    return StatusDecision(
        status,
        decision.start_attempt,
        events,
        decision.recheck_after_seconds,
        decision.stop_rayjob,
        decision.stop_reason,
        record_active_time=decision.record_active_time,
    )


def startup_wait_seconds(spec: RLHFJobSpec, rayjob: ObservedRayJob, now: datetime) -> float | None:
    """Seconds until ``rayjob``'s startup timeout, as KubeRay >= 1.6 keeps ``preRunningDeadlineSeconds``
    (``checkPreRunningDeadlineAndUpdateStatusIfNeeded``: from the period's ``startTime`` while the
    deployment is Initializing or Waiting); None when it does not apply (started, held, finished)."""
    timeout = spec.startup_timeout_seconds
    starting = rayjob.job_deployment_status in (DEPLOYMENT_INITIALIZING, DEPLOYMENT_WAITING)
    if timeout is None or rayjob.start_time is None or not starting or rayjob.held or rayjob.stopped_reason:
        return None
    return timeout - (_now(now) - _now(rayjob.start_time)).total_seconds()


def invalid_spec_status(
    current: RLHFJobStatus,
    problems: Sequence[str],
    *,
    now: datetime,
    generation: int | None = None,
) -> StatusDecision:
    """Status of a job whose spec the operator cannot accept: ``Validated=False`` naming each problem.

    No children are created. A job that never started stays Pending (not Failed) so that
    fixing a mutable field lets it proceed; a job that already has a RayJob keeps its phase,
    since what runs was started from the previous, valid spec.
    """
    now = _now(now)
    message = "; ".join(problems)
    validated = _set_condition(current, "Validated", "False", "InvalidSpec", message, now)
    others = tuple(c for c in current.conditions if c.type != "Validated")
    status = current.model_copy(
        update={
            "phase": current.phase or "Pending",
            "conditions": (validated, *others),
            "observed_generation": generation,
        }
    )
    old = current.condition("Validated")
    changed = old is None or old.status != "False" or old.message != message
    events = (Event("Warning", "InvalidSpec", message),) if changed else ()
    return StatusDecision(status, None, events)


def with_rayjob_created(previous: RLHFJobStatus, status: RLHFJobStatus, *, now: datetime) -> RLHFJobStatus:
    """``status`` once this pass has created the attempt's RayJob: ``RayJobCreated=True`` right away,
    so the pass that then observes the RayJob finds nothing to change (one status write, not two)."""
    old = status.condition("RayJobCreated")
    message = old.message.removeprefix("creating ") if old is not None else f"RayJob {status.ray_job_name}"
    created = _set_condition(previous, "RayJobCreated", "True", "Created", message, _now(now))
    return status.model_copy(
        update={"conditions": tuple(created if c.type == "RayJobCreated" else c for c in status.conditions)}
    )


CHILDREN_READY = "ChildrenReady"
"""Condition: True when every child the job needs exists and the last writes succeeded; False
with the API's reason (:mod:`hybridflow_operator.events`) and message otherwise."""


def set_children_ready(
    previous: RLHFJobStatus, status: RLHFJobStatus, problem: tuple[str, str] | None, *, now: datetime
) -> tuple[RLHFJobStatus, bool]:
    """``status`` with the ``ChildrenReady`` condition for ``problem`` (None: all well).

    Also says whether the condition's status or reason changed since ``previous``, which is
    when the reconcile emits a Warning Event: once per problem, not once per retry.
    """
    now = _now(now)
    reason, message = problem if problem is not None else ("Ready", "every child exists")
    condition = _set_condition(previous, CHILDREN_READY, "False" if problem else "True", reason, message, now)
    old = previous.condition(CHILDREN_READY)
    changed = old is None or old.status != condition.status or old.reason != condition.reason
    others = tuple(c for c in status.conditions if c.type != CHILDREN_READY)
    return status.model_copy(update={"conditions": (*others, condition)}), changed


def status_patch(current: RLHFJobStatus, desired: RLHFJobStatus) -> dict[str, Any]:
    """The merge patch of ``status`` that turns ``current`` into ``desired``, on operator-owned keys only.

    Empty when nothing changed, so a level-triggered reconcile that finds the world as it
    wants it writes nothing. A key that ``desired`` unsets is sent as null (merge-patch
    deletion). ``progress`` and ``artifacts`` are never included: the controller owns them.
    """
    old, new = current.to_json(), desired.to_json()
    return {key: new.get(key) for key in OPERATOR_OWNED_KEYS if old.get(key) != new.get(key)}


def remaining_deadline_seconds(
    spec: RLHFJobSpec, attempts: Sequence[ObservedRayJob], now: datetime
) -> int | None:
    """``activeDeadlineSeconds`` for the next RayJob: what the earlier ``attempts`` left of the
    job's running-time budget (:func:`active_seconds`).

    None without a deadline. At least 1, since KubeRay requires a positive value; a budget
    already spent is :func:`desired_status`'s business (it fails the job). KubeRay counts its
    own deadline from the RayJob's ``startTime``, which it sets again on each resume, so within
    an attempt that is suspended and resumed the operator's count is the one that stops it.
    """
    deadline = spec.active_deadline_seconds
    if deadline is None:
        return None
    return max(1, deadline - active_seconds(attempts, now))


def ttl_remaining_seconds(spec: RLHFJobSpec, status: RLHFJobStatus, now: datetime) -> float | None:
    """Seconds until a finished job should be deleted (<= 0: now); None while it runs or without a TTL."""
    ttl = spec.ttl_seconds_after_finished
    if ttl is None or status.phase not in TERMINAL_PHASES or status.completion_time is None:
        return None
    return ttl - (_now(now) - status.completion_time).total_seconds()
