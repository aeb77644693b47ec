"""Asynchronous server-mode rollout against one batch call per step, on a long-tail task.

The task: target_char's prompts, scored by ``first_char`` (1 when the response starts with the
target letter: a reward that does not move the length distribution), answered by a tiny model
whose response lengths have a long tail. The model is the tiny random model fine-tuned here for a few seconds (supervised, on
random letters) to end most responses within a few tokens and some only after dozens: each
training response is 1-4 letters with probability 0.85 and 24-64 letters otherwise. What the
fine-tuned policy then generates is measured before any RL (``response_length_p50`` / ``_p99``
over 512 samples; the issue asks p99/p50 >= 8).

Runs of the same GRPO job, same placement (the actor on pool "train", 1 simulated GPU; the
rollout on pool "generate", 2), same steps, prompts, samples and learning rate:

* ``sync``: ``rollout.mode: batch``, ``maxStaleness: 0``: every step one generation call split
  over the rollout's two ranks, which decode in lockstep until their longest response ends,
  then the actor trains while the rollout waits.
* ``async``: ``rollout.mode: server``, ``maxStaleness: 2``: two replicas batch requests
  continuously (a finished response's slot takes the next request), generation runs up to two
  updates ahead of the trainer, a weight update pauses the replicas and lets responses in
  progress continue with the new weights.

Throughput (``throughput``, ``async_over_sync_tokens_per_second``) is measured with the policy
held still (learning rate 1e-9): learning moves the length distribution, and differently in
each mode (both drift towards longer responses on this task, the asynchronous run faster), so
only a still policy compares the two systems on the same workload. Robust to a noisy machine:
``ROUNDS`` rounds, the two runs alternated (the order flips every round), medians. Tokens per
second: prompt + response tokens trained over the steps' seconds, every step counted.

Learning (``learning``): one run of each at the demo's learning rate over ``LEARNING_STEPS``
steps: the reward of the first and last 10 steps, tokens per second as they drifted, and for
``async`` the staleness histogram (samples per staleness, all steps) and the version span.
Per run, the rollout's idle fraction (``sync``: the generate pool's workers outside worker
calls; ``async``: the replicas' decode loops without work) and the mean seconds of each step
phase after the first two steps (``seconds_per_phase``: in ``async`` generation is the wait
that remains, and the update runs beside the replicas on the same cores).
``replica_replace_seconds``: a third, short async run in which one replica is killed (SIGKILL)
after step 2, from detection to its successor serving; ``replica_load_seconds``, of those, until
its successor's model had loaded (the rest: the wait for the step boundary and the push).

The throughput ratio is taken per round (each round's async run over the sync run beside it, so
the machine's drift between rounds cancels): ``async_over_sync_tokens_per_second`` is their
median, ``async_over_sync_spread`` the rounds' ratios with their median, min and max.

``--quick`` (CI, ``make bench-smoke``): a smoke run. One round of 4 steps after a 40-step
fine-tune, no learning runs (the still runs stand in) and no kill run: it proves that the bench
runs end to end, nothing more. Its JSON says so (``"quick": true`` and ``smoke_run``, a note), its
headline figures carry a ``smoke_`` prefix (``smoke_async_over_sync_tokens_per_second``) so that
no one quotes them as results, and it has no ``targets``. The last line printed is one JSON
object, in both modes.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, cast

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import psutil
import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

from hybridflow.controller import init_local_ray
from hybridflow.data import PromptDataset
from hybridflow.engines import SamplingParams
from hybridflow.engines.torch_engine import TorchRolloutEngine
from hybridflow.models.tiny import write_tiny_model
from hybridflow.rewards import make_toy_dataset
from hybridflow.spec import RLHFJobSpec, load_job_manifest
from hybridflow.trainer.roles import resource_pools
from hybridflow.trainer.runner import run_training

PROMPTS, SAMPLES, MAX_RESPONSE = 8, 8, 64
LEARNING_RATE = 2e-3
STILL_LEARNING_RATE = 1e-9
"""The throughput runs' learning rate: too small to move the policy, so its lengths stay long-tailed."""
STEPS, QUICK_STEPS = 30, 4
LEARNING_STEPS = 40
ROUNDS, QUICK_ROUNDS = 5, 1
SFT_STEPS, QUICK_SFT_STEPS = 300, 40
SHORT_PROBABILITY, SHORT_LENGTHS, LONG_LENGTHS = 0.85, (1, 4), (24, MAX_RESPONSE)
LETTERS = "abcdefgh"
TARGET_SPEEDUP, TARGET_REWARD_GAIN, TARGET_TAIL, TARGET_REPLACE_SECONDS = 1.5, 0.3, 8.0, 60.0
TARGETS = {
    "async_over_sync_tokens_per_second": TARGET_SPEEDUP,
    "reward_gain_async": TARGET_REWARD_GAIN,
    "response_length_p99_over_p50": TARGET_TAIL,
    "replica_replace_seconds": TARGET_REPLACE_SECONDS,
}
HEADLINE_KEYS = (
    "async_over_sync_tokens_per_second",
    "async_over_sync_spread",
    "async_over_sync_tokens_per_second_learning",
    "response_length_p99_over_p50",
    "rollout_idle_fraction_sync",
    "rollout_idle_fraction_async",
    "reward_gain_async",
    "reward_gain_sync",
    "staleness_histogram",
    "replica_replace_seconds",
    "replica_load_seconds",
)
"""The figures the docs quote and the targets judge: a smoke run prints them as ``smoke_<key>``."""
SMOKE_NOTE = (
    "smoke run (--quick, make bench-smoke): one round of 4 steps after a short fine-tune, no "
    "learning or kill runs; it proves only that the bench runs, and its smoke_ figures are not "
    "results. The full run (python bench/async_rollout.py) reports the median and spread of the "
    "per-round async/sync ratio over 5 rounds of 30 steps."
)


