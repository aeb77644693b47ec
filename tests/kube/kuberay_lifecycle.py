"""KubeRay's RayJob state machine, replayed in Python: one reconcile pass of a K8sJobMode RayJob.

Follows ``RayJobReconciler.Reconcile`` in ``ray-operator/controllers/ray/rayjob_controller.go``
of KubeRay v1.7.0, with the differences of v1.6.x and v1.5.1 where they show in K8sJobMode
(the only submission mode the operator uses): 1.5.1 has no ``preRunningDeadlineSeconds`` and
keeps requeueing a Suspended RayJob; 1.5.1 and 1.6 have no job-status-check timeout (a failing
dashboard query is just an error) and 1.5.1 deletes a clusterSelector cluster when it retries.
:func:`reconcile_rayjob` takes the RayJob (a JSON dict with ``status``) and what the pass
would observe (:class:`ClusterObservation`) and returns the status KubeRay writes, what it
does to the world and when it wants to run again:

* deletion (``deletionTimestamp``): stop the Ray job unless ``jobStatus`` is terminal, remove
  the ``ray.io/rayjob-finalizer``;
* validation (``kuberay_rules.validate_rayjob``): ``ValidationFailed`` with reason
  ``ValidationFailed``; a ValidationFailed RayJob stays so (Reconcile's ``default`` case);
* then the switch on ``status.jobDeploymentStatus``: ``""`` (New) -> Initializing
  (``initRayJobStatusIfNeed``); Initializing -> Suspending, Failed (``DeadlineExceeded``,
  ``PreRunningDeadlineExceeded``), waiting for the cluster, Running (submitter created);
  Running -> Suspending, Failed/Complete (deadline, transition grace period, job-status-check
  timeout, submitter failure, submitter-finished timeout, the Ray job's terminal status);
  Suspending/Retrying -> (resources gone) Suspended/New; Suspended -> New when unsuspended;
  Complete/Failed -> cluster deletion (``shutdownAfterJobFinishes`` + TTL, or
  ``deletionStrategy``);
* after the switch ``checkBackoffLimitAndUpdateStatusIfNeeded`` (counters, Retrying) and
  ``updateRayJobStatus``, which writes only when ``jobStatus``, ``jobDeploymentStatus``, the
  cluster state or (1.7) ``jobStatusCheckFailureStartTime`` changed, setting ``endTime`` to now
  whenever it writes a Complete or Failed status; an unwritten pass leaves the status as it was.

Times are RFC 3339 seconds (``metav1.Time``); ``now`` stands for every ``time.Now()`` of the
pass. Deliberately left out: other submission modes, batch schedulers, the head Service KubeRay
makes for the RayJob, API errors (only the errors the observation can cause are modelled:
they set :attr:`LifecycleStep.error`, and controller-runtime then retries with its backoff),
the full ``rayClusterStatus`` (only ``state: ready`` is mirrored), objects that are already
being deleted (an existing object is deleted again each pass), operator environment variables
(their defaults: a 300 s transition grace period and status-check timeout,
``DELETE_RAYJOB_CR_AFTER_JOB_FINISHES`` unset, ``cluster.local``), and KubeRay's random name
suffixes (``rand.String(5)``), which are derived here from the name and ``now`` so a pass is
reproducible.
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from kube import kuberay_rules

FINALIZER = "ray.io/rayjob-finalizer"  # utils.RayJobStopJobFinalizer
DEFAULT_REQUEUE_SECONDS = 3.0  # RayJobDefaultRequeueDuration
SUBMITTER_FINISHED_TIMEOUT_SECONDS = 30  # DefaultSubmitterFinishedTimeout
TRANSITION_GRACE_PERIOD_SECONDS = 300  # DEFAULT_RAYJOB_DEPLOYMENT_STATUS_TRANSITION_GRACE_PERIOD_SECONDS
JOB_STATUS_CHECK_TIMEOUT_SECONDS = 300  # DEFAULT_RAYJOB_STATUS_CHECK_TIMEOUT_SECONDS (1.7)
DELETION_REQUEUE_BUFFER_SECONDS = 2.0  # requeueDelayFor
KUBERAY_CONTROLLER = "ray.io/kuberay-operator"
DASHBOARD_PORT = 8265
RAND_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"  # k8s.io/apimachinery/pkg/util/rand
TERMINAL_JOB_STATUSES = ("STOPPED", "SUCCEEDED", "FAILED")  # rayv1.IsJobTerminal

Json = Mapping[str, Any]
REQUEUE = "requeue without writing"
"""What a state handler returns to end the pass like ``return ctrl.Result{RequeueAfter: 3s}, nil``;
any other string is an error KubeRay returns, None goes on to the status update."""


@dataclass(frozen=True)
class ClusterObservation:
    """What one pass sees of the world; defaults are a RayJob nothing was made for yet."""

    exists: bool = False
    """The RayJob's RayCluster object exists."""
    ready: bool = False
    """RayCluster ``.status.state == ready`` (all pods up)."""
    job_status: str = ""
    """Ray's JobStatus from the dashboard; "" is "no such job" (a BadRequest from GetJobInfo)."""
    job_message: str = ""
    submitter_finished: bool = False
    """The submitter K8s Job has a Complete or Failed condition."""
    job_start_ms: int = 0
    job_end_ms: int = 0
    submitter_failed: bool = False
    """The submitter K8s Job's condition is Failed (implies finished)."""
    submitter_failure_reason: str = "BackoffLimitExceeded"
    submitter_failure_message: str = "Job has reached the specified backoff limit"
    submitter_finished_at: datetime | None = None
    """The finished condition's lastTransitionTime; None: ``now`` (it just finished)."""
    submitter_exists: bool | None = None
    """The submitter K8s Job exists; None: as KubeRay left it (absent until Running, present
    from Running on, and gone together with the cluster while suspending or retrying)."""
    job_info_error: bool = False
    """GetJobInfo failed for another reason than "no such job" (the dashboard is unreachable)."""


