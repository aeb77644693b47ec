"""Seconds per phase of one RL step: what a step reports as ``timing/<phase>``.

Protocol. A step function makes one :class:`StepTimer`, runs each piece of its work inside
``with timer.phase(name):`` (controller math, blocking worker calls) or starts concurrent worker
calls with ``timer.submit(name, workers.critic.compute_values, batch)``, whose submission and,
later, ``result()`` both count toward ``name``; it returns ``timer.metrics()`` with its other
metrics. The trainer then reports what the step's wall time holds beyond those phases (prompt
sampling, bookkeeping between phases, the workers' step reports, the previous step's metrics
writes) as ``timing/other``
(:func:`unmeasured_seconds`), so the phases plus ``other`` are ``perf/step_seconds``.

Phases are intervals of the controller's single thread and never nest, so they are disjoint
and never add up to more than the step. Work that runs while the controller is in another
phase is hidden in that one: the actor's and the reference's log-prob passes run while the
controller scores the responses, so ``old_log_probs`` and ``ref_log_probs`` show only the wait
they add after ``reward``; PPO's critic and actor updates on separate pools run at the same
time, so ``actor_update`` shows only what it adds after ``critic_update`` (colocated, they run
one after the other and each shows its own time). A phase entered twice (ReMax's greedy
generation and scoring) adds up.

Names are the catalogue's :data:`~hybridflow.metrics.catalogue.STEP_PHASES`, which Prometheus,
the docs and the dashboards read; any other name raises, so no phase goes unlisted.

Every timer also records the wall-clock intervals of the phases in which the controller itself
computes (:data:`CONTROLLER_WORK_PHASES`: scoring, advantages) into the list that the trainer
opened around the step with :func:`recording_controller_work` (step functions, plugins
included, need not pass anything back): with the workers' busy intervals they tell the
algorithm's work apart from what the controller adds around it
(:mod:`hybridflow.trainer.step_accounting`).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from hybridflow.controller.worker_group import GroupFuture, MethodCaller
from hybridflow.metrics.catalogue import OTHER_PHASE, STEP_PHASES

__all__ = [
    "CONTROLLER_WORK_PHASES",
    "StepTimer",
    "TimedFuture",
    "recording_controller_work",
    "unmeasured_seconds",
]

_NAMES = tuple(phase.name for phase in STEP_PHASES)

CONTROLLER_WORK_PHASES = frozenset({"reward", "cost", "advantages"})
"""Phases whose work is the algorithm's, done in the controller's process (rule rewards in its
pool, advantage math), or waits on a reward or cost model: not overhead the controller adds."""

_controller_work: ContextVar[list[tuple[float, float]] | None] = ContextVar("controller_work", default=None)


@contextmanager
def recording_controller_work() -> Iterator[list[tuple[float, float]]]:
    """A list that every :class:`StepTimer` phase of :data:`CONTROLLER_WORK_PHASES` in the block appends
    its wall-clock (start, end) to; the trainer opens one per step."""
    intervals: list[tuple[float, float]] = []
    token = _controller_work.set(intervals)
    try:
        yield intervals
    finally:
        _controller_work.reset(token)


class TimedFuture:
    """A worker call's pending result whose ``result()`` wait counts toward the call's phase."""

    def __init__(self, timer: StepTimer, phase: str, future: GroupFuture) -> None:
        self._timer, self._phase, self._future = timer, phase, future

    def result(self) -> Any:
        with self._timer.phase(self._phase):
            return self._future.result()


class StepTimer:
    """The ``timing/<phase>`` seconds of one step (see the module docstring for the protocol)."""

    def __init__(self) -> None:
        self._seconds: dict[str, float] = {}
        self._current: str | None = None

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if name not in _NAMES:
            raise ValueError(f"timing phase {name!r}: not one of the catalogue's step phases {list(_NAMES)}")
        if self._current is not None:
            raise RuntimeError(f"timing phase {name!r} started inside {self._current!r}: phases do not nest")
        self._current = name
        started, started_wall = time.monotonic(), time.time()
        try:
            yield
        finally:
            self._seconds[name] = self._seconds.get(name, 0.0) + time.monotonic() - started
            recorded = _controller_work.get()
            if recorded is not None and name in CONTROLLER_WORK_PHASES:
                recorded.append((started_wall, time.time()))
            self._current = None

    def submit(self, name: str, method: MethodCaller, *args: Any, **kwargs: Any) -> TimedFuture:
        """``method.submit(*args, **kwargs)`` inside phase ``name``; the future's wait counts there too."""
        with self.phase(name):
            return TimedFuture(self, name, method.submit(*args, **kwargs))

    def metrics(self) -> dict[str, float]:
        """``timing/<phase>`` for every phase entered, in the order first entered."""
        return {f"timing/{name}": seconds for name, seconds in self._seconds.items()}


def unmeasured_seconds(metrics: Mapping[str, float], step_seconds: float) -> float:
    """``step_seconds`` less the step's ``timing/*`` phases: the trainer's ``timing/other``.

    Never negative: the phases are disjoint intervals inside the step (a step that writes
    overlapping ``timing/*`` figures of its own gets 0 rather than a negative remainder).
    """
    other = f"timing/{OTHER_PHASE.name}"
    measured = sum(value for key, value in metrics.items() if key.startswith("timing/") and key != other)
    return max(0.0, step_seconds - measured)
