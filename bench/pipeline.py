"""Placement figures: the tiny GRPO job on simulated GPUs, measured per placement and predicted by the planner.

The candidates are what the planner chooses between: for each GPU budget (1, 2 and 4 simulated
GPUs on this machine's cores; 1 and 2 with ``--quick``), the best plan of each placement kind
``plan_job`` returns for examples/grpo-tiny.yaml (everything colocated, or the actor with the
rollout and the reference on pools of their own), costed with device constants measured in
this process (``calibrate_device``, what ``hybridflow plan --profile`` does). After one
untimed warm-up run (Ray's freshly started processes take the cores for seconds), every
candidate runs ``run_training`` for a few steps in this process's one embedded Ray, twice (all
candidates forwards, then backwards, so that a drifting load on the machine weighs on each
alike); its step time is the median ``perf/step_seconds`` over the steps of both runs after
each run's first step, and its phases the mean over the runs of the median of the runner's
``timing/*`` (:data:`MEASURED_PHASES`).

Figures: ``step_seconds_colocated_sync`` and ``step_seconds_split_sync`` (2 GPUs: both roles on
both GPUs, or one GPU each), their ratio, each candidate's predicted and measured step and
phase seconds, the measured device constants, and ``planner_rank_agreement``, Kendall's tau
between the predicted and the measured step times over every pair of candidates (target >=
0.8). Stricter, ``planner_rank_agreement_resolved_pairs`` is the same over only the
``resolved_pairs`` pairs whose measured medians differ by more than two standard errors of
the difference (:mod:`hybridflow.planner.agreement`; the others are ``measured_ties``): one
step of the tiny job varies by up to +-25% within a run, and plans that measure within that
resolution have no order to agree with, while a pair it resolves must agree.

Overlap: examples/grpo-tiny-overlap.yaml (actor and reference on one simulated GPU, the rollout
on another) runs synchronously (``rollout.maxStaleness: 0``: generate, then score and update)
and overlapped (``maxStaleness: 1``: the next step generates while the actor updates), each for
the learning budget (``OVERLAP_STEPS``), sync, overlap, overlap, sync in the full run (one each
with ``--quick``). ``step_seconds_split_overlap`` is the overlapped run's median step time (after
the first step), ``step_seconds_rollout_split_sync`` the synchronous one's on the same pools,
``overlap_over_rollout_split_sync`` their ratio (target <= 0.75) and ``overlap_over_split_sync``
the ratio to ``step_seconds_split_sync``. ``overlap_reward_gain`` is the overlapped run's mean
reward over its last ``window`` steps minus over its first (target >= 0.3 over the full budget;
the runs are seeded, so a repeat learns the same), ``sync_reward_gain`` the synchronous run's,
for comparison. ``overlap_idle_fraction`` and ``sync_idle_fraction`` are the mean idle fraction
per pool. ``--quick`` runs fewer candidates and steps, each candidate once. The last line
printed is one JSON object.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import statistics
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import ray

from hybridflow.controller.resource_pool import node_pool_resource
from hybridflow.models.tiny import write_tiny_model
from hybridflow.planner import ClusterShape, Plan, plan_job
from hybridflow.planner.agreement import kendall_tau, resolvable, resolved_rank_agreement
from hybridflow.planner.calibrate import calibrate_device
from hybridflow.planner.hardware import SIMULATED_CPU_GPU, DeviceConstants
from hybridflow.planner.job import apply_plan, workload_from_spec
from hybridflow.rewards import make_toy_dataset
from hybridflow.spec import RLHFJobSpec, load_job_manifest
from hybridflow.spec.resources import ResourcePoolSpec, RolePlacementSpec
from hybridflow.trainer.runner import run_training

ROOT = Path(__file__).resolve().parents[1]
BUDGET_POOL = "bench"
TARGET_TAU = 0.8
TARGET_OVERLAP_RATIO = 0.75
TARGET_GAIN = 0.3
OVERLAP_STEPS, QUICK_OVERLAP_STEPS = 30, 8


BUDGETS, QUICK_BUDGETS = (1, 2, 4), (1, 2)
"""GPU budgets whose plans are measured: for each, the best plan of each placement kind."""

MEASURED_PHASES = {
    "generate": ("timing/weight_sync", "timing/generate"),
    "score": ("timing/old_log_probs", "timing/ref_log_probs", "timing/reward"),
    "train": ("timing/actor_update", "timing/advantages"),
}
"""The runner's ``timing/*`` figures that make up each phase of the cost model's step."""


@dataclass(frozen=True)
class Candidate:
    """A plan to measure: the planner's best plan of one placement kind on a budget of ``gpus``."""

    label: str
    gpus: int
    plan: Plan


