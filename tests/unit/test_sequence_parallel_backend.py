"""The FSDP backend at ``spec.training.sequenceParallelSize: 2`` scores and updates like size 1.

One spawned 4-rank gloo job, the tiny Qwen2 (2 query heads, 2 KV heads: one of each per rank of
a pair), float32, activation checkpointing on (Ulysses attention is recomputed in backward,
inside the context). The same global batch of 8 engine-layout rows (left-padded prompts,
right-padded responses, 13 columns: odd, so the pairs pad a column) goes through two backends
in the same processes, each rank taking the rows its DP coordinate gets under the mesh
``trainer/roles.py`` deploys (``DeviceMesh.training(4, tp=size)``, contiguous shards as
``DP_SPLIT`` cuts them):

* size 1: four data-parallel ranks of 2 rows, no groups (the default group);
* size 2: Ulysses pairs [0, 1] and [2, 3], two data-parallel ranks of 4 rows; both ranks of a
  pair get the same rows.

Each rank sums its loss counts over ``backend.dp_group()`` as the workers do, runs one
``forward_backward`` (two micro-batches per rank, a policy-gradient and an entropy term) and one
``clip_and_step``. Checked against size 1, within 1e-5: the log-probs and entropy of all 8 rows,
every parameter's gradient (relative to its norm), the pre-clip gradient norm and every weight
after the step (which moves them by far more than the tolerance). The learning rate is 1e-3:
AdamW's first step is ``lr * g / (|g| + eps)``, which turns the rounding noise left in the key
biases' gradients (zero in exact arithmetic: softmax ignores a shift shared by all keys) into
steps of a few thousandths of ``lr`` that differ between any two summation orders.

Without processes: the dispatch gives a pair the same rows, and the load-time refusals name
``spec.training.sequenceParallelSize``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from hybridflow.spec import RLHFJobSpec
from spawned_ranks import run_spawned_ranks

pytestmark = pytest.mark.unit

WORLD = 4
TOLERANCE = 1e-5
LEARNING_RATE = 1e-3
PROMPT_WIDTH, RESPONSE_WIDTH = 7, 6
ROWS = [
    ([72, 105], [33, 10, 258]),
    ([257, 117, 115, 101, 114, 10, 72], [65, 66, 67, 68, 69, 70]),
    ([84, 104, 101, 32, 113], [117]),
    ([99, 100], [101, 102, 103, 104, 258]),
    ([110, 111, 112, 113, 114, 115], [116, 117]),
    ([72], [73, 74, 75, 76, 77, 78]),
    ([120, 121, 122], [123, 258]),
    ([50, 51, 52, 53], [54, 55, 56, 258]),
]


def job_spec(model_dir: str, size: int, *, gpus: int = WORLD) -> RLHFJobSpec:
    return RLHFJobSpec.model_validate(
        {
            "models": {"actor": {"path": model_dir}},
            "data": {"trainFiles": ["/data/prompts.jsonl"]},
            "algorithm": {"name": "grpo", "samplesPerPrompt": 2},
            "training": {
                "totalSteps": 2,
                "promptsPerStep": 4,
                "miniBatchSize": 8,
                "microBatchSizePerGpu": 2,
                "precision": "fp32",
                "activationCheckpointing": True,
                "learningRate": LEARNING_RATE,
                "sequenceParallelSize": size,
            },
            "rewards": [{"function": "target_char"}],
            "resourcePools": [{"name": "default", "gpusPerNode": gpus}],
        }
    )


def global_batch() -> dict[str, torch.Tensor]:
    from hybridflow.models import PAD_TOKEN_ID

    input_ids = torch.full((len(ROWS), PROMPT_WIDTH + RESPONSE_WIDTH), PAD_TOKEN_ID)
    attention_mask = torch.zeros_like(input_ids)
    for row, (prompt, response) in enumerate(ROWS):
        start, end = PROMPT_WIDTH - len(prompt), PROMPT_WIDTH + len(response)
        input_ids[row, start:end] = torch.tensor(prompt + response)
        attention_mask[row, start:end] = 1
    advantages = torch.linspace(-1.0, 1.0, len(ROWS) * RESPONSE_WIDTH).view(len(ROWS), RESPONSE_WIDTH)
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": (attention_mask.cumsum(dim=1) - 1).clamp(min=0),
        "responses": input_ids[:, PROMPT_WIDTH:],
        "response_mask": attention_mask[:, PROMPT_WIDTH:],
        "advantages": advantages,
    }


def run_backend(rank: int, model_dir: str, size: int) -> dict[str, Any]:
    """One backend at ``size`` on this rank: the whole batch's scores, the gradients, the norm, the weights."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from hybridflow.backends.fsdp.training import FSDPTrainingBackend
    from hybridflow.mesh import DeviceMesh

    backend = FSDPTrainingBackend(job_spec(model_dir, size), torch.device("cpu"))
    backend.load(model_dir, kind="causal-lm", learning_rate=LEARNING_RATE)
    mesh = DeviceMesh.training(WORLD, tp=size)
    coord = mesh.coord(rank)
    batch = global_batch()
    rows = len(ROWS) // mesh.dp_size
    mine = {name: tensor[coord.dp * rows : (coord.dp + 1) * rows] for name, tensor in batch.items()}

    log_probs, entropy = backend.log_probs(mine, temperature=1.0, with_entropy=True)
    assert entropy is not None
    gathered: list[Any] = [None] * WORLD
    dist.all_gather_object(gathered, (coord.dp, coord.tp, log_probs, entropy))
    by_dp = sorted((dp, lp, ent) for dp, tp, lp, ent in gathered if tp == 0)
    same_in_group = all(
        torch.equal(lp, by_dp[dp][1]) for dp, _, lp, _ in gathered
    )  # every rank of a group returns the group's results

    counts = torch.tensor([float(mine["response_mask"].sum())], dtype=torch.float64)
    dist.all_reduce(counts, group=backend.dp_group())
    tokens, dp_size = float(counts[0]), mesh.dp_size

    def loss_fn(
        log_probs: torch.Tensor, entropy: torch.Tensor | None, micro: Any
    ) -> tuple[torch.Tensor, dict[str, float]]:
        assert entropy is not None
        mask = micro["response_mask"].float()
        per_token = -log_probs * micro["advantages"] - 0.01 * entropy
        return (per_token * mask).sum() / tokens * dp_size, {"tokens": float(mask.sum())}

    micro_batches = [{name: t[start : start + 2] for name, t in mine.items()} for start in range(0, rows, 2)]
    backend.forward_backward(micro_batches, loss_fn, fields=("response_mask", "advantages"))
    grads = {
        name: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
        for name, p in backend.model.named_parameters()
        if p.grad is not None
    }
    before = backend.full_state_dict()
    norm = backend.clip_and_step(max_grad_norm=1.0)
    return {
        "log_probs": torch.cat([lp for _, lp, _ in by_dp]),
        "entropy": torch.cat([ent for _, _, ent in by_dp]),
        "same_in_group": same_in_group,
        "grads": grads,
        "norm": norm,
        "before": before,
        "after": backend.full_state_dict(),
        "attention": backend.model.config._attn_implementation,
        "dp_ranks": dist.get_world_size(backend.dp_group()),
    }


