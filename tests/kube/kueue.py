"""A test-only stand-in for Kueue's job framework as it handles queued RayJobs (Kueue 0.16-0.19).

Written from Kueue's published Go source (tags v0.16.9, v0.17.8, v0.18.6, v0.19.2); every rule
below names the function and file it follows. It is a model of observable behaviour, not a
port: one cluster queue, one resource flavor; priorities only as WorkloadPriorityClass values
ordering the queue (no automatic preemption: a test evicts); admission checks only as a
rejection a test injects; waitForPodsReady's timeout and requeue backoff, without its
recovery timeout; no cohorts, topology, partial admission or elastic jobs.

Kueue's own decisions it makes as Kueue does: the Workload's pod sets (unique names, at most
MaxPodSets per version); ``IsActive`` of a RayJob (not Suspended or New, so a suspended job's
quota is released once KubeRay says Suspended, its pods' termination notwithstanding);
``IsOnHold`` from 0.18; deactivating a Workload itself (maximum execution time, the requeuing
limit, a rejected admission check) with reason ``DeactivatedDueTo<cause>``, after which making
it active again does not requeue it (0.19.2 reactivates only reason ``Deactivated``).

What it serves (:func:`register_kueue`)
    The ``Workload`` resource, ``kueue.x-k8s.io/v1beta2``, with its ``status`` subresource.
    Kueue 0.16, 0.17, 0.18 and 0.19 all serve two Workload versions (their CRD
    ``config/components/crd/bases/kueue.x-k8s.io_workloads.yaml``, converted by a webhook):
    ``v1beta1`` (served, not stored, marked deprecated) and ``v1beta2`` (served and stored).
    **An operator should patch ``spec.active`` through ``v1beta2``**: the one version every
    release from 0.16 to 0.19 serves without a deprecation warning, and the storage version
    (0.15 served it too, but stored v1beta1; v1beta2 does not exist before 0.15).
    ``spec.active`` and ``spec.queueName`` have the same names and meaning in both versions. The
    double serves v1beta2 only: the emulator keeps each registered version in a store of its
    own (no conversion), so serving v1beta1 too would show an empty, unrelated collection.

How to find a RayJob's Workload
    One LIST in the RayJob's namespace with the label selector
    ``kueue.x-k8s.io/job-uid=<RayJob metadata.uid>`` (``ConstructWorkload`` in
    ``jobframework/reconciler.go`` sets it on every Workload it creates, 0.16-0.19). Its name is
    :func:`workload_name` (``GetWorkloadNameForOwnerWithGVK``, ``jobframework/workload_names.go``):
    ``rayjob-<name>-<first 5 hex of sha1("RayJob\\nray.io\\n<name>\\n<uid>")>``, the prefix cut
    to 247 characters (to 57 with the alpha ``ShortWorkloadNames`` gate, off by default). The
    Workload's controller owner reference names the RayJob.

The controller (:class:`KueueStandIn`)
    Polls RayJobs and Workloads of one namespace, as an admin client, and per pass runs, in
    order: the workload controller (``spec.active``), the job reconciler
    (``ReconcileGenericJob`` for a top-level job) and the scheduler (quota in GPUs).

The webhook (:func:`kueue_rayjob_webhook`)
    ``RayJobWebhook.ValidateCreate``/``ValidateUpdate`` (``jobs/rayjob/rayjob_webhook.go``) for
    one Kueue version, as a :class:`ValidatingWebhook` for the emulator. Denial messages are
    this module's own wording, one ``<field path>: <problem>`` per fault; the field paths are
    Kueue's. Kueue's defaulting webhook (which suspends a queued RayJob created unsuspended)
    is not modelled; the controller suspends such a job instead, as Kueue's reconciler does.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import re
import threading
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from typing import Any, Final

import kmock
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from kube.emulator import ValidatingWebhook

JsonObject = dict[str, Any]

GROUP: Final = "kueue.x-k8s.io"
WORKLOAD_VERSION: Final = "v1beta2"
WORKLOAD_PLURAL: Final = "workloads"
QUEUE_LABEL: Final = "kueue.x-k8s.io/queue-name"
JOB_UID_LABEL: Final = "kueue.x-k8s.io/job-uid"
PODSET_LABEL: Final = "kueue.x-k8s.io/podset"
PRIORITY_CLASS_LABEL: Final = "kueue.x-k8s.io/priority-class"
MAX_EXEC_TIME_LABEL: Final = "kueue.x-k8s.io/max-exec-time-seconds"
ELASTIC_JOB_ANNOTATION: Final = "kueue.x-k8s.io/elastic-job"
RESOURCE_IN_USE_FINALIZER: Final = "kueue.x-k8s.io/resource-in-use"
GPU: Final = "nvidia.com/gpu"
WEBHOOK_NAME: Final = "vrayjob.kb.io"  # the +kubebuilder:webhook marker in rayjob_webhook.go

# jobframework.MaxPodSets (jobframework/constants.go from 0.18) and the Workload CRD's
# spec.podSets maxItems: 8 in 0.16 and 0.17, 10 in 0.18, 18 in 0.19.
MAX_POD_SETS: Final = {(0, 16): 8, (0, 17): 8, (0, 18): 10, (0, 19): 18}
# Reasons (apis/kueue/v1beta2/workload_types.go, 0.19; the same strings in 0.16-0.18).
EVICTED_BY_PREEMPTION: Final = "Preempted"
EVICTED_BY_NODE_FAILURES: Final = "NodeFailures"
EVICTED_BY_PODS_READY_TIMEOUT: Final = "PodsReadyTimeout"
EVICTED_BY_ADMISSION_CHECK: Final = "AdmissionCheck"
DEACTIVATED: Final = "Deactivated"
REACTIVATED: Final = "Reactivated"
BACKOFF_FINISHED: Final = "BackoffFinished"
DEACTIVATION_TARGET: Final = "DeactivationTarget"
REQUEUING_LIMIT_EXCEEDED: Final = "RequeuingLimitExceeded"
MAXIMUM_EXECUTION_TIME_EXCEEDED: Final = "MaximumExecutionTimeExceeded"
# What RestorePodSpec (pkg/podset/podset.go) puts back on a stopped job's pod templates.
RESTORED_FIELDS: Final = (
    ("metadata", "labels"),
    ("metadata", "annotations"),
    ("spec", "nodeSelector"),
    ("spec", "tolerations"),
    ("spec", "schedulingGates"),
)
# The submitter KubeRay adds (rayjob_controller.go defaultSubmitterResources, getSubmitterTemplate, 0.19).
SUBMITTER_CONTAINER: Final = "ray-job-submitter"
SUBMITTER_RESOURCES: Final = {
    "requests": {"cpu": "500m", "memory": "200Mi"},
    "limits": {"cpu": "1", "memory": "1Gi"},
}

_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


def parse_kueue_version(text: str) -> tuple[int, int]:
    """``"0.19"`` or ``"v0.19.2"`` as ``(0, 19)``; only the releases modelled here."""
    parts = text.removeprefix("v").split(".")
    version = (int(parts[0]), int(parts[1]))
    if version not in MAX_POD_SETS:
        raise ValueError(f"Kueue {text} is not modelled (0.16 to 0.19 are)")
    return version


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def owner_workload_name(name: str, uid: str, kind: str, group: str) -> str:
    # GetWorkloadNameForOwnerWithGVK -> GenerateWorkloadNameWithExtra (workload_names.go, 0.19;
    # generateWorkloadName in 0.16, same result): lowercased kind + "-" + name, cut to 253-1-5,
    # then "-" and 5 hex digits of sha1 over kind, group, name and uid, newline-separated.
    digest = hashlib.sha1(f"{kind}\n{group}\n{name}\n{uid}".encode(), usedforsecurity=False).hexdigest()
    return f"{f'{kind.lower()}-{name}'[:247]}-{digest[:5]}"


def workload_name(rayjob_name: str, rayjob_uid: str) -> str:
    """The name Kueue gives a RayJob's Workload (``GetWorkloadNameForRayJob``, rayjob_controller.go)."""
    return owner_workload_name(rayjob_name, rayjob_uid, "RayJob", "ray.io")


