"""The shared RL math: hand-computed cases, masking guarantees, and GAE against a plain loop."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridflow.rlmath.core import (
    AdaptiveKLController,
    FixedKLController,
    KLEstimator,
    LagrangeMultiplier,
    apply_kl_penalty_to_rewards,
    combine_reward_cost_advantages,
    compute_gae_advantages,
    entropy_from_logits,
    grpo_outcome_advantages,
    kl_penalty,
    masked_entropy,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
    place_outcome_score,
    place_token_rewards,
    policy_loss_clipped,
    reinforce_plus_plus_advantages,
    remax_outcome_advantages,
    rloo_outcome_advantages,
    value_loss_clipped,
)

pytestmark = pytest.mark.unit

NAN = float("nan")


def t(rows: object) -> torch.Tensor:
    """A float64 tensor, so hand-computed values compare tightly."""
    return torch.tensor(rows, dtype=torch.float64)


# --------------------------------------------------------------------------- masked reductions


def test_masked_sum_and_mean_ignore_padding_even_if_it_is_nan() -> None:
    values = t([[1.0, 2.0, NAN], [4.0, NAN, NAN]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.float32)
    assert masked_sum(values, mask).item() == pytest.approx(7.0)
    assert masked_mean(values, mask).item() == pytest.approx(7.0 / 3)
    torch.testing.assert_close(masked_mean(values, mask, dim=-1), t([1.5, 4.0]))
    torch.testing.assert_close(masked_sum(values, mask.bool(), dim=0), t([5.0, 2.0, 0.0]))


def test_all_zero_mask_gives_zeros_not_nan() -> None:
    values = t([[1.0, 2.0], [3.0, 4.0]])
    mask = torch.zeros(2, 2)
    assert masked_mean(values, mask).item() == 0.0
    torch.testing.assert_close(masked_mean(values, mask, dim=-1), t([0.0, 0.0]))
    assert masked_var(values, mask).item() == 0.0
    torch.testing.assert_close(masked_whiten(values, mask), torch.zeros_like(values))


def test_masked_var_is_unbiased() -> None:
    values = t([[1.0, 2.0, 3.0, 100.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    assert masked_var(values, mask).item() == pytest.approx(1.0)  # sample variance of 1, 2, 3
    assert masked_var(values, torch.tensor([[1, 0, 0, 0]])).item() == 0.0


def test_masked_whiten_has_zero_mean_unit_variance_over_valid_tokens() -> None:
    generator = torch.Generator().manual_seed(0)
    values = torch.randn(4, 6, generator=generator, dtype=torch.float64) * 3 + 5
    mask = torch.ones(4, 6)
    mask[1, 3:] = 0
    mask[3, 1:] = 0
    whitened = masked_whiten(values, mask)
    assert masked_mean(whitened, mask).item() == pytest.approx(0.0, abs=1e-9)
    assert masked_var(whitened, mask).item() == pytest.approx(1.0, rel=1e-6)
    assert torch.all(whitened[mask == 0] == 0)
    unshifted = masked_whiten(values, mask, shift_mean=False)
    assert masked_mean(unshifted, mask).item() == pytest.approx(masked_mean(values, mask).item())


def test_masked_whiten_of_a_constant_is_zero() -> None:
    torch.testing.assert_close(masked_whiten(torch.full((2, 3), 7.0), torch.ones(2, 3)), torch.zeros(2, 3))


# --------------------------------------------------------------------------- GAE


def test_gae_hand_computed_three_tokens() -> None:
    # gamma=0.9, lam=0.8 (gamma*lam = 0.72); reward only on the last token.
    #   t=2: delta = 1 - 0.3                 = 0.7   A = 0.7
    #   t=1: delta = 0.9*0.3 - 0.2           = 0.07  A = 0.07 + 0.72*0.7   = 0.574
    #   t=0: delta = 0.9*0.2 - 0.1           = 0.08  A = 0.08 + 0.72*0.574 = 0.49328
    advantages, returns = compute_gae_advantages(
        t([[0.0, 0.0, 1.0]]), t([[0.1, 0.2, 0.3]]), torch.ones(1, 3), gamma=0.9, lam=0.8
    )
    torch.testing.assert_close(advantages, t([[0.49328, 0.574, 0.7]]))
    torch.testing.assert_close(returns, t([[0.59328, 0.774, 1.0]]))


def test_gae_with_gamma_lam_one_returns_are_reward_to_go() -> None:
    advantages, returns = compute_gae_advantages(
        t([[0.0, 1.0]]), t([[0.5, 0.2]]), torch.ones(1, 2), gamma=1.0, lam=1.0
    )
    torch.testing.assert_close(advantages, t([[0.5, 0.8]]))
    torch.testing.assert_close(returns, t([[1.0, 1.0]]))


def test_gae_right_padding_bootstraps_zero_and_ignores_padding_values() -> None:
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    rewards = t([[0.0, 0.0, 1.0, NAN, 5.0], [0.0, 0.0, 1.0, 0.0, 0.0]])
    values = t([[0.1, 0.2, 0.3, 99.0, NAN], [0.1, 0.2, 0.3, 1.0, 0.0]])
    advantages, returns = compute_gae_advantages(rewards, values, mask, gamma=0.9, lam=0.8)
    torch.testing.assert_close(advantages[0, :3], t([0.49328, 0.574, 0.7]))
    torch.testing.assert_close(advantages[0, 3:], t([0.0, 0.0]))
    torch.testing.assert_close(returns[0, 3:], t([0.0, 0.0]))
    # The unpadded row continues past t=2, so its values differ: padding is not an episode end
    # for a row whose response really is longer.
    assert advantages[1, 2].item() != pytest.approx(0.7)


def gae_reference(
    rewards: list[float], values: list[float], valid: list[bool], gamma: float, lam: float
) -> tuple[list[float], list[float]]:
    """Textbook GAE over one row's valid tokens, written as a plain loop, scattered back."""
    positions = [i for i, is_valid in enumerate(valid) if is_valid]
    advantages = [0.0] * len(rewards)
    returns = [0.0] * len(rewards)
    next_value = 0.0
    next_advantage = 0.0
    for position in reversed(positions):
        delta = rewards[position] + gamma * next_value - values[position]
        next_advantage = delta + gamma * lam * next_advantage
        next_value = values[position]
        advantages[position] = next_advantage
        returns[position] = next_advantage + values[position]
    return advantages, returns


