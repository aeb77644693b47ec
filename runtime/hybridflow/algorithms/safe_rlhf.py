"""Safe-RLHF: PPO on the reward, constrained by a cost model through a Lagrange multiplier (Dai et al., 2023).

Each step scores responses with the reward (functions and/or reward model) and the cost model.
Reward advantages come from GAE with the critic, as in PPO (KL per ``kl.mode``). Cost
advantages are the cost model's outcome score spread over the tokens as whitened returns, the
REINFORCE++ estimator: this runtime keeps one critic per job, so there is no separate cost
critic (Safe-RLHF's paper trains one; a spec role for it can be added when a user needs it).
The two are combined as ``(A_r - lambda * A_c) / (1 + lambda)`` and lambda is updated after the
step by gradient ascent on ``lambda * (E[cost] - costLimit)``.
"""

from __future__ import annotations

from hybridflow.algorithms.api import JobWorkers, RewardScorer
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
    spec, algo = state.spec, state.spec.algorithm
    assert workers.critic is not None and workers.cost is not None and state.lagrange is not None
    batch, metrics = rollout_and_score(workers, prompts, scorer, spec)
    costs = workers.cost.compute_costs.submit(batch)
    values = workers.critic.compute_values.submit(batch)
    batch = batch.union(costs.result()).union(values.result())
    mask = batch.tensors["response_mask"].float()

    token_rewards = kl_penalized_token_rewards(batch, batch.tensors["scores"], state, metrics)
    reward_advantages, returns = core.compute_gae_advantages(
        token_rewards, batch.tensors["values"], mask, algo.gamma, algo.gae_lambda
    )
    cost_scores = batch.tensors["cost_scores"]
    cost_advantages, _ = core.reinforce_plus_plus_advantages(
        core.place_outcome_score(cost_scores, mask), mask, algo.gamma
    )
    lagrange_lambda = state.lagrange.value
    advantages = core.combine_reward_cost_advantages(
        core.masked_whiten(reward_advantages, mask), cost_advantages, lagrange_lambda
    )
    batch = batch.with_fields(advantages=advantages, returns=returns)
    critic_update = workers.critic.update_critic.submit(batch)
    actor_update = workers.actor.update_policy.submit(batch)
    metrics.update(average_worker_metrics(critic_update.result()))
    metrics.update(average_worker_metrics(actor_update.result()))
    mean_cost = float(cost_scores.mean())
    state.lagrange.update(mean_cost)
    metrics.update({"cost/mean": mean_cost, "cost/lambda": lagrange_lambda, "cost/limit": algo.cost_limit})
    return metrics