def register_kueue(emulator: Any) -> kmock.resource:
    """Serve Workloads (``kueue.x-k8s.io/v1beta2``, status subresource) on an ``ApiServerEmulator``.

    No schema: Kueue's CRD is not copied. The API server's default ``spec.active: true`` is
    written by the stand-in itself. ClusterQueues and LocalQueues are not served; every queue
    name maps to the stand-in's one cluster queue.
    """
    resource: kmock.resource = emulator.register_custom_resource(
        group=GROUP,
        version=WORKLOAD_VERSION,
        plural=WORKLOAD_PLURAL,
        kind="Workload",
        subresources={"status"},
    )
    return resource


# --- conditions (apimeta.SetStatusCondition semantics) ------------------------------------------


def condition(obj: JsonObject, kind: str) -> JsonObject | None:
    return next((c for c in (obj.get("status") or {}).get("conditions") or [] if c.get("type") == kind), None)


def is_true(obj: JsonObject, kind: str) -> bool:
    found = condition(obj, kind)
    return found is not None and found.get("status") == "True"


def _set_condition(
    conditions: list[JsonObject], kind: str, status: bool, reason: str, message: str, generation: int
) -> None:
    # k8s.io/apimachinery meta.SetStatusCondition: lastTransitionTime moves only when the
    # status flips; reason, message and observedGeneration are overwritten.
    value = "True" if status else "False"
    for index, existing in enumerate(conditions):
        if existing.get("type") == kind:
            moved = existing.get("status") != value
            conditions[index] = {
                **existing,
                "status": value,
                "reason": reason,
                "message": message,
                "observedGeneration": generation,
                "lastTransitionTime": _now() if moved else existing.get("lastTransitionTime", _now()),
            }
            return
    conditions.append(
        {
            "type": kind,
            "status": value,
            "reason": reason,
            "message": message,
            "observedGeneration": generation,
            "lastTransitionTime": _now(),
        }
    )


def _reset_if_true(conditions: list[JsonObject], kind: str, reason: str, generation: int) -> None:
    # resetActiveCondition (pkg/workload/workload.go, 0.19): a True condition becomes False.
    for existing in conditions:
        if existing.get("type") == kind and existing.get("status") == "True":
            _set_condition(
                conditions, kind, False, reason, f"Previously: {existing.get('message', '')}", generation
            )


# --- RayJob as a GenericJob (jobs/rayjob/rayjob_controller.go, 0.19) --------------------------


def rayjob_active(rayjob: JsonObject) -> bool:
    # RayJob.IsActive: pods may exist unless jobDeploymentStatus is Suspended or New ("").
    return (rayjob.get("status") or {}).get("jobDeploymentStatus", "") not in ("", "Suspended")


def rayjob_finished(rayjob: JsonObject) -> tuple[bool, bool, str]:
    # RayJob.Finished: (finished, succeeded, message) from KubeRay's status.
    status = rayjob.get("status") or {}
    finished = status.get("jobDeploymentStatus") in ("Complete", "Failed")
    return finished, status.get("jobStatus") == "SUCCEEDED", str(status.get("message") or "")


def _submitter_template(rayjob: JsonObject) -> JsonObject:
    # getSubmitterTemplate (rayjob_controller.go): the RayJob's, else KubeRay's default
    # submitter with the head's image.
    spec = rayjob["spec"]
    if spec.get("submitterPodTemplate") is not None:
        return copy.deepcopy(spec["submitterPodTemplate"])
    head = spec["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    return {
        "spec": {
            "containers": [
                {"name": SUBMITTER_CONTAINER, "image": head.get("image"), "resources": SUBMITTER_RESOURCES}
            ],
            "restartPolicy": "Never",
        }
    }


def rayjob_pod_sets(rayjob: JsonObject) -> list[JsonObject]:
    """The Workload pod sets Kueue derives from a RayJob: ``head`` (1), one per worker group
    (replicas x numOfHosts) and, in K8sJobMode, ``submitter`` (1).

    ``RayJob.PodSets`` -> ``raycluster.BuildPodSets`` (raycluster/common.go) and
    ``addSubmitterPodSet``/``addSidecarSubmitterToHeadPodSet`` (rayjob_controller.go), 0.19;
    the same pod sets in 0.16-0.18. Not modelled: the autoscaler and Redis-cleanup
    containers Kueue adds to the head's requests.
    """
    spec = rayjob["spec"]
    cluster = spec["rayClusterSpec"]
    head = copy.deepcopy(cluster["headGroupSpec"]["template"])
    mode = spec.get("submissionMode") or "K8sJobMode"  # the RayJob CRD's default
    if mode == "SidecarMode":
        head.setdefault("spec", {}).setdefault("containers", []).append(
            {"name": SUBMITTER_CONTAINER, "resources": SUBMITTER_RESOURCES}
        )
    pod_sets = [{"name": "head", "count": 1, "template": head}]
    for group in cluster.get("workerGroupSpecs") or []:
        # effectiveWorkerCount: replicas (1 when unset) times numOfHosts when above 1.
        count = int(group.get("replicas", 1)) * max(int(group.get("numOfHosts", 1)), 1)
        pod_sets.append(
            {"name": group["groupName"], "count": count, "template": copy.deepcopy(group["template"])}
        )
    if mode == "K8sJobMode":
        pod_sets.append({"name": "submitter", "count": 1, "template": _submitter_template(rayjob)})
    return pod_sets


def _container_gpus(container: JsonObject) -> int:
    resources = container.get("resources") or {}
    # Requests, or the limits they default to for an extended resource.
    value = (resources.get("requests") or {}).get(GPU, (resources.get("limits") or {}).get(GPU, 0))
    return int(str(value))


def pod_set_gpus(pod_set: JsonObject) -> int:
    """GPUs a pod set needs: count x the pod's effective request (the larger of the containers'
    sum and the largest init container, as the scheduler counts a pod)."""
    spec = pod_set["template"].get("spec") or {}
    main = sum(_container_gpus(c) for c in spec.get("containers") or [])
    init = max((_container_gpus(c) for c in spec.get("initContainers") or []), default=0)
    return int(pod_set["count"]) * max(main, init)


