"""Where a step's time went (hybridflow.trainer.step_accounting): idle pools, controller overhead, compile time."""

from __future__ import annotations

import time

import pytest

from hybridflow.algorithms.timing import StepTimer, recording_controller_work
from hybridflow.controller import BusyReport
from hybridflow.trainer.step_accounting import (
    controller_overhead,
    covered_seconds,
    move_compile_time,
    pool_idle_fractions,
)

pytestmark = pytest.mark.unit


def report(
    busy: float,
    calls: tuple[tuple[float, float], ...] = (),
    window: tuple[float, float] = (0.0, 0.0),
    **compiled: float,
) -> BusyReport:
    wall = window[1] - window[0] if window[1] > window[0] else 1.0
    return BusyReport(busy, wall, {k.replace("__", "."): v for k, v in compiled.items()}, calls, window)


def test_idle_fraction_is_the_mean_over_a_pools_ranks() -> None:
    reports = {
        "train": [report(0.9), report(0.7)],
        "generate": [report(0.25)],
        "empty": [BusyReport(0.0, 0.0)],
    }
    assert pool_idle_fractions(reports) == pytest.approx(
        {
            "pool/train/idle_fraction": 0.2,
            "pool/generate/idle_fraction": 0.75,
            "pool/empty/idle_fraction": 0.0,
        }
    )


@pytest.mark.parametrize(
    ("intervals", "expected"),
    [
        ([], 0.0),
        ([(1.0, 2.0), (3.0, 4.0)], 2.0),
        ([(1.0, 3.0), (2.0, 4.0)], 3.0),  # overlapping: counted once
        ([(1.0, 4.0), (2.0, 3.0)], 3.0),  # nested
        ([(-5.0, 1.0), (9.0, 20.0)], 2.0),  # clipped to the window [0, 10]
        ([(11.0, 12.0)], 0.0),
    ],
)
def test_covered_seconds_is_the_clipped_union(intervals: list[tuple[float, float]], expected: float) -> None:
    assert covered_seconds(intervals, 0.0, 10.0) == pytest.approx(expected)


def test_overhead_is_what_neither_the_busiest_rank_nor_the_algorithm_covers() -> None:
    # A 10 s window: the busiest rank works 1-4 and 6-8 (5 s), the controller scores 4-5; the
    # rest (0-1, 5-6, 8-10: 4 s) is dispatch, transport and bookkeeping.
    busiest = report(5.0, ((1.0, 4.0), (6.0, 8.0)), (0.0, 10.0))
    idle_peer = report(1.0, ((1.0, 2.0),), (0.0, 10.0))
    metrics = controller_overhead({"train": [idle_peer, busiest]}, [(4.0, 5.0)])
    assert metrics == pytest.approx({"controller/overhead_seconds": 4.0, "controller/overhead_fraction": 0.4})
    # Controller work overlapping the rank's is not subtracted twice.
    assert controller_overhead({"train": [busiest]}, [(1.5, 5.0)])[
        "controller/overhead_seconds"
    ] == pytest.approx(4.0)
    assert controller_overhead({"train": [BusyReport(0.0, 0.0)]}, []) == {}


def test_compile_seconds_leave_the_phase_that_paid_them() -> None:
    metrics = {"timing/generate": 3.0, "timing/actor_update": 0.5, "timing/reward": 0.1}
    reports = {
        "default": [
            report(1.0, rollout__generate_sequences=2.0, actor__update_policy=1.0),
            report(1.0, rollout__generate_sequences=2.5, actor__save_checkpoint=4.0),
        ]
    }
    move_compile_time(metrics, reports)
    # generate gives up the slowest rank's 2.5 s; actor_update no more than the 0.5 s it measured;
    # a call without a phase (a checkpoint) leaves its seconds in `other`.
    assert metrics == pytest.approx(
        {"timing/generate": 0.5, "timing/actor_update": 0.0, "timing/reward": 0.1, "timing/compile": 3.0}
    )
    untouched = {"timing/generate": 3.0}
    move_compile_time(untouched, {"default": [report(1.0)]})
    assert untouched == {"timing/generate": 3.0}  # nothing compiled: no compile phase


def test_the_controller_work_of_a_step_is_recorded_from_its_timers() -> None:
    with recording_controller_work() as work:
        timer = StepTimer()
        with timer.phase("generate"):
            pass
        before = time.time()
        with timer.phase("reward"):
            time.sleep(0.01)
        with timer.phase("advantages"):
            pass
    assert len(work) == 2  # reward and advantages; generation is the workers'
    (start, end), _ = work
    assert before <= start and end - start >= 0.01
    with StepTimer().phase("reward"):
        pass  # outside a recording: nothing kept, nothing raised
    assert len(work) == 2
