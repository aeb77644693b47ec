"""The math every RL algorithm shares: advantages, losses, KL, and the coefficient controllers.

Conventions (every function here follows them; callers may rely on them):

* Per-token tensors are ``[batch, response_len]``: one row per response, right-padded to the
  longest response of the batch. ``response_mask`` has the same shape, float (0/1) or bool;
  a position is valid where the mask is non-zero.
* Masked positions never contribute: they are excluded from every sum, mean and variance,
  and they are selected away with ``torch.where`` (not multiplied by zero), so a NaN or inf
  sitting in padding cannot leak into a result. Per-token outputs are 0 at masked positions.
* A valid position inside a row may follow a masked one (e.g. masked tool output in a
  multi-turn response). Recursions over time treat the valid tokens of a row, in order, as
  the trajectory and skip masked positions; for right-padded rows this is the textbook
  recursion with a zero bootstrap after the last valid token.
* Advantages and returns are training targets: they are computed under ``torch.no_grad``
  and come back detached. Losses keep their graph.
* Losses aggregate by token-mean over the whole batch by default (every valid token weighs
  the same, veRL's default); the other modes and the split over micro-batches and DP ranks
  are in :mod:`hybridflow.rlmath.aggregation`. A batch with no valid token yields 0, not NaN.

Nothing here knows about Ray, workers or models; the algorithm files call these functions
on the tensors the workers return.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from typing import Literal, get_args

import torch

from hybridflow.rlmath.aggregation import LossAggregation, LossNormalizer, aggregate

KLEstimator = Literal["k1", "k2", "k3"]
"""Per-token estimators of KL(policy || reference) from sampled-token log-probabilities.