@st.composite
def gae_batches(
    draw: st.DrawFn,
) -> tuple[list[list[float]], list[list[float]], list[list[bool]], float, float]:
    batch_size = draw(st.integers(1, 4))
    response_len = draw(st.integers(1, 8))
    number = st.floats(-5.0, 5.0, allow_nan=False)
    rewards = [
        draw(st.lists(number, min_size=response_len, max_size=response_len)) for _ in range(batch_size)
    ]
    values = [draw(st.lists(number, min_size=response_len, max_size=response_len)) for _ in range(batch_size)]
    if draw(st.booleans()):  # right-padded, the common case
        lengths = [draw(st.integers(0, response_len)) for _ in range(batch_size)]
        valid = [[i < length for i in range(response_len)] for length in lengths]
    else:  # arbitrary holes, e.g. masked tool output inside a multi-turn response
        valid = [
            draw(st.lists(st.booleans(), min_size=response_len, max_size=response_len))
            for _ in range(batch_size)
        ]
    gamma = draw(st.floats(0.0, 1.0))
    lam = draw(st.floats(0.0, 1.0))
    return rewards, values, valid, gamma, lam


@settings(max_examples=200, deadline=None)
@given(gae_batches())
def test_gae_matches_plain_loop(
    batch: tuple[list[list[float]], list[list[float]], list[list[bool]], float, float],
) -> None:
    rewards, values, valid, gamma, lam = batch
    advantages, returns = compute_gae_advantages(t(rewards), t(values), torch.tensor(valid), gamma, lam)
    for row in range(len(rewards)):
        expected_advantages, expected_returns = gae_reference(
            rewards[row], values[row], valid[row], gamma, lam
        )
        torch.testing.assert_close(advantages[row], t(expected_advantages))
        torch.testing.assert_close(returns[row], t(expected_returns))


