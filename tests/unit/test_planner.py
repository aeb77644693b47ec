"""The placement planner: the paper's three placement insights on paper-scale inputs, and the plumbing.

Paper-scale inputs are the HybridFlow evaluation's (Sec. 8): Llama-2 7B-70B actor, critic and
reward model of the same size, 1024 prompts of 1024 tokens with 1024-token responses, 16-128
A100-80GB GPUs in machines of 8. Everything here is arithmetic: no torch, no Ray.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

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
from hybridflow.planner.cost import (
    OPTIMIZER_BYTES_PER_PARAMETER,
    forward_collectives,
    forward_seconds,
    fsdp_unit_count,
    generation_estimate,
    optimizer_steps,
    reshard_bytes,
    train_collectives,
    train_seconds,
)
from hybridflow.planner.hardware import DeviceConstants
from hybridflow.planner.job import apply_plan, resolve_auto_placement, workload_from_spec
from hybridflow.planner.parallel import generation_tensor_sizes, training_layouts
from hybridflow.planner.shapes import ModelShape
from hybridflow.resharding import DecoderSpec, hybridflow_plan
from hybridflow.resharding.fsdp import fsdp_generation_plan, strided_tp_ranks
from hybridflow.spec import RLHFJobSpec, parse_job_manifest
from hybridflow.spec.training import DEFAULT_FSDP_UNIT_MIN_PARAMETERS

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


def small_model(arch: str, *, vocab_size: int, num_layers: int, qkv_bias: bool) -> ModelShape:
    """A tiny decoder (hidden 32, 4 heads of 8) whose resharding plans list every piece cheaply."""
    decoder = DecoderSpec(
        arch=arch,
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_layers=num_layers,
        num_heads=4,
        num_kv_heads=4,
        head_dim=8,
        rms_norm_eps=1e-5,
        rope_theta=1e4,
        max_position_embeddings=64,
        qkv_bias=qkv_bias,
    )
    return ModelShape("small", decoder)


def test_reshard_bytes_equal_the_bytes_the_transition_plan_sends() -> None:
    model = small_model("llama", vocab_size=64, num_layers=4, qkv_bias=False)
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


def test_generation_sizes_follow_the_engine_and_the_spec_rules(tmp_path: Path) -> None:
    """Megatron reshards to every ``t_g | t`` on both engines; FSDP to ``t_g`` 1 on torch, any on vLLM."""
    model = PAPER_MODELS["llama-7b"]
    megatron = Workload(actor=model, sequences=64, prompt_tokens=256, response_tokens=256)
    vllm = replace(megatron, rollout_engine="vllm")
    t4 = ModelLayoutChoice(2, 4, 2)
    assert generation_tensor_sizes(model, t4, 8, megatron) == [1, 2, 4]
    # vLLM builds its TP groups from the 3D-HybridEngine's strided generation groups.
    assert generation_tensor_sizes(model, t4, 8, vllm) == [1, 2, 4]
    # vLLM plans model-parallel training too.
    plans = plan_job(replace(vllm, critic=model), ClusterShape(16, 8), A100_80GB)
    actors = {plan.layout_of("actor") for plan in plans}
    assert any(a.tp * a.pp > 1 for a in actors)
    assert all(a.tp % a.generation_tp == 0 for a in actors)
    assert any(a.tp > 1 and a.generation_tp == a.tp for a in actors)
    # FSDP on vLLM: any t_g that divides the pool and the node; the torch engine stays at 1.
    fsdp = replace(vllm, backend="fsdp")
    assert generation_tensor_sizes(model, ModelLayoutChoice(1, 1, 16), 8, fsdp) == [1, 2, 4, 8]
    assert generation_tensor_sizes(
        model, ModelLayoutChoice(1, 1, 16), 8, replace(fsdp, rollout_engine="torch")
    ) == [1]
    # On a job spec: a 7B actor and critic on one node of 8 with vLLM. Decoding reads every
    # weight of its shard per token, so the best plan generates at t_g = t > 1; every plan the
    # search returns passes the spec's vLLM rules (apply_plan validates the spec it writes).
    llama = tmp_path / "llama-7b"
    llama.mkdir()
    d = model.decoder
    config = {
        "model_type": "llama",
        "vocab_size": d.vocab_size,
        "hidden_size": d.hidden_size,
        "intermediate_size": d.intermediate_size,
        "num_hidden_layers": d.num_layers,
        "num_attention_heads": d.num_heads,
        "num_key_value_heads": d.num_kv_heads,
        "rms_norm_eps": d.rms_norm_eps,
        "rope_theta": d.rope_theta,
        "max_position_embeddings": d.max_position_embeddings,
        "tie_word_embeddings": False,
    }
    (llama / "config.json").write_text(json.dumps(config))
    spec = _tiny_manifest(
        tmp_path,
        models={"actor": {"path": str(llama)}, "critic": {"path": str(llama)}},
        rollout={"engine": "vllm", "maxResponseTokens": 512},
        training={
            "backend": "megatron",
            "precision": "bf16",
            "totalSteps": 2,
            "promptsPerStep": 64,
            "miniBatchSize": 32,
            "microBatchSizePerGpu": 4,
        },
        resourcePools=[{"name": "gpus", "nodes": 1, "gpusPerNode": 8}],
    )
    workload = workload_from_spec(spec)
    assert workload.rollout_engine == "vllm"
    plans = plan_job(workload, ClusterShape(8, 8), A100_80GB)
    for plan in plans:
        actor = plan.layout_of("actor")
        placed = apply_plan(spec, plan)
        assert placed.training.tensor_parallel_size == actor.tp
        assert placed.rollout.tensor_parallel_size == actor.generation_tp
        assert actor.tp % actor.generation_tp == 0
    best = plans[0].layout_of("actor")
    assert best.tp > 1 and best.generation_tp == best.tp, plans[0].placement.describe()


@pytest.mark.parametrize("world, t_g", [(4, 1), (4, 2), (8, 2), (4, 4), (6, 2)])
def test_fsdp_reshard_bytes_equal_the_bytes_the_fsdp_plan_sends(world: int, t_g: int) -> None:
    model = small_model("qwen2", vocab_size=96, num_layers=2, qkv_bias=True)
    workload = Workload(
        actor=model, sequences=8, prompt_tokens=8, response_tokens=8, param_bytes=4, backend="fsdp"
    )
    plan = fsdp_generation_plan(model.layout(4), world, t_g, strided_tp_ranks(world, t_g))
    received = max(plan.bytes_received(rank) for rank in range(world))
    assert reshard_bytes(model, ModelLayoutChoice(1, 1, world, t_g), workload) == received


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
        # The paper's GPU, whatever this machine has (tests/unit/test_gpu_devices.py: the default).
        code = main(["plan", str(manifest), "--gpu-type", "A100-80GB", *args])
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
    assert "with miniBatchSize 16 and the step's" in err and "in whole micro-batches of 8" in err


def test_simulated_gpu_terms_price_threads_contention_and_oversubscribed_collectives() -> None:
    cpu = replace(
        A100_80GB,
        compute_slots=2.0,
        collective_latency_seconds=1e-3,
        oversubscribed_collective_latencies=((2.0, 5e-3), (4.0, 9e-3)),
        host_cores=2,
        all_cores_speedup=1.5,
        fsdp_unit_overhead_seconds=1e-3,
        shared_decode_step_overhead_seconds=2e-3,
        optimizer_step_overhead_seconds=5e-3,
    )
    # A 1-GPU job's worker has both cores' threads; from 2 GPUs on, one thread each. The
    # speedup is a whole step's: the rate rises by it and every fixed cost falls by it.
    one_gpu = cpu.for_budget(1)
    assert one_gpu.peak_flops == pytest.approx(1.5 * cpu.peak_flops)
    for fixed in (
        "call_overhead_seconds",
        "decode_step_overhead_seconds",
        "fsdp_unit_overhead_seconds",
        "shared_decode_step_overhead_seconds",
        "optimizer_step_overhead_seconds",
    ):
        assert getattr(one_gpu, fixed) == pytest.approx(getattr(cpu, fixed) / 1.5), fixed
    assert one_gpu.collective_latency_seconds == cpu.collective_latency_seconds
    assert cpu.for_budget(2).peak_flops == cpu.peak_flops == cpu.for_budget(4).peak_flops
    assert A100_80GB.for_budget(1) == A100_80GB
    # Contention and collective latency follow the busy workers per compute slot.
    assert [cpu.contention(busy) for busy in (1, 2, 4)] == [1.0, 1.0, 2.0]
    assert [cpu.collective_latency(busy) for busy in (2, 3, 4, 6, 8, 16)] == pytest.approx(
        [1e-3, 3e-3, 5e-3, 7e-3, 9e-3, 9e-3]
    )
    assert A100_80GB.collective_latency(1000) == A100_80GB.collective_latency_seconds


def test_fsdp_per_unit_work_and_shared_module_decoding_are_counted() -> None:
    model = PAPER_MODELS["llama-7b"]
    fsdp = Workload(
        actor=model,
        sequences=64,
        prompt_tokens=64,
        response_tokens=32,
        backend="fsdp",
        micro_batch_sequences=8,
    )
    units = model.decoder.num_layers + 1
    bare = replace(A100_80GB, training_pass_ratio=4.0)
    wrapped = replace(bare, fsdp_unit_overhead_seconds=1e-3)
    one_rank = ModelLayoutChoice(1, 1, 1, 1)
    micro = 64 // 8
    # Every forward micro-batch runs FSDP's work on each unit, on one rank too; training r times it.
    assert forward_seconds(model, one_rank, fsdp, wrapped) - forward_seconds(
        model, one_rank, fsdp, bare
    ) == pytest.approx(micro * units * 1e-3)
    assert train_seconds(model, one_rank, fsdp, wrapped, 8) - train_seconds(
        model, one_rank, fsdp, bare, 8
    ) == pytest.approx(4.0 * micro * units * 1e-3)
    # The one-rank actor's torch engine decodes from the wrapped module: each step pays the extra.
    shared = replace(bare, shared_decode_step_overhead_seconds=2e-3)

    def generation(device: DeviceConstants, layout: ModelLayoutChoice, workload: Workload) -> float:
        estimate = generation_estimate(model, layout, workload, device, kv_budget_bytes_per_gpu=70e9)
        assert estimate is not None
        return estimate.seconds

    assert generation(shared, one_rank, fsdp) - generation(bare, one_rank, fsdp) == pytest.approx(32 * 2e-3)
    two_ranks = ModelLayoutChoice(1, 1, 2, 1)
    assert generation(shared, two_ranks, fsdp) == generation(bare, two_ranks, fsdp)
    assert generation(shared, one_rank, replace(fsdp, rollout_engine="vllm")) == generation(
        bare, one_rank, replace(fsdp, rollout_engine="vllm")
    )


@pytest.mark.parametrize("bucket_bytes", [40_000, 100_000, 64 << 20])
def test_weight_sync_gathers_are_the_buckets_the_fsdp_sync_forms(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, bucket_bytes: int
) -> None:
    """The planner counts one gather per bucket as ``iter_full_weight_buckets`` forms them."""
    import torch

    from hybridflow.backends.fsdp.weights import iter_full_weight_buckets
    from hybridflow.models.tiny import build_tiny_model, write_tiny_model
    from hybridflow.planner import cost
    from hybridflow.planner.shapes import model_shape_from_dir
    from hybridflow.workers.weight_push import WEIGHT_BUCKET_BYTES

    assert cost.WEIGHT_SYNC_BUCKET_BYTES == WEIGHT_BUCKET_BYTES
    sizes = {"hidden": 64, "heads": 2, "layers": 3, "intermediate": 128}
    directory = write_tiny_model(tmp_path / "qwen2", "qwen2", seed=0, vocab_size=384, **sizes)
    model = build_tiny_model("qwen2", 384, seed=0, **sizes).to(torch.float32)
    expected = sum(1 for _ in iter_full_weight_buckets(model, bucket_bytes=bucket_bytes))
    monkeypatch.setattr(cost, "WEIGHT_SYNC_BUCKET_BYTES", bucket_bytes)
    shape = model_shape_from_dir(directory, field="model")
    workload = Workload(
        actor=shape, sequences=8, prompt_tokens=8, response_tokens=8, param_bytes=4, backend="fsdp"
    )
    assert cost.reshard_collectives(shape, ModelLayoutChoice(1, 1, 2, 1), workload) == expected
    assert expected > 1 or bucket_bytes == 64 << 20


def small_fsdp_workload(model: ModelShape, **fields: Any) -> Workload:
    """A step of 8-token prompts and responses on the FSDP backend; ``fields`` set the rest."""
    return Workload(actor=model, prompt_tokens=8, response_tokens=8, backend="fsdp", **fields)


def test_fsdp_collectives_follow_the_unit_grouping() -> None:
    """Per-layer units: L + 1 collectives per pass; the tiny model at the default minimum: the root only."""
    model = small_model("qwen2", vocab_size=64, num_layers=3, qkv_bias=True)
    per_layer = small_fsdp_workload(model, sequences=8, fsdp_unit_min_parameters=0)
    grouped = replace(per_layer, fsdp_unit_min_parameters=DEFAULT_FSDP_UNIT_MIN_PARAMETERS)
    two_layer_units = replace(per_layer, fsdp_unit_min_parameters=2 * model.layer_params)
    layout = ModelLayoutChoice(pp=1, tp=1, dp=2, generation_tp=1)
    assert fsdp_unit_count(model, per_layer) == model.decoder.num_layers + 1
    assert fsdp_unit_count(model, grouped) == 1
    assert fsdp_unit_count(model, two_layer_units) == 2  # layers 0-1, then layer 2 joins the root
    assert forward_collectives(model, layout, per_layer) == (
        model.decoder.num_layers + 1
    ) * forward_collectives(model, layout, grouped)


def test_optimizer_steps_cost_their_fixed_work_traffic_and_norm_all_reduce() -> None:
    """One optimizer step per mini-batch and epoch: fixed cost, AdamW's traffic over the shard, and
    on several ranks the gradient norm's all-reduce."""
    model = small_model("qwen2", vocab_size=64, num_layers=3, qkv_bias=True)
    workload = small_fsdp_workload(
        model, sequences=64, micro_batch_sequences=8, mini_batch_sequences=32, update_epochs=2
    )
    assert optimizer_steps(workload) == 4  # 2 mini-batches x 2 epochs
    assert optimizer_steps(replace(workload, mini_batch_sequences=None)) == 2
    bare = replace(A100_80GB, optimizer_step_overhead_seconds=0.0)
    stepping = replace(bare, optimizer_step_overhead_seconds=5e-3)
    for dp in (1, 4):
        layout = ModelLayoutChoice(1, 1, dp, 1)
        fixed = train_seconds(model, layout, workload, stepping, 8) - train_seconds(
            model, layout, workload, bare, 8
        )
        assert fixed == pytest.approx(4 * 5e-3)
    # The traffic: 28 bytes per parameter of the shard, at the memory bandwidth.
    slow_memory = replace(bare, memory_bandwidth_bytes_per_second=bare.memory_bandwidth_bytes_per_second / 2)
    one, four = ModelLayoutChoice(1, 1, 1, 1), ModelLayoutChoice(1, 1, 4, 1)
    for layout in (one, four):
        traffic = OPTIMIZER_BYTES_PER_PARAMETER * model.params / layout.world_size
        extra = train_seconds(model, layout, workload, slow_memory, 8) - train_seconds(
            model, layout, workload, bare, 8
        )
        assert extra == pytest.approx(4 * traffic / bare.memory_bandwidth_bytes_per_second)
    # The norm's all-reduce joins the latency-bound collectives on more than one rank only:
    # 2 epochs x 2 micro-batches per rank x 3 passes x the FSDP units, then one per optimizer step.
    assert train_collectives(model, four, workload) == 2 * 2 * 3 * fsdp_unit_count(model, workload) + 4
    assert train_collectives(model, one, workload) == 0
