"""The one level-triggered reconcile of an RLHFJob.

Every trigger (a change of the RLHFJob, a change of one of its RayJobs, the periodic timer) calls
:func:`reconcile` with the RLHFJob as it is now. The function reads what exists, asks the pure
builders and :mod:`hybridflow_operator.status` what should exist, and writes only the
difference, so it can run any number of times: a pass that finds the world as it wants it
writes nothing. In order:

1. parse the spec; a spec the operator cannot run sets ``Validated=False`` naming the fields,
   creates nothing, and stops (the admission schema and CEL rules catch most problems earlier);
2. a finished job: delete it once ``ttlSecondsAfterFinished`` has passed (owner references take
   the children with it), else nothing;
3. read the current attempt's RayJob and compute the desired status;
4. make sure the attempt's children exist: ConfigMap (patched when the spec changed, read by
   the next attempt), ServiceAccount, Role, RoleBinding, and the RayJob when the decision starts
   an attempt (a retry gets a new RayJob and resumes from the checkpoint volume);
5. mirror ``spec.suspend`` onto the running RayJob (Kueue un-suspends queued ones itself);
6. a job failed by its deadline has its RayJob deleted, so the GPUs are released;
7. patch the status (operator-owned keys only) and emit the decision's events.

The result says when to look again for purely time-based transitions (deadline, TTL).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from hybridflow.spec import SpecError, parse_job_manifest
from hybridflow_operator.builders import JobRef, RayJobDefaults, build_children, suspend_update
from hybridflow_operator.cluster import Cluster
from hybridflow_operator.names import rayjob_name
from hybridflow_operator.status import (
    TERMINAL_PHASES,
    ObservedRayJob,
    RLHFJobStatus,
    desired_status,
    invalid_spec_status,
    remaining_deadline_seconds,
    status_patch,
    ttl_remaining_seconds,
)

__all__ = ["ReconcileResult", "reconcile"]


@dataclass(frozen=True)
class ReconcileResult:
    phase: str | None
    writes: int
    recheck_after_seconds: float | None = None
    deleted: bool = False


def _source(body: Mapping[str, Any]) -> str:
    metadata = body.get("metadata") or {}
    return f"RLHFJob {metadata.get('namespace')}/{metadata.get('name')}"


def reconcile(
    body: Mapping[str, Any], cluster: Cluster, defaults: RayJobDefaults, *, now: datetime
) -> ReconcileResult:
    """Converge one RLHFJob (``body`` as read from the API server); see the module docstring."""
    owner = JobRef.from_body(body)
    metadata = body.get("metadata") or {}
    generation = metadata.get("generation")
    current = RLHFJobStatus.from_body(body.get("status"))
    writes = 0

    def finish(
        status: RLHFJobStatus, events: tuple[Any, ...], recheck: float | None = None
    ) -> ReconcileResult:
        nonlocal writes
        patch = status_patch(current, status)
        if patch:
            cluster.patch_job_status(owner.namespace, owner.name, patch)
            writes += 1
        for event in events:
            cluster.emit_event(body, event)
            writes += 1
        return ReconcileResult(status.phase, writes, recheck)

    try:
        job = parse_job_manifest(dict(body), source=_source(body))
    except SpecError as err:
        decision = invalid_spec_status(current, err.problems, now=now, generation=generation)
        return finish(decision.status, decision.events)
    spec = job.spec

    if current.phase in TERMINAL_PHASES:
        remaining = ttl_remaining_seconds(spec, current, now)
        if remaining is not None and remaining <= 0:
            cluster.delete("RLHFJob", owner.namespace, owner.name)
            return ReconcileResult(current.phase, 1, deleted=True)
        return ReconcileResult(current.phase, 0, remaining)

    name = current.ray_job_name or rayjob_name(owner.name, max(current.attempts, 1))
    observed_body = cluster.get("RayJob", owner.namespace, name)
    observed = ObservedRayJob.from_body(observed_body) if observed_body is not None else None
    decision = desired_status(job, current, observed, now=now, generation=generation)
    status = decision.status

    attempt = decision.start_attempt or max(status.attempts, 1)
    children = build_children(
        job,
        owner,
        attempt=attempt,
        defaults=defaults,
        active_deadline_seconds=remaining_deadline_seconds(spec, status, now),
    )
    first_attempt_of_new_job = decision.start_attempt == 1 and not current.conditions
    for child in children:
        kind, child_name = child["kind"], child["metadata"]["name"]
        if kind == "RayJob" and decision.start_attempt is None:
            continue
        if first_attempt_of_new_job:
            # A job never reconciled before has no children yet: create without reading first
            # (a 409 from an earlier, interrupted pass is fine). This is the latency-critical path.
            cluster.create(child)
            writes += 1
            continue
        existing = cluster.get(kind, owner.namespace, child_name)
        if existing is None:
            cluster.create(child)
            writes += 1
        elif kind == "ConfigMap" and existing.get("data") != child["data"]:
            cluster.patch(kind, owner.namespace, child_name, {"data": child["data"]})
            writes += 1

    if observed is not None and status.phase not in TERMINAL_PHASES:
        suspend = suspend_update(spec, observed.suspend)
        if suspend is not None:
            cluster.patch("RayJob", owner.namespace, observed.name, {"spec": {"suspend": suspend}})
            writes += 1
    if (
        observed is not None
        and status.phase == "Failed"
        and status.reason == "DeadlineExceeded"
        and observed.job_deployment_status not in ("Complete", "Failed")
    ):
        cluster.delete("RayJob", owner.namespace, observed.name)
        writes += 1

    recheck: float | None = None
    if spec.active_deadline_seconds is not None and status.start_time is not None:
        recheck = float(remaining_deadline_seconds(spec, status, now) or 0)
    ttl = ttl_remaining_seconds(spec, status, now)
    if ttl is not None:
        recheck = ttl if recheck is None else min(recheck, ttl)
    return finish(status, decision.events, recheck)