def test_gae_outputs_are_detached() -> None:
    values = t([[0.1, 0.2]]).requires_grad_()
    advantages, returns = compute_gae_advantages(t([[0.0, 1.0]]), values, torch.ones(1, 2), 1.0, 0.95)
    assert not advantages.requires_grad
    assert not returns.requires_grad


# --------------------------------------------------------------------------- outcome advantages


def test_grpo_group_normalized_with_unbiased_std() -> None:
    scores = t([1.0, 0.0, 1.0, 0.0, 3.0])
    mask = torch.tensor([[1, 1], [1, 0], [1, 1], [1, 1], [1, 1]])
    advantages = grpo_outcome_advantages(scores, [7, 7, 7, 7, 9], mask, eps=0.0)
    # Group 7: mean 0.5, sample std sqrt(1/3); group 9 has one member and gets 0.
    expected = 0.5 / math.sqrt(1 / 3)
    torch.testing.assert_close(
        advantages,
        t([[expected, expected], [-expected, 0.0], [expected, expected], [-expected, -expected], [0, 0]]),
    )


def test_grpo_accepts_tensor_and_string_group_ids_and_mean_only_mode() -> None:
    scores = t([2.0, 4.0, 10.0, 10.0])
    mask = torch.ones(4, 1)
    by_tensor = grpo_outcome_advantages(scores, torch.tensor([0, 0, 1, 1]), mask, normalize_by_std=False)
    by_uid = grpo_outcome_advantages(scores, ["p0", "p0", "p1", "p1"], mask, normalize_by_std=False)
    torch.testing.assert_close(by_tensor, t([[-1.0], [1.0], [0.0], [0.0]]))
    torch.testing.assert_close(by_uid, by_tensor)
    # A group whose scores are all equal has zero advantage even when normalizing by std.
    normalized = grpo_outcome_advantages(scores, [0, 0, 1, 1], mask)
    assert normalized[2:].abs().max().item() == 0.0


def test_grpo_rejects_mismatched_group_ids() -> None:
    with pytest.raises(ValueError, match="group_ids has 2 entries but there are 3 scores"):
        grpo_outcome_advantages(t([1.0, 2.0, 3.0]), [0, 0], torch.ones(3, 2))


def test_rloo_leave_one_out_baseline() -> None:
    scores = t([1.0, 2.0, 6.0, 5.0])
    advantages = rloo_outcome_advantages(scores, [0, 0, 0, 1], torch.ones(4, 2))
    # Baselines 8/2, 7/2, 3/2 for the group of three; the singleton gets 0.
    torch.testing.assert_close(advantages[:, 0], t([-3.0, -1.5, 4.5, 0.0]))
    torch.testing.assert_close(advantages[:, 1], advantages[:, 0])


def test_remax_subtracts_greedy_baseline_on_valid_tokens() -> None:
    advantages = remax_outcome_advantages(t([1.0, 0.5]), t([0.2, 0.5]), torch.tensor([[1, 1, 0], [1, 1, 1]]))
    torch.testing.assert_close(advantages, t([[0.8, 0.8, 0.0], [0.0, 0.0, 0.0]]))


