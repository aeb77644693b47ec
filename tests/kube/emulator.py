"""An in-memory Kubernetes API server for tests: kmock 0.8's emulator plus what an operator relies on.

``kmock.KubernetesEmulator`` stores objects and serves create/get/list/patch/delete/watch, but
the official client and kopf trip over several of its simplifications (see
``/work/shared/notes/k8s-test-stack.md``). :class:`ApiServerEmulator` keeps kmock's storage
(``emulator.objects``, with every version in ``.history``), request log (iterating the emulator
yields every ``kmock.Request``), discovery endpoints, error rendering and user reactions
(``emulator['get /x'] << 500`` still overrides responses), and replaces the parts that differ
from a real API server. Each replaced behaviour lives in its own method whose comment names the
kmock 0.8 behaviour it fixes:

=================================  ===========================================================
``_create_object``                 201 Created; server-set ``uid``, ``resourceVersion``,
                                   ``creationTimestamp``, ``generation``; namespace from the
                                   URL; ``generateName``; 409/422 Status bodies.
``_write_object``                  PUT (kmock answers 404); merge and JSON patches with
                                   ``test`` ops against the server's ``resourceVersion``;
                                   optimistic concurrency (409); no-op writes change nothing.
``_confine_to_endpoint``           the ``status`` subresource applies only ``status``; writes
                                   to the main resource never change ``status``.
``_next_generation``               ``generation`` grows on spec changes only.
``_delete_object``                 finalizers (``deletionTimestamp``) as kmock, plus a new
                                   ``resourceVersion`` and the generation bump.
``_collect_garbage``               owner-reference garbage collection, cascading.
``_serve_list``/``_serve_watch``   label and field selectors; list ``resourceVersion``; watches
                                   that start *after* a given ``resourceVersion`` (kmock replays
                                   every object as ADDED, which stalls kopf).
``_parse_namespace_paths``         ``/api/v1/namespaces[/{name}]`` (kmock's URL parser raises);
                                   the ``default`` namespace exists from the start.
``_admit``                         what kmock stores unchecked: ObjectMeta rules, each served
                                   CRD's structural schema (pruning, defaults, types, enums,
                                   bounds, required; ``status`` on its own subresource) and CEL
                                   rules with ``oldSelf`` (``kube.validation``), Kubernetes'
                                   schemas for built-ins (kubernetes-validate); 422 Status
                                   bodies listing every cause. Unknown fields are a 422 unless
                                   the request asks ``fieldValidation=Warn|Ignore`` (pruned).
=================================  ===========================================================

Threading protocol: every state change happens in :meth:`ApiServerEmulator._handle` on the
server's event loop, under kmock's ``_lock``; stored object versions are never mutated in place
(each write stores a new dict), so watch events and responses can share them without copies.
Tests on other threads may read ``emulator.objects`` and iterate requests, may register a
resource before its first request, and must change objects only through the API.

Deliberately absent (the operator does not rely on them): admission webhooks, RBAC, server-side apply (415), strategic merge (treated as a JSON merge patch, so
lists are replaced, not merged by key), foreground deletion (treated as background; orphaning
leaves the dependents' ownerReferences in place), deletecollection, paginated lists (``limit``
is ignored), namespace existence checks, watch bookmarks and history expiry (no 410 Gone).
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import copy
import dataclasses
import datetime
import functools
import json
import re
import secrets
import uuid
import warnings
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any, Final, Literal

import aiohttp.web
import attrs
import jsonpatch
import jsonpointer
import kmock
from kmock._internal import dsl, parsing, rendering

from kube.validation import BuiltinSchemas, Cause, CustomResourceSchema

# The extension reaches into kmock's internals (listed at the end of this file); any other
# version may rename them, so refuse to run on one rather than fail obscurely.
KMOCK_VERSION: Final = "0.8"
if kmock.__version__ != KMOCK_VERSION:
    raise ImportError(f"tests/kube/emulator.py extends kmock=={KMOCK_VERSION}; found {kmock.__version__}")

JsonObject = dict[str, Any]
ObjectKey = tuple[kmock.resource, str | None, str]

WRITE_METHODS: Final = frozenset({"POST", "PUT", "PATCH", "DELETE"})
ALL_VERBS: Final = frozenset({"create", "delete", "get", "list", "patch", "update", "watch"})

# Fields only the server sets; clients' values are ignored on every write.
SERVER_METADATA: Final = (
    "uid",
    "resourceVersion",
    "creationTimestamp",
    "deletionTimestamp",
    "deletionGracePeriodSeconds",
    "generation",
)
ENCODED_EVENTS_KEPT: Final = 2048
"""Watch events kept encoded (the newest): watchers that keep up read the log's tail."""
# The alphabet and length the API server uses for generateName suffixes (no vowels, no 0/1/3).
GENERATE_NAME_ALPHABET: Final = "bcdfghjklmnpqrstvwxz2456789"
GENERATE_NAME_SUFFIX_LENGTH: Final = 5


# kmock renders a KubernetesError as a `kind: Status` body with its code, reason, message and
# details. kmock's own errors say "Object Not Found" and put a traceback in `details`; clients
# (and kopf) branch on the code and people read reason/message, so these mirror the real server.


def not_found(resource: kmock.resource, name: str | None) -> kmock.KubernetesError:
    if name is None:
        return kmock.KubernetesError(
            404, "NotFound", "the server could not find the requested resource", {"kind": resource.plural}
        )
    return kmock.KubernetesError(
        404,
        "NotFound",
        f'{_group_resource(resource)} "{name}" not found',
        {"name": name, "group": resource.group, "kind": resource.plural},
    )


def already_exists(resource: kmock.resource, name: str) -> kmock.KubernetesError:
    return kmock.KubernetesError(
        409,
        "AlreadyExists",
        f'{_group_resource(resource)} "{name}" already exists',
        {"name": name, "group": resource.group, "kind": resource.plural},
    )


def conflict(resource: kmock.resource, name: str) -> kmock.KubernetesError:
    return kmock.KubernetesError(
        409,
        "Conflict",
        f'Operation cannot be fulfilled on {_group_resource(resource)} "{name}": the object has been'
        " modified; please apply your changes to the latest version and try again",
        {"name": name, "group": resource.group, "kind": resource.plural},
    )


def invalid(kind: str, name: str, field: str, message: str) -> kmock.KubernetesError:
    return kmock.KubernetesError(
        422,
        "Invalid",
        f'{kind} "{name}" is invalid: {field}: {message}',
        {
            "name": name,
            "kind": kind,
            "causes": [{"reason": "FieldValueInvalid", "message": message, "field": field}],
        },
    )


def invalid_causes(
    resource: kmock.resource, kind: str, name: str, causes: list[Cause]
) -> kmock.KubernetesError:
    """422 with every problem, in the API server's shape (``details.causes``, one per field)."""
    summary = "; ".join(f"{cause.field}: {cause.message}" for cause in causes)
    return kmock.KubernetesError(
        422,
        "Invalid",
        f'{kind}.{resource.group} "{name}" is invalid: {summary}'
        if resource.group
        else f'{kind} "{name}" is invalid: {summary}',
        {
            "name": name,
            "group": resource.group,
            "kind": kind,
            "causes": [cause.to_json() for cause in causes],
        },
    )


