"""``SpecError``: every problem of a manifest, one line each, written for the person who wrote it.

Pydantic's own messages name Python classes and say "Input should be"; a manifest author
thinks in camelCase dot paths and allowed values. So each pydantic error is rewritten here as
``<dot.path>: <what is wrong>`` with the offending value and what is allowed, and cross-field
rule failures (which already carry finished lines) are passed through. The same lines serve
the CLI's exit message, the operator's status condition and an admission response.
"""

from __future__ import annotations

import types
from collections.abc import Sequence
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails

from hybridflow.spec.algorithm import ALGORITHM_NAME_PATTERN, BUILTIN_ALGORITHMS
from hybridflow.spec.data import TRAIN_FILE_PATTERN
from hybridflow.spec.job import LABEL_VALUE_PATTERN
from hybridflow.spec.resources import DEVICE_COUNT_PATTERN, DNS_LABEL_PATTERN, MEMORY_QUANTITY_PATTERN
from hybridflow.spec.rewards import REWARD_FUNCTION_PATTERN
from hybridflow.spec.rules import RuleViolations, quoted_list
from hybridflow.spec.security import CAPABILITY_PATTERN
from hybridflow.spec.storage import ABSOLUTE_PATH_PATTERN, DNS_SUBDOMAIN_PATTERN, RELATIVE_PATH_PATTERN

_PATTERN_MEANINGS: dict[str, str] = {
    DNS_LABEL_PATTERN: "a DNS-1123 label (lowercase letters, digits and '-', starting and ending with a "
    "letter or digit)",
    DNS_SUBDOMAIN_PATTERN: "a DNS-1123 subdomain (lowercase letters, digits, '-' and '.')",
    TRAIN_FILE_PATTERN: "a .parquet or .jsonl file",
    REWARD_FUNCTION_PATTERN: "a registered reward name (lowercase, digits, '_') or an import path "
    "'package.module:function'",
    MEMORY_QUANTITY_PATTERN: "a memory quantity such as '64Gi' or '500M'",
    CAPABILITY_PATTERN: "a Linux capability name in capitals such as 'ALL' or 'IPC_LOCK'",
    DEVICE_COUNT_PATTERN: "a whole number of devices such as '1' or '4' (extended resources are integers)",
    ABSOLUTE_PATH_PATTERN: "an absolute path",
    RELATIVE_PATH_PATTERN: "a relative path",
    ALGORITHM_NAME_PATTERN: "one of "
    + quoted_list(BUILTIN_ALGORITHMS)
    + " or a plugin 'package.module:train_step'",
    LABEL_VALUE_PATTERN: "a Kubernetes label value (letters, digits, '-', '_' and '.', starting and ending "
    "with a letter or digit)",
}

_BOUNDS: dict[str, str] = {
    "greater_than": "gt",
    "greater_than_equal": "ge",
    "less_than": "lt",
    "less_than_equal": "le",
}
_BOUND_SYMBOLS: dict[str, str] = {"gt": ">", "ge": ">=", "lt": "<", "le": "<="}

_LONGEST_SHOWN_VALUE = 80


class SpecError(ValueError):
    """A manifest that cannot become an ``RLHFJob``; ``str()`` is one ``source: problem`` line per problem.

    ``source`` says what was read (a file path, or ``RLHFJob <namespace>/<name>`` in the
    operator); ``problems`` are the lines without it, for callers that show the source once.
    """

    def __init__(self, source: str, problems: Sequence[str]) -> None:
        self.source = source
        self.problems = tuple(problems)
        super().__init__("\n".join(f"{source}: {problem}" for problem in self.problems))


def describe_validation_error(error: ValidationError, root: type[BaseModel]) -> list[str]:
    """One line per problem in ``error``, raised while validating ``root`` from manifest data."""
    details = error.errors()
    lines: list[str] = []
    for detail in details:
        if _is_consequence_of_item_errors(detail, details):
            continue
        rule_failures = (detail.get("ctx") or {}).get("error")
        if detail["type"] == "value_error" and isinstance(rule_failures, RuleViolations):
            lines.extend(rule_failures.lines)
        else:
            lines.append(_describe(detail, root))
    return lines


