"""The Events the operator emits on an RLHFJob: a typed catalogue of reasons.

Every Event's ``reason`` is one of :data:`EVENT_REASONS` (a test checks the code and
``docs/operator.md`` against it), so alerts and ``kubectl get events --field-selector
reason=...`` can rely on them. Phase changes use the phase's name as the reason; problems
use the reason of the ``ChildrenReady`` condition they set. Messages never carry secret
values: the spec refers to Secrets by name only, and nothing reads them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal, Protocol

EventType = Literal["Normal", "Warning"]

EVENT_REASONS: Mapping[str, tuple[EventType, str]] = {
    "Pending": ("Normal", "The first attempt's RayJob exists and waits for KubeRay."),
    "Suspended": ("Normal", "spec.suspend is true: the cluster is deleted and nothing runs."),
    "Queued": ("Normal", "The RayJob is held by Kueue until admitted."),
    "Initializing": ("Normal", "KubeRay is starting the attempt's Ray cluster."),
    "Running": ("Normal", "The controller runs in the head pod."),
    "Succeeded": ("Normal", "Training finished."),
    "Retrying": (
        "Warning",
        "An attempt failed; the next one starts after the backoff, from the newest checkpoint.",
    ),
    "StopRequested": (
        "Normal",
        "A pod of the attempt was deleted (a drained node, an eviction): the controller saved its step "
        "and the next attempt resumes after it, not counted against spec.maxRestarts.",
    ),
    "KueueDeactivated": (
        "Warning",
        "Kueue deactivated the job's Workload itself (requeuing limit, maximum execution time, a rejected "
        "admission check) and will not queue it again; the message names the Workload to delete.",
    ),
    "Failed": ("Warning", "The job failed for good; the message says why (the reason is in status.reason)."),
    "InvalidSpec": ("Warning", "The spec cannot run; status condition Validated lists each field."),
    "NameConflict": (
        "Warning",
        "An object with a child's name exists but is not owned by this job's uid; it is never adopted.",
    ),
    "KubeRayMissing": (
        "Warning",
        "The API server has no RayJob resource: install KubeRay (1.5.1 to 1.7) and its CRDs.",
    ),
    "KubeRayUnsupported": (
        "Warning",
        "The installed KubeRay is older than 1.5.1 (its RayJob CRD has no authOptions): upgrade it.",
    ),
    "KueueWorkloadMissing": (
        "Warning",
        "A queued job must be held or released through its Kueue Workload, which does not exist (yet).",
    ),
    "RolloutReplicaReplaced": (
        "Warning",
        "Server mode: a rollout replica died or stalled and was replaced; the attempt went on "
        "(status.rolloutReplicasReplaced counts them, progress.rollout has each replica's health).",
    ),
    "Forbidden": ("Warning", "The operator's ServiceAccount may not make a write it needs (RBAC)."),
    "Invalid": ("Warning", "The API server rejected a child (422); the message names the field."),
    "ApiError": ("Warning", "Any other failed API request (timeouts, 5xx, conflicts); retried with backoff."),
}
"""Reason -> (type, meaning). ``docs/operator.md`` renders this table."""


@dataclass(frozen=True)
class Event:
    """A Kubernetes Event to emit on the RLHFJob; ``reason`` is one of :data:`EVENT_REASONS`."""

    type: EventType
    reason: str
    message: str

    def __post_init__(self) -> None:
        if self.reason not in EVENT_REASONS:
            raise ValueError(
                f"Event reason {self.reason!r} is not in the catalogue (hybridflow_operator.events)"
            )


class FailedRequest(Protocol):
    status: int
    kind: str
    message: str


def api_failure_reason(error: FailedRequest) -> str:
    """The catalogue reason for a failed API request."""
    if error.status == 404 and error.kind == "RayJob":
        return "KubeRayMissing"
    if error.status == 404 and error.kind == "Workload":
        return "KueueWorkloadMissing"
    return {403: "Forbidden", 422: "Invalid"}.get(error.status, "ApiError")
