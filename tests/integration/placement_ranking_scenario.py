"""Test-only scenario: the planner's predicted step times against measured ones, run as its own process.

``python placement_ranking_scenario.py WORK_DIR`` pins itself (and so its Ray and every worker)
to two cores of this machine (one if it has one), writes the tiny model and prompts under
WORK_DIR, measures the device constants (``calibrate_device``, what ``hybridflow plan
--profile`` does), and plans the tiny GRPO job (examples/grpo-tiny.yaml, 32 response tokens,
micro-batches of 4 so that 8 ranks get whole ones) colocated on as many simulated GPUs as it has cores, twice as many and four times as many.
Each plan then trains for ``STEPS`` steps in one embedded Ray, all forwards and then backwards;
a plan's measured seconds are the mean over its two runs of the median ``perf/step_seconds``
after the first step. Writes ``WORK_DIR/result.json``: per plan its GPUs, the predicted and the
measured step seconds.

Why these plans: more simulated GPUs than cores is where this machine's step time changes for
a reason the cost model must capture (workers share cores, and every collective waits for
ranks that are not running), by a factor well beyond the run-to-run noise of a shared
machine; plans with at most one worker per core measure within that noise of each other
(docs/placement.md).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from dataclasses import asdict
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
STEPS = 4
MEASURED_PHASES = {
    "generate": ("weight_sync", "generate"),
    "score": ("old_log_probs", "ref_log_probs", "reward"),
    "train": ("actor_update", "advantages"),
}
"""The runner's ``timing/*`` figures that make up each phase of the cost model's step."""


def main(work: Path) -> None:
    cores = tuple(sorted(os.sched_getaffinity(0)))[:2]
    os.sched_setaffinity(0, cores)  # before Ray starts: its processes inherit the mask
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")

    import ray

    from hybridflow.controller.resource_pool import node_pool_resource
    from hybridflow.models.tiny import write_tiny_model
    from hybridflow.planner import ClusterShape, plan_job
    from hybridflow.planner.calibrate import calibrate_device
    from hybridflow.planner.hardware import SIMULATED_CPU_GPU
    from hybridflow.planner.job import apply_plan, workload_from_spec
    from hybridflow.rewards import make_toy_dataset
    from hybridflow.spec import RLHFJobSpec, parse_job_manifest
    from hybridflow.trainer.runner import run_training

    model = write_tiny_model(work / "model")
    data = work / "target_char.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in make_toy_dataset("target_char", 256, seed=0)))

    def budget(gpus: int) -> RLHFJobSpec:
        doc = yaml.safe_load((ROOT / "examples" / "grpo-tiny.yaml").read_text())
        spec = doc["spec"]
        spec["models"] = {"actor": {"path": str(model)}}
        spec["data"]["trainFiles"] = [str(data)]
        # Micro-batches of 4: a mini-batch of 32 then splits over up to 8 data-parallel ranks.
        spec["training"].update({"totalSteps": STEPS, "microBatchSizePerGpu": 4})
        spec["checkpoint"]["intervalSteps"] = 100
        spec["placement"] = "auto"
        spec["resourcePools"] = [{"name": "budget", "nodes": 1, "gpusPerNode": gpus}]
        spec["roles"] = {"actor": "budget"}
        spec["outputDir"] = str(work / f"out-{gpus}")
        return parse_job_manifest(doc, source="scenario").spec

    device = calibrate_device(workload_from_spec(budget(1)), SIMULATED_CPU_GPU)
    plans = []
    for gpus in (len(cores), 2 * len(cores), 4 * len(cores)):
        spec = budget(gpus)
        plan = plan_job(workload_from_spec(spec), ClusterShape(gpus, gpus), device, kinds=("colocate",))[0]
        plans.append((gpus, plan, apply_plan(spec, plan)))
    ray.init(
        num_cpus=len(cores),
        num_gpus=max(gpus for gpus, _, _ in plans),
        resources={node_pool_resource("budget"): float(max(gpus for gpus, _, _ in plans))},
        include_dashboard=False,
        configure_logging=False,
        log_to_driver=False,
    )
    seconds: dict[int, list[float]] = {gpus: [] for gpus, _, _ in plans}
    phases: dict[int, list[dict[str, float]]] = {gpus: [] for gpus, _, _ in plans}
    try:
        for round_index, (gpus, _, spec) in enumerate([*plans, *reversed(plans)]):
            out = work / f"round-{round_index}-{gpus}"
            summary = run_training(
                spec.model_copy(update={"output_dir": str(out)}), on_step=lambda line: None
            )
            seconds[gpus].append(statistics.median(m["perf/step_seconds"] for m in summary.metrics[1:]))
            phases[gpus].append(
                {
                    phase: statistics.median(
                        sum(m.get(f"timing/{k}", 0.0) for k in keys) for m in summary.metrics[1:]
                    )
                    for phase, keys in MEASURED_PHASES.items()
                }
            )
    finally:
        ray.shutdown()
    result = {
        "cores": len(cores),
        "device": asdict(device),
        "plans": [
            {
                "gpus": gpus,
                "placement": plan.placement.describe(),
                "predicted_step_seconds": plan.step_seconds,
                "measured_step_seconds": statistics.mean(seconds[gpus]),
                "predicted_phase_seconds": plan.phase_seconds,
                "measured_phase_seconds": {
                    phase: statistics.mean(run[phase] for run in phases[gpus]) for phase in MEASURED_PHASES
                },
            }
            for gpus, plan, _ in plans
        ],
    }
    (work / "result.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
