"""What kube-apiserver checks on every write, for the emulator: schemas, pruning, defaults, CEL.

Custom resources (:class:`CustomResourceSchema`, one per served CRD version), in the order the
API server applies them (apiextensions-apiserver's ``customresource`` strategy):

1. *pruning*: fields the structural schema does not declare are dropped
   (``x-kubernetes-preserve-unknown-fields`` keeps them; ``additionalProperties`` declares a
   map); with ``?fieldValidation=Strict`` each one is an error instead (what ``kubectl apply``
   with ``--validate=strict`` and client-go's strict decoding ask for);
2. *defaulting*: each missing property with a ``default`` is set, recursively;
3. *schema validation*: types, enums, bounds, patterns, required, ``nullable``;
4. *CEL*: every ``x-kubernetes-validations`` rule, with ``self`` the node's value and, for
   transition rules (those that mention ``oldSelf``), ``oldSelf`` the stored value at the same
   place, evaluated only on update and only where an old value exists, as the API server does.

With a status subresource, a write to the main resource is checked without ``status`` and a
write to ``/status`` checks ``status`` only (the other part cannot change there). Built-in
objects (:class:`BuiltinSchemas`) are checked with the schemas ``kubernetes-validate`` bundles,
in strict mode (unknown fields are errors, as client-go's typed objects never send them).

Every problem becomes a :class:`Cause` (the ``details.causes`` of a 422 Status body: reason,
message, field), so a test sees the answer a real server gives.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import re
from collections.abc import Iterator, Mapping
from typing import Any, Final

import jsonschema
import referencing
from kubernetes_validate import utils as kubernetes_validate_utils

JsonObject = dict[str, Any]

KUBERNETES_SCHEMA_VERSION: Final = "1.37"
ROOT_METADATA_FIELDS: Final = frozenset({"apiVersion", "kind", "metadata"})
_OLD_SELF = re.compile(r"\boldSelf\b")


@dataclasses.dataclass(frozen=True)
class Cause:
    """One entry of a 422 Status body's ``details.causes``."""

    reason: str
    message: str
    field: str

    def to_json(self) -> JsonObject:
        return {"reason": self.reason, "message": self.message, "field": self.field}


def _field(path: tuple[str | int, ...]) -> str:
    """A path in the API server's notation: ``spec.resourcePools[0].nodes``."""
    text = ""
    for part in path:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


def _openapi_to_json_schema(node: Any) -> Any:
    """OpenAPI v3 ``nullable: true`` as JSON Schema (``type: [t, "null"]``); the rest is shared."""
    if isinstance(node, list):
        return [_openapi_to_json_schema(item) for item in node]
    if not isinstance(node, dict):
        return node
    converted = {key: _openapi_to_json_schema(value) for key, value in node.items()}
    if converted.get("nullable") is True and isinstance(converted.get("type"), str):
        converted["type"] = [converted["type"], "null"]
        if "enum" in converted:
            converted["enum"] = [*converted["enum"], None]
    return converted


# --- pruning and defaulting ------------------------------------------------------------------


def prune(schema: Mapping[str, Any], value: Any, path: tuple[str | int, ...] = ()) -> tuple[Any, list[str]]:
    """``value`` without the fields ``schema`` does not declare, and the paths of those fields."""
    unknown: list[str] = []
    if isinstance(value, dict):
        if schema.get("x-kubernetes-preserve-unknown-fields") and "properties" not in schema:
            return value, unknown
        properties: Mapping[str, Any] = schema.get("properties") or {}
        extra = schema.get("additionalProperties")
        kept: JsonObject = {}
        for key, item in value.items():
            if key in properties:
                kept[key], found = prune(properties[key], item, (*path, key))
                unknown += found
            elif isinstance(extra, dict):
                kept[key], found = prune(extra, item, (*path, key))
                unknown += found
            elif (
                extra is True
                or schema.get("x-kubernetes-preserve-unknown-fields")
                or (schema.get("x-kubernetes-embedded-resource") and key in ROOT_METADATA_FIELDS)
            ):
                kept[key] = item
            else:
                unknown.append(_field((*path, key)))
        return kept, unknown
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        items = []
        for index, item in enumerate(value):
            pruned, found = prune(schema["items"], item, (*path, index))
            items.append(pruned)
            unknown += found
        return items, unknown
    return value, unknown


def apply_defaults(schema: Mapping[str, Any], value: Any) -> Any:
    """Structural defaulting: each missing property with a ``default`` gets it, recursively."""
    if isinstance(value, dict):
        result = dict(value)
        for name, child in (schema.get("properties") or {}).items():
            if name not in result and "default" in child:
                result[name] = copy.deepcopy(child["default"])
            if name in result:
                result[name] = apply_defaults(child, result[name])
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            result = {key: apply_defaults(extra, item) for key, item in result.items()}
        return result
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [apply_defaults(schema["items"], item) for item in value]
    return value


