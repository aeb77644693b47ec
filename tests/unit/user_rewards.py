"""A user reward module for the scorer tests: light on purpose, since each scorer process imports it."""

from __future__ import annotations

from typing import Any


def fails_on_b(data_source: str, response: str, ground_truth: Any, extra_info: dict[str, Any]) -> float:
    """The response's length; raises on a response containing 'b' (a user function's bug)."""
    if "b" in response:
        raise KeyError("no b allowed")
    return float(len(response))
