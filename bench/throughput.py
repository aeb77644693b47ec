"""Throughput of one RL step: a plain single-process loop against hybridflow on 1 and 2 simulated GPUs.

Same model (the tiny random model), data (target_char prompts), shapes (16 prompts x 4 samples,
16 response tokens) and algorithm (GRPO advantages, no KL, one optimizer step per RL step), all
in this process's run:

* ``plain_loop``: written here, one process, no Ray, run before and after the hybridflow runs
  (its figure is the mean of the two): HF ``generate`` with its KV cache
  (sampling, temperature 1), the target_char reward, group-normalised advantages, one
  forward/backward over the same tokens and one AdamW step. torch uses every core.
* ``hybridflow_1gpu`` / ``hybridflow_2gpu``: ``run_training`` of the same job with 1 or 2
  simulated GPUs (each worker gets its share of the cores as torch threads), every role on
  every GPU, synchronous.
* ``hybridflow_2gpu_overlap``: the same job on 2 simulated GPUs placed as HybridFlow's split
  placement: the actor on one, the rollout on the other, generating the next step's batch while
  the actor updates (``rollout.maxStaleness: 1``, importance-sampling correction on; see
  docs/placement.md), so each core works on its own phase.

Tokens per step are prompt + response tokens (attention mask), as the paper counts them; tokens
per second is their sum over the measured steps divided by those steps' wall time; the first
``WARMUP`` steps (allocation, first-call compilation of kernels) are not measured, nor is hybridflow's
last step, which also writes the run's final checkpoint (the plain loop saves nothing; a job's
periodic checkpoints are off here, ``intervalSteps`` beyond the run). Per phase:
mean seconds per step (generate, reward, update; hybridflow also weight sync and log-probs).
``ratio_vs_plain_loop`` = best hybridflow tokens/s over plain-loop tokens/s (target >= 1.2),
``best_placement`` names the run it came from.
``--quick`` (CI) measures 2 steps after 1 warmup instead of 6 after 2. The last line printed is
one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hybridflow.controller import init_local_ray
from hybridflow.models.tiny import write_tiny_model
from hybridflow.rewards import make_toy_dataset, resolve_reward_function
from hybridflow.rlmath import core
from hybridflow.spec import RLHFJobSpec, load_job_manifest
from hybridflow.trainer.roles import resource_pools
from hybridflow.trainer.runner import run_training

ROOT = Path(__file__).resolve().parents[1]
PROMPTS, SAMPLES, RESPONSE_TOKENS = 16, 4, 16
LEARNING_RATE = 2e-3


def plain_loop(model_dir: Path, rows: list[dict[str, Any]], steps: int, warmup: int) -> dict[str, Any]:
    """The reference loop: generate, score, one AdamW step; every phase timed."""
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE)
    reward = resolve_reward_function("target_char")
    phases: dict[str, list[float]] = {"generate": [], "reward": [], "update": []}
    tokens: list[float] = []
    walls: list[float] = []
    for step in range(warmup + steps):
        batch = rows[(step * PROMPTS) % len(rows) :][:PROMPTS]
        texts = [
            tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False)
            for r in batch
        ]
        started = time.monotonic()
        encoded = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        model.eval()
        with torch.no_grad():
            sequences = model.generate(
                **encoded,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                max_new_tokens=RESPONSE_TOKENS,
                num_return_sequences=SAMPLES,
                pad_token_id=tokenizer.pad_token_id,
                use_cache=True,
            )
        generated = time.monotonic()
        prompt_width = encoded["input_ids"].shape[1]
        responses = sequences[:, prompt_width:]
        response_text = tokenizer.batch_decode(responses, skip_special_tokens=True)
        scores = torch.tensor(
            [
                reward("target_char", text, batch[i // SAMPLES]["reward_model"]["ground_truth"], {})
                for i, text in enumerate(response_text)
            ]
        )
        group_ids = [i // SAMPLES for i in range(len(scores))]
        eos = tokenizer.eos_token_id
        ended = (responses == eos).cumsum(dim=1) - (responses == eos).long()
        response_mask = ((ended == 0) & (responses != tokenizer.pad_token_id)).float()
        advantages = core.grpo_outcome_advantages(scores, group_ids, response_mask)
        scored = time.monotonic()
        model.train()
        attention_mask = torch.cat(
            [encoded["attention_mask"].repeat_interleave(SAMPLES, 0), response_mask.long()], 1
        )
        position_ids = (attention_mask.cumsum(-1) - 1).clamp_min(0)
        logits = model(input_ids=sequences, attention_mask=attention_mask, position_ids=position_ids).logits
        log_probs = torch.log_softmax(logits[:, prompt_width - 1 : -1].float(), -1)
        log_probs = log_probs.gather(-1, responses.unsqueeze(-1)).squeeze(-1)
        loss = -core.masked_mean(advantages * log_probs, response_mask)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        finished = time.monotonic()
        if step >= warmup:
            phases["generate"].append(generated - started)
            phases["reward"].append(scored - generated)
            phases["update"].append(finished - scored)
            tokens.append(float(attention_mask.sum()))
            walls.append(finished - started)
    return {
        "tokens_per_second": round(sum(tokens) / sum(walls), 1),
        "seconds_per_step": round(statistics.mean(walls), 3),
        "seconds_per_phase": {name: round(statistics.mean(values), 3) for name, values in phases.items()},
    }


PLACEMENTS = ("1gpu", "2gpu", "2gpu_overlap")
"""hybridflow's runs, in the order they run (see the module docstring)."""


