"""The one base class of every RLHFJob spec model, and the conventions it fixes.

Every section of the spec is frozen (a validated config cannot drift while the job runs),
forbids unknown keys (a typo is an error at load time, not a silently ignored knob) and
speaks camelCase to YAML and the CRD while Python code uses the snake_case names. The
manifest loader validates by alias only, so a manifest accepted on a laptop uses the same
keys the API server accepts; constructing models in Python by field name stays possible.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict
from pydantic.alias_generators import to_camel


class SpecModel(BaseModel):
    """Base of all spec sections: frozen, no unknown fields, camelCase aliases."""

    model_config = ConfigDict(
        frozen=True,
        extra="forbid",
        alias_generator=to_camel,
        validate_by_alias=True,
        validate_by_name=True,
    )