def test_reinforce_plus_plus_discounted_returns_then_global_whitening() -> None:
    token_rewards = t([[0.0, 0.0, 1.0], [0.0, 2.0, NAN]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    advantages, returns = reinforce_plus_plus_advantages(token_rewards, mask, gamma=1.0)
    torch.testing.assert_close(returns, t([[1.0, 1.0, 1.0], [2.0, 2.0, 0.0]]))
    # Valid returns 1,1,1,2,2: mean 1.4, sample variance 0.3.
    std = math.sqrt(0.3)
    low, high = -0.4 / std, 0.6 / std
    torch.testing.assert_close(advantages, t([[low, low, low], [high, high, 0.0]]), rtol=1e-6, atol=1e-6)

    _, discounted = reinforce_plus_plus_advantages(token_rewards[:1], mask[:1], gamma=0.5)
    torch.testing.assert_close(discounted, t([[0.25, 0.5, 1.0]]))


# --------------------------------------------------------------------------- KL and token rewards


@pytest.mark.parametrize(
    ("estimator", "expected"),
    [
        ("k1", math.log(2)),  # log 0.5 - log 0.25
        ("k2", 0.5 * math.log(2) ** 2),
        ("k3", 0.5 + math.log(2) - 1),  # exp(-log 2) - (-log 2) - 1
    ],
)
def test_kl_estimators_on_chosen_numbers(estimator: KLEstimator, expected: float) -> None:
    value = kl_penalty(t([math.log(0.5)]), t([math.log(0.25)]), estimator)
    assert value.item() == pytest.approx(expected)


def test_kl_estimators_vanish_when_policies_agree_and_k3_is_nonnegative_and_finite() -> None:
    logprob = t([-0.1, -2.0, -50.0, -1.0])
    for estimator in ("k1", "k2", "k3"):
        assert kl_penalty(logprob, logprob, estimator).abs().max().item() == 0.0
    k3 = kl_penalty(t([-1.0, -0.01, 0.0, -100.0]), t([-0.01, -1.0, -200.0, 0.0]), "k3")
    assert torch.all(k3 >= 0)
    assert torch.all(torch.isfinite(k3))
    # The log-ratio is clamped to [-20, 20] before exp.
    assert k3[3].item() == pytest.approx(math.exp(20) - 20 - 1)


def test_kl_unknown_estimator_names_allowed_values() -> None:
    with pytest.raises(ValueError, match=r"'low_var_kl' is not supported; use one of k1, k2, k3"):
        kl_penalty(t([0.0]), t([0.0]), "low_var_kl")  # type: ignore[arg-type]


def test_place_outcome_score_on_last_valid_token() -> None:
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 1], [0, 0, 0]])
    token_rewards = place_outcome_score(t([1.0, 2.0, 3.0, 4.0]), mask)
    torch.testing.assert_close(token_rewards, t([[0, 0, 1.0], [0, 2.0, 0], [0, 0, 3.0], [0, 0, 0]]))


def test_place_token_rewards_keeps_each_value_on_its_token_and_credits_masked_ones_back() -> None:
    mask = torch.tensor([[1, 1, 1], [1, 0, 1], [0, 1, 1], [0, 0, 0]])
    values = t([[0.1, 0.2, 0.3], [0.1, 0.2, 0.3], [0.1, 0.2, 0.3], [0.1, 0.2, 0.3]])
    token_rewards = place_token_rewards(t([1.0, 2.0, 3.0, 4.0]), values, mask)
    # Row 1's masked middle token (a tool result) goes to the token before it; row 2's leading
    # masked token has none before it and goes to the first valid one; row 3 has no valid token.
    expected = t([[0.1, 0.2, 1.3], [0.3, 0.0, 2.3], [0.0, 0.3, 3.3], [0.0, 0.0, 0.0]])
    torch.testing.assert_close(token_rewards, expected)
    torch.testing.assert_close(
        place_token_rewards(t([1.0, 2.0, 3.0, 4.0]), torch.zeros(4, 3), mask),
        place_outcome_score(t([1.0, 2.0, 3.0, 4.0]), mask),
    )


def test_gae_credits_a_token_level_reward_where_it_falls() -> None:
    """gamma = lambda = 1, values 0: a token's advantage is the reward from it to the end."""
    mask = torch.ones(1, 3)
    values = t([[0.0, 0.0, 0.0]])
    on_first = place_token_rewards(t([0.0]), t([[1.0, 0.0, 0.0]]), mask)
    advantages, _ = compute_gae_advantages(on_first, values, mask, 1.0, 1.0)
    torch.testing.assert_close(advantages, t([[1.0, 0.0, 0.0]]))  # only the token that earned it
    outcome, _ = compute_gae_advantages(place_outcome_score(t([1.0]), mask), values, mask, 1.0, 1.0)
    torch.testing.assert_close(outcome, t([[1.0, 1.0, 1.0]]))  # the same sum as a scalar: every token


