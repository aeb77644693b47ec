"""The operator's only I/O: reading and writing the API server through the official client.

The reconcile (``reconcile.py``) talks to a :class:`Cluster` and nothing else, so it is tested
with an in-memory fake and, end to end, against the API-server emulator. Every method is one
request; ``create`` treats 409 (already exists) as success, which is what a level-triggered
reconcile that raced an earlier pass wants.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any, Protocol

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from hybridflow.spec import GROUP, PLURAL, VERSION

__all__ = ["ApiCluster", "Cluster", "EventRecord"]

RAY_GROUP, RAY_VERSION, RAY_PLURAL = "ray.io", "v1", "rayjobs"


class EventRecord(Protocol):
    type: str
    reason: str
    message: str


class Cluster(Protocol):
    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None: ...
    def create(self, obj: Mapping[str, Any]) -> None: ...
    def patch(self, kind: str, namespace: str, name: str, patch: Mapping[str, Any]) -> None: ...
    def delete(self, kind: str, namespace: str, name: str) -> None: ...
    def patch_job_status(self, namespace: str, name: str, status: Mapping[str, Any]) -> None: ...
    def emit_event(self, job: Mapping[str, Any], event: EventRecord) -> None: ...


def _missing_ok(call: Callable[[], Any], *, also: tuple[int, ...] = ()) -> Any:
    try:
        return call()
    except ApiException as err:
        if err.status in (404, *also):
            return None
        raise


class ApiCluster:
    """:class:`Cluster` over ``kubernetes.client`` (sync; kopf runs sync handlers in threads)."""

    def __init__(self, api_client: client.ApiClient) -> None:
        self.api_client = api_client
        self.core = client.CoreV1Api(self.api_client)
        self.rbac = client.RbacAuthorizationV1Api(self.api_client)
        self.custom = client.CustomObjectsApi(self.api_client)

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
            "RayJob": lambda: self.custom.get_namespaced_custom_object(
                RAY_GROUP, RAY_VERSION, namespace, RAY_PLURAL, name
            ),
            "RLHFJob": lambda: self.custom.get_namespaced_custom_object(
                GROUP, VERSION, namespace, PLURAL, name
            ),
        }
        return self._serialize(_missing_ok(readers[kind]))

    def create(self, obj: Mapping[str, Any]) -> None:
        kind, namespace = obj["kind"], obj["metadata"]["namespace"]
        body: Any = dict(obj)  # the client serializes plain dicts as they are
        creators: dict[str, Callable[[], Any]] = {
            "ConfigMap": lambda: self.core.create_namespaced_config_map(namespace, body),
            "ServiceAccount": lambda: self.core.create_namespaced_service_account(namespace, body),
            "Role": lambda: self.rbac.create_namespaced_role(namespace, body),
            "RoleBinding": lambda: self.rbac.create_namespaced_role_binding(namespace, body),
            "RayJob": lambda: self.custom.create_namespaced_custom_object(
                RAY_GROUP, RAY_VERSION, namespace, RAY_PLURAL, body
            ),
        }
        _missing_ok(creators[kind], also=(409,))

    def patch(self, kind: str, namespace: str, name: str, patch: Mapping[str, Any]) -> None:
        body = dict(patch)
        patchers: dict[str, Callable[[], Any]] = {
            "ConfigMap": lambda: self.core.patch_namespaced_config_map(name, namespace, body),
            "RayJob": lambda: self.custom.patch_namespaced_custom_object(
                RAY_GROUP, RAY_VERSION, namespace, RAY_PLURAL, name, body
            ),
        }
        patchers[kind]()

    def delete(self, kind: str, namespace: str, name: str) -> None:
        deleters: dict[str, Callable[[], Any]] = {
            "RayJob": lambda: self.custom.delete_namespaced_custom_object(
                RAY_GROUP, RAY_VERSION, namespace, RAY_PLURAL, name
            ),
            "RLHFJob": lambda: self.custom.delete_namespaced_custom_object(
                GROUP, VERSION, namespace, PLURAL, name
            ),
        }
        _missing_ok(deleters[kind])

    def patch_job_status(self, namespace: str, name: str, status: Mapping[str, Any]) -> None:
        self.custom.patch_namespaced_custom_object_status(
            GROUP, VERSION, namespace, PLURAL, name, {"status": dict(status)}
        )

    def emit_event(self, job: Mapping[str, Any], event: EventRecord) -> None:
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
        self.core.create_namespaced_event(metadata["namespace"], body)
