"""The RayJob of one attempt: a KubeRay ``ray.io/v1`` RayJob with an inline RayCluster.

Layout. The head group is CPU only and runs the single controller as the RayJob's entrypoint
(``hybridflow run --in-cluster /etc/hybridflow/job.yaml``), as the job's ServiceAccount, with
the job's ConfigMap mounted. Each ``spec.resourcePools`` entry becomes one worker group of
``nodes`` identical pods (replicas = minReplicas = maxReplicas: the pool is a fixed gang,
never autoscaled), each pod holding ``gpusPerNode`` GPUs. Every pod mounts the checkpoint
volume (read-write) and ``spec.volumes`` (read-only) at the paths the spec names, so a path
in the spec means the same file on every node.

Binding pools to worker groups. The runtime reserves each pool's GPUs as placement-group
bundles that ask for one unit of the Ray custom resource ``hybridflow-pool-<pool name>``
(``hybridflow.controller.resource_pool.node_pool_resource``, mirrored by
:func:`pool_resource_name` since the operator may not import the runtime). Each worker
group advertises ``gpusPerNode`` units of it through ``rayStartParams``, so a pool's bundles
can only land on its own group's pods. The ``resources`` value is single-quoted compact
JSON, ``'{"hybridflow-pool-actor": 8}'``: KubeRay pastes rayStartParams verbatim into the
container's ``ray start --resources=...`` shell command (the single quotes keep the shell off
the JSON's double quotes) and parses the same value back by trimming the quotes and unmarshalling JSON
(ray-operator/controllers/ray/common/pod.go ``getResourcesMap``; KubeRay writes this exact
form itself in ``updateRayStartParamsResources``). The backslash-escaped form of older
KubeRay docs (``"{\\"Custom1\\": 1}"``) also survives the shell but fails that JSON parse.
``num-gpus`` and ``num-cpus`` are set explicitly rather than left to KubeRay's detection
from limits, so the Ray node offers exactly the CPUs the runtime reserves per bundle
(``cpusPerGpu`` each).

Retries: one RayJob per attempt, named ``<job>-<attempt>``, ``backoffLimit: 0``. KubeRay's
own ``backoffLimit`` would also recreate the cluster, but the operator keeps retries to
itself, for three reasons:

* every attempt gets a fresh RayJob, hence a fresh RayCluster and submitter, so nothing of a
  broken attempt (a wedged head, a half-dead NCCL group, a stale job id) carries over, and
  the failed attempt's RayJob stays behind, finished and without pods, for ``kubectl
  describe``;
* the attempt count is the operator's own state (``status.attempts``), counted the same
  way whatever failed (the Ray job, the submitter, KubeRay validation, a deadline, a
  deleted RayJob), and each new attempt gets what is *left* of ``activeDeadlineSeconds``,
  which is the job's budget across restarts; KubeRay's counter and deadline are per RayJob;
* the operator decides which failures are worth a retry (not ``ValidationFailed`` or
  ``DeadlineExceeded``; see ``hybridflow_operator.status``) and reports each one as an Event.

A new attempt resumes from the newest complete checkpoint on the checkpoint volume: the
controller looks there on start, so no state needs to pass between attempts.

Cleanup. ``shutdownAfterJobFinishes: true`` with ``ttlSecondsAfterFinished: 0`` deletes an
attempt's cluster as soon as it finishes. ``spec.ttlSecondsAfterFinished`` is *not* copied
here: it is the RLHFJob's TTL (the operator deletes the RLHFJob, and the owner references
take every RayJob with it); copying it would keep a finished attempt's GPU pods alive for
that long, and a failed attempt's pods would hold the GPUs its successor is waiting for.

Suspension and Kueue. ``suspend`` is ``spec.suspend``, and true at creation whenever
``spec.queueName`` is set: Kueue admits a RayJob by flipping ``suspend`` to false, so it must
be created suspended with the ``kueue.x-k8s.io/queue-name`` label. The RayJob records the
user's ``spec.suspend`` in the annotation ``hybridflow.io/user-suspend``; the reconcile writes
``suspend`` again only when the user's value changes, and never on a queued RayJob, whose
``suspend`` is Kueue's (it is held through its Workload: ``hybridflow_operator.kueue``). KubeRay
requires ``shutdownAfterJobFinishes`` for a suspendable RayJob (``ValidateRayJobSpec``), which it is.

Stopping. Every Ray container has a preStop hook, ``hybridflow stop``, and every pod a grace period
from ``spec.checkpoint.stopGracePeriodSeconds`` (:func:`_stop_hook`): KubeRay deletes a stopping
attempt's pods without stopping its job, and the hooks are what lets the controller save its last
step first (``hybridflow.incluster.stop``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from hybridflow.spec import ResourcePoolSpec, RLHFJob, RLHFJobSpec
from hybridflow.spec.agent import SANDBOX_GROUP, SANDBOX_RESOURCE
from hybridflow.spec.security import ContainerSecurityOverride
from hybridflow_operator.builders.configmap import CONFIG_MOUNT_PATH, CONFIG_PATH
from hybridflow_operator.builders.metadata import (
    ATTEMPT_LABEL,
    NODE_TYPE_LABEL,
    POOL_LABEL,
    USER_SUSPEND_ANNOTATION,
    JobRef,
    child_metadata,
    job_labels,
)
from hybridflow_operator.kuberay import ASSUMED_CURRENT, RAY_VERSION, KubeRayFeatures
from hybridflow_operator.names import child_names, rayjob_name

RAY_API_VERSION = "ray.io/v1"
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
ENTRYPOINT = f"hybridflow run --in-cluster {CONFIG_PATH}"
SUBMISSION_MODE = "K8sJobMode"
"""KubeRay creates a submitter Job that runs ``ray job submit`` against the head; the default."""
SUBMITTER_BACKOFF_LIMIT = 2**31 - 1
"""The submitter Job's ``backoffLimit`` (``spec.submitterConfig``, KubeRay >= 1.2): its pods' failures
never fail the attempt. KubeRay's submitter runs ``ray job logs --follow`` after an idempotent submit,
and that exits non-zero whenever the log stream's connection drops; with KubeRay's default of 2, the
third drop over a job's life failed a healthy attempt (``SubmissionFailed``). Each retry only follows
the logs again (the Job controller waits 10 s, doubling up to 6 minutes, between them). What a
submitter that cannot reach the head would have reported, the attempt's other clocks do: KubeRay
1.7's job-status check (300 s of a dashboard that does not answer), ``spec.startupTimeoutSeconds``
and ``spec.activeDeadlineSeconds`` (docs/operator.md, "Retries")."""

CONTROLLER_METRICS_PORT = 8081
"""Where the controller serves /metrics. Not 8080: KubeRay starts every Ray node with
``metrics-export-port=8080`` (its ``DefaultMetricsPort``), which Ray's own metrics agent
binds on the head too. Passed to the controller as :data:`METRICS_PORT_ENV`."""
METRICS_PORT_ENV = "HYBRIDFLOW_METRICS_PORT"
RAY_HEAD_PORTS: tuple[tuple[str, int], ...] = (("gcs-server", 6379), ("dashboard", 8265), ("client", 10001))
"""Ray's head ports. Declared because KubeRay builds the head Service from the head container's
ports and falls back to its defaults only when none are declared (common/service.go
``getServicePorts``); the submitter reaches the Ray dashboard through the port named ``dashboard``.
KubeRay adds ``metrics`` (8080) itself."""

SHM_MOUNT_PATH = "/dev/shm"
CHECKPOINT_VOLUME = "checkpoints"
CONFIG_VOLUME = "config"
SHM_VOLUME = "dshm"
HEAD_CONTAINER = "ray-head"
WORKER_CONTAINER = "ray-worker"
GPU_RESOURCE = "nvidia.com/gpu"

_QUANTITY = re.compile(r"^(?P<number>[0-9]+(?:\.[0-9]+)?)(?P<suffix>[A-Za-z]*)$")


@dataclass(frozen=True)
class RayJobDefaults:
    """Operator-wide settings the spec does not carry: the default image and the head pod's size.

    The head runs only the controller (a driver process: data loading, reward functions,
    dispatch), so a few CPUs and some memory do; it scales with the data, not with the GPUs.
    """

    image: str
    """The runtime image used when ``spec.image`` is unset."""
    head_cpu: str = "2"
    head_memory: str = "8Gi"
    kuberay_pod_labels: tuple[tuple[str, str], ...] = (("app.kubernetes.io/name", "kuberay-operator"),)
    """How the KubeRay operator's pods are labelled: the job's NetworkPolicy admits them to the
    Ray dashboard port (``builders.network_policy``)."""


RUN_AS_USER = 10001
"""uid and gid of every container: the runtime image's user (``images/runtime/Dockerfile``'s
``USER``; a test reads the Dockerfile). Another uid would have no home and no passwd entry
there: HOME would be ``/`` and every cache vLLM, Triton, torch and HF write unwritable."""
HOME_DIR = "/home/hybridflow"
"""The runtime image user's home (the Dockerfile's ``useradd --create-home``)."""
SUBMITTER_CONTAINER = "ray-job-submitter"
HOME_VOLUME = "home"
TMP_VOLUME = "tmp"
SCRATCH_MOUNTS: tuple[tuple[str, str], ...] = ((HOME_VOLUME, HOME_DIR), (TMP_VOLUME, "/tmp"))
"""emptyDirs over HOME and /tmp in every Ray container, so that what the stack writes there is
writable even under ``readOnlyRootFilesystem``: Ray's session directory (``/tmp/ray``) and its
auth token, vLLM's and torch's compile caches, Triton's kernels (``~/.triton``), the HF cache."""

