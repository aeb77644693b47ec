"""The 3D-HybridEngine in real Ray worker groups: megatron actor p1 t2 d2, rollout t_g 1.

Two GRPO steps through ``grpo.train_step`` and a greedy check against HF, then one PPO step
(megatron critic too) through ``run_training`` with its checkpoint.

The scenario (``hybrid_engine_scenario.py``) runs in its own process with its own embedded Ray,
whose worker processes apply the megatron CPU shim (``tests/megatron_shim.py``) through Ray's
``worker_process_setup_hook``: neither the shim nor that Ray touch this pytest process. On a
GPU machine the same worker code runs without the shim.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.integration

HERE = Path(__file__).resolve().parent
TESTS_DIR = HERE.parent


@pytest.fixture(scope="module")
def scenario(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    pytest.importorskip("megatron.core")
    work = tmp_path_factory.mktemp("hybrid-engine")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            [str(TESTS_DIR), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
        ),
        "RAY_AUTH_MODE": "disabled",
        "HF_HUB_OFFLINE": "1",
        "PYTHONUNBUFFERED": "1",
    }
    done = subprocess.run(
        [sys.executable, str(HERE / "hybrid_engine_scenario.py"), str(work), "1"],
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    result: dict[str, Any] = json.loads((work / "result.json").read_text())
    result["work"] = str(work)
    return result


def expected_bytes_received(model_dir: Path, figure: str = "bytes_received") -> list[int]:
    """What the plan says each rank receives (or holds for training) for p1 t2 d2 -> t_g 1 (pure, no processes)."""
    from transformers import AutoConfig

    from hybridflow.controller import DeviceMesh
    from hybridflow.resharding import DecoderSpec, decoder_layout, hybridflow_plan

    train = DeviceMesh.training(4, pp=1, tp=2)
    plan = hybridflow_plan(
        decoder_layout(DecoderSpec.from_hf_config(AutoConfig.from_pretrained(model_dir))),
        train,
        DeviceMesh.generation(train, pp=1, tp=1),
    )
    return [getattr(plan, figure)(rank).total for rank in range(4)]


def test_grpo_steps_run_on_the_hybrid_engine_and_generation_matches_hf(scenario: dict[str, Any]) -> None:
    assert scenario["meshes"] == {
        "actor": "pp=1 tp=2 dp=2 (4 ranks)",
        "rollout": "pp=1 tp=1 dp=4 (4 ranks)",
        "reference": "pp=1 tp=2 dp=2 (4 ranks)",
    }
    steps = scenario["steps"]
    assert len(steps) == 2
    expected = expected_bytes_received(Path(scenario["work"]) / "model")
    assert min(expected) > 0
    # The actor hands over views of its megatron parameters (one key/value group per TP rank:
    # q/k/v are back-to-back rows of linear_qkv), so no byte of its shard is a copy (measured by
    # storage pointer) and the engine holds nothing it does not read.
    training = expected_bytes_received(Path(scenario["work"]) / "model", "training_bytes")
    for metrics in steps:
        assert metrics["reshard/seconds"] > 0
        assert metrics["reshard/bytes_received_per_rank"] == max(expected)
        assert metrics["reshard/bytes_sent_per_rank"] == max(expected)  # micro-DP pairs swap halves
        assert metrics["reshard/redundant_bytes_per_rank"] == 0
        assert metrics["reshard/peak_memory_bytes_per_rank"] >= 0
        assert [metrics[f"reshard/rank{rank}/bytes_received"] for rank in range(4)] == expected
        assert metrics["actor/grad_norm"] > 0
    # The last transition, rank by rank: the planned bytes, and to_training freed exactly them.
    transition = scenario["transition"]
    assert [int(stats["bytes_received"]) for stats in transition] == expected
    assert [int(stats["freed_bytes"]) for stats in transition] == expected
    assert [int(stats["packed_copy_bytes"]) for stats in transition] == [0] * 4
    # Held while generating: the rank's own training bytes (in place) and the received ones.
    assert [int(stats["held_bytes"]) for stats in transition] == [
        own + received for own, received in zip(training, expected, strict=True)
    ]
    # The actor trained (so the comparison below is with the updated policy, not the initial one)
    # and greedy generation after resharding equals HF generate on the gathered full weights.
    assert scenario["max_weight_change"] > 0
    assert scenario["engine_greedy"] == scenario["hf_greedy"]


def test_ppo_through_run_training_reports_reshard_metrics_and_checkpoints(scenario: dict[str, Any]) -> None:
    (step,) = scenario["run_training"]
    assert step["step"] == 1
    assert "critic/value_loss" in step and "actor/policy_loss" in step
    assert step["reshard/seconds"] > 0
    assert step["reshard/bytes_received_per_rank"] == max(
        expected_bytes_received(Path(scenario["work"]) / "model")
    )
    assert {"step_000001", "actor", "critic"} <= set(scenario["checkpoints"])
    # Parameters offloaded during generation: the engine generated from a copy of the rank's own
    # blocks, which duplicates nothing on the device while the originals are away.
    assert step["offload/bytes_per_rank"] > 0
    assert step["reshard/redundant_bytes_per_rank"] == 0


def job_spec(example: str = "grpo-tiny.yaml", **training: Any) -> Any:
    import yaml

    from hybridflow.spec.manifest import parse_job_manifest

    doc = yaml.safe_load((TESTS_DIR.parent / "examples" / example).read_text())
    doc["spec"]["training"].update(training)
    doc["spec"]["resourcePools"][0]["gpusPerNode"] = 4
    return parse_job_manifest(doc, "test").spec


def test_roles_follow_the_training_backend() -> None:
    pytest.importorskip("megatron.core")
    from hybridflow.trainer.roles import job_roles
    from hybridflow.workers.hybrid_rollout import HybridRolloutWorker
    from hybridflow.workers.policy import ActorWorker, ReferenceWorker
    from hybridflow.workers.rollout import RolloutWorker
    from hybridflow.workers.value import CriticWorker

    fsdp = job_roles(job_spec())
    assert fsdp["actor"].worker_cls is ActorWorker and fsdp["actor"].mesh is None
    assert fsdp["rollout"].worker_cls is RolloutWorker
    roles = job_roles(job_spec(backend="megatron", tensorParallelSize=2))
    assert roles["actor"].worker_cls is ActorWorker
    assert roles["reference"].worker_cls is ReferenceWorker
    assert roles["rollout"].worker_cls is HybridRolloutWorker
    actor_mesh, rollout_mesh = roles["actor"].mesh, roles["rollout"].mesh
    assert actor_mesh is not None and rollout_mesh is not None
    assert (actor_mesh.pp_size, actor_mesh.tp_size, actor_mesh.dp_size) == (1, 2, 2)
    assert (rollout_mesh.pp_size, rollout_mesh.tp_size, rollout_mesh.dp_size) == (1, 1, 4)
    assert "critic" not in roles  # GRPO
    ppo = job_roles(job_spec("ppo-tiny.yaml", backend="megatron", tensorParallelSize=2))
    assert ppo["critic"].worker_cls is CriticWorker and ppo["critic"].mesh == actor_mesh
    plain = job_roles(job_spec(backend="megatron"))  # t*p == 1: the bucketed weight sync
    assert plain["actor"].worker_cls is ActorWorker
    assert plain["rollout"].worker_cls is RolloutWorker


def test_spec_refuses_tensor_parallelism_on_fsdp_naming_the_field() -> None:
    """Rejected by the spec (hence `hybridflow validate` and admission), before any GPU is allocated."""
    from hybridflow.spec import SpecError

    with pytest.raises(SpecError, match=r"spec.training.tensorParallelSize: must be 1 with backend 'fsdp'"):
        job_spec(tensorParallelSize=2)
