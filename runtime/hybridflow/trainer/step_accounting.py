"""Where a step's time went, from the workers' busy reports: idle pools, compile time, controller overhead.

At the end of every step the trainer asks each worker host for its
:class:`~hybridflow.controller.BusyReport` (seconds inside worker methods, the methods' wall-clock
intervals, and the seconds ``torch.compile`` took in each ``role.method``) and turns them into
step metrics with the pure functions here:

* :func:`pool_idle_fractions`: ``pool/<pool>/idle_fraction``, each pool's mean over its ranks
  of ``1 - busy / wall``.
* :func:`controller_overhead`: ``controller/overhead_seconds`` and ``controller/overhead_fraction``,
  what the single controller adds to the step: dispatch, argument and result transport, the
  protocols' split and collect, metrics and bookkeeping between steps. Measured as the time in
  the interval during which the busiest rank (the step's critical path on a one-pool job) ran
  no worker method *and* the controller did none of the algorithm's own work (rule rewards,
  advantages: :data:`~hybridflow.algorithms.timing.CONTROLLER_WORK_PHASES`). On a job whose
  roles share one pool this is exact; with several pools the busiest rank may also wait for
  another pool, which counts here, so the figure is an upper bound.
* :func:`move_compile_time`: ``timing/compile``, the seconds ``torch.compile`` took on the
  step's path (``spec.rollout.compile``, ``spec.training.compile``), moved out of the phase that
  triggered it (``generate`` for the rollout's decode step, ``actor_update`` for the actor's
  forward and backward...), so the phases still add up to the step.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, MutableMapping, Sequence

from hybridflow.controller import BusyReport

__all__ = [
    "PHASE_OF_CALL",
    "controller_overhead",
    "covered_seconds",
    "move_compile_time",
    "pool_idle_fractions",
]

PHASE_OF_CALL: Mapping[str, str] = {
    "rollout.generate_sequences": "generate",
    "rollout.sync_weights": "weight_sync",
    "rollout.receive_weights": "weight_sync",
    "actor.push_weights": "weight_sync",
    "actor.compute_log_probs": "old_log_probs",
    "actor.update_policy": "actor_update",
    "reference.compute_ref_log_probs": "ref_log_probs",
    "critic.compute_values": "values",
    "critic.update_critic": "critic_update",
    "cost_critic.compute_values": "cost_values",
    "cost_critic.update_critic": "cost_critic_update",
    "reward.compute_scores": "reward",
    "cost.compute_costs": "cost",
}
"""The step phase that waits on each worker call (what ``timing/compile`` is taken out of)."""


def pool_idle_fractions(reports: Mapping[str, Sequence[BusyReport]]) -> dict[str, float]:
    """``pool/<pool>/idle_fraction``: per pool, the mean over its ranks of ``1 - busy / wall``.

    ``reports`` are the hosts' reports over one step
    (:meth:`~hybridflow.controller.Deployment.busy_reports`); a rank with no wall time counts
    as not idle.
    """
    fractions = {}
    for pool, ranks in reports.items():
        idle = [
            min(1.0, max(0.0, 1.0 - r.busy_seconds / r.wall_seconds)) if r.wall_seconds > 0 else 0.0
            for r in ranks
        ]
        if idle:
            fractions[f"pool/{pool}/idle_fraction"] = sum(idle) / len(idle)
    return fractions


def covered_seconds(intervals: Iterable[tuple[float, float]], start: float, end: float) -> float:
    """Seconds of ``[start, end]`` inside at least one of ``intervals`` (their union, clipped)."""
    clipped = sorted((max(a, start), min(b, end)) for a, b in intervals if b > start and a < end)
    covered, reach = 0.0, start
    for a, b in clipped:
        if b <= reach:
            continue
        covered += b - max(a, reach)
        reach = b
    return covered


def controller_overhead(
    reports: Mapping[str, Sequence[BusyReport]], controller_work: Sequence[tuple[float, float]]
) -> dict[str, float]:
    """``controller/overhead_seconds`` and ``controller/overhead_fraction`` of one step (module docstring).

    The interval is the busiest rank's report window, which runs from the previous step's
    report to this one's, so it holds the previous step's checkpoint and metrics writes too.
    Empty when no rank reported a window.
    """
    ranks = [report for pool in reports.values() for report in pool if report.window[1] > report.window[0]]
    if not ranks:
        return {}
    busiest = max(ranks, key=lambda report: report.busy_seconds)
    start, end = busiest.window
    idle = (end - start) - covered_seconds([*busiest.calls, *controller_work], start, end)
    overhead = max(0.0, idle)
    return {
        "controller/overhead_seconds": overhead,
        "controller/overhead_fraction": overhead / (end - start),
    }


def move_compile_time(
    metrics: MutableMapping[str, float], reports: Mapping[str, Sequence[BusyReport]]
) -> None:
    """Add ``timing/compile`` to ``metrics``, taken out of the phases whose calls compiled (module docstring).

    Per ``role.method``, the step's compile seconds are the most any rank spent (ranks compile
    at the same time). Each phase gives up at most what it measured: a call hidden behind
    another phase (a log-prob pass while the controller scores) shows only its wait, and only
    that much of its compile time was on the step's path. Calls with no phase of their own
    (checkpoint saves, stats) leave their compile seconds in ``timing/other``. Nothing is added
    when nothing compiled.
    """
    per_call: dict[str, float] = {}
    for pool in reports.values():
        for report in pool:
            for call, seconds in report.compile_seconds.items():
                per_call[call] = max(per_call.get(call, 0.0), seconds)
    moved = 0.0
    for call, seconds in per_call.items():
        key = f"timing/{PHASE_OF_CALL.get(call, '')}"
        if key in metrics:
            taken = min(seconds, metrics[key])
            metrics[key] -= taken
            moved += taken
    if per_call:
        metrics["timing/compile"] = metrics.get("timing/compile", 0.0) + moved
