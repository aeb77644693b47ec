"""The one level-triggered reconcile of an RLHFJob.

Every trigger (a change of the RLHFJob's spec, a change of one of its children, a recheck time
that came due) calls :func:`reconcile` with the RLHFJob and its children as the operator's
caches hold them. The function reads nothing from the API server: it asks the pure builders
and :mod:`hybridflow_operator.status` what should exist, and writes only the difference, so it
can run any number of times: a pass that finds the world as it wants it writes nothing. In order:

1. parse the spec; a spec the operator cannot run sets ``Validated=False`` naming the fields,
   creates nothing, and stops (the admission schema and CEL rules catch most problems earlier);
   a KubeRay older than the minimum (``hybridflow_operator.kuberay``) gets no RayJob either
   (``ChildrenReady=False``, ``KubeRayUnsupported``);
2. sort the observed children: those whose owner reference carries this job's uid are the
   job's; anything else bearing a child's name (a leftover of a deleted job of the same name
   that the garbage collector has not removed yet, or a stranger) is never adopted, counted or
   changed: it is reported (``ChildrenReady=False``, reason ``NameConflict``, a Warning Event);
3. decide the status from the job's own RayJobs (``desired_status``: attempts, phase, retry
   backoff and deadline come from the children, never from the stored status, which the
   workload's controller can write);
4. a finished job is deleted once ``ttlSecondsAfterFinished`` has passed (owner references take
   the children with it); if the delete fails, the job reports it as below and writes no child;
5. make sure the attempt's children exist, in dependency order: ConfigMap (patched when the
   spec changed), ServiceAccount, Role, RoleBinding, NetworkPolicy, then the RayJob when the
   decision starts an attempt. A create answered 409 AlreadyExists reads the object (the one read outside the
   caches): owned by this uid, the cache was only behind and it is taken as the job's; owned by
   anyone else, it is a ``NameConflict``. The first failing write stops the sequence, so a
   RayJob never exists without the RBAC its head pod needs; a later pass finishes what is
   missing. Every failure sets ``ChildrenReady=False`` with the API's reason and message and
   emits one Warning Event (a 404 for RayJob means the KubeRay CRD is missing:
   ``KubeRayMissing``); the caller retries with bounded exponential backoff
   (``ReconcileResult.failed``);
6. stop a RayJob whose deadline passed, or (KubeRay 1.5) whose startup timeout passed (suspend
   it, recording ``hybridflow.io/stopped``: the pods go, the GPUs are released, the record
   stays), and write the RayJob's ``suspend`` only when the user's ``spec.suspend`` differs from
   what the operator last wrote there (a record in the RayJob's annotations). A RayJob with
   Kueue's queue label is never suspended or resumed by the operator: Kueue undoes that; its
   Workload's ``spec.active`` is written instead (``hybridflow_operator.kueue``), then the records.
   Any patch that suspends the RayJob also records the running time counted so far, and so does
   a patch of its own after Kueue suspended it (``hybridflow_operator.status``, "The deadline clock");
7. patch the status (operator-owned keys only, against the status the operator last wrote, so a
   cache that lags behind our own write causes no second write) and emit the decision's events.
   A brand-new job's first status waits for KubeRay's first status of its RayJob, up to
   ``status.PENDING_WRITE_DELAY_SECONDS`` (``StatusDecision.hold_status_seconds``): a Pending
   that KubeRay replaces within a second is a write per job nobody sees.

Every failed request, including the status patch and the Events of step 7, is also returned in
``ReconcileResult.failures``, which the caller logs with the API's reason and counts in its
metrics; a failed status patch cannot leave a condition, so that log line and metric are where
it shows.

The result says when to look again for purely time-based transitions (retry backoff, deadline,
TTL); the caller schedules the job's next pass then.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from hybridflow.spec import SpecError, parse_job_manifest
from hybridflow_operator.builders import JobRef, RayJobDefaults, build_children
from hybridflow_operator.cluster import ApiError, Cluster
from hybridflow_operator.events import Event, api_failure_reason
from hybridflow_operator.kuberay import ASSUMED_CURRENT, KubeRayFeatures
from hybridflow_operator.kueue import (
    QUEUED_RECHECK_SECONDS,
    ObservedWorkload,
    held_by_kueue,
    workload_change,
)
from hybridflow_operator.status import (
    ACTIVE_TIME_ANNOTATION,
    DEFAULT_RETRY_POLICY,
    STOPPED_ANNOTATION,
    TERMINAL_PHASES,
    USER_SUSPEND_ANNOTATION,
    WORKLOAD_ACTIVE_ANNOTATION,
    ObservedRayJob,
    RetryPolicy,
    RLHFJobStatus,
    StatusDecision,
    close_running_period,
    desired_status,
    held_inactive_by_kueue,
    invalid_spec_status,
    remaining_deadline_seconds,
    rollout_replacement_events,
    set_children_ready,
    status_patch,
    ttl_remaining_seconds,
    with_rayjob_created,
)

__all__ = ["ReconcileResult", "owned_by", "reconcile"]


@dataclass(frozen=True)
class ReconcileResult:
    phase: str | None
    writes: int
    recheck_after_seconds: float | None = None
    deleted: bool = False
    failed: bool = False
    """A request failed (see the ``ChildrenReady`` condition and ``failures``): retry with backoff."""
    status: RLHFJobStatus | None = None
    """The status this pass left stored (what it wrote, or found right): the next pass's base."""
    failures: tuple[ApiError, ...] = ()
    """Every request of this pass that failed, in order, for the caller's log and metrics."""
    created: tuple[tuple[str, str], ...] = ()
    """(kind, name) of each child this pass created (answered 201), for the caller's caches."""


