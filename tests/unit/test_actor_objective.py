"""The actor objective both backends train with: clipped surrogate - entropy bonus (+ KL loss)."""

import pytest
import torch

from hybridflow.rlmath import core
from hybridflow.rlmath.objectives import actor_objective
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
