"""Holding a Kueue-queued job through its Workload, never through the RayJob's ``suspend``.

Kueue's job framework owns a queued RayJob's ``suspend`` (``jobframework/reconciler.go``
``ReconcileGenericJob``, Kueue 0.16-0.19): it unsuspends a suspended RayJob whose Workload is
admitted ("Job admitted, unsuspending"), whoever suspended it, and suspends a running one whose
Workload is not. So a suspend the operator wrote there (the user's ``spec.suspend``, a deadline
stop) was undone at once, and the job restarted. What Kueue honours is the Workload's
``spec.active``: false evicts it (reason ``Deactivated``, ``core/workload_controller.go``), Kueue
suspends the RayJob and does not requeue it until ``spec.active`` is true again.

The protocol, per reconcile of a job whose current RayJob carries Kueue's queue label and is not
finished:

1. the Workload should be active unless the user suspended the job or the operator stopped the
   attempt (:func:`wanted_active`);
2. when that differs from the RayJob's :data:`WORKLOAD_ACTIVE_ANNOTATION` record (absent means
   active, as Kueue creates it), the operator finds the Workload (one list by Kueue's
   ``kueue.x-k8s.io/job-uid`` label, :data:`JOB_UID_LABEL`), patches ``spec.active``, and then
   records what it wrote on the RayJob; a Workload not there yet (Kueue has not seen the RayJob)
   is a ``KueueWorkloadMissing`` problem, retried with backoff;
3. the operator never writes such a RayJob's ``suspend``.

A queued job that is suspended before it has a RayJob gets none until it is resumed
(``status.desired_status``): its Workload would start active and be admitted.

Kueue deactivates a Workload itself, too (``core/workload_controller.go``, 0.16-0.19): past
``waitForPodsReady.requeuingStrategy.backoffLimitCount`` (``RequeuingLimitExceeded``), past the
job's ``kueue.x-k8s.io/max-exec-time-seconds`` (``MaximumExecutionTimeExceeded``), or when an
admission check rejects it. It evicts it with reason ``DeactivatedDueTo<cause>`` and never
admits it again: made active again, Kueue 0.19 leaves its ``Requeued`` condition False (it
reactivates only reason ``Deactivated``), so the way out is a new Workload, which Kueue makes
for the suspended RayJob once the old one is deleted. While the operator holds nothing, a pass
over a job whose RayJob Kueue suspended reads its Workload (:func:`observe_workload`), and one
that is inactive puts the job in phase Suspended, saying Kueue's reason and message and that way
out (``status.desired_status``); such a pass also comes every :data:`QUEUED_RECHECK_SECONDS`
while the job waits, for a Workload deactivated before its job ever ran (no RayJob change
announces it).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hybridflow_operator.status import ObservedRayJob, StatusDecision

WORKLOAD_GROUP = "kueue.x-k8s.io"
WORKLOAD_VERSION = "v1beta2"
"""Kueue's storage version from 0.15 on, served by every supported Kueue (v1beta1 still is, deprecated)."""
WORKLOAD_PLURAL = "workloads"
JOB_UID_LABEL = "kueue.x-k8s.io/job-uid"
"""Kueue labels each Workload with the uid of the job it admits (``jobframework`` ``constructWorkload``)."""
SUPPORTED_KUEUE = ("0.16", "0.17", "0.18", "0.19")


def wanted_active(spec_suspend: bool, latest: ObservedRayJob, decision: StatusDecision) -> bool:
    """Whether ``latest``'s Workload should be active: not while the user suspends the job or the
    operator has stopped (or is stopping) the attempt."""
    stopping = decision.stop_rayjob == latest.name or bool(latest.stopped_reason)
    return not (spec_suspend or stopping)


def workload_change(spec_suspend: bool, latest: ObservedRayJob, decision: StatusDecision) -> bool | None:
    """The ``spec.active`` to write onto ``latest``'s Workload, or None (nothing to write, or not Kueue's)."""
    if latest.queue_name is None or latest.finished:
        return None
    wanted = wanted_active(spec_suspend, latest, decision)
    recorded = True if latest.workload_active is None else latest.workload_active
    return None if wanted == recorded else wanted


QUEUED_RECHECK_SECONDS = 300.0
"""How often a pass looks at the Workload of a job Kueue keeps waiting (see the module docstring)."""


@dataclass(frozen=True)
class ObservedWorkload:
    """What a pass reads of a queued RayJob's Workload: whether Kueue keeps it inactive, and why."""

    name: str
    namespace: str
    active: bool
    reason: str
    """The ``Evicted`` condition's reason (``DeactivatedDueToRequeuingLimitExceeded``, ...), or ""."""
    message: str

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> ObservedWorkload:
        metadata = body.get("metadata") or {}
        conditions = (body.get("status") or {}).get("conditions") or []
        evicted: Mapping[str, Any] = next(
            (c for c in conditions if c.get("type") == "Evicted" and c.get("status") == "True"), {}
        )
        return cls(
            name=str(metadata.get("name", "")),
            namespace=str(metadata.get("namespace", "")),
            active=(body.get("spec") or {}).get("active", True) is not False,
            reason=str(evicted.get("reason") or ""),
            message=str(evicted.get("message") or ""),
        )

    def way_out(self) -> str:
        return (
            f"Kueue deactivated Workload {self.name}: {self.message or 'spec.active is false'}. Kueue does "
            "not queue it again; to queue the job again, delete that Workload "
            f"(kubectl delete workload -n {self.namespace} {self.name}) and Kueue makes a new one"
        )


def held_by_kueue(spec_suspend: bool, latest: ObservedRayJob, decision: StatusDecision) -> bool:
    """Whether ``latest`` waits on Kueue alone: queued, suspended by Kueue, not finished, and neither
    held nor being released by the operator (whose last write to the Workload, recorded on the
    RayJob, said active: an inactive Workload is then Kueue's doing)."""
    return (
        latest.queue_name is not None
        and latest.suspend
        and not latest.finished
        and latest.workload_active is not False
        and wanted_active(spec_suspend, latest, decision)
    )