k1 = log p - log q (unbiased, high variance, can be negative), k2 = 0.5 (log p - log q)^2,
k3 = exp(log q - log p) - (log q - log p) - 1 (unbiased, always >= 0; Schulman, "Approximating
KL divergence", 2020)."""

KL_ESTIMATORS: tuple[str, ...] = get_args(KLEstimator)

# exp() of a log-ratio beyond this overflows float32 long before it means anything; a ratio of
# e^20 already says "the policy moved off the sample" and the clipped losses ignore it anyway.
_MAX_LOG_RATIO = 20.0
# Added to variances before rsqrt so a constant batch whitens to zeros instead of NaN.
_WHITEN_EPS = 1e-8


# --------------------------------------------------------------------------- masked reductions


def _valid(mask: torch.Tensor) -> torch.Tensor:
    """The mask as bool: a position is valid where the mask is non-zero."""
    return mask if mask.dtype == torch.bool else mask != 0


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``values`` over the positions where ``mask`` is non-zero.

    ``values`` and ``mask`` have the same shape. With ``dim=None`` the result is a scalar;
    otherwise ``dim`` is reduced. An all-zero mask sums to 0.
    """
    selected = torch.where(_valid(mask), values, torch.zeros_like(values))
    return selected.sum() if dim is None else selected.sum(dim=dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``values`` over the valid positions (all of them, or along ``dim``).

    A reduction with no valid position is 0 (the count is clamped to 1), so a fully padded
    row or an empty micro-batch cannot turn a loss into NaN.
    """
    valid = _valid(mask)
    count = valid.sum() if dim is None else valid.sum(dim=dim)
    return masked_sum(values, valid, dim) / count.clamp_min(1).to(values.dtype)


def masked_var(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Variance of ``values`` over all valid positions, a scalar.

    Unbiased (Bessel-corrected) when there are at least two valid positions, as in veRL;
    0 with one or none, where no spread can be estimated.
    """
    valid = _valid(mask)
    count = valid.sum()
    mean = masked_mean(values, valid)
    # Bessel's factor n / (n - 1), taken as 1 when n <= 1 (the biased variance is then 0 anyway).
    bessel = count / (count - 1).clamp_min(1)
    return masked_mean((values - mean).square(), valid) * bessel.clamp_min(1).to(values.dtype)


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """Normalize ``values`` to zero mean and unit variance using only the valid positions.

    Statistics are global over the batch (every valid token of every row). With
    ``shift_mean=False`` the mean is added back after scaling (only the spread is
    normalized). Masked positions come back as 0. A constant or empty batch gives zeros
    (or the unshifted mean), not NaN.
    """
    valid = _valid(mask)
    mean = masked_mean(values, valid)
    whitened = (values - mean) * torch.rsqrt(masked_var(values, valid) + _WHITEN_EPS)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(valid, whitened, torch.zeros_like(whitened))


# --------------------------------------------------------------------------- token rewards and KL


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, estimator: KLEstimator) -> torch.Tensor:
    """Per-token KL(policy || reference) estimate from the log-probabilities of the sampled tokens.

    ``logprob`` and ``ref_logprob`` are ``[batch, response_len]``; so is the result. Padding is
    not masked here (the callers mask). See ``KLEstimator`` for the three estimators; k3
    clamps its log-ratio to [-20, 20] so that a token the reference finds near-impossible
    cannot overflow ``exp``.
    """
    log_ratio = logprob - ref_logprob
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    if estimator == "k3":
        reverse_log_ratio = torch.clamp(-log_ratio, -_MAX_LOG_RATIO, _MAX_LOG_RATIO)
        return torch.exp(reverse_log_ratio) - reverse_log_ratio - 1.0
    raise ValueError(f"KL estimator {estimator!r} is not supported; use one of {', '.join(KL_ESTIMATORS)}")


def place_outcome_score(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Turn one outcome score per response into token rewards.

    ``scores`` is ``[batch]``; the result is ``[batch, response_len]`` (dtype of ``scores``),
    zero everywhere except each row's last valid token, which carries the row's score. That
    is where a reward model or rule judges the finished response, and where the
    token-level recursions (GAE, REINFORCE++) expect the outcome. A row with no valid token
    gets no reward.
    """
    valid = _valid(response_mask)
    positions = torch.arange(valid.shape[-1], device=valid.device).expand_as(valid)
    last_valid = torch.where(valid, positions, torch.full_like(positions, -1)).amax(dim=-1)
    token_rewards = torch.zeros(valid.shape, dtype=scores.dtype, device=scores.device)
    has_tokens = last_valid >= 0
    rows = torch.arange(valid.shape[0], device=valid.device)[has_tokens]
    token_rewards[rows, last_valid[has_tokens]] = scores[has_tokens]
    return token_rewards


def place_token_rewards(
    scores: torch.Tensor, token_values: torch.Tensor, response_mask: torch.Tensor
) -> torch.Tensor:
    """Token rewards from outcome scores plus token-level rewards that land where they fall.

    ``scores`` is ``[batch]`` and goes on each row's last valid token, as in
    :func:`place_outcome_score`; ``token_values`` is ``[batch, response_len]``, a reward function's
    value for each response token, added at its own position. A value on a position outside
    ``response_mask`` (a token the policy did not generate: the tool results inserted into a
    multi-turn trajectory) is credited to the last valid token before it, the action that led
    to it (the first valid token if none precedes it), since the recursions (GAE, REINFORCE++)
    ignore rewards at masked positions. A row with no valid token gets no reward.
    """
    valid = _valid(response_mask)
    width = valid.shape[-1]
    positions = torch.arange(width, device=valid.device).expand_as(valid)
    last_valid_so_far = torch.where(valid, positions, torch.full_like(positions, -1)).cummax(dim=-1).values
    first_valid = torch.where(valid, positions, torch.full_like(positions, width)).amin(dim=-1, keepdim=True)
    target = torch.where(last_valid_so_far >= 0, last_valid_so_far, first_valid).clamp(max=width - 1)
    has_tokens = valid.any(dim=-1, keepdim=True)
    values = torch.where(has_tokens, token_values.to(scores.dtype), torch.zeros((), dtype=scores.dtype))
    return place_outcome_score(scores, response_mask).scatter_add_(-1, target, values)


def apply_kl_penalty_to_rewards(
    token_scores: torch.Tensor,
    logprob: torch.Tensor,
    ref_logprob: torch.Tensor,
    response_mask: torch.Tensor,
    kl_coef: float,
    estimator: KLEstimator = "k1",
) -> tuple[torch.Tensor, torch.Tensor]:
    """KL-in-reward: ``token_rewards = token_scores - kl_coef * KL`` on every valid token.

    All inputs are ``[batch, response_len]``; ``token_scores`` usually comes from
    ``place_outcome_score``. Returns ``(token_rewards, mean_kl)``: token rewards are 0 at
    masked positions; ``mean_kl`` is a detached scalar, the mean over responses of each
    response's token-mean KL (veRL's convention), which is what ``AdaptiveKLController``
    consumes. PPO and REINFORCE++ penalize KL this way; GRPO puts KL in the loss instead.
    """
    valid = _valid(response_mask)
    with torch.no_grad():
        kl = kl_penalty(logprob, ref_logprob, estimator)
        kl = torch.where(valid, kl, torch.zeros_like(kl))
        token_rewards = torch.where(valid, token_scores - kl_coef * kl, torch.zeros_like(token_scores))
        mean_kl = masked_mean(kl, valid, dim=-1).mean()
    return token_rewards, mean_kl


# --------------------------------------------------------------------------- advantages


def compute_gae_advantages(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation (Schulman et al., 2016) over response tokens.

    Inputs are ``[batch, response_len]``: ``token_rewards`` (outcome score on the last token,
    KL penalty on every token), ``values`` from the critic. Returns ``(advantages, returns)``
    of the same shape, detached, 0 at masked positions::

        delta_t = r_t + gamma * V_{t+1} - V_t
        A_t     = delta_t + gamma * lam * A_{t+1}
        R_t     = A_t + V_t        (the critic's regression target)

    where t+1 means the next *valid* token of the row, and V and A after a row's last valid
    token are 0 (the response ended: nothing to bootstrap from). Rewards and values at
    masked positions are ignored. Advantages are not whitened here; PPO whitens them with
    ``masked_whiten`` after the returns are taken, so the critic's target stays in reward units.
    """
    valid = _valid(response_mask)
    with torch.no_grad():
        batch_size, response_len = token_rewards.shape
        next_value = torch.zeros(batch_size, dtype=values.dtype, device=values.device)
        next_advantage = torch.zeros_like(next_value)
        advantages = torch.zeros_like(values)
        for t in reversed(range(response_len)):
            is_valid = valid[:, t]
            delta = token_rewards[:, t] + gamma * next_value - values[:, t]
            advantage = delta + gamma * lam * next_advantage
            # A masked position passes the next valid token's value and advantage through.
            next_advantage = torch.where(is_valid, advantage, next_advantage)
            next_value = torch.where(is_valid, values[:, t], next_value)
            advantages[:, t] = torch.where(is_valid, advantage, torch.zeros_like(advantage))
        returns = torch.where(valid, advantages + values, torch.zeros_like(values))
    return advantages, returns


def _group_index(
    group_ids: Sequence[Hashable] | torch.Tensor, scores: torch.Tensor
) -> tuple[torch.Tensor, int]:
    """Map any hashable group ids (one per score) to indices ``0..n_groups-1`` on ``scores``' device."""
    ids = group_ids.tolist() if isinstance(group_ids, torch.Tensor) else list(group_ids)
    if len(ids) != scores.shape[0]:
        raise ValueError(
            f"group_ids has {len(ids)} entries but there are {scores.shape[0]} scores; "
            "need one id per response"
        )
    index_of: dict[Hashable, int] = {}
    indices = [index_of.setdefault(group_id, len(index_of)) for group_id in ids]
    return torch.tensor(indices, dtype=torch.long, device=scores.device), len(index_of)


def _group_sum(per_response: torch.Tensor, group_index: torch.Tensor, n_groups: int) -> torch.Tensor:
    """For each response, the sum of ``per_response`` over its group: ``[batch] -> [batch]``."""
    sums = torch.zeros(n_groups, dtype=per_response.dtype, device=per_response.device)
    return sums.index_add_(0, group_index, per_response)[group_index]


def _broadcast_to_tokens(per_response: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """``[batch]`` -> ``[batch, response_len]``: the same value on every valid token, 0 elsewhere."""
    valid = _valid(response_mask)
    tokens = per_response.unsqueeze(-1).expand(valid.shape)
    return torch.where(valid, tokens, torch.zeros_like(tokens))


def grpo_outcome_advantages(
    scores: torch.Tensor,
    group_ids: Sequence[Hashable] | torch.Tensor,
    response_mask: torch.Tensor,
    eps: float = 1e-6,
    normalize_by_std: bool = True,
) -> torch.Tensor:
    """GRPO (Shao et al., 2024): each response's score relative to its prompt group.

    ``scores`` is ``[batch]``; ``group_ids`` has one id per response (int tensor, or any
    hashable values, e.g. prompt uids), and responses sharing an id were sampled from the
    same prompt. The advantage ``(r - mean_group) / (std_group + eps)`` (unbiased std, as in
    veRL) is placed on every valid token of ``[batch, response_len]``. With
    ``normalize_by_std=False`` only the mean is subtracted (Dr. GRPO), which does not
    up-weight prompts whose group scores barely differ. A group of one response has no
    baseline and gets advantage 0, so it contributes no gradient.
    """
    with torch.no_grad():
        index, n_groups = _group_index(group_ids, scores)
        sizes = _group_sum(torch.ones_like(scores), index, n_groups)
        centered = scores - _group_sum(scores, index, n_groups) / sizes
        if normalize_by_std:
            squared_deviation = _group_sum(centered.square(), index, n_groups)
            stds = torch.sqrt(squared_deviation / (sizes - 1).clamp_min(1))
            centered = centered / (stds + eps)
        advantages = torch.where(sizes > 1, centered, torch.zeros_like(centered))
        return _broadcast_to_tokens(advantages, response_mask)


def rloo_outcome_advantages(
    scores: torch.Tensor,
    group_ids: Sequence[Hashable] | torch.Tensor,
    response_mask: torch.Tensor,
) -> torch.Tensor:
    """RLOO (Ahmadian et al., 2024): score minus the mean score of the *other* responses of its group.

    ``scores`` is ``[batch]``, ``group_ids`` as in ``grpo_outcome_advantages``; the
    advantage ``r_i - (sum_group - r_i) / (n - 1)`` is placed on every valid token. The
    leave-one-out baseline keeps the estimator unbiased (the baseline does not depend on the
    response it is subtracted from). A group of one has no other response to compare with
    and gets advantage 0, consistent with GRPO.
    """
    with torch.no_grad():
        index, n_groups = _group_index(group_ids, scores)
        sizes = _group_sum(torch.ones_like(scores), index, n_groups)
        baseline = (_group_sum(scores, index, n_groups) - scores) / (sizes - 1).clamp_min(1)
        advantages = torch.where(sizes > 1, scores - baseline, torch.zeros_like(scores))
        return _broadcast_to_tokens(advantages, response_mask)


def remax_outcome_advantages(
    scores: torch.Tensor, greedy_baseline_scores: torch.Tensor, response_mask: torch.Tensor
) -> torch.Tensor:
    """ReMax (Li et al., 2023): score minus the score of the greedy response to the same prompt.

    ``scores`` and ``greedy_baseline_scores`` are ``[batch]`` (row i's baseline is the greedy
    decode of row i's prompt); the difference is placed on every valid token of
    ``[batch, response_len]``. The greedy baseline replaces the critic: one extra
    generation per prompt instead of a second model to train.
    """
    with torch.no_grad():
        return _broadcast_to_tokens(scores - greedy_baseline_scores, response_mask)


def reinforce_plus_plus_advantages(
    token_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu, 2025): discounted token returns, whitened over the whole batch.

    ``token_rewards`` is ``[batch, response_len]`` and already carries the KL penalty on
    every token (build it with ``place_outcome_score`` then ``apply_kl_penalty_to_rewards``):
    REINFORCE++ has no critic and no group baseline, so the per-token KL in the reward and
    the global whitening are what keep its variance down. Returns ``(advantages, returns)``,
    detached, 0 at masked positions, where ``G_t = r_t + gamma * G_{t+1}`` over the row's
    valid tokens (0 after the last) and advantages are ``masked_whiten(G)``.
    """
    valid = _valid(response_mask)
    with torch.no_grad():
        running_return = torch.zeros(
            token_rewards.shape[0], dtype=token_rewards.dtype, device=token_rewards.device
        )
        returns = torch.zeros_like(token_rewards)
        for t in reversed(range(token_rewards.shape[1])):
            is_valid = valid[:, t]
            running_return = torch.where(
                is_valid, token_rewards[:, t] + gamma * running_return, running_return
            )
            returns[:, t] = torch.where(is_valid, running_return, torch.zeros_like(running_return))
        advantages = masked_whiten(returns, valid)
    return advantages, returns


# --------------------------------------------------------------------------- losses


def _dual_clip(
    per_token: torch.Tensor, advantages: torch.Tensor, clip_ratio_c: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss, capped)``: dual-clip PPO (Ye et al., 2020, "Mastering Complex Control in MOBA Games
    with Deep Reinforcement Learning"), ``c = clip_ratio_c > 1``.

    Where ``A_t < 0`` the clipped loss is also bounded above, ``loss_t = min(loss_t, -A_t * c)``,
    so a token whose ratio has run far past ``1 + clip_ratio_high`` (a stale or off-policy
    sample) cannot take an unbounded step; its gradient is 0 there. None leaves the loss as is.
    """
    if clip_ratio_c is None:
        return per_token, torch.zeros(per_token.shape, dtype=torch.bool, device=per_token.device)
    if not clip_ratio_c > 1.0:
        raise ValueError(f"clip_ratio_c={clip_ratio_c} must be greater than 1 (dual-clip PPO's bound)")
    bound = -advantages * clip_ratio_c
    capped = (advantages < 0) & (per_token > bound)
    return torch.where(capped, bound, per_token), capped


def policy_loss_clipped(
    logprob: torch.Tensor,
    old_logprob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    *,
    aggregation: LossAggregation = "token-mean",
    normalizer: LossNormalizer | None = None,
    token_weights: torch.Tensor | None = None,
    clip_ratio_c: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped surrogate (Schulman et al., 2017), reduced over the valid tokens by ``aggregation``.

    ``logprob`` (with grad) is the current policy's log-probability of each sampled token,
    ``old_logprob`` the rollout policy's; all inputs ``[batch, response_len]``. Per token,
    with ``ratio = exp(logprob - old_logprob)``::

        loss_t = max(-A_t * ratio, -A_t * clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high))

    then, with ``clip_ratio_c``, capped where ``A_t < 0`` (dual-clip PPO: :func:`_dual_clip`).
    Separate low/high bounds allow DAPO's "clip-higher" (Yu et al., 2025, section 3.1: a
    larger ``clip_ratio_high`` lets low-probability tokens rise, against entropy collapse).
    ``aggregation`` and ``normalizer`` are those of
    :func:`hybridflow.rlmath.aggregation.aggregate` (default: token-mean of this batch).
    Returns ``(loss, metrics)``:
    ``metrics["clipfrac"]`` is the fraction of valid tokens where the clipped term was
    chosen (its gradient is 0 there), ``metrics["dual_clipfrac"]`` the fraction the dual clip
    capped (0 without ``clip_ratio_c``), ``metrics["approx_kl"]`` the token-mean of
    ``old_logprob - logprob`` (k1 estimate of KL(old || new)) and ``metrics["approx_kl_k3"]``
    its k3 estimate ``mean(ratio - 1 - log ratio)`` (never negative, lower variance: the one
    an early stop at ``targetKl`` reads); all detached scalars.

    ``token_weights`` (detached, from
    :func:`hybridflow.rlmath.rollout_correction.correction_weights`) multiply each token's loss
    before the reduction: the decoupled objective of off-policy PPO, where ``old_logprob`` is the
    proximal policy (the trainer's before the update) and the weights correct from the behaviour
    policy that sampled the tokens (the rollout engine's) to it.
    """
    valid = _valid(response_mask)
    log_ratio = torch.clamp(logprob - old_logprob, -_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    unclipped_loss = -advantages * ratio
    clipped_loss = -advantages * torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    per_token, dual_clipped = _dual_clip(
        torch.maximum(unclipped_loss, clipped_loss), advantages, clip_ratio_c
    )
    if token_weights is not None:
        per_token = per_token * token_weights.detach()
    loss = aggregate(per_token, valid, aggregation, normalizer)
    with torch.no_grad():
        metrics = {
            "clipfrac": masked_mean((clipped_loss > unclipped_loss).to(logprob.dtype), valid),
            "dual_clipfrac": masked_mean(dual_clipped.to(logprob.dtype), valid),
            "approx_kl": masked_mean(-log_ratio, valid),
            # k3 (Schulman 2020) of KL(old || new) from samples of old: (r - 1) - log r >= 0.
            "approx_kl_k3": masked_mean(ratio - 1.0 - log_ratio, valid),
        }
    return loss, metrics


def value_loss_clipped(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    clip_range: float,
    *,
    aggregation: LossAggregation = "token-mean",
    normalizer: LossNormalizer | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The critic's clipped regression loss, reduced over the valid tokens by ``aggregation``.

    ``values`` (with grad) are the critic's current predictions, ``old_values`` those made
    at rollout time, ``returns`` the GAE targets; all ``[batch, response_len]``. The
    prediction may move at most ``clip_range`` away from ``old_values`` before the clipped
    term takes over, which keeps one batch from dragging the critic far off::

        loss = 0.5 * mean(max((V - R)^2, (old_V + clamp(V - old_V, -c, c) - R)^2))

    Returns ``(loss, clipfrac)``; ``clipfrac`` (detached) is the fraction of valid tokens
    where the clipped term was the larger.
    """
    valid = _valid(response_mask)
    clipped_values = old_values + torch.clamp(values - old_values, -clip_range, clip_range)
    unclipped_error = (values - returns).square()
    clipped_error = (clipped_values - returns).square()
    loss = 0.5 * aggregate(torch.maximum(unclipped_error, clipped_error), valid, aggregation, normalizer)
    with torch.no_grad():
        clipfrac = masked_mean((clipped_error > unclipped_error).to(values.dtype), valid)
    return loss, clipfrac


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the categorical distribution over the last dimension: ``[..., vocab] -> [...]``.

    Computed as ``logsumexp(z) - sum(softmax(z) * z)``, which never exponentiates a large
    logit and stays finite (with a finite gradient) when some logits are ``-inf`` (masked
    vocabulary entries have probability 0 and contribute nothing).
    """
    probs = torch.softmax(logits, dim=-1)
    finite_logits = torch.where(probs > 0, logits, torch.zeros_like(logits))
    return torch.logsumexp(logits, dim=-1) - (probs * finite_logits).sum(dim=-1)


def masked_entropy(logits: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Token-mean entropy of the policy over the valid response tokens, a scalar with grad.

    ``logits`` is ``[batch, response_len, vocab]``, ``response_mask`` ``[batch, response_len]``.
    The actor subtracts ``entropy_coef * masked_entropy(...)`` from its loss (an entropy
    bonus) to keep the policy from collapsing early; it also logs the value.
    """
    return masked_mean(entropy_from_logits(logits), response_mask)


def explained_variance(
    values: torch.Tensor, returns: torch.Tensor, response_mask: torch.Tensor
) -> torch.Tensor:
    """``1 - Var(returns - values) / Var(returns)`` over the valid tokens: how much of the
    return's spread the critic predicts (1 perfect, 0 no better than a constant, < 0 worse).

    A detached scalar; 0 when the returns do not vary (nothing to explain). The diagnostic
    PPO implementations log for the critic (e.g. Stable-Baselines3, cleanrl).
    """
    with torch.no_grad():
        valid = _valid(response_mask)
        spread = masked_var(returns, valid)
        if float(spread) <= 0.0:
            return torch.zeros((), dtype=returns.dtype)
        return 1.0 - masked_var(returns - values, valid) / spread


# --------------------------------------------------------------------------- KL coefficient controllers


class FixedKLController:
    """A KL coefficient that never changes; ``update`` exists so PPO's loop treats both kinds alike."""

    def __init__(self, coef: float) -> None:
        if coef < 0:
            raise ValueError(f"kl coef must be >= 0, got {coef}")
        self.value = float(coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op; the coefficient is fixed."""

    def state_dict(self) -> dict[str, float]:
        """The checkpointed state: the coefficient."""
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        """Restore from ``state_dict()``."""
        self.value = float(state["value"])


class AdaptiveKLController:
    """Adaptive KL coefficient of Ziegler et al. (2019), "Fine-Tuning LMs from Human Preferences".

    After each step the controller compares the measured KL with ``target_kl`` and moves the
    coefficient proportionally::

        error = clip(current_kl / target_kl - 1, -0.2, 0.2)
        value *= 1 + error * n_steps / horizon

    so the KL drifts toward the target over roughly ``horizon`` samples (``n_steps`` is the
    number of samples, i.e. responses, the step consumed). Clipping the error bounds how
    fast a single noisy measurement can move the coefficient.
    """

    def __init__(self, init_coef: float, target_kl: float, horizon: int) -> None:
        if init_coef < 0:
            raise ValueError(f"init kl coef must be >= 0, got {init_coef}")
        if target_kl <= 0:
            raise ValueError(f"target_kl must be > 0, got {target_kl}")
        if horizon <= 0:
            raise ValueError(f"horizon must be > 0, got {horizon}")
        self.value = float(init_coef)
        self.target_kl = float(target_kl)
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        """Move the coefficient toward the value that would put ``current_kl`` on target."""
        proportional_error = min(max(current_kl / self.target_kl - 1.0, -0.2), 0.2)
        self.value *= 1.0 + proportional_error * n_steps / self.horizon

    def state_dict(self) -> dict[str, float]:
        """The checkpointed state: the current coefficient (target and horizon are config)."""
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        """Restore from ``state_dict()``."""
        self.value = float(state["value"])


# --------------------------------------------------------------------------- Safe-RLHF


def combine_reward_cost_advantages(
    reward_advantages: torch.Tensor, cost_advantages: torch.Tensor, lagrange_lambda: float
) -> torch.Tensor:
    """Safe-RLHF (Dai et al., 2023): ``(A_r - lambda * A_c) / (1 + lambda)``, one advantage from two.

    Both inputs are ``[batch, response_len]`` (e.g. two GAE runs, one per critic); the
    result has that shape. Dividing by ``1 + lambda`` keeps the advantage's scale
    independent of the multiplier, so a growing lambda shifts the policy toward safety
    without also inflating the step size.
    """
    if lagrange_lambda < 0:
        raise ValueError(f"lagrange_lambda must be >= 0, got {lagrange_lambda}")
    return (reward_advantages - lagrange_lambda * cost_advantages) / (1.0 + lagrange_lambda)


class LagrangeMultiplier:
    """Safe-RLHF's multiplier ``lambda = exp(log_lambda)`` for the constraint ``E[cost] <= cost_limit``.

    The parameter is ``log_lambda`` so lambda stays positive. After each step the controller
    calls ``update(mean_cost)``: one Adam step (beta 0.9/0.999) on Safe-RLHF's
    ``lambda_loss = -(mean_cost - cost_limit) * exp(log_lambda)`` with respect to
    ``log_lambda``, as the paper's released code does (``torch.optim.Adam([log_lambda])``).
    Adam makes a step about ``lr`` in ``log_lambda`` whatever the cost's units, and a lambda
    near 0 (where the plain gradient ``(mean_cost - cost_limit) * lambda`` vanishes) can still
    grow again when the constraint is violated. Lambda grows while the constraint is violated
    and decays once it holds; it is clamped to ``max_lambda`` so that a long violation cannot
    make the reward irrelevant.
    """

    _BETAS = (0.9, 0.999)
    _EPS = 1e-8

    def __init__(
        self, init_lambda: float, cost_limit: float, lr: float, max_lambda: float | None = None
    ) -> None:
        if init_lambda <= 0:
            raise ValueError(f"init_lambda must be > 0 (it is stored as a logarithm), got {init_lambda}")
        if lr <= 0:
            raise ValueError(f"lr must be > 0, got {lr}")
        if max_lambda is not None and max_lambda < init_lambda:
            raise ValueError(f"max_lambda ({max_lambda}) must be >= init_lambda ({init_lambda})")
        self.log_lambda = math.log(init_lambda)
        self.cost_limit = float(cost_limit)
        self.lr = float(lr)
        self.max_lambda = max_lambda
        self._step = 0
        self._first_moment = 0.0
        self._second_moment = 0.0

    @property
    def value(self) -> float:
        """The current multiplier, ``exp(log_lambda)``."""
        return math.exp(self.log_lambda)

    def update(self, mean_cost: float) -> None:
        """One Adam step from the batch's mean episode cost (ascent on ``lambda * (cost - limit)``)."""
        gradient = -(mean_cost - self.cost_limit) * self.value
        beta1, beta2 = self._BETAS
        self._step += 1
        self._first_moment = beta1 * self._first_moment + (1 - beta1) * gradient
        self._second_moment = beta2 * self._second_moment + (1 - beta2) * gradient * gradient
        first = self._first_moment / (1 - beta1**self._step)
        second = self._second_moment / (1 - beta2**self._step)
        self.log_lambda -= self.lr * first / (math.sqrt(second) + self._EPS)
        if self.max_lambda is not None:
            self.log_lambda = min(self.log_lambda, math.log(self.max_lambda))

    def state_dict(self) -> dict[str, float]:
        """The checkpointed state: ``log_lambda`` and Adam's moments (limit, lr and max are config)."""
        return {
            "log_lambda": self.log_lambda,
            "step": float(self._step),
            "first_moment": self._first_moment,
            "second_moment": self._second_moment,
        }

    def load_state_dict(self, state: dict[str, float]) -> None:
        """Restore from ``state_dict()`` (a checkpoint with only ``log_lambda`` restarts Adam's moments)."""
        self.log_lambda = float(state["log_lambda"])
        self._step = int(state.get("step", 0))
        self._first_moment = float(state.get("first_moment", 0.0))
        self._second_moment = float(state.get("second_moment", 0.0))