@dataclass(frozen=True)
class LifecycleStep:
    status: dict[str, Any]
    actions: tuple[str, ...]
    requeue_after_seconds: float | None
    error: str | None = None
    """An error KubeRay returned this pass (controller-runtime retries with backoff then)."""


# --------------------------------------------------------------------------- helpers


def _utc(moment: datetime) -> datetime:
    return moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment.astimezone(UTC)


def format_time(moment: datetime) -> str:
    """``metav1.Time`` as JSON: RFC 3339, whole seconds, UTC."""
    return _utc(moment).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(text: str) -> datetime:
    return _utc(datetime.fromisoformat(text.replace("Z", "+00:00")))


def go_time_string(moment: datetime) -> str:
    """Go's ``time.Time.String()`` of a whole-second UTC time (``%v`` of a ``*metav1.Time``)."""
    return _utc(moment).strftime("%Y-%m-%d %H:%M:%S +0000 UTC")


def go_date_time(moment: datetime) -> str:
    """Go's ``Format(time.DateTime)``."""
    return _utc(moment).strftime("%Y-%m-%d %H:%M:%S")


def rand_suffix(*seed: str) -> str:
    """Five characters of ``rand.String``'s alphabet, derived from ``seed`` (KubeRay draws them)."""
    digest = hashlib.sha256("\x00".join(seed).encode()).digest()
    return "".join(RAND_ALPHABET[byte % len(RAND_ALPHABET)] for byte in digest[:5])


def generate_ray_cluster_name(rayjob_name: str, suffix: str) -> str:
    # GenerateRayClusterName (utils/util.go), 1.5.1-1.7: "<name>-<rand.String(5)>".
    return f"{rayjob_name}-{suffix}"


def generate_ray_job_id(rayjob_name: str, suffix: str) -> str:
    # GenerateRayJobId (utils/util.go), 1.5.1-1.7: "<name>-<rand.String(5)>".
    return f"{rayjob_name}-{suffix}"


def dashboard_url(cluster_name: str, namespace: str) -> str:
    # FetchHeadServiceURL + GenerateHeadServiceName (utils/util.go): "<cluster>-head-svc.<ns>.svc.<domain>:<port>".
    return f"{cluster_name}-head-svc.{namespace}.svc.cluster.local:{DASHBOARD_PORT}"


def _put(status: dict[str, Any], key: str, value: Any) -> None:
    """Set a status field as Go's ``omitempty`` JSON has it: an empty string or nil is absent."""
    if value in ("", None):
        status.pop(key, None)
    else:
        status[key] = value


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


