"""The training backend registry and the FSDP backend's contract edges (one process, gloo world of one).

* ``training_backend`` names every backend the spec accepts and refuses others, naming the field.
* A frozen model (loaded without a learning rate) has no gradients and refuses to train.
* What FSDP cannot do (the 3D-HybridEngine's training shard) fails with an error naming the backend
  that can, not with an attribute error deep in the rollout.
* Scoring through the backend equals the backend functions on the same rows (micro-batches of
  ``microBatchSizePerGpu`` concatenated).
"""

from __future__ import annotations

import os
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
import torch.distributed as dist

from hybridflow.backends.api import BACKEND_NAMES, UnsupportedByBackend, training_backend
from hybridflow.backends.fsdp import token_logprobs_and_entropy
from hybridflow.backends.fsdp.parallelize import decoder_layers
from hybridflow.backends.fsdp.training import FSDPTrainingBackend
from hybridflow.models import PAD_TOKEN_ID, write_tiny_model
from hybridflow.spec import RLHFJobSpec
from hybridflow.spec.training import TrainingSpec

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("training-backend") / "qwen2", "qwen2", seed=3)


@pytest.fixture
def world_of_one(tmp_path: Path) -> Iterator[None]:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _spec(model_dir: Path) -> RLHFJobSpec:
    return RLHFJobSpec.model_validate(
        {
            "models": {"actor": {"path": str(model_dir)}},
            "data": {"trainFiles": ["/data/prompts.jsonl"]},
            "algorithm": {"name": "grpo", "samplesPerPrompt": 2},
            "training": {
                "totalSteps": 2,
                "promptsPerStep": 2,
                "miniBatchSize": 4,
                "microBatchSizePerGpu": 2,
                "precision": "fp32",
            },
            "rewards": [{"function": "target_char"}],
        }
    )


def _batch(rows: int = 5, prompt: int = 4, response: int = 3) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(3, 200, (rows, prompt + response), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, :2] = 0  # a left-padded prompt
    input_ids[0, :2] = PAD_TOKEN_ID
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": position_ids,
        "responses": input_ids[:, prompt:],
        "response_mask": torch.ones(rows, response, dtype=torch.long),
    }


def test_the_registry_names_every_backend_the_spec_accepts() -> None:
    field = TrainingSpec.model_fields["backend"].annotation
    assert set(BACKEND_NAMES) == set(typing.get_args(field))
    assert training_backend("fsdp") is FSDPTrainingBackend
    with pytest.raises(
        ValueError, match=r"spec.training.backend: 'deepspeed' is not one of 'fsdp', 'megatron'"
    ):
        training_backend("deepspeed")


@pytest.mark.usefixtures("world_of_one")
def test_a_frozen_fsdp_model_scores_like_the_backend_functions_and_refuses_to_train(model_dir: Path) -> None:
    backend = training_backend("fsdp")(_spec(model_dir), torch.device("cpu"))
    backend.load(str(model_dir), kind="causal-lm", learning_rate=None)
    assert not any(p.requires_grad for p in backend.model.parameters())
    batch = _batch()
    log_probs, entropy = backend.log_probs(batch, temperature=1.0, with_entropy=True)
    assert entropy is not None and log_probs.shape == entropy.shape == (5, 3)
    with torch.no_grad():
        expected = torch.cat(
            [
                token_logprobs_and_entropy(
                    backend.model,
                    batch["input_ids"][start : start + 2],
                    batch["attention_mask"][start : start + 2],
                    batch["position_ids"][start : start + 2],
                    response_len=3,
                    with_entropy=False,
                )[0]
                for start in range(0, 5, 2)
            ]
        )
    assert torch.equal(log_probs, expected)
    with pytest.raises(ValueError, match="causal LM; use log_probs"):
        backend.values(batch)
    with pytest.raises(RuntimeError, match="frozen"):
        backend.clip_and_step(max_grad_norm=1.0)
    with pytest.raises(UnsupportedByBackend, match=r"needs spec\.training\.backend 'megatron'"):
        backend.training_shard([])


