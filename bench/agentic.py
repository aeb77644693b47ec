"""Learning with a tool: the lookup task (``examples/plugins/lookup_task.py``) with and without its tool, and the sandbox.

Each prompt asks for the letter of a key; the letter is a hash of the key, so only the ``lookup``
tool knows it. Both runs train the tiny random model with GRPO through the same code path as
``hybridflow run`` (the rollout service, the agent loop, token-exact trajectories), in one
embedded Ray, with the same steps and prompts:

* **with the tool**: ``examples/grpo-tiny-lookup.yaml`` as written (its model, data, output and
  step count replaced): ``agent.loop: lookup_task:LookupLoop`` with the ``lookup`` tool, at most
  two model turns, ChatML's tool turn. Rewards: ``target_char`` (weight 1) and
  ``lookup_task:called_lookup`` (weight 0.1, a format reward for calling).
* **without it**: the same manifest with ``agent.loop: single-turn``, ``target_char`` alone, one
  turn of 16 tokens. The best it can learn is a guess: ``1 / len(LETTERS)`` = 0.25.

Both start from a format cold start (``lookup_task.warm_up``): a few supervised steps on what a
turn looks like (with the tool, "call, then write something"), never on an answer.

Why the cold start and the format reward. A byte-level random model finds no call syntax by
itself, and a model that does not keep calling never learns what a result is for. Measured
here, 100 steps of the tool run each: no cold start, no format reward: calls fell from 3% of
trajectories to none within 30 steps, reward at the guess (plain-torch GRPO on this model); a cold
start alone: the reward reached 0.44 at step 50 as the model began to copy, then the first
turn drifted to guessing and calls fell to none; both (this bench): calls 0.92 a trajectory and
the reward 0.45 at the end.

Reported, per run: ``reward_first10`` / ``reward_last10`` (the mean ``target_char`` reward over
the first / last ten steps; the format reward is not in it), ``reward_gain``,
``tool_calls_per_trajectory`` and ``turns_per_trajectory`` (means over the last ten steps),
``tool_latency_p50_seconds`` / ``tool_latency_p99_seconds`` (over steps: the median of each
step's p50, the largest p99) and ``wall_seconds``. For the sandbox: every attempt of
``hybridflow.agents.escapes``, with and without namespaces (``sandbox_escapes_tried`` /
``sandbox_escapes_contained``, equal when all were contained), and the latency of a small
Python tool call (``python_tool_latency_*``, 20 calls). Target: ``reward_gain >= 0.3`` with the
tool, and every escape contained. ``--quick`` (CI) runs 4 steps each, 2 cold-start steps and
the attempts in one mode, and judges nothing. The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PLUGINS = ROOT / "examples" / "plugins"
EXAMPLE = ROOT / "examples" / "grpo-tiny-lookup.yaml"
# The loop, tool and reward plugins are imported by path in the rollout service's process too.
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PLUGINS), os.environ.get("PYTHONPATH")]))
sys.path.insert(0, str(PLUGINS))
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import lookup_task  # noqa: E402

from hybridflow.agents.escapes import ESCAPE_LIMITS, MODES, try_escapes  # noqa: E402
from hybridflow.agents.sandbox import probe, run_python  # noqa: E402
from hybridflow.controller import init_local_ray  # noqa: E402
from hybridflow.models.tiny import write_tiny_model  # noqa: E402
from hybridflow.spec import RLHFJobSpec, load_job_manifest  # noqa: E402
from hybridflow.trainer.roles import resource_pools  # noqa: E402
from hybridflow.trainer.runner import run_training  # noqa: E402

STEPS, QUICK_STEPS = 150, 4
TARGET_GAIN = 0.3


def spec_for(tools: bool, model: Path, data: Path, workdir: Path, steps: int) -> RLHFJobSpec:
    """The example's job (with the tool), or the same job single-turn without the format reward."""
    spec = load_job_manifest(EXAMPLE).spec
    update: dict[str, Any] = {
        "models": spec.models.model_validate({"actor": {"path": str(model)}}),
        "data": spec.data.model_copy(update={"train_files": (str(data),)}),
        "training": spec.training.model_copy(update={"total_steps": steps}),
        "checkpoint": spec.checkpoint.model_copy(update={"interval_steps": steps}),
        "output_dir": str(workdir / ("with-tool" if tools else "without-tool")),
    }
    if not tools:
        update["agent"] = spec.agent.model_copy(update={"loop": "single-turn", "tools": ()})
        update["rewards"] = tuple(r for r in spec.rewards if r.function == "target_char")
        update["rollout"] = spec.rollout.model_copy(update={"max_response_tokens": lookup_task.TURN_TOKENS})
    return spec.model_copy(update=update)