def candidates(
    workdir: Path, model: Path, data: Path, steps: int, budgets: tuple[int, ...], device: DeviceConstants
) -> list[tuple[Candidate, RLHFJobSpec]]:
    """For each budget, the best plan of each placement kind ``plan_job`` returns, and its spec."""
    chosen = []
    for gpus in budgets:
        spec = budget_spec(workdir / f"budget-{gpus}", model, data, gpus, steps)
        seen: set[str] = set()
        for plan in plan_job(workload_from_spec(spec), ClusterShape(gpus, gpus), device):
            if plan.placement.kind in seen:
                continue
            seen.add(plan.placement.kind)
            sizes = "-".join(str(pool.gpus) for pool in plan.pools)
            label = f"{'colocate' if plan.placement.kind == 'colocate' else 'split'}-{sizes}"
            chosen.append((Candidate(label, gpus, plan), apply_plan(spec, plan)))
    return chosen


def budget_spec(workdir: Path, model: Path, data: Path, gpus: int, steps: int) -> RLHFJobSpec:
    """examples/grpo-tiny.yaml on a budget of ``gpus`` GPUs with ``placement: auto``."""
    spec = load_job_manifest(ROOT / "examples" / "grpo-tiny.yaml").spec
    return spec.model_copy(
        update={
            "models": spec.models.model_validate({"actor": {"path": str(model)}}),
            "data": spec.data.model_copy(update={"train_files": (str(data),)}),
            "training": spec.training.model_copy(update={"total_steps": steps}),
            "resource_pools": (ResourcePoolSpec(name=BUDGET_POOL, nodes=1, gpus_per_node=gpus),),
            "roles": RolePlacementSpec(actor=BUDGET_POOL),
            "placement": "auto",
            "output_dir": str(workdir),
        }
    )


