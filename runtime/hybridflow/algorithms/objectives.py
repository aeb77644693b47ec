"""The actor's training objective, shared by every backend's actor worker.

Per micro-batch: PPO's clipped surrogate, minus ``entropyCoef`` times the masked mean entropy,
plus ``kl.coef`` times the masked mean KL to the reference when ``kl.mode`` is ``loss``. The
backends differ only in how they run forward/backward (FSDP2 directly, Megatron through its
pipeline schedule), so the objective lives here once.
"""

from __future__ import annotations

import torch

from hybridflow.algorithms import core
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
) -> tuple[torch.Tensor, dict[str, torch.Tensor | float]]:
    """(loss, metrics) of one micro-batch; ``ref_log_probs`` None means no KL loss term.

    Metrics are detached: 0-d tensors for the loss parts, floats for the clip statistics.
    """
    mask = response_mask.float()
    policy_loss, stats = core.policy_loss_clipped(
        log_probs, old_log_probs, advantages, mask, algo.clip_ratio_low, algo.clip_ratio_high
    )
    if entropy is None:
        raise ValueError("the actor objective needs the per-token entropy (with_entropy=True)")
    entropy_mean = core.masked_mean(entropy, mask)
    loss = policy_loss - algo.entropy_coef * entropy_mean
    metrics: dict[str, torch.Tensor | float] = {
        "actor/policy_loss": policy_loss.detach(),
        "actor/entropy": entropy_mean.detach(),
        "actor/clipfrac": float(stats["clipfrac"]),
        "actor/approx_kl": float(stats["approx_kl"]),
    }
    if ref_log_probs is not None:
        kl = core.masked_mean(core.kl_penalty(log_probs, ref_log_probs, algo.kl.estimator), mask)
        loss = loss + algo.kl.coef * kl
        metrics["actor/kl_loss"] = kl.detach()
    return loss, metrics
