"""Rank agreement between predicted and measured step times, with ties the measurement cannot resolve."""

from __future__ import annotations

import math

import pytest

from hybridflow.planner.agreement import (
    kendall_tau,
    median_standard_error,
    resolvable,
    resolved_rank_agreement,
)

pytestmark = pytest.mark.unit


def test_kendall_tau_counts_concordant_minus_discordant_pairs() -> None:
    assert kendall_tau([1, 2, 3, 4], [10, 20, 30, 40]) == 1.0
    assert kendall_tau([1, 2, 3, 4], [40, 30, 20, 10]) == -1.0
    # One swapped neighbour pair out of six: (5 - 1) / 6.
    assert kendall_tau([1, 2, 3, 4], [10, 30, 20, 40]) == pytest.approx(4 / 6)


def test_agreement_counts_only_the_pairs_the_measurement_orders() -> None:
    predicted = [1.0, 2.0, 3.0, 4.0, 5.0]
    # Measured: plans 1 and 2 swapped, within the resolution; plan order otherwise as predicted.
    measured = [0.40, 0.45, 0.44, 0.50, 0.60]
    assert kendall_tau(predicted, measured) == pytest.approx(8 / 10)
    assert resolved_rank_agreement(predicted, measured, {(1, 2)}) == (1.0, 9)
    # Without the tie the swapped pair is discordant: (9 - 1) / 10, as tau-a.
    assert resolved_rank_agreement(predicted, measured, set()) == (pytest.approx(0.8), 10)
    # A discordant pair the measurement does resolve still counts against the planner.
    reversed_order = [0.60, 0.45, 0.44, 0.50, 0.40]
    agreement, ordered = resolved_rank_agreement(predicted, reversed_order, {(1, 2)})
    assert ordered == 9 and agreement == pytest.approx((2 - 7) / 9)
    # Nothing resolved: nothing to compare.
    assert math.isnan(resolved_rank_agreement([1.0, 2.0], [1.0, 1.1], {(0, 1)})[0])
    with pytest.raises(ValueError, match="3 predicted and 2 measured"):
        resolved_rank_agreement([1.0, 2.0, 3.0], [1.0, 2.0], set())


def test_resolvable_separates_medians_by_their_standard_errors() -> None:
    noisy = [0.40, 0.46, 0.38, 0.52, 0.44, 0.41, 0.47, 0.43, 0.39, 0.50]
    shifted = [x + 0.02 for x in noisy]
    far = [x + 0.2 for x in noisy]
    assert median_standard_error(noisy) > 0
    assert not resolvable(noisy, shifted)
    assert resolvable(noisy, far)
    # More samples of the same spread resolve a smaller difference.
    assert resolvable(noisy * 40, shifted * 40)
    with pytest.raises(ValueError, match="at least 2 samples"):
        median_standard_error([0.4])
