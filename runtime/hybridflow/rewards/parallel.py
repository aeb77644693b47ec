"""Rule rewards over a batch, in a pool of processes: the part of scoring that runs in child processes.

Protocol: the controller's :class:`~hybridflow.rewards.scorer.RewardScorer` cuts a batch's
samples into contiguous chunks and submits :func:`score_chunk` for each to a process pool
(``spawn`` start: the controller holds Ray's threads, which a fork would copy mid-flight). A
child resolves the functions by the names the job config gives (a registered rule or an
import path, so nothing unpicklable crosses the process boundary) and returns one list of
floats per function, or, at the first failure, a :class:`SampleFailure` naming the function
and the chunk's row, which the controller turns into an error that names the sample.

This module imports only the rules (no torch, no Ray), so a child starts in a fraction of a
second.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hybridflow.rewards.rules import RewardFunction, resolve_reward_function

__all__ = ["Sample", "SampleFailure", "score_chunk"]

Sample = tuple[str, str, Any, dict[str, Any]]
"""(data_source, response_text, ground_truth, extra_info): the arguments of a reward function."""

_RESOLVED: dict[str, RewardFunction] = {}


@dataclass(frozen=True)
class SampleFailure:
    """A reward function raised (or returned a non-number) on row ``row`` of the chunk."""

    function: str
    row: int
    error: str


def score_chunk(
    function_names: Sequence[str], samples: Sequence[Sample]
) -> list[list[float]] | SampleFailure:
    """Every function's score of every sample, ``[function][sample]``, or the first failure."""
    scores: list[list[float]] = []
    for name in function_names:
        if name not in _RESOLVED:
            _RESOLVED[name] = resolve_reward_function(name)
        function = _RESOLVED[name]
        values = []
        for row, sample in enumerate(samples):
            try:
                values.append(float(function(*sample)))
            except Exception as err:
                return SampleFailure(name, row, f"{type(err).__name__}: {err}")
        scores.append(values)
    return scores