# --- CEL -------------------------------------------------------------------------------------


@functools.cache
def _cel_program(rule: str) -> Any:
    import celpy  # cel-python: a dev dependency, imported when a CRD with rules is served

    environment = celpy.Environment()
    return environment.program(environment.compile(rule))


_VERDICTS: dict[tuple[str, str, str | None], bool | str] = {}
_VERDICT_CACHE_SIZE: Final = 65536


def _cel_verdict(rule: str, value: Any, old: Any, has_old: bool) -> bool | str:
    """True/False, or the evaluation error's text (the API server reports those as invalid).

    A rule is a pure function of ``self`` and ``oldSelf``, so verdicts are memoised by the
    values' canonical JSON: cel-python interprets each rule by walking its parse tree (about
    10 ms for the RLHFJob's larger rules, where the API server's compiled CEL takes
    microseconds), and the same spec is usually checked many times (a test's or a benchmark's
    jobs share one; every write re-checks an unchanged spec).
    """
    key = (
        rule,
        json.dumps(value, sort_keys=True, separators=(",", ":")),
        json.dumps(old, sort_keys=True, separators=(",", ":")) if has_old else None,
    )
    if key in _VERDICTS:
        return _VERDICTS[key]
    verdict = _evaluate_cel(rule, value, old, has_old)
    if len(_VERDICTS) >= _VERDICT_CACHE_SIZE:
        _VERDICTS.clear()
    _VERDICTS[key] = verdict
    return verdict


def _evaluate_cel(rule: str, value: Any, old: Any, has_old: bool) -> bool | str:
    import celpy

    activation = {"self": celpy.json_to_cel(value)}
    if has_old:
        activation["oldSelf"] = celpy.json_to_cel(old)
    try:
        verdict = _cel_program(rule).evaluate(activation)
    except Exception as err:  # celpy raises its own evaluation errors
        return f"{type(err).__name__}: {err}"
    if isinstance(verdict, Exception):  # celpy returns some errors as values
        return f"{type(verdict).__name__}: {verdict}"
    return bool(verdict)


_MISSING: Final = object()


def cel_causes(
    schema: Mapping[str, Any], value: Any, old: Any = _MISSING, path: tuple[str | int, ...] = ()
) -> Iterator[Cause]:
    """Every broken ``x-kubernetes-validations`` rule under ``schema`` for ``value`` (``old`` on update).

    Old values are correlated as the API server does: through object properties, map keys and
    ``x-kubernetes-list-type: map`` items with the same keys; not through other lists, where a
    transition rule is not evaluated.
    """
    has_old = old is not _MISSING
    for rule in schema.get("x-kubernetes-validations") or []:
        transition = bool(_OLD_SELF.search(rule["rule"]))
        if transition and not has_old:
            continue
        verdict = _cel_verdict(rule["rule"], value, old, has_old)
        if verdict is True:
            continue
        field = _field(path) + rule.get("fieldPath", "")
        message = rule.get("message") or f"failed rule: {rule['rule']}"
        if isinstance(verdict, str):
            message = f"{message} (rule evaluation error: {verdict})"
        yield Cause(rule.get("reason", "FieldValueInvalid"), message, field)
    if isinstance(value, dict):
        properties: Mapping[str, Any] = schema.get("properties") or {}
        extra = schema.get("additionalProperties")
        for key, item in value.items():
            child = properties.get(key, extra if isinstance(extra, dict) else None)
            if child is None:
                continue
            child_old = old.get(key, _MISSING) if has_old and isinstance(old, dict) else _MISSING
            yield from cel_causes(child, item, child_old, (*path, key))
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        item_schema = schema["items"]
        keys = (
            schema.get("x-kubernetes-list-map-keys")
            if schema.get("x-kubernetes-list-type") == "map"
            else None
        )
        old_items: dict[tuple[Any, ...], Any] = {}
        if keys and has_old and isinstance(old, list):
            old_items = {tuple(o.get(k) for k in keys): o for o in old if isinstance(o, dict)}
        for index, item in enumerate(value):
            item_old: Any = _MISSING
            if keys and isinstance(item, dict):
                item_old = old_items.get(tuple(item.get(k) for k in keys), _MISSING)
            yield from cel_causes(item_schema, item, item_old, (*path, index))


# --- custom resources ------------------------------------------------------------------------


