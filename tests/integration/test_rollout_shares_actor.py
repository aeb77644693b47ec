"""The FSDP actor -> rollout engine sync, as the worker group hosts the two roles (no Ray).

Spawned gloo processes host the actor and the rollout the way a worker group does
(``WorkerContext.colocated_roles``).

* One rank: no second copy. The torch engine generates from the FSDP actor's own module:
  ``sync_weights`` moves 0 bytes; the engine's module is the actor's; greedy output equals HF
  ``generate`` on the actor's weights before and after an optimizer step; the actor still
  trains after generating (FSDP2 unsharding under the engine's grad mode).
* Two ranks: the engine holds its own copy, loaded bucket by bucket; the bytes the traffic
  meter counted equal the all-gather's exact figure (each rank receives the other's rows of
  every parameter), the engine got the whole model, and greedy output equals HF ``generate``.
* Both run with ``offloadDuringGeneration`` (the optimizer state; with two ranks the parameters
  too): the rollout moves it out and back around each generation, and the actor trains and the
  engine generates as without it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from spawned_ranks import run_spawned_ranks
from tiny_inputs import make_tiny

ROOT = Path(__file__).resolve().parents[2]


def run_rank(rank: int, port: int, world: int, model_dir: str, data_file: str, work_dir: str) -> None:
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from hybridflow.controller import Batch, DeviceMesh, WorkerContext
    from hybridflow.spec.manifest import parse_job_manifest
    from hybridflow.workers.policy import ActorWorker
    from hybridflow.workers.rollout import RolloutWorker

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    outcome: dict[str, Any] = {}
    try:
        doc = yaml.safe_load((ROOT / "examples" / "grpo-tiny.yaml").read_text())
        doc["spec"]["models"] = {"actor": {"path": model_dir}}
        doc["spec"]["data"]["trainFiles"] = [data_file]
        doc["spec"]["rollout"]["maxResponseTokens"] = 8
        doc["spec"]["resourcePools"][0]["gpusPerNode"] = world
        # Offload around generation: the optimizer state always, the parameters where the engine
        # has its own copy (the spec refuses them for the shared module).
        doc["spec"]["training"]["offloadDuringGeneration"] = {"parameters": world > 1, "optimizerState": True}
        spec = parse_job_manifest(doc, "test").spec
        roles: dict[str, Any] = {}

        def context(role: str) -> WorkerContext:
            return WorkerContext(
                role=role,
                pool="default",
                rank=rank,
                world_size=world,
                local_rank=rank,
                local_world_size=world,
                node_id="local",
                mesh=DeviceMesh.data_parallel(world),
                device="cpu",
                backend="gloo",
                colocated_roles=roles,
            )

        roles["actor"] = actor = ActorWorker(context("actor"), spec)
        roles["rollout"] = rollout = RolloutWorker(context("rollout"), spec)
        prompts = [[5, 17, 42, 9], [100, 3, 77]]
        batch = Batch.from_dict(
            {"prompt_token_ids": [list(p) for p in prompts], "uid": ["a", "b"]},
            meta={"samples": 1, "greedy": True},
        )
        reference = AutoModelForCausalLM.from_pretrained(model_dir)

        def hf_greedy() -> list[list[int]]:
            full = {
                k: v.full_tensor() if hasattr(v, "full_tensor") else v
                for k, v in actor.model.state_dict().items()
            }
            reference.load_state_dict({k: v.detach() for k, v in full.items()})
            out = []
            for prompt in prompts:
                ids = torch.tensor([prompt])
                generated = reference.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=8,
                    do_sample=False,
                    eos_token_id=rollout.engine.eos_token_ids,
                    pad_token_id=rollout.pad_id,
                )
                out.append(generated[0, len(prompt) :].tolist())
            return out

        def engine_greedy() -> list[list[int]]:
            generated = rollout.generate_sequences(batch)
            responses, mask = generated.tensors["responses"], generated.tensors["response_mask"]
            return [
                [int(t) for t, m in zip(row.tolist(), row_mask.tolist(), strict=True) if m]
                for row, row_mask in zip(responses, mask, strict=True)
            ]

        outcome["synced_bytes"] = rollout.sync_weights()
        outcome["stats"] = rollout.transition_stats()
        outcome["same_module"] = rollout.engine.model is actor.model
        outcome["full_bytes"] = sum(v.numel() * v.element_size() for v in actor.model.state_dict().values())
        outcome["expected_received"] = sum(
            -(-v.shape[0] // world) * (world - 1) * (v.numel() // v.shape[0]) * v.element_size()
            for v in actor.model.state_dict().values()
            if hasattr(v, "full_tensor")
        )
        outcome["greedy_before"] = [engine_greedy(), hf_greedy()]
        # One optimizer step on the shared module (after generating from it).
        torch.manual_seed(0)
        ids = torch.randint(0, 200, (2, 12))
        loss = actor.model(input_ids=ids).logits.float().logsumexp(-1).mean()
        loss.backward()
        actor.backend.optimizer.step()
        actor.backend.optimizer.zero_grad()
        outcome["synced_bytes_after"] = rollout.sync_weights()
        outcome["greedy_after"] = [engine_greedy(), hf_greedy()]
        outcome["offload_stats"] = rollout.transition_stats()
        outcome["resident_after"] = all(
            p.to_local().untyped_storage().nbytes() > 0 for p in actor.model.parameters()
        ) and all(
            v.untyped_storage().nbytes() > 0
            for state in actor.backend.optimizer.state.values()
            for v in (t.to_local() if hasattr(t, "to_local") else t for t in state.values())
        )
        outcome["local_parameter_bytes"] = actor.local_parameter_bytes()
    except Exception:
        import traceback

        outcome["error"] = traceback.format_exc()
    finally:
        (Path(work_dir) / f"rank{rank}.json").write_text(json.dumps(outcome))
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("tiny-shared")
    make_tiny(base / "model", base / "data", prompts=16)
    return base


def test_single_rank_torch_engine_generates_from_the_actor_module(tiny: Path, tmp_path: Path) -> None:
    outcomes = run_spawned_ranks(
        run_rank,
        (1, str(tiny / "model"), str(tiny / "data" / "target_char.jsonl"), str(tmp_path)),
        world_size=1,
        work_dir=tmp_path,
        deadline_seconds=240,
        what="the shared-module rollout",
    )
    assert "error" not in outcomes, outcomes["error"][0]
    assert outcomes["synced_bytes"][0] == 0 and outcomes["synced_bytes_after"][0] == 0
    assert outcomes["same_module"][0] is True
    engine, hf = outcomes["greedy_before"][0]
    assert engine == hf
    engine_after, hf_after = outcomes["greedy_after"][0]
    assert engine_after == hf_after
    assert engine_after != engine, "the optimizer step did not change the shared weights' output"
    # Adam's state (two moments of every parameter) went to host memory and came back.
    stats, parameter_bytes = outcomes["offload_stats"][0], outcomes["local_parameter_bytes"][0]
    assert stats["offloaded_bytes"] >= 2 * parameter_bytes and outcomes["resident_after"][0] is True


def test_two_ranks_sync_a_metered_full_copy_into_the_engine(tiny: Path, tmp_path: Path) -> None:
    outcomes = run_spawned_ranks(
        run_rank,
        (2, str(tiny / "model"), str(tiny / "data" / "target_char.jsonl"), str(tmp_path)),
        world_size=2,
        work_dir=tmp_path,
        deadline_seconds=240,
        what="the two-rank weight sync",
    )
    assert "error" not in outcomes, outcomes["error"]
    for rank in (0, 1):
        assert outcomes["same_module"][rank] is False
        stats = outcomes["stats"][rank]
        assert outcomes["synced_bytes"][rank] == outcomes["full_bytes"][rank]
        assert stats["loaded_bytes"] == outcomes["full_bytes"][rank]
        assert stats["bytes_received"] == outcomes["expected_received"][rank] > 0
        assert stats["bytes_sent"] == stats["bytes_received"]
        assert stats["redundant_bytes"] > 0  # the trainer's shard, kept aside while the engine has a copy
        assert stats["peak_memory_bytes"] >= 0 and stats["to_generation_seconds"] > 0
        engine, hf = outcomes["greedy_before"][rank]
        assert engine == hf
        engine_after, hf_after = outcomes["greedy_after"][rank]
        assert engine_after == hf_after
        # Parameters and Adam's state went to host memory around generation and came back.
        offload, parameter_bytes = outcomes["offload_stats"][rank], outcomes["local_parameter_bytes"][rank]
        assert offload["offloaded_bytes"] >= 3 * parameter_bytes and outcomes["resident_after"][rank] is True
