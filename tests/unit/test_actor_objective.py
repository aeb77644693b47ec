"""The actor objective both backends train with: clipped surrogate - entropy bonus (+ KL loss)."""

import pytest
import torch

from hybridflow.rlmath import core
from hybridflow.rlmath.objectives import actor_objective
from hybridflow.rlmath.rollout_correction import RolloutCorrection
from hybridflow.spec import AlgorithmSpec

pytestmark = pytest.mark.unit


def test_objective_composes_policy_entropy_and_kl_terms() -> None:
    algo = AlgorithmSpec.model_validate(
        {"name": "grpo", "samplesPerPrompt": 2, "entropyCoef": 0.01, "kl": {"coef": 0.1}}
    )
    torch.manual_seed(0)
    log_probs, old, ref, adv = (torch.randn(3, 4) for _ in range(4))
    entropy = torch.rand(3, 4)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
    without_kl, metrics = actor_objective(
        algo, log_probs, entropy, old_log_probs=old, advantages=adv, response_mask=mask, ref_log_probs=None
    )
    policy, _ = core.policy_loss_clipped(log_probs, old, adv, mask.float(), 0.2, 0.2)
    expected = policy - 0.01 * core.masked_mean(entropy, mask.float())
    assert torch.allclose(without_kl, expected)
    assert "actor/kl_loss" not in metrics
    with_kl, metrics = actor_objective(
        algo, log_probs, entropy, old_log_probs=old, advantages=adv, response_mask=mask, ref_log_probs=ref
    )
    kl = core.masked_mean(core.kl_penalty(log_probs, ref, "k3"), mask.float())
    assert torch.allclose(with_kl, expected + 0.1 * kl)
    assert torch.allclose(metrics["actor/kl_loss"], kl)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="entropy"):
        actor_objective(
            algo, log_probs, None, old_log_probs=old, advantages=adv, response_mask=mask, ref_log_probs=None
        )


def test_importance_weights_scale_each_tokens_policy_loss() -> None:
    algo = AlgorithmSpec.model_validate({"name": "grpo", "samplesPerPrompt": 2, "entropyCoef": 0.0})
    torch.manual_seed(1)
    log_probs = torch.randn(2, 3, requires_grad=True)
    old = log_probs.detach().clone()
    behaviour = old - torch.tensor([[0.0, 1.0, -1.0], [3.0, 0.0, 0.0]])  # ratios 1, e, 1/e, e^3
    adv = torch.randn(2, 3)
    mask = torch.ones(2, 3)
    entropy = torch.zeros(2, 3)
    loss, metrics = actor_objective(
        algo,
        log_probs,
        entropy,
        old_log_probs=old,
        advantages=adv,
        response_mask=mask,
        ref_log_probs=None,
        rollout_log_probs=behaviour,
        correction=RolloutCorrection("token-truncate", max_weight=2.0),
    )
    weights = torch.tensor([[1.0, 2.0, torch.tensor(-1.0).exp().item()], [2.0, 1.0, 1.0]])
    # On the proximal policy the PPO ratio is 1: each token's loss is -A * w, token-mean.
    assert torch.allclose(loss, (-adv * weights).mean())
    assert metrics["off_policy/is_truncated_fraction"] == pytest.approx(2 / 6)
    assert torch.isclose(metrics["off_policy/is_weight_mean"], weights.mean())  # type: ignore[arg-type]
    assert float(metrics["off_policy/kl"]) > 0
    loss.backward()
    assert log_probs.grad is not None
    # Without a correction the same call only reports the gap (tests/unit/test_rollout_correction.py
    # has the weights and metrics by hand).
    plain, metrics = actor_objective(
        algo,
        log_probs,
        entropy,
        old_log_probs=old,
        advantages=adv,
        response_mask=mask,
        ref_log_probs=None,
        rollout_log_probs=behaviour,
    )
    assert torch.allclose(plain, (-adv).mean()) and "off_policy/is_weight_mean" not in metrics
    with pytest.raises(ValueError, match="rollout's log-probs"):
        actor_objective(
            algo,
            log_probs,
            entropy,
            old_log_probs=old,
            advantages=adv,
            response_mask=mask,
            ref_log_probs=None,
            correction=RolloutCorrection("token-truncate", max_weight=2.0),
        )


def test_clip_ratio_c_dual_clips_and_reports_the_fraction() -> None:
    plain = AlgorithmSpec.model_validate({"name": "ppo", "entropyCoef": 0.0})
    dual = AlgorithmSpec.model_validate({"name": "ppo", "entropyCoef": 0.0, "clipRatioC": 3.0})
    log_probs = torch.log(torch.tensor([[5.0, 1.0]]))  # ratio 5 and 1 against old log-probs 0
    inputs = {
        "old_log_probs": torch.zeros(1, 2),
        "advantages": torch.tensor([[-1.0, -1.0]]),
        "response_mask": torch.ones(1, 2),
        "ref_log_probs": None,
    }
    entropy = torch.zeros(1, 2)
    loss, metrics = actor_objective(plain, log_probs, entropy, **inputs)  # type: ignore[arg-type]
    assert loss.item() == pytest.approx((5.0 + 1.0) / 2) and "actor/dual_clipfrac" not in metrics
    loss, metrics = actor_objective(dual, log_probs, entropy, **inputs)  # type: ignore[arg-type]
    assert loss.item() == pytest.approx((3.0 + 1.0) / 2)
    assert metrics["actor/dual_clipfrac"] == pytest.approx(0.5)
    assert metrics["actor/policy_loss"].item() == pytest.approx(2.0)  # type: ignore[union-attr]


@pytest.mark.parametrize("value", [1.0, 0.5])
def test_clip_ratio_c_must_exceed_one(value: float) -> None:
    with pytest.raises(ValueError, match="clipRatioC\n  Input should be greater than 1"):
        AlgorithmSpec.model_validate({"name": "ppo", "clipRatioC": value})
