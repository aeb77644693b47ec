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
``compact``                        410 Gone: etcd compaction (:meth:`compact`) and a bounded
                                   event history (``watch_history_limit``); a watch from an older
                                   ``resourceVersion`` gets one ``ERROR`` event (``Expired``,
                                   "too old resource version: X (Y)") and ends; an ``Exact`` list
                                   from before the compaction answers 410.
``_parse_namespace_paths``         ``/api/v1/namespaces[/{name}]`` (kmock's URL parser raises);
                                   the ``default`` namespace exists from the start.
``_admit``                         what kmock stores unchecked: ObjectMeta rules, each served
                                   CRD's structural schema (pruning, defaults, types, enums,
                                   bounds, required; ``status`` on its own subresource) and CEL
                                   rules with ``oldSelf`` (``kube.validation``), Kubernetes'
                                   schemas for built-ins (kubernetes-validate); 422 Status
                                   bodies listing every cause. Unknown fields are a 422 unless
                                   the request asks ``fieldValidation=Warn|Ignore`` (pruned).
                                   A binding's ``roleRef`` cannot change.
``_authorize``                     RBAC for the tokens in ``identities`` (any other token is an
                                   admin): Roles and ClusterRoles, bound by RoleBindings (in
                                   their namespace) and ClusterRoleBindings (everywhere, and the
                                   only grant for cluster-scoped resources) to User, Group and
                                   ServiceAccount subjects; ``resourceNames``, subresources
                                   (``rlhfjobs/status``, ``*/status``), ``*``; 403 Status bodies
                                   worded as the API server's. Discovery stays open.
``_prevent_escalation``            RBAC escalation prevention: writing a Role or ClusterRole
                                   needs every permission it grants (or ``escalate``), writing
                                   a binding every permission of its role (or ``bind``).
``_enforce_owner_references``      the OwnerReferencesPermissionEnforcement admission plugin:
                                   ``blockOwnerDeletion`` needs ``update`` on the owner's
                                   ``finalizers``; changing ownerReferences needs ``delete``
                                   (``owner_references_permission_enforcement`` turns it off).
``_call_webhooks``                 validating admission webhooks (``validating_webhooks``, a
                                   list of :class:`ValidatingWebhook`): callables asked about
                                   each matching CREATE/UPDATE after schema admission, by any
                                   user; a message denies it with 403, as a webhook does.
=================================  ===========================================================

Each rule of kube-apiserver names, where it is implemented, the Go function it follows
(Kubernetes v1.3x). ``tests/integration/test_api_server_rules.py`` shows each one.

Threading protocol: every state change happens in :meth:`ApiServerEmulator._handle` on the
server's event loop, under kmock's ``_lock``; stored object versions are never mutated in place
(each write stores a new dict), so watch events and responses can share them without copies.
Tests on other threads may read ``emulator.objects`` and iterate requests, may register a
resource (or set ``identities``, ``validating_webhooks``) before its first request, and must
change objects only through the API, or through ``EmulatedCluster.run_on_server`` (which runs
a function on the server's loop: ``watch_gap``, ``compact``, :meth:`delete_stored_object`).

Deliberately absent (the operator does not rely on them): admission webhooks over HTTP (the
callables above stand in for them; no mutating webhooks), RBAC's bootstrap roles (no
``system:discovery`` and the like: only the roles a test creates grant anything),
``nonResourceURLs`` authorization (non-resource paths are open to everyone),
ClusterRole aggregation (``aggregationRule`` is stored, never evaluated), impersonation and
access reviews, server-side apply (415), strategic merge (treated as a JSON merge patch, so
lists are replaced, not merged by key), foreground deletion (treated as background; orphaning
leaves the dependents' ownerReferences in place), deletecollection, paginated lists (``limit``
is ignored), historical reads (a list at an older ``resourceVersion`` serves the current
objects, unless it is compacted), namespace existence checks, watch bookmarks.
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
from collections.abc import Set as AbstractSet
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


RBAC_GROUP: Final = "rbac.authorization.k8s.io"
SERVICE_ACCOUNT_USER_PREFIX: Final = "system:serviceaccount:"
ROLES: Final = kmock.resource(RBAC_GROUP, "v1", "roles")
CLUSTER_ROLES: Final = kmock.resource(RBAC_GROUP, "v1", "clusterroles")
ROLE_RESOURCES: Final = {"Role": "roles", "ClusterRole": "clusterroles"}
BINDING_RESOURCES: Final = frozenset({"rolebindings", "clusterrolebindings"})
# A subject as the bindings index keys it: ("User", name), ("Group", name) or
# ("ServiceAccount", "namespace/name").
SubjectKey = tuple[str, str]