def bad_request(message: str) -> kmock.KubernetesError:
    return kmock.KubernetesError(400, "BadRequest", message, {"causes": [{"message": message}]})


_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_LABEL_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")


def _metadata_causes(meta: JsonObject) -> list[Cause]:
    """ObjectMeta validation every kind shares: the name, label keys and values, ownerReferences."""
    causes: list[Cause] = []
    name = meta.get("name", "")
    if not isinstance(name, str) or len(name) > 253 or not _DNS_SUBDOMAIN.match(name):
        causes.append(
            Cause(
                "FieldValueInvalid",
                f"Invalid value: {name!r}: a lowercase RFC 1123 subdomain",
                "metadata.name",
            )
        )
    for key, value in (meta.get("labels") or {}).items():
        prefix, _, label = key.rpartition("/")
        if not _LABEL_NAME.match(label) or len(label) > 63 or (prefix and not _DNS_SUBDOMAIN.match(prefix)):
            causes.append(
                Cause("FieldValueInvalid", f"Invalid value: {key!r}: not a qualified name", "metadata.labels")
            )
        if not isinstance(value, str) or len(value) > 63 or not _LABEL_VALUE.match(value):
            causes.append(
                Cause(
                    "FieldValueInvalid",
                    f"Invalid value: {value!r}: not a valid label value",
                    f"metadata.labels.{key}",
                )
            )
    for index, ref in enumerate(meta.get("ownerReferences") or []):
        for required in ("apiVersion", "kind", "name", "uid"):
            if not ref.get(required):
                causes.append(
                    Cause(
                        "FieldValueRequired",
                        "Required value",
                        f"metadata.ownerReferences[{index}].{required}",
                    )
                )
    return causes


def _group_resource(resource: kmock.resource) -> str:
    return f"{resource.plural}.{resource.group}" if resource.group else str(resource.plural)


def _api_version(resource: kmock.resource) -> str | None:
    return f"{resource.group}/{resource.version}" if resource.group else resource.version