STOP_COMMAND = "hybridflow"
WORKER_GRACE_MARGIN_SECONDS = 30
"""Workers' pods outlive the head's by this much, so that the controller's checkpoint, which
every worker writes a shard of, is not cut off by the workers' own deadline."""
PRESTOP_MARGIN_SECONDS = 5
"""The preStop hook gives up this long before the kubelet's SIGKILL, so it returns (and logs) first."""
RAY_DRAIN_TIMEOUT_SECONDS = 3
"""``RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S`` of every Ray container: after the preStop hook returns,
the kubelet SIGTERMs ``ray start --block``, whose handler marks the node draining and waits up to
this long for it to go idle before it kills the node's processes (Ray 2.60 ``_private/node.py``
``_drain_node_before_shutdown``; Ray's default is 30 s). The hook has waited for the controller
already (its actors are gone, the node idles at once), and at worst it returned
:data:`PRESTOP_MARGIN_SECONDS` before the kubelet's SIGKILL: the drain must end inside that margin,
leaving Ray 2 s to stop its processes itself. KubeRay 1.5.1-1.7 set no such variable."""
DRAIN_TIMEOUT_ENV = "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"
CHECKPOINT_DIR_ENV = "HYBRIDFLOW_CHECKPOINT_DIR"
"""Where every Ray container's ``hybridflow stop`` finds the controller's record and leaves its stop
request (``hybridflow.incluster.stop``): the job's checkpoint directory on the checkpoint volume,
which every pod but the sandbox's mounts. Unset without a volume: nothing a stop saved would
outlive the pods."""


