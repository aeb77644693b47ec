"""REINFORCE++: no critic, no group; token-level returns with the KL penalty, whitened over the batch.

The outcome score sits on each response's last token; with ``kl.mode: reward`` (the REINFORCE++
recipe) every token also carries ``-coef * KL``; the discounted returns are whitened across the
whole batch and used as advantages with PPO's clipped loss (Hu, 2025).
"""

from __future__ import annotations

from hybridflow.algorithms.api import JobWorkers, RewardScorer, StepTimer
from hybridflow.algorithms.common import (
    average_worker_metrics,
    kl_penalized_token_rewards,
    rollout_and_score,
)
from hybridflow.algorithms.state import AlgorithmState
from hybridflow.controller import Batch
from hybridflow.rlmath import core


def train_step(
    workers: JobWorkers, prompts: Batch, scorer: RewardScorer, state: AlgorithmState
) -> dict[str, float]:
    timer = StepTimer()
    batch, metrics = rollout_and_score(workers, prompts, scorer, state.spec, timer)
    with timer.phase("advantages"):
        mask = batch.tensors["response_mask"].float()
        token_rewards = kl_penalized_token_rewards(batch, batch.tensors["scores"], state, metrics)
        advantages, _ = core.reinforce_plus_plus_advantages(token_rewards, mask, state.spec.algorithm.gamma)
    with timer.phase("actor_update"):
        updates = workers.actor.update_policy(batch.with_fields(advantages=advantages))
    return metrics | average_worker_metrics(updates) | timer.metrics()
