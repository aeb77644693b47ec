"""The actor's training objective, shared by every backend's actor worker.

Per micro-batch: PPO's clipped surrogate (dual-clipped with ``clipRatioC``; each token weighted by
the rollout correction when one is on: :mod:`hybridflow.rlmath.rollout_correction`), minus ``entropyCoef`` times the entropy, plus
``kl.coef`` times the KL to the reference when ``kl.mode`` is ``loss``; all three reduced by
``spec.algorithm.lossAggregation`` with the mini-batch's global counts
(:mod:`hybridflow.rlmath.aggregation`), so the micro-batch losses sum to the mini-batch's. The
backends differ only in how they run forward/backward (FSDP2 directly, Megatron through its
pipeline schedule), so the objective lives here once.
"""

from __future__ import annotations

import torch

from hybridflow.rlmath import core
from hybridflow.rlmath.aggregation import LossNormalizer, aggregate
from hybridflow.rlmath.rollout_correction import RolloutCorrection, correction_weights, mismatch_metrics
from hybridflow.spec import AlgorithmSpec

__all__ = ["actor_objective"]


def actor_objective(
    algo: AlgorithmSpec,
    log_probs: torch.Tensor,
    entropy: torch.Tensor | None,
    *,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    ref_log_probs: torch.Tensor | None,
    normalizer: LossNormalizer | None = None,
    rollout_log_probs: torch.Tensor | None = None,
    correction: RolloutCorrection | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor | float]]:
    """(loss, metrics) of one micro-batch; ``ref_log_probs`` None means no KL loss term.

    ``normalizer`` holds the mini-batch's global counts; the loss is then this micro-batch's
    share (backward on every share gives the mini-batch's gradient). None: the batch is the
    whole mini-batch. Metrics are this micro-batch's own means, detached: 0-d tensors for the
    loss parts, floats for the clip and KL statistics.

    ``rollout_log_probs`` (the engine's, at the trainer's temperature) add the mismatch metrics
    ``off_policy/*`` of :func:`~hybridflow.rlmath.rollout_correction.mismatch_metrics` against
    ``old_log_probs`` (the trainer's before the update); they read the log-probs only, so the
    loss is bit for bit the one without them. ``correction`` too weights (or masks) each token's
    policy loss by :func:`~hybridflow.rlmath.rollout_correction.correction_weights` and reports
    the weights' statistics.
    """
    mode = algo.loss_aggregation
    mask = response_mask.float()
    weights = None
    off_policy: dict[str, torch.Tensor | float] = {}
    if rollout_log_probs is not None:
        gap = mismatch_metrics(old_log_probs, rollout_log_probs, mask)
        off_policy = {f"off_policy/{name}": value for name, value in gap.items()}
        if correction is not None:
            weights, weight_stats = correction_weights(correction, old_log_probs, rollout_log_probs, mask)
            off_policy.update({f"off_policy/{name}": value for name, value in weight_stats.items()})
    elif correction is not None:
        raise ValueError(
            f"the {correction.kind} correction needs the rollout's log-probs (rollout_log_probs) in the batch"
        )
    policy_loss, stats = core.policy_loss_clipped(
        log_probs,
        old_log_probs,
        advantages,
        mask,
        algo.clip_ratio_low,
        algo.clip_ratio_high,
        aggregation=mode,
        normalizer=normalizer,
        token_weights=weights,
        clip_ratio_c=algo.clip_ratio_c,
    )
    if entropy is None:
        raise ValueError("the actor objective needs the per-token entropy (with_entropy=True)")
    loss = policy_loss - algo.entropy_coef * aggregate(entropy, mask, mode, normalizer)
    metrics: dict[str, torch.Tensor | float] = {
        "actor/policy_loss": core.policy_loss_clipped(
            log_probs.detach(),
            old_log_probs,
            advantages,
            mask,
            algo.clip_ratio_low,
            algo.clip_ratio_high,
            token_weights=weights,
            clip_ratio_c=algo.clip_ratio_c,
        )[0],
        "actor/entropy": core.masked_mean(entropy.detach(), mask),
        "actor/clipfrac": float(stats["clipfrac"]),
        "actor/approx_kl": float(stats["approx_kl"]),
        "actor/approx_kl_k3": float(stats["approx_kl_k3"]),
        **off_policy,
    }
    if algo.clip_ratio_c is not None:
        metrics["actor/dual_clipfrac"] = float(stats["dual_clipfrac"])
    if ref_log_probs is not None:
        per_token_kl = core.kl_penalty(log_probs, ref_log_probs, algo.kl.estimator)
        loss = loss + algo.kl.coef * aggregate(per_token_kl, mask, mode, normalizer)
        metrics["actor/kl_loss"] = core.masked_mean(per_token_kl.detach(), mask)
    return loss, metrics