@dataclasses.dataclass(frozen=True)
class UserInfo:
    """Who sent a request, as authentication hands it to the authorizer: a name and groups."""

    name: str
    groups: tuple[str, ...]

    @classmethod
    def named(cls, name: str, extra_groups: tuple[str, ...] | list[str] = ()) -> UserInfo:
        # k8s.io/apiserver/pkg/authentication/serviceaccount UserInfo()/MakeGroupNames(): a
        # ServiceAccount's token is user system:serviceaccount:NS:NAME in the groups
        # system:serviceaccounts and system:serviceaccounts:NS; every authenticated user then
        # gets system:authenticated (pkg/authentication/group AuthenticatedGroupAdder).
        groups: list[str] = []
        if name.startswith(SERVICE_ACCOUNT_USER_PREFIX):
            namespace = name.removeprefix(SERVICE_ACCOUNT_USER_PREFIX).partition(":")[0]
            groups += ["system:serviceaccounts", f"system:serviceaccounts:{namespace}"]
        groups += [group for group in extra_groups if group not in groups]
        if "system:authenticated" not in groups:
            groups.append("system:authenticated")
        return cls(name, tuple(groups))

    def subject_keys(self) -> list[SubjectKey]:
        """Every binding subject that names this user (see :func:`_subject_key`)."""
        keys = [("User", self.name)] + [("Group", group) for group in self.groups]
        if self.name.startswith(SERVICE_ACCOUNT_USER_PREFIX):
            namespace, _, name = self.name.removeprefix(SERVICE_ACCOUNT_USER_PREFIX).partition(":")
            keys.append(("ServiceAccount", f"{namespace}/{name}"))
        return keys


def _subject_key(subject: JsonObject, binding_namespace: str) -> SubjectKey | None:
    # pkg/registry/rbac/validation/rule.go appliesToUser(): a User subject matches by name, a
    # Group by membership, a ServiceAccount by its namespace (defaulting to the binding's, so a
    # ClusterRoleBinding's must name one) and name; other kinds match nobody.
    kind, name = subject.get("kind"), str(subject.get("name", ""))
    if kind in ("User", "Group"):
        return kind, name
    if kind == "ServiceAccount":
        namespace = subject.get("namespace") or binding_namespace
        return ("ServiceAccount", f"{namespace}/{name}") if namespace else None
    return None


@dataclasses.dataclass(frozen=True)
class Attributes:
    """What a request asks to do, as the authorizer sees it (``authorizer.AttributesRecord``)."""

    verb: str
    group: str
    resource: str
    subresource: str = ""
    name: str = ""
    namespace: str = ""  # "" for cluster-scoped resources and requests across all namespaces


def _resource_matches(resources: list[str], combined: str, subresource: str) -> bool:
    # pkg/apis/rbac/v1/evaluation_helpers.go ResourceMatches(): "*", the exact resource (with
    # its subresource: "rlhfjobs/status"), or "*/status" for that subresource of any resource.
    return any(
        resource in ("*", combined) or (bool(subresource) and resource == f"*/{subresource}")
        for resource in resources
    )


def _rule_allows(rule: JsonObject, attributes: Attributes) -> bool:
    # plugin/pkg/auth/authorizer/rbac/rbac.go RuleAllows() for resource requests, with
    # VerbMatches/APIGroupMatches/ResourceMatches/ResourceNameMatches (evaluation_helpers.go):
    # "*" wildcards; a rule with resourceNames allows only requests naming one of them (so no
    # create, and list/watch only with a metadata.name field selector).
    verbs, groups = rule.get("verbs") or [], rule.get("apiGroups") or []
    names = rule.get("resourceNames") or []
    combined = attributes.resource + (f"/{attributes.subresource}" if attributes.subresource else "")
    return (
        ("*" in verbs or attributes.verb in verbs)
        and ("*" in groups or attributes.group in groups)
        and _resource_matches(rule.get("resources") or [], combined, attributes.subresource)
        and (not names or attributes.name in names)
    )


def _breakdown(rule: JsonObject) -> list[JsonObject]:
    # pkg/registry/rbac/validation/policy_comparator.go BreakdownRule(): one rule per group,
    # resource, verb (and resource name); non-resource URLs combine with verbs only.
    names = rule.get("resourceNames") or []
    subrules = [
        {"apiGroups": [group], "resources": [resource], "verbs": [verb]}
        | ({"resourceNames": [name]} if name is not None else {})
        for group in rule.get("apiGroups") or []
        for resource in rule.get("resources") or []
        for verb in rule.get("verbs") or []
        for name in (names or [None])
    ]
    subrules += [
        {"nonResourceURLs": [url], "verbs": [verb]}
        for url in rule.get("nonResourceURLs") or []
        for verb in rule.get("verbs") or []
    ]
    return subrules


def _resources_cover(owned: list[str], wanted: list[str]) -> bool:
    # policy_comparator.go resourceCoversAll(): "*", each resource itself, or "*/sub" for a
    # subresource.
    if "*" in owned:
        return True
    return all(
        resource in owned or ("/" in resource and "*/" + resource.split("/", 1)[1] in owned)
        for resource in wanted
    )


def _urls_cover(owned: list[str], wanted: list[str]) -> bool:
    # policy_comparator.go nonResourceURLsCoversAll()/nonResourceURLCovers(): exact, or a
    # trailing "*" prefix.
    return all(
        any(path == url or (path.endswith("*") and url.startswith(path.rstrip("*"))) for path in owned)
        for url in wanted
    )