def ranks(rank: int, port: int, model_dir: str, work: str) -> None:
    import torch.distributed as dist

    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(WORLD)})
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    plain = run_backend(rank, model_dir, 1)
    split = run_backend(rank, model_dir, 2)
    valid = global_batch()["response_mask"].bool()
    grad_errors = {
        name: float((split["grads"][name] - ref).norm() / ref.norm().clamp_min(1e-12))
        for name, ref in plain["grads"].items()
    }
    results = {
        "layout": {
            "attention": [plain["attention"], split["attention"]],
            "dp_ranks": [plain["dp_ranks"], split["dp_ranks"]],
            "same_in_group": split["same_in_group"],
        },
        "scores": {
            "log_prob_error": float((split["log_probs"] - plain["log_probs"])[valid].abs().max()),
            "entropy_error": float((split["entropy"] - plain["entropy"])[valid].abs().max()),
        },
        "update": {
            "same_parameters": sorted(split["grads"]) == sorted(plain["grads"]),
            "worst_grad_error": max(grad_errors.items(), key=lambda item: item[1]),
            "norms": [plain["norm"], split["norm"]],
            "weight_error": max(
                float((split["after"][name] - ref).abs().max()) for name, ref in plain["after"].items()
            ),
            "weight_change": max(
                float((plain["after"][name] - ref).abs().max()) for name, ref in plain["before"].items()
            ),
        },
    }
    (Path(work) / f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from hybridflow.models import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("sequence-parallel") / "qwen2", "qwen2", seed=5)


@pytest.fixture(scope="module")
def outcome(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[int, Any]]:
    work = tmp_path_factory.mktemp("sequence-parallel-ranks")
    return run_spawned_ranks(
        ranks,
        (str(model_dir), str(work)),
        world_size=WORLD,
        work_dir=work,
        deadline_seconds=240,
        what="the FSDP backend at sequence-parallel sizes 1 and 2",
        expected=["layout", "scores", "update"],
    )


