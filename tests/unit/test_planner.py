"""The placement planner: the paper's three placement insights on paper-scale inputs, and the plumbing.

Paper-scale inputs are the HybridFlow evaluation's (Sec. 8): Llama-2 7B-70B actor, critic and
reward model of the same size, 1024 prompts of 1024 tokens with 1024-token responses, 16-128
A100-80GB GPUs in machines of 8. Everything here is arithmetic: no torch, no Ray.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from hybridflow.cli import main
from hybridflow.controller.mesh import DeviceMesh
from hybridflow.planner import (
    A100_80GB,
    PAPER_MODELS,
    ClusterShape,
    ModelLayoutChoice,
    Plan,
    PlannerInputError,
    Workload,
    placements,
    plan_job,
)
from hybridflow.planner.cost import generation_estimate, reshard_bytes
from hybridflow.planner.job import apply_plan, resolve_auto_placement, workload_from_spec
from hybridflow.planner.parallel import training_layouts
from hybridflow.resharding import DecoderSpec, hybridflow_plan
from hybridflow.spec import RLHFJobSpec, parse_job_manifest

pytestmark = pytest.mark.unit


def paper_workload(size: str) -> Workload:
    model = PAPER_MODELS[size]
    return Workload(
        actor=model, critic=model, reward=model, sequences=1024, prompt_tokens=1024, response_tokens=1024
    )


def best_of(plans: list[Plan], kind: str) -> Plan:
    return next(plan for plan in plans if plan.placement.kind == kind)


@pytest.mark.parametrize("size", ["llama-7b", "llama-13b"])
def test_insight_colocating_everything_wins_on_a_small_cluster(size: str) -> None:
    plans = plan_job(paper_workload(size), ClusterShape(16, 8), A100_80GB)
    assert plans[0].placement.kind == "colocate"
    assert plans[0].step_seconds < best_of(plans, "split").step_seconds


@pytest.mark.parametrize("size", ["llama-34b", "llama-70b"])
def test_insight_splitting_actor_and_critic_wins_at_large_scale(size: str) -> None:
    plans = plan_job(paper_workload(size), ClusterShape(128, 8), A100_80GB)
    assert plans[0].placement.kind == "split"
    split, colocate = best_of(plans, "split"), best_of(plans, "colocate")
    assert split.step_seconds < colocate.step_seconds
    # Split pools run the critic side's scoring and training beside the actor's.
    assert split.phase_seconds["train"] < colocate.phase_seconds["train"]


def test_insight_more_gpus_for_the_actor_shorten_the_critical_path() -> None:
    """In a split placement the actor's pool carries generation, the critical path of the step."""
    plans = plan_job(paper_workload("llama-13b"), ClusterShape(64, 8), A100_80GB, kinds=("split",))
    by_actor_gpus = {plan.pools[0].gpus: plan for plan in plans}
    generation = [by_actor_gpus[g].phase_seconds["generate"] for g in (16, 24, 32, 40, 48)]
    assert generation == sorted(generation, reverse=True) and len(set(generation)) == 5
    best = plans[0]
    assert best.pools[0].gpus >= best.pools[1].gpus
    standalone = plan_job(
        paper_workload("llama-13b"), ClusterShape(128, 8), A100_80GB, kinds=("standalone",)
    )[0]
    actor_gpus = standalone.pools[standalone.pool_index_of("actor")].gpus
    assert actor_gpus == max(pool.gpus for pool in standalone.pools)


def test_reshard_bytes_equal_the_bytes_the_transition_plan_sends() -> None:
    decoder = DecoderSpec(
        arch="llama",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_layers=4,
        num_heads=4,
        num_kv_heads=4,
        head_dim=8,
        rms_norm_eps=1e-5,
        rope_theta=1e4,
        max_position_embeddings=64,
        qkv_bias=False,
    )
    model = PAPER_MODELS["llama-7b"].__class__("small", decoder)
    workload = Workload(actor=model, sequences=8, prompt_tokens=8, response_tokens=8, param_bytes=4)
    for pp, tp, dp, t_g in [(1, 4, 2, 2), (1, 4, 2, 1), (2, 2, 2, 1), (1, 2, 4, 2)]:
        train = DeviceMesh.training(pp * tp * dp, pp=pp, tp=tp)
        plan = hybridflow_plan(model.layout(4), train, DeviceMesh.generation(train, pp=1, tp=t_g))
        received = max(plan.bytes_received(rank).total for rank in range(train.world_size))
        assert reshard_bytes(model, ModelLayoutChoice(pp, tp, dp, t_g), workload) == received, (
            pp,
            tp,
            dp,
            t_g,
        )


def test_training_layouts_obey_the_model_split_and_the_node() -> None:
    workload = paper_workload("llama-70b")
    layouts = training_layouts(PAPER_MODELS["llama-70b"], 32, 8, workload)
    assert layouts and all(c.tp <= 8 and 8 % c.tp == 0 and 80 % c.pp == 0 for c in layouts)
    assert all(c.world_size == 32 for c in layouts)
    fsdp = Workload(
        actor=PAPER_MODELS["llama-7b"], sequences=8, prompt_tokens=8, response_tokens=8, backend="fsdp"
    )
    assert training_layouts(PAPER_MODELS["llama-7b"], 16, 8, fsdp) == (ModelLayoutChoice(1, 1, 16),)
    # megatron with a vllm rollout: no 3D-HybridEngine, so data parallelism only (the spec's rule)
    vllm = replace(fsdp, backend="megatron", model_parallel_training=False)
    assert training_layouts(PAPER_MODELS["llama-7b"], 16, 8, vllm) == (ModelLayoutChoice(1, 1, 16),)


