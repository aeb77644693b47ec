"""Test-only scenario: the 3D-HybridEngine in real Ray worker groups, run as its own process.

``python hybrid_engine_scenario.py WORK_DIR`` writes a tiny model and prompts under WORK_DIR,
starts its own embedded Ray (4 simulated GPUs, one pool) whose worker processes apply the
megatron CPU shim at start-up (``worker_process_setup_hook``; this directory must be on
``PYTHONPATH``), deploys actor (megatron, p1 t2 d2) + rollout (HybridFlow generation layout,
t_g from argv, default 1) + reference through :func:`hybridflow.trainer.roles.job_roles`, runs
GRPO steps through :func:`hybridflow.algorithms.grpo.train_step` with the runner's reshard
metrics, then compares greedy generation after a reshard with HF ``generate`` on the actor's
gathered full weights; finally one PPO step (megatron critic) through
:func:`hybridflow.trainer.runner.run_training`, with its checkpoint, the actor's parameters and
optimizer state offloaded during generation. Writes
``WORK_DIR/result.json``.

It is a separate process so that the shim and this Ray instance never touch the pytest
session's (``tests/conftest.py``'s shared Ray).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
STEPS = 2


def manifest(work: Path, rollout_tp: int, example: str = "grpo-tiny.yaml") -> dict[str, Any]:
    doc = yaml.safe_load((ROOT / "examples" / example).read_text())
    spec = doc["spec"]
    spec["models"] = {role: {"path": str(work / "model")} for role in spec["models"]}
    spec["data"]["trainFiles"] = [str(work / "data" / "target_char.jsonl")]
    spec["algorithm"]["samplesPerPrompt"] = 2
    # A gradient even when every reward of a group ties (zero advantages): the weights must move
    # for the greedy check to compare the *trained* policy.
    spec["algorithm"]["entropyCoef"] = 0.01
    spec["rollout"].update({"engine": "torch", "maxResponseTokens": 8, "tensorParallelSize": rollout_tp})
    spec["training"].update(
        {
            "backend": "megatron",
            "tensorParallelSize": 2,
            "pipelineParallelSize": 1,
            "totalSteps": STEPS,
            "promptsPerStep": 4,
            "miniBatchSize": 8,
            "microBatchSizePerGpu": 2,
        }
    )
    spec["resourcePools"] = [{"name": "default", "nodes": 1, "gpusPerNode": 4}]
    spec["outputDir"] = str(work / "out")
    return doc


def hf_greedy(
    model_dir: Path, full: dict[str, Any], prompts: list[list[int]], max_new: int
) -> list[list[int]]:
    import torch
    from transformers import AutoModelForCausalLM

    from hybridflow.workers.hybrid_rollout import eos_token_ids

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    model.load_state_dict(full, strict=True)
    eos = eos_token_ids(str(model_dir))
    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            generated = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new,
                do_sample=False,
                eos_token_id=eos,
                pad_token_id=eos[0],
            )
            tokens = generated[0, len(prompt) :].tolist()
            for index, token in enumerate(tokens):
                if token in eos:
                    tokens = tokens[: index + 1]
                    break
            out.append(tokens)
    return out


def main(work: Path, rollout_tp: int) -> None:
    import ray
    from transformers import AutoTokenizer

    from hybridflow.algorithms import grpo
    from hybridflow.algorithms.state import AlgorithmState
    from hybridflow.controller import Batch, deploy
    from hybridflow.controller.resource_pool import simulated_cluster_resources
    from hybridflow.data import PromptDataset, PromptSampler
    from hybridflow.models.tiny import write_tiny_model
    from hybridflow.rewards import make_toy_dataset
    from hybridflow.rewards.scorer import RewardScorer
    from hybridflow.spec.manifest import parse_job_manifest
    from hybridflow.trainer.roles import JobWorkers, job_roles, resource_pools
    from hybridflow.trainer.runner import reshard_metrics

    write_tiny_model(work / "model", arch="qwen2", seed=0)
    (work / "data").mkdir(exist_ok=True)
    rows = make_toy_dataset("target_char", 32, seed=0)
    (work / "data" / "target_char.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    spec = parse_job_manifest(manifest(work, rollout_tp), "scenario").spec

    pools = resource_pools(spec, simulated=True)
    ray.init(
        num_cpus=4,
        num_gpus=4,
        resources=simulated_cluster_resources(pools),
        include_dashboard=False,
        configure_logging=False,
        log_to_driver=True,
        runtime_env={"worker_process_setup_hook": "megatron_shim.install"},
    )
    tokenizer = AutoTokenizer.from_pretrained(spec.models.actor.path)
    sampler = PromptSampler(PromptDataset.from_spec(spec.data, tokenizer), seed=0, shuffle=False)
    result: dict[str, Any] = {"steps": []}
    started = time.monotonic()
    with deploy(pools, job_roles(spec), placement_timeout_seconds=60) as deployment:
        result["deploy_seconds"] = time.monotonic() - started
        workers = JobWorkers.of(deployment)
        result["meshes"] = {role: group.mesh.describe() for role, group in deployment.groups.items()}
        scorer = RewardScorer(spec, workers.reward)
        state = AlgorithmState(spec)
        for step in range(1, STEPS + 1):
            step_started = time.monotonic()
            prompts = sampler.next_batch(spec.training.prompts_per_step)
            batch = Batch.from_dict(
                prompts.to_batch_fields(),
                meta={"samples": spec.algorithm.samples_per_prompt, "seed": step},
            )
            metrics = grpo.train_step(workers, batch, scorer, state)
            metrics.update(reshard_metrics(workers.rollout.transition_stats()))
            metrics["perf/step_seconds"] = time.monotonic() - step_started
            result["steps"].append(metrics)
        # Greedy generation after one more train -> generate transition, against HF generate.
        full = workers.actor.full_state_dict()[0]
        prompts = sampler.next_batch(4)
        batch = Batch.from_dict(prompts.to_batch_fields(), meta={"samples": 1, "greedy": True})
        workers.rollout.sync_weights()
        generated = workers.rollout.generate_sequences(batch)
        responses, mask = generated.tensors["responses"], generated.tensors["response_mask"]
        engine_tokens = [
            [int(t) for t, m in zip(row.tolist(), row_mask.tolist(), strict=True) if m]
            for row, row_mask in zip(responses, mask, strict=True)
        ]
        result["transition"] = workers.rollout.transition_stats()
    prompt_ids = [list(map(int, ids)) for ids in batch.non_tensors["prompt_token_ids"]]
    result["engine_greedy"] = engine_tokens
    result["hf_greedy"] = hf_greedy(work / "model", full, prompt_ids, spec.rollout.max_response_tokens)
    from safetensors.torch import load_file

    initial = load_file(str(work / "model" / "model.safetensors"))
    result["max_weight_change"] = max(float((full[name] - initial[name]).abs().max()) for name in initial)
    # PPO (megatron critic too) through the runner (``hybridflow run``'s loop): one step, its checkpoint.
    from hybridflow.trainer.runner import run_training

    doc = manifest(work, rollout_tp, "ppo-tiny.yaml")
    doc["spec"]["training"]["totalSteps"] = 1
    # The actor's parameters leave the device while the engine generates: the rollout then
    # generates from a copy of the rank's own blocks instead of reading them in place.
    doc["spec"]["training"]["offloadDuringGeneration"] = {"parameters": True, "optimizerState": True}
    doc["spec"]["outputDir"] = str(work / "run")
    summary = run_training(parse_job_manifest(doc, "scenario").spec, simulated=True, on_step=print)
    result["run_training"] = summary.metrics
    result["checkpoints"] = sorted(p.name for p in (work / "run").rglob("*") if p.is_dir())
    result["seconds"] = time.monotonic() - started
    ray.shutdown()
    (work / "result.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    main(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 1)