class _Pass:
    """The mutable state of one reconcile pass."""

    def __init__(self, rayjob: Json, cluster: ClusterObservation, now: datetime, version: str) -> None:
        self.rayjob = rayjob
        self.metadata: Json = rayjob.get("metadata") or {}
        self.spec: Json = rayjob.get("spec") or {}
        self.old: dict[str, Any] = copy.deepcopy(dict(rayjob.get("status") or {}))
        self.status: dict[str, Any] = copy.deepcopy(self.old)
        self.cluster = cluster
        self.now = _utc(now)
        self.version = version
        self.actions: list[str] = []

    # ---- reading
    @property
    def name(self) -> str:
        return str(self.metadata.get("name") or "")

    @property
    def namespace(self) -> str:
        return str(self.metadata.get("namespace") or "default")

    @property
    def selector_name(self) -> str:
        return str(
            (self.spec.get("clusterSelector") or {}).get(kuberay_rules.RAY_JOB_CLUSTER_SELECTOR_KEY) or ""
        )

    @property
    def selector_mode(self) -> bool:
        return bool(self.spec.get("clusterSelector"))

    def get(self, key: str) -> str:
        return str(self.status.get(key) or "")

    def time(self, key: str) -> datetime | None:
        value = self.status.get(key)
        return parse_time(value) if isinstance(value, str) and value else None

    def passed(self, start_key: str, seconds: int) -> bool:
        """``!time.Now().Before(status.<start_key> + seconds)``; Go dereferences a nil start time."""
        start = self.time(start_key)
        if start is None:
            raise ValueError(f"status.{start_key} is unset: KubeRay would dereference a nil pointer here")
        return self.now >= start + timedelta(seconds=seconds)

    def submitter_present(self, default: bool) -> bool:
        if self.cluster.submitter_failed or self.cluster.submitter_finished:
            return True
        return default if self.cluster.submitter_exists is None else self.cluster.submitter_exists

    def cluster_status(self) -> dict[str, Any]:
        return {"state": "ready"} if self.cluster.exists and self.cluster.ready else {}

    # ---- writing
    def put(self, key: str, value: Any) -> None:
        _put(self.status, key, value)

    def fail(self, reason: str, message: str) -> None:
        self.put("jobDeploymentStatus", "Failed")
        self.put("reason", reason)
        self.put("message", message)

    def step(
        self, requeue: float | None, *, status: dict[str, Any] | None = None, error: str | None = None
    ) -> LifecycleStep:
        return LifecycleStep(
            status=copy.deepcopy(self.old if status is None else status),
            actions=tuple(self.actions),
            requeue_after_seconds=requeue,
            error=error,
        )


# --------------------------------------------------------------------------- the checks of the switch


def _suspending(p: _Pass) -> bool:
    # updateStatusToSuspendingIfNeeded (rayjob_controller.go), 1.5.1-1.7: from Running or Initializing only.
    if p.spec.get("suspend") is not True or p.get("jobDeploymentStatus") not in ("Running", "Initializing"):
        return False
    p.put("jobDeploymentStatus", "Suspending")
    return True


def _active_deadline(p: _Pass) -> bool:
    # checkActiveDeadlineAndUpdateStatusIfNeeded (rayjob_controller.go), 1.5.1-1.7.
    deadline = p.spec.get("activeDeadlineSeconds")
    if deadline is None or not p.passed("startTime", _int(deadline)):
        return False
    start = p.time("startTime")
    assert start is not None
    p.fail(
        "DeadlineExceeded",
        f"The RayJob has passed the activeDeadlineSeconds. StartTime: {go_time_string(start)}. "
        f"ActiveDeadlineSeconds: {_int(deadline)}",
    )
    return True


def _pre_running_deadline(p: _Pass) -> bool:
    # checkPreRunningDeadlineAndUpdateStatusIfNeeded (rayjob_controller.go), 1.6-1.7.
    deadline = p.spec.get("preRunningDeadlineSeconds")
    if p.version == "1.5.1" or deadline is None or not p.passed("startTime", _int(deadline)):
        return False
    start = p.time("startTime")
    assert start is not None
    p.fail(
        "PreRunningDeadlineExceeded",
        f"The RayJob has passed the preRunningDeadlineSeconds. StartTime: {go_time_string(start)}. "
        f"PreRunningDeadlineSeconds: {_int(deadline)}",
    )
    return True