def _source(body: Mapping[str, Any]) -> str:
    metadata = body.get("metadata") or {}
    return f"RLHFJob {metadata.get('namespace')}/{metadata.get('name')}"


def owned_by(child: Mapping[str, Any], uid: str) -> bool:
    """True when ``child``'s owner references name the RLHFJob with ``uid`` (names do not count)."""
    refs = (child.get("metadata") or {}).get("ownerReferences") or []
    return any(ref.get("kind") == "RLHFJob" and ref.get("uid") == uid for ref in refs)


def _min(*values: float | None) -> float | None:
    present = [v for v in values if v is not None]
    return min(present) if present else None


def _failure_problem(err: ApiError, doing: str) -> tuple[str, str]:
    """The ``ChildrenReady`` reason and message for a failed request."""
    return api_failure_reason(err), f"{doing}: {err.status} {err.reason}: {err.message}"


def rayjob_patch(
    spec_suspend: bool,
    latest: ObservedRayJob,
    decision: StatusDecision,
    now: datetime,
    *,
    workload_active: bool | None = None,
) -> dict[str, Any] | None:
    """The merge patch of the current, unfinished RayJob this pass needs, or None.

    A stop (deadline; on KubeRay 1.5 a startup timeout) suspends it for good
    (:data:`STOPPED_ANNOTATION` names why, with the running-time record, whose ``periodEnd`` says
    when the job ended). Otherwise the user's ``spec.suspend`` is written when it differs from the
    record of what the operator last wrote (:data:`USER_SUSPEND_ANNOTATION`). A RayJob Kueue queues
    (its queue label) gets the records only, never ``suspend``: Kueue owns that field and undoes
    any other writer's value; the operator holds it through its Workload instead
    (``hybridflow_operator.kueue``), and ``workload_active`` is what this pass wrote there, to be
    recorded. A patch that suspends a RayJob whose running period is not recorded yet records it
    in the same write, and a record the decision asks for (Kueue suspended it) is written on its own.
    """
    if latest.stopped_reason and workload_active is None:
        return None
    queued = latest.queue_name is not None
    annotations: dict[str, str] = {}
    spec: dict[str, Any] = {}
    if latest.stopped_reason:
        pass  # only the Workload record below
    elif decision.stop_rayjob == latest.name:
        annotations[STOPPED_ANNOTATION] = decision.stop_reason
        if not queued:
            spec["suspend"] = True
    elif latest.user_suspend != spec_suspend:
        annotations[USER_SUSPEND_ANNOTATION] = str(spec_suspend).lower()
        if not queued:
            spec["suspend"] = spec_suspend
    if workload_active is not None:
        annotations[WORKLOAD_ACTIVE_ANNOTATION] = str(workload_active).lower()
    stopping = STOPPED_ANNOTATION in annotations  # its record's periodEnd is the job's completionTime
    if stopping or (spec.get("suspend") is True and latest.period_open):
        annotations[ACTIVE_TIME_ANNOTATION] = close_running_period(latest, now).to_annotation()
    elif decision.record_active_time is not None:
        annotations[ACTIVE_TIME_ANNOTATION] = decision.record_active_time.to_annotation()
    if not annotations and not spec:
        return None
    patch: dict[str, Any] = {"metadata": {"annotations": annotations}}
    if spec:
        patch["spec"] = spec
    return patch


