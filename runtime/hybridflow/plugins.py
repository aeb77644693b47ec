"""Objects named by an import path ``package.module:attribute`` in a job spec.

Reward functions (``spec.rewards[].function``) and the agent's loops, tools, parsers and runners
(``spec.agent``) are resolved here, so that every such field fails the same way: a
``ValueError`` naming the field, the value and what is missing.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["import_attribute"]


def import_attribute(path: str, field: str) -> Any:
    """What ``path`` names (``attribute`` may be dotted, ``pkg.mod:Scorer.score``).

    Only an ``ImportError`` of the module becomes a ``ValueError``: anything else its import
    raises is a bug in the user's module, and its own traceback is the useful message.
    """
    module_name, separator, attribute_path = path.partition(":")
    if not separator or not module_name or not attribute_path:
        raise ValueError(f"{field}: {path!r} is not an import path 'package.module:attribute'")
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(
            f"{field}: {path!r}: module {module_name!r} could not be imported ({error})"
        ) from error
    resolved: list[str] = []
    for attribute in attribute_path.split("."):
        if not hasattr(target, attribute):
            owner = f"{module_name}:{'.'.join(resolved)}" if resolved else f"module {module_name!r}"
            raise ValueError(f"{field}: {path!r}: {owner} has no attribute {attribute!r}")
        target = getattr(target, attribute)
        resolved.append(attribute)
    return target
