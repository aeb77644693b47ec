"""The RLHFJob spec: defaults, error messages, cross-field rules (Python and CEL), round trips.

Rule cases are mutations of a manifest whose defaults are already filled in (the dump of a
valid job), because that is what the API server's CEL sees after defaulting; each case breaks
exactly one rule, so the tests also show the rules do not overlap.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import BaseModel, ValidationError

from hybridflow.spec import (
    VALIDATION_RULES,
    AlgorithmSpec,
    CrossFieldRule,
    RLHFJob,
    RLHFJobSpec,
    SpecError,
    load_job_manifest,
    parse_job_manifest,
)

pytestmark = pytest.mark.unit

REPO_ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = REPO_ROOT / "examples" / "grpo-tiny.yaml"

Manifest = dict[str, Any]


def minimal_manifest() -> Manifest:
    """The smallest manifest that runs: everything else has a default."""
    return {
        "apiVersion": "hybridflow.io/v1alpha1",
        "kind": "RLHFJob",
        "metadata": {"name": "tiny"},
        "spec": {
            "models": {"actor": {"path": "/models/actor"}},
            "data": {"trainFiles": ["/data/prompts.jsonl"]},
            "algorithm": {"name": "grpo", "samplesPerPrompt": 4},
            "training": {"totalSteps": 10},
            "rewards": [{"function": "gsm8k"}],
        },
    }


def full_manifest() -> Manifest:
    """PPO with reward and critic models on their own pool, a separate rollout pool, volumes."""
    return {
        "apiVersion": "hybridflow.io/v1alpha1",
        "kind": "RLHFJob",
        "metadata": {"name": "ppo-7b", "namespace": "research", "labels": {"team": "rl"}},
        "spec": {
            "models": {
                "actor": {"path": "/models/sft-7b", "tokenizerPath": "/models/tokenizer"},
                "critic": {"path": "/models/rm-7b"},
                "reward": {"path": "/models/rm-7b"},
            },
            "data": {"trainFiles": ["/data/a.parquet", "/data/b.jsonl"], "maxPromptTokens": 1024},
            "algorithm": {
                "name": "ppo",
                "gaeLambda": 0.95,
                "kl": {"mode": "reward", "estimator": "k1", "controller": "adaptive", "targetKl": 6.0},
            },
            "rollout": {"engine": "vllm", "gpuMemoryUtilization": 0.9, "maxStaleness": 1},
            "training": {
                "backend": "megatron",
                "totalSteps": 500,
                "promptsPerStep": 64,
                "miniBatchSize": 32,
                "microBatchSizePerGpu": 2,
                "warmupSteps": 10,
                "lrSchedule": "cosine",
            },
            "resourcePools": [
                {
                    "name": "actor",
                    "nodes": 2,
                    "gpusPerNode": 8,
                    "cpusPerGpu": 8,
                    "memoryPerGpu": "100Gi",
                    "nodeSelector": {"gpu": "h100"},
                    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
                    "affinity": {"nodeAffinity": {}},
                },
                {"name": "critic", "nodes": 1, "gpusPerNode": 8},
                {"name": "generate", "nodes": 1, "gpusPerNode": 4},
            ],
            "roles": {"actor": "actor", "critic": "critic", "reward": "critic", "rollout": "generate"},
            "checkpoint": {
                "intervalSteps": 20,
                "keepLast": 3,
                "volume": {"claimName": "ckpt", "mountPath": "/checkpoints"},
            },
            "volumes": [{"claimName": "models", "mountPath": "/models"}],
            "image": "registry.example/hybridflow:0.1.0",
            "suspend": True,
            "queueName": "team-rl",
            "maxRestarts": 5,
            "activeDeadlineSeconds": 86400,
            "ttlSecondsAfterFinished": 3600,
            "schedulerLabels": {"ray.io/scheduler-name": "volcano"},
        },
    }


def safe_rlhf_manifest() -> Manifest:
    manifest = minimal_manifest()
    manifest["spec"]["algorithm"] = {"name": "safe-rlhf", "costLimit": 0.1}
    manifest["spec"]["models"].update(critic={"path": "/m/critic"}, cost={"path": "/m/cost"})
    return manifest


def defaulted(manifest: Manifest) -> Manifest:
    """The manifest with every default written out, as the API server stores it."""
    return parse_job_manifest(manifest, "test").to_manifest()


def spec_errors(manifest: Manifest) -> list[str]:
    with pytest.raises(SpecError) as caught:
        parse_job_manifest(manifest, "test")
    assert caught.value.source == "test"
    return list(caught.value.problems)


# --------------------------------------------------------------------------- defaults and loading


def test_minimal_manifest_loads_with_defaults() -> None:
    job = parse_job_manifest(minimal_manifest(), "test")
    spec = job.spec
    assert job.metadata.name == "tiny"
    assert spec.algorithm.kl.coef == 0.001 and spec.algorithm.kl.estimator == "k3"
    assert spec.rollout.engine == "vllm" and spec.rollout.top_k == -1
    assert spec.training.backend == "fsdp" and spec.training.mini_batch_size == 8
    assert [(pool.name, pool.world_size) for pool in spec.resource_pools] == [("default", 1)]
    assert {role: spec.roles.pool_of(role) for role in ("actor", "rollout", "critic")} == {
        "actor": "default",
        "rollout": "default",
        "critic": "default",
    }
    assert spec.pool("reference").name == "default"
    assert spec.models.reference_or_actor.path == "/models/actor"
    assert spec.checkpoint_dir == "outputs/checkpoints"
    assert spec.max_restarts == 3 and spec.suspend is False and spec.queue_name is None


def test_full_manifest_loads() -> None:
    spec = parse_job_manifest(full_manifest(), "test").spec
    assert spec.pool("rollout").name == "generate"
    assert spec.rollout.max_staleness == 1 and spec.rollout.importance_sampling_on
    assert spec.pool("reward").name == "critic"
    assert spec.resource_pools[0].tolerations[0]["operator"] == "Exists"
    assert spec.checkpoint_dir == "/checkpoints/checkpoints"


def test_models_are_frozen() -> None:
    job = parse_job_manifest(minimal_manifest(), "test")
    with pytest.raises(ValidationError):
        job.spec.training.total_steps = 99


def test_load_resolves_local_paths_against_the_manifest_directory(tmp_path: Path) -> None:
    manifest = minimal_manifest()
    manifest["spec"]["models"]["actor"] = {"path": "models/actor", "tokenizerPath": "../tok"}
    manifest["spec"]["data"]["trainFiles"] = ["data/a.jsonl", "/abs/b.parquet"]
    manifest["spec"]["data"]["valFiles"] = ["data/val.jsonl"]
    manifest["spec"]["checkpoint"] = {"path": "ckpt"}
    job_dir = tmp_path / "jobs"
    job_dir.mkdir()
    (job_dir / "job.yaml").write_text(yaml.safe_dump(manifest))

    spec = load_job_manifest(job_dir / "job.yaml").spec

    assert spec.models.actor.path == str(job_dir / "models" / "actor")
    assert spec.models.actor.tokenizer_path == str(tmp_path / "tok")
    assert spec.data.train_files == (str(job_dir / "data" / "a.jsonl"), "/abs/b.parquet")
    assert spec.data.val_files == (str(job_dir / "data" / "val.jsonl"),)
    assert spec.output_dir == str(job_dir / "outputs")
    assert spec.checkpoint.path == "ckpt"  # relative to outputDir or the volume by definition
    assert spec.checkpoint_dir == str(job_dir / "outputs" / "ckpt")


def test_evaluation_defaults_apply_with_val_files_and_nothing_runs_without() -> None:
    manifest = minimal_manifest()
    assert parse_job_manifest(manifest, "test").spec.evaluation_settings is None
    manifest["spec"]["data"]["valFiles"] = ["/data/val.jsonl"]
    settings = parse_job_manifest(manifest, "test").spec.evaluation_settings
    assert settings is not None
    assert (settings.every_steps, settings.at_start, settings.passes) == (0, False, ("greedy", "sampled"))
    manifest["spec"]["evaluation"] = {"everySteps": 5, "greedy": False, "samples": 4, "maxPrompts": 100}
    settings = parse_job_manifest(manifest, "test").spec.evaluation_settings
    assert settings is not None
    assert (settings.every_steps, settings.passes, settings.max_prompts) == (5, ("sampled",), 100)


def test_example_grpo_tiny_loads() -> None:
    job = load_job_manifest(EXAMPLE)
    spec = job.spec
    assert job.metadata.name == "grpo-tiny"
    assert spec.algorithm.name == "grpo" and spec.algorithm.samples_per_prompt >= 2
    assert spec.rollout.engine == "torch"
    assert [(p.name, p.nodes, p.gpus_per_node) for p in spec.resource_pools] == [("default", 1, 2)]
    assert spec.training.total_steps == 40
    assert [reward.function for reward in spec.rewards] == ["target_char"]
    assert spec.models.actor.path == str(REPO_ROOT / "outputs" / "tiny-model")


# --------------------------------------------------------------------------- file errors


def test_missing_file_names_the_path(tmp_path: Path) -> None:
    path = tmp_path / "absent.yaml"
    with pytest.raises(SpecError) as caught:
        load_job_manifest(path)
    assert str(caught.value) == f"{path}: cannot read the manifest: no such file"


def test_directory_instead_of_file(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="it is a directory"):
        load_job_manifest(tmp_path)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("spec: [unclosed\n", "not valid YAML: "),
        (
            "a: 1\n---\nb: 2\n",
            "not valid YAML: expected a single document in the stream, but found another document (line 2",
        ),
        ("", "the manifest is empty"),
        ("- a\n- b\n", "the manifest is a list, not a mapping"),
        ("apiVersion: v1\nkind: Pod\n", "apiVersion: 'v1' is not 'hybridflow.io/v1alpha1'"),
        ("kind: RLHFJob\n", "apiVersion: required field is missing (expected 'hybridflow.io/v1alpha1')"),
        ("apiVersion: hybridflow.io/v1alpha1\nkind: RayJob\n", "kind: 'RayJob' is not 'RLHFJob'"),
    ],
)
def test_unreadable_manifests_say_which_file_and_why(tmp_path: Path, text: str, expected: str) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(text)
    with pytest.raises(SpecError) as caught:
        load_job_manifest(path)
    message = str(caught.value)
    assert message.startswith(f"{path}: {expected}"), message
    assert len(caught.value.problems) == len(message.splitlines())


def test_wrong_kind_reports_only_the_identity() -> None:
    manifest = minimal_manifest()
    manifest["kind"] = "RayJob"
    manifest["spec"]["training"]["foo"] = 1
    assert spec_errors(manifest) == ["kind: 'RayJob' is not 'RLHFJob'; this is not an RLHFJob manifest"]


# --------------------------------------------------------------------------- field errors


def test_enum_error_names_path_value_and_allowed_values() -> None:
    manifest = minimal_manifest()
    manifest["spec"]["algorithm"]["name"] = "ppo2"
    assert spec_errors(manifest) == [
        "spec.algorithm.name: 'ppo2' is not one of 'ppo', 'grpo', 'remax', 'safe-rlhf', 'rloo', 'reinforce++' "
        "or a plugin 'package.module:train_step'"
    ]


def test_unknown_field_lists_the_allowed_keys() -> None:
    manifest = minimal_manifest()
    manifest["spec"]["training"]["foo"] = 1
    [problem] = spec_errors(manifest)
    assert problem.startswith(
        "spec.training.foo: unknown field (allowed: backend, totalSteps, promptsPerStep, "
    )
    assert problem.endswith("pipelineParallelSize, sequenceParallelSize, seed, lora)")


def test_unknown_top_level_field() -> None:
    manifest = minimal_manifest()
    manifest["specs"] = {}
    assert spec_errors(manifest) == ["specs: unknown field (allowed: apiVersion, kind, metadata, spec)"]


def test_list_length_errors() -> None:
    manifest = minimal_manifest()
    manifest["spec"]["data"]["trainFiles"] = []
    manifest["spec"]["resourcePools"] = []
    assert spec_errors(manifest) == [
        "spec.data.trainFiles: must have at least 1 item(s) (got 0)",
        "spec.resourcePools: must have at least 1 item(s) (got 0)",
    ]


def test_snake_case_keys_are_unknown_like_in_the_crd() -> None:
    manifest = minimal_manifest()
    manifest["spec"]["training"] = {"total_steps": 10}
    assert spec_errors(manifest) == [
        "spec.training.totalSteps: required field is missing",
        "spec.training.total_steps: unknown field (allowed: backend, totalSteps, promptsPerStep, "
        "miniBatchSize, microBatchSizePerGpu, maxTokensPerMicroBatch, packSequences, learningRate, criticLearningRate, warmupSteps, lrSchedule, "
        "maxGradNorm, weightDecay, precision, activationCheckpointing, sharedPromptMinTokens, compile, fsdpUnitMinParameters, offloadDuringGeneration, tensorParallelSize, "
        "pipelineParallelSize, sequenceParallelSize, seed, lora)",
    ]


def test_every_field_error_is_reported_one_per_line() -> None:
    manifest = minimal_manifest()
    spec = manifest["spec"]
    spec["training"]["totalSteps"] = 0
    spec["rollout"] = {"gpuMemoryUtilization": 1.5, "engine": "sglang"}
    spec["data"]["trainFiles"] = ["prompts.csv"]
    spec["resourcePools"] = [{"name": "GPU_A"}, "big"]
    spec["checkpoint"] = {"volume": {"claimName": "ckpt", "mountPath": "relative"}}
    spec["rewards"] = [{"function": "not a function"}]
    spec["models"]["actor"] = {}
    del spec["algorithm"]

    problems = spec_errors(manifest)

    assert problems == [
        "spec.models.actor.path: required field is missing",
        "spec.data.trainFiles[0]: 'prompts.csv' is not a .parquet or .jsonl file",
        "spec.algorithm: required field is missing",
        "spec.rollout.engine: 'sglang' is not one of 'vllm', 'torch'",
        "spec.rollout.gpuMemoryUtilization: must be <= 1.0 (got 1.5)",
        "spec.training.totalSteps: must be >= 1 (got 0)",
        "spec.rewards[0].function: 'not a function' is not a registered reward name (lowercase, digits, "
        "'_') or an import path 'package.module:function'",
        "spec.resourcePools[0].name: 'GPU_A' is not a DNS-1123 label (lowercase letters, digits and '-', "
        "starting and ending with a letter or digit)",
        "spec.resourcePools[1]: expected a mapping (got 'big')",
        "spec.checkpoint.volume.mountPath: 'relative' is not an absolute path",
    ]
    message = str(SpecError("job.yaml", problems))
    assert message.splitlines() == [f"job.yaml: {problem}" for problem in problems]


def test_status_from_the_api_server_is_ignored() -> None:
    manifest = minimal_manifest()
    manifest["status"] = {"phase": "Running"}
    manifest["metadata"].update(uid="1234", resourceVersion="7")
    job = parse_job_manifest(manifest, "test")
    assert job.metadata.name == "tiny"


def test_rules_also_guard_specs_built_in_python() -> None:
    spec = parse_job_manifest(minimal_manifest(), "test").spec
    with pytest.raises(ValidationError, match=r"spec\.algorithm\.samplesPerPrompt: must be >= 2"):
        RLHFJobSpec(
            models=spec.models,
            data=spec.data,
            algorithm=AlgorithmSpec(name="rloo"),
            training=spec.training,
            rewards=spec.rewards,
        )


# --------------------------------------------------------------------------- cross-field rules

Mutation = Callable[[Manifest], None]


def _set(path: str, value: Any) -> Mutation:
    """A mutation that sets the dot ``path`` under ``spec`` to ``value``."""

    def mutate(spec: Manifest) -> None:
        *parents, leaf = path.split(".")
        node = spec
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value

    return mutate


def _all(*mutations: Mutation) -> Mutation:
    def mutate(spec: Manifest) -> None:
        for mutation in mutations:
            mutation(spec)

    return mutate


def _pool(name: str, gpus: int) -> dict[str, Any]:
    """A pool written out in full, as after defaulting (CEL reads nodes and gpusPerNode)."""
    return {
        "name": name,
        "nodes": 1,
        "gpusPerNode": gpus,
        "cpusPerGpu": 4,
        "nodeSelector": {},
        "tolerations": [],
        "affinity": {},
    }


_PPO_WITH_CRITIC = _all(_set("algorithm.name", "ppo"), _set("models.critic", {"path": "/m/critic"}))
_SAFE_RLHF = _all(
    _set("algorithm.name", "safe-rlhf"),
    _set("models.critic", {"path": "/m/critic"}),
    _set("models.cost", {"path": "/m/cost"}),
)

_SERVER = _all(
    _set("rollout.mode", "server"),
    _set("rollout.engine", "torch"),
    _set("resourcePools", [_pool("default", 1), _pool("generate", 2)]),
    _set("roles.rollout", "generate"),
)

# rule name -> a mutation of the defaulted minimal manifest's spec that breaks that rule alone,
# and a fragment the rule's "(got ...)" must show.
RULE_CASES: dict[str, tuple[Mutation, str]] = {
    "adaptive-kl-needs-positive-coef": (
        _all(_set("algorithm.kl.controller", "adaptive"), _set("algorithm.kl.coef", 0.0)),
        "0.0 with controller 'adaptive'",
    ),
    "group-baseline-needs-samples": (_set("algorithm.samplesPerPrompt", 1), "1 with name 'grpo'"),
    "top-k-not-zero": (_set("rollout.topK", 0), "0"),
    "evaluation-has-a-pass": (
        _all(
            _set("data.valFiles", ["/data/val.jsonl"]),
            _set("evaluation", {"everySteps": 0, "atStart": False, "greedy": False, "samples": 0}),
        ),
        "samples 0 with greedy false",
    ),
    "evaluation-needs-val-files": (
        # With the CRD's defaults, as the API server would see it.
        _set("evaluation", {"everySteps": 5, "atStart": False, "greedy": True, "samples": 1}),
        "an evaluation section and no spec.data.valFiles",
    ),
    "warmup-within-total-steps": (_set("training.warmupSteps", 11), "11 with totalSteps 10"),
    "token-budget-needs-fsdp": (
        _all(_set("training.backend", "megatron"), _set("training.maxTokensPerMicroBatch", 64)),
        "64 with backend 'megatron'",
    ),
    "packing-needs-fsdp": (
        _all(_set("training.backend", "megatron"), _set("training.packSequences", True)),
        "true with backend 'megatron'",
    ),
    "compile-needs-fsdp": (
        _all(_set("training.backend", "megatron"), _set("training.compile", True)),
        "true with backend 'megatron'",
    ),
    "compile-needs-the-torch-engine": (
        _all(_set("rollout.engine", "vllm"), _set("rollout.compile", True)),
        "true with engine 'vllm'",
    ),
    "rollout-compile-needs-a-whole-model-engine": (
        _all(
            _set("rollout.engine", "torch"),
            _set("rollout.compile", True),
            _set("training.backend", "megatron"),
            _set("training.tensorParallelSize", 2),
            _set("resourcePools", [_pool("default", 2)]),
        ),
        "true with backend 'megatron' at 2 * 1",
    ),
    "tensor-parallel-needs-megatron": (
        _all(_set("training.tensorParallelSize", 2), _set("resourcePools", [_pool("default", 2)])),
        "2 with backend 'fsdp'",
    ),
    "pipeline-parallel-needs-megatron": (
        _all(_set("training.pipelineParallelSize", 2), _set("resourcePools", [_pool("default", 2)])),
        "2 with backend 'fsdp'",
    ),
    "sequence-parallel-needs-fsdp": (
        _all(
            _set("training.backend", "megatron"),
            _set("training.sequenceParallelSize", 2),
            _set("rollout.engine", "torch"),
            _set("resourcePools", [_pool("default", 2)]),
        ),
        "2 with backend 'megatron'",
    ),
    "sequence-parallel-not-with-packing": (
        _all(
            _set("training.sequenceParallelSize", 2),
            _set("training.packSequences", True),
            _set("resourcePools", [_pool("default", 2)]),
        ),
        "2 with packSequences true",
    ),
    "sequence-parallel-not-with-compile": (
        _all(
            _set("training.sequenceParallelSize", 2),
            _set("training.compile", True),
            _set("resourcePools", [_pool("default", 2)]),
        ),
        "2 with compile true",
    ),
    "sequence-parallel-divides-policy-pools": (
        _all(
            _set("training.sequenceParallelSize", 2),
            _set("resourcePools", [_pool("default", 2), _pool("ref", 3)]),
            _set("roles.reference", "ref"),
        ),
        "2 with pool 'ref' of 3 GPUs",
    ),
    "sequence-parallel-without-critic": (
        _all(
            _PPO_WITH_CRITIC,
            _set("training.sequenceParallelSize", 2),
            _set("resourcePools", [_pool("default", 2)]),
        ),
        "2 with algorithm.name 'ppo' and a critic",
    ),
    "pool-names-unique": (
        _set("resourcePools", [_pool("default", 1), _pool("default", 1)]),
        "repeated: 'default'",
    ),
    "actor-pool-exists": (
        _all(_set("roles.actor", "gpu-a"), _set("roles.reference", "default")),
        "'gpu-a'; pools: 'default'",
    ),
    "rollout-pool-exists": (_set("roles.rollout", "gpu-b"), "'gpu-b'; pools: 'default'"),
    "reference-pool-exists": (_set("roles.reference", "gpu-b"), "'gpu-b'"),
    "critic-pool-exists": (_all(_PPO_WITH_CRITIC, _set("roles.critic", "gpu-b")), "'gpu-b'"),
    "reward-pool-exists": (
        _all(_set("models.reward", {"path": "/m/rm"}), _set("roles.reward", "gpu-b")),
        "'gpu-b'",
    ),
    "cost-pool-exists": (_all(_SAFE_RLHF, _set("roles.cost", "gpu-b")), "'gpu-b'"),
    "critic-role-needs-model": (_set("roles.critic", "default"), "'default' and no spec.models.critic"),
    "reward-role-needs-model": (_set("roles.reward", "default"), "no spec.models.reward"),
    "cost-role-needs-model": (_set("roles.cost", "default"), "no spec.models.cost"),
    "every-pool-hosts-a-role": (
        _set("resourcePools", [_pool("default", 1), _pool("spare", 1)]),
        "unused: 'spare'",
    ),
    "critic-required": (_set("algorithm.name", "ppo"), "no critic with algorithm.name 'ppo'"),
    "critic-unused": (_set("models.critic", {"path": "/m/critic"}), "a critic with algorithm.name 'grpo'"),
    "cost-required": (
        _all(_SAFE_RLHF, lambda spec: spec["models"].pop("cost")),
        "no cost model with algorithm.name 'safe-rlhf'",
    ),
    "cost-unused": (_set("models.cost", {"path": "/m/cost"}), "a cost model with algorithm.name 'grpo'"),
    "reward-source": (_set("rewards", []), "no reward functions and no reward model"),
    "training-fits-actor-pool": (
        _all(
            _set("training.backend", "megatron"),
            _set("training.tensorParallelSize", 2),
            _set("rollout.engine", "torch"),
        ),
        "2 * 1 = 2; pool 'default' has 1 GPU",
    ),
    "training-fits-critic-pool": (
        _all(
            _PPO_WITH_CRITIC,
            _set("resourcePools", [_pool("default", 2), _pool("critic", 1)]),
            _set("roles.critic", "critic"),
            _set("training.backend", "megatron"),
            _set("training.tensorParallelSize", 2),
            _set("rollout.engine", "torch"),
        ),
        "2 * 1 = 2; pool 'critic' has 1 GPU",
    ),
    "mini-batch-splits-over-actor-ranks": (
        _all(_set("resourcePools", [_pool("default", 4)]), _set("training.microBatchSizePerGpu", 4)),
        "8 with microBatchSizePerGpu 4 and data-parallel size 4 on pool 'default'",
    ),
    "mini-batch-splits-over-critic-ranks": (
        _all(
            _PPO_WITH_CRITIC,
            _set("resourcePools", [_pool("default", 1), _pool("critic", 4)]),
            _set("roles.critic", "critic"),
            _set("training.microBatchSizePerGpu", 4),
        ),
        "data-parallel size 4 on pool 'critic'",
    ),
    "step-splits-over-actor-ranks": (
        _all(
            _set("resourcePools", [_pool("default", 4)]),
            _set("training.microBatchSizePerGpu", 2),
            _set("training.promptsPerStep", 3),
        ),
        "3 prompts x 4 samples with microBatchSizePerGpu 2 and data-parallel size 4 on pool 'default'",
    ),
    "step-splits-over-critic-ranks": (
        _all(
            _PPO_WITH_CRITIC,
            _set("resourcePools", [_pool("default", 1), _pool("critic", 4)]),
            _set("roles.critic", "critic"),
            _set("training.microBatchSizePerGpu", 2),
            _set("training.promptsPerStep", 3),
        ),
        "data-parallel size 4 on pool 'critic'",
    ),
    "rollout-tensor-parallel-divides-training": (
        _all(
            _set("training.backend", "megatron"),
            _set("rollout.tensorParallelSize", 2),
            _set("rollout.engine", "torch"),
        ),
        "2 with training.tensorParallelSize 1",
    ),
    "rollout-pipeline-parallel-divides-training": (
        _all(
            _set("training.backend", "megatron"),
            _set("rollout.pipelineParallelSize", 2),
            _set("rollout.engine", "torch"),
        ),
        "2 with training.pipelineParallelSize 1",
    ),
    "rollout-tensor-parallel-needs-megatron": (
        _all(_set("rollout.tensorParallelSize", 2), _set("rollout.engine", "torch")),
        "2 with backend 'fsdp' and engine 'torch'",
    ),
    "rollout-pipeline-parallel-needs-megatron": (
        _all(_set("rollout.pipelineParallelSize", 2), _set("rollout.engine", "torch")),
        "2 with backend 'fsdp'",
    ),
    "vllm-generates-without-pipeline-parallel": (
        _all(
            _set("training.backend", "megatron"),
            _set("training.pipelineParallelSize", 2),
            _set("rollout.pipelineParallelSize", 2),
            _set("resourcePools", [_pool("default", 2)]),
        ),
        "2 with engine 'vllm'",
    ),
    "vllm-tensor-parallel-divides-actor-pool": (
        _all(_set("rollout.tensorParallelSize", 3), _set("resourcePools", [_pool("default", 2)])),
        "3 with [2] GPUs",
    ),
    "rollout-own-pool-holds-whole-model": (
        _all(
            _set("training.backend", "megatron"),
            _set("resourcePools", [_pool("default", 1), _pool("generate", 2)]),
            _set("roles.rollout", "generate"),
            _set("rollout.tensorParallelSize", 2),
        ),
        "rollout 2 * 1, training 1 * 1 with roles.rollout 'generate', engine 'vllm', mode 'batch'",
    ),
    "tool-loop-needs-tools": (_all(_SERVER, _set("agent.loop", "tools")), "[] with loop 'tools'"),
    "tool-response-has-a-result": (_set("agent.toolResponseFormat", "<tool>"), "'<tool>'"),
    "agent-tools-are-known": (_set("agent.tools", ["calculator", "shell"]), "['shell']"),
    "agent-loop-is-known": (_all(_SERVER, _set("agent.loop", "react")), "'react'"),
    "sandbox-group-name-is-free": (
        _all(
            _set("rollout.mode", "server"),
            _set("rollout.engine", "torch"),
            _set("resourcePools", [_pool("default", 1), _pool("sandbox", 2)]),
            _set("roles.rollout", "sandbox"),
            _set("agent.loop", "tools"),
            _set("agent.tools", ["python"]),
        ),
        "['default', 'sandbox']",
    ),
    "endpoint-loop-needs-a-runner": (
        _all(_SERVER, _set("agent.loop", "endpoint")),
        "None with loop 'endpoint'",
    ),
    "multi-turn-needs-server-mode": (
        _all(_set("agent.loop", "tools"), _set("agent.tools", ["calculator"])),
        "'tools' with rollout.mode 'batch'",
    ),
    "server-mode-replica-fits-a-node": (
        _all(
            _set("rollout.mode", "server"),
            _set("rollout.engine", "vllm"),
            _set("rollout.tensorParallelSize", 2),
            _set("resourcePools", [_pool("default", 1), _pool("generate", 3)]),
            _set("roles.rollout", "generate"),
        ),
        "2 with gpusPerNode [3]",
    ),
    "server-mode-decodes-eagerly": (
        _all(
            _set("rollout.mode", "server"),
            _set("rollout.engine", "torch"),
            _set("rollout.compile", True),
            _set("resourcePools", [_pool("default", 1), _pool("generate", 2)]),
            _set("roles.rollout", "generate"),
        ),
        "true with mode 'server'",
    ),
    "dynamic-sampling-needs-server-mode": (
        _set("rollout.dynamicSampling", {"enabled": True}),
        "true with mode 'batch'",
    ),
    "server-mode-needs-own-rollout-pool": (
        _all(_set("rollout.mode", "server"), _set("rollout.engine", "torch")),
        "'server' with roles.rollout None and roles.actor 'default'",
    ),
    "dynamic-sampling-needs-groups": (
        _all(
            _set("rollout.mode", "server"),
            _set("rollout.engine", "torch"),
            _set("rollout.dynamicSampling", {"enabled": True}),
            _set("algorithm.samplesPerPrompt", 1),
            _set("algorithm.name", "ppo"),
            _set("models.critic", {"path": "/models/critic"}),
            _set("resourcePools", [_pool("default", 1), _pool("generate", 2)]),
            _set("roles.rollout", "generate"),
        ),
        "true with samplesPerPrompt 1",
    ),
    "staleness-needs-own-rollout-pool": (
        _set("rollout.maxStaleness", 1),
        "1 with roles.rollout None and roles.actor 'default'",
    ),
    "importance-sampling-needs-temperature-one": (
        _all(_set("rollout.temperature", 0.7), _set("rollout.importanceSampling", {"mode": "on"})),
        "'on' with maxStaleness 0 and temperature 0.7",
    ),
    "mask-band-needs-a-mask-correction": (
        _set("rollout.importanceSampling.maskUpper", 1.5),
        "correction 'token-truncate' with maskLower None and maskUpper 1.5",
    ),
    "parameter-offload-needs-own-engine-weights": (
        _all(
            _set("rollout.engine", "torch"),
            _set("training.offloadDuringGeneration", {"parameters": True, "optimizerState": False}),
        ),
        "true with the torch engine on a one-GPU actor pool",
    ),
    "auto-placement-one-pool": (
        _all(_set("placement", "auto"), _set("resourcePools", [_pool("default", 1), _pool("spare", 1)])),
        "2 pools: 'default', 'spare'",
    ),
    "auto-placement-chooses-roles-and-sizes": (
        _all(_set("placement", "auto"), _set("roles.reference", "default")),
        "auto with roles.reference='default'",
    ),
    "lora-needs-fsdp": (
        _all(_set("training.backend", "megatron"), _set("training.lora", {"rank": 8})),
        "set with backend 'megatron'",
    ),
    "lora-reference-is-the-base": (
        _all(_set("training.lora", {"rank": 8}), _set("models.reference", {"path": "/models/other"})),
        "'/models/other' with training.lora set",
    ),
    "lora-rollout-whole-model": (
        _all(
            _set("training.lora", {"rank": 8}),
            _set("rollout.tensorParallelSize", 2),
            _set("resourcePools", [_pool("default", 2)]),
        ),
        "2 with training.lora set",
    ),
    "lora-vllm-server-aborts": (
        _all(_SERVER, _set("training.lora", {"rank": 8}), _set("rollout.engine", "vllm")),
        "'keep' with training.lora and engine 'vllm' in server mode",
    ),
    "export-kind-matches-lora": (
        _set("checkpoint.export", {"kind": "adapter"}),
        "'adapter' with training.lora unset",
    ),
    "volume-mount-paths-unique": (
        _set("volumes", [{"claimName": "a", "mountPath": "/m"}, {"claimName": "b", "mountPath": "/m"}]),
        "repeated: '/m'",
    ),
    "checkpoint-mount-path-free": (
        _all(
            _set("volumes", [{"claimName": "models", "mountPath": "/data"}]),
            _set("checkpoint.volume", {"claimName": "ckpt", "mountPath": "/data"}),
        ),
        "'/data'",
    ),
}

RULES_BY_NAME: dict[str, CrossFieldRule[Any]] = {rule.name: rule for rule in VALIDATION_RULES}


def broken_manifest(rule_name: str) -> Manifest:
    manifest = defaulted(minimal_manifest())
    mutate, _ = RULE_CASES[rule_name]
    mutate(manifest["spec"])
    return manifest


def test_rule_names_are_unique_and_every_rule_has_a_failing_case() -> None:
    assert len(RULES_BY_NAME) == len(VALIDATION_RULES)
    assert set(RULE_CASES) == set(RULES_BY_NAME)


@pytest.mark.parametrize("rule_name", sorted(RULE_CASES))
def test_each_rule_rejects_its_case_with_its_message(rule_name: str) -> None:
    rule = RULES_BY_NAME[rule_name]
    _, observed = RULE_CASES[rule_name]

    [problem] = spec_errors(broken_manifest(rule_name))

    assert problem.startswith(f"{rule.path}: {rule.message} (got "), problem
    assert observed in problem, problem


def test_every_problem_of_the_cross_field_rules_is_reported() -> None:
    manifest = defaulted(minimal_manifest())
    for rule_name in ("top-k-not-zero", "critic-required", "reward-source"):
        RULE_CASES[rule_name][0](manifest["spec"])
    problems = spec_errors(manifest)
    assert [problem.split(":")[0] for problem in problems] == [
        "spec.rollout.topK",
        "spec.models.critic",
        "spec.rewards",
    ]


# --------------------------------------------------------------------------- rules as CEL


def vllm_server_manifest() -> Manifest:
    """Server mode with vLLM replicas of two GPUs each (two replicas on one 4-GPU node), keeping responses."""
    manifest = minimal_manifest()
    manifest["spec"]["rollout"] = {
        "engine": "vllm",
        "mode": "server",
        "tensorParallelSize": 2,
        "onWeightUpdate": "keep",
        "maxStaleness": 2,
    }
    manifest["spec"]["agent"] = {"loop": "tools", "tools": ["calculator", "python", "my_tools.search:Search"]}
    manifest["spec"]["resourcePools"] = [
        {"name": "train", "gpusPerNode": 2},
        {"name": "generate", "gpusPerNode": 4},
    ]
    manifest["spec"]["roles"] = {"actor": "train", "rollout": "generate"}
    return manifest


def test_vllm_server_replicas_may_span_gpus_and_keep_responses() -> None:
    spec = parse_job_manifest(vllm_server_manifest(), "test").spec
    assert (spec.rollout.tensor_parallel_size, spec.rollout.on_weight_update) == (2, "keep")


def sequence_parallel_manifest() -> Manifest:
    """GRPO with a reference model on 4 GPUs in sequence-parallel pairs: 2 data-parallel ranks."""
    manifest = minimal_manifest()
    manifest["spec"]["training"].update(sequenceParallelSize=2, miniBatchSize=2)
    manifest["spec"]["resourcePools"] = [{"name": "default", "gpusPerNode": 4}]
    return manifest


def test_sequence_parallel_pairs_share_rows_in_the_mini_batch_rule() -> None:
    # 4 GPUs in pairs are 2 data-parallel ranks: a mini-batch of 2 splits into one row each.
    spec = parse_job_manifest(sequence_parallel_manifest(), "test").spec
    assert spec.training.sequence_parallel_size == 2
    manifest = sequence_parallel_manifest()
    manifest["spec"]["training"]["microBatchSizePerGpu"] = 2
    [problem] = spec_errors(manifest)
    assert problem.startswith("spec.training.miniBatchSize: ") and "data-parallel size 2" in problem, problem


def last_smaller_mini_batch_manifest() -> Manifest:
    """32 sequences per step in mini-batches of 12: two of 12, then a last one of 8, on 2 ranks."""
    manifest = minimal_manifest()
    manifest["spec"]["training"].update(miniBatchSize=12, microBatchSizePerGpu=2)
    manifest["spec"]["resourcePools"] = [{"name": "default", "gpusPerNode": 2}]
    return manifest


def test_a_mini_batch_that_does_not_divide_the_step_is_allowed() -> None:
    spec = parse_job_manifest(last_smaller_mini_batch_manifest(), "test").spec
    assert (
        spec.training.prompts_per_step * spec.algorithm.samples_per_prompt % spec.training.mini_batch_size
        == 8
    )


VALID_MANIFESTS: dict[str, Callable[[], Manifest]] = {
    "minimal": minimal_manifest,
    "last-smaller-mini-batch": last_smaller_mini_batch_manifest,
    "sequence-parallel": sequence_parallel_manifest,
    "vllm-server": vllm_server_manifest,
    "full": full_manifest,
    "safe-rlhf": safe_rlhf_manifest,
    "example": lambda: yaml.safe_load(EXAMPLE.read_text()),
}


def _node(manifest: Manifest, node_path: str) -> Any:
    node: Any = manifest
    for key in node_path.split("."):
        node = node[key]
    return node


def _cel_failures(manifest: Manifest) -> set[str]:
    """Names of the rules whose CEL expression is false on the (defaulted) manifest.

    The rules of an optional section the manifest leaves out (``spec.evaluation``) are not run,
    as on the API server."""
    celpy = pytest.importorskip("celpy", reason="install cel-python to check the CEL twin of each rule")
    environment = celpy.Environment()
    failures = set()
    for rule in VALIDATION_RULES:
        try:
            _node(manifest, rule.node_path)
        except KeyError:
            continue
        program = environment.program(environment.compile(rule.cel))
        verdict = program.evaluate({"self": celpy.json_to_cel(_node(manifest, rule.node_path))})
        assert isinstance(verdict, celpy.celtypes.BoolType), f"{rule.name}: CEL gave {verdict!r}"
        if not verdict:
            failures.add(rule.name)
    return failures


@pytest.mark.parametrize("name", sorted(VALID_MANIFESTS))
def test_cel_rules_accept_valid_manifests(name: str) -> None:
    assert _cel_failures(defaulted(VALID_MANIFESTS[name]())) == set()


@pytest.mark.parametrize("rule_name", sorted(RULE_CASES))
def test_cel_and_python_reject_the_same_case(rule_name: str) -> None:
    assert _cel_failures(broken_manifest(rule_name)) == {rule_name}


def _schema_node(schema: dict[str, Any], node: dict[str, Any], path: list[str]) -> dict[str, Any]:
    for key in path:
        while "$ref" in node or "anyOf" in node:
            if "$ref" in node:
                node = schema["$defs"][node["$ref"].split("/")[-1]]
            else:
                node = next(option for option in node["anyOf"] if option.get("type") != "null")
        node = node["properties"][key]
    return node


@pytest.mark.parametrize("rule", VALIDATION_RULES, ids=lambda rule: rule.name)
def test_rule_paths_exist_in_the_json_schema(rule: CrossFieldRule[Any]) -> None:
    schema = RLHFJob.model_json_schema(by_alias=True)
    node_keys = rule.node_path.split(".")
    field_keys = rule.field_path.removeprefix(".").split(".")
    _schema_node(schema, schema, node_keys + field_keys)
    assert rule.as_x_kubernetes_validation() == {
        "rule": rule.cel,
        "message": rule.message,
        "fieldPath": rule.field_path,
    }


# --------------------------------------------------------------------------- round trips and schema


@pytest.mark.parametrize("name", sorted(VALID_MANIFESTS))
def test_camel_case_round_trip(name: str) -> None:
    job = parse_job_manifest(VALID_MANIFESTS[name](), "test")
    assert parse_job_manifest(job.model_dump(by_alias=True), "dump") == job
    assert parse_job_manifest(yaml.safe_load(yaml.safe_dump(job.to_manifest())), "yaml") == job


def test_json_schema_uses_camel_case_and_enums() -> None:
    schema = RLHFJobSpec.model_json_schema(by_alias=True)
    training = schema["$defs"]["TrainingSpec"]["properties"]
    assert "microBatchSizePerGpu" in training and "micro_batch_size_per_gpu" not in training
    name_pattern = re.compile(schema["$defs"]["AlgorithmSpec"]["properties"]["name"]["pattern"])
    for name in ("ppo", "grpo", "remax", "safe-rlhf", "rloo", "reinforce++", "my_pkg.algos:train_step"):
        assert name_pattern.match(name), name
    assert not name_pattern.match("ppo2") and not name_pattern.match("pkg.mod")
    assert schema["properties"]["rollout"]["default"]["engine"] == "vllm"


def _models_reachable_from(model: type[BaseModel]) -> Iterator[type[BaseModel]]:
    seen: set[type[BaseModel]] = set()
    pending = [model]
    while pending:
        current = pending.pop()
        if current in seen:
            continue
        seen.add(current)
        yield current
        for field in current.model_fields.values():
            pending.extend(_nested_models(field.annotation))


def _nested_models(annotation: Any) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [model for arg in getattr(annotation, "__args__", ()) for model in _nested_models(arg)]


def test_every_field_has_a_description_for_kubectl_explain() -> None:
    models = list(_models_reachable_from(RLHFJob))
    assert len(models) >= 14
    undocumented = [
        f"{model.__name__}.{name}"
        for model in models
        for name, field in model.model_fields.items()
        if not (field.description and field.description.strip())
    ]
    assert undocumented == []
    assert all(model.__doc__ and model.__doc__.strip() for model in models)


def test_spec_imports_no_ml_or_operator_stack() -> None:
    """hybridflow.spec must load in the operator image: pydantic, PyYAML and the standard library only."""
    probe = (
        "import sys\n"
        "before = set(sys.modules)\n"
        "import hybridflow.spec\n"
        "print('\\n'.join(sorted({name.split('.')[0] for name in set(sys.modules) - before})))\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    loaded = set(result.stdout.split())
    assert loaded.isdisjoint({"torch", "ray", "vllm", "kopf", "kubernetes", "numpy", "transformers"})
    # Loaded by PyYAML's C extension: the Cython runtime and the interpreter's build config.
    loaded = {
        name for name in loaded if not name.startswith(("_cython_", "cython_runtime", "_sysconfigdata_"))
    }
    allowed = set(sys.stdlib_module_names) | {
        "hybridflow",
        "pydantic",
        "pydantic_core",
        "annotated_types",
        "typing_extensions",
        "typing_inspection",
        "yaml",
        "_yaml",
    }
    assert loaded <= allowed, f"hybridflow.spec imported {sorted(loaded - allowed)}"


@pytest.mark.parametrize("example", sorted((REPO_ROOT / "examples").glob("*.yaml")), ids=lambda p: p.name)
def test_every_example_is_a_valid_rlhfjob(example: Path) -> None:
    job = load_job_manifest(example)
    assert job.metadata.name == example.stem
