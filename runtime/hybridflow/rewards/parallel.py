"""Rule rewards over a batch, in a pool of processes: the part of scoring that runs in child processes.

Protocol: the controller's :class:`~hybridflow.rewards.scorer.RewardScorer` cuts a batch's
samples into contiguous chunks and submits :func:`score_chunk` for each to a process pool
(``spawn`` start: the controller holds Ray's threads, which a fork would copy mid-flight). A
child resolves the functions by the names the job config gives (a registered rule or an
import path, so nothing unpicklable crosses the process boundary) and returns one list of
scores per function, or, at the first failure, a :class:`SampleFailure` naming the function
and the chunk's row, which the controller turns into an error that names the sample.

A function is called ``fn(data_source, response, ground_truth, extra_info)`` and, when its
signature names them (or takes ``**kwargs``), also with the keywords of
:data:`RESPONSE_EXTRAS`: ``response_token_ids`` (the response's tokens as generated, special
tokens included, which the decoded ``response`` drops) and ``finish_reason`` (``"stop"``: it
ended on an end token; ``"length"``: it was cut at ``rollout.maxResponseTokens``). Functions
written for the four arguments keep working unchanged.

A score is a number, or a sequence of one number per response token
(``len(response_token_ids)`` of them): a token-level reward, which the scorer places on those
tokens (:mod:`hybridflow.rewards.scorer`). Anything else is a failure of the sample.

This module imports only the rules (no torch, no Ray), so a child starts in a fraction of a
second.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hybridflow.rewards.rules import RewardFunction, resolve_reward_function

__all__ = ["RESPONSE_EXTRAS", "Sample", "SampleFailure", "Score", "accepted_extras", "score_chunk"]

RESPONSE_EXTRAS: tuple[str, ...] = ("response_token_ids", "finish_reason")
"""Keyword arguments a reward function gets when its signature asks for them."""

Score = float | list[float]
"""A response's score: one number, or one per response token."""


@dataclass(frozen=True)
class Sample:
    """What a reward function may read of one response (see the module docstring)."""

    data_source: str
    response: str
    ground_truth: Any
    extra_info: dict[str, Any]
    response_token_ids: list[int] | None = None
    """None only where the batch carries no response tokens (a test's hand-made batch)."""
    finish_reason: str | None = None


@dataclass(frozen=True)
class SampleFailure:
    """A reward function raised (or returned neither a number nor one per token) on row ``row`` of the chunk."""

    function: str
    row: int
    error: str


def accepted_extras(function: Any) -> tuple[str, ...]:
    """The names of :data:`RESPONSE_EXTRAS` that ``function`` accepts as keywords (all with ``**kwargs``)."""
    try:
        parameters = inspect.signature(function).parameters
    except (TypeError, ValueError):  # a builtin or C function without a signature: the four arguments
        return ()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return RESPONSE_EXTRAS
    keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return tuple(name for name in RESPONSE_EXTRAS if name in parameters and parameters[name].kind in keyword)


_RESOLVED: dict[str, tuple[RewardFunction, tuple[str, ...]]] = {}


def _resolved(name: str) -> tuple[RewardFunction, tuple[str, ...]]:
    if name not in _RESOLVED:
        function = resolve_reward_function(name)
        _RESOLVED[name] = (function, accepted_extras(function))
    return _RESOLVED[name]


def as_score(value: Any, response_tokens: int | None) -> Score:
    """``value`` as a number, or as a list of one number per response token; ValueError otherwise."""
    if isinstance(value, (str, bytes)):
        raise ValueError(f"returned {value!r}, not a number or a sequence of numbers")
    try:
        return float(value)
    except TypeError:
        pass
    try:
        values = [float(v) for v in value]
    except TypeError as error:
        raise ValueError(f"returned {type(value).__name__}, not a number or a sequence of numbers") from error
    if response_tokens is None:
        raise ValueError("returned a sequence, but the batch carries no response tokens to place it on")
    if len(values) != response_tokens:
        raise ValueError(
            f"returned {len(values)} values for a response of {response_tokens} tokens: a token-level "
            "reward has one value per response token"
        )
    return values


def score_chunk(
    function_names: Sequence[str], samples: Sequence[Sample]
) -> list[list[Score]] | SampleFailure:
    """Every function's score of every sample, ``[function][sample]``, or the first failure."""
    scores: list[list[Score]] = []
    for name in function_names:
        function, extras = _resolved(name)
        values: list[Score] = []
        for row, sample in enumerate(samples):
            keywords = {extra: getattr(sample, extra) for extra in extras}
            tokens = None if sample.response_token_ids is None else len(sample.response_token_ids)
            try:
                value = function(
                    sample.data_source, sample.response, sample.ground_truth, sample.extra_info, **keywords
                )
                values.append(as_score(value, tokens))
            except Exception as err:
                return SampleFailure(name, row, f"{type(err).__name__}: {err}")
        scores.append(values)
    return scores