def _transition_grace_period(p: _Pass) -> bool:
    # checkTransitionGracePeriodAndUpdateStatusIfNeeded (rayjob_controller.go), 1.5.1-1.7.
    if p.get("jobStatus") not in TERMINAL_JOB_STATUSES or p.get("jobDeploymentStatus") != "Running":
        return False
    end = (p.status.get("rayJobInfo") or {}).get("endTime")
    if not end or p.now < parse_time(end) + timedelta(seconds=TRANSITION_GRACE_PERIOD_SECONDS):
        return False
    p.put("jobDeploymentStatus", "Failed" if p.get("jobStatus") == "FAILED" else "Complete")
    p.put("reason", "JobDeploymentStatusTransitionGracePeriodExceeded")
    p.put(
        "message",
        "JobDeploymentStatus does not transition to Complete or Failed within the grace period after JobStatus "
        "reaches a terminal state.",
    )
    return True


def _job_status_check_timeout(p: _Pass) -> bool:
    # checkJobStatusCheckTimeoutAndUpdateStatusIfNeeded (rayjob_controller.go), 1.7.
    start = p.time("jobStatusCheckFailureStartTime")
    if p.version != "1.7" or start is None:
        return False
    if p.now < start + timedelta(seconds=JOB_STATUS_CHECK_TIMEOUT_SECONDS):
        return False
    p.fail(
        "JobStatusCheckTimeoutExceeded",
        f"Job status checks have been failing since {go_date_time(start)}; exceeded timeout of "
        f"{JOB_STATUS_CHECK_TIMEOUT_SECONDS}s",
    )
    return True


def _get_or_create_cluster(p: _Pass) -> str | None:
    # getOrCreateRayClusterInstance (rayjob_controller.go): None, or the error KubeRay returns.
    if p.cluster.exists:
        return None
    if p.selector_mode:
        return f"clusterSelector mode is enabled, but RayCluster {p.namespace}/{p.get('rayClusterName')} is not found"
    p.actions.append("create-cluster")
    return None


def _submitter_finished_at(p: _Pass) -> datetime | None:
    if not (p.cluster.submitter_finished or p.cluster.submitter_failed):
        return None
    return _utc(p.cluster.submitter_finished_at) if p.cluster.submitter_finished_at else p.now


# --------------------------------------------------------------------------- the states


def _initializing(p: _Pass) -> str | None:
    if _suspending(p) or _active_deadline(p) or _pre_running_deadline(p):
        return None
    error = _get_or_create_cluster(p)
    if error is not None:
        return error
    if not p.get("dashboardURL"):
        if not (p.cluster.exists and p.cluster.ready):
            p.status["rayClusterStatus"] = p.cluster_status()  # a cluster made just now has no status
            return None
        p.put("dashboardURL", dashboard_url(p.get("rayClusterName"), p.namespace))
    if not p.submitter_present(default=False):
        p.actions.append("create-submitter")  # createK8sJobIfNeed
    p.put("jobDeploymentStatus", "Running")
    return None


def _running(p: _Pass) -> str | None:
    if _suspending(p) or _active_deadline(p) or _transition_grace_period(p) or _job_status_check_timeout(p):
        return None
    error = _get_or_create_cluster(p)
    if error is not None:
        return error
    # checkSubmitterAndUpdateStatusIfNeeded, K8sJobMode.
    if not p.submitter_present(default=True):
        return f"jobs.batch {p.name!r} not found (the submitter Kubernetes Job)"
    failed = p.cluster.submitter_failed
    if failed:
        p.put("jobDeploymentStatus", "Failed")
        if p.get("jobStatus") == "FAILED":
            p.put("reason", "AppFailed")
        else:
            p.put("reason", "SubmissionFailed")
            p.put(
                "message",
                f"Job submission has failed. Reason: {p.cluster.submitter_failure_reason}. "
                f"Message: {p.cluster.submitter_failure_message}",
            )
    finished_at = _submitter_finished_at(p)
    # checkSubmitterFinishedTimeoutAndUpdateStatusIfNeeded: it does not look at the Ray job.
    if finished_at is not None and p.now >= finished_at + timedelta(
        seconds=SUBMITTER_FINISHED_TIMEOUT_SECONDS
    ):
        p.put("jobStatus", "FAILED")
        p.fail(
            "JobDeploymentStatusTransitionGracePeriodExceeded",
            f"The RayJob submitter finished at {go_date_time(finished_at)} but the ray job did not reach terminal "
            f"state within {SUBMITTER_FINISHED_TIMEOUT_SECONDS}s",
        )
        return None
    if failed:
        return None
    # GetJobInfo.
    if p.cluster.job_info_error:
        if p.version != "1.7":
            return "failed to get the Ray job info from the dashboard"
        if p.status.get("jobStatusCheckFailureStartTime") is None:  # recordJobStatusCheckFailure
            p.put("jobStatusCheckFailureStartTime", format_time(p.now))
            return None
        return REQUEUE
    if not p.cluster.job_status:  # BadRequest: no such Ray job
        if finished_at is not None:
            p.fail("AppFailed", "Submitter completed but Ray job not found in RayCluster.")
            return None
        return REQUEUE
    p.status.pop("jobStatusCheckFailureStartTime", None)
    deployment, reason = "Running", ""
    if p.cluster.job_status in TERMINAL_JOB_STATUSES and finished_at is not None:
        deployment = "Complete"
        if p.cluster.job_status == "FAILED":
            deployment, reason = "Failed", "AppFailed"
    p.status["rayClusterStatus"] = p.cluster_status()
    p.put("jobStatus", p.cluster.job_status)
    p.put("jobDeploymentStatus", deployment)
    p.put("reason", reason)
    p.put("message", p.cluster.job_message)
    info = dict(p.status.get("rayJobInfo") or {})
    if p.cluster.job_start_ms:
        info["startTime"] = format_time(datetime.fromtimestamp(p.cluster.job_start_ms / 1000, UTC))
    if p.cluster.job_end_ms:
        info["endTime"] = format_time(datetime.fromtimestamp(p.cluster.job_end_ms / 1000, UTC))
    p.status["rayJobInfo"] = info
    return None


