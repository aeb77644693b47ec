"""Test-only scenario: vLLM rollout shards in real Ray worker groups, run as its own process.

``python vllm_tp_scenario.py WORK_DIR CASE...`` (CASE is ``<backend>-tg<t_g>``, e.g. ``fsdp-tg2``,
``megatron-tg1`` (megatron at t 2), ``megatron-p2-tg1`` (megatron at p 2), ``fsdp4-tg2`` (FSDP
over 4 GPUs), ``fsdp4h4-tg4`` (FSDP over 4 GPUs, one vLLM group of 4), ``megatron-t4-tg2``
(megatron at t 4 on 4 GPUs, a 4-head model: vLLM's TP groups are the strided ``[0, 2], [1, 3]``))
writes tiny models and prompts under WORK_DIR, starts its own embedded Ray (2 simulated GPUs, 4
if a case needs them; one pool; worker processes apply the megatron CPU shim at start-up, this
directory must be on ``PYTHONPATH``), and for each case deploys actor + rollout (+ reference)
through :func:`hybridflow.trainer.roles.job_roles` with ``rollout.engine: vllm``. It compares
greedy generation with HF ``generate`` on the actor's current full weights after the first sync
and after a GRPO step (which syncs first; a second step would repeat the same sleep, reload and
generate path), and records the step's reshard
metrics and each sync's transition figures. Writes ``WORK_DIR/result.json``.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import yaml
from hybrid_engine_scenario import hf_greedy

ROOT = Path(__file__).resolve().parents[2]
STEPS = 1


def manifest(work: Path, backend: str, t_g: int) -> dict[str, Any]:
    doc = yaml.safe_load((ROOT / "examples" / "grpo-tiny-vllm.yaml").read_text())
    spec = doc["spec"]
    spec["models"] = {role: {"path": str(work / "model")} for role in spec["models"]}
    spec["data"]["trainFiles"] = [str(work / "data" / "target_char.jsonl")]
    spec["algorithm"]["samplesPerPrompt"] = 2
    spec["algorithm"]["entropyCoef"] = 0.01  # the weights move even when a group's rewards tie
    spec["rollout"].update({"maxResponseTokens": 8, "tensorParallelSize": t_g})
    spec["training"].update(
        {
            "backend": backend,
            "totalSteps": STEPS,
            "promptsPerStep": 4,
            "miniBatchSize": 8,
            "microBatchSizePerGpu": 2,
        }
    )
    if backend == "megatron":
        spec["training"]["tensorParallelSize"] = 2
    elif backend == "fsdp4":  # FSDP over 4 ranks -> t_g 2: strided groups [0, 2], [1, 3]
        spec["training"]["backend"] = "fsdp"
        spec["resourcePools"][0]["gpusPerNode"] = 4
    elif backend == "fsdp4h4":  # FSDP over 4 ranks -> one vLLM group of t_g 4 (a 4-head model)
        spec["training"]["backend"] = "fsdp"
        spec["models"] = {role: {"path": str(work / "model-h4-v512")} for role in spec["models"]}
        spec["resourcePools"][0]["gpusPerNode"] = 4
    elif backend == "megatron-t4":  # t 4 -> t_g 2: micro-DP groups [0, 1], [2, 3]
        spec["training"].update({"backend": "megatron", "tensorParallelSize": 4})
        spec["models"] = {role: {"path": str(work / "model-h4")} for role in spec["models"]}
        spec["resourcePools"][0]["gpusPerNode"] = 4
    elif backend == "megatron-p2":  # pipeline-parallel training, generation gathered over the stages
        spec["training"].update({"backend": "megatron", "pipelineParallelSize": 2})
    spec["outputDir"] = str(work / f"out-{backend}-{t_g}")
    return doc


def remove_shm_leftovers() -> None:
    for pattern in ("*cpushm*", "psm_*"):
        for leftover in Path("/dev/shm").glob(pattern):
            with contextlib.suppress(OSError):
                leftover.unlink()


def full_weights(workers: Any, backend: str, work: Path) -> dict[str, Any]:
    if backend.startswith("megatron"):
        return dict(workers.actor.full_state_dict()[0])
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    directory = work / f"ckpt-{time.monotonic_ns()}"
    workers.actor.save_checkpoint(str(directory))
    single = directory.with_suffix(".pt")
    dcp_to_torch_save(str(directory), str(single))
    state = torch.load(single, weights_only=False)
    return {k: v for k, v in state["model"].items() if isinstance(v, torch.Tensor)}


def greedy_check(workers: Any, sampler: Any, backend: str, work: Path, spec: Any) -> dict[str, Any]:
    from hybridflow.controller import Batch

    full = full_weights(workers, backend, work)
    prompts = sampler.next_batch(4)
    batch = Batch.from_dict(prompts.to_batch_fields(), meta={"samples": 1, "greedy": True})
    workers.rollout.sync_weights()
    transition = workers.rollout.transition_stats()
    generated = workers.rollout.generate_sequences(batch)
    responses, mask = generated.tensors["responses"], generated.tensors["response_mask"]
    engine = [
        [int(t) for t, m in zip(row.tolist(), row_mask.tolist(), strict=True) if m]
        for row, row_mask in zip(responses, mask, strict=True)
    ]
    prompt_ids = [list(map(int, ids)) for ids in batch.non_tensors["prompt_token_ids"]]
    hf = hf_greedy(Path(spec.models.actor.path), full, prompt_ids, spec.rollout.max_response_tokens)
    return {"engine": engine, "hf": hf, "transition": transition}


def run_case(work: Path, case: str) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from hybridflow.algorithms import grpo
    from hybridflow.algorithms.state import AlgorithmState
    from hybridflow.controller import Batch, deploy
    from hybridflow.data import PromptDataset, PromptSampler
    from hybridflow.rewards.scorer import RewardScorer
    from hybridflow.spec.manifest import parse_job_manifest
    from hybridflow.trainer.roles import JobWorkers, job_roles, resource_pools
    from hybridflow.trainer.runner import reshard_metrics

    backend, t_g = case.split("-tg")
    spec = parse_job_manifest(manifest(work, backend, int(t_g)), "scenario").spec
    tokenizer = AutoTokenizer.from_pretrained(spec.models.actor.path)
    sampler = PromptSampler(PromptDataset.from_spec(spec.data, tokenizer), seed=0, shuffle=False)
    started = time.monotonic()
    result: dict[str, Any] = {"steps": [], "checks": []}
    remove_shm_leftovers()
    roles = job_roles(spec)
    result["rollout_worker"] = roles["rollout"].worker_cls.__name__
    with deploy(resource_pools(spec, simulated=True), roles, placement_timeout_seconds=60) as deployment:
        result["deploy_seconds"] = time.monotonic() - started
        # What each worker saw of its GPU: under the suite's GPU-contract emulation
        # (tests/conftest.py) every one is enforced, one visible device, index 0.
        result["device_views"] = [
            {"enforced": v.enforced, "visible": v.visible, "index": v.device_index()}
            for v in deployment.device_views.values()
        ]
        workers = JobWorkers.of(deployment)
        scorer = RewardScorer(spec, workers.reward)
        state = AlgorithmState(spec)
        result["checks"].append(greedy_check(workers, sampler, backend, work, spec))
        for step in range(1, STEPS + 1):
            prompts = sampler.next_batch(spec.training.prompts_per_step)
            batch = Batch.from_dict(
                prompts.to_batch_fields(), meta={"samples": spec.algorithm.samples_per_prompt, "seed": step}
            )
            metrics = grpo.train_step(workers, batch, scorer, state)
            metrics.update(reshard_metrics(workers.rollout.transition_stats()))
            result["steps"].append(metrics)
            result["checks"].append(greedy_check(workers, sampler, backend, work, spec))
    remove_shm_leftovers()
    result["seconds"] = time.monotonic() - started
    return result


def main(work: Path, cases: list[str]) -> None:
    import ray

    from hybridflow.controller.resource_pool import simulated_cluster_resources
    from hybridflow.models.tiny import write_tiny_model
    from hybridflow.rewards import make_toy_dataset
    from hybridflow.spec.manifest import parse_job_manifest
    from hybridflow.trainer.roles import resource_pools

    write_tiny_model(work / "model", arch="qwen2", seed=0)
    # Four key/value heads split four ways (megatron at t 4); head dim 32, vLLM's smallest.
    write_tiny_model(work / "model-h4", arch="qwen2", seed=0, hidden=128, heads=4, kv_heads=4)
    # t_g 4: vLLM pads the vocabulary to a multiple of 64 x t_g before splitting it.
    write_tiny_model(
        work / "model-h4-v512", arch="qwen2", seed=0, hidden=128, heads=4, kv_heads=4, vocab_size=512
    )
    (work / "data").mkdir(exist_ok=True)
    rows = make_toy_dataset("target_char", 32, seed=0)
    (work / "data" / "target_char.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    # One Ray for every case, as large as the largest case's pool.
    specs = [parse_job_manifest(manifest(work, case.split("-tg")[0], 1), "scenario").spec for case in cases]
    pools = [pool for spec in specs for pool in resource_pools(spec, simulated=True)]
    largest = max(pools, key=lambda pool: pool.world_size)
    ray.init(
        num_cpus=2,
        num_gpus=largest.world_size,
        resources=simulated_cluster_resources([largest]),
        include_dashboard=False,
        configure_logging=False,
        log_to_driver=True,
        runtime_env={"worker_process_setup_hook": "megatron_shim.install"},
    )
    results = {case: run_case(work, case) for case in cases}
    ray.shutdown()
    (work / "result.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    main(Path(sys.argv[1]), sys.argv[2:])
