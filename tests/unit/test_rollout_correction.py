"""The train-inference mismatch: its metrics, the corrections, when the spec turns them on, and a real gap.

Pure parts by hand (``hybridflow.rlmath.rollout_correction``, the spec's ``corrects``, the
catalogue's ``combine``), then the FSDP actor in one process (gloo world of one, no Ray) trained
on responses that a torch engine generated in bf16 and in fp32 against an fp32 trainer: with the
bf16 engine the gap is measured non-zero and the correction changes the update; with the fp32
engine (equal dtypes, ``maxStaleness: 0``, ``mode: auto``) the gap is ~0 and the update is bit for
bit the one made without the rollout's log-probs.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
import torch.distributed as dist

from hybridflow.backends.fsdp import full_state_dict
from hybridflow.controller import Batch, WorkerContext
from hybridflow.engines.base import SamplingParams
from hybridflow.engines.layout import response_tensors
from hybridflow.engines.torch_engine import TorchRolloutEngine
from hybridflow.mesh import DeviceMesh
from hybridflow.metrics.catalogue import combine_values
from hybridflow.models import PAD_TOKEN_ID, write_tiny_model
from hybridflow.rlmath.objectives import actor_objective
from hybridflow.rlmath.rollout_correction import (
    RolloutCorrection,
    correction_weights,
    mismatch_metrics,
    truncated_importance_weights,
)
from hybridflow.spec import AlgorithmSpec, RLHFJobSpec
from hybridflow.workers.mini_batches import rollout_correction
from hybridflow.workers.policy import ActorWorker
from hybridflow.workers.weight_push import dtypes_differ, generation_dtype, trainer_dtype

pytestmark = pytest.mark.unit

NAN = float("nan")


def _scalar(value: torch.Tensor) -> float:
    return float(value)


# --------------------------------------------------------------------------- the metrics


def test_metrics_by_hand_and_padding_never_leaks() -> None:
    # log r = trainer - rollout: 0.5, -0.5, 1.0 on the valid tokens; NaN and a huge gap in padding.
    trainer = torch.tensor([[0.5, -0.5, NAN], [1.0, 50.0, 0.0]])
    rollout = torch.zeros(2, 3)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    got = mismatch_metrics(trainer, rollout, mask)
    log_r = torch.tensor([0.5, -0.5, 1.0])
    r = log_r.exp()
    assert _scalar(got["kl"]) == pytest.approx(float((r - 1 - log_r).mean()))
    assert _scalar(got["abs_log_prob_diff"]) == pytest.approx(2.0 / 3)
    assert _scalar(got["abs_log_prob_diff_max"]) == pytest.approx(1.0)
    assert _scalar(got["ratio_min"]) == pytest.approx(math.exp(-0.5))
    assert _scalar(got["ratio_max"]) == pytest.approx(math.e)
    assert _scalar(got["ratio_std"]) == pytest.approx(float(r.std(unbiased=False)))
    assert all(math.isfinite(_scalar(value)) for value in got.values())


def test_metrics_are_zero_when_rollout_and_trainer_agree_and_without_tokens() -> None:
    same = torch.full((2, 3), -1.5)
    for mask in (torch.ones(2, 3), torch.zeros(2, 3)):
        got = mismatch_metrics(same, same, mask)
        assert {name: _scalar(v) for name, v in got.items()} == {
            "kl": 0.0,
            "abs_log_prob_diff": 0.0,
            "abs_log_prob_diff_max": 0.0,
            "ratio_std": 0.0,
            "ratio_min": 1.0,
            "ratio_max": 1.0,
        }


def test_k3_sees_symmetric_noise_that_k1_averages_away() -> None:
    """Why k3: numeric noise of both signs has a k1 mean of 0, while k3 ~ mean((log r)^2) / 2 > 0."""
    trainer = torch.tensor([[0.1, -0.1, 0.1, -0.1]])
    got = mismatch_metrics(trainer, torch.zeros(1, 4), torch.ones(1, 4))
    assert float(trainer.mean()) == pytest.approx(0.0)  # k1
    assert _scalar(got["kl"]) == pytest.approx(0.5 * 0.1**2, rel=0.01)
    # and it is never negative, token by token
    noise = torch.randn(64, 16, generator=torch.Generator().manual_seed(0))
    assert _scalar(mismatch_metrics(noise, torch.zeros_like(noise), torch.ones_like(noise))["kl"]) > 0


# --------------------------------------------------------------------------- the corrections


def test_truncated_weights_by_hand() -> None:
    # ratios e^0 = 1, e^-1, e^2 (truncated to 2) and a masked token whose NaN must not leak
    trainer = torch.tensor([[0.0, -1.0, 2.0, NAN]])
    mask = torch.tensor([[1, 1, 1, 0]])
    weights = truncated_importance_weights(trainer, torch.zeros(1, 4), mask, max_weight=2.0)
    assert torch.allclose(weights, torch.tensor([[1.0, math.exp(-1.0), 2.0, 0.0]]))
    weights, stats = correction_weights(RolloutCorrection("token-truncate"), trainer, torch.zeros(1, 4), mask)
    assert torch.allclose(weights, torch.tensor([[1.0, math.exp(-1.0), 2.0, 0.0]]))
    assert _scalar(stats["is_truncated_fraction"]) == pytest.approx(1 / 3)
    assert _scalar(stats["is_weight_mean"]) == pytest.approx((1 + math.exp(-1) + 2) / 3)
    assert "is_masked_fraction" not in stats and not weights.requires_grad


def test_token_mask_drops_the_tokens_outside_the_band() -> None:
    # ratios 1 (kept), e^-1 = 0.37 (< 0.5: dropped), e^0.5 = 1.65 (kept), e^1 = 2.7 (> 2: dropped)
    trainer = torch.tensor([[0.0, -1.0, 0.5, 1.0, NAN]])
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    weights, stats = correction_weights(RolloutCorrection("token-mask"), trainer, torch.zeros(1, 5), mask)
    assert weights.tolist() == [[1.0, 0.0, 1.0, 0.0, 0.0]]
    assert _scalar(stats["is_masked_fraction"]) == pytest.approx(0.5)
    assert _scalar(stats["is_weight_mean"]) == pytest.approx(0.5)
    narrow = RolloutCorrection("token-mask", lower=0.9, upper=1.1)
    assert correction_weights(narrow, trainer, torch.zeros(1, 5), mask)[0].tolist() == [[1.0, 0, 0, 0, 0]]


def test_sequence_mask_keeps_or_drops_whole_responses_by_their_geometric_mean() -> None:
    trainer = torch.tensor(
        [
            [0.01, -0.01, 0.0, 0.0],  # geometric mean 1: kept
            [0.002, 0.002, NAN, NAN],  # e^0.002 = 1.002 > 1.001: dropped, padding ignored
            [1.0, -1.0, 1.0, -1.0],  # large per-token gaps that cancel: kept (by the mean, not the max)
            [5.0, 0.0, 0.0, 0.0],  # no valid token: nothing to drop
        ]
    )
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]])
    correction = RolloutCorrection("sequence-mask", lower=0.999, upper=1.001)
    weights, stats = correction_weights(correction, trainer, torch.zeros(4, 4), mask)
    assert weights.tolist() == [[1.0] * 4, [0.0] * 4, [1.0] * 4, [0.0] * 4]
    assert _scalar(stats["is_masked_fraction"]) == pytest.approx(2 / 10)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"kind": "clip"}, "not supported; use one of token-truncate, token-mask, sequence-mask"),
        ({"kind": "token-truncate", "max_weight": 0.5}, "max_weight=0.5 must be >= 1"),
        ({"kind": "token-mask", "lower": 1.0, "upper": 2.0}, "0 < lower < 1 < upper"),
    ],
)
def test_a_bad_correction_is_refused_with_what_is_allowed(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RolloutCorrection(**kwargs)


# --------------------------------------------------------------------------- the objective


def _objective_inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    log_probs = torch.randn(4, 5, generator=g)
    return {
        "log_probs": log_probs,
        "old": log_probs + 0.05 * torch.randn(4, 5, generator=g),
        "rollout": log_probs + 1.0 * torch.randn(4, 5, generator=g),
        "adv": torch.randn(4, 5, generator=g),
        "mask": torch.tensor([[1] * 5, [1, 1, 1, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 0]]),
    }


def _loss_and_grad(
    algo: AlgorithmSpec, inputs: dict[str, torch.Tensor], **extra: Any
) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
    log_probs = inputs["log_probs"].clone().requires_grad_(True)
    loss, metrics = actor_objective(
        algo,
        log_probs,
        torch.rand(4, 5, generator=torch.Generator().manual_seed(4)),
        old_log_probs=inputs["old"],
        advantages=inputs["adv"],
        response_mask=inputs["mask"],
        ref_log_probs=None,
        **extra,
    )
    loss.backward()
    assert log_probs.grad is not None
    return loss.detach(), log_probs.grad, metrics


def test_without_a_correction_the_loss_is_bit_for_bit_todays() -> None:
    algo = AlgorithmSpec.model_validate({"name": "grpo", "samplesPerPrompt": 2, "entropyCoef": 0.01})
    inputs = _objective_inputs()
    plain_loss, plain_grad, plain_metrics = _loss_and_grad(algo, inputs)
    measured_loss, measured_grad, metrics = _loss_and_grad(algo, inputs, rollout_log_probs=inputs["rollout"])
    assert torch.equal(measured_loss, plain_loss) and torch.equal(measured_grad, plain_grad)
    assert float(metrics["off_policy/kl"]) > 0 and not any(k.startswith("off_policy/") for k in plain_metrics)
    assert "off_policy/is_weight_mean" not in metrics
    for kind in ("token-truncate", "token-mask", "sequence-mask"):
        _, grad, corrected = _loss_and_grad(
            algo, inputs, rollout_log_probs=inputs["rollout"], correction=RolloutCorrection(kind)
        )
        assert not torch.equal(grad, plain_grad), kind
        assert float(corrected["off_policy/is_weight_mean"]) != 1.0, kind


def test_metrics_of_extremes_combine_by_max_and_min_the_rest_by_mean() -> None:
    assert combine_values("off_policy/abs_log_prob_diff_max", [0.1, 0.4, 0.2]) == 0.4
    assert combine_values("off_policy/ratio_max", [1.1, 1.3]) == 1.3
    assert combine_values("off_policy/ratio_min", [0.9, 0.7]) == 0.7
    assert combine_values("off_policy/kl", [0.1, 0.3]) == pytest.approx(0.2)
    assert combine_values("some/uncatalogued", [1.0, 2.0]) == 1.5
    with pytest.raises(ValueError, match="no values to combine for 'off_policy/kl'"):
        combine_values("off_policy/kl", [])


# --------------------------------------------------------------------------- when the spec corrects


def _job(rollout: dict[str, Any] | None = None, **training: Any) -> RLHFJobSpec:
    return RLHFJobSpec.model_validate(
        {
            "models": {"actor": {"path": "/models/actor"}},
            "data": {"trainFiles": ["/data/prompts.jsonl"]},
            "algorithm": {"name": "grpo", "samplesPerPrompt": 2},
            "rollout": {"engine": "torch", **(rollout or {})},
            "training": {"totalSteps": 2, "promptsPerStep": 2, "miniBatchSize": 4, **training},
            "rewards": [{"function": "target_char"}],
        }
    )


@pytest.mark.parametrize(
    ("importance", "temperature", "dtypes_differ_", "corrects"),
    [
        ({}, 1.0, False, False),  # today's synchronous job: measured, not corrected
        ({}, 1.0, True, True),  # auto: the engine's dtype differs
        ({}, 0.7, True, False),  # auto at another temperature: the log-probs do not compare
        ({}, 0.0, True, False),  # greedy: no distribution to correct from
        ({"mode": "on"}, 1.0, False, True),
        ({"mode": "off"}, 1.0, True, False),
    ],
)
def test_auto_corrects_when_the_dtypes_differ_at_temperature_one(
    importance: dict[str, Any], temperature: float, dtypes_differ_: bool, corrects: bool
) -> None:
    spec = _job({"temperature": temperature, "importanceSampling": importance})
    assert spec.rollout.corrects(dtypes_differ=dtypes_differ_) is corrects
    assert (rollout_correction(spec, dtypes_differ=dtypes_differ_) is not None) is corrects


def test_the_spec_builds_each_correction_with_its_documented_defaults() -> None:
    spec = _job({"importanceSampling": {"mode": "on"}})
    assert rollout_correction(spec, dtypes_differ=False) == RolloutCorrection(
        "token-truncate", max_weight=2.0
    )
    token = _job({"importanceSampling": {"mode": "on", "correction": "token-mask"}})
    assert rollout_correction(token, dtypes_differ=False) == RolloutCorrection(
        "token-mask", lower=0.5, upper=2.0
    )
    sequence = _job({"importanceSampling": {"mode": "on", "correction": "sequence-mask", "maskLower": 0.99}})
    assert rollout_correction(sequence, dtypes_differ=False) == RolloutCorrection(
        "sequence-mask", lower=0.99, upper=1.001
    )


def _ctx(device: str, world_size: int = 1) -> WorkerContext:
    return WorkerContext(
        role="actor",
        pool="default",
        rank=0,
        world_size=world_size,
        local_rank=0,
        local_world_size=1,
        node_id="local",
        mesh=DeviceMesh.data_parallel(world_size),
        device=device,
        backend="gloo",
    )


def test_which_dtype_the_rollout_and_the_trainer_compute_in() -> None:
    bf16 = torch.bfloat16
    # CPU computes in fp32 whatever the precision: equal, nothing to correct by default.
    assert not dtypes_differ(_job(precision="bf16"), _ctx("cpu", 2))
    # A GPU, bf16 training: vLLM and the torch engine's own copy both serve bf16 (equal)...
    vllm = _job({"engine": "vllm"}, precision="bf16")
    assert generation_dtype(vllm, _ctx("cuda:0", 2)) == bf16 == trainer_dtype(vllm, torch.device("cuda"))
    assert generation_dtype(_job(precision="bf16"), _ctx("cuda:0", 2)) == bf16
    assert not dtypes_differ(_job(precision="bf16"), _ctx("cuda:0", 2))
    # ...as does an engine generating from the trainer's own module (one FSDP rank).
    assert generation_dtype(_job(precision="bf16"), _ctx("cuda:0", 1)) == bf16
    assert not dtypes_differ(_job(precision="bf16"), _ctx("cuda:0", 1))
    # fp32 training on a GPU: fp32 everywhere.
    assert not dtypes_differ(_job({"engine": "vllm"}, precision="fp32"), _ctx("cuda:0", 2))


# --------------------------------------------------------------------------- a real gap: bf16 engine, fp32 trainer

PROMPTS = [[11, 12, 13, 14], [21, 22], [31, 32, 33], [41]]
SAMPLES, NEW_TOKENS, PROMPT_WIDTH = 2, 12, 6


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("mismatch") / "qwen2", "qwen2", seed=7)


@pytest.fixture
def world_of_one(tmp_path: Path) -> Iterator[None]:
    if dist.is_initialized():
        pytest.fail("a torch.distributed process group is already initialised in the test process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _spec(model_dir: Path, importance: dict[str, Any] | None = None) -> RLHFJobSpec:
    rows = len(PROMPTS) * SAMPLES
    return RLHFJobSpec.model_validate(
        {
            "models": {"actor": {"path": str(model_dir)}},
            "data": {"trainFiles": ["/data/prompts.jsonl"], "maxPromptTokens": PROMPT_WIDTH},
            "algorithm": {"name": "grpo", "samplesPerPrompt": SAMPLES, "entropyCoef": 0.0},
            "rollout": {
                "engine": "torch",
                "maxResponseTokens": NEW_TOKENS,
                "importanceSampling": importance or {},
            },
            "training": {
                "totalSteps": 10,
                "promptsPerStep": len(PROMPTS),
                "miniBatchSize": rows,
                "microBatchSizePerGpu": 4,
                "learningRate": 1e-2,
                "precision": "fp32",
            },
            "rewards": [{"function": "target_char"}],
        }
    )


def _rollout(model_dir: Path, engine_dtype: torch.dtype) -> Batch:
    """Responses and their log-probs from a torch engine in ``engine_dtype``, in the trainer's layout."""
    engine = TorchRolloutEngine(model_dir, dtype=engine_dtype)
    params = SamplingParams(max_new_tokens=NEW_TOKENS, n=SAMPLES, seed=5, return_logprobs=True)
    output = engine.generate(PROMPTS, params)
    engine.close()
    packed = response_tensors(
        PROMPTS, output, pad_id=PAD_TOKEN_ID, max_prompt_len=PROMPT_WIDTH, max_response_len=NEW_TOKENS
    )
    mask = packed["response_mask"]
    rows = mask.shape[0]
    advantages = torch.linspace(-1.0, 1.0, rows).unsqueeze(-1).expand(rows, NEW_TOKENS) * mask
    tensors = {name: value for name, value in packed.items() if isinstance(value, torch.Tensor)}
    return Batch.from_dict({**tensors, "advantages": advantages})