class CustomResourceSchema:
    """The checks of one served CRD version (see the module docstring for their order)."""

    def __init__(self, openapi: Mapping[str, Any], *, status_subresource: bool) -> None:
        self.openapi = dict(openapi)
        self.status_subresource = status_subresource
        self._validators: dict[frozenset[str], jsonschema.Draft4Validator] = {}

    @classmethod
    def from_crd_version(cls, version: Mapping[str, Any]) -> CustomResourceSchema | None:
        openapi = ((version.get("schema") or {}).get("openAPIV3Schema")) or None
        if openapi is None:
            return None
        return cls(openapi, status_subresource="status" in (version.get("subresources") or {}))

    def admit(
        self,
        obj: JsonObject,
        old: JsonObject | None,
        *,
        subresource: str | None,
        strict_fields: bool,
    ) -> tuple[JsonObject, list[Cause]]:
        """The object as stored (pruned, defaulted) and what is wrong with it (empty: admitted)."""
        parts = self._checked_parts(subresource)
        body = {key: value for key, value in obj.items() if key in parts}
        kept = {key: value for key, value in obj.items() if key not in parts}
        schema = {
            **self.openapi,
            "properties": {k: v for k, v in self.openapi.get("properties", {}).items() if k in parts},
        }
        pruned, unknown = prune(schema, body)
        causes = (
            [Cause("FieldValueInvalid", f'unknown field "{path}"', path) for path in unknown]
            if strict_fields
            else []
        )
        defaulted = apply_defaults(schema, pruned)
        for error in self._validator(parts).iter_errors(defaulted):
            causes.append(
                Cause(_reason(error), error.message, _field(tuple(error.absolute_path)) or "<root>")
            )
        if not causes:
            old_body = {key: value for key, value in (old or {}).items() if key in parts}
            causes += cel_causes(schema, defaulted, old_body if old is not None else _MISSING)
        stored = {**kept, **defaulted}
        return stored, causes

    def _validator(self, parts: frozenset[str]) -> jsonschema.Draft4Validator:
        """The schema of just ``parts`` (a status write re-checks only the status, not a large spec)."""
        if parts not in self._validators:
            root = {
                **self.openapi,
                "properties": {k: v for k, v in (self.openapi.get("properties") or {}).items() if k in parts},
                "required": [k for k in self.openapi.get("required") or [] if k in parts],
            }
            if not root["required"]:
                del root["required"]
            self._validators[parts] = jsonschema.Draft4Validator(_openapi_to_json_schema(root))
        return self._validators[parts]

    def _checked_parts(self, subresource: str | None) -> frozenset[str]:
        everything = frozenset(self.openapi.get("properties", {})) - ROOT_METADATA_FIELDS
        if not self.status_subresource:
            return everything
        return frozenset({"status"}) if subresource == "status" else everything - {"status"}


def _reason(error: jsonschema.ValidationError) -> str:
    return {
        "required": "FieldValueRequired",
        "enum": "FieldValueNotSupported",
        "type": "FieldValueTypeInvalid",
    }.get(str(error.validator), "FieldValueInvalid")


# --- built-in objects ------------------------------------------------------------------------


class BuiltinSchemas:
    """Kubernetes' own schemas (bundled by ``kubernetes-validate``), one cached validator per kind."""

    def __init__(self, version: str = KUBERNETES_SCHEMA_VERSION) -> None:
        self.version = version
        self._validators: dict[tuple[str, str], jsonschema.protocols.Validator | None] = {}

    def causes(self, obj: JsonObject) -> list[Cause]:
        validator = self._validator(str(obj.get("apiVersion", "")), str(obj.get("kind", "")))
        if validator is None:
            return []
        return [
            Cause(_reason(error), error.message, _field(tuple(error.absolute_path)) or "<root>")
            for error in validator.iter_errors(obj)
        ]

    def _validator(self, api_version: str, kind: str) -> jsonschema.protocols.Validator | None:
        key = (api_version, kind)
        if key not in self._validators:
            self._validators[key] = self._load(api_version, kind)
        return self._validators[key]

    def _load(self, api_version: str, kind: str) -> jsonschema.protocols.Validator | None:
        versions = [v for v in kubernetes_validate_utils.all_versions() if v.startswith(self.version)]
        schema_dir = f"v{versions[-1]}-local-strict"
        group_version = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", api_version)
        try:
            schema = kubernetes_validate_utils.schema_contents(
                f"kubernetes-json-schema/{schema_dir}/{kind.lower()}-{group_version}.json", self.version
            )
        except FileNotFoundError:
            return None  # a kind kubernetes-validate does not bundle: admitted unchecked
        definitions = kubernetes_validate_utils.schema_contents(
            f"kubernetes-json-schema/{schema_dir}/_definitions.json", self.version
        )
        registry: referencing.Registry[Any] = referencing.Registry()
        registry = referencing.Resource.from_contents(schema) @ registry
        registry = referencing.Resource.from_contents(definitions) @ registry
        validator: jsonschema.protocols.Validator = jsonschema.Draft202012Validator(schema, registry=registry)
        return validator


__all__ = ["BuiltinSchemas", "Cause", "CustomResourceSchema", "apply_defaults", "cel_causes", "prune"]
