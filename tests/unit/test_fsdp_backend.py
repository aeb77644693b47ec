"""The FSDP2 backend's functions in one process: loading, log-probs and values against plain
references, LR schedules, the clipped step, and FSDP2 with a world of one (gloo).

The two-rank checks (sharded training equals unsharded, buckets, checkpoints) live in
``tests/integration/test_fsdp_backend_distributed.py``.
"""

from __future__ import annotations

import math
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from hybridflow.backends.fsdp import (
    ValueModel,
    build_lr_scheduler,
    build_optimizer,
    clip_grad_norm_and_step,
    decoder_layers,
    fsdp_units,
    full_state_dict,
    iter_full_weight_buckets,
    load_causal_lm,
    load_value_model,
    lr_factor,
    pack_sequences,
    packed_token_logprobs_and_entropy,
    packed_token_values,
    shard_model,
    token_logprobs_and_entropy,
    token_values,
)
from hybridflow.models import PAD_TOKEN_ID, write_tiny_model
from hybridflow.spec.training import DEFAULT_FSDP_UNIT_MIN_PARAMETERS

pytestmark = pytest.mark.unit

PROMPT_WIDTH = 8
RESPONSE_WIDTH = 6
# (prompt, response) token ids of different lengths: left padding and right padding both occur,
# and one row fills both halves completely.
ROWS = [
    ([72, 105], [33, 10, 258]),
    ([257, 117, 115, 101, 114, 10, 72, 105], [65, 66, 67, 68, 69, 70]),
    ([84, 104, 101, 32, 113], [117]),
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("fsdp-unit") / "qwen2", "qwen2", seed=3)