def job_spec(workdir: Path, model: Path, data: Path, placement: str, steps: int) -> RLHFJobSpec:
    """The measured job on ``placement`` (one of :data:`PLACEMENTS`)."""
    doc_spec = load_job_manifest(ROOT / "examples" / "grpo-tiny.yaml").spec
    sequences = PROMPTS * SAMPLES
    overlap = placement == "2gpu_overlap"
    gpus = 1 if overlap else int(placement.removesuffix("gpu"))  # GPUs of the actor's pool
    pools: list[dict[str, Any]] = [{"name": "default", "nodes": 1, "gpusPerNode": gpus}]
    roles: dict[str, str] = {"actor": "default"}
    if overlap:
        pools.append({"name": "generate", "nodes": 1, "gpusPerNode": 1})
        roles["rollout"] = "generate"
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
            },
            "training": {
                "totalSteps": steps,
                "promptsPerStep": PROMPTS,
                "miniBatchSize": sequences,
                "microBatchSizePerGpu": sequences // gpus,
                "learningRate": LEARNING_RATE,
                "precision": "fp32",
            },
            "resourcePools": pools,
            "roles": roles,
            "checkpoint": {"intervalSteps": 10_000, "keepLast": 1},
            "outputDir": str(workdir / f"hybridflow-{placement}"),
        }
    )


def hybridflow_run(spec: RLHFJobSpec, warmup: int) -> dict[str, Any]:
    """Steps after ``warmup`` up to the last one, which saves the final checkpoint (not measured)."""
    summary = run_training(spec, on_step=lambda line: print(f"[{spec.output_dir}] {line}", file=sys.stderr))
    measured = summary.metrics[warmup:-1]
    walls = [m["perf/step_seconds"] for m in measured]
    phase_names = sorted({k.removeprefix("timing/") for m in measured for k in m if k.startswith("timing/")})
    return {
        "tokens_per_second": round(sum(m["tokens/step"] for m in measured) / sum(walls), 1),
        "seconds_per_step": round(statistics.mean(walls), 3),
        "seconds_per_phase": {
            name: round(statistics.mean(m.get(f"timing/{name}", 0.0) for m in measured), 3)
            for name in phase_names
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        default=os.environ.get("HYBRIDFLOW_BENCH_QUICK") == "1",
        help="2 measured steps after 1 warmup (CI)",
    )
    args = parser.parse_args()
    steps, warmup = (2, 1) if args.quick else (6, 2)
    workdir = Path(tempfile.mkdtemp(prefix="hybridflow-throughput-"))
    model = write_tiny_model(workdir / "tiny-model")
    rows = make_toy_dataset("target_char", 256, seed=0)
    data = workdir / "target_char.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    figures: dict[str, Any] = {
        "shape": {"prompts": PROMPTS, "samples_per_prompt": SAMPLES, "response_tokens": RESPONSE_TOKENS},
        "measured_steps": steps,
        "quick": args.quick,
    }
    plain_before = plain_loop(model, rows, steps, warmup)
    # One embedded Ray for every run, sized for each pool's largest use (it cannot grow once
    # started): "default" with 2 GPUs (the 2-GPU run), "generate" with 1 (the overlapped run).
    pools = {
        pool.name: pool
        for placement in ("2gpu_overlap", "2gpu")
        for pool in resource_pools(job_spec(workdir, model, data, placement, 1), simulated=True)
    }
    init_local_ray(list(pools.values()))
    for placement in PLACEMENTS:
        figures[f"hybridflow_{placement}"] = hybridflow_run(
            job_spec(workdir, model, data, placement, warmup + steps + 1), warmup
        )
    # The baseline runs before and after hybridflow's runs: a load that drifts over the minutes of
    # the bench weighs on both sides alike. Its figure is the mean of the two runs.
    plain_after = plain_loop(model, rows, steps, warmup)
    figures["plain_loop"] = {
        "tokens_per_second": round(
            statistics.mean([plain_before["tokens_per_second"], plain_after["tokens_per_second"]]), 1
        ),
        "runs": [plain_before, plain_after],
    }
    plain = figures["plain_loop"]["tokens_per_second"]
    measured = {p: figures[f"hybridflow_{p}"]["tokens_per_second"] for p in PLACEMENTS}
    best = max(measured, key=measured.__getitem__)
    figures["plain_loop_tokens_per_second"] = plain
    figures["hybridflow_tokens_per_second"] = measured
    figures["best_placement"] = best
    figures["ratio_vs_plain_loop"] = round(measured[best] / plain, 3)
    figures["target_ratio"] = 1.2
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