@pytest.mark.usefixtures("world_of_one")
def test_without_an_entropy_bonus_the_entropy_is_a_metric_and_the_gradients_are_the_same(
    model_dir: Path,
) -> None:
    """entropy_grad=False (entropyCoef 0): no graph through the entropy, bit-identical gradients."""
    batch = _batch()
    seen: list[torch.Tensor] = []

    def loss_fn(
        log_probs: torch.Tensor, entropy: torch.Tensor | None, micro: typing.Mapping[str, torch.Tensor]
    ) -> tuple[torch.Tensor, dict[str, float]]:
        assert entropy is not None
        seen.append(entropy)
        mask = micro["response_mask"].float()
        loss = -(log_probs * mask).sum() / mask.sum() - 0.0 * (entropy * mask).sum()
        return loss, {"entropy": float((entropy.detach() * mask).mean())}

    grads, metrics = [], []
    for entropy_grad in (True, False):
        backend = FSDPTrainingBackend(_spec(model_dir), torch.device("cpu"))
        backend.load(str(model_dir), kind="causal-lm", learning_rate=1e-3)
        seen.clear()
        metrics.append(
            backend.forward_backward([batch], loss_fn, fields=["response_mask"], entropy_grad=entropy_grad)
        )
        assert all(entropy.requires_grad == entropy_grad for entropy in seen)
        grads.append({name: p.grad.full_tensor().clone() for name, p in backend.model.named_parameters()})
    assert metrics[0] == metrics[1]
    assert grads[0].keys() == grads[1].keys()
    assert all(torch.equal(grads[0][name], grads[1][name]) for name in grads[0])


def _left_padded(batch: dict[str, torch.Tensor], columns: int) -> dict[str, torch.Tensor]:
    """``batch`` with ``columns`` more prompt columns of padding on the left of every row."""
    rows = int(batch["input_ids"].shape[0])
    pad = {
        "input_ids": torch.full((rows, columns), PAD_TOKEN_ID, dtype=torch.long),
        "attention_mask": torch.zeros(rows, columns, dtype=torch.long),
        "position_ids": torch.zeros(rows, columns, dtype=torch.long),
    }
    return {
        name: torch.cat([pad[name], tensor], 1) if name in pad else tensor for name, tensor in batch.items()
    }


def test_first_used_column_keeps_one_prompt_column() -> None:
    from hybridflow.backends.fsdp.logprobs import first_used_column

    mask = _left_padded(_batch(), 3)["attention_mask"]
    assert first_used_column(mask, response_len=3) == 3
    assert first_used_column(_batch()["attention_mask"], response_len=3) == 0
    only_responses = torch.cat([torch.zeros(2, 4, dtype=torch.long), torch.ones(2, 3, dtype=torch.long)], 1)
    assert first_used_column(only_responses, response_len=3) == 3  # the column scoring the first token


@pytest.mark.usefixtures("world_of_one")
def test_columns_that_are_padding_in_every_row_are_not_computed(model_dir: Path) -> None:
    """The rollout pads prompts to data.maxPromptTokens; passes skip the columns no row uses."""
    batch = _batch()
    padded = _left_padded(batch, 5)
    backend = FSDPTrainingBackend(_spec(model_dir), torch.device("cpu"))
    backend.load(str(model_dir), kind="causal-lm", learning_rate=1e-3)
    widths: list[int] = []
    backend.model.register_forward_pre_hook(
        lambda module, args, kwargs: widths.append(int(kwargs["input_ids"].shape[1])), with_kwargs=True
    )

    def loss_fn(
        log_probs: torch.Tensor, entropy: torch.Tensor | None, micro: typing.Mapping[str, torch.Tensor]
    ) -> tuple[torch.Tensor, dict[str, float]]:
        mask = micro["response_mask"].float()
        return -(log_probs * mask).sum() / mask.sum(), {}

    scored = [backend.log_probs(b, temperature=1.0, with_entropy=False)[0] for b in (batch, padded)]
    assert torch.equal(scored[0], scored[1])
    grads = []
    for b in (batch, padded):
        backend.forward_backward([b], loss_fn, fields=["response_mask"], entropy_grad=False)
        grads.append({name: p.grad.full_tensor().clone() for name, p in backend.model.named_parameters()})
    assert all(torch.equal(grads[0][name], grads[1][name]) for name in grads[0])
    assert set(widths) == {7}  # 4 prompt + 3 response columns, never the 12 of the padded batch


def _shared_prompt_batch() -> dict[str, torch.Tensor]:
    """:func:`_batch` whose rows carry prompts A, B, A, A, B (row 0's A is left-padded)."""
    batch = _batch()
    for name in ("input_ids", "attention_mask", "position_ids"):
        for row, source in ((2, 0), (3, 0), (4, 1)):
            batch[name][row, :4] = batch[name][source, :4]
    batch["position_ids"] = (batch["attention_mask"].cumsum(dim=1) - 1).clamp(min=0)
    return batch


def test_find_shared_prompts_groups_rows_by_prompt_tokens_and_mask() -> None:
    from hybridflow.backends.fsdp.logprobs import find_shared_prompts

    batch = _shared_prompt_batch()
    shared = find_shared_prompts(batch["input_ids"], batch["attention_mask"], response_len=3)
    assert shared is not None
    assert shared.first_rows[shared.inverse].tolist() == [0, 1, 0, 0, 1]
    # Padding compares equal whatever id fills it; a different mask is a different prompt.
    batch["input_ids"][2, :2] = 7
    batch["attention_mask"][3, 0] = 1
    shared = find_shared_prompts(batch["input_ids"], batch["attention_mask"], response_len=3)
    assert shared is not None and shared.first_rows[shared.inverse].tolist() == [0, 1, 0, 3, 1]
    assert find_shared_prompts(_batch()["input_ids"], _batch()["attention_mask"], response_len=3) is None