def train(spec: RLHFJobSpec, tag: str) -> dict[str, Any]:
    init_local_ray(resource_pools(spec, simulated=True))
    started = time.monotonic()
    metrics = run_training(spec, on_step=lambda line: print(f"[{tag}] {line}", file=sys.stderr)).metrics
    wall = time.monotonic() - started
    window = min(10, max(1, len(metrics) // 2))
    rewards = [m["reward/target_char"] for m in metrics]
    last = metrics[-window:]
    figures: dict[str, Any] = {
        "reward_first10": round(statistics.mean(rewards[:window]), 4),
        "reward_last10": round(statistics.mean(rewards[-window:]), 4),
        "tool_calls_per_trajectory": round(
            statistics.mean(m.get("agent/tool_calls_per_trajectory", 0.0) for m in last), 3
        ),
        "turns_per_trajectory": round(statistics.mean(m.get("agent/turns_mean", 1.0) for m in last), 3),
        "wall_seconds": round(wall, 1),
    }
    figures["reward_gain"] = round(figures["reward_last10"] - figures["reward_first10"], 4)
    p50s = [m["agent/tool_latency_p50_seconds"] for m in metrics if "agent/tool_latency_p50_seconds" in m]
    p99s = [m["agent/tool_latency_p99_seconds"] for m in metrics if "agent/tool_latency_p99_seconds" in m]
    if p50s:
        figures["tool_latency_p50_seconds"] = round(statistics.median(p50s), 6)
        figures["tool_latency_p99_seconds"] = round(max(p99s), 6)
    return figures


def sandbox_figures(quick: bool) -> dict[str, Any]:
    """The escape catalogue in every mode this machine gives (strict alone in the quick run), and
    a small call's latency in strict isolation."""
    applied, refused = probe("strict")
    modes = [mode for mode in MODES if probe(MODES[mode][0])[1] == ""]
    if quick:
        modes = modes[:1]
    reports = [report for mode in modes for report in try_escapes(ESCAPE_LIMITS, mode)]
    latencies = sorted(
        run_python("print(sum(range(1000)))", ESCAPE_LIMITS).seconds for _ in range(5 if quick else 20)
    )
    return {
        "isolation": None if applied is None else vars(applied),
        "isolation_refused": refused,
        "sandbox_modes": modes,
        "sandbox_escapes_tried": len(reports),
        "sandbox_escapes_contained": sum(report.contained for report in reports),
        "sandbox_escapes_not_contained": [f"{r.name}: {r.reason}" for r in reports if not r.contained],
        "python_tool_latency_p50_seconds": round(statistics.median(latencies), 4),
        "python_tool_latency_p99_seconds": round(
            latencies[min(len(latencies) - 1, round(0.99 * (len(latencies) - 1)))], 4
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        default=os.environ.get("HYBRIDFLOW_BENCH_QUICK") == "1",
        help=f"{QUICK_STEPS} steps each, no verdict (CI)",
    )
    parser.add_argument("--only", choices=("with-tool", "without-tool"), help="one of the two runs")
    parser.add_argument("--steps", type=int, default=None, help=f"steps per run (default {STEPS})")
    args = parser.parse_args()
    steps = args.steps or (QUICK_STEPS if args.quick else STEPS)
    workdir = Path(tempfile.mkdtemp(prefix="hybridflow-agentic-"))
    rows = lookup_task.make_rows(512, seed=0)
    data = workdir / "lookup.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    random_model = write_tiny_model(workdir / "tiny-model")
    cold_steps = 2 if args.quick else lookup_task.WARM_UP_STEPS
    with_tool_model = lookup_task.warm_up(
        random_model, workdir / "cold-start-tool", rows, cold_steps, tool=True
    )
    without_tool_model = lookup_task.warm_up(
        random_model, workdir / "cold-start-no-tool", rows, cold_steps, tool=False
    )
    figures: dict[str, Any] = {
        "task": "lookup",
        "letters": len(lookup_task.LETTERS),
        "guess_reward": round(1 / len(lookup_task.LETTERS), 4),
        "steps": steps,
        "quick": args.quick,
        "target_gain": TARGET_GAIN,
    }
    if args.only != "without-tool":
        figures["with_tool"] = train(spec_for(True, with_tool_model, data, workdir, steps), "with tool")
    if args.only != "with-tool":
        figures["without_tool"] = train(
            spec_for(False, without_tool_model, data, workdir, steps), "without tool"
        )
    figures.update(sandbox_figures(args.quick))
    if not args.quick and not args.only:
        figures["meets_target"] = (
            figures["with_tool"]["reward_gain"] >= TARGET_GAIN
            and figures["sandbox_escapes_contained"] == figures["sandbox_escapes_tried"]
        )
    shutil.rmtree(workdir, ignore_errors=True)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