def _now() -> str:
    return datetime.datetime.now(tz=datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


# --- selectors -------------------------------------------------------------------------------

_LABEL_REQUIREMENT = re.compile(
    r"""^\s*(?:
        !\s*(?P<absent>[\w./-]+)
      | (?P<set_key>[\w./-]+)\s+(?P<set_op>in|notin)\s*\((?P<values>[^()]*)\)
      | (?P<eq_key>[\w./-]+)\s*(?P<eq_op>==|=|!=)\s*(?P<value>[\w./-]*)
      | (?P<present>[\w./-]+)
    )\s*$""",
    re.VERBOSE,
)
_FIELD_REQUIREMENT = re.compile(r"^\s*(?P<field>[\w.]+)\s*(?P<op>==|=|!=)\s*(?P<value>[^,]*?)\s*$")
_SELECTABLE_FIELDS: Final[Mapping[str, Callable[[JsonObject], str | None]]] = {
    "metadata.name": lambda obj: obj.get("metadata", {}).get("name"),
    "metadata.namespace": lambda obj: obj.get("metadata", {}).get("namespace"),
}


def _split_requirements(selector: str) -> list[str]:
    """Split on the commas between requirements, not those inside ``in (a,b)`` value sets."""
    parts, depth, start = [], 0, 0
    for index, char in enumerate(selector):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if char == "," and depth == 0:
            parts.append(selector[start:index])
            start = index + 1
    parts.append(selector[start:])
    return [part for part in parts if part.strip()]


@dataclasses.dataclass(frozen=True)
class ObjectFilter:
    """Which objects a list or watch request sees: its namespace, name and selectors.

    Label selectors follow the API's syntax: ``a=b``, ``a==b``, ``a!=b``, ``a in (x,y)``,
    ``a notin (x,y)``, ``a`` and ``!a``, comma-separated (all must hold). Field selectors support
    ``metadata.name`` and ``metadata.namespace`` with ``=``, ``==`` and ``!=``, the fields every
    resource can select on; others are rejected with 400 as the API server does.
    """

    namespace: str | None
    name: str | None
    label_tests: tuple[Callable[[Mapping[str, str]], bool], ...] = ()
    field_tests: tuple[Callable[[JsonObject], bool], ...] = ()

    @classmethod
    def from_request(cls, request: kmock.Request) -> ObjectFilter:
        return cls(
            namespace=request.namespace,
            name=request.name,
            label_tests=tuple(map(_label_test, _split_requirements(request.params.get("labelSelector", "")))),
            field_tests=tuple(map(_field_test, _split_requirements(request.params.get("fieldSelector", "")))),
        )

    def matches(self, obj: JsonObject) -> bool:
        meta = obj.get("metadata", {})
        if self.namespace is not None and meta.get("namespace") != self.namespace:
            return False
        if self.name is not None and meta.get("name") != self.name:
            return False
        labels = meta.get("labels") or {}
        return all(test(labels) for test in self.label_tests) and all(test(obj) for test in self.field_tests)


def _label_test(requirement: str) -> Callable[[Mapping[str, str]], bool]:
    match = _LABEL_REQUIREMENT.match(requirement)
    if match is None:
        raise bad_request(f"unable to parse requirement: {requirement.strip()!r}")
    if key := match["absent"]:
        return lambda labels: key not in labels
    if key := match["present"]:
        return lambda labels: key in labels
    if key := match["set_key"]:
        values = {value.strip() for value in match["values"].split(",") if value.strip()}
        if match["set_op"] == "in":
            return lambda labels: labels.get(key) in values
        return lambda labels: labels.get(key) not in values
    key, value = match["eq_key"], match["value"]
    if match["eq_op"] == "!=":
        return lambda labels: labels.get(key) != value
    return lambda labels: key in labels and labels[key] == value


def _field_test(requirement: str) -> Callable[[JsonObject], bool]:
    match = _FIELD_REQUIREMENT.match(requirement)
    if match is None:
        raise bad_request(f"invalid field selector: {requirement.strip()!r}")
    getter = _SELECTABLE_FIELDS.get(match["field"])
    if getter is None:
        raise bad_request(f"field label not supported: {match['field']}")
    value = match["value"]
    if match["op"] == "!=":
        return lambda obj: getter(obj) != value
    return lambda obj: getter(obj) == value


# --- authorization -----------------------------------------------------------------------------


def _bearer_token(request: kmock.Request) -> str:
    header = next((v for k, v in request.headers.items() if k.lower() == "authorization"), "")
    return str(header).removeprefix("Bearer ").strip()


def _verb(request: kmock.Request) -> str:
    method = request.method.value
    if method == "GET":
        if request.name is not None:
            return "get"
        return "watch" if request.params.get("watch") in ("true", "1") else "list"
    if method == "DELETE" and request.name is None:
        return "deletecollection"
    return {"POST": "create", "PUT": "update", "PATCH": "patch", "DELETE": "delete"}.get(
        method, method.lower()
    )


def _rule_allows(rule: JsonObject, group: str, resource: str, verb: str, name: str | None) -> bool:
    """One PolicyRule of a Role, evaluated as RBAC does (``*`` wildcards; resourceNames need a name)."""
    groups, resources, verbs = (
        rule.get("apiGroups") or [],
        rule.get("resources") or [],
        rule.get("verbs") or [],
    )
    names = rule.get("resourceNames") or []
    return (
        ("*" in groups or group in groups)
        and ("*" in resources or resource in resources)
        and ("*" in verbs or verb in verbs)
        and (not names or (name is not None and name in names))
    )


# --- patches -----------------------------------------------------------------------------------


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch: objects merge recursively, ``null`` deletes, the rest replaces.

    kmock's ``patch_dict`` raises when a patch replaces a scalar by an object or vice versa,
    which a real server accepts; lists replace wholesale, as in a real merge patch.
    """
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


@dataclasses.dataclass(frozen=True)
class WatchEvent:
    """One change, as every watcher of the resource will see it.

    ``previous`` is the state before the change (``None`` when added): a watcher with a selector
    needs both states to tell "stopped matching" (DELETED for it) from "never matched" (nothing).
    """

    resource_version: int
    type: str
    previous: JsonObject | None
    current: JsonObject


WriteFault = Literal["conflict", "lost", "applied"]


@attrs.frozen
class WriteSeen:
    """A write as fault injection sees it: who (bearer token), what and where."""

    token: str
    verb: str
    plural: str
    namespace: str | None
    name: str | None


# --- the emulator ----------------------------------------------------------------------------


@attrs.define(kw_only=True)
class ApiServerEmulator(kmock.KubernetesEmulator):
    """kmock's Kubernetes emulator with server-side semantics an operator (and kopf) relies on.

    All bundled built-in resources are registered (core v1 with ConfigMap, ServiceAccount, Event,
    Pod, Namespace; rbac.authorization.k8s.io/v1; coordination.k8s.io/v1; events.k8s.io/v1; ...);
    custom resources are added with :meth:`register_custom_resource` or :meth:`register_crd`.

    The emulator must run inside ``async with emulator, kmock.Server(emulator)`` (kmock's
    protocol); the harness in ``kube.harness`` does that on a thread of its own.
    """

    _resource_version: int = attrs.field(default=0, init=False)
    _watch_logs: dict[kmock.resource, list[WatchEvent]] = attrs.field(factory=dict, init=False)
    _watch_wakeup: asyncio.Event = attrs.field(factory=asyncio.Event, init=False)
    _watches_closed: bool = attrs.field(default=False, init=False)
    # The outcome of each write, computed in _handle() and served by the fallback reactions.
    _write_results: dict[int, rendering.Payload] = attrs.field(factory=dict, init=False)
    # Every write request in arrival order, and how many requests were served (see _forget()).
    _writes: list[kmock.Request] = attrs.field(factory=list, init=False)
    request_count: int = attrs.field(default=0, init=False)
    requests_by_token: collections.Counter[tuple[str, str, str]] = attrs.field(
        factory=collections.Counter, init=False
    )
    """Requests served, by (bearer token, RBAC verb, resource plural): who read and wrote what."""
    # Admission: the schema of each served custom resource version, Kubernetes' own for the rest.
    _schemas: dict[kmock.resource, CustomResourceSchema] = attrs.field(factory=dict, init=False)
    _builtin_schemas: BuiltinSchemas = attrs.field(factory=BuiltinSchemas, init=False)
    _custom: set[kmock.resource] = attrs.field(factory=set, init=False)
    unknown_fields: str = "Strict"
    """What a write with a field no schema declares gets when the request does not say
    (``?fieldValidation=``): "Strict" answers 422, stricter than the API server's default of
    pruning with a warning, so that an operator bug cannot hide; "Warn"/"Ignore" prune."""
    validate_builtins: bool = True
    """Check built-in objects against Kubernetes' schemas (kubernetes-validate)."""
    identities: dict[str, str] = attrs.field(factory=dict)
    """Bearer token -> user name for tokens that get RBAC checks (``system:serviceaccount:NS:NAME``
    users are authorized by the Roles bound to that ServiceAccount). Any other token is an admin,
    as the harness's own clients and the operator under test are."""

    write_faults: Callable[[WriteSeen], WriteFault | None] | None = None
    """Fault injection (the e2e scenarios): asked about every write before it is applied.
    ``"conflict"`` answers 409 Conflict and changes nothing (a concurrent writer won);
    ``"lost"`` answers 503 and changes nothing (the connection died before the server got it);
    ``"applied"`` applies the write, then answers 503 (it died before the answer came back).
    The callable may also act, e.g. kill the writer's process, before it answers."""
    _watch_epoch: int = attrs.field(default=0, init=False)
    _encoded_events: collections.OrderedDict[tuple[int, str], bytes] = attrs.field(
        factory=collections.OrderedDict, init=False
    )
    _reaction_order: tuple[tuple[int, ...], list[dsl.Reaction]] = attrs.field(
        factory=lambda: ((), []), init=False
    )
    # Lookup indexes over kmock's store, so that a request costs the same with 20 or 20,000
    # objects: the keys of each resource (for lists and RBAC) and the key of each uid (for the
    # garbage collector's "does an owner still exist"). Kept by _store(); rebuilt whenever the
    # store's size says something else changed it (kmock's own writes, a test's `del`).
    _keys_by_resource: dict[kmock.resource, dict[ObjectKey, None]] = attrs.field(factory=dict, init=False)
    _key_by_uid: dict[str, ObjectKey] = attrs.field(factory=dict, init=False)
    _indexed_count: int = attrs.field(default=-1, init=False)
    # RoleBindings that have named a ServiceAccount as a subject, by (binding namespace, SA
    # namespace, SA name): candidates only, each re-checked against the binding as it is now.
    _bindings_by_subject: dict[tuple[str, str, str], set[ObjectKey]] = attrs.field(factory=dict, init=False)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        with warnings.catch_warnings():  # kmock 0.8 reads its bundle with a deprecated importlib call
            warnings.simplefilter("ignore", DeprecationWarning)
            self.resources.load_bundled()
        # Every cluster has the "default" namespace; tests and operators assume it is listed.
        namespaces = kmock.resource("", "v1", "namespaces")
        seed = kmock.Request(resource=namespaces, data={"metadata": {"name": "default"}})
        self._create_object(seed, namespaces, self.resources[namespaces])
        # kmock classifies PUT as no action at all and answers it with 404: serve replacements.
        self.fallback[kmock.method.PUT] << self._serve_write_result

    # --- registration ---------------------------------------------------------------------------

    def register_custom_resource(
        self,
        *,
        group: str,
        version: str,
        plural: str,
        kind: str,
        namespaced: bool = True,
        subresources: frozenset[str] | set[str] = frozenset(),
        shortnames: frozenset[str] | set[str] = frozenset(),
    ) -> kmock.resource:
        """Serve a custom resource as if its CRD were installed (discovery, CRUD, watch).

        ``subresources={"status"}`` gives it the status subresource, as a CRD's
        ``subresources.status: {}`` does; kopf then writes status through ``/status``.
        """
        resource = kmock.resource(group, version, plural)
        self._custom.add(resource)
        self.resources[resource] = kmock.ResourceInfo(
            kind=kind,
            singular=kind.lower(),
            namespaced=namespaced,
            verbs=set(ALL_VERBS),
            shortnames=set(shortnames),
            subresources=set(subresources),
        )
        return resource

    def register_crd(self, crd: Mapping[str, Any]) -> list[kmock.resource]:
        """Serve every served version of a CustomResourceDefinition manifest (a parsed YAML)."""
        spec = crd["spec"]
        names = spec["names"]
        registered = []
        for version in spec["versions"]:
            if not version.get("served", True):
                continue
            resource = self.register_custom_resource(
                group=spec["group"],
                version=version["name"],
                plural=names["plural"],
                kind=names["kind"],
                namespaced=spec.get("scope", "Namespaced") == "Namespaced",
                subresources={name for name in (version.get("subresources") or {}) if name == "status"},
                shortnames=set(names.get("shortNames", [])),
            )
            schema = CustomResourceSchema.from_crd_version(version)
            if schema is not None:
                self._schemas[resource] = schema
            registered.append(resource)
        return registered

    def unregister(self, resource: kmock.resource) -> None:
        """Serve ``resource`` no more, as after its CRD is deleted (requests to it answer 404)."""
        self.resources.pop(resource, None)
        self._schemas.pop(resource, None)

    # --- request routing ------------------------------------------------------------------------

    def write_requests(self) -> list[kmock.Request]:
        """Every POST/PUT/PATCH/DELETE received so far, in arrival order (for write counting)."""
        return list(self._writes)

    def close_watches(self) -> None:
        """End every open watch stream, so that the HTTP server can shut down promptly.

        Must be called on the server's loop. Without it, aiohttp waits for the streams of
        clients that never disconnect (a test's own watch) until its shutdown timeout.
        """
        self._watches_closed = True
        self._wake_watchers()

    async def _handle(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        # Replaces KubernetesEmulator._handle(), whose write bookkeeping is what the fixes below
        # change: state changes here, under kmock's lock, even when a user reaction intercepts
        # the response (kmock's documented behaviour), and the fallback reactions registered by
        # kmock (_serve_create/_update/_delete, and PUT above) serve the outcome.
        self.request_count += 1
        if request.resource is not None and request.resource.plural is not None:
            token = _bearer_token(request)
            self.requests_by_token[(token, _verb(request), request.resource.plural)] += 1
        denied = self._authorize(request)
        if denied is not None:
            self._forget(request)
            return self._forbidden_response(denied)
        if request.method.value in WRITE_METHODS:
            self._writes.append(request)
        fault = self._fault_for(request)
        if fault in ("conflict", "lost"):
            self._forget(request)
            return self._status_response(
                409 if fault == "conflict" else 503,
                "Conflict" if fault == "conflict" else "ServiceUnavailable",
                f"injected fault: {fault}",
            )
        if self._is_emulated_write(request):
            async with self._lock:
                self._write_results[id(request)] = self._apply_write(request)
        if fault == "applied":
            self._write_results.pop(id(request), None)
            self._forget(request)
            return self._status_response(503, "ServiceUnavailable", "injected fault: applied, answer lost")
        try:
            # Skip KubernetesEmulator._handle (its state changes are replaced above) and go to
            # the reactions, as kmock's own _handle does after its bookkeeping.
            return await self._react(request)
        finally:
            self._write_results.pop(id(request), None)
            self._forget(request)

    def _authorize(self, request: kmock.Request) -> kmock.KubernetesError | None:
        # Fixes kmock 0.8, which has no authorization: a request whose token names a
        # ServiceAccount is allowed only by a rule of a Role bound to it (RBAC, namespaced
        # Roles only, which is all the operator grants), else 403 Forbidden with the API
        # server's message. Discovery (no resource) is open, as to system:authenticated.
        user = self.identities.get(_bearer_token(request))
        resource = request.resource
        if user is None or resource is None or resource.plural is None:
            return None
        verb = _verb(request)
        plural = resource.plural + (f"/{request.subresource}" if request.subresource else "")
        namespace = request.namespace
        if user.startswith("system:serviceaccount:") and namespace is not None:
            sa_namespace, sa_name = user.removeprefix("system:serviceaccount:").split(":", 1)
            for rule in self._rules_for(namespace, sa_namespace, sa_name):
                if _rule_allows(rule, resource.group or "", plural, verb, request.name):
                    return None
        where = f' in the namespace "{namespace}"' if namespace else " at the cluster scope"
        target = (
            f'{_group_resource(resource)} "{request.name}"' if request.name else _group_resource(resource)
        )
        return kmock.KubernetesError(
            403,
            "Forbidden",
            f'{target} is forbidden: User "{user}" cannot {verb} resource "{plural}" in API group '
            f'"{resource.group or ""}"{where}',
            {"name": request.name or "", "group": resource.group, "kind": resource.plural},
        )

    def _rules_for(self, namespace: str, sa_namespace: str, sa_name: str) -> list[JsonObject]:
        roles = kmock.resource("rbac.authorization.k8s.io", "v1", "roles")
        self._refresh_indexes()
        candidates = sorted(self._bindings_by_subject.get((namespace, sa_namespace, sa_name), ()), key=str)
        rules: list[JsonObject] = []
        for binding in (self._live_object(key) for key in candidates):
            if binding is None or binding["metadata"].get("namespace") != namespace:
                continue
            if not any(
                s.get("kind") == "ServiceAccount"
                and s.get("name") == sa_name
                and s.get("namespace", namespace) == sa_namespace
                for s in binding.get("subjects") or []
            ):
                continue
            ref = binding.get("roleRef") or {}
            role = (
                self._live_object((roles, namespace, ref.get("name", "")))
                if ref.get("kind") == "Role"
                else None
            )
            rules += (role or {}).get("rules") or []
        return rules

    def _fault_for(self, request: kmock.Request) -> WriteFault | None:
        if self.write_faults is None or not self._is_emulated_write(request) or request.resource is None:
            return None
        return self.write_faults(
            WriteSeen(
                token=_bearer_token(request),
                verb=_verb(request),
                plural=str(request.resource.plural)
                + (f"/{request.subresource}" if request.subresource else ""),
                namespace=request.namespace,
                name=request.name,
            )
        )

    def drop_watches(self) -> None:
        """End every open watch stream once, as a restarted API server or a broken connection
        does; clients reconnect (new streams are served as usual). Call on the server's loop."""
        self._watch_epoch += 1
        self._wake_watchers()

    @staticmethod
    def _status_response(code: int, reason: str, message: str) -> aiohttp.web.Response:
        body = {
            "apiVersion": "v1",
            "kind": "Status",
            "metadata": {},
            "status": "Failure",
            "code": code,
            "reason": reason,
            "message": message,
        }
        return aiohttp.web.json_response(body, status=code)

    @staticmethod
    def _forbidden_response(error: kmock.KubernetesError) -> aiohttp.web.Response:
        body = {
            "apiVersion": "v1",
            "kind": "Status",
            "metadata": {},
            "status": "Failure",
            "code": 403,
            "reason": "Forbidden",
            "message": error.message,
            "details": error.details,
        }
        return aiohttp.web.json_response(body, status=403)

    async def _react(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        # Replaces RawHandler._handle (kmock 0.8), whose only difference is how it asks whether
        # a reaction sees the request: `request in reaction_source` applies the source's filters
        # to every request in flight (each open watch included) until it meets this one, once
        # per reaction, which made reaction matching the costliest part of every request.
        # The reactions are tried in kmock's order, with kmock's outcomes.
        for payload in self._reactions_in_order():
            if not payload._disabled.is_set() and self._reaches(payload._source, request):
                try:
                    return await payload(request)
                except rendering.ReactionMismatchError:  # a depleted stream: try the next one
                    payload._disabled.set()
                except NotImplementedError:  # matched, but has nothing to respond with
                    pass
        raise NotImplementedError(
            "no reaction matches the request; add a fallback: `emulator.fallback << 404`"
        )

    def _reactions_in_order(self) -> list[dsl.Reaction]:
        """The reactions by descending priority, as RawHandler._handle orders them (stable sort;
        shorter priority tuples padded with zeros), recomputed only when reactions change."""
        key = tuple(map(id, self._payloads))
        if self._reaction_order[0] != key:
            priorities = [tuple(-p for p in payload.priorities) for payload in self._payloads]
            width = max((len(priority) for priority in priorities), default=0)
            padded = [priority + (0,) * (width - len(priority)) for priority in priorities]
            order = sorted(range(len(padded)), key=lambda index: padded[index])
            self._reaction_order = (key, [self._payloads[index] for index in order])
        return self._reaction_order[1]

    def _reaches(self, view: dsl.View, request: kmock.Request) -> bool:
        """Whether ``view`` (a reaction's source) lets ``request`` through, as
        ``request in view`` answers: a chain of filters and priority marks over this emulator is
        decided by the filters' criteria on the request alone; anything else (slices, groups,
        exclusions, streams), whose answer depends on other requests, asks kmock."""
        current = view
        while current is not self:
            kind = type(current)
            if kind is dsl.Filter:
                if not current.criteria(request):
                    return False
            elif kind not in (dsl.Priority, dsl.Chained):
                return request in view
            current = current._source
        return True

    def _forget(self, request: kmock.Request) -> None:
        # Fixes kmock 0.8's cost per request, which grows with every request ever served: to
        # pick a reaction it checks `request in reaction_source`, which filters the whole request
        # log. A finished request is dropped from that log (writes stay in self._writes), so the
        # log holds only requests still in flight (open watches) and a request costs O(1).
        # So a reaction sliced by count (`emulator['get /x'][:1]`) counts only requests in
        # flight, and never runs out; filter by what the request says instead.
        self._requests[:] = [r for r in self._requests if r is not request]

    @staticmethod
    def _is_emulated_write(request: kmock.Request) -> bool:
        if request.resource is None or request.resource.plural is None:
            return False
        match request.method.value:
            case "POST":
                return request.name is None and request.subresource is None
            case "PUT" | "PATCH":
                return request.name is not None
            case "DELETE":
                return request.name is not None and request.subresource is None
        return False

    async def _serve_write_result(self, request: kmock.Request) -> rendering.Payload:
        if id(request) not in self._write_results:
            raise not_found(request.resource or kmock.resource(), None)
        return self._write_results[id(request)]

    # kmock registers these as its fallback reactions; they now serve what _apply_write() did.
    async def _serve_create(self, request: kmock.Request) -> rendering.Payload:
        return await self._serve_write_result(request)

    async def _serve_update(self, request: kmock.Request) -> rendering.Payload:
        return await self._serve_write_result(request)

    async def _serve_delete(self, request: kmock.Request) -> rendering.Payload:
        return await self._serve_write_result(request)

    def _apply_write(self, request: kmock.Request) -> rendering.Payload:
        resource, info = self._resource_of(request)
        match request.method.value:
            case "POST":
                return rendering.Response(status=201, payload=self._create_object(request, resource, info))
            case "DELETE":
                return self._delete_object(request, resource, info)
            case _:
                return self._write_object(request, resource, info)

    def _resource_of(self, request: kmock.Request) -> tuple[kmock.resource, kmock.ResourceInfo]:
        resource = request.resource
        if resource is None or resource not in self.resources:
            raise not_found(resource or kmock.resource(), None)
        return resource, self.resources[resource]

    # --- writes ---------------------------------------------------------------------------------

    def _create_object(
        self, request: kmock.Request, resource: kmock.resource, info: kmock.ResourceInfo
    ) -> JsonObject:
        # Fixes kmock 0.8's create: it answers 200 (the official client maps only 201 to a
        # body), stores the body as sent (no uid/resourceVersion/creationTimestamp/generation,
        # no namespace from the URL, generateName fails), and keeps a status sent on create.
        body = request.data
        if not isinstance(body, dict):
            raise bad_request("the request body must be a JSON object")
        obj: JsonObject = copy.deepcopy(body)
        meta: JsonObject = obj.setdefault("metadata", {})
        for field in SERVER_METADATA:
            meta.pop(field, None)

        if info.namespaced:
            namespace = request.namespace or meta.get("namespace")
            if request.namespace and meta.get("namespace", request.namespace) != request.namespace:
                raise bad_request(
                    "the namespace of the provided object does not match the namespace sent on the request"
                )
            if not namespace:
                raise bad_request("a namespaced object needs a namespace in the URL")
            meta["namespace"] = namespace
        else:
            namespace = None
            meta.pop("namespace", None)

        kind: str = obj.setdefault("kind", info.kind or "")
        obj.setdefault("apiVersion", _api_version(resource))
        if not meta.get("name"):
            if not meta.get("generateName"):
                raise invalid(kind, "", "metadata.name", "Required value: name or generateName is required")
            meta["name"] = self._generated_name(resource, namespace, meta["generateName"])
        key = (resource, namespace, meta["name"])
        if self._live_object(key) is not None:
            raise already_exists(resource, meta["name"])

        if "status" in info.subresources:
            obj.pop("status", None)  # status is written only through the status subresource
        obj = self._admit(request, resource, obj, None)
        meta = obj["metadata"]
        meta.update(
            uid=str(uuid.uuid4()),
            resourceVersion=self._next_resource_version(),
            creationTimestamp=_now(),
            generation=1,
        )
        self._store(key, obj)
        self._record(resource, "ADDED", None, obj)
        self._collect_if_ownerless(key, obj)
        return obj

    def _collect_if_ownerless(self, key: ObjectKey, obj: JsonObject) -> None:
        # The API server's garbage collector also deletes an object created with owner
        # references of which none exists any more (by uid): a child written by a controller
        # that had not yet seen its owner's deletion is created, then collected. The create
        # itself succeeds (the answer is 201); the object is gone right after, as in a cluster
        # a moment later.
        owner_uids = {ref.get("uid") for ref in obj["metadata"].get("ownerReferences") or []}
        if not owner_uids:
            return
        if any(self._uid_is_live(uid) for uid in owner_uids if uid):
            return
        # The index may lag an object written past _store(): confirm against the whole store.
        live_uids = {o.raw["metadata"].get("uid") for o in self._objects.values() if not o.deleted}
        if not owner_uids & live_uids:
            self._delete(key, obj, propagation="Background")

    def _admit(
        self, request: kmock.Request, resource: kmock.resource, obj: JsonObject, old: JsonObject | None
    ) -> JsonObject:
        # Fixes kmock 0.8, which stores whatever it is sent: metadata, the CRD's structural
        # schema (pruning, defaults, types, CEL with oldSelf) or Kubernetes' own schema are
        # checked as the API server does (kube.validation), and a violation is a 422 whose
        # Status lists every cause. Deletion in progress is not re-validated (finalizer removal
        # must always succeed, as on the real server).
        kind = str(obj.get("kind") or resource.plural)
        name = str(obj["metadata"].get("name", ""))
        causes = _metadata_causes(obj["metadata"])
        mode = request.params.get("fieldValidation") or self.unknown_fields
        if resource in self._schemas:
            stored, schema_causes = self._schemas[resource].admit(
                obj, old, subresource=request.subresource, strict_fields=mode == "Strict"
            )
            obj = {**stored, "metadata": obj["metadata"]}
            causes += schema_causes
        elif self.validate_builtins and resource not in self._custom:
            causes += self._builtin_schemas.causes(obj)
        if causes and not (old is not None and old["metadata"].get("deletionTimestamp")):
            raise invalid_causes(resource, kind, name, causes)
        return obj

    def _generated_name(self, resource: kmock.resource, namespace: str | None, prefix: str) -> str:
        while True:
            suffix = "".join(
                secrets.choice(GENERATE_NAME_ALPHABET) for _ in range(GENERATE_NAME_SUFFIX_LENGTH)
            )
            if self._live_object((resource, namespace, prefix + suffix)) is None:
                return prefix + suffix

    def _write_object(
        self, request: kmock.Request, resource: kmock.resource, info: kmock.ResourceInfo
    ) -> JsonObject:
        # Fixes kmock 0.8's updates: PUT answers 404; patches apply to the body verbatim (a JSON
        # patch's `test` op on /metadata/resourceVersion meets whatever the client once sent),
        # the status endpoint applies spec too, and every write is a new version and a watch
        # event, even when nothing changed.
        assert request.name is not None  # _is_emulated_write() routes only named writes here
        if request.subresource not in (None, "status") or (
            request.subresource == "status" and "status" not in info.subresources
        ):
            raise not_found(resource, request.name)
        key = self._object_key(resource, info, request.namespace, request.name)
        old = self._live_object(key)
        if old is None:
            raise not_found(resource, request.name)

        if request.method.value == "PUT":
            new = self._replacement(request, resource, old)
        else:
            new = self._patched(request, resource, old)
        new = self._confine_to_endpoint(old, new, request.subresource, info)
        new = self._with_server_metadata(old, new)
        new = self._admit(request, resource, new, old)
        if new == old:
            return old  # a no-op write: same resourceVersion, no watch event, as the real server

        new["metadata"]["generation"] = self._next_generation(old, new, info)
        new["metadata"]["resourceVersion"] = self._next_resource_version()
        self._store(key, new)
        self._record(resource, "MODIFIED", old, new)
        if new["metadata"].get("deletionTimestamp") and not new["metadata"].get("finalizers"):
            self._remove(key, new, propagation="Background")
        return new

    def _replacement(self, request: kmock.Request, resource: kmock.resource, old: JsonObject) -> JsonObject:
        body = request.data
        if not isinstance(body, dict):
            raise bad_request("the request body must be a JSON object")
        meta = body.get("metadata") or {}
        if meta.get("name", request.name) != request.name:
            raise bad_request(
                f"the name of the object ({meta.get('name')}) does not match the name on the URL ({request.name})"
            )
        self._check_precondition(resource, old, meta.get("resourceVersion"))
        return copy.deepcopy(body)

    def _patched(self, request: kmock.Request, resource: kmock.resource, old: JsonObject) -> JsonObject:
        content_type = next(
            (value for header, value in request.headers.items() if header.lower() == "content-type"), ""
        )
        media_type = content_type.split(";")[0].strip()
        if media_type == "application/json-patch+json":
            if not isinstance(request.data, list):
                raise bad_request("a JSON patch must be a list of operations")
            try:
                patched: JsonObject = jsonpatch.apply_patch(copy.deepcopy(old), request.data)
            except (jsonpatch.JsonPatchException, jsonpointer.JsonPointerException) as e:
                # The API server answers 422 for a failed `test` op or a missing path.
                raise kmock.KubernetesError(
                    422, "Invalid", f"the server rejected our request: {e}", {"causes": [{"message": str(e)}]}
                ) from e
            return patched
        if media_type in ("application/merge-patch+json", "application/strategic-merge-patch+json"):
            if not isinstance(request.data, dict):
                raise bad_request("a merge patch must be a JSON object")
            self._check_precondition(
                resource, old, (request.data.get("metadata") or {}).get("resourceVersion")
            )
            merged: JsonObject = merge_patch(old, request.data)
            return merged
        raise kmock.KubernetesError(
            415,
            "UnsupportedMediaType",
            f"the patch type {media_type!r} is not supported",
            {"kind": resource.plural},
        )

    @staticmethod
    def _check_precondition(resource: kmock.resource, old: JsonObject, resource_version: str | None) -> None:
        """A write that names a resourceVersion applies only to that version (409 otherwise)."""
        if resource_version is not None and resource_version != old["metadata"]["resourceVersion"]:
            raise conflict(resource, old["metadata"]["name"])

    @staticmethod
    def _confine_to_endpoint(
        old: JsonObject, new: JsonObject, subresource: str | None, info: kmock.ResourceInfo
    ) -> JsonObject:
        # Fixes kmock 0.8: its status endpoint applies the whole body (spec included), and a
        # write to the main resource changes status too. With a status subresource, the real
        # server takes only `status` from /status writes and everything but `status` from the
        # main resource (apiextensions' status strategy); without one, status is a plain field.
        if "status" not in info.subresources:
            return new
        if subresource == "status":
            confined = copy.deepcopy(old)
            source = new
        else:
            confined = new
            source = old
        if "status" in source:
            confined["status"] = copy.deepcopy(source["status"])
        else:
            confined.pop("status", None)
        return confined

    @staticmethod
    def _with_server_metadata(old: JsonObject, new: JsonObject) -> JsonObject:
        """Keep what only the server sets (and the identity) from the stored object."""
        # A fresh metadata dict: a merge patch shares untouched sub-dicts with the stored object.
        meta = new["metadata"] = dict(new["metadata"]) if isinstance(new.get("metadata"), dict) else {}
        old_meta = old["metadata"]
        for field in (*SERVER_METADATA, "name", "namespace"):
            if field in old_meta:
                meta[field] = old_meta[field]
            else:
                meta.pop(field, None)
        new["apiVersion"], new["kind"] = old["apiVersion"], old["kind"]
        return new

    @staticmethod
    def _next_generation(old: JsonObject, new: JsonObject, info: kmock.ResourceInfo) -> int:
        # Fixes kmock 0.8, which has no generation: it grows when anything but metadata (and
        # status, with a status subresource) changes, so metadata-only and status writes keep it,
        # and once when deletion starts (markAsDeleting() in the API server).
        generation = int(old["metadata"].get("generation", 1))
        ignored = {"metadata", "status"} if "status" in info.subresources else {"metadata"}
        spec_changed = {k: v for k, v in old.items() if k not in ignored} != {
            k: v for k, v in new.items() if k not in ignored
        }
        deletion_started = bool(new["metadata"].get("deletionTimestamp")) and not old["metadata"].get(
            "deletionTimestamp"
        )
        return generation + 1 if spec_changed or deletion_started else generation

    def _delete_object(
        self, request: kmock.Request, resource: kmock.resource, info: kmock.ResourceInfo
    ) -> JsonObject:
        # Keeps kmock 0.8's finalizer semantics (deletionTimestamp while finalizers remain;
        # removing the last one deletes) and adds what kmock lacks: a new resourceVersion on
        # each change, the generation bump, and garbage collection of dependents.
        assert request.name is not None  # _is_emulated_write() routes only named deletes here
        key = self._object_key(resource, info, request.namespace, request.name)
        old = self._live_object(key)
        if old is None:
            raise not_found(resource, request.name)
        options = request.data if isinstance(request.data, dict) else {}
        propagation = (
            request.params.get("propagationPolicy") or options.get("propagationPolicy") or "Background"
        )
        self._check_precondition(resource, old, (options.get("preconditions") or {}).get("resourceVersion"))
        return self._delete(key, old, propagation=propagation)

    def _delete(self, key: ObjectKey, old: JsonObject, *, propagation: str) -> JsonObject:
        if old["metadata"].get("deletionTimestamp"):
            return old  # already being deleted: waiting for its finalizers
        if not old["metadata"].get("finalizers"):
            return self._remove(key, old, propagation=propagation)
        new = copy.deepcopy(old)
        new["metadata"].update(deletionTimestamp=_now(), deletionGracePeriodSeconds=0)
        new["metadata"]["generation"] = self._next_generation(old, new, self.resources[key[0]])
        new["metadata"]["resourceVersion"] = self._next_resource_version()
        self._store(key, new)
        self._record(key[0], "MODIFIED", old, new)
        return new

    def _remove(self, key: ObjectKey, last: JsonObject, *, propagation: str) -> JsonObject:
        gone = copy.deepcopy(last)
        gone["metadata"]["resourceVersion"] = self._next_resource_version()
        self._objects[key].delete()  # kmock's soft deletion: the history stays for assertions
        self._record(key[0], "DELETED", last, gone)
        if propagation != "Orphan":
            self._collect_garbage(gone)
        return gone

    def _collect_garbage(self, owner: JsonObject) -> None:
        # Fixes kmock 0.8, which has no garbage collector: when an owner is removed, each object
        # whose ownerReferences now all point at removed objects is deleted (finalizers apply,
        # and its own dependents follow when it is removed). Objects in a removed Namespace go
        # too. Synchronous, i.e. background propagation that happens to finish before the reply.
        live = [(key, obj.raw) for key, obj in list(self._objects.items()) if not obj.deleted]
        live_uids = {raw["metadata"].get("uid") for _, raw in live}
        owner_uid = owner["metadata"].get("uid")
        removed_namespace = owner["metadata"]["name"] if owner.get("kind") == "Namespace" else None
        for key, raw in live:
            owner_uids = {ref.get("uid") for ref in raw["metadata"].get("ownerReferences") or []}
            orphaned = owner_uid in owner_uids and not owner_uids & live_uids
            if orphaned or (removed_namespace is not None and key[1] == removed_namespace):
                current = self._live_object(key)  # re-read: a cascade may have removed it already
                if current is not None:
                    self._delete(key, current, propagation="Background")

    # --- storage and the watch log --------------------------------------------------------------

    def _object_key(
        self, resource: kmock.resource, info: kmock.ResourceInfo, namespace: str | None, name: str
    ) -> ObjectKey:
        return resource, namespace if info.namespaced else None, name

    def _live_object(self, key: ObjectKey) -> JsonObject | None:
        if key not in self._objects or self._objects[key].deleted:
            return None
        return self._objects[key].raw

    def _store(self, key: ObjectKey, obj: JsonObject) -> None:
        self._refresh_indexes()
        self._index_subjects(key, obj)
        if key in self._objects:
            self._objects[key].history.append(obj)
        else:
            self._objects[key] = obj
            self._keys_by_resource.setdefault(key[0], {})[key] = None
            self._indexed_count += 1
        uid = obj.get("metadata", {}).get("uid")
        if uid:
            self._key_by_uid[uid] = key

    def _index_subjects(self, key: ObjectKey, obj: JsonObject) -> None:
        if key[0].group != "rbac.authorization.k8s.io" or key[0].plural != "rolebindings":
            return
        namespace = key[1] or ""
        for subject in obj.get("subjects") or []:
            if subject.get("kind") == "ServiceAccount":
                where = (namespace, subject.get("namespace", namespace), subject.get("name", ""))
                self._bindings_by_subject.setdefault(where, set()).add(key)

    def _refresh_indexes(self) -> None:
        """Rebuild the lookup indexes if the store changed other than through _store()."""
        if self._indexed_count == len(self._objects):
            return
        self._keys_by_resource = {}
        self._key_by_uid = {}
        self._bindings_by_subject = {}
        for key, stored in list(self._objects.items()):
            self._keys_by_resource.setdefault(key[0], {})[key] = None
            if stored.deleted:
                continue
            self._index_subjects(key, stored.raw)
            uid = stored.raw.get("metadata", {}).get("uid")
            if uid:
                self._key_by_uid[uid] = key
        self._indexed_count = len(self._objects)

    def _uid_is_live(self, uid: str) -> bool:
        """Whether an object with this uid exists now (by the index; a miss is not proof)."""
        self._refresh_indexes()
        key = self._key_by_uid.get(uid)
        current = self._live_object(key) if key is not None else None
        return current is not None and current["metadata"].get("uid") == uid

    def _next_resource_version(self) -> str:
        # One counter for all resources, like etcd's revision: monotonic across every write.
        self._resource_version += 1
        return str(self._resource_version)

    def _record(
        self, resource: kmock.resource, type: str, previous: JsonObject | None, current: JsonObject
    ) -> None:
        event = WatchEvent(int(current["metadata"]["resourceVersion"]), type, previous, current)
        self._watch_logs.setdefault(resource, []).append(event)
        self._wake_watchers()

    def _wake_watchers(self) -> None:
        # Each waiting watcher holds the Event it saw; setting it and starting a fresh one
        # wakes exactly those that had caught up. Single-threaded (the server's loop): no lock.
        self._watch_wakeup.set()
        self._watch_wakeup = asyncio.Event()

    # --- reads ----------------------------------------------------------------------------------

    async def _serve_fetch(self, request: kmock.Request) -> rendering.Payload:
        # Adds the 404 Status shape of the real server, and GET on the status subresource.
        resource, info = self._resource_of(request)
        assert request.name is not None  # kmock classifies only named GETs as FETCH
        if request.subresource not in (None, "status") or (
            request.subresource == "status" and "status" not in info.subresources
        ):
            raise not_found(resource, request.name)
        obj = self._live_object(self._object_key(resource, info, request.namespace, request.name))
        if obj is None:
            raise not_found(resource, request.name)
        return obj

    async def _serve_list(self, request: kmock.Request) -> rendering.Payload:
        # Fixes kmock 0.8's list: label selectors are ignored, the list's resourceVersion is
        # "...", and /api/v1/namespaces cannot be listed (see _parse_namespace_paths).
        resource, info = self._resource_of(request)
        object_filter = ObjectFilter.from_request(request)
        return {
            "apiVersion": _api_version(resource),
            "kind": f"{info.kind}List",
            "metadata": {"resourceVersion": str(self._resource_version)},
            "items": [obj for obj in self._live_objects(resource) if object_filter.matches(obj)],
        }

    def objects_of(self, group: str, plural: str) -> list[JsonObject]:
        """Every existing object of a resource (any version), for tests on other threads: a
        read of the resource index instead of a scan of every stored object (reading only, since
        the server's loop may be changing the index: copies taken in one step each)."""
        return [
            raw
            for resource, keys in list(self._keys_by_resource.items())
            if resource.group == group and resource.plural == plural
            for raw in (self._live_object(key) for key in list(keys))
            if raw is not None
        ]

    def _live_objects(self, resource: kmock.resource) -> list[JsonObject]:
        """The resource's existing objects, ordered by namespace and name (etcd's key order)."""
        self._refresh_indexes()
        keys = list(self._keys_by_resource.get(resource, {}))
        live = [raw for raw in (self._live_object(key) for key in keys) if raw is not None]
        return sorted(live, key=lambda raw: (raw["metadata"].get("namespace") or "", raw["metadata"]["name"]))

    async def _serve_watch(self, request: kmock.Request) -> AsyncIterator[rendering.Payload]:
        # Fixes kmock 0.8's watch, which ignores resourceVersion and selectors and replays every
        # existing object as ADDED on each (re)connection: kopf then sees stale ADDED events and
        # stalls on 422s. Here, with ?resourceVersion=N only later events come (what kopf
        # asks for after its list); without one (or "0"), the current objects come as ADDED
        # first, as from the real server. timeoutSeconds ends the stream; selectors filter it,
        # and an object that stops matching arrives as DELETED, as it does from the API server.
        resource, info = self._resource_of(request)
        object_filter = ObjectFilter.from_request(request)
        since = request.params.get("resourceVersion") or "0"
        if not since.isdigit():
            raise bad_request(f"invalid resourceVersion: {since!r}")
        timeout = float(request.params["timeoutSeconds"]) if "timeoutSeconds" in request.params else None
        initial_events = since == "0" or request.params.get("sendInitialEvents") == "true"
        log = self._watch_logs.setdefault(resource, [])
        if initial_events:
            start = self._resource_version
            initial = [
                {"type": "ADDED", "object": obj}
                for obj in self._live_objects(resource)
                if object_filter.matches(obj)
            ]
        else:
            start, initial = int(since), []
        position = bisect.bisect_right(log, start, key=lambda event: event.resource_version)

        yield b""  # send the headers now: a client waits for them before reading any event
        for event in initial:
            yield event
        if request.params.get("sendInitialEvents") == "true":
            yield {
                "type": "BOOKMARK",
                "object": {
                    "kind": info.kind,
                    "apiVersion": _api_version(resource),
                    "metadata": {
                        "resourceVersion": str(start),
                        "annotations": {"k8s.io/initial-events-end": "true"},
                    },
                },
            }

        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        epoch = self._watch_epoch
        while not self._watches_closed and epoch == self._watch_epoch:
            while position < len(log):
                event = log[position]
                seen_as = self._as_seen_by(object_filter, event)
                position += 1
                if seen_as is not None:
                    yield self._encoded(event, seen_as)
            wakeup = self._watch_wakeup  # taken after the last check: no event can slip between
            remaining = None if deadline is None else deadline - loop.time()
            if remaining is not None and remaining <= 0:
                return
            try:
                await asyncio.wait_for(wakeup.wait(), remaining)
            except TimeoutError:
                return

    @staticmethod
    def _as_seen_by(object_filter: ObjectFilter, event: WatchEvent) -> str | None:
        """The event's type for a watcher with ``object_filter`` (None: it does not see it)."""
        matched_before = event.previous is not None and object_filter.matches(event.previous)
        matches_now = object_filter.matches(event.current)
        if event.type == "DELETED":
            return "DELETED" if matched_before else None
        if matched_before and matches_now:
            return event.type
        if matches_now:
            return "ADDED"
        if matched_before:
            return "DELETED"
        return None

    def _encoded(self, event: WatchEvent, seen_as: str) -> bytes:
        # One JSON line per event and type, shared by every watcher that sees it so (kmock
        # encodes each yielded dict for each watcher: with an operator's and a controller's
        # watch on the same resource, every event was encoded twice). Bytes go out as they are.
        key = (event.resource_version, seen_as)
        line = self._encoded_events.get(key)
        if line is None:
            line = json.dumps({"type": seen_as, "object": event.current}).encode("utf-8") + b"\n"
            self._encoded_events[key] = line
            if len(self._encoded_events) > ENCODED_EVENTS_KEPT:
                self._encoded_events.popitem(last=False)
        return line


# --- kmock's URL parser ------------------------------------------------------------------------

_NAMESPACE_PATH = re.compile(
    r"^/api/v1/namespaces(?:/(?P<name>[^/]+)(?:/(?P<subresource>status|finalize))?)?/?$"
)
# Re-importing this module must not wrap the wrapper: functools.wraps keeps kmock's original.
_kmock_parse_path = getattr(parsing.parse_path, "__wrapped__", parsing.parse_path)


@functools.wraps(_kmock_parse_path)
def _parse_namespace_paths(path: str) -> parsing.ParsedPath:
    # Fixes kmock 0.8's parse_path(), which reads the segment after "namespaces" as the
    # namespace of a namespaced resource: "/api/v1/namespaces" raises (every request to it gets
    # a 500) and "/api/v1/namespaces/ns1" is parsed as namespace "ns1" with no resource. The
    # Namespace resource is cluster-scoped: parse those paths as such, and defer to kmock for
    # every other path. Installed process-wide (rendering calls parsing.parse_path), which only
    # changes paths kmock could not parse.
    match = _NAMESPACE_PATH.match(path)
    if match is None:
        return _kmock_parse_path(path)
    return parsing.ParsedPath(
        group="", version="v1", plural="namespaces", name=match["name"], subresource=match["subresource"]
    )


parsing.parse_path = _parse_namespace_paths

# The kmock internals used above, for whoever upgrades kmock: KubernetesEmulator._handle,
# ._serve_create/_update/_delete/_list/_watch/_fetch (registered as fallbacks by name),
# ._lock and ._objects; RawHandler._handle (replaced by _react: ._payloads, Reaction.priorities,
# ._source, ._disabled, ReactionMismatchError; dsl.Filter/Priority/Chained and Filter.criteria);
# rendering.Response (a status with a payload); parsing.parse_path and parsing.ParsedPath.
__all__ = ["ApiServerEmulator", "ObjectFilter", "WatchEvent", "merge_patch"]