def packed_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``input_ids``, ``attention_mask``, ``position_ids`` in the engine layout (left | right padded)."""
    rows = len(ROWS)
    input_ids = torch.full((rows, PROMPT_WIDTH + RESPONSE_WIDTH), PAD_TOKEN_ID)
    attention_mask = torch.zeros_like(input_ids)
    for row, (prompt, response) in enumerate(ROWS):
        start = PROMPT_WIDTH - len(prompt)
        input_ids[row, start : PROMPT_WIDTH + len(response)] = torch.tensor(prompt + response)
        attention_mask[row, start : PROMPT_WIDTH + len(response)] = 1
    position_ids = (attention_mask.cumsum(dim=-1) - 1).clamp_min(0)
    return input_ids, attention_mask, position_ids


def response_mask() -> torch.Tensor:
    return packed_batch()[1][:, PROMPT_WIDTH:]


# --------------------------------------------------------------------------- loading


def test_load_causal_lm_is_fp32_sdpa_eval_without_cache(model_dir: Path) -> None:
    model: Any = load_causal_lm(model_dir)
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert model.config._attn_implementation == "sdpa"
    assert model.config.use_cache is False
    assert not model.training
    assert {p.dtype for p in load_causal_lm(model_dir, dtype=torch.bfloat16).parameters()} == {torch.bfloat16}


def test_missing_model_directory_names_the_path(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"no config\.json"):
        load_causal_lm(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match=r"no config\.json"):
        load_value_model(tmp_path)


def test_a_checkpoint_missing_a_weight_is_refused_not_randomly_filled(
    model_dir: Path, tmp_path: Path
) -> None:
    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    shutil.copytree(model_dir, broken)
    weights = load_file(broken / "model.safetensors")
    del weights["model.norm.weight"]
    save_file(weights, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing weights \['model\.norm\.weight'\]"):
        load_causal_lm(broken)
    with pytest.raises(ValueError, match=r"missing weights \['norm\.weight'\]"):
        load_value_model(broken)


def test_value_model_backbone_is_the_causal_lm_decoder_with_a_zero_head(model_dir: Path) -> None:
    lm: Any = load_causal_lm(model_dir)
    critic = load_value_model(model_dir)
    decoder = {f"backbone.{name}": tensor for name, tensor in lm.model.state_dict().items()}
    state = critic.state_dict()
    assert set(state) == set(decoder) | {"value_head.weight", "value_head.bias"}
    assert all(torch.equal(state[name], decoder[name]) for name in decoder)
    assert not critic.value_head.weight.any() and not critic.value_head.bias.any()
    values = critic(*packed_batch())
    assert values.shape == (len(ROWS), PROMPT_WIDTH + RESPONSE_WIDTH)
    assert not values.any()


def test_value_model_round_trips_through_state_dict(model_dir: Path) -> None:
    critic = load_value_model(model_dir)
    with torch.no_grad():
        critic.value_head.weight.normal_(generator=torch.Generator().manual_seed(0))
        critic.value_head.bias.fill_(0.25)
    restored = load_value_model(model_dir)
    restored.load_state_dict(critic.state_dict())
    batch = packed_batch()
    assert torch.equal(restored(*batch), critic(*batch))


# --------------------------------------------------------------------------- log-probs and values


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_and_entropy_equal_a_plain_reference(model_dir: Path, temperature: float) -> None:
    model = load_causal_lm(model_dir)
    input_ids, attention_mask, position_ids = packed_batch()
    with torch.no_grad():
        log_probs, entropy = token_logprobs_and_entropy(
            model,
            input_ids,
            attention_mask,
            position_ids,
            response_len=RESPONSE_WIDTH,
            temperature=temperature,
        )
        logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    assert entropy is not None
    assert log_probs.shape == entropy.shape == (len(ROWS), RESPONSE_WIDTH)
    assert log_probs.dtype == entropy.dtype == torch.float32
    for row in range(len(ROWS)):
        for t in range(RESPONSE_WIDTH):
            # Column P + t - 1 predicts response token t (column P + t).
            reference = torch.log_softmax(logits[row, PROMPT_WIDTH + t - 1] / temperature, dim=-1)
            token = input_ids[row, PROMPT_WIDTH + t]
            assert log_probs[row, t] == reference[token]
            assert entropy[row, t] == pytest.approx(-(reference.exp() * reference).sum().item(), abs=1e-5)


def test_left_padded_rows_score_as_they_would_alone(model_dir: Path) -> None:
    model = load_causal_lm(model_dir)
    input_ids, attention_mask, position_ids = packed_batch()
    mask = response_mask()
    with torch.no_grad():
        batched, _ = token_logprobs_and_entropy(
            model, input_ids, attention_mask, position_ids, response_len=RESPONSE_WIDTH, with_entropy=False
        )
        for row, (prompt, response) in enumerate(ROWS):
            alone = torch.tensor([prompt + response])
            logits = model(input_ids=alone).logits[0, len(prompt) - 1 : -1]
            expected = torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(response)[:, None])[:, 0]
            torch.testing.assert_close(batched[row, : len(response)], expected, atol=1e-5, rtol=0)
            assert mask[row].sum() == len(response)


def test_logprobs_carry_gradients_and_entropy_is_optional(model_dir: Path) -> None:
    model: Any = load_causal_lm(model_dir)
    log_probs, entropy = token_logprobs_and_entropy(
        model, *packed_batch(), response_len=RESPONSE_WIDTH, with_entropy=False
    )
    assert entropy is None
    (log_probs * response_mask()).sum().backward()
    assert model.model.layers[0].mlp.up_proj.weight.grad is not None


@pytest.mark.parametrize(
    ("response_len", "temperature", "message"),
    [
        (0, 1.0, "response_len=0"),
        (PROMPT_WIDTH + RESPONSE_WIDTH, 1.0, "shorter"),
        (2, 0.0, "temperature=0.0"),
    ],
)
def test_bad_layout_or_temperature_is_refused(
    model_dir: Path, response_len: int, temperature: float, message: str
) -> None:
    model = load_causal_lm(model_dir)
    with pytest.raises(ValueError, match=message):
        token_logprobs_and_entropy(model, *packed_batch(), response_len=response_len, temperature=temperature)


def test_token_values_are_the_columns_that_predict_each_response_token(model_dir: Path) -> None:
    critic = load_value_model(model_dir)
    with torch.no_grad():
        critic.value_head.weight.normal_(generator=torch.Generator().manual_seed(1))
    input_ids, attention_mask, position_ids = packed_batch()
    with torch.no_grad():
        values = token_values(critic, input_ids, attention_mask, position_ids, response_len=RESPONSE_WIDTH)
        every_column = critic(input_ids, attention_mask, position_ids)
        assert values.shape == (len(ROWS), RESPONSE_WIDTH) and values.dtype == torch.float32
        assert torch.equal(values, every_column[:, PROMPT_WIDTH - 1 : -1])
        assert values.abs().min() > 0  # the head is no longer zero: the check above means something

        # values[:, t] has read the prompt and response tokens < t, never token t itself.
        changed = input_ids.clone()
        changed[:, PROMPT_WIDTH] = 65 + (changed[:, PROMPT_WIDTH] == 65).long()  # response token 0
        moved = token_values(critic, changed, attention_mask, position_ids, response_len=RESPONSE_WIDTH)
    assert torch.equal(moved[:, 0], values[:, 0])
    assert (moved[:, 1:] != values[:, 1:]).any(dim=1).all()


# --------------------------------------------------------------------------- layers


def test_decoder_layers_are_found_in_causal_lms_and_value_models(model_dir: Path) -> None:
    lm: Any = load_causal_lm(model_dir)
    critic: Any = load_value_model(model_dir)
    assert decoder_layers(lm) == list(lm.model.layers)
    assert decoder_layers(critic) == list(critic.backbone.layers)

    class Plain(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)])

    plain = Plain()
    assert decoder_layers(plain) == list(plain.layers)
    with pytest.raises(ValueError, match="cannot find the decoder layers of Linear"):
        decoder_layers(nn.Linear(2, 2))


# --------------------------------------------------------------------------- optimizer and schedule


def lrs_after_steps(schedule: str, steps: list[int], warmup: int = 2, total: int = 10) -> list[float]:
    optimizer = build_optimizer(nn.Linear(2, 1), learning_rate=2.0)
    scheduler = build_lr_scheduler(optimizer, warmup_steps=warmup, total_steps=total, schedule=schedule)  # type: ignore[arg-type]
    seen = {}
    for step in range(max(steps) + 1):
        seen[step] = float(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    return [seen[step] for step in steps]


COSINE_AT_4 = 2.0 * 0.5 * (1 + math.cos(math.pi * 2 / 8))


@pytest.mark.parametrize(
    ("schedule", "expected"),
    [
        ("constant", [0.0, 1.0, 2.0, 2.0, 2.0, 2.0, 2.0]),
        ("linear", [0.0, 1.0, 2.0, 1.5, 1.0, 0.0, 0.0]),
        ("cosine", [0.0, 1.0, 2.0, COSINE_AT_4, 1.0, 0.0, 0.0]),
    ],
)
def test_lr_schedule_values(schedule: str, expected: list[float]) -> None:
    # Peak 2.0, warmup 2, total 10: steps 0 and 1 warm up, decay spans steps 2..10.
    assert lrs_after_steps(schedule, [0, 1, 2, 4, 6, 10, 12]) == pytest.approx(expected, abs=1e-12)


def test_lr_schedule_without_warmup_starts_at_the_peak() -> None:
    assert lrs_after_steps("cosine", [0, 5], warmup=0) == pytest.approx([2.0, 1.0])
    assert lr_factor(3, warmup_steps=3, total_steps=3, schedule="linear") == 0.0


@pytest.mark.parametrize(
    ("warmup", "total", "schedule", "message"),
    [
        (0, 0, "constant", "total_steps=0"),
        (5, 4, "linear", "warmup_steps=5"),
        (-1, 4, "linear", "warmup_steps=-1"),
        (0, 4, "step", "schedule='step'"),
    ],
)
def test_bad_schedule_arguments_are_refused(warmup: int, total: int, schedule: str, message: str) -> None:
    optimizer = build_optimizer(nn.Linear(2, 1), learning_rate=1.0)
    with pytest.raises(ValueError, match=message):
        build_lr_scheduler(optimizer, warmup_steps=warmup, total_steps=total, schedule=schedule)  # type: ignore[arg-type]


def test_optimizer_covers_trainable_parameters_only() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    model[0].requires_grad_(False)
    optimizer = build_optimizer(model, learning_rate=0.1, weight_decay=0.01, betas=(0.8, 0.9))
    (group,) = optimizer.param_groups
    assert group["params"] == list(model[1].parameters())
    assert (group["lr"], group["weight_decay"], group["betas"]) == (0.1, 0.01, (0.8, 0.9))
    with pytest.raises(ValueError, match="requires grad"):
        build_optimizer(model[0], learning_rate=0.1)


def model_with_grads(grad_value: float) -> nn.Linear:
    model = nn.Linear(3, 2)
    with torch.no_grad():
        model.weight.copy_(torch.arange(6.0).reshape(2, 3))
        model.bias.zero_()
    model.weight.grad = torch.full_like(model.weight, 3.0)
    model.bias.grad = torch.full_like(model.bias, grad_value)
    return model


def test_clipped_step_returns_the_pre_clip_norm_and_leaves_the_schedule_alone() -> None:
    model = model_with_grads(4.0)
    reference = model_with_grads(4.0)
    expected_norm = math.sqrt(6 * 9 + 2 * 16)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scheduler = build_lr_scheduler(optimizer, warmup_steps=0, total_steps=5, schedule="linear")
    norm = clip_grad_norm_and_step(model, optimizer, scheduler, max_grad_norm=1.0)
    assert isinstance(norm, float) and norm == pytest.approx(expected_norm)
    # SGD with lr 1 moves each parameter by its clipped gradient: grad / norm (norm 1 after clipping).
    torch.testing.assert_close(model.weight, reference.weight - 3.0 / expected_norm)
    torch.testing.assert_close(model.bias, reference.bias - 4.0 / expected_norm)
    assert model.weight.grad is None and model.bias.grad is None
    assert scheduler.last_epoch == 0  # the workers step it once per RL step


def test_max_grad_norm_zero_disables_clipping() -> None:
    model = model_with_grads(4.0)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scheduler = build_lr_scheduler(optimizer, warmup_steps=0, total_steps=5, schedule="constant")
    assert clip_grad_norm_and_step(model, optimizer, scheduler, max_grad_norm=0.0) == pytest.approx(
        math.sqrt(86)
    )
    torch.testing.assert_close(model.bias, torch.full((2,), -4.0))
    with pytest.raises(ValueError, match="max_grad_norm=-1"):
        clip_grad_norm_and_step(model, optimizer, scheduler, max_grad_norm=-1)


@pytest.mark.parametrize("bad", [math.inf, math.nan])
def test_non_finite_grad_norm_skips_the_step(bad: float) -> None:
    model = model_with_grads(bad)
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    optimizer = build_optimizer(model, learning_rate=0.1, weight_decay=0.1)
    scheduler = build_lr_scheduler(optimizer, warmup_steps=0, total_steps=5, schedule="constant")
    norm = clip_grad_norm_and_step(model, optimizer, scheduler, max_grad_norm=1.0)
    assert not math.isfinite(norm)
    assert all(torch.equal(before[name], tensor) for name, tensor in model.state_dict().items())
    assert not optimizer.state  # Adam's moments never saw the bad gradients
    assert model.weight.grad is None and model.bias.grad is None


# --------------------------------------------------------------------------- FSDP2, world size 1


@pytest.fixture
def world_of_one(tmp_path: Path) -> Iterator[None]:
    if dist.is_initialized():
        pytest.fail("a torch.distributed process group is already initialised in the test process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_shard_model_requires_a_process_group(model_dir: Path) -> None:
    with pytest.raises(RuntimeError, match="initialised"):
        shard_model(load_causal_lm(model_dir), device=torch.device("cpu"))


@pytest.mark.usefixtures("world_of_one")
def test_single_rank_fsdp_scores_and_gathers_like_the_plain_model(model_dir: Path) -> None:
    reference = load_causal_lm(model_dir)
    sharded = shard_model(load_causal_lm(model_dir), device=torch.device("cpu"))
    assert all(isinstance(parameter, DTensor) for parameter in sharded.parameters())
    batch = packed_batch()
    with torch.no_grad():
        expected, _ = token_logprobs_and_entropy(reference, *batch, response_len=RESPONSE_WIDTH)
        got, _ = token_logprobs_and_entropy(sharded, *batch, response_len=RESPONSE_WIDTH)
    assert torch.equal(got, expected)

    state = full_state_dict(sharded)
    assert list(state) == list(reference.state_dict())
    assert all(torch.equal(state[name], tensor) for name, tensor in reference.state_dict().items())

    as_bf16 = {
        name: tensor
        for bucket in iter_full_weight_buckets(sharded, bucket_bytes=1 << 20, dtype=torch.bfloat16)
        for name, tensor in bucket
    }
    assert all(
        torch.equal(as_bf16[name], tensor.to(torch.bfloat16))
        for name, tensor in reference.state_dict().items()
    )


@pytest.mark.usefixtures("world_of_one")
def test_single_rank_value_model_shards_and_trains(model_dir: Path) -> None:
    critic = shard_model(load_value_model(model_dir), device=torch.device("cpu"))
    optimizer = build_optimizer(critic, learning_rate=1e-2)
    scheduler = build_lr_scheduler(optimizer, warmup_steps=0, total_steps=2, schedule="constant")
    input_ids, attention_mask, position_ids = packed_batch()
    values = token_values(critic, input_ids, attention_mask, position_ids, response_len=RESPONSE_WIDTH)
    ((values - 1.0).square() * response_mask()).sum().backward()
    norm = clip_grad_norm_and_step(critic, optimizer, scheduler, max_grad_norm=1.0)
    assert norm > 0 and math.isfinite(norm)
    state = full_state_dict(critic)
    assert "value_head.weight" in state and state["value_head.bias"].item() == pytest.approx(1e-2)


def _sharded_gradients(model: nn.Module, *, value: bool) -> dict[str, torch.Tensor]:
    """Gradients (full tensors, by name) of one loss over :func:`packed_batch` in train mode."""
    model.train()
    batch = packed_batch()
    if value:
        outputs = token_values(model, *batch, response_len=RESPONSE_WIDTH)
        loss = ((outputs - 1.0).square() * response_mask()).sum()
    else:
        log_probs, entropy = token_logprobs_and_entropy(model, *batch, response_len=RESPONSE_WIDTH)
        assert entropy is not None
        loss = ((-0.7 * log_probs - 0.01 * entropy) * response_mask()).sum()
    loss.backward()
    grads = {}
    for name, parameter in model.named_parameters():
        assert parameter.grad is not None, name
        grad = parameter.grad
        grads[name] = grad.full_tensor() if isinstance(grad, DTensor) else grad
    return grads


@pytest.mark.usefixtures("world_of_one")
@pytest.mark.parametrize("value", [False, True], ids=["causal-lm", "value-model"])
@pytest.mark.parametrize(
    ("unit_min_parameters", "units"),
    [(0, 3), (50_000, 2), (DEFAULT_FSDP_UNIT_MIN_PARAMETERS, 1)],
    ids=["unit-per-layer", "two-layer-unit", "root-unit"],  # the tiny model's layers: ~41k each
)
def test_activation_checkpointing_recomputes_and_gives_the_same_gradients(
    model_dir: Path, value: bool, unit_min_parameters: int, units: int
) -> None:
    load = load_value_model if value else load_causal_lm
    cpu = torch.device("cpu")
    plain = shard_model(load(model_dir), device=cpu, unit_min_parameters=unit_min_parameters)
    checkpointed = shard_model(
        load(model_dir), device=cpu, activation_checkpointing=True, unit_min_parameters=unit_min_parameters
    )
    layers = decoder_layers(checkpointed)
    assert layers and all(getattr(layer, "gradient_checkpointing", False) for layer in layers)
    # One FSDP state per unit; the modules of a grouped unit share theirs.
    states = {id(m._get_fsdp_state()) for m in checkpointed.modules() if isinstance(m, FSDPModule)}
    assert len(states) == units
    forwards = []
    mlp = layers[0].mlp
    plain_forward = mlp.forward

    def counted(*args: Any, **kwargs: Any) -> Any:
        forwards.append(1)
        return plain_forward(*args, **kwargs)

    mlp.forward = counted  # torch's recompute skips module hooks: count the calls themselves
    got = _sharded_gradients(checkpointed, value=value)
    assert len(forwards) == 2  # the forward, and its recompute in backward
    expected = _sharded_gradients(plain, value=value)
    assert list(got) == list(expected)
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.usefixtures("world_of_one")
def test_mixed_precision_computes_in_bf16_and_keeps_fp32_weights(model_dir: Path) -> None:
    reference = load_causal_lm(model_dir)
    model = shard_model(load_causal_lm(model_dir), device=torch.device("cpu"), mixed_precision=True)
    optimizer = build_optimizer(model, learning_rate=1e-3)
    scheduler = build_lr_scheduler(optimizer, warmup_steps=0, total_steps=1, schedule="constant")
    batch = packed_batch()
    log_probs, entropy = token_logprobs_and_entropy(model, *batch, response_len=RESPONSE_WIDTH)
    with torch.no_grad():
        expected, _ = token_logprobs_and_entropy(reference, *batch, response_len=RESPONSE_WIDTH)
    assert log_probs.dtype == torch.float32 and entropy is not None and entropy.dtype == torch.float32
    torch.testing.assert_close(log_probs, expected, atol=0.1, rtol=0)  # bf16 compute: close, not equal
    assert not torch.equal(log_probs, expected)
    (log_probs * response_mask()).sum().backward()
    assert math.isfinite(clip_grad_norm_and_step(model, optimizer, scheduler, max_grad_norm=1.0))
    assert {parameter.dtype for parameter in model.parameters()} == {torch.float32}


def test_buckets_respect_the_byte_budget_and_are_released(model_dir: Path) -> None:
    model = load_causal_lm(model_dir)
    expected = model.state_dict()
    budget = 40_000  # the 384 x 64 fp32 embedding (98,304 bytes) must form a bucket of its own
    seen: dict[str, torch.Tensor] = {}
    previous: list[tuple[str, torch.Tensor]] | None = None
    bucket_count = 0
    for bucket in iter_full_weight_buckets(model, bucket_bytes=budget):
        if previous is not None:
            assert previous == []  # cleared in place when the next bucket was asked for
        size = sum(tensor.numel() * tensor.element_size() for _, tensor in bucket)
        assert size <= budget or len(bucket) == 1
        seen.update(bucket)
        previous = bucket
        bucket_count += 1
    assert bucket_count > 3
    assert list(seen) == list(expected)
    assert all(torch.equal(seen[name], tensor) for name, tensor in expected.items())
    # Fresh copies, never views of the live weights.
    assert all(seen[name].data_ptr() != tensor.data_ptr() for name, tensor in expected.items())
    with pytest.raises(ValueError, match="bucket_bytes=0"):
        next(iter_full_weight_buckets(model, bucket_bytes=0))


def test_wrapper_prefixes_are_stripped_from_names() -> None:
    from hybridflow.backends.fsdp.weights import hf_name

    assert hf_name("_orig_mod.model.layers.0._checkpoint_wrapped_module.mlp.up_proj.weight") == (
        "model.layers.0.mlp.up_proj.weight"
    )


def test_value_model_needs_a_hugging_face_backbone() -> None:
    with pytest.raises(TypeError, match="no Hugging Face config"):
        ValueModel(nn.Linear(2, 2))


def test_reward_model_directory_scores_like_its_sequence_classifier(tmp_path: Path) -> None:
    """A ``*ForSequenceClassification`` (num_labels=1) checkpoint loads its score head as the value head."""
    from transformers import AutoModelForSequenceClassification

    directory = write_tiny_model(tmp_path / "rm", head="score", seed=3)
    reference = AutoModelForSequenceClassification.from_pretrained(directory).eval()
    value_model = load_value_model(directory)
    ids = torch.randint(0, 250, (2, 7))
    mask = torch.ones_like(ids)
    positions = torch.arange(7).expand(2, 7)
    with torch.no_grad():
        expected = reference(input_ids=ids, attention_mask=mask).logits.squeeze(-1)
        assert torch.allclose(value_model(ids, mask, positions)[:, -1], expected, atol=1e-6)
        assert value_model.value_head.weight.abs().sum() > 0


# --------------------------------------------------------------------------- packed sequences


def test_packing_keeps_each_rows_tokens_and_positions() -> None:
    input_ids, attention_mask, position_ids = packed_batch()
    packed = pack_sequences(input_ids, attention_mask, response_len=RESPONSE_WIDTH)
    lengths = [len(prompt) + len(response) for prompt, response in ROWS]
    assert packed.input_ids.shape == (1, sum(lengths))
    assert packed.input_ids[0].tolist() == [t for prompt, response in ROWS for t in prompt + response]
    assert packed.position_ids[0].tolist() == [p for n in lengths for p in range(n)]
    assert torch.equal(packed.position_ids[0], position_ids[attention_mask != 0])
    mask = response_mask() != 0
    assert torch.equal(packed.targets, input_ids[:, PROMPT_WIDTH:][mask])
    assert torch.equal(packed.input_ids[0, packed.predictors + 1], packed.targets)


def test_packing_refuses_a_response_with_nothing_before_it() -> None:
    input_ids, attention_mask, _ = packed_batch()
    attention_mask = attention_mask.clone()
    attention_mask[0, :PROMPT_WIDTH] = 0  # row 0 loses its prompt
    with pytest.raises(ValueError, match="row 0 has a response token with no token before it"):
        pack_sequences(input_ids, attention_mask, response_len=RESPONSE_WIDTH)
    attention_mask[1, 3] = 0  # a hole inside row 1
    with pytest.raises(ValueError, match="row 1's attention mask has holes"):
        pack_sequences(input_ids, attention_mask, response_len=RESPONSE_WIDTH)


@pytest.mark.usefixtures("world_of_one")
@pytest.mark.parametrize("value", [False, True], ids=["log-probs", "values"])
def test_packed_results_and_gradients_equal_the_padded_ones(model_dir: Path, value: bool) -> None:
    """Unequal lengths, one packed row: block-diagonal attention gives every token what it had padded."""
    load = load_value_model if value else load_causal_lm
    batch = packed_batch()
    input_ids, attention_mask = batch[0], batch[1]
    mask = response_mask()
    results = []
    for packed in (False, True):
        model = shard_model(load(model_dir), device=torch.device("cpu"))
        model.train()
        if value:
            out = (
                packed_token_values(model, input_ids, attention_mask, response_len=RESPONSE_WIDTH)
                if packed
                else token_values(model, *batch, response_len=RESPONSE_WIDTH)
            )
            loss = ((out - 1.0).square() * mask).sum()
            entropy = None
        else:
            out, entropy = (
                packed_token_logprobs_and_entropy(
                    model, input_ids, attention_mask, response_len=RESPONSE_WIDTH, temperature=0.7
                )
                if packed
                else token_logprobs_and_entropy(model, *batch, response_len=RESPONSE_WIDTH, temperature=0.7)
            )
            assert entropy is not None
            loss = ((-0.7 * out - 0.01 * entropy) * mask).sum()
        loss.backward()
        grads = {
            name: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            for name, p in model.named_parameters()
            if p.grad is not None
        }
        results.append((out.detach() * mask, None if entropy is None else entropy.detach() * mask, grads))
    (padded, padded_entropy, padded_grads), (packed, packed_entropy, packed_grads) = results
    torch.testing.assert_close(packed, padded, atol=1e-5, rtol=0)
    if padded_entropy is not None:
        assert packed_entropy is not None
        torch.testing.assert_close(packed_entropy, padded_entropy, atol=1e-5, rtol=0)
    assert packed_grads.keys() == padded_grads.keys() and padded_grads
    for name, grad in padded_grads.items():
        torch.testing.assert_close(packed_grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: flash-attention's varlen kernel")
def test_packed_flash_attention_matches_padded_sdpa_on_cuda(model_dir: Path) -> None:
    from transformers.utils import is_flash_attn_2_available

    from hybridflow.backends.fsdp import attention_implementation

    if not is_flash_attn_2_available():
        pytest.skip("flash-attn is not installed: packed passes use sdpa's block-diagonal mask")
    device = torch.device("cuda", 0)
    assert attention_implementation(device, packed=True, bf16=True) == "flash_attention_2"
    padded_model = load_causal_lm(model_dir, dtype=torch.bfloat16).to(device)
    packed_model = load_causal_lm(
        model_dir, dtype=torch.bfloat16, attn_implementation="flash_attention_2"
    ).to(device)
    input_ids, attention_mask, position_ids = (t.to(device) for t in packed_batch())
    mask = response_mask().to(device).bool()
    with torch.no_grad():
        expected, _ = token_logprobs_and_entropy(
            padded_model, input_ids, attention_mask, position_ids, response_len=RESPONSE_WIDTH
        )
        got, _ = packed_token_logprobs_and_entropy(
            packed_model, input_ids, attention_mask, response_len=RESPONSE_WIDTH
        )
    torch.testing.assert_close(got[mask], expected[mask], atol=0.05, rtol=0)  # bf16 kernels


@pytest.mark.parametrize(
    ("sizes", "minimum", "units"),
    [
        ([5, 5, 5], 0, [[0], [1], [2]]),  # 0: a unit per layer
        ([5, 5, 5, 5], 10, [[0, 1], [2, 3]]),
        ([5, 5, 5], 10, [[0, 1]]),  # the last layer, too small alone, joins the root
        ([20, 5, 5], 10, [[0], [1, 2]]),
        ([5, 5], 100, []),  # a small model: every layer in the root unit
    ],
)
def test_fsdp_units_group_consecutive_layers_up_to_the_minimum(
    sizes: list[int], minimum: int, units: list[list[int]]
) -> None:
    assert fsdp_units(sizes, minimum) == units


def test_fsdp_units_refuse_a_negative_minimum() -> None:
    with pytest.raises(ValueError, match="min_parameters=-1"):
        fsdp_units([1], -1)