# --------------------------------------------------------------------------- the long-tail policy


def long_tail_model(workdir: Path, data: Path, sft_steps: int) -> Path:
    """The tiny random model, fine-tuned to answer prompts with long-tailed random-letter responses."""
    model_dir = write_tiny_model(workdir / "base-model")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    spec = load_job_manifest(write_manifest(workdir, model_dir, data, "probe", mode="batch", steps=1)).spec
    prompts = first_prompts(model_dir, spec, 64)
    letter_ids: list[int] = [int(cast(int, tokenizer.convert_tokens_to_ids(letter))) for letter in LETTERS]
    eos = int(tokenizer.eos_token_id)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    rng = random.Random(0)
    model.train()
    for _ in range(sft_steps):
        rows: list[list[int]] = []
        masks: list[list[int]] = []
        for _ in range(32):
            prompt = rng.choice(prompts)
            low, high = SHORT_LENGTHS if rng.random() < SHORT_PROBABILITY else LONG_LENGTHS
            response: list[int] = [rng.choice(letter_ids) for _ in range(rng.randint(low, high))] + [eos]
            rows.append(list(prompt) + response)
            masks.append([0] * len(prompt) + [1] * len(response))
        width = max(map(len, rows))
        ids = torch.full((len(rows), width), eos)
        labels = torch.full((len(rows), width), -100)
        attention = torch.zeros((len(rows), width), dtype=torch.long)
        for i, (row, mask) in enumerate(zip(rows, masks, strict=True)):
            ids[i, : len(row)] = torch.tensor(row)
            attention[i, : len(row)] = 1
            labels[i, : len(row)] = torch.tensor([t if m else -100 for t, m in zip(row, mask, strict=True)])
        loss = model(input_ids=ids, attention_mask=attention, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    out = workdir / "long-tail-model"
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def first_prompts(model_dir: Path, spec: RLHFJobSpec, count: int) -> list[list[int]]:
    """The job's first ``count`` prompts, tokenized as the trainer tokenizes them."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return PromptDataset.from_spec(spec.data, tokenizer).take(range(count)).prompt_token_ids


def response_lengths(model_dir: Path, prompts: list[list[int]]) -> list[int]:
    engine = TorchRolloutEngine(model_dir)
    params = SamplingParams(max_new_tokens=MAX_RESPONSE, temperature=1.0, n=SAMPLES, seed=1)
    return [len(tokens) for tokens in engine.generate(prompts, params).response_token_ids]


def percentile(values: list[int], q: float) -> float:
    ordered = sorted(values)
    return float(ordered[min(len(ordered) - 1, int(q * len(ordered)))])


# --------------------------------------------------------------------------- what the JSON says


def ratio_spread(async_rounds: list[float], sync_rounds: list[float]) -> dict[str, Any]:
    """Each round's async tokens/s over the sync run's of the same round, and their median, min and max.

    Runs are paired by round (the two runs of a round ran one after the other, on the machine as
    it was then), so the ratio of a pair is what the machine's drift between rounds leaves alone.

    >>> ratio_spread([16134, 15879, 16897], [13632, 13307, 13831])
    {'rounds': [1.184, 1.193, 1.222], 'median': 1.193, 'min': 1.184, 'max': 1.222}
    """
    if not async_rounds or len(async_rounds) != len(sync_rounds):
        raise ValueError(
            f"ratio_spread needs one sync run per async run and at least one round; got "
            f"{len(async_rounds)} async and {len(sync_rounds)} sync"
        )
    ratios = [round(a / s, 3) for a, s in zip(async_rounds, sync_rounds, strict=True)]
    return {
        "rounds": ratios,
        "median": round(statistics.median(ratios), 3),
        "min": min(ratios),
        "max": max(ratios),
    }


def as_smoke_run(figures: dict[str, Any]) -> dict[str, Any]:
    """A quick run's figures as the JSON prints them: headline keys renamed ``smoke_<key>``, no
    ``targets``, and the note that says what a smoke run proves (see the module docstring)."""
    marked: dict[str, Any] = {"quick": True, "smoke_run": SMOKE_NOTE}
    for key, value in figures.items():
        if key in ("quick", "targets"):
            continue
        marked[f"smoke_{key}" if key in HEADLINE_KEYS else key] = value
    return marked


# --------------------------------------------------------------------------- the two jobs


def write_manifest(
    workdir: Path,
    model: Path,
    data: Path,
    name: str,
    *,
    mode: str,
    steps: int,
    learning_rate: float = LEARNING_RATE,
) -> Path:
    server = mode == "server"
    rollout: dict[str, Any] = {
        "engine": "torch",
        "mode": mode,
        "maxResponseTokens": MAX_RESPONSE,
        "temperature": 1.0,
        "maxStaleness": 2 if server else 0,
    }
    if server:
        rollout.update(
            {"onWeightUpdate": "keep", "slotsPerReplica": PROMPTS * SAMPLES, "replicaTimeoutSeconds": 60}
        )
    doc = {
        "apiVersion": "hybridflow.io/v1alpha1",
        "kind": "RLHFJob",
        "metadata": {"name": name},
        "spec": {
            "models": {"actor": {"path": str(model)}},
            "data": {"trainFiles": [str(data)], "promptKey": "prompt", "maxPromptTokens": 64, "seed": 0},
            "algorithm": {
                "name": "grpo",
                "samplesPerPrompt": SAMPLES,
                "kl": {"coef": 0.0},
                # Every response weighs the same whatever its length: no push towards long ones.
                "lossAggregation": "seq-mean-token-mean",
            },
            "rollout": rollout,
            "training": {
                "totalSteps": steps,
                "promptsPerStep": PROMPTS,
                "miniBatchSize": PROMPTS * SAMPLES,
                "microBatchSizePerGpu": 16,
                "learningRate": learning_rate,
                "lrSchedule": "constant",
                "precision": "fp32",
            },
            "rewards": [{"function": "first_char"}],
            "resourcePools": [
                {"name": "train", "nodes": 1, "gpusPerNode": 1},
                {"name": "generate", "nodes": 1, "gpusPerNode": 2},
            ],
            "roles": {"actor": "train", "rollout": "generate"},
            "checkpoint": {"intervalSteps": 10_000, "keepLast": 1},
            "outputDir": str(workdir / name),
        },
    }
    path = workdir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc))  # JSON would write 1e-09, which YAML reads as a string
    return path


def run(spec: RLHFJobSpec, should_stop: Any = None) -> list[dict[str, float]]:
    summary = run_training(
        spec,
        on_step=lambda line: print(f"[{Path(spec.output_dir).name}] {line}", file=sys.stderr),
        should_stop=should_stop,
    )
    return summary.metrics


def figures_of(metrics: list[dict[str, float]], mode: str) -> dict[str, Any]:
    seconds = sum(m["perf/step_seconds"] for m in metrics)
    rewards = [m["reward/mean"] for m in metrics]
    window = min(10, max(1, len(rewards) // 2))
    idle_key = "rollout/idle_fraction" if mode == "server" else "pool/generate/idle_fraction"
    idle = [m[idle_key] for m in metrics if idle_key in m]
    figures: dict[str, Any] = {
        "tokens_per_second": round(sum(m["tokens/step"] for m in metrics) / seconds, 1),
        "seconds_per_step": round(seconds / len(metrics), 4),
        "rollout_idle_fraction": round(statistics.mean(idle), 4) if idle else None,
        "reward_first10": round(statistics.mean(rewards[:window]), 4),
        "reward_last10": round(statistics.mean(rewards[-window:]), 4),
        "response_length_mean": round(statistics.mean(m["response/length_mean"] for m in metrics), 2),
    }
    figures["reward_gain"] = round(figures["reward_last10"] - figures["reward_first10"], 4)
    # Where a step's seconds went (the steps after the first two: the replicas' start is over).
    steady = metrics[2:] or metrics
    phases = sorted({k for m in steady for k in m if k.startswith("timing/") and k != "timing/checkpoint"})
    figures["seconds_per_phase"] = {
        phase.removeprefix("timing/"): round(statistics.mean(m.get(phase, 0.0) for m in steady), 4)
        for phase in phases
    }
    if mode == "server":
        counts: dict[str, float] = {}
        for m in metrics:
            for key, value in m.items():
                if key.startswith("staleness/samples/"):
                    counts[key.removeprefix("staleness/samples/")] = (
                        counts.get(key.removeprefix("staleness/samples/"), 0) + value
                    )
        figures["staleness_histogram"] = {k: int(v) for k, v in sorted(counts.items())}
        figures["version_span_mean"] = round(
            statistics.mean(m.get("rollout/version_span_mean", 0.0) for m in metrics), 4
        )
    return figures


def medians_over_rounds(results: list[dict[str, Any]]) -> dict[str, Any]:
    """One mode's still runs (``figures_of`` each, one per round): medians, and tokens/s per round."""
    return {
        "tokens_per_second": statistics.median(r["tokens_per_second"] for r in results),
        "rounds_tokens_per_second": [r["tokens_per_second"] for r in results],
        "seconds_per_step": statistics.median(r["seconds_per_step"] for r in results),
        "rollout_idle_fraction": statistics.median(r["rollout_idle_fraction"] for r in results),
        "response_length_mean": statistics.median(r["response_length_mean"] for r in results),
        "seconds_per_phase": {
            phase: statistics.median(r["seconds_per_phase"].get(phase, 0.0) for r in results)
            for phase in results[0]["seconds_per_phase"]
        },
    }


def comparison(
    per_round: dict[str, list[dict[str, Any]]], learning: dict[str, dict[str, Any]]
) -> dict[str, Any]:
    """The two modes side by side: still runs by round (``figures_of`` each), learning runs one each."""
    throughput = {name: medians_over_rounds(results) for name, results in per_round.items()}
    spread = ratio_spread(
        throughput["async"]["rounds_tokens_per_second"], throughput["sync"]["rounds_tokens_per_second"]
    )
    return {
        "throughput": throughput,
        "learning": learning,
        "async_over_sync_tokens_per_second": spread["median"],
        "async_over_sync_spread": spread,
        "async_over_sync_tokens_per_second_learning": round(
            learning["async"]["tokens_per_second"] / learning["sync"]["tokens_per_second"], 3
        ),
        "rollout_idle_fraction_sync": throughput["sync"]["rollout_idle_fraction"],
        "rollout_idle_fraction_async": throughput["async"]["rollout_idle_fraction"],
        "reward_gain_async": learning["async"]["reward_gain"],
        "reward_gain_sync": learning["sync"]["reward_gain"],
        "staleness_histogram": learning["async"]["staleness_histogram"],
    }


def replica_processes() -> list[psutil.Process]:
    found = []
    for process in psutil.process_iter(["cmdline"]):
        if "ray::RolloutReplica" in " ".join(process.info.get("cmdline") or []):
            found.append(process)
    return found


def replace_seconds(workdir: Path, model: Path, data: Path) -> dict[str, float | None]:
    """A short async run in which one replica is killed after step 2: detection to its successor
    serving (``replica_replace_seconds``) and to its model loaded (``replica_load_seconds``)."""
    path = write_manifest(workdir, model, data, "async-kill", mode="server", steps=400)
    metrics_file = workdir / "async-kill" / "metrics.jsonl"

    def kill_after_step_two() -> None:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            lines = metrics_file.read_text().splitlines() if metrics_file.exists() else []
            replicas = replica_processes()
            if len(lines) >= 2 and replicas:
                replicas[0].kill()
                return
            time.sleep(0.05)

    def replaced() -> bool:
        return metrics_file.exists() and "replica_replace_seconds" in metrics_file.read_text()

    threading.Thread(target=kill_after_step_two, daemon=True).start()
    metrics = run(load_job_manifest(path).spec, should_stop=replaced)
    rejoined = [m for m in metrics if "rollout/replica_replace_seconds" in m]
    return {
        name: round(rejoined[0][f"rollout/{name}"], 2) if rejoined else None
        for name in ("replica_replace_seconds", "replica_load_seconds")
    }


def long_tail_task(workdir: Path, sft_steps: int) -> tuple[Path, Path]:
    """The task's prompts (a JSONL file) and the long-tail policy fine-tuned for it."""
    data = workdir / "target_char.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in make_toy_dataset("target_char", 256, seed=0)))
    started = time.monotonic()
    model = long_tail_model(workdir, data, sft_steps)
    print(f"fine-tuned the long-tail policy in {time.monotonic() - started:.0f} s", file=sys.stderr)
    return data, model


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        default=os.environ.get("HYBRIDFLOW_BENCH_QUICK") == "1",
        help="a smoke run (CI): one round of 4 steps, a short fine-tune, no kill run; figures prefixed smoke_",
    )
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    steps, rounds, sft_steps = (
        (QUICK_STEPS, QUICK_ROUNDS, QUICK_SFT_STEPS) if args.quick else (STEPS, ROUNDS, SFT_STEPS)
    )
    learning_steps = QUICK_STEPS if args.quick else LEARNING_STEPS
    workdir = Path(tempfile.mkdtemp(prefix="hybridflow-async-rollout-"))
    data, model = long_tail_task(workdir, sft_steps)
    probe = load_job_manifest(write_manifest(workdir, model, data, "probe", mode="batch", steps=1)).spec
    lengths = response_lengths(model, first_prompts(model, probe, 64))
    p50, p99 = percentile(lengths, 0.5), percentile(lengths, 0.99)
    modes = {"sync": "batch", "async": "server"}
    init_local_ray(resource_pools(probe, simulated=True))

    def measured(name: str, label: str, learning_rate: float, run_steps: int) -> dict[str, Any]:
        # A fresh output directory per run: a second run in the same one would resume.
        path = write_manifest(
            workdir, model, data, label, mode=modes[name], steps=run_steps, learning_rate=learning_rate
        )
        figures = figures_of(run(load_job_manifest(path).spec), modes[name])
        print(f"{label}: {figures['tokens_per_second']} tokens/s", file=sys.stderr)
        return figures

    # Throughput with the policy held still (a learning rate too small to move it), so that both
    # runs generate from the same long-tail length distribution from first step to last.
    per_round: dict[str, list[dict[str, Any]]] = {"sync": [], "async": []}
    for round_index in range(rounds):
        for name in ["sync", "async"] if round_index % 2 == 0 else ["async", "sync"]:
            per_round[name].append(
                measured(name, f"{name}-still-{round_index + 1}", STILL_LEARNING_RATE, steps)
            )
    # Learning: the same jobs at the learning rate the demo uses, over the same budget (in quick
    # mode the still runs stand in: it proves only that the bench runs).
    learning = (
        {name: per_round[name][0] for name in modes}
        if args.quick
        else {name: measured(name, f"{name}-learning", LEARNING_RATE, learning_steps) for name in modes}
    )
    figures: dict[str, Any] = {
        "shape": {"prompts": PROMPTS, "samples_per_prompt": SAMPLES, "max_response_tokens": MAX_RESPONSE},
        "steps_per_run": steps,
        "learning_steps": learning_steps,
        "rounds": rounds,
        "quick": args.quick,
        "replicas": 2,
        "response_length_p50": p50,
        "response_length_p99": p99,
        "response_length_p99_over_p50": round(p99 / max(p50, 1.0), 2),
        **comparison(per_round, learning),
        **(
            dict.fromkeys(("replica_replace_seconds", "replica_load_seconds"))
            if args.quick
            else replace_seconds(workdir, model, data)
        ),
        "targets": TARGETS,
    }
    print(json.dumps(as_smoke_run(figures) if args.quick else figures))


if __name__ == "__main__":
    main()