@dataclasses.dataclass(frozen=True)
class WaitForPodsReady:
    """Kueue's ``waitForPodsReady`` configuration (``apis/config/v1beta2``, 0.16-0.19): an admitted
    Workload whose job's pods are not all ready within ``timeout_seconds`` of its admission is
    evicted (``PodsReadyTimeout``) and requeued after ``backoff_base_seconds * 2^(n-1)`` (at most
    ``backoff_max_seconds``); once ``backoff_limit_count`` requeues are spent Kueue deactivates it
    itself (``RequeuingLimitExceeded``). ``requeuingStrategy.timestamp`` and ``recoveryTimeout`` are
    not modelled (their defaults: Eviction, none)."""

    timeout_seconds: float = 300.0
    backoff_limit_count: int | None = None
    backoff_base_seconds: float = 60.0
    backoff_max_seconds: float = 3600.0


def _since(text: str | None) -> float:
    """Seconds since a condition's ``lastTransitionTime`` (RFC 3339, whole seconds)."""
    if not text:
        return 0.0
    moment = datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC)
    return (datetime.now(UTC) - moment).total_seconds()


def workload_refusal(pod_sets: list[JsonObject], version: tuple[int, int]) -> str | None:
    """Why the API server refuses a Workload with ``pod_sets``, or None: the Workload CRD's
    ``spec.podSets`` is ``+listType=map`` keyed by ``name`` (two pod sets of one name are a
    duplicate key) with ``MaxItems`` MaxPodSets (``apis/kueue/v1beta2/workload_types.go``,
    0.16-0.19). Kueue's create fails, and it tries again each pass: the job stays suspended."""
    names = [str(p["name"]) for p in pod_sets]
    duplicated = sorted({name for name in names if names.count(name) > 1})
    if duplicated:
        return f"spec.podSets: Duplicate value: pod sets named {duplicated} (the list is keyed by name)"
    limit = MAX_POD_SETS[version]
    if len(pod_sets) > limit:
        return f"{len(pod_sets)} pod sets, the Workload holds at most {limit}"
    return None


def rayjob_on_hold(rayjob: JsonObject, version: tuple[int, int]) -> bool:
    """``RayJob.IsOnHold`` (``jobs/rayjob/rayjob_controller.go``): from 0.18 a RayJob KubeRay marked
    ValidationFailed is on hold, and its Workload's quota is released (``ReconcileGenericJob`` step
    2). Before 0.18 there is no such method: the job is neither finished nor inactive
    (:func:`rayjob_active`), so its admitted Workload keeps its quota for as long as it exists."""
    status = (rayjob.get("status") or {}).get("jobDeploymentStatus")
    return version >= (0, 18) and status == "ValidationFailed"


def _on_hold(workload: JsonObject) -> bool:
    # workload.IsOnHold (pkg/workload/workload.go, 0.19): QuotaReserved False with reason OnHold; the
    # workload controller keeps such a Workload out of the queues (its Update handler), so the
    # scheduler never sees it again until the reason changes.
    found = condition(workload, "QuotaReserved")
    return found is not None and found.get("status") == "False" and found.get("reason") == "OnHold"


def workload_gpus(workload: JsonObject) -> int:
    return sum(pod_set_gpus(p) for p in workload["spec"]["podSets"])


def _template_paths(spec: JsonObject) -> list[tuple[str, JsonObject]]:
    """Each pod set's template inside a RayJob spec, by pod set name (head, workers, submitter)."""
    cluster = spec["rayClusterSpec"]
    found = [("head", cluster["headGroupSpec"]["template"])]
    found += [(g["groupName"], g["template"]) for g in cluster.get("workerGroupSpecs") or []]
    if (spec.get("submissionMode") or "K8sJobMode") == "K8sJobMode" and spec.get("submitterPodTemplate"):
        found.append(("submitter", spec["submitterPodTemplate"]))
    return found


def merge_diff(old: Any, new: Any) -> Any:
    """A JSON merge patch from ``old`` to ``new`` (what controller-runtime's ``MergeFrom`` sends)."""
    if not isinstance(old, dict) or not isinstance(new, dict):
        return new
    patch: JsonObject = {key: None for key in old if key not in new}
    for key, value in new.items():
        if key not in old:
            patch[key] = value
        elif old[key] != value:
            patch[key] = merge_diff(old[key], value)
    return patch


# --- the webhook (jobs/rayjob/rayjob_webhook.go, raycluster/common.go, jobframework/validation.go)


def _queue_name(obj: JsonObject | None) -> str:
    # jobframework.QueueNameForObject: the queue-name label only (0.16-0.19).
    return ((obj or {}).get("metadata", {}).get("labels") or {}).get(QUEUE_LABEL, "")


def _label(obj: JsonObject, key: str) -> str | None:
    value: str | None = (obj.get("metadata", {}).get("labels") or {}).get(key)
    return value


def _elastic(obj: JsonObject, version: tuple[int, int]) -> bool:
    # workloadslicing.Enabled: the annotation "true" and the ElasticJobsViaWorkloadSlices gate,
    # alpha (off) until 0.17, beta (on) from 0.18 (pkg/features/kube_features.go).
    annotated = (obj.get("metadata", {}).get("annotations") or {}).get(ELASTIC_JOB_ANNOTATION) == "true"
    return annotated and version >= (0, 18)


def _validate_create(job: JsonObject, version: tuple[int, int]) -> list[str]:
    # RayJobWebhook.validateCreate (rayjob_webhook.go; identical in 0.16-0.19). Only queued
    # jobs are checked (manageJobsWithoutQueueName is false by default).
    errors: list[str] = []
    if _queue_name(job):
        spec = job.get("spec") or {}
        selector, cluster = bool(spec.get("clusterSelector")), spec.get("rayClusterSpec")
        if selector and cluster is not None:
            return ["spec.clusterSelector: a queued RayJob must bring its own cluster, not select one"]
        if selector:
            return []  # an existing cluster: Kueue does not manage the job (RayJob.Skip)
        if cluster is None:
            return ["spec.rayClusterSpec: required for a queued RayJob without clusterSelector"]
        if not spec.get("shutdownAfterJobFinishes"):
            errors.append(
                "spec.shutdownAfterJobFinishes: must be true (the cluster holds quota until deleted)"
            )
        errors += _validate_cluster(job, cluster, version)
    # jobframework.ValidateJobOnCreate -> ValidateQueueName, validateCreateForMaxExecTime.
    queue = _label(job, QUEUE_LABEL)
    if queue is not None and (len(queue) > 253 or not _DNS_SUBDOMAIN.match(queue)):
        errors.append(f"metadata.labels[{QUEUE_LABEL}]: {queue!r} is not a DNS-1123 subdomain")
    limit = _label(job, MAX_EXEC_TIME_LABEL)
    if limit is not None and not (limit.lstrip("-").isdigit() and int(limit) > 0):
        errors.append(f"metadata.labels[{MAX_EXEC_TIME_LABEL}]: {limit!r} is not a positive integer")
    return errors