def _actor(spec: RLHFJobSpec, *, rollout_dtype: torch.dtype) -> ActorWorker:
    """An fp32 FSDP actor whose correction is decided from the test engine's dtype.

    On a CPU no manifest gives a bf16 engine (``engine_dtype`` serves fp32 there), so the dtype the
    actor would compute from its context is replaced by the one the test's engine really used.
    """
    actor = ActorWorker(_ctx("cpu"), spec)
    differ = rollout_dtype != trainer_dtype(spec, torch.device("cpu"))
    actor.correction = rollout_correction(spec, dtypes_differ=differ)
    return actor


def _update(spec: RLHFJobSpec, batch: Batch, rollout_dtype: torch.dtype) -> tuple[dict[str, float], Any]:
    actor = _actor(spec, rollout_dtype=rollout_dtype)
    metrics = actor.update_policy(batch)
    return metrics, full_state_dict(actor.model)


@pytest.mark.usefixtures("world_of_one")
@pytest.mark.parametrize(
    ("importance", "acting"),
    [
        ({}, "off_policy/is_truncated_fraction"),  # auto, token-truncate: on because the dtypes differ
        # Bands this narrow because the tiny random model's logits are small: bf16 moves its
        # log-probs by ~1e-3 (a real model's, with larger logits, by more).
        (
            {"correction": "token-mask", "maskLower": 0.999, "maskUpper": 1.001},
            "off_policy/is_masked_fraction",
        ),
        (
            {"correction": "sequence-mask", "maskLower": 0.9999, "maskUpper": 1.0001},
            "off_policy/is_masked_fraction",
        ),
    ],
    ids=["token-truncate", "token-mask", "sequence-mask"],
)
def test_a_bf16_engine_against_an_fp32_trainer_is_measured_and_corrected(
    model_dir: Path, importance: dict[str, Any], acting: str
) -> None:
    batch = _rollout(model_dir, torch.bfloat16)
    spec = _spec(model_dir, importance)
    corrected, corrected_weights = _update(spec, batch, torch.bfloat16)
    # The gap is there: bf16 weights and activations against the fp32 forward.
    assert corrected["off_policy/kl"] > 1e-8
    assert corrected["off_policy/abs_log_prob_diff"] > 1e-4
    assert corrected["off_policy/abs_log_prob_diff_max"] > corrected["off_policy/abs_log_prob_diff"]
    assert corrected["off_policy/ratio_std"] > 0
    assert corrected["off_policy/ratio_min"] < 1 < corrected["off_policy/ratio_max"]
    # The correction acts: weights not all 1, and the update differs from the uncorrected one.
    assert corrected["off_policy/is_weight_mean"] != 1.0
    if acting == "off_policy/is_masked_fraction":
        assert corrected[acting] > 0
    uncorrected, plain_weights = _update(
        _spec(model_dir, {**importance, "mode": "off"}), batch, torch.bfloat16
    )
    assert "off_policy/is_weight_mean" not in uncorrected
    assert uncorrected["off_policy/kl"] == corrected["off_policy/kl"]  # measured either way, alike
    assert uncorrected["actor/policy_loss"] != corrected["actor/policy_loss"]
    assert any(not torch.equal(corrected_weights[name], plain_weights[name]) for name in plain_weights)


@pytest.mark.usefixtures("world_of_one")
def test_with_equal_dtypes_the_gap_is_about_zero_and_the_update_unchanged(model_dir: Path) -> None:
    batch = _rollout(model_dir, torch.float32)
    spec = _spec(model_dir)  # mode auto, maxStaleness 0, fp32 engine and trainer
    measured, weights = _update(spec, batch, torch.float32)
    assert measured["off_policy/kl"] < 1e-10 and measured["off_policy/abs_log_prob_diff_max"] < 1e-4
    assert "off_policy/is_weight_mean" not in measured  # no correction
    # Today's path: the batch without the rollout's log-probs. Bit for bit the same update.
    today = batch.select([name for name in batch.tensors if name != "rollout_log_probs"])
    before, before_weights = _update(spec, today, torch.float32)
    assert not any(key.startswith("off_policy/") for key in before)
    assert measured["actor/policy_loss"] == before["actor/policy_loss"]
    assert measured["actor/grad_norm"] == before["actor/grad_norm"]
    for name, tensor in before_weights.items():
        assert torch.equal(weights[name], tensor), name
