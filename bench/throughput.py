"""Throughput of the tiny GRPO job: two single-process loops against hybridflow's placements, eager and compiled.

Same model (the tiny random model), data (target_char prompts), shapes (16 prompts x 4 samples,
16 response tokens), sampling (temperature 1, no top-k/top-p) and algorithm (GRPO advantages,
no KL, one clipped AdamW step per RL step) everywhere, all in this process's run:

* ``plain_loop``: one process, no Ray, written the obvious way: HF ``generate`` with
  ``num_return_sequences`` (it prefills every prompt once per sample), a forward pass whose
  logits cover every column, torch's default AdamW (a Python loop over the parameters on CPU),
  torch using every core.
* ``strong_loop``: the same loop written the way the public libraries allow a competent
  engineer to: each prompt prefilled once into a dynamic cache that is then repeated for its
  samples (``DynamicCache.batch_repeat_interleave``) before ``generate`` decodes from it;
  ``logits_to_keep`` so the update computes logits only for the columns that predict a
  response token; fused AdamW (one kernel over every parameter); and the torch thread count
  that ran fastest on this machine, chosen by timing a few steps at each count before the
  measured run (``strong_threads`` in the output). Its greedy outputs equal the plain loop's.
* ``hybridflow_<placement>``: ``run_training`` of the same job on the embedded Ray:
  ``1gpu`` (every role on one simulated GPU with both cores), ``2gpu`` (every role on two
  simulated GPUs, one core each), ``2gpu_overlap`` (HybridFlow's split placement: actor on one,
  rollout on the other, generating the next step while the actor updates; ``maxStaleness: 1``),
  each eager and, as ``..._compiled``, with ``rollout.compile`` and ``training.compile`` on.

Robust to a noisy machine: every run is repeated ``ROUNDS`` times, the runs of one round one
after the other and each round in the opposite order to the last (so a load that drifts over
the minutes of the bench weighs on every run alike), and each figure is the median over the
rounds. Tokens per second count every step, the first included: a compiled run's compile time
(cold: each run compiles into an empty cache of its own) and every run's first-call warm-up are
inside its figures, as a user's run pays them. Tokens per step are prompt + response tokens
(attention mask), as the paper counts them. hybridflow's step seconds cover the step and the
metrics writes after it, not the final checkpoint (the loops save nothing).

Per run: ``tokens_per_second``, ``seconds_per_step``, ``seconds_per_phase`` (the loops:
generate, reward, update; hybridflow: its ``timing/*`` phases, ``compile`` among them),
``warm_tokens_per_second`` (the steps after the last one that compiled, and after the second:
what the run does once its one-off costs are paid, which is where the compiled runs stand on a
warm compile cache), and for hybridflow ``controller_overhead_fraction`` (what the single
controller adds to the step: ``hybridflow.trainer.step_accounting``) and ``compile_seconds``. ``ratio_vs_plain_loop`` and ``ratio_vs_strong_loop`` are
the best hybridflow run's tokens/s over each loop's (targets 1.2 and 1.5); ``phase_ratios_vs_strong_loop``
is, per hybridflow run, the strong loop's seconds per step of generation and of the update over
that run's (the targets ask >= 2 and >= 1.5 of the best run; in the overlapped placement generation
is off the critical path, and its figure is the wait that remains).

``--quick`` (CI): one round of 3 steps per run, the compiled runs and the thread-count trial left
out. The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hybridflow.controller import init_local_ray
from hybridflow.host import available_cores
from hybridflow.models.tiny import write_tiny_model
from hybridflow.rewards import make_toy_dataset, resolve_reward_function
from hybridflow.rlmath import core
from hybridflow.spec import RLHFJobSpec, load_job_manifest
from hybridflow.trainer.roles import resource_pools
from hybridflow.trainer.runner import run_training

ROOT = Path(__file__).resolve().parents[1]
PROMPTS, SAMPLES, RESPONSE_TOKENS = 16, 4, 16
LEARNING_RATE = 2e-3
STEPS, QUICK_STEPS = 200, 3
ROUNDS, QUICK_ROUNDS = 3, 1
WARM_AFTER_STEPS = 2
"""``warm_tokens_per_second`` leaves out the first steps (first-call allocations, a compile)."""
THREAD_TRIAL_STEPS = 4
"""Steps the strong loop times at each thread count to choose one (after one untimed step)."""
TARGET_VS_PLAIN, TARGET_VS_STRONG = 1.2, 1.5
TARGET_GENERATE, TARGET_UPDATE = 2.0, 1.5

LOOPS = ("plain_loop", "strong_loop")
PLACEMENTS = ("1gpu", "2gpu", "2gpu_overlap")


class Loop:
    """One single-process GRPO loop over the tiny model (the module docstring's plain and strong loops)."""

    def __init__(self, model_dir: Path, rows: list[dict[str, Any]], *, strong: bool) -> None:
        torch.manual_seed(0)
        self.strong = strong
        self.rows = rows
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.tokenizer.padding_side = "left"
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=LEARNING_RATE, **({"fused": True} if strong else {})
        )
        self.reward = resolve_reward_function("target_char")
        self.step_index = 0

    def generate(self, encoded: Any) -> torch.Tensor:
        """``[prompts * SAMPLES, prompt width + RESPONSE_TOKENS]`` sampled sequences, rows grouped by prompt."""
        sampling: dict[str, Any] = {
            "do_sample": True,
            "temperature": 1.0,
            "top_k": 0,
            "max_new_tokens": RESPONSE_TOKENS,
            "pad_token_id": self.tokenizer.pad_token_id,
        }
        if not self.strong:
            return self.model.generate(**encoded, num_return_sequences=SAMPLES, **sampling)
        # Prefill every prompt but its last token once, repeat the cache for the samples, and let
        # generate feed the last token (it runs only the columns the cache does not hold).
        ids, mask = encoded["input_ids"], encoded["attention_mask"]
        positions = (mask.cumsum(-1) - 1).clamp_min(0)
        prefix = self.model(
            input_ids=ids[:, :-1],
            attention_mask=mask[:, :-1],
            position_ids=positions[:, :-1],
            use_cache=True,
            logits_to_keep=1,
        ).past_key_values
        prefix.batch_repeat_interleave(SAMPLES)
        return self.model.generate(
            input_ids=ids.repeat_interleave(SAMPLES, 0),
            attention_mask=mask.repeat_interleave(SAMPLES, 0),
            past_key_values=prefix,
            **sampling,
        )

    def step(self) -> dict[str, float]:
        """One RL step; seconds per phase and the step's tokens."""
        tokenizer = self.tokenizer
        batch = self.rows[(self.step_index * PROMPTS) % len(self.rows) :][:PROMPTS]
        self.step_index += 1
        texts = [
            tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False)
            for r in batch
        ]
        started = time.monotonic()
        encoded = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        self.model.eval()
        with torch.no_grad():
            sequences = self.generate(encoded)
        generated = time.monotonic()
        prompt_width = encoded["input_ids"].shape[1]
        responses = sequences[:, prompt_width:]
        response_text = tokenizer.batch_decode(responses, skip_special_tokens=True)
        scores = torch.tensor(
            [
                self.reward("target_char", text, batch[i // SAMPLES]["reward_model"]["ground_truth"], {})
                for i, text in enumerate(response_text)
            ]
        )
        eos = tokenizer.eos_token_id
        ended = (responses == eos).cumsum(dim=1) - (responses == eos).long()
        response_mask = ((ended == 0) & (responses != tokenizer.pad_token_id)).float()
        advantages = core.grpo_outcome_advantages(
            scores, [i // SAMPLES for i in range(len(scores))], response_mask
        )
        scored = time.monotonic()
        self.model.train()
        attention_mask = torch.cat(
            [encoded["attention_mask"].repeat_interleave(SAMPLES, 0), response_mask.long()], 1
        )
        position_ids = (attention_mask.cumsum(-1) - 1).clamp_min(0)
        response_width = responses.shape[1]
        # Strong: logits only for the columns that predict a response token (and the last, dropped).
        keep = response_width + 1 if self.strong else 0
        logits = self.model(
            input_ids=sequences, attention_mask=attention_mask, position_ids=position_ids, logits_to_keep=keep
        ).logits
        predicting = logits[:, -response_width - 1 : -1]
        log_probs = torch.log_softmax(predicting.float(), -1).gather(-1, responses.unsqueeze(-1)).squeeze(-1)
        loss = -core.masked_mean(advantages * log_probs, response_mask)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        finished = time.monotonic()
        return {
            "generate": generated - started,
            "reward": scored - generated,
            "update": finished - scored,
            "wall": finished - started,
            "tokens": float(attention_mask.sum()),
        }


def fastest_thread_count(model_dir: Path, rows: list[dict[str, Any]]) -> int:
    """The torch thread count at which the strong loop's steps ran fastest here (1 .. all cores)."""
    seconds: dict[int, float] = {}
    for threads in range(1, available_cores() + 1):
        torch.set_num_threads(threads)
        loop = Loop(model_dir, rows, strong=True)
        loop.step()  # first-call allocations
        seconds[threads] = statistics.median(loop.step()["wall"] for _ in range(THREAD_TRIAL_STEPS))
    return min(seconds, key=seconds.__getitem__)


def loop_run(
    model_dir: Path, rows: list[dict[str, Any]], steps: int, *, strong: bool, threads: int
) -> dict[str, Any]:
    """``steps`` steps of a fresh loop at ``threads`` torch threads; every step measured."""
    torch.set_num_threads(threads)
    loop = Loop(model_dir, rows, strong=strong)
    measured = [loop.step() for _ in range(steps)]
    walls = [m["wall"] for m in measured]
    warm = measured[WARM_AFTER_STEPS:] or measured
    return {
        "tokens_per_second": round(sum(m["tokens"] for m in measured) / sum(walls), 1),
        "warm_tokens_per_second": round(sum(m["tokens"] for m in warm) / sum(m["wall"] for m in warm), 1),
        "seconds_per_step": round(statistics.mean(walls), 4),
        "seconds_per_phase": {
            phase: round(statistics.mean(m[phase] for m in measured), 4)
            for phase in ("generate", "reward", "update")
        },
    }


def job_spec(workdir: Path, model: Path, data: Path, run: str, steps: int) -> RLHFJobSpec:
    """The measured job of hybridflow run ``run`` (``hybridflow_<placement>[_compiled]``)."""
    placement = run.removeprefix("hybridflow_").removesuffix("_compiled")
    compiled = run.endswith("_compiled")
    doc_spec = load_job_manifest(ROOT / "examples" / "grpo-tiny.yaml").spec
    sequences = PROMPTS * SAMPLES
    overlap = placement == "2gpu_overlap"
    gpus = 1 if overlap else int(placement.removesuffix("gpu"))  # GPUs of the actor's pool
    pools: list[dict[str, Any]] = [{"name": "default", "nodes": 1, "gpusPerNode": gpus}]
    roles: dict[str, str] = {"actor": "default"}
    if overlap:
        pools.append({"name": "generate", "nodes": 1, "gpusPerNode": 1})
        roles["rollout"] = "generate"
    # A fresh output directory per measured run, and so a cold compile cache.
    output = Path(tempfile.mkdtemp(prefix=f"{run}-", dir=workdir)) if steps > 1 else workdir / run
    return RLHFJobSpec.model_validate(
        {
            **doc_spec.model_dump(by_alias=True, exclude_none=True),
            "models": {"actor": {"path": str(model)}},
            "data": {**doc_spec.data.model_dump(by_alias=True, exclude_none=True), "trainFiles": [str(data)]},
            "algorithm": {"name": "grpo", "samplesPerPrompt": SAMPLES, "kl": {"coef": 0.0}},
            "rollout": {
                "engine": "torch",
                "maxResponseTokens": RESPONSE_TOKENS,
                "temperature": 1.0,
                "maxStaleness": 1 if overlap else 0,
                "compile": compiled,
            },
            "training": {
                "totalSteps": steps,
                "promptsPerStep": PROMPTS,
                "miniBatchSize": sequences,
                "microBatchSizePerGpu": sequences // gpus,
                "learningRate": LEARNING_RATE,
                "precision": "fp32",
                "compile": compiled,
            },
            "resourcePools": pools,
            "roles": roles,
            "checkpoint": {"intervalSteps": 10_000, "keepLast": 1},
            "outputDir": str(output),
        }
    )


def hybridflow_run(spec: RLHFJobSpec) -> dict[str, Any]:
    """Every step of ``run_training(spec)``; the final checkpoint after the last step is not a step."""
    summary = run_training(
        spec, on_step=lambda line: print(f"[{Path(spec.output_dir).name}] {line}", file=sys.stderr)
    )
    measured = summary.metrics
    walls = [m["perf/step_seconds"] for m in measured]
    compiled_until = max(
        (i + 1 for i, m in enumerate(measured) if m.get("timing/compile", 0.0) > 0), default=0
    )
    warm = measured[max(WARM_AFTER_STEPS, compiled_until) :] or measured
    phase_names = sorted({k.removeprefix("timing/") for m in measured for k in m if k.startswith("timing/")})
    phase_names.remove("checkpoint")
    return {
        "tokens_per_second": round(sum(m["tokens/step"] for m in measured) / sum(walls), 1),
        "warm_tokens_per_second": round(
            sum(m["tokens/step"] for m in warm) / sum(m["perf/step_seconds"] for m in warm), 1
        ),
        "seconds_per_step": round(statistics.mean(walls), 4),
        "seconds_per_phase": {
            name: round(statistics.mean(m.get(f"timing/{name}", 0.0) for m in measured), 4)
            for name in phase_names
        },
        "controller_overhead_fraction": round(
            sum(m.get("controller/overhead_seconds", 0.0) for m in measured) / sum(walls), 4
        ),
        "compile_seconds": round(sum(m.get("timing/compile", 0.0) for m in measured), 1),
    }


def median_run(rounds: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The per-round figures of one run, and their medians (phases too)."""
    phases = sorted({name for r in rounds for name in r["seconds_per_phase"]})
    figures: dict[str, Any] = {
        "tokens_per_second": round(statistics.median(r["tokens_per_second"] for r in rounds), 1),
        "warm_tokens_per_second": round(statistics.median(r["warm_tokens_per_second"] for r in rounds), 1),
        "seconds_per_step": round(statistics.median(r["seconds_per_step"] for r in rounds), 4),
        "seconds_per_phase": {
            name: round(statistics.median(r["seconds_per_phase"].get(name, 0.0) for r in rounds), 4)
            for name in phases
        },
        "rounds_tokens_per_second": [r["tokens_per_second"] for r in rounds],
    }
    for extra in ("controller_overhead_fraction", "compile_seconds"):
        if extra in rounds[0]:
            figures[extra] = round(statistics.median(r[extra] for r in rounds), 4)
    return figures


def phase_ratios(strong: dict[str, Any], run: dict[str, Any]) -> dict[str, float | None]:
    """The strong loop's seconds per step of generation and of the update over ``run``'s."""
    phases = run["seconds_per_phase"]
    pairs = {"generate": ("generate", "generate"), "update": ("update", "actor_update")}
    return {
        name: round(strong["seconds_per_phase"][ours] / phases[theirs], 3) if phases.get(theirs) else None
        for name, (ours, theirs) in pairs.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        default=os.environ.get("HYBRIDFLOW_BENCH_QUICK") == "1",
        help="one round of 3 steps per run, no compiled runs (CI)",
    )
    args = parser.parse_args()
    steps, rounds = (QUICK_STEPS, QUICK_ROUNDS) if args.quick else (STEPS, ROUNDS)
    workdir = Path(tempfile.mkdtemp(prefix="hybridflow-throughput-"))
    model = write_tiny_model(workdir / "tiny-model")
    rows = make_toy_dataset("target_char", 256, seed=0)
    data = workdir / "target_char.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    hybridflow_runs = [f"hybridflow_{p}" for p in PLACEMENTS]
    if not args.quick:
        hybridflow_runs += [f"{run}_compiled" for run in hybridflow_runs]
    plain_threads = available_cores()
    strong_threads = plain_threads if args.quick else fastest_thread_count(model, rows)
    # One embedded Ray for every run, sized for each pool's largest use (it cannot grow once
    # started): "default" with 2 GPUs (the 2-GPU runs), "generate" with 1 (the overlapped runs).
    pools = {
        pool.name: pool
        for run in ("hybridflow_2gpu_overlap", "hybridflow_2gpu")
        for pool in resource_pools(job_spec(workdir, model, data, run, 1), simulated=True)
    }
    init_local_ray(list(pools.values()))
    runners: dict[str, Callable[[], dict[str, Any]]] = {
        "plain_loop": lambda: loop_run(model, rows, steps, strong=False, threads=plain_threads),
        "strong_loop": lambda: loop_run(model, rows, steps, strong=True, threads=strong_threads),
        **{
            run: (lambda run=run: hybridflow_run(job_spec(workdir, model, data, run, steps)))
            for run in hybridflow_runs
        },
    }
    order = list(runners)
    per_round: dict[str, list[dict[str, Any]]] = {run: [] for run in order}
    for round_index in range(rounds):
        for run in order if round_index % 2 == 0 else reversed(order):
            per_round[run].append(runners[run]())
            print(
                f"round {round_index + 1}: {run} {per_round[run][-1]['tokens_per_second']} tokens/s",
                file=sys.stderr,
            )
    runs = {run: median_run(results) for run, results in per_round.items()}
    best = max(hybridflow_runs, key=lambda run: runs[run]["tokens_per_second"])
    best_tokens = runs[best]["tokens_per_second"]
    figures: dict[str, Any] = {
        "shape": {"prompts": PROMPTS, "samples_per_prompt": SAMPLES, "response_tokens": RESPONSE_TOKENS},
        "steps_per_run": steps,
        "rounds": rounds,
        "quick": args.quick,
        "strong_threads": strong_threads,
        "plain_threads": plain_threads,
        **runs,
        "tokens_per_second": {run: runs[run]["tokens_per_second"] for run in order},
        "warm_tokens_per_second": {run: runs[run]["warm_tokens_per_second"] for run in order},
        "warm_ratio_vs_strong_loop": {
            run: round(runs[run]["warm_tokens_per_second"] / runs["strong_loop"]["warm_tokens_per_second"], 3)
            for run in hybridflow_runs
        },
        "best_placement": best,
        "ratio_vs_plain_loop": round(best_tokens / runs["plain_loop"]["tokens_per_second"], 3),
        "ratio_vs_strong_loop": round(best_tokens / runs["strong_loop"]["tokens_per_second"], 3),
        "strong_over_plain_loop": round(
            runs["strong_loop"]["tokens_per_second"] / runs["plain_loop"]["tokens_per_second"], 3
        ),
        "phase_ratios_vs_strong_loop": {
            run: phase_ratios(runs["strong_loop"], runs[run]) for run in hybridflow_runs
        },
        "controller_overhead_fraction": {
            run: runs[run]["controller_overhead_fraction"] for run in hybridflow_runs
        },
        "targets": {
            "ratio_vs_plain_loop": TARGET_VS_PLAIN,
            "ratio_vs_strong_loop": TARGET_VS_STRONG,
            "generate_vs_strong_loop": TARGET_GENERATE,
            "update_vs_strong_loop": TARGET_UPDATE,
            "controller_overhead_fraction": 0.05,
        },
    }
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