def test_generation_is_infeasible_when_no_sequence_fits_the_kv_budget() -> None:
    workload = paper_workload("llama-7b")
    layout = ModelLayoutChoice(1, 1, 8, 1)
    assert (
        generation_estimate(
            PAPER_MODELS["llama-7b"], layout, workload, A100_80GB, kv_budget_bytes_per_gpu=14e9
        )
        is None
    )
    roomy = generation_estimate(
        PAPER_MODELS["llama-7b"], layout, workload, A100_80GB, kv_budget_bytes_per_gpu=70e9
    )
    assert roomy is not None and roomy.waves >= 1 and roomy.kv_bytes_per_gpu <= 70e9


def test_placements_cut_pools_at_node_boundaries() -> None:
    for placement in placements(paper_workload("llama-7b"), ClusterShape(32, 8)):
        sizes = [gpus for _, gpus in placement.pools]
        assert sum(sizes) == 32
        assert all(gpus % 8 == 0 for gpus in sizes if gpus > 8)
    kinds = {p.placement.kind for p in plan_job(paper_workload("llama-7b"), ClusterShape(32, 8), A100_80GB)}
    assert kinds == {"colocate", "split", "standalone"}


def test_nothing_fits_is_a_clear_error() -> None:
    with pytest.raises(
        PlannerInputError, match="no placement of actor, reference, critic, reward fits 16 GPUs"
    ):
        plan_job(paper_workload("llama-70b"), ClusterShape(16, 8), A100_80GB)
    with pytest.raises(PlannerInputError, match="--gpus 12 is not a whole number of nodes"):
        ClusterShape(12, 8)


def _tiny_manifest(tmp_path: Path, **spec_updates: object) -> RLHFJobSpec:
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    config = {
        "model_type": "qwen2",
        "vocab_size": 384,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "max_position_embeddings": 512,
        "tie_word_embeddings": False,
    }
    (model / "config.json").write_text(json.dumps(config))
    spec = {
        "models": {"actor": {"path": str(model)}, "critic": {"path": str(model)}},
        "data": {"trainFiles": ["/data/x.jsonl"], "maxPromptTokens": 64},
        "algorithm": {"name": "ppo"},
        "rollout": {"maxResponseTokens": 32},
        "training": {"totalSteps": 2, "promptsPerStep": 32, "miniBatchSize": 16, "microBatchSizePerGpu": 8},
        "rewards": [{"function": "target_char"}],
        "resourcePools": [{"name": "gpus", "nodes": 1, "gpusPerNode": 4, "nodeSelector": {"pool": "a"}}],
        "roles": {"actor": "gpus"},
        "placement": "auto",
        **spec_updates,
    }
    return parse_job_manifest(
        {"apiVersion": "hybridflow.io/v1alpha1", "kind": "RLHFJob", "metadata": {"name": "t"}, "spec": spec},
        source="test",
    ).spec


def test_auto_placement_writes_the_best_plan_into_a_valid_spec(tmp_path: Path) -> None:
    spec = _tiny_manifest(tmp_path)
    resolved, plan = resolve_auto_placement(spec, A100_80GB)
    assert resolved.placement == "manual"
    assert sum(pool.world_size for pool in resolved.resource_pools) == 4
    assert all(pool.node_selector == {"pool": "a"} for pool in resolved.resource_pools)
    for pool in plan.pools:
        for role in pool.roles:
            assert resolved.pool(role).world_size == pool.gpus
    # Every data-parallel rank of the trained models gets whole micro-batches.
    for role in ("actor", "critic"):
        assert 16 % (8 * resolved.pool(role).world_size) == 0
    standalone = plan_job(workload_from_spec(spec), ClusterShape(4, 4), A100_80GB, kinds=("standalone",))[0]
    placed = apply_plan(spec, standalone)
    assert {pool.name for pool in placed.resource_pools} == {
        f"gpus-{r}" for r in ("actor", "reference", "critic")
    }
    assert placed.roles.reference == "gpus-reference" and placed.roles.critic == "gpus-critic"


def test_plan_command_prints_ranked_plans_and_names_bad_input(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = _tiny_manifest(tmp_path)
    manifest = tmp_path / "job.yaml"
    document = {
        "apiVersion": "hybridflow.io/v1alpha1",
        "kind": "RLHFJob",
        "metadata": {"name": "t"},
        "spec": spec.model_dump(mode="json", by_alias=True, exclude_none=True),
    }
    manifest.write_text(yaml.safe_dump(document))

    def plan(*args: str) -> tuple[int, str, str]:
        code = main(["plan", str(manifest), *args])
        out, err = capsys.readouterr()
        return code, out, err

    code, out, err = plan("--gpus", "4", "--gpus-per-node", "2")
    assert code == 0, err
    assert "budget: 4 GPU(s), 2 per node" in out
    assert "  1  split" in out and "actor+reference:2" in out and "critic:2" in out
    code, _, err = plan("--gpus", "3", "--gpus-per-node", "2")
    assert code == 2
    assert "--gpus 3 is not a whole number of nodes of --gpus-per-node 2" in err
    code, _, err = plan("--gpus", "16", "--gpus-per-node", "8")
    assert code == 2
    assert "with miniBatchSize 16 in whole micro-batches of 8" in err