def _rule_covers(owner: JsonObject, subrule: JsonObject) -> bool:
    # policy_comparator.go ruleCovers(): the owner rule holds the (broken-down) subrule.
    def holds(field: str) -> bool:
        owned = owner.get(field) or []
        return "*" in owned or set(subrule.get(field) or []) <= set(owned)

    owner_names, wanted_names = owner.get("resourceNames") or [], subrule.get("resourceNames") or []
    names = not owner_names or (bool(wanted_names) and set(wanted_names) <= set(owner_names))
    return (
        holds("verbs")
        and holds("apiGroups")
        and _resources_cover(owner.get("resources") or [], subrule.get("resources") or [])
        and _urls_cover(owner.get("nonResourceURLs") or [], subrule.get("nonResourceURLs") or [])
        and names
    )


def _uncovered(owner_rules: list[JsonObject], rules: list[JsonObject]) -> list[JsonObject]:
    """policy_comparator.go Covers(): the broken-down rules that no owner rule covers."""
    return [
        subrule
        for rule in rules
        for subrule in _breakdown(rule)
        if not any(_rule_covers(owner, subrule) for owner in owner_rules)
    ]


def _compact_rules(rules: list[JsonObject]) -> list[JsonObject]:
    # pkg/registry/rbac/validation/policy_compact.go CompactRules(): rules of one group and one
    # resource (and at most one name) that differ only by verb are merged, for the message.
    compacted: list[JsonObject] = []
    simple: dict[tuple[str, str, str | None], JsonObject] = {}
    for rule in rules:
        names = rule.get("resourceNames") or []
        groups, resources = rule.get("apiGroups") or [], rule.get("resources") or []
        if len(names) > 1 or rule.get("nonResourceURLs") or len(groups) != 1 or len(resources) != 1:
            compacted.append(rule)
            continue
        key = (groups[0], resources[0], names[0] if names else None)
        if key in simple:
            simple[key]["verbs"] = simple[key]["verbs"] + list(rule.get("verbs") or [])
        else:
            simple[key] = copy.deepcopy(rule)
    return compacted + list(simple.values())


def _go_strings(values: tuple[str, ...] | list[str]) -> str:
    """A []string as Go's %q prints it: ["a" "b"]."""
    return "[" + " ".join(json.dumps(value) for value in values) + "]"


def _compact_string(rule: JsonObject) -> str:
    # pkg/apis/rbac/v1/evaluation_helpers.go CompactString().
    parts = [
        f"{label}:{_go_strings(rule[field])}"
        for label, field in (
            ("APIGroups", "apiGroups"),
            ("Resources", "resources"),
            ("NonResourceURLs", "nonResourceURLs"),
            ("ResourceNames", "resourceNames"),
            ("Verbs", "verbs"),
        )
        if rule.get(field)
    ]
    return "{" + ", ".join(parts) + "}"


def _aggregate(errors: list[str]) -> str:
    """Go's utilerrors.NewAggregate(errs).Error(): one message alone, several in brackets."""
    unique = list(dict.fromkeys(errors))
    return unique[0] if len(unique) == 1 else "[" + ", ".join(unique) + "]"


def _only_gc_fields_change(new: JsonObject, old: JsonObject) -> bool:
    # pkg/registry/rbac/helpers.go IsOnlyMutatingGCFields(): the write changes nothing but
    # ownerReferences and finalizers (and managedFields), as the garbage collector's do.
    meta = dict(new.get("metadata") or {})
    old_meta = old.get("metadata") or {}
    for field in ("ownerReferences", "finalizers", "managedFields", "selfLink"):
        if field in old_meta:
            meta[field] = old_meta[field]
        else:
            meta.pop(field, None)
    return {**new, "metadata": meta} == old


def _field_selector_name(selector: str) -> str:
    """The name a list/watch's ``metadata.name=`` field selector requires ("" if none)."""
    for requirement in _split_requirements(selector):
        match = _FIELD_REQUIREMENT.match(requirement)
        if match is not None and match["field"] == "metadata.name" and match["op"] != "!=":
            return str(match["value"])
    return ""


def forbidden(resource: kmock.resource, name: str, message: str) -> kmock.KubernetesError:
    """403 as ``errors.NewForbidden(groupResource, name, err)`` words it."""
    target = f'{_group_resource(resource)} "{name}"' if name else _group_resource(resource)
    return kmock.KubernetesError(
        403,
        "Forbidden",
        f"{target} is forbidden: {message}",
        {"name": name, "group": resource.group, "kind": resource.plural},
    )


@dataclasses.dataclass(frozen=True)
class ValidatingWebhook:
    """A validating admission webhook, as a callable (what a ValidatingWebhookConfiguration's
    webhook and its server do, in-process).

    ``resources`` are plurals as a webhook rule's ``resources`` list them: ``"rlhfjobs"`` (the
    main resource only), ``"rlhfjobs/status"``, ``"*"`` (every main resource), ``"*/*"``;
    ``operations`` are ``"CREATE"`` and/or ``"UPDATE"``. ``check(new, old)`` gets copies of the
    object after schema admission and of the stored one (``None`` on CREATE) and returns
    ``None`` to allow or a message to deny, which answers 403 Forbidden with
    ``admission webhook "<name>" denied the request: <message>`` (controller-runtime's
    CustomValidator denial). An exception is a 500, as a failing webhook with
    ``failurePolicy: Fail``.
    """

    name: str
    resources: AbstractSet[str]
    operations: AbstractSet[str]
    check: Callable[[JsonObject, JsonObject | None], str | None]

    def matches(self, plural: str, subresource: str | None, operation: str) -> bool:
        # k8s.io/apiserver/pkg/admission/plugin/webhook/predicates/rules/rules.go
        # Matcher.resource(): "res/sub" patterns, "*" in either part.
        if operation not in self.operations:
            return False
        for pattern in self.resources:
            resource, _, sub = pattern.partition("/")
            if resource in ("*", plural) and sub in ("*", subresource or ""):
                return True
        return False


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


