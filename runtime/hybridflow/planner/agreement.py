"""How well the planner's predicted step times order plans against measured ones (pure).

``bench/pipeline.py`` runs several plans on this machine and compares the planner's ranking
with the measured one. Step times on a shared machine are noisy (one step of the tiny job
varies by +-25% within a run), so two plans whose measured medians differ by less than the
measurement can resolve have no measured order: :func:`resolvable` decides from the samples
(the medians' standard errors), and :func:`resolved_rank_agreement` is Kendall's tau over the
pairs the measurement orders, ``(C - D) / (C + D)`` (Goodman and Kruskal's gamma when the
predictions have no ties). Kendall's tau-b would count an unresolved pair as a tie that the
prediction must reproduce, so it stays below 1 even when every ordered pair agrees (0.63 with
four of ten pairs ordered). :func:`kendall_tau` is tau-a over every pair as measured.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Sequence

__all__ = [
    "RESOLUTION_STANDARD_ERRORS",
    "kendall_tau",
    "median_standard_error",
    "resolvable",
    "resolved_rank_agreement",
]

RESOLUTION_STANDARD_ERRORS = 2.0
"""Two medians are ordered when they differ by more than this many standard errors of the difference
(about a 95% two-sided interval for near-normal step times)."""

_MAD_TO_SIGMA = 1.4826
"""The median absolute deviation of a normal sample times this is its standard deviation."""

_MEDIAN_EFFICIENCY = math.sqrt(math.pi / 2)
"""The median's standard error over the mean's for a normal sample (1.2533)."""


def median_standard_error(samples: Sequence[float]) -> float:
    """The standard error of the median of ``samples``, from their MAD (robust to a few spikes)."""
    if len(samples) < 2:
        raise ValueError(f"a standard error needs at least 2 samples, got {len(samples)}")
    centre = statistics.median(samples)
    sigma = _MAD_TO_SIGMA * statistics.median(abs(x - centre) for x in samples)
    return _MEDIAN_EFFICIENCY * sigma / math.sqrt(len(samples))


def resolvable(first: Sequence[float], second: Sequence[float]) -> bool:
    """Whether the medians of two sets of step times differ by more than the measurement resolves."""
    difference = abs(statistics.median(first) - statistics.median(second))
    error = math.hypot(median_standard_error(first), median_standard_error(second))
    return difference > RESOLUTION_STANDARD_ERRORS * error


def _sign(value: float) -> int:
    return (value > 0) - (value < 0)


def resolved_rank_agreement(
    predicted: Sequence[float], measured: Sequence[float], unresolved: set[tuple[int, int]]
) -> tuple[float, int]:
    """``((C - D) / (C + D), C + D)`` over the pairs ``i < j`` not in ``unresolved`` whose predictions differ.

    ``C`` and ``D`` count the concordant and discordant pairs; ``nan`` when no pair is left.
    """
    if len(predicted) != len(measured):
        raise ValueError(f"{len(predicted)} predicted and {len(measured)} measured values")
    concordant = discordant = 0
    for i, j in itertools.combinations(range(len(predicted)), 2):
        if (i, j) in unresolved:
            continue
        sign = _sign(predicted[i] - predicted[j]) * _sign(measured[i] - measured[j])
        concordant += sign > 0
        discordant += sign < 0
    ordered = concordant + discordant
    return ((concordant - discordant) / ordered if ordered else math.nan), ordered


def kendall_tau(predicted: Sequence[float], measured: Sequence[float]) -> float:
    """Kendall's tau-a: concordant minus discordant pairs over all pairs (ties count as neither)."""
    pairs = list(itertools.combinations(range(len(predicted)), 2))
    if not pairs:
        return math.nan
    score = sum(_sign(predicted[i] - predicted[j]) * _sign(measured[i] - measured[j]) for i, j in pairs)
    return score / len(pairs)
