"""What the API server does to an RLHFJob before storing it, replayed without one.

Order (apiextensions-apiserver): check ``metadata.name`` (a DNS-1123 subdomain for every custom
resource), reject unknown fields (``kubectl``'s default ``--validate=strict``, i.e. the
``fieldValidation=Strict`` the API server then applies instead of silently pruning them), prune
``key: null`` (no field of the CRD is nullable), apply structural defaults, validate against the ``openAPIV3Schema`` (jsonschema's draft 4: OpenAPI
v3.0's ``exclusiveMinimum: true`` form), then, on an object that passed, evaluate every
``x-kubernetes-validations`` rule at its node (cel-python; an evaluation error rejects, as the
API server does). Each rejection names the field the way the API server does
(``spec.training.totalSteps: ...``).

Shared by the fuzz tests and the e2e harness; the CRD is read from the committed ``crds/`` YAML,
the very file users apply.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import celpy
import yaml
from jsonschema import Draft4Validator

ROOT = Path(__file__).resolve().parents[2]
CRD_FILE = ROOT / "crds" / "hybridflow.io_rlhfjobs.yaml"


@cache
def openapi_schema() -> dict[str, Any]:
    crd = yaml.safe_load(CRD_FILE.read_text())
    schema: dict[str, Any] = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return schema


def apply_defaults(schema: dict[str, Any], value: Any) -> Any:
    """Structural defaulting: fill missing defaulted properties, recursively (lists and maps too)."""
    value = copy.deepcopy(value)
    if isinstance(value, dict) and schema.get("type", "object") == "object":
        for name, child in schema.get("properties", {}).items():
            if name not in value and "default" in child:
                value[name] = copy.deepcopy(child["default"])
            if name in value:
                value[name] = apply_defaults(child, value[name])
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            value = {key: apply_defaults(extra, item) for key, item in value.items()}
    elif isinstance(value, list) and "items" in schema:
        value = [apply_defaults(schema["items"], item) for item in value]
    return value


@dataclass(frozen=True)
class AttachedRule:
    path: tuple[str, ...]  # property names from the root; "*" steps into every list item
    rule: str
    message: str
    field_path: str


def _attached(schema: dict[str, Any], path: tuple[str, ...] = ()) -> Iterator[AttachedRule]:
    for rule in schema.get("x-kubernetes-validations", []):
        yield AttachedRule(path, rule["rule"], rule.get("message", ""), rule.get("fieldPath", ""))
    for name, child in schema.get("properties", {}).items():
        yield from _attached(child, (*path, name))
    if "items" in schema:
        yield from _attached(schema["items"], (*path, "*"))


@cache
def _compiled() -> list[tuple[AttachedRule, Any]]:
    environment = celpy.Environment()
    return [
        (rule, environment.program(environment.compile(rule.rule)))
        for rule in _attached(openapi_schema())
        if "oldSelf" not in rule.rule  # transition rules apply to updates only
    ]


def _nodes(value: Any, path: tuple[str, ...], prefix: str = "") -> Iterator[tuple[str, Any]]:
    if not path:
        yield prefix, value
        return
    head, rest = path[0], path[1:]
    if head == "*":
        if isinstance(value, list):
            for index, item in enumerate(value):
                yield from _nodes(item, rest, f"{prefix}[{index}]")
    elif isinstance(value, dict) and head in value:
        yield from _nodes(value[head], rest, f"{prefix}.{head}" if prefix else head)


def _schema_error_text(error: Any) -> str:
    """``spec.training.totalSteps: ...``: the API server names the field, even a missing or unknown one."""
    parts = [str(p) if not isinstance(p, int) else f"[{p}]" for p in error.absolute_path]
    named = re.search(r"'([^']+)' (?:is a required property|was unexpected)", error.message)
    if named and error.validator in ("required", "additionalProperties"):
        parts.append(named.group(1))
    path = ".".join(parts).replace(".[", "[")
    return f"{path or '<root>'}: {error.message}"


def without_nulls(value: Any) -> Any:
    """The API server prunes ``key: null`` of non-nullable fields (all of the CRD's) before defaulting."""
    if isinstance(value, dict):
        return {key: without_nulls(item) for key, item in value.items() if item is not None}
    if isinstance(value, list):
        return [without_nulls(item) for item in value]
    return value


DNS_1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
ROOT_FIELDS = ("apiVersion", "kind", "metadata", "spec", "status")


def unknown_fields(schema: dict[str, Any], value: Any, path: str) -> list[str]:
    """Fields of ``value`` the schema does not declare (what strict field validation reports)."""
    found = []
    if isinstance(value, dict) and "properties" in schema:
        for key, item in value.items():
            if key not in schema["properties"]:
                found.append(f"{path}.{key}: unknown field")
            else:
                found += unknown_fields(schema["properties"][key], item, f"{path}.{key}")
    elif isinstance(value, dict) and isinstance(schema.get("additionalProperties"), dict):
        for key, item in value.items():
            found += unknown_fields(schema["additionalProperties"], item, f"{path}.{key}")
    elif isinstance(value, list) and "items" in schema:
        for index, item in enumerate(value):
            found += unknown_fields(schema["items"], item, f"{path}[{index}]")
    return found


def admission_errors(manifest: Any) -> list[str]:
    """Why the API server would refuse to create ``manifest`` (empty: it would store it)."""
    if not isinstance(manifest, dict):
        return [f"<root>: the body is a {type(manifest).__name__}, not an object"]
    metadata = manifest.get("metadata")
    name = metadata.get("name") if isinstance(metadata, dict) else None
    if not isinstance(name, str) or not name:
        return ["metadata.name: Required value: name or generateName is required"]
    if len(name) > 253 or not DNS_1123_SUBDOMAIN.match(name):
        return [f"metadata.name: Invalid value: {name!r}: a lowercase RFC 1123 subdomain is required"]
    unknown = [f"{key}: unknown field" for key in manifest if key not in ROOT_FIELDS]
    unknown += unknown_fields(openapi_schema()["properties"]["spec"], manifest.get("spec"), "spec")
    if unknown:
        return unknown
    defaulted = apply_defaults(openapi_schema(), without_nulls(manifest))
    schema_errors = sorted(Draft4Validator(openapi_schema()).iter_errors(defaulted), key=str)
    if schema_errors:
        return [_schema_error_text(error) for error in schema_errors]
    errors = []
    converted: dict[str, Any] = {}  # one CEL value per node, shared by the node's rules
    for rule, program in _compiled():
        for where, node in _nodes(defaulted, rule.path):
            if where not in converted:
                converted[where] = celpy.json_to_cel(node)
            try:
                verdict = program.evaluate({"self": converted[where]})
            except Exception as error:  # an evaluation error rejects the object
                verdict = error
            if verdict is not True and not (isinstance(verdict, celpy.celtypes.BoolType) and bool(verdict)):
                errors.append(f"{where}{rule.field_path}: {rule.message or rule.rule}")
    return errors
