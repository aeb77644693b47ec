"""The operator's only I/O: reading and writing the API server through the official client.

The reconcile (``reconcile.py``) talks to a :class:`Cluster` and nothing else, so it is tested
with an in-memory fake and, end to end, against the strict API-server double. Every method is
one request. A failed request raises :class:`ApiError` with the API's code, reason and message
(the reconcile turns it into a condition and an Event); ``create`` answers False on 409
AlreadyExists instead, since the caller must then find out whose the existing object is.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any, Protocol

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from hybridflow.spec import GROUP, PLURAL, VERSION
from hybridflow_operator.events import Event
from hybridflow_operator.kueue import JOB_UID_LABEL, WORKLOAD_GROUP, WORKLOAD_PLURAL, WORKLOAD_VERSION

__all__ = ["ApiCluster", "ApiError", "Cluster"]

RAY_GROUP, RAY_VERSION, RAY_PLURAL = "ray.io", "v1", "rayjobs"


class ApiError(Exception):
    """A failed API request: what it tried (``verb``, ``kind``, ``name``) and what the server said."""

    def __init__(self, verb: str, kind: str, name: str, status: int, reason: str, message: str) -> None:
        super().__init__(f"{verb} {kind} {name}: {status} {reason}: {message}")
        self.verb, self.kind, self.name = verb, kind, name
        self.status, self.reason, self.message = status, reason, message

    @classmethod
    def from_exception(cls, verb: str, kind: str, name: str, err: ApiException) -> ApiError:
        """Read the Kubernetes Status body (``reason``, ``message``) when there is one."""
        reason, message = str(err.reason or ""), str(err.body or "")
        try:
            body = json.loads(err.body) if err.body else {}
        except (TypeError, ValueError):
            body = {}
        if isinstance(body, dict):
            reason = str(body.get("reason") or reason)
            message = str(body.get("message") or message)
        return cls(verb, kind, name, int(err.status or 0), reason, message[:1024])


class Cluster(Protocol):
    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None: ...
    def create(self, obj: Mapping[str, Any]) -> bool: ...
    def patch(self, kind: str, namespace: str, name: str, patch: Mapping[str, Any]) -> None: ...
    def delete(self, kind: str, namespace: str, name: str) -> None: ...
    def patch_job_status(self, namespace: str, name: str, status: Mapping[str, Any]) -> None: ...
    def find_workload(self, namespace: str, job_uid: str) -> dict[str, Any] | None: ...
    def get_crd(self, name: str) -> dict[str, Any] | None: ...
    def emit_event(self, job: Mapping[str, Any], event: Event) -> None: ...
    def list_children(
        self, namespaces: Sequence[str], label_selector: str, kinds: Sequence[str] | None = None
    ) -> list[dict[str, Any]]: ...
    def list_jobs(self, namespaces: Sequence[str]) -> list[dict[str, Any]]: ...


def _call(verb: str, kind: str, name: str, call: Callable[[], Any], *, missing_ok: bool = False) -> Any:
    """Run one request; None for 404 when ``missing_ok``; any other failure as :class:`ApiError`."""
    try:
        return call()
    except ApiException as err:
        if missing_ok and err.status == 404:
            return None
        raise ApiError.from_exception(verb, kind, name, err) from err
    except OSError as err:  # connection refused, timeouts: no Status body
        raise ApiError(verb, kind, name, 0, "Unreachable", str(err)) from err


class ApiCluster:
    """:class:`Cluster` over ``kubernetes.client`` (sync; kopf runs sync handlers in threads)."""

    def __init__(self, api_client: client.ApiClient) -> None:
        self.api_client = api_client
        self.core = client.CoreV1Api(self.api_client)
        self.rbac = client.RbacAuthorizationV1Api(self.api_client)
        self.custom = client.CustomObjectsApi(self.api_client)
        self.networking = client.NetworkingV1Api(self.api_client)
        self.coordination = client.CoordinationV1Api(self.api_client)
        self.extensions = client.ApiextensionsV1Api(self.api_client)

    @classmethod
    def from_environment(cls) -> ApiCluster:
        """The service account's credentials inside a pod, else the local kubeconfig (``$KUBECONFIG``)."""
        configuration = client.Configuration()
        try:
            config.load_incluster_config(client_configuration=configuration)
        except config.ConfigException:
            config.load_kube_config(client_configuration=configuration)
        return cls(client.ApiClient(configuration))

    def _serialize(self, obj: Any) -> dict[str, Any] | None:
        if obj is None:
            return None
        if isinstance(obj, dict):
            return obj
        serialized: dict[str, Any] = self.api_client.sanitize_for_serialization(obj)
        return serialized

    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        readers: dict[str, Callable[[], Any]] = {
            "ConfigMap": lambda: self.core.read_namespaced_config_map(name, namespace),
            "ServiceAccount": lambda: self.core.read_namespaced_service_account(name, namespace),
            "Role": lambda: self.rbac.read_namespaced_role(name, namespace),
            "RoleBinding": lambda: self.rbac.read_namespaced_role_binding(name, namespace),
            "NetworkPolicy": lambda: self.networking.read_namespaced_network_policy(name, namespace),
            "Service": lambda: self.core.read_namespaced_service(name, namespace),
            "RayJob": lambda: self.custom.get_namespaced_custom_object(
                RAY_GROUP, RAY_VERSION, namespace, RAY_PLURAL, name
            ),
            "RLHFJob": lambda: self.custom.get_namespaced_custom_object(
                GROUP, VERSION, namespace, PLURAL, name
            ),
        }
        return self._serialize(_call("get", kind, name, readers[kind], missing_ok=True))

    def create(self, obj: Mapping[str, Any]) -> bool:
        """Create ``obj``; False when an object of that name already exists (409 AlreadyExists)."""
        kind, namespace, name = obj["kind"], obj["metadata"]["namespace"], obj["metadata"]["name"]
        body: Any = dict(obj)  # the client serializes plain dicts as they are
        creators: dict[str, Callable[[], Any]] = {
            "ConfigMap": lambda: self.core.create_namespaced_config_map(namespace, body),
            "ServiceAccount": lambda: self.core.create_namespaced_service_account(namespace, body),
            "Role": lambda: self.rbac.create_namespaced_role(namespace, body),
            "RoleBinding": lambda: self.rbac.create_namespaced_role_binding(namespace, body),
            "NetworkPolicy": lambda: self.networking.create_namespaced_network_policy(namespace, body),
            "Service": lambda: self.core.create_namespaced_service(namespace, body),
            "RayJob": lambda: self.custom.create_namespaced_custom_object(
                RAY_GROUP, RAY_VERSION, namespace, RAY_PLURAL, body
            ),
        }
        try:
            _call("create", kind, name, creators[kind])
        except ApiError as err:
            if err.status == 409:
                return False
            raise
        return True

    def patch(self, kind: str, namespace: str, name: str, patch: Mapping[str, Any]) -> None:
        body = dict(patch)
        patchers: dict[str, Callable[[], Any]] = {
            "ConfigMap": lambda: self.core.patch_namespaced_config_map(name, namespace, body),
            "RayJob": lambda: self.custom.patch_namespaced_custom_object(
                RAY_GROUP, RAY_VERSION, namespace, RAY_PLURAL, name, body
            ),
            "Workload": lambda: self.custom.patch_namespaced_custom_object(
                WORKLOAD_GROUP, WORKLOAD_VERSION, namespace, WORKLOAD_PLURAL, name, body
            ),
        }
        _call("patch", kind, name, patchers[kind])

    def find_workload(self, namespace: str, job_uid: str) -> dict[str, Any] | None:
        """The Kueue Workload of the job with ``job_uid`` (one list by Kueue's job-uid label), or None."""
        listed = self._serialize(
            _call(
                "list",
                "Workload",
                f"{JOB_UID_LABEL}={job_uid}",
                lambda: self.custom.list_namespaced_custom_object(
                    WORKLOAD_GROUP,
                    WORKLOAD_VERSION,
                    namespace,
                    WORKLOAD_PLURAL,
                    label_selector=f"{JOB_UID_LABEL}={job_uid}",
                ),
            )
        )
        items = (listed or {}).get("items") or []
        return dict(items[0]) if items else None

    def get_crd(self, name: str) -> dict[str, Any] | None:
        """A CustomResourceDefinition by name (``rayjobs.ray.io``), or None when it is not installed."""
        return self._serialize(
            _call(
                "get",
                "CustomResourceDefinition",
                name,
                lambda: self.extensions.read_custom_resource_definition(name),
                missing_ok=True,
            )
        )

    def delete(self, kind: str, namespace: str, name: str) -> None:
        deleters: dict[str, Callable[[], Any]] = {
            "RayJob": lambda: self.custom.delete_namespaced_custom_object(
                RAY_GROUP, RAY_VERSION, namespace, RAY_PLURAL, name
            ),
            "RLHFJob": lambda: self.custom.delete_namespaced_custom_object(
                GROUP, VERSION, namespace, PLURAL, name
            ),
        }
        _call("delete", kind, name, deleters[kind], missing_ok=True)

    def patch_job_status(self, namespace: str, name: str, status: Mapping[str, Any]) -> None:
        body = {"status": dict(status)}
        _call(
            "patch",
            "RLHFJob/status",
            name,
            lambda: self.custom.patch_namespaced_custom_object_status(
                GROUP, VERSION, namespace, PLURAL, name, body
            ),
        )

    def emit_event(self, job: Mapping[str, Any], event: Event) -> None:
        metadata = job["metadata"]
        now = datetime.now(UTC)
        body = client.CoreV1Event(
            metadata=client.V1ObjectMeta(
                generate_name=f"{metadata['name']}.", namespace=metadata["namespace"]
            ),
            involved_object=client.V1ObjectReference(
                api_version=job.get("apiVersion", f"{GROUP}/{VERSION}"),
                kind=job.get("kind", "RLHFJob"),
                name=metadata["name"],
                namespace=metadata["namespace"],
                uid=metadata.get("uid"),
            ),
            type=event.type,
            reason=event.reason,
            message=event.message[:1024],
            first_timestamp=now,
            last_timestamp=now,
            count=1,
            source=client.V1EventSource(component="hybridflow-operator"),
            reporting_component="hybridflow-operator",
        )
        _call(
            "create",
            "Event",
            metadata["name"],
            lambda: self.core.create_namespaced_event(metadata["namespace"], body),
        )

    # --- the Lease of leader election (hybridflow_operator.leader.LeaseApi) ---------------------

    def get_lease(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self._serialize(
            _call(
                "get",
                "Lease",
                name,
                lambda: self.coordination.read_namespaced_lease(name, namespace),
                missing_ok=True,
            )
        )

    def create_lease(self, namespace: str, body: Any) -> bool:
        """False when another replica created it first (409)."""
        try:
            _call(
                "create",
                "Lease",
                body["metadata"]["name"],
                lambda: self.coordination.create_namespaced_lease(namespace, body),
            )
        except ApiError as err:
            if err.status == 409:
                return False
            raise
        return True

    def replace_lease(self, namespace: str, name: str, body: Any) -> bool:
        """False when the Lease changed since it was read (409 on the resourceVersion precondition)."""
        try:
            _call(
                "replace",
                "Lease",
                name,
                lambda: self.coordination.replace_namespaced_lease(name, namespace, body),
            )
        except ApiError as err:
            if err.status == 409:
                return False
            raise
        return True

    # --- the startup listing of the children (main.py fills its caches with it) ----------------

    def list_children(
        self, namespaces: Sequence[str], label_selector: str, kinds: Sequence[str] | None = None
    ) -> list[dict[str, Any]]:
        """Every object of the seven child kinds (or ``kinds``) matching ``label_selector`` (all
        namespaces when ``namespaces`` is empty).

        One list per kind and namespace, at startup: the caches then hold every child before the
        first reconcile, so a restarted operator never mistakes a child it has not yet been told
        about for a missing one. After a relist, one kind (``hybridflow_operator.relist``).
        """
        found: list[dict[str, Any]] = []
        every_kind = (
            ("v1", "ConfigMap"),
            ("v1", "ServiceAccount"),
            ("rbac.authorization.k8s.io/v1", "Role"),
            ("rbac.authorization.k8s.io/v1", "RoleBinding"),
            ("networking.k8s.io/v1", "NetworkPolicy"),
            ("v1", "Service"),
            ("ray.io/v1", "RayJob"),
        )
        wanted = [(v, k) for v, k in every_kind if kinds is None or k in kinds]
        for namespace in namespaces or [""]:
            for api_version, kind in wanted:
                listed = self._serialize(
                    _call(
                        "list",
                        kind,
                        namespace or "*",
                        functools.partial(self._list, kind, namespace, label_selector),
                        missing_ok=kind == "RayJob",  # KubeRay missing: reported by the first create
                    )
                )
                for item in (listed or {}).get("items") or []:
                    found.append({"apiVersion": api_version, "kind": kind, **item})
        return found

    def list_jobs(self, namespaces: Sequence[str]) -> list[dict[str, Any]]:
        """Every RLHFJob of ``namespaces`` (all when empty): one list per namespace."""
        found: list[dict[str, Any]] = []
        for namespace in namespaces or [""]:

            def listing(namespace: str = namespace) -> Any:
                if namespace:
                    return self.custom.list_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL)
                return self.custom.list_cluster_custom_object(GROUP, VERSION, PLURAL)

            listed = self._serialize(_call("list", "RLHFJob", namespace or "*", listing))
            found.extend((listed or {}).get("items") or [])
        return found

    def _list(self, kind: str, namespace: str, label_selector: str) -> Any:
        if kind == "RayJob":
            if namespace:
                return self.custom.list_namespaced_custom_object(
                    RAY_GROUP, RAY_VERSION, namespace, RAY_PLURAL, label_selector=label_selector
                )
            return self.custom.list_cluster_custom_object(
                RAY_GROUP, RAY_VERSION, RAY_PLURAL, label_selector=label_selector
            )
        listers: dict[str, tuple[Callable[..., Any], Callable[..., Any]]] = {
            "ConfigMap": (self.core.list_namespaced_config_map, self.core.list_config_map_for_all_namespaces),
            "ServiceAccount": (
                self.core.list_namespaced_service_account,
                self.core.list_service_account_for_all_namespaces,
            ),
            "Role": (self.rbac.list_namespaced_role, self.rbac.list_role_for_all_namespaces),
            "RoleBinding": (
                self.rbac.list_namespaced_role_binding,
                self.rbac.list_role_binding_for_all_namespaces,
            ),
            "NetworkPolicy": (
                self.networking.list_namespaced_network_policy,
                self.networking.list_network_policy_for_all_namespaces,
            ),
            "Service": (self.core.list_namespaced_service, self.core.list_service_for_all_namespaces),
        }
        in_namespace, everywhere = listers[kind]
        if namespace:
            return in_namespace(namespace, label_selector=label_selector)
        return everywhere(label_selector=label_selector)