def _releasing(p: _Pass) -> str | None:
    """Suspending or Retrying: delete the cluster and the submitter, then reset the status."""
    # deleteClusterResources: 1.5.1 lacks the clusterSelector guard, so a retry deletes the selected cluster.
    cluster_gone = True
    if not (p.selector_mode and p.version != "1.5.1") and p.cluster.exists:
        p.actions.append("delete-cluster")
        cluster_gone = False
    submitter_gone = True
    if p.submitter_present(default=p.cluster.exists):  # deleteSubmitterJob
        p.actions.append("delete-submitter")
        submitter_gone = False
    if not (cluster_gone and submitter_gone):
        return REQUEUE
    p.status["rayClusterStatus"] = {}
    for key in ("rayClusterName", "dashboardURL", "jobId", "message", "reason", "jobStatus"):
        p.put(key, "")
    p.status["rayJobInfo"] = {}
    if p.version == "1.7":
        p.status.pop("jobStatusCheckFailureStartTime", None)
    p.put("jobDeploymentStatus", "Suspended" if p.get("jobDeploymentStatus") == "Suspending" else "")
    return None


def _initialize(p: _Pass) -> None:
    # initRayJobStatusIfNeed (rayjob_controller.go), 1.5.1-1.7 (K8sJobMode: a job id is always set).
    if p.get("jobId") and p.get("rayClusterName") and p.get("jobStatus"):
        return
    stamp = format_time(p.now)
    if not p.get("jobId"):
        p.put(
            "jobId",
            str(p.spec.get("jobId") or "") or generate_ray_job_id(p.name, rand_suffix(p.name, stamp, "job")),
        )
    if not p.get("rayClusterName"):
        p.put(
            "rayClusterName",
            p.selector_name or generate_ray_cluster_name(p.name, rand_suffix(p.name, stamp, "cluster")),
        )
    p.put("jobDeploymentStatus", "Initializing")
    p.put("startTime", stamp)


def _deletion_policy_done(p: _Pass, policy: str) -> bool:
    # isDeletionActionCompleted (rayjob_controller.go), 1.6-1.7; suspended worker groups are not observed.
    return policy == "DeleteNone" or (policy in ("DeleteCluster", "DeleteWorkers") and not p.cluster.exists)


def _execute(p: _Pass, policy: str) -> None:
    # executeDeletionPolicy (rayjob_controller.go), 1.6-1.7.
    if policy == "DeleteCluster" and p.cluster.exists:
        p.actions.append("delete-cluster")
    elif policy == "DeleteWorkers":
        p.actions.append("delete-workers")  # suspendWorkerGroups
    elif policy == "DeleteSelf":
        p.actions.append("delete-rayjob")


def _delay(p: _Pass, moment: datetime) -> float:
    # requeueDelayFor (rayjob_controller.go): time.Until(t) + 2s.
    return (moment - p.now).total_seconds() + DELETION_REQUEUE_BUFFER_SECONDS


