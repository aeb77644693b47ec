"""Pure builders: an RLHFJob's typed spec plus what was observed -> the manifests of its children.

No API calls, no clock, no randomness: the same inputs give identical dicts, so the
reconcile can compare desired with observed and write nothing when they agree. Children, in
creation order (:func:`build_children`): the ConfigMap with the runtime config, the
ServiceAccount, Role and RoleBinding the controller uses to push progress, the NetworkPolicy
that keeps the job's Ray cluster to itself, and the RayJob of the current attempt. Every child is owned by the RLHFJob (see ``metadata``).
"""

from __future__ import annotations

from typing import Any

from hybridflow.spec import RLHFJob
from hybridflow_operator.builders.agent_service import build_agent_service
from hybridflow_operator.builders.configmap import CONFIG_KEY, CONFIG_MOUNT_PATH, CONFIG_PATH, build_configmap
from hybridflow_operator.builders.metadata import JobRef, owner_reference
from hybridflow_operator.builders.network_policy import build_network_policy, build_sandbox_network_policy
from hybridflow_operator.builders.rayjob import (
    ENTRYPOINT,
    RayJobDefaults,
    build_rayjob,
    pool_resource_name,
)
from hybridflow_operator.builders.rbac import build_role, build_role_binding, build_service_account
from hybridflow_operator.kuberay import ASSUMED_CURRENT, KubeRayFeatures

__all__ = [
    "CONFIG_KEY",
    "CONFIG_MOUNT_PATH",
    "CONFIG_PATH",
    "ENTRYPOINT",
    "JobRef",
    "RayJobDefaults",
    "build_agent_service",
    "build_children",
    "build_configmap",
    "build_network_policy",
    "build_rayjob",
    "build_role",
    "build_role_binding",
    "build_sandbox_network_policy",
    "build_service_account",
    "owner_reference",
    "pool_resource_name",
]


def build_children(
    job: RLHFJob,
    owner: JobRef,
    *,
    attempt: int,
    defaults: RayJobDefaults,
    active_deadline_seconds: int | None = None,
    kuberay: KubeRayFeatures = ASSUMED_CURRENT,
) -> list[dict[str, Any]]:
    """Every child of ``job`` for ``attempt``, in the order to create them.

    The RBAC objects come before the RayJob so the head pod's ServiceAccount exists when
    KubeRay creates the pod (a pod naming a missing ServiceAccount is rejected), and the
    NetworkPolicy before it so the Ray ports are never open, not even while the pods start.
    """
    return [
        build_configmap(job, owner),
        build_service_account(owner),
        build_role(owner),
        build_role_binding(owner),
        build_network_policy(owner, kuberay_pod_labels=dict(defaults.kuberay_pod_labels)),
        *(
            [build_sandbox_network_policy(owner, endpoint_port=_endpoint_port(job))]
            if job.spec.agent.sandbox_workers
            else []
        ),
        *([build_agent_service(job, owner)] if job.spec.agent.loop == "endpoint" else []),
        build_rayjob(
            job,
            owner,
            attempt=attempt,
            defaults=defaults,
            active_deadline_seconds=active_deadline_seconds,
            kuberay=kuberay,
        ),
    ]


def _endpoint_port(job: RLHFJob) -> int | None:
    """The head's chat endpoint port, when ``spec.agent`` serves one (``builders.agent_service``)."""
    return job.spec.agent.endpoint_port if job.spec.agent.loop == "endpoint" else None