def test_apply_kl_penalty_to_rewards_subtracts_scaled_kl_and_averages_per_sequence() -> None:
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    token_scores = place_outcome_score(t([1.0, 2.0]), mask)
    ref_logprob = t([[-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0]])
    logprob = ref_logprob + t([[0.1, 0.1, 0.1], [0.4, 0.4, 9.0]])
    token_rewards, mean_kl = apply_kl_penalty_to_rewards(token_scores, logprob, ref_logprob, mask, 0.5, "k1")
    torch.testing.assert_close(token_rewards, t([[-0.05, -0.05, 0.95], [-0.2, 1.8, 0.0]]))
    # Mean of per-response means (0.1 and 0.4), not the token mean (0.22); padding's 9.0 ignored.
    assert mean_kl.item() == pytest.approx(0.25)


# --------------------------------------------------------------------------- losses


def test_policy_loss_clipped_hand_computed() -> None:
    old_logprob = t([[0.0, 0.0, 0.0, 0.0]])
    logprob = t([[math.log(1.5), math.log(0.5), math.log(1.1), 100.0]]).requires_grad_()
    advantages = t([[1.0, 1.0, -1.0, 1.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    loss, metrics = policy_loss_clipped(logprob, old_logprob, advantages, mask, 0.2, 0.2)
    # token 0: ratio 1.5 clipped to 1.2 -> -1.2 (clipped); token 1: ratio 0.5, A > 0 -> -0.5;
    # token 2: ratio 1.1 inside the range -> 1.1; token 3 is padding.
    assert loss.item() == pytest.approx((-1.2 - 0.5 + 1.1) / 3)
    assert metrics["clipfrac"].item() == pytest.approx(1 / 3)
    assert metrics["approx_kl"].item() == pytest.approx(-(math.log(1.5) + math.log(0.5) + math.log(1.1)) / 3)
    loss.backward()
    assert logprob.grad is not None
    # d(-A ratio)/d logprob = -A ratio; the clipped token and the padding get no gradient.
    torch.testing.assert_close(logprob.grad, t([[0.0, -0.5 / 3, 1.1 / 3, 0.0]]))


def test_policy_loss_clip_higher_widens_the_upper_bound_only() -> None:
    logprob = t([[math.log(1.5), math.log(0.5)]])
    old_logprob = torch.zeros_like(logprob)
    loss, metrics = policy_loss_clipped(logprob, old_logprob, t([[1.0, -1.0]]), torch.ones(1, 2), 0.2, 0.6)
    # token 0: 1.5 within [0.8, 1.6] -> -1.5; token 1: A < 0, ratio 0.5 clipped up to 0.8 -> 0.8.
    assert loss.item() == pytest.approx((-1.5 + 0.8) / 2)
    assert metrics["clipfrac"].item() == pytest.approx(0.5)


def test_dual_clip_caps_the_loss_of_negative_advantages_by_hand() -> None:
    # ratios 5, 2, 0.5, 5, 1; advantages -1, -1, -1, +1, -2; clip 0.2, c = 3.
    logprob = t([[math.log(5.0), math.log(2.0), math.log(0.5), math.log(5.0), 0.0]]).requires_grad_()
    old_logprob = torch.zeros_like(logprob)
    advantages = t([[-1.0, -1.0, -1.0, 1.0, -2.0]])
    mask = torch.ones(1, 5)
    loss, metrics = policy_loss_clipped(logprob, old_logprob, advantages, mask, 0.2, 0.2, clip_ratio_c=3.0)
    # token 0: max(5, 1.2) = 5 > c * 1 = 3 -> 3 (dual-clipped, no gradient); token 1: max(2, 1.2) = 2
    # below 3 -> 2; token 2: max(0.5, 0.8) = 0.8 (clipped low); token 3: A > 0, never dual-clipped:
    # max(-5, -1.2) = -1.2; token 4: ratio 1 -> 2, below c * 2 = 6.
    assert loss.item() == pytest.approx((3.0 + 2.0 + 0.8 - 1.2 + 2.0) / 5)
    assert metrics["dual_clipfrac"].item() == pytest.approx(1 / 5)
    assert metrics["clipfrac"].item() == pytest.approx(2 / 5)  # tokens 2 and 3
    loss.backward()
    assert logprob.grad is not None
    # d(-A ratio)/d logprob = -A ratio on the unclipped tokens 1 and 4; 0 on the clipped ones.
    torch.testing.assert_close(logprob.grad, t([[0.0, 2.0 / 5, 0.0, 0.0, 2.0 / 5]]))
    without, stats = policy_loss_clipped(logprob, old_logprob, advantages, mask, 0.2, 0.2)
    assert without.item() == pytest.approx((5.0 + 2.0 + 0.8 - 1.2 + 2.0) / 5)
    assert stats["dual_clipfrac"].item() == 0.0
    with pytest.raises(ValueError, match=r"clip_ratio_c=1\.0 must be greater than 1"):
        policy_loss_clipped(logprob, old_logprob, advantages, mask, clip_ratio_c=1.0)


def test_value_loss_clipped_hand_computed() -> None:
    values = t([[1.0, 0.0, 50.0]]).requires_grad_()
    old_values = t([[0.0, 0.0, 0.0]])
    returns = t([[2.0, 1.0, 0.0]])
    loss, clipfrac = value_loss_clipped(
        values, old_values, returns, torch.tensor([[1, 1, 0]]), clip_range=0.5
    )
    # token 0: unclipped (1-2)^2 = 1, clipped (0.5-2)^2 = 2.25 -> 2.25; token 1: 1 either way.
    assert loss.item() == pytest.approx(0.5 * (2.25 + 1.0) / 2)
    assert clipfrac.item() == pytest.approx(0.5)
    loss.backward()
    assert values.grad is not None
    # The clipped term is constant in V on token 0: no gradient there.
    torch.testing.assert_close(values.grad, t([[0.0, 0.5 * 2 * (0.0 - 1.0) / 2, 0.0]]))


def test_losses_on_an_empty_batch_are_zero() -> None:
    zeros = torch.zeros(2, 3)
    loss, metrics = policy_loss_clipped(zeros, zeros, zeros + 1, zeros, 0.2, 0.2)
    assert loss.item() == 0.0
    assert metrics["clipfrac"].item() == 0.0
    value_loss, _ = value_loss_clipped(zeros, zeros, zeros + 1, zeros, 0.2)
    assert value_loss.item() == 0.0


# --------------------------------------------------------------------------- entropy


def test_entropy_known_values() -> None:
    logits = t([[0.0, 0.0, 0.0, 0.0], [0.0, 0.0, -math.inf, -math.inf], [1000.0, 0.0, 0.0, 0.0]])
    entropy = entropy_from_logits(logits)
    torch.testing.assert_close(entropy, t([math.log(4), math.log(2), 0.0]))


def test_entropy_matches_definition_and_has_finite_gradient_with_masked_vocab() -> None:
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 7, generator=generator, dtype=torch.float64) * 4
    probs = torch.softmax(logits, dim=-1)
    torch.testing.assert_close(entropy_from_logits(logits), -(probs * probs.log()).sum(-1))

    masked_vocab = logits.clone()
    masked_vocab[..., :3] = -math.inf
    masked_vocab.requires_grad_()
    entropy_from_logits(masked_vocab).sum().backward()
    assert masked_vocab.grad is not None
    assert torch.all(torch.isfinite(masked_vocab.grad))


def test_masked_entropy_averages_valid_tokens_only() -> None:
    logits = torch.zeros(1, 3, 4, dtype=torch.float64)
    logits[0, 2] = t([100.0, 0.0, 0.0, 0.0])  # near-deterministic padding token
    assert masked_entropy(logits, torch.tensor([[1, 1, 0]])).item() == pytest.approx(math.log(4))


# --------------------------------------------------------------------------- controllers


def test_fixed_kl_controller_never_moves() -> None:
    controller = FixedKLController(0.05)
    controller.update(current_kl=100.0, n_steps=1000)
    assert controller.value == 0.05
    restored = FixedKLController(0.0)
    restored.load_state_dict(controller.state_dict())
    assert restored.value == 0.05


@pytest.mark.parametrize(
    ("current_kl", "expected"),
    [
        (9.0, 0.2 * (1 + 0.2 * 256 / 10000)),  # error 0.5 clipped to 0.2
        (3.0, 0.2 * (1 - 0.2 * 256 / 10000)),  # error -0.5 clipped to -0.2
        (6.6, 0.2 * (1 + 0.1 * 256 / 10000)),  # error 0.1 inside the clip
        (6.0, 0.2),  # on target
    ],
)
def test_adaptive_kl_controller_update(current_kl: float, expected: float) -> None:
    controller = AdaptiveKLController(init_coef=0.2, target_kl=6.0, horizon=10000)
    controller.update(current_kl, n_steps=256)
    assert controller.value == pytest.approx(expected)


def test_adaptive_kl_controller_state_round_trip_and_validation() -> None:
    controller = AdaptiveKLController(0.2, 6.0, 10000)
    controller.update(9.0, 256)
    restored = AdaptiveKLController(0.2, 6.0, 10000)
    restored.load_state_dict(controller.state_dict())
    assert restored.value == controller.value
    with pytest.raises(ValueError, match="target_kl must be > 0"):
        AdaptiveKLController(0.2, 0.0, 10000)
    with pytest.raises(ValueError, match="horizon must be > 0"):
        AdaptiveKLController(0.2, 6.0, 0)


# --------------------------------------------------------------------------- Safe-RLHF


def test_combine_reward_cost_advantages() -> None:
    reward_advantages, cost_advantages = t([[1.0, 3.0]]), t([[2.0, 0.0]])
    torch.testing.assert_close(
        combine_reward_cost_advantages(reward_advantages, cost_advantages, 0.5), t([[0.0, 2.0]])
    )
    torch.testing.assert_close(
        combine_reward_cost_advantages(reward_advantages, cost_advantages, 0.0), reward_advantages
    )
    with pytest.raises(ValueError, match="lagrange_lambda must be >= 0"):
        combine_reward_cost_advantages(reward_advantages, cost_advantages, -1.0)


def test_lagrange_multiplier_rises_on_violation_falls_when_satisfied() -> None:
    multiplier = LagrangeMultiplier(init_lambda=1.0, cost_limit=0.0, lr=0.1)
    multiplier.update(mean_cost=2.0)  # Adam's first step is lr * sign(cost - limit), whatever the units
    assert multiplier.log_lambda == pytest.approx(0.1)
    tiny = LagrangeMultiplier(init_lambda=1.0, cost_limit=0.0, lr=0.1)
    tiny.update(mean_cost=0.002)
    assert tiny.log_lambda == pytest.approx(0.1, rel=1e-4)
    peak = multiplier.value
    for _ in range(10):
        multiplier.update(mean_cost=-1.0)
    assert multiplier.value < 1.0 < peak
    restored = LagrangeMultiplier(init_lambda=5.0, cost_limit=0.0, lr=0.1)
    restored.load_state_dict(multiplier.state_dict())
    assert restored.value == pytest.approx(multiplier.value)
    multiplier.update(mean_cost=3.0)
    restored.update(mean_cost=3.0)
    assert restored.value == pytest.approx(multiplier.value)  # the moments were restored too


def test_a_lambda_near_zero_grows_again_on_violation() -> None:
    multiplier = LagrangeMultiplier(init_lambda=1e-6, cost_limit=0.0, lr=0.5)
    before = multiplier.value
    for _ in range(5):
        multiplier.update(mean_cost=1.0)
    assert multiplier.value > 10 * before


def test_lagrange_multiplier_is_clamped_to_max() -> None:
    multiplier = LagrangeMultiplier(init_lambda=1.0, cost_limit=0.0, lr=10.0, max_lambda=1.5)
    multiplier.update(mean_cost=5.0)
    assert multiplier.value == pytest.approx(1.5)
    with pytest.raises(ValueError, match="init_lambda must be > 0"):
        LagrangeMultiplier(init_lambda=0.0, cost_limit=0.0, lr=0.1)