def overlap_spec(workdir: Path, model: Path, data: Path, steps: int, max_staleness: int) -> RLHFJobSpec:
    """examples/grpo-tiny-overlap.yaml (actor | rollout on 1 + 1 GPUs) with ``rollout.maxStaleness``."""
    spec = load_job_manifest(ROOT / "examples" / "grpo-tiny-overlap.yaml").spec
    return spec.model_copy(
        update={
            "models": spec.models.model_validate({"actor": {"path": str(model)}}),
            "data": spec.data.model_copy(update={"train_files": (str(data),)}),
            "training": spec.training.model_copy(update={"total_steps": steps}),
            "rollout": spec.rollout.model_copy(update={"max_staleness": max_staleness}),
            "output_dir": str(workdir / f"staleness-{max_staleness}"),
        }
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--quick",
        action="store_true",
        default=os.environ.get("HYBRIDFLOW_BENCH_QUICK") == "1",
        help="budgets of 1 and 2 GPUs, fewer steps (CI)",
    )
    args = parser.parse_args()
    steps = 4 if args.quick else 24

    workdir = Path(tempfile.mkdtemp(prefix="hybridflow-pipeline-"))
    model = write_tiny_model(workdir / "tiny-model")
    data = workdir / "target_char.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in make_toy_dataset("target_char", 256, seed=0)))

    probe = workload_from_spec(budget_spec(workdir / "probe", model, data, 1, steps))
    device = calibrate_device(probe, SIMULATED_CPU_GPU)
    chosen = candidates(workdir, model, data, steps, QUICK_BUDGETS if args.quick else BUDGETS, device)

    overlap_steps = QUICK_OVERLAP_STEPS if args.quick else OVERLAP_STEPS
    overlap_specs = {s: overlap_spec(workdir / "overlap", model, data, overlap_steps, s) for s in (0, 1)}
    capacity: dict[str, float] = {}
    for spec in [*(spec for _, spec in chosen), *overlap_specs.values()]:
        for pool in spec.resource_pools:
            key = node_pool_resource(pool.name)
            capacity[key] = max(capacity.get(key, 0.0), float(pool.world_size))
    ray.init(
        num_cpus=os.cpu_count() or 1,
        num_gpus=max(candidate.gpus for candidate, _ in chosen),
        resources=capacity,
        include_dashboard=False,
        configure_logging=False,
        log_to_driver=False,
    )
    # Other load on the machine drifts over minutes: run the candidates forwards, then backwards
    # (ABC CBA), so a linear drift adds the same time to every candidate's mean. A quick run
    # judges nothing: forwards only.
    order = [*range(len(chosen))]
    if not args.quick:
        order += reversed(range(len(chosen)))
    seconds: dict[int, list[float]] = {index: [] for index in range(len(chosen))}
    phases: dict[int, list[dict[str, float]]] = {index: [] for index in range(len(chosen))}
    try:
        if not args.quick:  # a quick run judges nothing: no warm-up for the timings
            warm_up = chosen[0][1]
            run_training(
                warm_up.model_copy(update={"output_dir": str(Path(warm_up.output_dir) / "warm-up")}),
                on_step=lambda line: None,
            )
        for round_index, index in enumerate(order):
            candidate, spec = chosen[index]
            out = Path(spec.output_dir) / candidate.label / f"round-{round_index}"
            summary = run_training(
                spec.model_copy(update={"output_dir": str(out)}), on_step=lambda line: None
            )
            steps_seconds = [m["perf/step_seconds"] for m in summary.metrics[1:]]
            seconds[index].extend(steps_seconds)
            phases[index].append(measured_phases(summary.metrics[1:]))
            print(
                json.dumps(
                    {
                        "label": candidate.label,
                        "round": round_index,
                        "seconds": statistics.median(steps_seconds),
                    }
                ),
                file=sys.stderr,
            )
        # The overlap pair: synchronous and overlapped on the same two pools, forwards then backwards.
        overlap_order = [0, 1] if args.quick else [0, 1, 1, 0]
        overlap_runs: dict[int, list[list[dict[str, float]]]] = {0: [], 1: []}
        for round_index, staleness in enumerate(overlap_order):
            spec = overlap_specs[staleness]
            out = Path(spec.output_dir) / f"round-{round_index}"
            summary = run_training(
                spec.model_copy(update={"output_dir": str(out)}), on_step=lambda line: None
            )
            overlap_runs[staleness].append(summary.metrics)
            print(
                json.dumps(
                    {
                        "label": f"rollout-split-staleness-{staleness}",
                        "round": round_index,
                        "seconds": statistics.median(m["perf/step_seconds"] for m in summary.metrics[1:]),
                    }
                ),
                file=sys.stderr,
            )
    finally:
        ray.shutdown()
    rows = [
        {
            "label": candidate.label,
            "gpus": candidate.gpus,
            "placement": candidate.plan.placement.describe(),
            "predicted_step_seconds": round(candidate.plan.step_seconds, 4),
            "measured_step_seconds": round(statistics.median(seconds[index]), 4),
            "predicted_phase_seconds": {k: round(v, 4) for k, v in candidate.plan.phase_seconds.items()},
            "measured_phase_seconds": {
                phase: round(statistics.mean(run[phase] for run in phases[index]), 4)
                for phase in MEASURED_PHASES
            },
        }
        for index, (candidate, _) in enumerate(chosen)
    ]
    measured = {
        candidate.label: statistics.median(seconds[index]) for index, (candidate, _) in enumerate(chosen)
    }
    predicted = [candidate.plan.step_seconds for candidate, _ in chosen]
    ties = {
        (i, j)
        for i, j in itertools.combinations(range(len(chosen)), 2)
        if not resolvable(seconds[i], seconds[j])
    }
    agreement, resolved_pairs = resolved_rank_agreement(predicted, list(measured.values()), ties)
    figures = {
        "steps_per_run": steps,
        "device": device.name,
        "measured_compute_slots": round(device.compute_slots or 0.0, 2),
        "measured_collective_latency_seconds": round(device.collective_latency_seconds, 6),
        "measured_device": {
            name: round(value, 6) if isinstance(value, float) else value
            for name, value in asdict(device).items()
        },
        "step_seconds_colocated_sync": round(measured["colocate-2"], 4),
        "step_seconds_split_sync": round(measured["split-1-1"], 4),
        "split_over_colocated_ratio": round(measured["split-1-1"] / measured["colocate-2"], 3),
        **overlap_figures(overlap_runs, measured["split-1-1"], window=2 if args.quick else 5),
        "candidates": rows,
        "measured_ties": [[chosen[i][0].label, chosen[j][0].label] for i, j in sorted(ties)],
        "planner_rank_agreement": round(kendall_tau(predicted, list(measured.values())), 3),
        # None when the measurement resolves no pair (a NaN would not be JSON).
        "planner_rank_agreement_resolved_pairs": None if math.isnan(agreement) else round(agreement, 3),
        "resolved_pairs": resolved_pairs,
        "target_rank_agreement": TARGET_TAU,
    }
    print(json.dumps(figures))


