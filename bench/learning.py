"""Learning figures: PPO and GRPO on the tiny target_char task, a fixed step budget, on CPU.

Both algorithms run the repository's example manifests (examples/ppo-tiny.yaml,
examples/grpo-tiny.yaml) through the same code path as ``hybridflow run``, in one process with one
embedded Ray, each into a fresh output directory. Rewards are in [0, 1].

Per algorithm: ``reward_first10`` / ``reward_last10`` (mean step reward over the first / last ten
steps), ``tokens_per_second`` (mean over steps of (prompt + response tokens) / step wall time)
and ``wall_seconds`` (deploy included). Target: ``reward_last10 - reward_first10 >= 0.3`` for both.
The last line printed is one JSON object.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from hybridflow.controller import init_local_ray
from hybridflow.models.tiny import write_tiny_model
from hybridflow.rewards import make_toy_dataset
from hybridflow.spec import RLHFJobSpec, load_job_manifest
from hybridflow.trainer.roles import resource_pools
from hybridflow.trainer.runner import run_training

ROOT = Path(__file__).resolve().parents[1]
QUICK = os.environ.get("HYBRIDFLOW_BENCH_QUICK") == "1"
"""Quick mode (``make bench-smoke``): a few steps, to prove the bench runs and prints its JSON line."""
STEPS = 3 if QUICK else 40
TARGET_GAIN = 0.3


def spec_for(example: str, workdir: Path, model: Path, data: Path) -> RLHFJobSpec:
    spec = load_job_manifest(ROOT / "examples" / example).spec
    models = {
        role: {"path": str(model)}
        for role in ("actor", "critic")
        if role == "actor" or getattr(spec.models, role) is not None
    }
    return spec.model_copy(
        update={
            "models": spec.models.model_validate(models),
            "data": spec.data.model_copy(update={"train_files": (str(data),)}),
            "training": spec.training.model_copy(update={"total_steps": STEPS}),
            "output_dir": str(workdir / example.removesuffix(".yaml")),
        }
    )


def main() -> None:
    workdir = Path(tempfile.mkdtemp(prefix="hybridflow-learning-"))
    model = write_tiny_model(workdir / "tiny-model")
    data = workdir / "target_char.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in make_toy_dataset("target_char", 256, seed=0)))
    figures: dict[str, object] = {"steps": STEPS, "task": "target_char", "target_gain": TARGET_GAIN}
    for algorithm, example in (("ppo", "ppo-tiny.yaml"), ("grpo", "grpo-tiny.yaml")):
        spec = spec_for(example, workdir, model, data)
        init_local_ray(resource_pools(spec, simulated=True))
        started = time.monotonic()
        summary = run_training(
            spec, on_step=lambda line, tag=algorithm: print(f"[{tag}] {line}", file=sys.stderr)
        )
        wall = time.monotonic() - started
        rewards = [m["reward/mean"] for m in summary.metrics]
        first10, last10 = statistics.mean(rewards[:10]), statistics.mean(rewards[-10:])
        figures[algorithm] = {
            "reward_first10": round(first10, 4),
            "reward_last10": round(last10, 4),
            "reward_gain": round(last10 - first10, 4),
            "meets_target": last10 - first10 >= TARGET_GAIN,
            "tokens_per_second": round(
                statistics.mean(m["perf/tokens_per_second"] for m in summary.metrics), 1
            ),
            "wall_seconds": round(wall, 1),
        }
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
