"""The one base class of every RLHFJob spec model, and the conventions it fixes.

Every section of the spec is frozen (a validated config cannot drift while the job runs),
forbids unknown keys (a typo is an error at load time, not a silently ignored knob) and
speaks camelCase to YAML and the CRD while Python code uses the snake_case names. The
manifest loader validates by alias only, so a manifest accepted on a laptop uses the same
keys the API server accepts; constructing models in Python by field name stays possible.
"""

from __future__ import annotations

import types
from typing import Annotated, Any, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator, model_validator
from pydantic.alias_generators import to_camel
from pydantic_core import PydanticCustomError


def _without_null_entries(value: Any) -> Any:
    """A map's ``key: null`` entries dropped (the API server prunes them: no map value is nullable).

    Only maps (``dict[...]`` fields): a section's unknown ``key: null`` stays an error."""
    if isinstance(value, dict):
        return {key: item for key, item in value.items() if item is not None}
    return value


class SpecModel(BaseModel):
    """Base of all spec sections: frozen, no unknown fields, camelCase aliases."""

    model_config = ConfigDict(
        frozen=True,
        extra="forbid",
        alias_generator=to_camel,
        validate_by_alias=True,
        validate_by_name=True,
    )

    @model_validator(mode="before")
    @classmethod
    def _null_means_unset(cls, data: Any) -> Any:
        """``field: null`` is the field left out, as on the API server.

        The API server prunes nulls of non-nullable fields (the CRD has no nullable one) before
        defaulting, so ``seed: null`` gets the default there; here too, and for the entries of a
        map (``nodeSelector: {k: null}`` is ``nodeSelector: {}`` there). An unknown key stays an
        error even when null, as with the server's strict field validation.
        """
        if not isinstance(data, dict):
            return data
        known = {info.alias or name for name, info in cls.model_fields.items()} | set(cls.model_fields)
        maps = {
            key
            for name, info in cls.model_fields.items()
            if get_origin(info.annotation) is dict
            for key in (name, info.alias or name)
        }
        return {
            key: _without_null_entries(value) if key in maps else value
            for key, value in data.items()
            if value is not None or key not in known
        }

    @field_validator("*", mode="before")
    @classmethod
    def _json_scalar_types(cls, value: Any, info: ValidationInfo) -> Any:
        """Scalars must have the JSON type the CRD's schema gives them, as the API server checks.

        Pydantic's lax mode would take ``true`` or ``"2"`` or ``2.0`` for an integer and ``"0.5"``
        for a number; the API server refuses them, so a manifest ``hybridflow run`` accepts
        would be refused by ``kubectl apply``. (Strict mode cannot be used: it refuses lists for
        the tuple fields.)
        """
        if value is None or info.field_name is None:
            return value
        kind = _scalar_kind(cls.model_fields[info.field_name].annotation)
        if kind is not None and not _is_json_kind(value, kind):
            raise PydanticCustomError("json_type", "expected {kind}", {"kind": f"{_ARTICLES[kind]} {kind}"})
        return value


_ARTICLES = {"integer": "an", "number": "a", "boolean": "a", "string": "a"}


def _scalar_kind(annotation: Any) -> str | None:
    """``integer``/``number``/``boolean``/``string`` for a (possibly optional) scalar annotation."""
    origin = get_origin(annotation)
    if origin is Annotated:
        return _scalar_kind(get_args(annotation)[0])
    if origin is Union or origin is types.UnionType:
        kinds = {_scalar_kind(arg) for arg in get_args(annotation) if arg is not type(None)}
        return kinds.pop() if len(kinds) == 1 else None
    return {bool: "boolean", int: "integer", float: "number", str: "string"}.get(annotation)


def _is_json_kind(value: Any, kind: str) -> bool:
    if kind == "boolean":
        return isinstance(value, bool)
    if isinstance(value, bool):
        return False
    if kind == "integer":
        return isinstance(value, int)
    if kind == "number":
        return isinstance(value, int | float)
    return isinstance(value, str)