def measured_phases(metrics: list[dict[str, float]]) -> dict[str, float]:
    """Median seconds per step of each phase of :data:`MEASURED_PHASES` over ``metrics``."""
    return {
        phase: statistics.median(sum(m.get(key, 0.0) for key in keys) for m in metrics)
        for phase, keys in MEASURED_PHASES.items()
    }


def overlap_figures(
    runs: dict[int, list[list[dict[str, float]]]], split_sync_seconds: float, *, window: int
) -> dict[str, object]:
    """The overlap figures of the module docstring from the synchronous (0) and overlapped (1) runs."""

    def step_seconds(staleness: int) -> float:
        return statistics.mean(
            statistics.median(m["perf/step_seconds"] for m in metrics[1:]) for metrics in runs[staleness]
        )

    def reward_gain(staleness: int) -> float:
        rewards = [m["reward/mean"] for m in runs[staleness][0]]
        return statistics.mean(rewards[-window:]) - statistics.mean(rewards[:window])

    def idle(staleness: int) -> dict[str, float]:
        metrics = runs[staleness][0][1:]
        pools = sorted({k for m in metrics for k in m if k.startswith("pool/")})
        return {k.split("/")[1]: round(statistics.mean(m[k] for m in metrics), 3) for k in pools}

    overlap, sync = step_seconds(1), step_seconds(0)
    staleness = [m.get("staleness/mean", 0.0) for m in runs[1][0]]
    return {
        "step_seconds_split_overlap": round(overlap, 4),
        "step_seconds_rollout_split_sync": round(sync, 4),
        "overlap_over_rollout_split_sync": round(overlap / sync, 3),
        "overlap_over_split_sync": round(overlap / split_sync_seconds, 3),
        "target_overlap_ratio": TARGET_OVERLAP_RATIO,
        "overlap_steps_per_run": len(runs[1][0]),
        "overlap_reward_gain": round(reward_gain(1), 4),
        "sync_reward_gain": round(reward_gain(0), 4),
        "target_reward_gain": TARGET_GAIN,
        "overlap_staleness_mean": round(statistics.mean(staleness[1:]), 3),
        "overlap_rollout_trainer_kl_mean": round(
            statistics.mean(m["off_policy/kl"] for m in runs[1][0][1:]), 5
        ),
        "overlap_idle_fraction": idle(1),
        "sync_idle_fraction": idle(0),
    }


if __name__ == "__main__":
    main()