def _hold_through_workload(
    cluster: Cluster, namespace: str, latest: ObservedRayJob, active: bool
) -> tuple[str, str] | None:
    """Write ``active`` onto ``latest``'s Kueue Workload; the problem, if it could not."""
    workload = cluster.find_workload(namespace, latest.uid)
    if workload is None:
        return (
            "KueueWorkloadMissing",
            f"RayJob {latest.name} is queued (label kueue.x-k8s.io/queue-name) but Kueue has no Workload for "
            f"it yet; the job is {'released' if active else 'held'} through its Workload once there is one",
        )
    name = str((workload.get("metadata") or {}).get("name"))
    cluster.patch("Workload", namespace, name, {"spec": {"active": active}})
    return None


def _with_workload(
    cluster: Cluster,
    namespace: str,
    latest: ObservedRayJob,
    decision: StatusDecision,
    current: RLHFJobStatus,
    now: datetime,
    failures: list[ApiError],
) -> StatusDecision:
    """``decision`` for a job that waits on Kueue alone, after one look at its Workload: Suspended
    with Kueue's reason when Kueue deactivated it itself, and a look again in a while either way
    (``hybridflow_operator.kueue``). A failed read changes nothing (the next pass reads again)."""
    decision = dataclasses.replace(
        decision, recheck_after_seconds=_min(decision.recheck_after_seconds, QUEUED_RECHECK_SECONDS)
    )
    try:
        body = cluster.find_workload(namespace, latest.uid)
    except ApiError as err:
        failures.append(err)
        return decision
    workload = ObservedWorkload.from_body(body) if body is not None else None
    if workload is None or workload.active:
        return decision
    return held_inactive_by_kueue(decision, current, workload.reason, workload.way_out(), now=now)


