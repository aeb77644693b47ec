"""Objects named by an import path ``package.module:attribute`` in ``spec.agent`` (loops, tools, parsers, runners)."""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["import_attribute"]


def import_attribute(path: str, field: str) -> Any:
    """What ``path`` names (``attribute`` may be dotted); a ``ValueError`` naming ``field``, the value and what is missing."""
    module_name, separator, attribute = path.partition(":")
    if not separator or not module_name or not attribute:
        raise ValueError(f"{field}: {path!r} is not an import path 'package.module:attribute'")
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(
            f"{field}: {path!r}: module {module_name!r} could not be imported ({error})"
        ) from error
    for part in attribute.split("."):
        if not hasattr(target, part):
            raise ValueError(f"{field}: {path!r}: {module_name!r} has no attribute {attribute!r}")
        target = getattr(target, part)
    return target
