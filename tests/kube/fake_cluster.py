"""An in-memory cluster for the pure reconcile: the API as the operator's ``Cluster`` protocol sees it.

Objects by (kind, name) in one namespace; every write counted; as strict as the API server on
names (409 on a second create). Tests play KubeRay on it (:meth:`FakeCluster.kuberay`) and run
passes (:meth:`FakeCluster.pass_`). Shared by the reconcile tests and the manifest fuzzer, which
reconciles every accepted manifest on it.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from hybridflow_operator.builders import RayJobDefaults
from hybridflow_operator.cluster import ApiError
from hybridflow_operator.reconcile import reconcile

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
    """Objects by (kind, name) in one namespace; counts every write; as strict as the API server on names.

    ``fail`` maps a (verb, kind) to the ApiError the next such request raises (and keeps raising).
    """

    def __init__(self, job: dict[str, Any]) -> None:
        self.objects: dict[tuple[str, str], dict[str, Any]] = {("RLHFJob", job["metadata"]["name"]): job}
        self.writes = 0
        self.events: list[tuple[str, str]] = []
        self.fail: dict[tuple[str, str], ApiError] = {}
        self.written: Any = None
        self.reads = 0

    @property
    def job(self) -> dict[str, Any]:
        return next(v for (k, _), v in self.objects.items() if k == "RLHFJob")

    def _check(self, verb: str, kind: str) -> None:
        if (verb, kind) in self.fail:
            raise self.fail[(verb, kind)]

    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        """Counted: the reconcile reads from its caches, and from the API server only after a 409."""
        self._check("get", kind)
        self.reads += 1
        found = self.objects.get((kind, name))
        return copy.deepcopy(found) if found is not None else None

    def create(self, obj: Mapping[str, Any]) -> bool:
        self._check("create", obj["kind"])
        key = (obj["kind"], obj["metadata"]["name"])
        if key in self.objects:
            return False
        self.writes += 1
        created = copy.deepcopy(dict(obj))
        created["metadata"].update(
            creationTimestamp=T0.isoformat(), generation=1, uid=f"uid-{obj['kind']}-{obj['metadata']['name']}"
        )
        self.objects[key] = created
        return True

    def patch(self, kind: str, namespace: str, name: str, patch: Mapping[str, Any]) -> None:
        self._check("patch", kind)
        self.writes += 1
        target = self.objects[(kind, name)]
        spec = copy.deepcopy(target.get("spec"))
        merge(target, patch)
        if target.get("spec") != spec:  # as the API server: the generation grows on spec changes
            target["metadata"]["generation"] = target["metadata"].get("generation", 1) + 1

    def delete(self, kind: str, namespace: str, name: str) -> None:
        self._check("delete", kind)
        self.writes += 1
        self.objects.pop((kind, name), None)

    def patch_job_status(self, namespace: str, name: str, status: Mapping[str, Any]) -> None:
        self._check("patch", "RLHFJob/status")
        self.writes += 1
        merge(self.objects[("RLHFJob", name)].setdefault("status", {}), status)

    def find_workload(self, namespace: str, job_uid: str) -> dict[str, Any] | None:
        """Kueue's Workload of the RayJob with ``job_uid`` (its ``kueue.x-k8s.io/job-uid`` label)."""
        self._check("list", "Workload")
        self.reads += 1
        for (kind, _), obj in self.objects.items():
            labels = obj["metadata"].get("labels") or {}
            if kind == "Workload" and labels.get("kueue.x-k8s.io/job-uid") == job_uid:
                return copy.deepcopy(obj)
        return None

    def get_crd(self, name: str) -> dict[str, Any] | None:
        return None

    def list_children(self, namespaces: Any, label_selector: str, kinds: Any = None) -> list[dict[str, Any]]:
        return [c for c in self.children() if kinds is None or c["kind"] in kinds]

    def list_jobs(self, namespaces: Any) -> list[dict[str, Any]]:
        return [copy.deepcopy(v) for (k, _), v in self.objects.items() if k == "RLHFJob"]

    def emit_event(self, job: Mapping[str, Any], event: Any) -> None:
        self._check("create", "Event")
        self.writes += 1
        self.events.append((event.type, event.reason))

    def kuberay(
        self,
        name: str,
        deployment: str,
        job_status: str = "",
        reason: str = "",
        message: str = "",
        end: datetime | None = None,
        start: datetime = T0,
    ) -> None:
        """Play KubeRay: set the RayJob's status as its controller would (``start``: the startTime
        KubeRay sets each time it initializes the RayJob, after creation and after each resume)."""
        status = {
            "jobDeploymentStatus": deployment,
            "jobStatus": job_status,
            "reason": reason,
            "message": message,
            "startTime": start.isoformat(),
        }
        if end is not None:
            status["endTime"] = end.isoformat()
        self.objects[("RayJob", name)]["status"] = status

    def children(self) -> list[dict[str, Any]]:
        return [copy.deepcopy(v) for (k, _), v in self.objects.items() if k != "RLHFJob"]

    def pass_(self, now: datetime = T0, children: list[dict[str, Any]] | None = None) -> int:
        """One reconcile at ``now`` over ``children`` as cached (default: all of them, up to date)."""
        before = self.writes
        if ("RLHFJob", self.job["metadata"]["name"]) in self.objects:
            cached = self.children() if children is None else children
            self.result = reconcile(copy.deepcopy(self.job), cached, self, DEFAULTS, now=now)
        return self.writes - before
