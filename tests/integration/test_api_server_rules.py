"""kube-apiserver's rules that the emulator implements, each shown as a real cluster behaves.

The rules, with the Go source (Kubernetes v1.3x) each follows in ``tests/kube/emulator.py``:

* 410 Gone: a watch from a resourceVersion older than the history kept gets one ERROR event
  (Status ``Expired``, "too old resource version: X (Y)") and ends
  (``k8s.io/apiserver/pkg/storage/cacher/watch_cache.go`` getAllEventsSinceLocked, Cacher.Watch
  newErrWatcher); an ``Exact`` list from before a compaction answers 410
  (``storage/etcd3/errors.go`` interpretListError). The history ends at compaction and at
  ``watch_history_limit``; kopf re-lists and never hears of what was deleted in between.
* RBAC authorization (``plugin/pkg/auth/authorizer/rbac/rbac.go`` RBACAuthorizer.Authorize and
  RuleAllows; ``pkg/registry/rbac/validation/rule.go`` VisitRulesFor, appliesToUser,
  GetRoleReferenceRules): ClusterRoleBindings grant everywhere and are the only grant at the
  cluster scope; RoleBindings grant in their namespace, to a Role or a ClusterRole; subjects
  are Users, Groups and ServiceAccounts; resourceNames, subresources and ``*``. 403 messages as
  ``responsewriters/errors.go`` forbiddenMessage words them.
* RBAC escalation prevention (``pkg/registry/rbac/{role,clusterrole,rolebinding,
  clusterrolebinding}/policybased/storage.go``; ``rule.go`` ConfirmNoEscalation;
  ``escalation_check.go`` RoleEscalationAuthorized, BindingAuthorized): a role grants only what
  its writer holds (or may ``escalate``), a binding binds only a role whose rules its writer
  holds (or may ``bind``); a binding's roleRef never changes (``ValidateRoleBindingUpdate``).
* OwnerReferencesPermissionEnforcement (``plugin/pkg/admission/gc/gc_admission.go``):
  ``blockOwnerDeletion`` needs ``update`` on the owner's ``finalizers``; changing an object's
  ownerReferences needs ``delete`` on it.
* Validating admission webhooks (``admission/plugin/webhook/validating``, webhookerrors
  ToStatusErr): a denial is a 403 for every user, admins included.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import kmock
import kopf
import kubernetes.client
import kubernetes.watch
import pytest
import yaml
from kubernetes.client import ApiException, CoreV1Api, CustomObjectsApi, RbacAuthorizationV1Api

from kube.emulator import ApiServerEmulator, ValidatingWebhook
from kube.harness import EmulatedCluster, load_crd, operator_registry, wait_until

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
NS = "default"
OTHER = "other"
GROUP, VERSION, PLURAL = "hybridflow.io", "v1alpha1", "rlhfjobs"
RLHFJOBS = kmock.resource(GROUP, VERSION, PLURAL)
SA_GROUPS = '["system:serviceaccounts" "system:serviceaccounts:default" "system:authenticated"]'


def start(emulator: ApiServerEmulator | None = None) -> EmulatedCluster:
    cluster = EmulatedCluster(emulator)
    cluster.emulator.register_crd(load_crd(ROOT / "crds" / "hybridflow.io_rlhfjobs.yaml"))
    return cluster


@pytest.fixture
def cluster() -> Iterator[EmulatedCluster]:
    with start() as cluster:
        cluster.core.create_namespace({"metadata": {"name": OTHER}})
        yield cluster


def job(name: str) -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((ROOT / "examples" / "grpo-cluster.yaml").read_text())
    doc["metadata"] = {"name": name}
    return doc


def create_job(cluster: EmulatedCluster, name: str) -> dict[str, Any]:
    created: dict[str, Any] = cluster.custom.create_namespaced_custom_object(
        GROUP, VERSION, NS, PLURAL, job(name)
    )
    return created


def service_account(name: str, namespace: str = NS) -> str:
    return f"system:serviceaccount:{namespace}:{name}"


def rule(groups: list[str], resources: list[str], verbs: list[str], **more: list[str]) -> dict[str, Any]:
    return {"apiGroups": groups, "resources": resources, "verbs": verbs, **more}


def subject(user: str, kind: str = "") -> dict[str, Any]:
    if user.startswith("system:serviceaccount:"):
        namespace, name = user.removeprefix("system:serviceaccount:").split(":")
        return {"kind": "ServiceAccount", "name": name, "namespace": namespace}
    return {"kind": kind or "User", "name": user, "apiGroup": "rbac.authorization.k8s.io"}


def role(
    cluster: EmulatedCluster, name: str, rules: list[dict[str, Any]], namespace: str | None = NS
) -> None:
    """A Role in ``namespace``, or a ClusterRole for None (written by an admin)."""
    body = {"metadata": {"name": name}, "rules": rules}
    if namespace is None:
        cluster.rbac.create_cluster_role(body)
    else:
        cluster.rbac.create_namespaced_role(namespace, body)


def bind(
    cluster: EmulatedCluster,
    name: str,
    role_kind: str,
    role_name: str,
    subjects: list[dict[str, Any]],
    namespace: str | None = NS,
) -> None:
    """A RoleBinding in ``namespace``, or a ClusterRoleBinding for None (written by an admin)."""
    body = {
        "metadata": {"name": name},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": role_kind, "name": role_name},
        "subjects": subjects,
    }
    if namespace is None:
        cluster.rbac.create_cluster_role_binding(body)
    else:
        cluster.rbac.create_namespaced_role_binding(namespace, body)


def grant(cluster: EmulatedCluster, user: str, name: str, rules: list[dict[str, Any]]) -> None:
    """A Role in NS with ``rules``, bound to ``user``."""
    role(cluster, name, rules)
    bind(cluster, name, "Role", name, [subject(user)])


def refusal(call: Callable[[], object], code: int = 403) -> dict[str, Any]:
    """The Status body of a call that the server refuses with ``code``."""
    with pytest.raises(ApiException) as raised:
        call()
    assert raised.value.status == code, raised.value.body
    status: dict[str, Any] = json.loads(raised.value.body)
    assert status["kind"] == "Status" and status["code"] == code
    return status


def config_map(name: str, **metadata: Any) -> dict[str, Any]:
    return {"metadata": {"name": name, **metadata}, "data": {}}


# --- 410 Gone --------------------------------------------------------------------------------


def expired_event(since: str, oldest: int) -> dict[str, Any]:
    return {
        "type": "ERROR",
        "object": {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": f"too old resource version: {since} ({oldest})",
            "reason": "Expired",
            "code": 410,
        },
    }


def raw_watch(cluster: EmulatedCluster, since: str) -> list[dict[str, Any]]:
    """Every event of a watch of ConfigMaps from ``since`` until the server ends the stream."""
    response = cluster.core.list_namespaced_config_map(
        NS, watch=True, resource_version=since, timeout_seconds=1, _preload_content=False
    )
    try:
        return [json.loads(line) for line in response.read().splitlines() if line.strip()]
    finally:
        response.release_conn()


def test_a_watch_from_before_a_compaction_gets_410_gone(cluster: EmulatedCluster) -> None:
    old = cluster.core.create_namespaced_config_map(NS, config_map("a")).metadata.resource_version
    cluster.core.create_namespaced_config_map(NS, config_map("b"))
    revision = cluster.compact()

    # The server answers 200, sends one ERROR event and ends the stream.
    assert raw_watch(cluster, old) == [expired_event(old, revision)]
    with pytest.raises(ApiException) as expired:  # the official client raises it
        list(
            kubernetes.watch.Watch().stream(
                cluster.core.list_namespaced_config_map, NS, resource_version=old, timeout_seconds=2
            )
        )
    assert expired.value.status == 410
    assert expired.value.reason == f"Expired: too old resource version: {old} ({revision})"

    # From the compacted revision on, watches are served; so is a list, unless it asks for an
    # older version exactly.
    cluster.core.create_namespaced_config_map(NS, config_map("c"))
    watch = kubernetes.watch.Watch()
    for event in watch.stream(
        cluster.core.list_namespaced_config_map, NS, resource_version=str(revision), timeout_seconds=5
    ):
        assert (event["type"], event["object"].metadata.name) == ("ADDED", "c")
        watch.stop()
    assert len(cluster.core.list_namespaced_config_map(NS, resource_version=old).items) == 3
    status = refusal(
        lambda: cluster.core.list_namespaced_config_map(
            NS, resource_version=old, resource_version_match="Exact"
        ),
        410,
    )
    assert (status["reason"], status["message"]) == (
        "Expired",
        "The resourceVersion for the provided list is too old.",
    )


def test_a_bounded_watch_history_expires_old_resource_versions() -> None:
    with start(ApiServerEmulator(watch_history_limit=2)) as cluster:
        before = cluster.core.list_namespaced_config_map(NS).metadata.resource_version
        versions = [
            cluster.core.create_namespaced_config_map(NS, config_map(name)).metadata.resource_version
            for name in ("a", "b", "c")
        ]
        # Two events are kept per resource (b's and c's): a's is forgotten.
        assert raw_watch(cluster, before) == [expired_event(before, int(versions[0]))]
        assert [event["object"]["metadata"]["name"] for event in raw_watch(cluster, versions[0])] == [
            "b",
            "c",
        ]
        # Each resource keeps its own history: RLHFJob events leave the ConfigMaps' in place.
        create_job(cluster, "j")
        create_job(cluster, "k")
        assert [event["object"]["metadata"]["name"] for event in raw_watch(cluster, versions[0])] == [
            "b",
            "c",
        ]


def test_kopf_relists_after_410_and_never_sees_what_was_deleted_in_the_gap(
    cluster: EmulatedCluster, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="kopf._cogs.clients.watching")
    seen: list[tuple[str | None, str]] = []
    registry = operator_registry()

    @kopf.on.event(GROUP, VERSION, PLURAL, registry=registry)
    def observe(type: str | None, name: str, **_: Any) -> None:
        seen.append((type, name))

    def lists() -> int:
        return cluster.emulator.requests_by_token[("emulator", "list", PLURAL)]

    create_job(cluster, "kept")
    with cluster.run_operator(registry, namespaces=[NS]):
        create_job(cluster, "gone")
        wait_until(lambda: {"kept", "gone"} <= {name for _, name in seen})
        listed, before_gap = lists(), len(seen)
        cluster.watch_gap(lambda: cluster.emulator.delete_stored_object(RLHFJOBS, "gone", NS))
        wait_until(lambda: lists() > listed, message="kopf re-lists")
        create_job(cluster, "after")
        # The re-list shows what exists (kopf's type None); then the new watch goes on. kopf
        # handles each object on its own worker: the two may come in either order.
        expected = {(None, "kept"), ("ADDED", "after")}
        wait_until(lambda: expected <= set(seen[before_gap:]))
        cluster.wait_until_idle(quiet_seconds=0.3)

    assert any("Restarting the watch-stream" in record.getMessage() for record in caplog.records), "410"
    assert sorted(seen[before_gap:], key=str) == sorted(expected, key=str)
    assert ("DELETED", "gone") not in seen, "nothing tells kopf that `gone` went away"
    names = [
        item["metadata"]["name"]
        for item in cluster.custom.list_namespaced_custom_object(GROUP, VERSION, NS, PLURAL)["items"]
    ]
    assert names == ["after", "kept"]


# --- RBAC ------------------------------------------------------------------------------------

CM_READER = [rule([""], ["configmaps"], ["get", "list"])]


def test_a_role_binding_to_a_cluster_role_grants_in_its_namespace_only(cluster: EmulatedCluster) -> None:
    user = service_account("reader")
    role(cluster, "cm-reader", CM_READER, namespace=None)
    bind(cluster, "readers", "ClusterRole", "cm-reader", [subject(user)])
    reader = CoreV1Api(cluster.api_client_as(user))

    assert reader.list_namespaced_config_map(NS).items == []
    denied = refusal(lambda: reader.list_namespaced_config_map(OTHER))
    assert denied["reason"] == "Forbidden"
    assert denied["message"] == (
        f'configmaps is forbidden: User "{user}" cannot list resource "configmaps" in API group "" '
        f'in the namespace "{OTHER}"'
    )
    across = refusal(reader.list_config_map_for_all_namespaces)
    assert across["message"].endswith('in API group "" at the cluster scope')

    # A binding to a role that does not exist grants nothing; the authorizer says so.
    bind(cluster, "dangling", "Role", "missing", [subject(user)], namespace=OTHER)
    denied = refusal(lambda: reader.read_namespaced_config_map("x", OTHER))
    assert denied["message"] == (
        f'configmaps "x" is forbidden: User "{user}" cannot get resource "configmaps" in API group "" '
        f'in the namespace "{OTHER}": RBAC: role.rbac.authorization.k8s.io "missing" not found'
    )


def test_cluster_scoped_resources_and_all_namespaces_need_a_cluster_role_binding(
    cluster: EmulatedCluster,
) -> None:
    user = service_account("lister")
    role(cluster, "ns-reader", [rule([""], ["namespaces", "configmaps"], ["get", "list"])], namespace=None)
    bind(cluster, "ns-readers", "ClusterRole", "ns-reader", [subject(user)])
    lister = CoreV1Api(cluster.api_client_as(user))

    refusal(lister.list_namespace)
    # A Namespace's own namespace is itself: a RoleBinding in it grants reading it.
    assert lister.read_namespace(NS).metadata.name == NS
    refusal(lambda: lister.read_namespace(OTHER))

    bind(cluster, "ns-readers", "ClusterRole", "ns-reader", [subject(user)], namespace=None)
    assert {ns.metadata.name for ns in lister.list_namespace().items} == {NS, OTHER}
    assert lister.list_config_map_for_all_namespaces().items == []
    assert lister.read_namespace(OTHER).metadata.name == OTHER


def test_resource_names_subresources_and_wildcards(cluster: EmulatedCluster) -> None:
    user = service_account("narrow")
    create_job(cluster, "j")
    for name in ("allowed", "other"):
        cluster.core.create_namespaced_config_map(NS, config_map(name))
    grant(
        cluster,
        user,
        "narrow",
        [
            rule([""], ["configmaps"], ["get", "list"], resourceNames=["allowed"]),
            rule([GROUP], ["rlhfjobs/status"], ["patch"]),
            rule([GROUP], ["*"], ["list"]),
        ],
    )
    client = cluster.api_client_as(user)
    core, custom = CoreV1Api(client), CustomObjectsApi(client)

    assert core.read_namespaced_config_map("allowed", NS).metadata.name == "allowed"
    refusal(lambda: core.read_namespaced_config_map("other", NS))
    refusal(lambda: core.list_namespaced_config_map(NS))  # a list names no object...
    only = core.list_namespaced_config_map(NS, field_selector="metadata.name=allowed")  # ...unless it does
    assert [cm.metadata.name for cm in only.items] == ["allowed"]

    custom.patch_namespaced_custom_object_status(
        GROUP, VERSION, NS, PLURAL, "j", {"status": {"phase": "Pending"}}
    )
    denied = refusal(
        lambda: custom.patch_namespaced_custom_object(
            GROUP, VERSION, NS, PLURAL, "j", {"spec": {"suspend": True}}
        )
    )
    assert 'cannot patch resource "rlhfjobs" in API group "hybridflow.io"' in denied["message"]
    assert len(custom.list_namespaced_custom_object(GROUP, VERSION, NS, PLURAL)["items"]) == 1
    refusal(lambda: custom.get_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, "j"))


def test_user_group_and_service_account_subjects(cluster: EmulatedCluster) -> None:
    role(cluster, "cm-reader", CM_READER, namespace=None)
    bind(
        cluster,
        "sas-of-default",
        "ClusterRole",
        "cm-reader",
        [subject("system:serviceaccounts:default", "Group")],
    )
    bind(cluster, "alice", "ClusterRole", "cm-reader", [subject("alice")], namespace=OTHER)
    bind(cluster, "team", "ClusterRole", "cm-reader", [subject("team-rl", "Group")], namespace=OTHER)
    cluster.emulator.user_groups["carol"] = ("team-rl",)

    def reads(user: str, namespace: str) -> bool:
        try:
            CoreV1Api(cluster.api_client_as(user)).list_namespaced_config_map(namespace)
        except ApiException as e:
            assert e.status == 403
            return False
        return True

    assert reads(service_account("anyone"), NS) and not reads(service_account("x", OTHER), NS)
    assert reads("alice", OTHER) and not reads("alice", NS) and not reads("bob", OTHER)
    assert reads("carol", OTHER)
    # A ServiceAccount subject of a ClusterRoleBinding must name its namespace.
    bind(
        cluster,
        "no-namespace",
        "ClusterRole",
        "cm-reader",
        [{"kind": "ServiceAccount", "name": "x"}],
        namespace=None,
    )
    assert not reads(service_account("x", OTHER), NS)
    bind(
        cluster,
        "everyone",
        "ClusterRole",
        "cm-reader",
        [subject("system:authenticated", "Group")],
        namespace=None,
    )
    assert reads("bob", NS) and reads(service_account("x", OTHER), OTHER)


# --- RBAC escalation prevention -------------------------------------------------------------


def test_a_role_grants_only_what_its_writer_holds_unless_it_may_escalate(cluster: EmulatedCluster) -> None:
    user = service_account("delegate")
    grant(
        cluster,
        user,
        "delegator",
        [
            rule(["rbac.authorization.k8s.io"], ["roles"], ["create", "patch"]),
            rule([""], ["configmaps"], ["get", "list"]),
        ],
    )
    rbac = RbacAuthorizationV1Api(cluster.api_client_as(user))

    rbac.create_namespaced_role(
        NS, {"metadata": {"name": "sub"}, "rules": [rule([""], ["configmaps"], ["get"])]}
    )
    more = {"metadata": {"name": "more"}, "rules": [rule([""], ["configmaps", "secrets"], ["get", "delete"])]}
    denied = refusal(lambda: rbac.create_namespaced_role(NS, more))
    assert denied["reason"] == "Forbidden"
    assert denied["message"] == (
        f'roles.rbac.authorization.k8s.io "more" is forbidden: user "{user}" (groups={SA_GROUPS}) is '
        "attempting to grant RBAC permissions not currently held:\n"
        '{APIGroups:[""], Resources:["configmaps"], Verbs:["delete"]}\n'
        '{APIGroups:[""], Resources:["secrets"], Verbs:["get" "delete"]}'
    )
    refusal(lambda: rbac.patch_namespaced_role("sub", NS, {"rules": more["rules"]}))
    # Nor may it write roles where it holds nothing.
    refusal(lambda: rbac.create_namespaced_role(OTHER, {"metadata": {"name": "sub"}, "rules": []}))

    # A ClusterRole needs the permissions cluster-wide: a RoleBinding's do not count.
    role(
        cluster,
        "cluster-role-writer",
        [rule(["rbac.authorization.k8s.io"], ["clusterroles"], ["create"])],
        namespace=None,
    )
    bind(
        cluster, "cluster-role-writer", "ClusterRole", "cluster-role-writer", [subject(user)], namespace=None
    )
    reader = {"metadata": {"name": "cm-reader"}, "rules": [rule([""], ["configmaps"], ["get"])]}
    assert "not currently held" in refusal(lambda: rbac.create_cluster_role(reader))["message"]
    role(cluster, "cm-getter", [rule([""], ["configmaps"], ["get"])], namespace=None)
    bind(cluster, "cm-getter", "ClusterRole", "cm-getter", [subject(user)], namespace=None)
    rbac.create_cluster_role(reader)

    # `escalate` on roles lifts the check.
    grant(cluster, user, "escalator", [rule(["rbac.authorization.k8s.io"], ["roles"], ["escalate"])])
    rbac.create_namespaced_role(NS, more)
    rbac.patch_namespaced_role("sub", NS, {"rules": more["rules"]})


def test_a_binding_binds_only_a_role_its_writer_holds_unless_it_may_bind(cluster: EmulatedCluster) -> None:
    user = service_account("binder")
    grant(
        cluster,
        user,
        "binder",
        [
            rule(["rbac.authorization.k8s.io"], ["rolebindings"], ["create"]),
            rule([""], ["configmaps"], ["get"]),
        ],
    )
    role(cluster, "cm-getter", [rule([""], ["configmaps"], ["get"])], namespace=None)
    role(cluster, "cm-admin", [rule([""], ["configmaps"], ["*"])], namespace=None)
    rbac = RbacAuthorizationV1Api(cluster.api_client_as(user))

    def binding(name: str, cluster_role: str) -> dict[str, Any]:
        return {
            "metadata": {"name": name},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": cluster_role},
            "subjects": [subject(service_account("worker"))],
        }

    rbac.create_namespaced_role_binding(NS, binding("getters", "cm-getter"))
    denied = refusal(lambda: rbac.create_namespaced_role_binding(NS, binding("admins", "cm-admin")))
    assert denied["message"] == (
        f'rolebindings.rbac.authorization.k8s.io "admins" is forbidden: user "{user}" (groups={SA_GROUPS}) '
        "is attempting to grant RBAC permissions not currently held:\n"
        '{APIGroups:[""], Resources:["configmaps"], Verbs:["*"]}'
    )
    missing = refusal(lambda: rbac.create_namespaced_role_binding(NS, binding("dangling", "absent")), 404)
    assert missing["message"] == 'clusterroles.rbac.authorization.k8s.io "absent" not found'

    # `bind` on that one ClusterRole lifts the check for it.
    grant(
        cluster,
        user,
        "may-bind",
        [rule(["rbac.authorization.k8s.io"], ["clusterroles"], ["bind"], resourceNames=["cm-admin"])],
    )
    rbac.create_namespaced_role_binding(NS, binding("admins", "cm-admin"))
    # A binding's role is fixed at creation (for admins too).
    changed = {
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "cm-getter"}
    }
    status = refusal(lambda: cluster.rbac.patch_namespaced_role_binding("admins", NS, changed), 422)
    assert status["details"]["causes"][0]["field"] == "roleRef"


# --- OwnerReferencesPermissionEnforcement ---------------------------------------------------


def test_owner_references_permission_enforcement(cluster: EmulatedCluster) -> None:
    owner = create_job(cluster, "owner")
    user = service_account("builder")
    grant(
        cluster,
        user,
        "builder",
        [rule([""], ["configmaps"], ["create", "get", "patch"]), rule([GROUP], [PLURAL], ["get"])],
    )
    core = CoreV1Api(cluster.api_client_as(user))

    def owned(name: str, **block: bool) -> dict[str, Any]:
        ref = {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "RLHFJob",
            "name": "owner",
            "uid": owner["metadata"]["uid"],
        }
        return config_map(name, ownerReferences=[{**ref, **block}])

    denied = refusal(
        lambda: core.create_namespaced_config_map(NS, owned("blocking", blockOwnerDeletion=True))
    )
    assert denied["message"] == (
        'configmaps "blocking" is forbidden: cannot set blockOwnerDeletion if an ownerReference refers to '
        "a resource you can't set finalizers on: , <nil>"
    )
    core.create_namespaced_config_map(NS, owned("plain"))
    core.create_namespaced_config_map(NS, owned("not-blocking", blockOwnerDeletion=False))
    # Changing ownerReferences needs `delete` on the object (checked before the finalizers).
    denied = refusal(
        lambda: core.patch_namespaced_config_map("plain", NS, owned("plain", blockOwnerDeletion=True))
    )
    assert denied["message"] == (
        'configmaps "plain" is forbidden: cannot set an ownerRef on a resource you can\'t delete: , <nil>'
    )
    unknown = config_map(
        "unknown",
        ownerReferences=[
            {
                "apiVersion": "example.com/v1",
                "kind": "Thing",
                "name": "t",
                "uid": "u",
                "blockOwnerDeletion": True,
            }
        ],
    )
    assert refusal(lambda: core.create_namespaced_config_map(NS, unknown))["message"].endswith(
        "cannot find RESTMapping for APIVersion example.com/v1 Kind Thing: "
        'no matches for kind "Thing" in version "example.com/v1"'
    )

    grant(
        cluster,
        user,
        "finalizers",
        [rule([GROUP], ["rlhfjobs/finalizers"], ["update"]), rule([""], ["configmaps"], ["delete"])],
    )
    core.create_namespaced_config_map(NS, owned("blocking", blockOwnerDeletion=True))
    core.patch_namespaced_config_map("plain", NS, owned("plain", blockOwnerDeletion=True))
    # Admins are not checked, nor anyone with the plugin off.
    cluster.core.create_namespaced_config_map(NS, owned("by-admin", blockOwnerDeletion=True))
    restricted = service_account("restricted")
    grant(cluster, restricted, "restricted", [rule([""], ["configmaps"], ["create"])])
    cluster.emulator.owner_references_permission_enforcement = False
    CoreV1Api(cluster.api_client_as(restricted)).create_namespaced_config_map(
        NS, owned("unchecked", blockOwnerDeletion=True)
    )


# --- validating admission webhooks ----------------------------------------------------------


def test_a_validating_webhook_denies_matching_writes_by_anyone(cluster: EmulatedCluster) -> None:
    calls: list[tuple[str, str | None]] = []

    def no_locked_data(new: dict[str, Any], old: dict[str, Any] | None) -> str | None:
        calls.append((new["metadata"]["name"], None if old is None else old["metadata"]["resourceVersion"]))
        return "data.locked may not be set" if "locked" in (new.get("data") or {}) else None

    def phase_is_kept(new: dict[str, Any], old: dict[str, Any] | None) -> str | None:
        assert old is not None
        return "status.phase is immutable" if new.get("status", {}).get("phase") == "Failed" else None

    cluster.emulator.validating_webhooks += [
        ValidatingWebhook("vconfigmap.example.com", {"configmaps"}, {"CREATE", "UPDATE"}, no_locked_data),
        ValidatingWebhook("vrlhfjob-status.example.com", {"rlhfjobs/status"}, {"UPDATE"}, phase_is_kept),
    ]
    denied = refusal(
        lambda: cluster.core.create_namespaced_config_map(
            NS, {"metadata": {"name": "c"}, "data": {"locked": "1"}}
        )
    )
    assert denied == {
        "apiVersion": "v1",
        "kind": "Status",
        "metadata": {},
        "status": "Failure",
        "message": 'admission webhook "vconfigmap.example.com" denied the request: data.locked may not be set',
        "reason": "Forbidden",
        "code": 403,
    }
    created = cluster.core.create_namespaced_config_map(NS, {"metadata": {"name": "c"}, "data": {}})
    refusal(lambda: cluster.core.patch_namespaced_config_map("c", NS, {"data": {"locked": "1"}}))
    assert calls[-1] == ("c", created.metadata.resource_version), "an UPDATE sees the stored object"
    assert "locked" not in (cluster.core.read_namespaced_config_map("c", NS).data or {})

    create_job(cluster, "j")  # neither webhook matches the main resource's CREATE
    patch_status = cluster.custom.patch_namespaced_custom_object_status
    patch_status(GROUP, VERSION, NS, PLURAL, "j", {"status": {"phase": "Running"}})
    message = refusal(lambda: patch_status(GROUP, VERSION, NS, PLURAL, "j", {"status": {"phase": "Failed"}}))[
        "message"
    ]
    assert (
        message
        == 'admission webhook "vrlhfjob-status.example.com" denied the request: status.phase is immutable'
    )
    cluster.custom.patch_namespaced_custom_object(
        GROUP, VERSION, NS, PLURAL, "j", {"spec": {"suspend": True}}
    )