def _finished(p: _Pass) -> LifecycleStep:
    """Complete or Failed: the deletion mechanisms (the switch returns here, nothing is written)."""
    if p.selector_mode:
        return p.step(None)
    end = p.time("endTime")
    strategy = p.spec.get("deletionStrategy")
    if kuberay_rules.gate(p.version, "RayJobDeletionPolicy") and strategy is not None:
        if end is None:
            raise ValueError("status.endTime is unset: KubeRay would dereference a nil pointer here")
        if strategy.get("deletionRules") is not None:  # handleDeletionRules
            overdue, next_time = [], None
            for rule in strategy["deletionRules"]:
                condition = rule.get("condition") or {}
                matched = (
                    condition["jobStatus"] == p.get("jobStatus")
                    if condition.get("jobStatus") is not None
                    else condition.get("jobDeploymentStatus") == p.get("jobDeploymentStatus")
                )
                if not matched:
                    continue
                due = end + timedelta(seconds=_int(condition.get("ttlSeconds")))
                if p.now < due:
                    next_time = due if next_time is None or due < next_time else next_time
                elif not _deletion_policy_done(p, str(rule.get("policy"))):
                    overdue.append(str(rule.get("policy")))
            if overdue:  # selectMostImpactfulRule
                order = {"DeleteSelf": 4, "DeleteCluster": 3, "DeleteWorkers": 2, "DeleteNone": 1}
                _execute(p, max(overdue, key=lambda policy: order.get(policy, 0)))
            return p.step(_delay(p, next_time) if next_time is not None else None)
        # handleLegacyDeletionPolicy: only SUCCEEDED and FAILED Ray jobs have a policy.
        which = {"SUCCEEDED": "onSuccess", "FAILED": "onFailure"}.get(p.get("jobStatus"))
        policy = str(((strategy.get(which) or {}).get("policy")) or "DeleteNone") if which else "DeleteNone"
        if policy == "DeleteNone":
            return p.step(None)
        due = end + timedelta(seconds=_int(p.spec.get("ttlSecondsAfterFinished")))
        if due > p.now:
            return p.step(_delay(p, due))
        _execute(p, policy)
        return p.step(None)
    if p.spec.get("shutdownAfterJobFinishes") is True:  # handleShutdownAfterJobFinishes
        if end is None:
            raise ValueError("status.endTime is unset: KubeRay would dereference a nil pointer here")
        due = end + timedelta(seconds=_int(p.spec.get("ttlSecondsAfterFinished")))
        if due > p.now:
            return p.step(_delay(p, due))
        if p.cluster.exists:
            p.actions.append("delete-cluster")  # the submitter Job stays, for its logs
    return p.step(None)


def _backoff_limit(p: _Pass) -> None:
    # checkBackoffLimitAndUpdateStatusIfNeeded (rayjob_controller.go), 1.5.1-1.7.
    failed, succeeded = _int(p.status.get("failed")), _int(p.status.get("succeeded"))
    if p.get("jobDeploymentStatus") == "Failed":
        failed += 1
    if p.get("jobStatus") == "SUCCEEDED" and p.get("jobDeploymentStatus") == "Complete":
        succeeded += 1
    p.status["failed"], p.status["succeeded"] = failed, succeeded
    limit = p.spec.get("backoffLimit")
    if p.get("jobDeploymentStatus") == "Failed" and limit is not None and failed < _int(limit) + 1:
        final = (
            ("DeadlineExceeded", "JobStatusCheckTimeoutExceeded")
            if p.version == "1.7"
            else ("DeadlineExceeded",)
        )
        if p.get("reason") not in final:
            p.put("jobDeploymentStatus", "Retrying")


def _write(p: _Pass) -> dict[str, Any]:
    # updateRayJobStatus (rayjob_controller.go): the status KubeRay stores after this pass.
    changed = any(p.old.get(key) != p.status.get(key) for key in ("jobStatus", "jobDeploymentStatus"))
    changed = changed or (p.old.get("rayClusterStatus") or {}) != (p.status.get("rayClusterStatus") or {})
    if p.version == "1.7":
        changed = changed or p.old.get("jobStatusCheckFailureStartTime") != p.status.get(
            "jobStatusCheckFailureStartTime"
        )
    if not changed:
        return p.old
    p.status.setdefault("rayClusterStatus", {})  # Go marshals these structs even when empty
    p.status.setdefault("rayJobInfo", {})
    if p.get("jobDeploymentStatus") in ("Complete", "Failed"):
        p.put("endTime", format_time(p.now))
    return p.status


