"""The controller's identity: a ServiceAccount that may read this one RLHFJob and patch its status.

The controller in the head pod pushes ``status.progress`` itself (throttled), so that progress
reaches ``kubectl get rlhfjobs`` without the operator polling every job's metrics. It runs
user-supplied code (reward functions, models), so its token gets the least that does the job:
``get``/``patch`` on ``rlhfjobs/status`` and ``get`` on ``rlhfjobs``, both restricted by
``resourceNames`` to this job, in this namespace. It cannot touch the spec, other jobs,
pods or secrets. Only the head pod runs as this ServiceAccount; worker pods keep the
namespace's default one.

The operator itself must hold every permission it grants here (RBAC forbids escalation),
which it does: it patches RLHFJob status anyway.
"""

from __future__ import annotations

from typing import Any

from hybridflow.spec import GROUP, PLURAL
from hybridflow_operator.builders.metadata import JobRef, child_metadata
from hybridflow_operator.names import child_names

RBAC_API_VERSION = "rbac.authorization.k8s.io/v1"


def build_service_account(owner: JobRef) -> dict[str, Any]:
    """The head pod's ServiceAccount."""
    return {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": child_metadata(child_names(owner.name).service_account, owner),
    }


def build_role(owner: JobRef) -> dict[str, Any]:
    """A Role limited to reading this RLHFJob and patching its status."""
    return {
        "apiVersion": RBAC_API_VERSION,
        "kind": "Role",
        "metadata": child_metadata(child_names(owner.name).role, owner),
        "rules": [
            {
                "apiGroups": [GROUP],
                "resources": [f"{PLURAL}/status"],
                "resourceNames": [owner.name],
                "verbs": ["get", "patch"],
            },
            {
                "apiGroups": [GROUP],
                "resources": [PLURAL],
                "resourceNames": [owner.name],
                "verbs": ["get"],
            },
        ],
    }


def build_role_binding(owner: JobRef) -> dict[str, Any]:
    """Binds the Role to the ServiceAccount."""
    names = child_names(owner.name)
    return {
        "apiVersion": RBAC_API_VERSION,
        "kind": "RoleBinding",
        "metadata": child_metadata(names.role_binding, owner),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": names.role},
        "subjects": [{"kind": "ServiceAccount", "name": names.service_account, "namespace": owner.namespace}],
    }