def restricted_pod_security_context() -> dict[str, Any]:
    """Pod-level settings Pod Security "restricted" requires (non-root, RuntimeDefault seccomp).

    ``fsGroup`` makes the checkpoint and data volumes writable/readable by the non-root user.
    """
    return {
        "runAsNonRoot": True,
        "runAsUser": RUN_AS_USER,
        "runAsGroup": RUN_AS_USER,
        "fsGroup": RUN_AS_USER,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def restricted_container_security_context(
    override: ContainerSecurityOverride | None = None,
) -> dict[str, Any]:
    """A container's security context under Pod Security "restricted", with ``override`` merged over it.

    The override (``resourcePools[].containerSecurityContext`` or
    ``spec.pods.headContainerSecurityContext``, an allow-list: ``hybridflow.spec.security``)
    replaces whole keys: ``{capabilities: {add: [IPC_LOCK]}}`` gives RDMA its capability and keeps
    every other one dropped.
    """
    context: dict[str, Any] = {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "runAsNonRoot": True,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    if override is not None:
        extra = override.model_dump(mode="json", by_alias=True, exclude_none=True)
        capabilities = extra.get("capabilities")
        if capabilities is not None and not capabilities.get("add"):
            capabilities.pop("add", None)
        context.update(extra)
    return context


def _env(spec: RLHFJobSpec) -> list[dict[str, Any]]:
    """``spec.pods.env`` in core/v1 form: plain values, and Secret keys by reference only."""
    env: list[dict[str, Any]] = []
    for var in spec.pods.env:
        item: dict[str, Any] = {"name": var.name}
        if var.value is not None:
            item["value"] = var.value
        if var.value_from is not None:
            ref = var.value_from.secret_key_ref
            item["valueFrom"] = {"secretKeyRef": {"name": ref.name, "key": ref.key, "optional": ref.optional}}
        env.append(item)
    return env


def _env_from(spec: RLHFJobSpec) -> list[dict[str, Any]]:
    env_from: list[dict[str, Any]] = []
    for source in spec.pods.env_from:
        item: dict[str, Any] = {
            "secretRef": {"name": source.secret_ref.name, "optional": source.secret_ref.optional}
        }
        if source.prefix is not None:
            item["prefix"] = source.prefix
        env_from.append(item)
    return env_from


def _with_pod_settings(spec: RLHFJobSpec, pod_spec: dict[str, Any]) -> dict[str, Any]:
    """Add what every pod carries: the restricted pod security context, pull secrets, priority."""
    pod_spec["securityContext"] = restricted_pod_security_context()
    if spec.pods.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": name} for name in spec.pods.image_pull_secrets]
    if spec.pods.priority_class_name is not None:
        pod_spec["priorityClassName"] = spec.pods.priority_class_name
    return pod_spec


def _with_container_env(spec: RLHFJobSpec, container: dict[str, Any]) -> dict[str, Any]:
    env = [*container.get("env", []), *_env(spec)]
    if env:
        container["env"] = env
    if spec.pods.env_from:
        container["envFrom"] = _env_from(spec)
    return container


def _pod_metadata(spec: RLHFJobSpec, labels: dict[str, str]) -> dict[str, Any]:
    """Pod metadata: the operator's labels win over ``spec.pods.labels``; annotations as given."""
    merged = {**spec.pods.labels, **labels}
    metadata: dict[str, Any] = {"labels": merged}
    if spec.pods.annotations:
        metadata["annotations"] = dict(spec.pods.annotations)
    return metadata


def pool_resource_name(pool_name: str) -> str:
    """The Ray custom resource that ties a pool's placement bundles to its worker group."""
    return f"hybridflow-pool-{pool_name}"


def ray_resources_param(resources: dict[str, int]) -> str:
    """The ``rayStartParams.resources`` value: single-quoted compact JSON (see the module docstring)."""
    return "'" + json.dumps(resources, separators=(",", ":"), sort_keys=True) + "'"


def scale_quantity(quantity: str, factor: int) -> str:
    """``quantity`` times ``factor``, in the same unit: ``scale_quantity("64Gi", 8) == "512Gi"``.

    Exact decimal arithmetic, so the pod asks for precisely ``memoryPerGpu`` per GPU.
    """
    match = _QUANTITY.match(quantity)
    if match is None:
        raise ValueError(f"not a plain Kubernetes quantity: {quantity!r}")
    total = Decimal(match["number"]) * factor
    number = format(total.quantize(Decimal(1)) if total == total.to_integral() else total.normalize(), "f")
    return number + match["suffix"]


def _volumes(spec: RLHFJobSpec) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The volumes every pod mounts and their mounts: the checkpoint claim (rw), spec.volumes (ro)."""
    volumes: list[dict[str, Any]] = []
    mounts: list[dict[str, Any]] = []
    checkpoint = spec.checkpoint.volume
    if checkpoint is not None:
        volumes.append(
            {"name": CHECKPOINT_VOLUME, "persistentVolumeClaim": {"claimName": checkpoint.claim_name}}
        )
        mounts.append({"name": CHECKPOINT_VOLUME, "mountPath": checkpoint.mount_path})
    for index, volume in enumerate(spec.volumes):
        name = f"volume-{index}"
        volumes.append(
            {"name": name, "persistentVolumeClaim": {"claimName": volume.claim_name, "readOnly": True}}
        )
        mounts.append({"name": name, "mountPath": volume.mount_path, "readOnly": True})
    return volumes, mounts


def _pod_labels(spec: RLHFJobSpec, owner: JobRef, attempt: int, extra: dict[str, str]) -> dict[str, str]:
    """Pod labels: the job's own, then the gang-scheduler labels, which never override the job's."""
    labels = {**job_labels(owner), ATTEMPT_LABEL: str(attempt), **extra}
    for key, value in spec.scheduler_labels.items():
        labels.setdefault(key, value)
    return labels


def _ray_container_env(spec: RLHFJobSpec) -> list[dict[str, Any]]:
    """What every Ray container (head and workers) is told: its home, the controller's port, how long
    Ray drains on SIGTERM and, with a checkpoint volume, where the stop protocol runs."""
    env = [
        {"name": "HOME", "value": HOME_DIR},
        {"name": METRICS_PORT_ENV, "value": str(CONTROLLER_METRICS_PORT)},
        {"name": DRAIN_TIMEOUT_ENV, "value": str(RAY_DRAIN_TIMEOUT_SECONDS)},
    ]
    if spec.checkpoint.volume is not None:
        env.append({"name": CHECKPOINT_DIR_ENV, "value": spec.checkpoint_dir})
    return env


def _scratch_volumes() -> list[dict[str, Any]]:
    return [{"name": name, "emptyDir": {}} for name, _ in SCRATCH_MOUNTS]


def _scratch_mounts() -> list[dict[str, Any]]:
    return [{"name": name, "mountPath": path} for name, path in SCRATCH_MOUNTS]


def _stop_hook(grace_seconds: int) -> dict[str, Any]:
    """The preStop hook of a Ray container: ``hybridflow stop`` (``hybridflow.incluster.stop``).

    Why a hook: KubeRay stops nothing before it deletes an attempt's cluster (suspend, Kueue
    preemption, a deadline; ``rayjob_controller.go`` leaves it to the pods' preStop hooks). Every
    pod is deleted at once: the kubelet runs each container's preStop hook, then sends SIGTERM
    to its PID 1 (``ray start --block``, which drains for :data:`RAY_DRAIN_TIMEOUT_SECONDS`, then
    kills the node's processes), then SIGKILL when the pod's grace period ends. Ray's end kills
    the driver's process group, so without a hook the controller is gone before it can save
    anything. The hook asks the controller to stop after its current step and waits until it
    has exited (its checkpoint saved), through the checkpoint volume, not the head's Service,
    whose name stops resolving when the cluster is deleted: on the head it holds the head's Ray
    up, on a worker it holds that worker's Ray up, which the checkpoint writes through. It gives
    up :data:`PRESTOP_MARGIN_SECONDS` before the kubelet would kill it.
    """
    timeout = max(1, grace_seconds - PRESTOP_MARGIN_SECONDS)
    return {"preStop": {"exec": {"command": [STOP_COMMAND, "stop", "--timeout-seconds", str(timeout)]}}}


def _head_group(
    spec: RLHFJobSpec, owner: JobRef, attempt: int, image: str, defaults: RayJobDefaults
) -> dict[str, Any]:
    volumes, mounts = _volumes(spec)
    grace = spec.checkpoint.stop_grace_period_seconds
    container = {
        "name": HEAD_CONTAINER,
        "image": image,
        "env": _ray_container_env(spec),
        "ports": [
            *({"name": name, "containerPort": port} for name, port in RAY_HEAD_PORTS),
            {"name": "hf-metrics", "containerPort": CONTROLLER_METRICS_PORT},
            # The chat endpoint of spec.agent (builders/agent_service.py), when the job serves one.
            *(
                [{"name": "hf-agent", "containerPort": spec.agent.endpoint_port}]
                if spec.agent.loop == "endpoint"
                else []
            ),
        ],
        "resources": {
            "requests": {"cpu": defaults.head_cpu, "memory": defaults.head_memory},
            "limits": {"memory": defaults.head_memory},
        },
        "volumeMounts": [
            {"name": CONFIG_VOLUME, "mountPath": CONFIG_MOUNT_PATH, "readOnly": True},
            *_scratch_mounts(),
            *mounts,
        ],
        "securityContext": restricted_container_security_context(spec.pods.head_container_security_context),
        "lifecycle": _stop_hook(grace),
    }
    _with_container_env(spec, container)
    config_volume = {"name": CONFIG_VOLUME, "configMap": {"name": child_names(owner.name).config_map}}
    return {
        # The head hosts the driver only: no Ray task or actor may take its CPUs.
        "rayStartParams": {"num-cpus": "0"},
        "template": {
            "metadata": _pod_metadata(spec, _pod_labels(spec, owner, attempt, {NODE_TYPE_LABEL: "head"})),
            "spec": _with_pod_settings(
                spec,
                {
                    "serviceAccountName": child_names(owner.name).service_account,
                    "terminationGracePeriodSeconds": grace,
                    "containers": [container],
                    "volumes": [config_volume, *_scratch_volumes(), *volumes],
                },
            ),
        },
    }


def _worker_group(
    spec: RLHFJobSpec, pool: ResourcePoolSpec, owner: JobRef, attempt: int, image: str
) -> dict[str, Any]:
    volumes, mounts = _volumes(spec)
    gpus = pool.gpus_per_node
    requests: dict[str, str] = {"cpu": str(pool.cpus_per_gpu * gpus)}
    limits: dict[str, str] = {GPU_RESOURCE: str(gpus)}
    for resource, quantity in pool.extra_resources.items():
        # Extended resources cannot be overcommitted: the request must equal the limit.
        requests[resource] = quantity
        limits[resource] = quantity
    # NCCL's shared-memory transport and Ray's object store (the batches the controller sends) both
    # live in /dev/shm, which a container otherwise gets at 64 MiB. Memory-backed pages count against
    # the pod's memory limit, so that limit is the natural cap; without one, Kubernetes caps the
    # tmpfs at the node's allocatable memory.
    shm: dict[str, Any] = {"medium": "Memory"}
    if pool.memory_per_gpu is not None:
        memory = scale_quantity(pool.memory_per_gpu, gpus)
        requests["memory"] = memory
        limits["memory"] = memory
        shm["sizeLimit"] = memory
    grace = spec.checkpoint.stop_grace_period_seconds + WORKER_GRACE_MARGIN_SECONDS
    container = {
        "name": WORKER_CONTAINER,
        "image": image,
        "env": _ray_container_env(spec),
        "resources": {"requests": requests, "limits": limits},
        "volumeMounts": [{"name": SHM_VOLUME, "mountPath": SHM_MOUNT_PATH}, *_scratch_mounts(), *mounts],
        "securityContext": restricted_container_security_context(pool.container_security_context),
        "lifecycle": _stop_hook(grace),
    }
    _with_container_env(spec, container)
    pod_spec: dict[str, Any] = {
        # Workers run no code that talks to the API server: no token in the pod.
        "automountServiceAccountToken": False,
        "terminationGracePeriodSeconds": grace,
        "containers": [container],
        "volumes": [{"name": SHM_VOLUME, "emptyDir": shm}, *_scratch_volumes(), *volumes],
    }
    if pool.node_selector:
        pod_spec["nodeSelector"] = dict(pool.node_selector)
    if pool.tolerations:
        pod_spec["tolerations"] = [dict(toleration) for toleration in pool.tolerations]
    if pool.affinity:
        pod_spec["affinity"] = dict(pool.affinity)
    _with_pod_settings(spec, pod_spec)
    return {
        "groupName": pool.name,
        "replicas": pool.nodes,
        "minReplicas": pool.nodes,
        "maxReplicas": pool.nodes,
        "rayStartParams": {
            "num-cpus": str(pool.cpus_per_gpu * gpus),
            "num-gpus": str(gpus),
            "resources": ray_resources_param({pool_resource_name(pool.name): gpus}),
        },
        "template": {
            "metadata": _pod_metadata(
                spec, _pod_labels(spec, owner, attempt, {NODE_TYPE_LABEL: "worker", POOL_LABEL: pool.name})
            ),
            "spec": pod_spec,
        },
    }


def _sandbox_group(spec: RLHFJobSpec, owner: JobRef, attempt: int, image: str) -> dict[str, Any]:
    """The sandbox workers of ``spec.agent`` (``hybridflow.agents.sandbox_pool``): CPU pods that run tool code.

    Each advertises one unit of the Ray resource the sandbox workers ask for, so that nothing
    else is placed there and they land nowhere else; restricted like every pod of the job, with
    no service-account token, no volume of the job's, and egress limited to the job's own pods
    and DNS (``builders.network_policy.build_sandbox_network_policy``).
    """
    sandbox = spec.agent.sandbox
    resources = {"cpu": str(sandbox.cpus_per_worker), "memory": sandbox.memory_per_worker}
    container = {
        "name": WORKER_CONTAINER,
        "image": image,
        "env": [e for e in _ray_container_env(spec) if e["name"] != CHECKPOINT_DIR_ENV],  # no volumes
        "resources": {"requests": dict(resources), "limits": dict(resources)},
        "volumeMounts": _scratch_mounts(),
        "securityContext": restricted_container_security_context(),
    }
    pod_spec: dict[str, Any] = {
        "automountServiceAccountToken": False,
        "containers": [container],
        "volumes": _scratch_volumes(),
    }
    _with_pod_settings(spec, pod_spec)
    workers = spec.agent.sandbox_workers
    return {
        "groupName": SANDBOX_GROUP,
        "replicas": workers,
        "minReplicas": workers,
        "maxReplicas": workers,
        "rayStartParams": {
            "num-cpus": str(sandbox.cpus_per_worker),
            "resources": ray_resources_param({SANDBOX_RESOURCE: 1}),
        },
        "template": {
            "metadata": _pod_metadata(
                spec,
                _pod_labels(spec, owner, attempt, {NODE_TYPE_LABEL: "worker", POOL_LABEL: SANDBOX_GROUP}),
            ),
            "spec": pod_spec,
        },
    }


def _submitter_template(spec: RLHFJobSpec, owner: JobRef, attempt: int, image: str) -> dict[str, Any]:
    """KubeRay's submitter pod (``ray job submit`` against the head), restricted like the others.

    KubeRay fills in the submit command when the container has none (common/job.go
    ``GetDefaultSubmitterTemplate`` and the K8sJobMode submitter); only the security, image,
    resources and metadata are ours. It needs no API token.
    """
    container = {
        "name": SUBMITTER_CONTAINER,
        "image": image,
        "env": [{"name": "HOME", "value": HOME_DIR}],
        "resources": {"requests": {"cpu": "500m", "memory": "512Mi"}, "limits": {"memory": "512Mi"}},
        "volumeMounts": _scratch_mounts(),
        "securityContext": restricted_container_security_context(),
    }
    return {
        "metadata": _pod_metadata(spec, _pod_labels(spec, owner, attempt, {NODE_TYPE_LABEL: "submitter"})),
        "spec": _with_pod_settings(
            spec,
            {
                "restartPolicy": "Never",
                "automountServiceAccountToken": False,
                "containers": [container],
                "volumes": _scratch_volumes(),
            },
        ),
    }


def build_rayjob(
    job: RLHFJob,
    owner: JobRef,
    *,
    attempt: int,
    defaults: RayJobDefaults,
    active_deadline_seconds: int | None = None,
    kuberay: KubeRayFeatures = ASSUMED_CURRENT,
) -> dict[str, Any]:
    """The RayJob of ``attempt`` (1 for the first run), for the KubeRay whose RayJob CRD serves ``kuberay``.

    ``active_deadline_seconds`` is what is left of ``spec.activeDeadlineSeconds`` for this
    attempt (``hybridflow_operator.status.remaining_deadline_seconds``); None takes the spec's
    full budget, right for the first attempt. A KubeRay without ``preRunningDeadlineSeconds``
    (1.5.x) gets none: the API server would drop it, and the operator keeps that timer itself
    (``hybridflow_operator.status``). A KubeRay without token authentication is refused before
    anything is built (``hybridflow_operator.kuberay``).
    """
    spec = job.spec
    image = spec.image or defaults.image
    labels = {ATTEMPT_LABEL: str(attempt)}
    if spec.queue_name is not None:
        labels[KUEUE_QUEUE_LABEL] = spec.queue_name
    labels.update((key, value) for key, value in spec.scheduler_labels.items() if key not in labels)
    rayjob_spec: dict[str, Any] = {
        "entrypoint": ENTRYPOINT,
        "submissionMode": SUBMISSION_MODE,
        "submitterConfig": {"backoffLimit": SUBMITTER_BACKOFF_LIMIT},
        "backoffLimit": 0,
        "shutdownAfterJobFinishes": True,
        "ttlSecondsAfterFinished": spec.keep_cluster_seconds_after_finished,
        "suspend": spec.suspend or spec.queue_name is not None,
        "submitterPodTemplate": _submitter_template(spec, owner, attempt, image),
    }
    if spec.startup_timeout_seconds is not None and kuberay.pre_running_deadline:
        rayjob_spec["preRunningDeadlineSeconds"] = spec.startup_timeout_seconds
    deadline = (
        active_deadline_seconds if active_deadline_seconds is not None else spec.active_deadline_seconds
    )
    if deadline is not None:
        rayjob_spec["activeDeadlineSeconds"] = deadline
    rayjob_spec["rayClusterSpec"] = {
        # The image's Ray (hybridflow_operator.kuberay): KubeRay requires it for token authentication
        # and chooses the pods' probes by it (HTTP from Ray 2.53 on KubeRay >= 1.6, else wget).
        "rayVersion": RAY_VERSION,
        # Ray's token authentication (Ray >= 2.52, KubeRay >= 1.5.1): KubeRay generates a token
        # Secret for the cluster and sets RAY_AUTH_MODE/RAY_AUTH_TOKEN on every Ray container,
        # so the dashboard, job API and GCS answer only requests that carry it.
        "authOptions": {"mode": "token"},
        "headGroupSpec": _head_group(spec, owner, attempt, image, defaults),
        "workerGroupSpecs": [
            *(_worker_group(spec, pool, owner, attempt, image) for pool in spec.resource_pools),
            *([_sandbox_group(spec, owner, attempt, image)] if spec.agent.sandbox_workers else []),
        ],
    }
    metadata = child_metadata(rayjob_name(owner.name, attempt), owner, labels)
    # The user's suspend as written at creation: the reconcile writes `suspend` again only when
    # spec.suspend differs from this record, never in reply to Kueue (see suspend in the docstring).
    metadata["annotations"] = {USER_SUSPEND_ANNOTATION: str(spec.suspend).lower()}
    return {"apiVersion": RAY_API_VERSION, "kind": "RayJob", "metadata": metadata, "spec": rayjob_spec}