def test_size_two_runs_ulysses_pairs_over_two_data_parallel_ranks(outcome: dict[str, dict[int, Any]]) -> None:
    from hybridflow.backends.fsdp.ulysses import ULYSSES_ATTENTION

    assert set(outcome["layout"]) == set(range(WORLD))
    for rank, layout in outcome["layout"].items():
        assert layout["attention"] == ["sdpa", ULYSSES_ATTENTION], rank
        assert layout["dp_ranks"] == [WORLD, WORLD // 2], rank
        assert layout["same_in_group"], rank


def test_size_two_scores_the_batch_like_size_one(outcome: dict[str, dict[int, Any]]) -> None:
    assert set(outcome["scores"]) == set(range(WORLD))
    for rank, scores in outcome["scores"].items():
        assert scores["log_prob_error"] <= TOLERANCE, (rank, scores)
        assert scores["entropy_error"] <= TOLERANCE, (rank, scores)


def test_size_two_makes_the_update_of_size_one(outcome: dict[str, dict[int, Any]]) -> None:
    assert set(outcome["update"]) == set(range(WORLD))
    for rank, update in outcome["update"].items():
        assert update["same_parameters"], rank
        assert update["worst_grad_error"][1] <= TOLERANCE, (rank, update["worst_grad_error"])
        plain_norm, split_norm = update["norms"]
        assert abs(split_norm - plain_norm) <= TOLERANCE * plain_norm, (rank, update["norms"])
        assert update["weight_error"] <= TOLERANCE, (rank, update["weight_error"])
        # The step moved the weights far more than the tolerance: equal weights are not trivially equal.
        assert update["weight_change"] > 50 * TOLERANCE, (rank, update["weight_change"])


# --------------------------------------------------------------------------- no processes


def test_dispatch_gives_a_sequence_parallel_pair_the_same_rows(tmp_path: Path) -> None:
    from hybridflow.controller import DP_SPLIT, Batch
    from hybridflow.controller.protocols import CallArgs
    from hybridflow.trainer.roles import job_roles

    roles = job_roles(job_spec(str(tmp_path), 2))
    mesh = roles["actor"].mesh
    assert mesh is not None and (mesh.tp_size, mesh.dp_size) == (2, 2)
    assert roles["reference"].mesh == mesh
    batch = Batch({name: tensor for name, tensor in global_batch().items()})
    dispatched = DP_SPLIT.dispatch(CallArgs((batch,)), mesh)
    shards = [call.args[0] for call in dispatched.per_rank if call is not None]
    assert shards[0] is shards[1] and shards[2] is shards[3]
    assert torch.equal(shards[0].tensors["input_ids"], batch.tensors["input_ids"][:4])
    assert torch.equal(shards[2].tensors["input_ids"], batch.tensors["input_ids"][4:])
    assert dispatched.collect_from == (0, 2)
    assert job_roles(job_spec(str(tmp_path), 1))["actor"].mesh is None  # size 1: pure DP, as before


@pytest.fixture
def world_of_one(tmp_path: Path) -> Any:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.usefixtures("world_of_one")
def test_load_refuses_heads_or_ranks_the_size_does_not_split(tmp_path: Path) -> None:
    from hybridflow.backends.fsdp.training import FSDPTrainingBackend
    from hybridflow.models import write_tiny_model

    one_kv_head = str(write_tiny_model(tmp_path / "gqa", "qwen2", kv_heads=1))
    backend = FSDPTrainingBackend(job_spec(one_kv_head, 2), torch.device("cpu"))
    with pytest.raises(
        ValueError,
        match=(
            r"spec\.training\.sequenceParallelSize: 2 does not split the attention heads of .*gqa "
            r"\(num_key_value_heads=1 is smaller than the sequence-parallel size 2.*\); allowed: a size "
            r"that divides both num_attention_heads=2 and num_key_value_heads=1"
        ),
    ):
        backend.load(one_kv_head, kind="causal-lm", learning_rate=LEARNING_RATE)

    two_heads = str(write_tiny_model(tmp_path / "mha", "qwen2"))
    backend = FSDPTrainingBackend(job_spec(two_heads, 2), torch.device("cpu"))
    with pytest.raises(
        ValueError,
        match=r"spec\.training\.sequenceParallelSize: 2 does not divide this role's 1 ranks",
    ):
        backend.load(two_heads, kind="causal-lm", learning_rate=LEARNING_RATE)
