"""Identity, labels and owner references shared by every child of an RLHFJob.

Every child carries the same three things, so that deletion cascades and a person (or a
label selector) can find a job's objects: an owner reference to the RLHFJob with
``controller: true`` (the garbage collector deletes the child with the job, and only this
operator manages it) and ``blockOwnerDeletion: true`` (foreground deletion of the job waits
for its children), ``app.kubernetes.io/managed-by: hybridflow-operator``, and
``hybridflow.io/job: <job name>``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hybridflow.spec import API_VERSION, KIND, RLHFJob
from hybridflow_operator.names import job_label_value

MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
MANAGED_BY = "hybridflow-operator"
JOB_LABEL = "hybridflow.io/job"
ATTEMPT_LABEL = "hybridflow.io/attempt"
POOL_LABEL = "hybridflow.io/pool"
"""On worker pods: the resource pool (= KubeRay worker group) the pod belongs to."""
NODE_TYPE_LABEL = "hybridflow.io/node-type"
"""On pods: ``head`` (the controller) or ``worker`` (a pool's GPU node)."""
USER_SUSPEND_ANNOTATION = "hybridflow.io/user-suspend"
"""On a RayJob: the user's ``spec.suspend`` the operator last wrote onto it ("true"/"false").

The operator writes the RayJob's ``suspend`` only when the user's own ``spec.suspend`` differs
from this record, and updates the record in the same patch. Kueue flips ``suspend`` to admit
or preempt a queued RayJob; since that leaves the record alone, the operator never writes
back, so the two never fight over the field."""
STOPPED_ANNOTATION = "hybridflow.io/stopped"
"""On a RayJob: why the operator stopped it (``DeadlineExceeded``, or ``StartupTimeout`` on a
KubeRay without a startup deadline of its own). The operator's own record of its decision,
kept on a child the workload cannot write."""
WORKLOAD_ACTIVE_ANNOTATION = "hybridflow.io/workload-active"
"""On a RayJob that Kueue queues: the ``spec.active`` the operator last wrote onto its Kueue
Workload ("true"/"false"). Kueue undoes a suspend written on an admitted RayJob ("Job admitted,
unsuspending"), so the operator holds a queued job (the user's suspend, a deadline stop) by
deactivating its Workload, and writes that again only when what it wants differs from this
record (``hybridflow_operator.kueue``)."""


@dataclass(frozen=True)
class JobRef:
    """The RLHFJob as an owner: where it lives and its uid, the facts the API server assigned."""

    namespace: str
    name: str
    uid: str

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> JobRef:
        """Read the identity from the RLHFJob object as the API server returns it."""
        metadata = body.get("metadata") or {}
        missing = [key for key in ("namespace", "name", "uid") if not metadata.get(key)]
        if missing:
            raise ValueError(
                f"RLHFJob metadata lacks {', '.join(missing)}; children need an owner with all three"
            )
        return cls(namespace=str(metadata["namespace"]), name=str(metadata["name"]), uid=str(metadata["uid"]))

    @classmethod
    def of(cls, job: RLHFJob) -> JobRef:
        """The identity of a parsed job; its metadata keeps the server-set ``uid`` as an extra field."""
        return cls.from_body({"metadata": job.metadata.model_dump(by_alias=True)})


def owner_reference(owner: JobRef) -> dict[str, Any]:
    """The owner reference every child carries (see the module docstring)."""
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": owner.name,
        "uid": owner.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def job_labels(owner: JobRef) -> dict[str, str]:
    """Labels that mark an object as this job's child."""
    return {MANAGED_BY_LABEL: MANAGED_BY, JOB_LABEL: job_label_value(owner.name)}


def child_metadata(name: str, owner: JobRef, labels: Mapping[str, str] | None = None) -> dict[str, Any]:
    """``metadata`` of a child named ``name``: namespace, labels (the job's, then ``labels``), owner.

    The job's own labels win a clash with ``labels`` (which may come from the user's
    ``schedulerLabels``), so a child can never be relabelled out of its job.
    """
    merged = job_labels(owner)
    for key, value in (labels or {}).items():
        merged.setdefault(key, value)
    return {
        "name": name,
        "namespace": owner.namespace,
        "labels": merged,
        "ownerReferences": [owner_reference(owner)],
    }