@pytest.mark.usefixtures("world_of_one")
def test_rows_sharing_a_prompt_run_it_once_with_the_unshared_results(model_dir: Path) -> None:
    """Prompts A, B, A, A, B: two prompt rows, then five response rows; results as if unshared."""
    batch = _shared_prompt_batch()

    def loss_fn(
        log_probs: torch.Tensor, entropy: torch.Tensor | None, micro: typing.Mapping[str, torch.Tensor]
    ) -> tuple[torch.Tensor, dict[str, float]]:
        assert entropy is not None
        mask = micro["response_mask"].float()
        return -((log_probs + 0.01 * entropy) * mask).sum() / mask.sum(), {}

    results = []
    # sharedPromptMinTokens 0: share whatever it saves (this batch saves a few tokens, far below
    # the default), without and with activation checkpointing; the default threshold shares
    # nothing here and is the unshared reference.
    for options in (
        {"shared_prompt_min_tokens": 0},
        {"shared_prompt_min_tokens": 0, "activation_checkpointing": True},
        {},
    ):
        spec = _spec(model_dir)
        spec = spec.model_copy(update={"training": spec.training.model_copy(update=options)})
        backend = FSDPTrainingBackend(spec, torch.device("cpu"))
        backend.load(str(model_dir), kind="causal-lm", learning_rate=1e-3)
        shapes: list[tuple[int, int]] = []
        backend.model.register_forward_pre_hook(
            lambda module, args, kwargs, shapes=shapes: shapes.append(tuple(kwargs["input_ids"].shape)),
            with_kwargs=True,
        )
        mlp_calls: list[int] = []
        mlp = decoder_layers(backend.model)[0].mlp
        plain_forward = mlp.forward

        def counted(*args: Any, plain_forward: Any = plain_forward, calls: list[int] = mlp_calls) -> Any:
            calls.append(1)
            return plain_forward(*args)

        mlp.forward = counted  # torch's recompute skips module hooks: count the calls themselves
        scored, _ = backend.log_probs(batch, temperature=0.8, with_entropy=False)
        scoring_calls = len(mlp_calls)
        backend.forward_backward([batch], loss_fn, fields=["response_mask"], temperature=0.8)
        grads = {name: p.grad.full_tensor().clone() for name, p in backend.model.named_parameters()}
        results.append((shapes, scored, grads, len(mlp_calls) - scoring_calls))
    with torch.no_grad():  # the last backend: no sharing
        unshared, _ = token_logprobs_and_entropy(
            backend.model,
            batch["input_ids"],
            batch["attention_mask"],
            batch["position_ids"],
            response_len=3,
            temperature=0.8,
            with_entropy=False,
        )
    (shared_shapes, shared_scored, shared_grads, shared_calls), checkpointed, default = results
    checkpointed_shapes, checkpointed_scored, checkpointed_grads, checkpointed_calls = checkpointed
    default_shapes, _, default_grads, _ = default
    # log_probs runs micro-batches of 2 rows: rows 0-1 differ; rows 2-3 share A (left padding
    # trimmed: 2 prompt columns); row 4 is alone. The update runs all five: prompts A and B.
    assert shared_shapes == [(2, 7), (1, 2), (2, 3), (1, 7), (2, 4), (5, 3)]
    # Under activation checkpointing the update shares too, and its two passes are recomputed
    # in backward (the prompt pass and the response pass: 2 forwards, then 2 replays).
    assert checkpointed_shapes == shared_shapes
    assert (shared_calls, checkpointed_calls) == (2, 4)
    assert default_shapes[:4] == [(2, 7), (2, 5), (1, 7), (5, 7)]  # then the unshared reference pass
    torch.testing.assert_close(shared_scored, unshared, atol=1e-5, rtol=0)
    torch.testing.assert_close(checkpointed_scored, unshared, atol=1e-5, rtol=0)
    for got in (shared_grads, checkpointed_grads):
        assert got.keys() == default_grads.keys()
        for name, grad in default_grads.items():
            torch.testing.assert_close(got[name], grad, atol=1e-6, rtol=1e-4, msg=name)


def test_the_optimizer_is_the_fused_adamw_on_cpu_and_cuda() -> None:
    from hybridflow.backends.fsdp.optim import build_optimizer

    # torch's default on CPU is a per-parameter Python loop, 4x slower on FSDP's DTensors than
    # the multi-tensor one, which is slower again than the fused kernel.
    optimizer = build_optimizer(torch.nn.Linear(2, 1), learning_rate=0.1)
    assert optimizer.defaults["fused"] is True and not optimizer.defaults["foreach"]