def _validate_cluster(job: JsonObject, cluster: JsonObject, version: tuple[int, int]) -> list[str]:
    # raycluster.ValidateCreate (raycluster/common.go).
    errors: list[str] = []
    if cluster.get("enableInTreeAutoscaling") and not _elastic(job, version):
        errors.append(
            "spec.rayClusterSpec.enableInTreeAutoscaling: autoscaling needs an elastic job"
            f" ({ELASTIC_JOB_ANNOTATION}: 'true', Kueue 0.18 or later)"
        )
    groups = cluster.get("workerGroupSpecs") or []
    # 0.16/0.17: at most 7 worker groups ("8 - 1"); 0.18+: workers + head <= MaxPodSets. The
    # K8sJobMode submitter pod set is not counted by either, though the Workload holds it too.
    pod_sets, limit = len(groups) + 1, MAX_POD_SETS[version]
    if pod_sets > limit:
        errors.append(
            f"spec.rayClusterSpec.workerGroupSpecs: {len(groups)} worker groups and the head make"
            f" {pod_sets} pod sets, Kueue {version[0]}.{version[1]} allows {limit}"
        )
    for index, group in enumerate(groups):
        if group.get("groupName") == "head":
            errors.append(
                f"spec.rayClusterSpec.workerGroupSpecs[{index}].groupName: 'head' is the head's pod set name"
            )
    return errors


def _validate_update(old: JsonObject, new: JsonObject) -> list[str]:
    # jobframework.ValidateJobOnUpdate (validation.go, 0.16-0.19): validateUpdateForQueueName
    # (the default-LocalQueue rule is not modelled: no LocalQueues), validateUpdateForMaxExecTime,
    # ValidateUpdateForWorkloadPriorityClassName, validatedUpdateForEnabledWorkloadSlice.
    errors: list[str] = []
    new_suspended, old_suspended = bool(new["spec"].get("suspend")), bool(old["spec"].get("suspend"))
    if not new_suspended and _queue_name(new) != _queue_name(old):
        errors.append(f"metadata.labels[{QUEUE_LABEL}]: cannot change while the job is not suspended")
    if (not new_suspended or not old_suspended) and _label(new, MAX_EXEC_TIME_LABEL) != _label(
        old, MAX_EXEC_TIME_LABEL
    ):
        errors.append(f"metadata.labels[{MAX_EXEC_TIME_LABEL}]: cannot change unless the job stays suspended")
    old_class, new_class = _label(old, PRIORITY_CLASS_LABEL) or "", _label(new, PRIORITY_CLASS_LABEL) or ""
    if not new_suspended and not old_class and new_class:
        errors.append(
            f"metadata.labels[{PRIORITY_CLASS_LABEL}]: cannot be added to a job that is not suspended"
        )
    if old_class and not new_class:
        errors.append(f"metadata.labels[{PRIORITY_CLASS_LABEL}]: cannot be removed")

    def annotated(obj: JsonObject) -> bool:
        return (obj.get("metadata", {}).get("annotations") or {}).get(ELASTIC_JOB_ANNOTATION) == "true"

    if annotated(old) != annotated(new):
        errors.append(f"metadata.annotations[{ELASTIC_JOB_ANNOTATION}]: immutable")
    return errors


def kueue_rayjob_webhook(kueue_version: str = "0.19") -> ValidatingWebhook:
    """Kueue's validating webhook for RayJobs (``vrayjob.kb.io``) as the given release runs it.

    CREATE: ``RayJobWebhook.ValidateCreate``. UPDATE: ``ValidateUpdate``, i.e. the update rules
    plus the create rules on the new object; in 0.16/0.17 only when the new object has a queue
    name, from 0.18 also when the old one had (``ShouldValidateRayOrSparkJobOnUpdate``, the
    ``ValidateRayAndSparkJobUpdates`` gate, beta and on), so only 0.18+ refuses removing the
    queue label from a running job. Not modelled: prebuilt workloads, topology requests,
    ``manageJobsWithoutQueueName``.
    """
    version = parse_kueue_version(kueue_version)

    def check(new: JsonObject, old: JsonObject | None) -> str | None:
        if old is None:
            errors = _validate_create(new, version)
        elif _queue_name(new) or (version >= (0, 18) and _queue_name(old)):
            errors = _validate_update(old, new) + _validate_create(new, version)
        else:
            errors = []
        return "; ".join(errors) or None

    return ValidatingWebhook(
        name=WEBHOOK_NAME, resources={"rayjobs"}, operations={"CREATE", "UPDATE"}, check=check
    )


# --- the controller ------------------------------------------------------------------------------


def _owner_name(workload: JsonObject) -> str | None:
    for ref in workload["metadata"].get("ownerReferences") or []:
        if ref.get("controller") and ref.get("kind") == "RayJob":
            return str(ref.get("name"))
    return None


def _owner_uid(workload: JsonObject) -> str | None:
    for ref in workload["metadata"].get("ownerReferences") or []:
        if ref.get("controller") and ref.get("kind") == "RayJob":
            return str(ref.get("uid"))
    return None


@dataclasses.dataclass
class KueueEvent:
    """An Event Kueue records on the job (kept here, not written to the API)."""

    rayjob: str
    reason: str
    message: str