def reconcile(
    body: Mapping[str, Any],
    children: Iterable[Mapping[str, Any]],
    cluster: Cluster,
    defaults: RayJobDefaults,
    *,
    now: datetime,
    last_written: RLHFJobStatus | None = None,
    retry_policy: RetryPolicy = DEFAULT_RETRY_POLICY,
    kuberay: KubeRayFeatures = ASSUMED_CURRENT,
) -> ReconcileResult:
    """Converge one RLHFJob; see the module docstring.

    ``kuberay`` is what the installed KubeRay's RayJob CRD serves (``hybridflow_operator.kuberay``).

    ``children`` are the objects of the job's namespace that carry its job label, as cached
    (any kind); ``last_written`` is the status the previous pass of this process left stored,
    used instead of ``body``'s status when the cache has not caught up with that write yet.
    """
    owner = JobRef.from_body(body)
    metadata = body.get("metadata") or {}
    generation = metadata.get("generation")
    stored = RLHFJobStatus.from_body(body.get("status"))
    current = last_written if last_written is not None else stored
    writes = 0
    failures: list[ApiError] = []
    created: list[tuple[str, str]] = []

    def finish(
        status: RLHFJobStatus,
        events: tuple[Event, ...],
        recheck: float | None = None,
        *,
        failed: bool = False,
    ) -> ReconcileResult:
        nonlocal writes
        patch = status_patch(current, status)
        if patch:
            try:
                cluster.patch_job_status(owner.namespace, owner.name, patch)
                writes += 1
            except ApiError as err:
                # No condition can say so (the status is what failed): the caller logs and counts it.
                failures.append(err)
                return ReconcileResult(
                    current.phase,
                    writes,
                    recheck,
                    failed=True,
                    status=None,
                    failures=tuple(failures),
                    created=tuple(created),
                )
        for event in events:
            try:
                cluster.emit_event(body, event)
                writes += 1
            except ApiError as err:
                failures.append(err)
                failed = True  # Events are best effort, but say so: the caller retries with backoff
        return ReconcileResult(
            status.phase,
            writes,
            recheck,
            failed=failed,
            status=status,
            failures=tuple(failures),
            created=tuple(created),
        )

    try:
        job = parse_job_manifest(dict(body), source=_source(body))
    except SpecError as err:
        decision = invalid_spec_status(current, err.problems, now=now, generation=generation)
        return finish(decision.status, decision.events)
    spec = job.spec

    owned: dict[tuple[str, str], Mapping[str, Any]] = {}
    foreign: dict[tuple[str, str], Mapping[str, Any]] = {}
    for child in children:
        key = (str(child.get("kind")), str((child.get("metadata") or {}).get("name")))
        (owned if owned_by(child, owner.uid) else foreign)[key] = child
    attempts = [ObservedRayJob.from_body(c) for (kind, _), c in owned.items() if kind == "RayJob"]
    decision = desired_status(
        job, current, attempts, now=now, generation=generation, retry_policy=retry_policy, kuberay=kuberay
    )
    latest = max(attempts, key=lambda a: a.attempt) if attempts else None
    if latest is not None and held_by_kueue(spec.suspend, latest, decision):
        decision = _with_workload(cluster, owner.namespace, latest, decision, current, now, failures)
    status, replaced = rollout_replacement_events(decision.status)
    events = [*decision.events, *replaced]

    problem: tuple[str, str] | None = None
    retry = False  # a transient miss that sets no condition (an object gone between 409 and read)
    if status.phase in TERMINAL_PHASES:
        remaining = ttl_remaining_seconds(spec, status, now)
        if remaining is not None and remaining <= 0:
            try:
                cluster.delete("RLHFJob", owner.namespace, owner.name)
                return ReconcileResult(status.phase, writes + 1, deleted=True)
            except ApiError as err:
                failures.append(err)
                problem = _failure_problem(
                    err, f"delete RLHFJob {owner.name} (spec.ttlSecondsAfterFinished passed)"
                )

    attempt = decision.start_attempt or max(status.attempts, 1)
    desired = build_children(
        job,
        owner,
        attempt=attempt,
        defaults=defaults,
        active_deadline_seconds=remaining_deadline_seconds(spec, attempts, now),
        kuberay=kuberay,
    )
    to_make = desired if problem is None else []  # the job could not be deleted: make nothing new
    for child in to_make:
        kind, name = child["kind"], child["metadata"]["name"]
        if kind == "RayJob" and decision.start_attempt is None:
            continue
        if kind == "RayJob" and kuberay.installed and not kuberay.supported:
            problem = ("KubeRayUnsupported", kuberay.unsupported_message())
            break
        if (kind, name) in foreign:
            problem = (
                "NameConflict",
                f"{kind} {name} exists but is not owned by this RLHFJob (uid {owner.uid}); it is left "
                "alone and the job waits until it is gone (a leftover of a deleted job of the same name "
                "goes with the garbage collector)",
            )
            break
        existing = owned.get((kind, name))
        try:
            if existing is None:
                if cluster.create(child):
                    writes += 1
                    created.append((kind, name))
                    if kind == "RayJob":
                        status = with_rayjob_created(current, status, now=now)
                    continue
                # 409: the cache has not seen the object yet (our own earlier create), or it is a stranger's.
                existing = cluster.get(kind, owner.namespace, name)
                if existing is None:
                    retry = True  # deleted since the 409: the next pass creates it
                    break
                if not owned_by(existing, owner.uid):
                    problem = (
                        "NameConflict",
                        f"{kind} {name} already exists and is not owned by this RLHFJob (uid {owner.uid}); "
                        "it is left alone",
                    )
                    break
                if kind == "RayJob":
                    status = with_rayjob_created(current, status, now=now)
            if kind == "ConfigMap" and existing.get("data") != child["data"]:
                cluster.patch(kind, owner.namespace, name, {"data": child["data"]})
                writes += 1
        except ApiError as err:
            failures.append(err)
            problem = _failure_problem(err, f"{err.verb} {kind} {name}")
            break

    if problem is None and latest is not None and not latest.finished:
        active = workload_change(spec.suspend, latest, decision)
        try:
            if active is not None:
                problem = _hold_through_workload(cluster, owner.namespace, latest, active)
                writes += problem is None
            patch = (
                rayjob_patch(spec.suspend, latest, decision, now, workload_active=active)
                if problem is None
                else None
            )
            if patch is not None:
                cluster.patch("RayJob", owner.namespace, latest.name, patch)
                writes += 1
        except ApiError as err:
            failures.append(err)
            problem = _failure_problem(err, f"{err.verb} {err.kind} {err.name}")

    status, ready_changed = set_children_ready(current, status, problem, now=now)
    if problem is not None and ready_changed:
        events.append(Event("Warning", problem[0], problem[1]))
    recheck = decision.recheck_after_seconds
    ttl = ttl_remaining_seconds(spec, status, now)
    recheck = _min(recheck, ttl)
    if decision.hold_status_seconds is not None and problem is None and not retry and not events:
        # A new job's first status waits for KubeRay's first word (status.pending_hold_seconds):
        # the pass its RayJob event triggers writes it, or the recheck writes Pending.
        return ReconcileResult(
            status.phase, writes, recheck, status=current, failures=tuple(failures), created=tuple(created)
        )
    return finish(status, tuple(events), recheck, failed=problem is not None or retry)