@dataclasses.dataclass
class WatchLog:
    """One resource's watch events still kept, oldest first (the watch cache's window).

    Watchers hold absolute positions (``dropped`` + index), so forgetting the oldest events
    does not move them; a watcher whose next event was forgotten has fallen behind.
    """

    events: list[WatchEvent] = dataclasses.field(default_factory=list)
    dropped: int = 0
    """How many events were forgotten from the front."""
    floor: int = 0
    """The resourceVersion up to which events were forgotten by the history bound: a watch from
    an older one cannot be served (the Y of "too old resource version: X (Y)")."""

    def append(self, event: WatchEvent, limit: int | None) -> None:
        self.events.append(event)
        if limit is not None and len(self.events) > max(limit, 1):
            excess = len(self.events) - max(limit, 1)
            self.floor = self.events[excess - 1].resource_version
            del self.events[:excess]
            self.dropped += excess

    def forget_through(self, revision: int) -> None:
        """Forget the events up to ``revision`` (compaction)."""
        count = bisect.bisect_right(self.events, revision, key=lambda event: event.resource_version)
        del self.events[:count]
        self.dropped += count

    def position_after(self, resource_version: int) -> int:
        """The absolute position of the first event after ``resource_version``."""
        index = bisect.bisect_right(self.events, resource_version, key=lambda event: event.resource_version)
        return self.dropped + index


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
    _watch_logs: dict[kmock.resource, WatchLog] = attrs.field(factory=dict, init=False)
    _compacted_revision: int = attrs.field(default=0, init=False)
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
    """Bearer token -> user name for tokens that get RBAC checks: a ServiceAccount
    (``system:serviceaccount:NS:NAME``, in the groups ``system:serviceaccounts`` and
    ``system:serviceaccounts:NS``) or any other user name; all are in ``system:authenticated``.
    Any other token is an admin (``system:masters``: no RBAC, no escalation or ownerReference
    checks), as the harness's own clients and the operator under test are."""
    user_groups: dict[str, tuple[str, ...]] = attrs.field(factory=dict)
    """User name -> further groups it authenticates with (what an OIDC token's groups claim
    gives), for Group subjects beyond the implied ones."""
    owner_references_permission_enforcement: bool = True
    """Run the OwnerReferencesPermissionEnforcement admission plugin (on in most clusters: it is
    in kube-apiserver's recommended --enable-admission-plugins, and OpenShift's)."""
    validating_webhooks: list[ValidatingWebhook] = attrs.field(factory=list)
    """Validating admission webhooks, called in order after schema admission."""
    watch_history_limit: int | None = None
    """Watch events kept per resource (the watch cache's capacity); None keeps all (until
    :meth:`compact`). A watch from before the oldest kept event gets 410 Gone."""

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
    # RoleBindings and ClusterRoleBindings that have named a subject, by (the binding's
    # namespace, "" for a ClusterRoleBinding; the subject): candidates only, each re-checked
    # against the binding as it is now. A request costs O(the bindings of its user).
    _bindings_by_subject: dict[tuple[str, SubjectKey], set[ObjectKey]] = attrs.field(factory=dict, init=False)

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

    def register_crd(self, crd: Mapping[str, Any], *, store: bool = True) -> list[kmock.resource]:
        """Serve every served version of a CustomResourceDefinition manifest (a parsed YAML).

        With ``store``, the CRD object itself is also served (``GET .../customresourcedefinitions/
        <plural>.<group>``), as an installed CRD is: operators read it to learn what a component's
        installed version serves. Call before the first request (see the threading protocol).
        """
        spec = crd["spec"]
        names = spec["names"]
        if store:
            crds = kmock.resource("apiextensions.k8s.io", "v1", "customresourcedefinitions")
            body = {
                "apiVersion": "apiextensions.k8s.io/v1",
                "kind": "CustomResourceDefinition",
                "metadata": {"name": f"{names['plural']}.{spec['group']}"},
                "spec": copy.deepcopy(dict(spec)),
            }
            key = self._object_key(crds, self.resources[crds], None, body["metadata"]["name"])
            if self._live_object(key) is None:
                self._create_object(kmock.Request(resource=crds, data=body), crds, self.resources[crds])
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
        # kmock (_serve_create/_update/_delete, and PUT above) serve the outcome. A refusal (a
        # KubernetesError) is answered here with the API server's Status body: kmock would add
        # a traceback as its details and keep the error, and the request, for the session.
        self.request_count += 1
        if request.resource is not None and request.resource.plural is not None:
            token = _bearer_token(request)
            self.requests_by_token[(token, _verb(request), request.resource.plural)] += 1
        denied = self._authorize(request)
        if denied is not None:
            self._forget(request)
            return self._error_response(denied)
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
        try:
            if self._is_emulated_write(request):
                async with self._lock:
                    self._write_results[id(request)] = self._apply_write(request)
            if fault == "applied":
                self._write_results.pop(id(request), None)
                return self._status_response(
                    503, "ServiceUnavailable", "injected fault: applied, answer lost"
                )
            # Skip KubernetesEmulator._handle (its state changes are replaced above) and go to
            # the reactions, as kmock's own _handle does after its bookkeeping.
            return await self._react(request)
        except kmock.KubernetesError as error:
            return self._error_response(error)
        finally:
            self._write_results.pop(id(request), None)
            self._forget(request)

    # --- authorization --------------------------------------------------------------------------

    def _user_of(self, request: kmock.Request) -> UserInfo | None:
        """The user a request authenticates as; None for an admin token (system:masters)."""
        name = self.identities.get(_bearer_token(request))
        return None if name is None else UserInfo.named(name, self.user_groups.get(name, ()))

    @staticmethod
    def _attributes_of(request: kmock.Request) -> Attributes:
        # k8s.io/apiserver/pkg/endpoints/request/requestinfo.go RequestInfoFactory.NewRequestInfo:
        # a list or watch names the object its metadata.name field selector requires, and a
        # Namespace's own namespace is its name (/api/v1/namespaces/NAME[/status]).
        resource = request.resource
        assert resource is not None and resource.plural is not None
        verb = _verb(request)
        name = request.name or ""
        if not name and verb in ("list", "watch"):
            name = _field_selector_name(request.params.get("fieldSelector", ""))
        namespace = request.namespace or ""
        if not resource.group and resource.plural == "namespaces" and request.name:
            namespace = request.name
        return Attributes(
            verb, resource.group or "", resource.plural, request.subresource or "", name, namespace
        )

    def _authorize(self, request: kmock.Request) -> kmock.KubernetesError | None:
        # Fixes kmock 0.8, which has no authorization: kube-apiserver's RBAC authorizer
        # (plugin/pkg/auth/authorizer/rbac/rbac.go RBACAuthorizer.Authorize, v1.3x) allows a
        # request only by a rule bound to its user; else 403 Forbidden with the message of
        # k8s.io/apiserver/pkg/endpoints/handlers/responsewriters/errors.go forbiddenMessage()
        # plus the authorizer's reason ("RBAC: " and the bindings whose role is missing).
        # Discovery and other non-resource paths are open, as to system:authenticated.
        user = self._user_of(request)
        resource = request.resource
        if user is None or resource is None or resource.plural is None:
            return None
        attributes = self._attributes_of(request)
        allowed, errors = self._authorizes(user, attributes)
        if allowed:
            return None
        combined = attributes.resource + (f"/{attributes.subresource}" if attributes.subresource else "")
        where = (
            f' in the namespace "{attributes.namespace}"' if attributes.namespace else " at the cluster scope"
        )
        message = (
            f'User "{user.name}" cannot {attributes.verb} resource "{combined}" in API group '
            f'"{attributes.group}"{where}'
        )
        if errors:
            message += f": RBAC: {_aggregate(errors)}"
        return forbidden(resource, request.name or "", message)

    def _authorizes(self, user: UserInfo, attributes: Attributes) -> tuple[bool, list[str]]:
        """Whether RBAC allows ``attributes`` to ``user``, and the rule resolution errors."""
        rules, errors = self._rules_for(user, attributes.namespace)
        return any(_rule_allows(rule, attributes) for rule in rules), errors

    def _rules_for(
        self, user: UserInfo, namespace: str, *, registry: bool = False
    ) -> tuple[list[JsonObject], list[str]]:
        # pkg/registry/rbac/validation/rule.go DefaultRuleResolver.VisitRulesFor()/RulesFor():
        # the rules of the roles of every ClusterRoleBinding naming the user, then (for a
        # namespace) of every RoleBinding in that namespace naming it; a roleRef names a Role
        # of the binding's namespace or a ClusterRole (GetRoleReferenceRules). A missing role
        # grants nothing and is reported. Candidates come from the subject index, re-checked.
        self._refresh_indexes()
        keys = user.subject_keys()
        wanted = set(keys)
        rules: list[JsonObject] = []
        errors: list[str] = []
        for scope in ("", namespace) if namespace else ("",):
            candidates: set[ObjectKey] = set()
            for key in keys:
                candidates |= self._bindings_by_subject.get((scope, key), set())
            for binding_key in sorted(candidates, key=str):
                binding = self._live_object(binding_key)
                if binding is None or (binding["metadata"].get("namespace") or "") != scope:
                    continue
                if not any(_subject_key(s, scope) in wanted for s in binding.get("subjects") or []):
                    continue
                role_rules, error = self._role_reference_rules(
                    binding.get("roleRef") or {}, scope, registry=registry
                )
                rules += role_rules
                if error is not None:
                    errors.append(str(error.message))
        return rules, errors

    def _role_reference_rules(
        self, role_ref: JsonObject, namespace: str, *, registry: bool
    ) -> tuple[list[JsonObject], kmock.KubernetesError | None]:
        # rule.go DefaultRuleResolver.GetRoleReferenceRules(). The authorizer reads roles from
        # informer listers, whose NotFound says `role.rbac...`; the RBAC storage reads them from
        # the registry, whose NotFound says `roles.rbac...`.
        kind, name = role_ref.get("kind"), str(role_ref.get("name", ""))
        if kind not in ROLE_RESOURCES:
            return [], kmock.KubernetesError(
                500, "InternalError", f'unsupported role reference kind: "{kind}"', {}
            )
        resource = ROLES if kind == "Role" else CLUSTER_ROLES
        role = None
        if kind == "ClusterRole":
            role = self._live_object((resource, None, name))
        elif namespace:
            role = self._live_object((resource, namespace, name))
        if role is None:
            plural = resource.plural if registry else str(kind).lower()
            return [], kmock.KubernetesError(
                404,
                "NotFound",
                f'{plural}.{RBAC_GROUP} "{name}" not found',
                {"name": name, "group": RBAC_GROUP, "kind": plural},
            )
        return list(role.get("rules") or []), None

    def _confirm_no_escalation(self, user: UserInfo, namespace: str, rules: list[JsonObject]) -> str | None:
        # pkg/registry/rbac/validation/rule.go ConfirmNoEscalation(): the user must already
        # hold every permission of `rules` in `namespace` ("" for cluster-wide: only
        # ClusterRoleBindings count); the message lists the missing ones, compacted.
        owner_rules, errors = self._rules_for(user, namespace, registry=True)
        missing = _uncovered(owner_rules, rules)
        if not missing:
            return None
        descriptions = sorted({_compact_string(rule) for rule in _compact_rules(missing)})
        message = (
            f'user "{user.name}" (groups={_go_strings(user.groups)}) is attempting to grant RBAC '
            "permissions not currently held:\n" + "\n".join(descriptions)
        )
        if errors:
            message += f"; resolution errors: [{' '.join(errors)}]"
        return message

    def _prevent_escalation(
        self, request: kmock.Request, resource: kmock.resource, obj: JsonObject, old: JsonObject | None
    ) -> None:
        # kube-apiserver's RBAC storage (pkg/registry/rbac/{role,clusterrole}/policybased/
        # storage.go Create/Update, v1.3x): a Role or ClusterRole is written only if its writer
        # holds `escalate` on it (RoleEscalationAuthorized) or already holds every rule it
        # grants (ConfirmNoEscalation, in its namespace or cluster-wide); the
        # {role,clusterrole}binding policybased storage writes a binding only if its writer
        # holds `bind` on the role (BindingAuthorized) or every rule of the role
        # (GetRoleReferenceRules, 404 if it is missing, then ConfirmNoEscalation). System
        # masters (admin tokens) skip it (EscalationAllowed), and so does an update that changes
        # only ownerReferences and finalizers (IsOnlyMutatingGCFields). Runs before validation.
        if resource.group != RBAC_GROUP or resource.plural not in {
            *ROLE_RESOURCES.values(),
            *BINDING_RESOURCES,
        }:
            return
        user = self._user_of(request)
        if user is None or (old is not None and _only_gc_fields_change(obj, old)):
            return
        meta = obj.get("metadata") or {}
        namespace = str(meta.get("namespace") or "")
        name = str(meta.get("name") or "")
        if resource.plural in ROLE_RESOURCES.values():
            escalate = Attributes(
                "escalate", RBAC_GROUP, resource.plural, "", request.name or "", request.namespace or ""
            )
            if self._authorizes(user, escalate)[0]:
                return
            rules = list(obj.get("rules") or [])
        else:
            role_ref = obj.get("roleRef") or {}
            role_plural = ROLE_RESOURCES.get(role_ref.get("kind", ""))
            if role_plural is not None:
                bind = Attributes(
                    "bind",
                    str(role_ref.get("apiGroup", "")),
                    role_plural,
                    "",
                    str(role_ref.get("name", "")),
                    namespace,
                )
                if self._authorizes(user, bind)[0]:
                    return
            rules, error = self._role_reference_rules(role_ref, namespace, registry=True)
            if error is not None:
                raise error
        denial = self._confirm_no_escalation(user, namespace, rules)
        if denial is not None:
            raise forbidden(resource, name, denial)

    def _enforce_owner_references(
        self, request: kmock.Request, resource: kmock.resource, obj: JsonObject, old: JsonObject | None
    ) -> None:
        # The OwnerReferencesPermissionEnforcement admission plugin
        # (plugin/pkg/admission/gc/gc_admission.go gcPermissionsEnforcement.Validate, v1.3x),
        # for writes by users other than admins: changing an object's ownerReferences on update
        # needs `delete` on the object; each ownerReference with blockOwnerDeletion: true that is
        # new, or was not blocking before (newBlockingOwnerDeletionRefs), needs `update` on the
        # owner's `finalizers` subresource (ownerRefToDeleteAttributeRecords: the owner's kind
        # mapped to its resource, in the object's namespace when the owner is namespaced).
        # pods/status is exempt (whiteList). 403 in admission.NewForbidden's words.
        if not self.owner_references_permission_enforcement:
            return
        user = self._user_of(request)
        if user is None or (resource.group, resource.plural, request.subresource) == ("", "pods", "status"):
            return
        meta = obj.get("metadata") or {}
        refs = list(meta.get("ownerReferences") or [])
        old_refs = list((old or {}).get("metadata", {}).get("ownerReferences") or [])
        if (not refs) if old is None else refs == old_refs:  # isChangingOwnerReference()
            return
        name = str(meta.get("name") or "")
        namespace = str(meta.get("namespace") or "")
        if old is not None:
            delete = Attributes(
                "delete",
                resource.group or "",
                str(resource.plural),
                request.subresource or "",
                name,
                namespace,
            )
            allowed, errors = self._authorizes(user, delete)
            if not allowed:
                reason = f"RBAC: {_aggregate(errors)}" if errors else ""
                raise forbidden(
                    resource, name, f"cannot set an ownerRef on a resource you can't delete: {reason}, <nil>"
                )
        was_blocking = {ref.get("uid") for ref in old_refs if ref.get("blockOwnerDeletion") is True}
        for ref in refs:
            if ref.get("blockOwnerDeletion") is not True or ref.get("uid") in was_blocking:
                continue
            api_version, kind = str(ref.get("apiVersion", "")), str(ref.get("kind", ""))
            mappings = self._rest_mappings(api_version, kind)
            if isinstance(mappings, str):
                raise forbidden(
                    resource,
                    name,
                    "cannot set blockOwnerDeletion in this case because cannot find RESTMapping for "
                    f"APIVersion {api_version} Kind {kind}: {mappings}",
                )
            for owner_resource, info in mappings:
                finalizers = Attributes(
                    "update",
                    owner_resource.group or "",
                    str(owner_resource.plural),
                    "finalizers",
                    str(ref.get("name", "")),
                    namespace if info.namespaced else "",
                )
                allowed, errors = self._authorizes(user, finalizers)
                if not allowed:
                    reason = f"RBAC: {_aggregate(errors)}" if errors else ""
                    raise forbidden(
                        resource,
                        name,
                        "cannot set blockOwnerDeletion if an ownerReference refers to a resource you "
                        f"can't set finalizers on: {reason}, <nil>",
                    )

    def _rest_mappings(
        self, api_version: str, kind: str
    ) -> list[tuple[kmock.resource, kmock.ResourceInfo]] | str:
        """The served resources of a kind in a group/version (a RESTMapper's RESTMappings), or
        the error message when there is none."""
        group, _, version = api_version.rpartition("/")
        if "/" in group:
            return f"unexpected GroupVersion string: {api_version}"
        mappings = [
            (resource, info)
            for resource, info in list(self.resources.items())
            if isinstance(resource, kmock.resource)
            and isinstance(info, kmock.ResourceInfo)
            and (resource.group or "") == group
            and resource.version == version
            and info.kind == kind
        ]
        return mappings or f'no matches for kind "{kind}" in version "{api_version}"'

    def _call_webhooks(
        self, request: kmock.Request, resource: kmock.resource, obj: JsonObject, old: JsonObject | None
    ) -> None:
        # Validating admission webhooks (k8s.io/apiserver/pkg/admission/plugin/webhook/validating
        # Plugin.Validate, v1.3x), called for every user, admins included, after schema
        # validation; a denial becomes 403 with webhookerrors.ToStatusErr()'s message
        # ("admission webhook %q denied the request: %s"), a webhook that cannot answer a 500.
        operation = "CREATE" if old is None else "UPDATE"
        for webhook in list(self.validating_webhooks):
            if not webhook.matches(str(resource.plural), request.subresource, operation):
                continue
            try:
                message = webhook.check(copy.deepcopy(obj), copy.deepcopy(old) if old is not None else None)
            except Exception as e:
                raise kmock.KubernetesError(
                    500,
                    "InternalError",
                    f'Internal error occurred: failed calling webhook "{webhook.name}": {e!r}',
                    {},
                ) from e
            if message is not None:
                raise kmock.KubernetesError(
                    403,
                    "Forbidden",
                    f'admission webhook "{webhook.name}" denied the request: {message or "Forbidden"}',
                    {},
                )

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
    def _error_response(error: kmock.KubernetesError) -> aiohttp.web.Response:
        """The Status body of a refusal, as the API server sends it (details only if any)."""
        body: JsonObject = {
            "apiVersion": "v1",
            "kind": "Status",
            "metadata": {},
            "status": "Failure",
            "code": error.status,
            "reason": error.reason,
            "message": error.message,
        }
        if error.details:
            body["details"] = error.details
        return aiohttp.web.json_response(body, status=error.status)

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
        self._prevent_escalation(request, resource, obj, None)
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
        # The system fields are set before validating admission sees the object (BeforeCreate);
        # the resourceVersion only when it is stored.
        obj["metadata"].update(uid=str(uuid.uuid4()), creationTimestamp=_now(), generation=1)
        self._enforce_owner_references(request, resource, obj, None)
        self._call_webhooks(request, resource, obj, None)
        obj["metadata"]["resourceVersion"] = self._next_resource_version()
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
        if (
            old is not None
            and resource.group == RBAC_GROUP
            and resource.plural in BINDING_RESOURCES
            and obj.get("roleRef") != old.get("roleRef")
        ):
            # pkg/apis/rbac/validation/validation.go ValidateRoleBindingUpdate(): a binding
            # keeps its role for life (delete and recreate it to bind another).
            causes.append(
                Cause(
                    "FieldValueInvalid",
                    f"Invalid value: {obj.get('roleRef')!r}: cannot change roleRef",
                    "roleRef",
                )
            )
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
        self._prevent_escalation(request, resource, new, old)
        new = self._admit(request, resource, new, old)
        self._enforce_owner_references(request, resource, new, old)
        self._call_webhooks(request, resource, new, old)
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
        if key[0].group != RBAC_GROUP or key[0].plural not in BINDING_RESOURCES:
            return
        scope = key[1] or ""
        for subject in obj.get("subjects") or []:
            subject_key = _subject_key(subject, scope)
            if subject_key is not None:
                self._bindings_by_subject.setdefault((scope, subject_key), set()).add(key)

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
        self._watch_log(resource).append(event, self.watch_history_limit)
        self._wake_watchers()

    def _watch_log(self, resource: kmock.resource) -> WatchLog:
        log = self._watch_logs.get(resource)
        if log is None:
            log = self._watch_logs[resource] = WatchLog()
        return log

    def compact(self) -> int:
        """Forget every watch event up to the current resourceVersion, as etcd's compaction
        does (kube-apiserver compacts every 5 minutes); return that revision.

        A watch from an older resourceVersion then gets 410 Gone, and so does a list asking for
        one exactly (``resourceVersionMatch=Exact``). Call on the server's loop (from another
        thread: ``EmulatedCluster.compact()``).
        """
        revision = self._resource_version
        self._compacted_revision = revision
        for log in self._watch_logs.values():
            log.forget_through(revision)
        return revision

    def watch_gap(self, actions: Callable[[], object] = lambda: None) -> int:
        """End every watch, run ``actions``, compact: what a watcher sees when it was away
        longer than the server's history (its next watch gets 410 Gone and must re-list, and
        sees no events of what ``actions`` did). Atomic: no request is served in between.
        Call on the server's loop (from another thread: ``EmulatedCluster.watch_gap()``)."""
        self.drop_watches()
        actions()
        return self.compact()

    def delete_stored_object(
        self,
        resource: kmock.resource,
        name: str,
        namespace: str | None = None,
        *,
        propagation: str = "Background",
    ) -> JsonObject:
        """Delete an object as an API DELETE does (finalizers hold it; its dependents are
        garbage-collected), with no request: for functions on the server's loop, such as the
        actions of :meth:`watch_gap`. Returns the object as the DELETE would answer."""
        if resource not in self.resources:
            raise not_found(resource, None)
        key = self._object_key(resource, self.resources[resource], namespace, name)
        old = self._live_object(key)
        if old is None:
            raise not_found(resource, name)
        return self._delete(key, old, propagation=propagation)

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
        exact = request.params.get("resourceVersion") or ""
        exact_match = request.params.get("resourceVersionMatch") == "Exact"
        if exact_match and exact.isdigit() and int(exact) < self._compacted_revision:
            # k8s.io/apiserver/pkg/storage/etcd3/errors.go interpretListError(): etcd answers
            # ErrCompacted for a read at a compacted revision.
            raise kmock.KubernetesError(
                410, "Expired", "The resourceVersion for the provided list is too old.", {}
            )
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
        log = self._watch_log(resource)
        oldest = max(log.floor, self._compacted_revision)
        if not initial_events and int(since) < oldest:
            # k8s.io/apiserver/pkg/storage/cacher/watch_cache.go getAllEventsSinceLocked(): a
            # resourceVersion older than the oldest event kept is "too old" (410 Expired), and
            # Cacher.Watch answers it as newErrWatcher() does: 200, one ERROR event, the end.
            yield {
                "type": "ERROR",
                "object": {
                    "kind": "Status",
                    "apiVersion": "v1",
                    "metadata": {},
                    "status": "Failure",
                    "message": f"too old resource version: {int(since)} ({oldest})",
                    "reason": "Expired",
                    "code": 410,
                },
            }
            return
        if initial_events:
            start = self._resource_version
            initial = [
                {"type": "ADDED", "object": obj}
                for obj in self._live_objects(resource)
                if object_filter.matches(obj)
            ]
        else:
            start, initial = int(since), []
        position = log.position_after(start)

        yield b""  # send the headers now: a client waits for them before reading any event
        for initial_event in initial:
            yield initial_event
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
            while not self._watches_closed and epoch == self._watch_epoch:
                index = position - log.dropped
                if index < 0:
                    # Events it has not sent yet were forgotten (compaction, the history bound):
                    # end the stream, as the cacher ends a watcher that cannot keep up; the
                    # client re-watches from its last resourceVersion (and gets 410 Gone).
                    return
                if index >= len(log.events):
                    break
                event = log.events[index]
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
