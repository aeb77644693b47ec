"""REINFORCE++: no critic, no group; token-level returns with the KL penalty, whitened over the batch.

The outcome score sits on each response's last token; with ``kl.mode: reward`` (the REINFORCE++
recipe) every token also carries ``-coef * KL``; the discounted returns are whitened across the
whole batch and used as advantages with PPO's clipped loss (Hu, 2025).
"""

from __future__ import annotations

from hybridflow.algorithms import core
from hybridflow.algorithms.common import average_worker_metrics, rollout_and_score
from hybridflow.algorithms.state import AlgorithmState
from hybridflow.controller import Batch
from hybridflow.trainer.rewards import RewardScorer
from hybridflow.trainer.roles import JobWorkers


def train_step(
    workers: JobWorkers, prompts: Batch, scorer: RewardScorer, state: AlgorithmState
) -> dict[str, float]:
    spec, algo = state.spec, state.spec.algorithm
    batch, metrics = rollout_and_score(workers, prompts, scorer, spec)
    mask = batch.tensors["response_mask"].float()
    token_rewards = core.place_outcome_score(batch.tensors["scores"], mask)
    if algo.kl.mode == "reward":
        token_rewards, mean_kl = core.apply_kl_penalty_to_rewards(
            token_rewards,
            batch.tensors["old_log_probs"],
            batch.tensors["ref_log_probs"],
            mask,
            state.kl_controller.value,
            algo.kl.estimator,
        )
        state.kl_controller.update(float(mean_kl), len(batch))
        metrics["kl/coef"] = state.kl_controller.value
    advantages, _ = core.reinforce_plus_plus_advantages(token_rewards, mask, algo.gamma)
    metrics.update(
        average_worker_metrics(workers.actor.update_policy(batch.with_fields(advantages=advantages)))
    )
    return metrics