DEFAULT_SUBMITTER_BACKOFF_LIMIT = 2
"""``createNewK8sJob`` (rayjob_controller.go, 1.5.1-1.7): the submitter Job's ``backoffLimit`` unless
``spec.submitterConfig.backoffLimit`` sets one."""


def submitter_backoff_limit(rayjob: Json) -> int:
    """The ``backoffLimit`` KubeRay gives the K8sJobMode submitter Job (``createNewK8sJob``, 1.5.1-1.7)."""
    config = (rayjob.get("spec") or {}).get("submitterConfig") or {}
    limit = config.get("backoffLimit")
    return DEFAULT_SUBMITTER_BACKOFF_LIMIT if limit is None else int(limit)


def submitter_job_failed(rayjob: Json, failed_pods: int) -> bool:
    """Whether the submitter Job has failed after ``failed_pods`` of its pods failed.

    The Job controller (kubernetes ``pkg/controller/job/job_controller.go`` ``syncJob``, v1.27-1.35):
    a Job whose pods restart ``Never`` (KubeRay's submitter template) fails with reason
    ``BackoffLimitExceeded`` once ``failed > backoffLimit``, each failed pod counted for the Job's
    whole life. A submitter pod fails whenever its command exits non-zero: KubeRay's command
    (``common/job.go`` ``BuildJobSubmitCommand``) is ``ray job status || ray job submit --no-wait``
    and then ``ray job logs --follow``, which exits non-zero when the log stream's WebSocket
    closes under it; the next pod finds the job submitted and follows its logs again.
    """
    return failed_pods > submitter_backoff_limit(rayjob)


def reconcile_rayjob(
    rayjob: Json, cluster: ClusterObservation, *, now: datetime, version: str = "1.7"
) -> LifecycleStep:
    """One pass of ``RayJobReconciler.Reconcile`` (K8sJobMode) of KubeRay ``version``."""
    kuberay_rules._check_version(version)
    p = _Pass(rayjob, cluster, now, version)
    if str(p.spec.get("submissionMode") or "K8sJobMode") != "K8sJobMode":
        raise ValueError("only K8sJobMode is modelled")
    managed_by = p.spec.get("managedBy")
    if managed_by is not None and managed_by != KUBERAY_CONTROLLER:  # ManagedByExternalController
        return p.step(None)
    if p.metadata.get("deletionTimestamp"):
        if p.get("jobStatus") not in TERMINAL_JOB_STATUSES:
            p.actions.append("stop-ray-job")  # StopJob; its error is only logged
        if FINALIZER in (p.metadata.get("finalizers") or []):
            p.actions.append("remove-finalizer")
        return p.step(DEFAULT_REQUEUE_SECONDS)

    message = kuberay_rules.validate_rayjob(rayjob, version)
    if message is not None:
        p.put("jobDeploymentStatus", "ValidationFailed")
        p.put("reason", "ValidationFailed")
        p.put("message", message)
        return p.step(None, status=_write(p))

    state = p.get("jobDeploymentStatus")
    outcome: str | None = None
    if state == "":
        if FINALIZER not in (p.metadata.get("finalizers") or []):
            p.actions.append("add-finalizer")
        _initialize(p)
    elif state == "Initializing":
        outcome = _initializing(p)
    elif state == "Running":
        outcome = _running(p)
    elif state in ("Suspending", "Retrying"):
        outcome = _releasing(p)
    elif state == "Suspended":
        if p.spec.get("suspend") is True:
            return p.step(DEFAULT_REQUEUE_SECONDS if version == "1.5.1" else None)
        p.put("jobStatus", "")
        p.put("jobDeploymentStatus", "")
    elif state in ("Complete", "Failed"):
        return _finished(p)
    else:  # ValidationFailed, Waiting, anything else: "Unknown JobDeploymentStatus"
        return p.step(DEFAULT_REQUEUE_SECONDS)
    if outcome is REQUEUE:
        return p.step(DEFAULT_REQUEUE_SECONDS)
    if outcome is not None:
        return p.step(DEFAULT_REQUEUE_SECONDS, error=outcome)
    _backoff_limit(p)
    return p.step(DEFAULT_REQUEUE_SECONDS, status=_write(p))
