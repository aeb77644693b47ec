"""A user reward module for the scorer tests: light on purpose, since each scorer process imports it."""

from __future__ import annotations

from typing import Any


def fails_on_b(data_source: str, response: str, ground_truth: Any, extra_info: dict[str, Any]) -> float:
    """The response's length; raises on a response containing 'b' (a user function's bug)."""
    if "b" in response:
        raise KeyError("no b allowed")
    return float(len(response))


def stop_and_token_count(
    data_source: str,
    response: str,
    ground_truth: Any,
    extra_info: dict[str, Any],
    *,
    response_token_ids: list[int],
    finish_reason: str,
) -> float:
    """10 for a response that stopped on its end token, 0 if cut; minus 1 per token id 3 in it."""
    return (10.0 if finish_reason == "stop" else 0.0) - response_token_ids.count(3)


def token_ids_as_rewards(
    data_source: str, response: str, ground_truth: Any, extra_info: Any, **extras: Any
) -> list[float]:
    """A token-level reward: each response token's id as its reward (``**extras`` gets every extra)."""
    return [float(token) for token in extras["response_token_ids"]]


def one_value_too_many(
    data_source: str, response: str, ground_truth: Any, extra_info: Any, response_token_ids: list[int]
) -> list[float]:
    return [1.0] * (len(response_token_ids) + 1)