class KueueStandIn:
    """Kueue's controllers for the queued RayJobs of one namespace, on a thread (a context manager).

    ``gpus`` is the cluster queue's ``nvidia.com/gpu`` quota (None: unlimited, so everything is
    admitted); ``node_labels`` are the flavor's node labels, which Kueue writes into each pod
    template's nodeSelector when it starts a job. :meth:`hold`/:meth:`release` stop and resume
    admission; :meth:`evict` evicts an admitted Workload as the preemptor does. Failures of a
    pass are collected in ``errors`` (a test should assert it is empty); Workloads the API
    server would refuse (more pod sets than ``MAX_POD_SETS``) are reported per RayJob in
    ``refused`` and retried, as Kueue retries a failed create.
    """

    def __init__(
        self,
        api: client.ApiClient,
        *,
        namespace: str = "default",
        gpus: int | None = None,
        kueue_version: str = "0.19",
        cluster_queue: str = "cluster-queue",
        flavor: str = "default-flavor",
        node_labels: Mapping[str, str] | None = None,
        interval_seconds: float = 0.1,
        wait_for_pods_ready: WaitForPodsReady | None = None,
        priority_classes: Mapping[str, int] | None = None,
    ) -> None:
        self.custom: Any = client.CustomObjectsApi(api)  # its answers are plain JSON dicts
        self.namespace = namespace
        self.gpus = gpus
        self.version = parse_kueue_version(kueue_version)
        self.cluster_queue = cluster_queue
        self.flavor = flavor
        self.node_labels = dict(node_labels or {})
        self.interval_seconds = interval_seconds
        self.wait_for_pods_ready = wait_for_pods_ready
        self.priority_classes = dict(priority_classes or {})
        """WorkloadPriorityClass values by name: a job's ``kueue.x-k8s.io/priority-class`` label sets
        its Workload's ``spec.priority`` (jobframework ``ExtractPriority``), else 0."""
        self.errors: list[str] = []
        self.events: list[KueueEvent] = []
        self.refused: dict[str, str] = {}
        self._held = False
        self._lock = threading.Lock()  # one pass at a time; hold/release/evict act between passes
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"kueue-stand-in-{namespace}", daemon=True)

    # --- lifecycle and test controls ------------------------------------------------------------

    def __enter__(self) -> KueueStandIn:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def hold(self) -> None:
        """Admit nothing from the next pass on (Workloads already admitted stay admitted)."""
        with self._lock:
            self._held = True

    def release(self) -> None:
        with self._lock:
            self._held = False

    def evict(self, rayjob_name: str, reason: str = EVICTED_BY_PREEMPTION) -> None:
        """Evict the RayJob's admitted Workload (``workloadevict.Evict``, pkg/workload/evict/evict.go,
        0.19): condition Evicted with ``reason``, plus Preempted when preempted, as
        ``preemption.go`` sets. The job reconciler then suspends the job and, once KubeRay reports
        it stopped, releases the quota; ``Preempted``/``NodeFailures`` requeue it, other reasons
        leave it waiting (Kueue's backoff requeue is not modelled)."""
        with self._lock:
            workload = self.workload_of(rayjob_name)
            if workload is None or not is_true(workload, "QuotaReserved"):
                raise ValueError(f"RayJob {rayjob_name} has no admitted Workload to evict")
            conditions = copy.deepcopy(workload["status"].get("conditions") or [])
            generation = int(workload["metadata"].get("generation", 1))
            _set_condition(conditions, "Evicted", True, reason, f"Evicted by the test ({reason})", generation)
            if reason == EVICTED_BY_PREEMPTION:
                _set_condition(
                    conditions, "Preempted", True, "InClusterQueue", "Preempted by the test", generation
                )
            self._patch_status(workload, {"conditions": conditions})

    def workload_of(self, rayjob_name: str) -> JsonObject | None:
        """The RayJob's Workload, found as an operator would: by the job-uid label."""
        try:
            rayjob = self.custom.get_namespaced_custom_object(
                "ray.io", "v1", self.namespace, "rayjobs", rayjob_name
            )
        except ApiException as error:
            if error.status == 404:
                return None
            raise
        items = self._workloads(f"{JOB_UID_LABEL}={rayjob['metadata']['uid']}")
        return items[0] if items else None

    # --- the loop ---------------------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                with self._lock:
                    self._pass()
            except ApiException as error:
                if error.status not in (404, 409):  # gone or changed meanwhile: the next pass retries
                    self.errors.append(f"{error.status} {error.reason}: {error.body}")
            except Exception as error:  # keep going; the test reads errors
                self.errors.append(repr(error))
            self._stop.wait(self.interval_seconds)

    def _pass(self) -> None:
        for workload in self._workloads():
            self._reconcile_workload(workload)
        rayjobs = self.custom.list_namespaced_custom_object("ray.io", "v1", self.namespace, "rayjobs")[
            "items"
        ]
        workloads = self._workloads()
        self._finalize_orphans(rayjobs, workloads)
        for rayjob in rayjobs:
            owned = [w for w in workloads if _owner_name(w) == rayjob["metadata"]["name"]]
            try:
                self._reconcile_job(rayjob, owned)
            except ApiException as error:  # one job's conflict must not hold up the others
                if error.status not in (404, 409):
                    raise
        self._schedule(self._workloads())

    def _workloads(self, selector: str = "") -> list[JsonObject]:
        listed = self.custom.list_namespaced_custom_object(
            GROUP, WORKLOAD_VERSION, self.namespace, WORKLOAD_PLURAL, label_selector=selector
        )
        items: list[JsonObject] = listed["items"]
        return items

    # --- the workload controller (core/workload_controller.go Reconcile, 0.19) --------------------

    def _reconcile_workload(self, workload: JsonObject) -> None:
        if is_true(workload, "Finished"):
            return
        conditions = copy.deepcopy((workload.get("status") or {}).get("conditions") or [])
        generation = int(workload["metadata"].get("generation", 1))
        if workload["spec"].get("active", True):
            if is_true(workload, DEACTIVATION_TARGET):
                # Kueue deactivates it itself: spec.active false (an Update of the Workload).
                self._patch_workload(workload, {"spec": {"active": False}})
                return
            if self._deactivation_due(workload, conditions, generation) or self._requeue_due(
                workload, conditions, generation
            ):
                self._patch_status(workload, {"conditions": conditions})
            self._pods_ready_timeout(workload, conditions, generation)
        elif not is_true(workload, "Evicted"):
            # Inactive and not yet evicted: Evict with reason Deactivated, "DueTo" the deactivation
            # target's reason when Kueue set one (evict.Evict, patching.ReasonWithCause); the target
            # condition goes (admission stays until the job reconciler sees the job stopped).
            target = condition(workload, DEACTIVATION_TARGET)
            reason, message = DEACTIVATED, "The workload is deactivated"
            if target is not None:
                reason, message = f"{reason}DueTo{target['reason']}", f"{message} due to {target['message']}"
                conditions = [c for c in conditions if c.get("type") != DEACTIVATION_TARGET]
            _set_condition(conditions, "Evicted", True, reason, message, generation)
            self._patch_status(workload, {"conditions": conditions, "requeueState": None})

    def _requeue_due(self, workload: JsonObject, conditions: list[JsonObject], generation: int) -> bool:
        # The active branch (workload_controller.go Reconcile, 0.19): a Requeued=False left by a
        # deactivation turns True (Reactivated), one left by a PodsReady timeout or an admission
        # check once its requeueAt has passed (BackoffFinished). The reason must be exactly
        # "Deactivated": a Workload Kueue deactivated itself ("DeactivatedDueTo...") stays
        # Requeued=False when made active again, and the queue never offers it (0.19.2's switch).
        requeued = condition(workload, "Requeued")
        if requeued is None or requeued["status"] != "False":
            return False
        if requeued.get("reason") == DEACTIVATED:
            _set_condition(
                conditions, "Requeued", True, REACTIVATED, "The workload was reactivated", generation
            )
            return True
        if requeued.get("reason") in (EVICTED_BY_PODS_READY_TIMEOUT, EVICTED_BY_ADMISSION_CHECK):
            at = ((workload.get("status") or {}).get("requeueState") or {}).get("requeueAt")
            if at is None or _since(at) >= 0:
                _set_condition(
                    conditions,
                    "Requeued",
                    True,
                    BACKOFF_FINISHED,
                    "The workload backoff was finished",
                    generation,
                )
                return True
        return False

    def _deactivation_due(self, workload: JsonObject, conditions: list[JsonObject], generation: int) -> bool:
        """Kueue's own reasons to deactivate an admitted Workload (workload_controller.go, 0.19):
        ``reconcileMaxExecutionTime`` (admitted longer than ``spec.maximumExecutionTimeSeconds``;
        the time accumulated in earlier admissions is not modelled) and
        ``reconcileCheckBasedEviction`` (an admission check Rejected). Sets ``DeactivationTarget``."""
        if is_true(workload, DEACTIVATION_TARGET):
            return False
        status = workload.get("status") or {}
        limit = workload["spec"].get("maximumExecutionTimeSeconds")
        admitted = condition(workload, "Admitted")
        if (
            limit is not None
            and is_true(workload, "Admitted")
            and _since((admitted or {}).get("lastTransitionTime")) >= int(limit)
        ):
            reason, message = MAXIMUM_EXECUTION_TIME_EXCEEDED, "exceeding the maximum execution time"
        else:
            rejected = [c for c in status.get("admissionChecks") or [] if c.get("state") == "Rejected"]
            if not rejected:
                return False
            noun = "AdmissionCheck" if len(rejected) == 1 else "AdmissionChecks"
            listed = "; ".join(
                f'"{c["name"]}" ({c["message"]})' if c.get("message") else f'"{c["name"]}"' for c in rejected
            )
            reason, message = (
                EVICTED_BY_ADMISSION_CHECK,
                f"{noun} in Rejected state: {listed}",
            )  # buildAdmissionChecksMessage
        _set_condition(conditions, DEACTIVATION_TARGET, True, reason, message, generation)
        return True

    def _pods_ready_timeout(
        self, workload: JsonObject, conditions: list[JsonObject], generation: int
    ) -> None:
        # reconcileNotReadyTimeout / admittedNotReadyWorkload / triggerDeactivation (0.19).
        config = self.wait_for_pods_ready
        if config is None or not is_true(workload, "Admitted") or is_true(workload, "PodsReady"):
            return
        if is_true(workload, "Evicted") or is_true(workload, DEACTIVATION_TARGET):
            return
        if _since((condition(workload, "Admitted") or {}).get("lastTransitionTime")) < config.timeout_seconds:
            return
        state = dict((workload.get("status") or {}).get("requeueState") or {})
        count = int(state.get("count") or 0)
        if config.backoff_limit_count is not None and count + 1 > config.backoff_limit_count:
            message = "exceeding the maximum number of re-queuing retries"
            _set_condition(
                conditions, DEACTIVATION_TARGET, True, REQUEUING_LIMIT_EXCEEDED, message, generation
            )
            self._patch_status(workload, {"conditions": conditions})
            return
        wait = min(config.backoff_base_seconds * 2**count, config.backoff_max_seconds)  # UpdateRequeueState
        requeue_at = (datetime.now(UTC) + timedelta(seconds=wait)).strftime("%Y-%m-%dT%H:%M:%SZ")
        message = f"Exceeded the PodsReady timeout {self.namespace}/{workload['metadata']['name']}"
        _set_condition(conditions, "Evicted", True, EVICTED_BY_PODS_READY_TIMEOUT, message, generation)
        self._patch_status(
            workload,
            {"conditions": conditions, "requeueState": {"count": count + 1, "requeueAt": requeue_at}},
        )
        self.events.append(KueueEvent(_owner_name(workload) or "", "EvictedDueToPodsReadyTimeout", message))

    def reject_admission_check(self, rayjob_name: str, check: str, message: str) -> None:
        """An admission check controller rejects the RayJob's Workload (its ``status.admissionChecks``)."""
        with self._lock:
            workload = self.workload_of(rayjob_name)
            if workload is None:
                raise ValueError(f"RayJob {rayjob_name} has no Workload")
            checks = [{"name": check, "state": "Rejected", "message": message, "lastTransitionTime": _now()}]
            self._patch_status(workload, {"admissionChecks": checks})

    # --- the job reconciler (jobframework/reconciler.go ReconcileGenericJob, 0.19) ---------------

    def _reconcile_job(self, rayjob: JsonObject, owned: list[JsonObject]) -> None:
        name = rayjob["metadata"]["name"]
        spec = rayjob.get("spec") or {}
        if (
            spec.get("clusterSelector")
            or not _queue_name(rayjob)
            or rayjob["metadata"].get("deletionTimestamp")
        ):
            return  # RayJob.Skip; no queue name (manageJobsWithoutQueueName off); being finalized
        workload = self._ensure_one_workload(rayjob, owned)
        if workload is not None and is_true(workload, "Finished"):
            self._remove_finalizer(workload)
            return
        if workload is not None and workload["metadata"].get("deletionTimestamp"):
            # 1.1: the Workload is being deleted: stop the job, let the Workload go.
            self._stop_job(rayjob, workload, "Workload is deleted")
            self._remove_finalizer(workload)
            return
        if workload is not None and rayjob_on_hold(rayjob, self.version):
            # 2: on hold (0.18+): release the quota, reason OnHold (WorkloadOnHold), nothing else.
            if is_true(workload, "QuotaReserved"):
                conditions = copy.deepcopy(workload["status"].get("conditions") or [])
                self._unset_quota_reservation(workload, conditions, "Job is on hold", reason="OnHold")
            return
        finished, succeeded, message = rayjob_finished(rayjob)
        if finished:
            # 3: a finished job finishes its Workload (quota is released: the scheduler no longer
            # counts finished Workloads).
            if workload is not None:
                self._finish(workload, succeeded, message)
                self.events.append(KueueEvent(name, "FinishedWorkload", workload["metadata"]["name"]))
            return
        if workload is None:
            # handleJobWithNoWorkload: create one, once no pods of the job are left.
            if not rayjob_active(rayjob):
                self._create_workload(rayjob)
            return
        self._sync_pods_ready(rayjob, workload)
        evicted = condition(workload, "Evicted")
        if evicted is not None and evicted["status"] == "True":
            # 6: eviction: stop the job; once it is inactive, clear the admission. Only preemption
            # and node failures requeue it (Requeued=True).
            self._stop_job(rayjob, workload, evicted.get("message", ""))
            if is_true(workload, "QuotaReserved") and not rayjob_active(rayjob):
                reason = evicted.get("reason", "")
                conditions = copy.deepcopy(workload["status"].get("conditions") or [])
                generation = int(workload["metadata"].get("generation", 1))
                requeue = reason in (EVICTED_BY_PREEMPTION, EVICTED_BY_NODE_FAILURES)
                _set_condition(
                    conditions, "Requeued", requeue, reason, evicted.get("message", ""), generation
                )
                self._unset_quota_reservation(workload, conditions, evicted.get("message", ""))
            return
        if spec.get("suspend"):
            # 7: "Job admitted, unsuspending", whoever suspended it; else follow a queue change.
            if is_true(workload, "Admitted"):
                self._start_job(rayjob, workload)
            elif workload["spec"].get("queueName") != _queue_name(rayjob):
                self._patch_workload(workload, {"spec": {"queueName": _queue_name(rayjob)}})
            return
        if not is_true(workload, "Admitted"):
            # 8: "Running job is not admitted by a cluster queue, suspending".
            self._stop_job(rayjob, workload, "Not admitted by cluster queue")

    def _sync_pods_ready(self, rayjob: JsonObject, workload: JsonObject) -> None:
        # 5. with waitForPodsReady: the PodsReady condition from the job (generatePodsReadyCondition;
        # RayJob.PodsReady: KubeRay's rayClusterStatus.state is "ready").
        if self.wait_for_pods_ready is None or not is_true(workload, "Admitted"):
            return
        ready = ((rayjob.get("status") or {}).get("rayClusterStatus") or {}).get("state") == "ready"
        reason, message = (
            ("Started", "All pods reached readiness and the workload is running")
            if ready
            else ("WaitForStart", "Not all pods are ready or succeeded")
        )
        found = condition(workload, "PodsReady")
        if found is None or found.get("reason") != reason:
            conditions = copy.deepcopy((workload.get("status") or {}).get("conditions") or [])
            generation = int(workload["metadata"].get("generation", 1))
            _set_condition(conditions, "PodsReady", ready, reason, message, generation)
            self._patch_status(workload, {"conditions": conditions})

    def _ensure_one_workload(self, rayjob: JsonObject, owned: list[JsonObject]) -> JsonObject | None:
        # ensureOneWorkload + FindMatchingWorkloads/EquivalentToWorkload (reconciler.go, 0.19):
        # the first equivalent Workload is the job's; others are deleted. Equivalence here: the
        # same owner (uid too from 0.18, FinishOrphanedWorkloads), pod set names and counts and
        # GPU requests (Kueue compares the whole templates).
        match: JsonObject | None = None
        others: list[JsonObject] = []
        for workload in owned:
            if match is None and self._equivalent(rayjob, workload):
                match = workload
            else:
                others.append(workload)
        suspended = bool(rayjob["spec"].get("suspend"))
        if match is None and others and suspended and not is_true(others[0], "QuotaReserved"):
            # A suspended job's unreserved Workload is updated to match (updateWorkloadToMatchJob).
            update, others = others[0], others[1:]
            self._patch_workload(update, {"spec": {"podSets": rayjob_pod_sets(rayjob)}})
            match = update
        if match is None and not suspended and not rayjob_finished(rayjob)[0]:
            # A running job without a matching Workload is suspended.
            self._stop_job(rayjob, others[0] if len(others) == 1 else None, "No matching Workload")
        deleted = False
        for workload in others:
            self._remove_finalizer(workload)
            if not workload["metadata"].get("deletionTimestamp"):
                self._delete_workload(workload)
                deleted = True
        return None if deleted else match

    def _equivalent(self, rayjob: JsonObject, workload: JsonObject) -> bool:
        if self.version >= (0, 18) and _owner_uid(workload) != rayjob["metadata"]["uid"]:
            return False

        def shape(pod_sets: list[JsonObject]) -> list[tuple[str, int, int]]:
            return [(p["name"], int(p["count"]), pod_set_gpus(p)) for p in pod_sets]

        return shape(rayjob_pod_sets(rayjob)) == shape(workload["spec"]["podSets"])

    def _create_workload(self, rayjob: JsonObject) -> None:
        # ConstructWorkload + NewWorkload + prepareWorkload (reconciler.go, jobframework/utils.go, 0.19).
        meta = rayjob["metadata"]
        pod_sets = rayjob_pod_sets(rayjob)
        refusal = workload_refusal(pod_sets, self.version)
        if refusal is not None:
            self.refused[meta["name"]] = refusal
            return
        self.refused.pop(meta["name"], None)
        workload: JsonObject = {
            "apiVersion": f"{GROUP}/{WORKLOAD_VERSION}",
            "kind": "Workload",
            "metadata": {
                "name": workload_name(meta["name"], meta["uid"]),
                "namespace": self.namespace,
                "labels": {JOB_UID_LABEL: meta["uid"]},
                "finalizers": [RESOURCE_IN_USE_FINALIZER],
                "ownerReferences": [
                    {
                        "apiVersion": "ray.io/v1",
                        "kind": "RayJob",
                        "name": meta["name"],
                        "uid": meta["uid"],
                        "controller": True,
                        "blockOwnerDeletion": True,
                    }
                ],
            },
            "spec": {
                "active": True,
                "queueName": _queue_name(rayjob),
                "podSets": pod_sets,
                "priority": self.priority_classes.get(_label(rayjob, PRIORITY_CLASS_LABEL) or "", 0),
            },
        }
        limit_label = _label(rayjob, MAX_EXEC_TIME_LABEL)
        if limit_label is not None:
            workload["spec"]["maximumExecutionTimeSeconds"] = int(limit_label)
        self.custom.create_namespaced_custom_object(
            GROUP, WORKLOAD_VERSION, self.namespace, WORKLOAD_PLURAL, workload
        )
        self.events.append(KueueEvent(meta["name"], "CreatedWorkload", workload["metadata"]["name"]))

    def _start_job(self, rayjob: JsonObject, workload: JsonObject) -> None:
        # startJob -> RayJob.RunWithPodSetsInfo (rayjob_controller.go, 0.19): suspend false, and each
        # pod template gets the podset label and the flavor's node labels (podset.Merge); a RayJob
        # without a submitter template gets KubeRay's default one.
        spec = copy.deepcopy(rayjob["spec"])
        spec["suspend"] = False
        if (spec.get("submissionMode") or "K8sJobMode") == "K8sJobMode" and not spec.get(
            "submitterPodTemplate"
        ):
            spec["submitterPodTemplate"] = _submitter_template(rayjob)
        for pod_set, template in _template_paths(spec):
            template.setdefault("metadata", {}).setdefault("labels", {})[PODSET_LABEL] = pod_set
            if self.node_labels:
                template.setdefault("spec", {}).setdefault("nodeSelector", {}).update(self.node_labels)
        self._patch_rayjob(rayjob, spec)
        self.events.append(
            KueueEvent(rayjob["metadata"]["name"], "Started", f"Admitted by {self.cluster_queue}")
        )

    def _stop_job(self, rayjob: JsonObject, workload: JsonObject | None, message: str) -> None:
        # stopJob -> RayJob.Suspend + RestorePodSetsInfo (reconciler.go, rayjob_controller.go, 0.19): nothing when already suspended; else
        # suspend and restore each template's labels, annotations, nodeSelector, tolerations and
        # scheduling gates to the Workload's copy.
        if rayjob["spec"].get("suspend"):
            return
        spec = copy.deepcopy(rayjob["spec"])
        spec["suspend"] = True
        if workload is not None:
            saved = {p["name"]: p["template"] for p in workload["spec"]["podSets"]}
            for pod_set, template in _template_paths(spec):
                if pod_set not in saved:
                    continue
                for part, key in RESTORED_FIELDS:
                    value = (saved[pod_set].get(part) or {}).get(key)
                    if value:
                        template.setdefault(part, {})[key] = copy.deepcopy(value)
                    else:
                        template.get(part, {}).pop(key, None)
        self._patch_rayjob(rayjob, spec)
        self.events.append(KueueEvent(rayjob["metadata"]["name"], "Stopped", message))

    def _finish(self, workload: JsonObject, succeeded: bool, message: str) -> None:
        # workloadfinish.Finish (pkg/workload/finish/finish.go, 0.19): condition Finished, reason
        # Succeeded or Failed, the job's message.
        if is_true(workload, "Finished"):
            return
        conditions = copy.deepcopy((workload.get("status") or {}).get("conditions") or [])
        reason = "Succeeded" if succeeded else "Failed"
        generation = int(workload["metadata"].get("generation", 1))
        _set_condition(conditions, "Finished", True, reason, message or f"Job {reason.lower()}", generation)
        self._patch_status(workload, {"conditions": conditions})

    def _finalize_orphans(self, rayjobs: list[JsonObject], workloads: list[JsonObject]) -> None:
        # loadJob/finalize -> finalizeWorkloads -> FinalizeOrphanedWorkload (workload.go, 0.19): the
        # Workloads of a RayJob that is gone (or being deleted) lose their finalizer; one not yet
        # being deleted is first finished (OwnerNotFound, FinishOrphanedWorkloads, from 0.18).
        live = {r["metadata"]["name"] for r in rayjobs if not r["metadata"].get("deletionTimestamp")}
        for workload in workloads:
            owner = _owner_name(workload)
            if owner is None or owner in live:
                continue
            if not workload["metadata"].get("deletionTimestamp") and self.version >= (0, 18):
                conditions = copy.deepcopy((workload.get("status") or {}).get("conditions") or [])
                generation = int(workload["metadata"].get("generation", 1))
                _set_condition(conditions, "Finished", True, "OwnerNotFound", "The owner is gone", generation)
                workload = self._patch_status(workload, {"conditions": conditions})
            self._remove_finalizer(workload)

    # --- the scheduler (pkg/scheduler, pkg/cache/queue, 0.19; BestEffortFIFO) --------------------------

    def _schedule(self, workloads: list[JsonObject]) -> None:
        # Quota in use: Workloads with reserved quota that are not finished (the cache drops
        # finished ones). A pending Workload is admissible when active, not finished, without
        # reservation and not waiting to be requeued (IsAdmissible, workload.go;
        # backoffWaitingTimeExpired, cache/queue/cluster_queue.go: Requeued=False waits).
        used = sum(
            workload_gpus(w) for w in workloads if is_true(w, "QuotaReserved") and not is_true(w, "Finished")
        )
        pending = [
            w
            for w in workloads
            if w["spec"].get("active", True)
            and not is_true(w, "Finished")
            and not is_true(w, "QuotaReserved")
            and not w["metadata"].get("deletionTimestamp")
            and (condition(w, "Requeued") or {}).get("status") != "False"
            and not _on_hold(w)
        ]
        # BestEffortFIFO's order (queue/cluster_queue.go queueOrdering): higher priority first, then older.
        pending.sort(
            key=lambda w: (
                -int(w["spec"].get("priority") or 0),
                w["metadata"].get("creationTimestamp", ""),
                w["metadata"]["name"],
            )
        )
        for workload in pending:
            need = workload_gpus(workload)
            if self._held or (self.gpus is not None and used + need > self.gpus):
                self._mark_pending(workload, need)
                continue  # BestEffortFIFO: a later, smaller Workload may still fit
            self._admit(workload)
            used += need

    def _mark_pending(self, workload: JsonObject, need: int) -> None:
        # QuotaReserved False with reason Pending (the scheduler's "couldn't assign flavors", 0.19).
        conditions = copy.deepcopy((workload.get("status") or {}).get("conditions") or [])
        message = (
            "Admission is held" if self._held else f"{need} {GPU} do not fit in {self.cluster_queue} now"
        )
        found = condition(workload, "QuotaReserved")
        if found is None or found.get("message") != message:
            generation = int(workload["metadata"].get("generation", 1))
            _set_condition(conditions, "QuotaReserved", False, "Pending", message, generation)
            self._patch_status(workload, {"conditions": conditions})

    def _admit(self, workload: JsonObject) -> None:
        # SetQuotaReservation (workload.go, 0.19): admission, QuotaReserved True, Evicted and Preempted
        # reset to False; SyncAdmittedCondition: Admitted True (no admission checks here).
        assignments = []
        for pod_set in workload["spec"]["podSets"]:
            names = set()
            for container in (pod_set["template"].get("spec") or {}).get("containers") or []:
                resources = container.get("resources") or {}
                names |= set(resources.get("requests") or {}) | set(resources.get("limits") or {})
            assignment: JsonObject = {
                "name": pod_set["name"],
                "count": pod_set["count"],
                "flavors": dict.fromkeys(sorted(names), self.flavor),
            }
            if gpus := pod_set_gpus(pod_set):
                assignment["resourceUsage"] = {GPU: str(gpus)}
            assignments.append(assignment)
        conditions = copy.deepcopy((workload.get("status") or {}).get("conditions") or [])
        generation = int(workload["metadata"].get("generation", 1))
        message = f"Quota reserved in ClusterQueue {self.cluster_queue}"
        _set_condition(conditions, "QuotaReserved", True, "QuotaReserved", message, generation)
        _reset_if_true(conditions, "Evicted", "QuotaReserved", generation)
        _reset_if_true(conditions, "Preempted", "QuotaReserved", generation)
        _set_condition(conditions, "Admitted", True, "Admitted", "The Workload is admitted", generation)
        admission = {"clusterQueue": self.cluster_queue, "podSetAssignments": assignments}
        self._patch_status(workload, {"admission": admission, "conditions": conditions})

    def _unset_quota_reservation(
        self, workload: JsonObject, conditions: list[JsonObject], message: str, *, reason: str = "Pending"
    ) -> None:
        # UnsetQuotaReservationWithCondition (workload.go, 0.19): QuotaReserved False (reason Pending
        # while UnadmittedWorkloadsObservability is off, as by default; OnHold for a job on hold), no
        # admission, and SyncAdmittedCondition: Admitted False, NoReservation.
        generation = int(workload["metadata"].get("generation", 1))
        _set_condition(conditions, "QuotaReserved", False, reason, message, generation)
        if condition(workload, "Admitted") is not None:
            _set_condition(
                conditions, "Admitted", False, "NoReservation", "The Workload has no reservation", generation
            )
        self._patch_status(workload, {"admission": None, "conditions": conditions})

    # --- writes (merge patches carrying resourceVersion, as Kueue's strict clientutil.Patch) -----

    # Each write replaces the caller's copy with the server's answer (as controller-runtime's
    # client does), so that later steps of the same pass see it and send its resourceVersion.

    def _patch_status(self, workload: JsonObject, status: JsonObject) -> JsonObject:
        body = {"metadata": {"resourceVersion": workload["metadata"]["resourceVersion"]}, "status": status}
        result = self.custom.patch_namespaced_custom_object_status(
            GROUP, WORKLOAD_VERSION, self.namespace, WORKLOAD_PLURAL, workload["metadata"]["name"], body
        )
        return _replace(workload, result)

    def _patch_workload(self, workload: JsonObject, body: JsonObject) -> None:
        metadata = {**body.get("metadata", {}), "resourceVersion": workload["metadata"]["resourceVersion"]}
        result = self.custom.patch_namespaced_custom_object(
            GROUP,
            WORKLOAD_VERSION,
            self.namespace,
            WORKLOAD_PLURAL,
            workload["metadata"]["name"],
            {**body, "metadata": metadata},
        )
        _replace(workload, result)

    def _remove_finalizer(self, workload: JsonObject) -> None:
        # workload.RemoveFinalizer (pkg/workload/workload.go, 0.19).
        finalizers = workload["metadata"].get("finalizers") or []
        if RESOURCE_IN_USE_FINALIZER in finalizers:
            kept = [f for f in finalizers if f != RESOURCE_IN_USE_FINALIZER]
            self._patch_workload(workload, {"metadata": {"finalizers": kept or None}})

    def _delete_workload(self, workload: JsonObject) -> None:
        self.custom.delete_namespaced_custom_object(
            GROUP, WORKLOAD_VERSION, self.namespace, WORKLOAD_PLURAL, workload["metadata"]["name"]
        )
        self.events.append(
            KueueEvent(_owner_name(workload) or "", "DeletedWorkload", workload["metadata"]["name"])
        )

    def _patch_rayjob(self, rayjob: JsonObject, spec: JsonObject) -> None:
        body = {
            "metadata": {"resourceVersion": rayjob["metadata"]["resourceVersion"]},
            "spec": merge_diff(rayjob["spec"], spec),
        }
        result = self.custom.patch_namespaced_custom_object(
            "ray.io", "v1", self.namespace, "rayjobs", rayjob["metadata"]["name"], body
        )
        _replace(rayjob, result)


def _replace(target: JsonObject, answer: Any) -> JsonObject:
    target.clear()
    target.update(answer)
    return target