def _is_consequence_of_item_errors(detail: ErrorDetails, details: Sequence[ErrorDetails]) -> bool:
    """True for pydantic's "too short after validation" on a tuple whose items already failed.

    Pydantic counts only the items that validated, so one bad item of a one-item list also
    yields "should have at least 1 item"; the item's own error is the one worth reading.
    """
    if detail["type"] != "too_short":
        return False
    loc = tuple(detail["loc"])
    return any(tuple(other["loc"])[: len(loc)] == loc and len(other["loc"]) > len(loc) for other in details)


def _describe(detail: ErrorDetails, root: type[BaseModel]) -> str:
    loc = tuple(detail["loc"])
    path = dot_path(loc)
    kind = detail["type"]
    ctx: dict[str, Any] = dict(detail.get("ctx") or {})
    value = detail.get("input")
    if kind == "missing":
        return f"{path}: required field is missing"
    if kind == "extra_forbidden":
        parent = _model_at(root, loc[:-1])
        allowed = ", ".join(_aliases(parent)) if parent is not None else "none"
        return f"{path}: unknown field (allowed: {allowed})"
    if kind == "literal_error":
        allowed_values = _literal_values(root, loc)
        if allowed_values:
            if len(allowed_values) == 1:
                return f"{path}: {_show(value)} is not {allowed_values[0]!r}"
            return f"{path}: {_show(value)} is not one of {quoted_list(allowed_values)}"
    if kind in _BOUNDS:
        bound_name = _BOUNDS[kind]
        return f"{path}: must be {_BOUND_SYMBOLS[bound_name]} {ctx[bound_name]} (got {_show(value)})"
    if kind == "string_pattern_mismatch":
        meaning = _PATTERN_MEANINGS.get(str(ctx.get("pattern")), f"a string matching {ctx.get('pattern')}")
        return f"{path}: {_show(value)} is not {meaning}"
    if kind in ("too_short", "too_long"):
        limit = ctx.get("min_length") if kind == "too_short" else ctx.get("max_length")
        bound = "at least" if kind == "too_short" else "at most"
        return f"{path}: must have {bound} {limit} item(s) (got {ctx.get('actual_length')})"
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        return f"{path}: expected a mapping (got {_show(value)})"
    if kind in ("tuple_type", "list_type"):
        return f"{path}: expected a list (got {_show(value)})"
    return f"{path}: {detail['msg']} (got {_show(value)})"


def dot_path(loc: Sequence[int | str]) -> str:
    """``spec.resourcePools[0].name`` from pydantic's location tuple."""
    path = ""
    for key in loc:
        if isinstance(key, int):
            path += f"[{key}]"
        else:
            path += f".{key}" if path else str(key)
    return path or "(top level)"


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= _LONGEST_SHOWN_VALUE else text[: _LONGEST_SHOWN_VALUE - 3] + "..."


def _aliases(model: type[BaseModel]) -> list[str]:
    return [field.alias or name for name, field in model.model_fields.items()]


def _branches(annotation: Any) -> list[Any]:
    """The concrete types an annotation may hold: unwraps ``Annotated``, ``Optional`` and unions."""
    origin = get_origin(annotation)
    if origin is Annotated:
        return _branches(get_args(annotation)[0])
    if origin is Union or origin is types.UnionType:
        return [branch for arg in get_args(annotation) for branch in _branches(arg)]
    return [annotation]


def _annotation_at(root: type[BaseModel], loc: Sequence[int | str]) -> Any:
    """The annotation of the value at ``loc`` (camelCase keys, list indexes), or None if unknown."""
    annotation: Any = root
    for key in loc:
        annotation = _child_annotation(annotation, key)
        if annotation is None:
            return None
    return annotation


def _child_annotation(annotation: Any, key: int | str) -> Any:
    for branch in _branches(annotation):
        if isinstance(branch, type) and issubclass(branch, BaseModel) and isinstance(key, str):
            for name, field in branch.model_fields.items():
                if key in (field.alias, name):
                    return field.annotation
        origin = get_origin(branch)
        if origin in (tuple, list) and isinstance(key, int):
            return get_args(branch)[0]
        if origin is dict:
            return get_args(branch)[1]
    return None


def _model_at(root: type[BaseModel], loc: Sequence[int | str]) -> type[BaseModel] | None:
    for branch in _branches(_annotation_at(root, loc)):
        if isinstance(branch, type) and issubclass(branch, BaseModel):
            return branch
    return None


def _literal_values(root: type[BaseModel], loc: Sequence[int | str]) -> list[object]:
    for branch in _branches(_annotation_at(root, loc)):
        if get_origin(branch) is Literal:
            return list(get_args(branch))
    return []
