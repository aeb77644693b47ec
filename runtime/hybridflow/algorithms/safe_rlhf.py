"""Safe-RLHF: PPO on the reward, constrained by a cost model through a Lagrange multiplier (Dai et al., 2023).

How the paper's method maps onto this step (section 3 and Algorithm 1 of the paper):

* Two preference models score each response: the reward (functions and/or reward model) and
  the cost model (``spec.models.cost``; higher means less safe).
* Two critics: the reward critic (``spec.models.critic``) and a cost critic that starts from
  the cost model's weights, as in the paper's released code. Each gets its own GAE over the
  response tokens: the reward's token rewards carry the KL penalty (``kl.mode: reward``), the
  cost's carry only the cost score on the last token.
* The Lagrangian ``min_theta max_{lambda >= 0} -J_R(theta) + lambda * (J_C(theta) - d)``, with
  ``d = costLimit`` and ``J_C`` the expected episode cost, is solved by alternating updates:
  first lambda by ascent on ``lambda * (J_C - d)`` from this batch's mean episode cost (an Adam
  step on log_lambda, as the paper's code; ``lagrangianLearningRate``), then the policy with
  the advantage ``(A_R - lambda * A_C) / (1 + lambda)``, the paper's eq. (13) normalisation,
  which keeps the step size independent of lambda. Both advantages are whitened first.
* Both critics update with the clipped value loss, concurrently with the actor.
"""

from __future__ import annotations

from hybridflow.algorithms.api import JobWorkers, RewardScorer, StepTimer
from hybridflow.algorithms.common import average_worker_metrics, kl_penalized_token_rewards, rollout_and_score
from hybridflow.algorithms.state import AlgorithmState
from hybridflow.controller import Batch
from hybridflow.rlmath import core


def train_step(
    workers: JobWorkers, prompts: Batch, scorer: RewardScorer, state: AlgorithmState
) -> dict[str, float]:
    spec, algo = state.spec, state.spec.algorithm
    assert workers.critic is not None and workers.cost is not None and workers.cost_critic is not None
    assert state.lagrange is not None
    timer = StepTimer()
    batch, metrics = rollout_and_score(workers, prompts, scorer, spec, timer)
    costs = timer.submit("cost", workers.cost.compute_costs, batch)
    values = timer.submit("values", workers.critic.compute_values, batch)
    cost_values = timer.submit("cost_values", workers.cost_critic.compute_values, batch)
    batch = batch.union(costs.result()).union(values.result())
    batch = batch.with_fields(cost_values=cost_values.result().tensors["values"])

    with timer.phase("advantages"):
        mask = batch.tensors["response_mask"].float()
        token_rewards = kl_penalized_token_rewards(batch, batch.tensors["scores"], state, metrics)
        reward_advantages, returns = core.compute_gae_advantages(
            token_rewards, batch.tensors["values"], mask, algo.gamma, algo.gae_lambda
        )
        cost_scores = batch.tensors["cost_scores"]
        cost_advantages, cost_returns = core.compute_gae_advantages(
            core.place_outcome_score(cost_scores, mask),
            batch.tensors["cost_values"],
            mask,
            algo.gamma,
            algo.gae_lambda,
        )
        episode_cost = float(cost_scores.mean())
        state.lagrange.update(episode_cost)  # lambda first, then the policy with the new lambda
        lagrange_lambda = state.lagrange.value
        advantages = core.combine_reward_cost_advantages(
            core.masked_whiten(reward_advantages, mask),
            core.masked_whiten(cost_advantages, mask),
            lagrange_lambda,
        )
        batch = batch.with_fields(advantages=advantages, returns=returns)
        cost_batch = batch.with_fields(values=batch.tensors["cost_values"], returns=cost_returns)
    critic_update = timer.submit("critic_update", workers.critic.update_critic, batch)
    cost_critic_update = timer.submit("cost_critic_update", workers.cost_critic.update_critic, cost_batch)
    actor_update = timer.submit("actor_update", workers.actor.update_policy, batch)
    metrics.update(average_worker_metrics(critic_update.result()))
    metrics.update(average_worker_metrics(cost_critic_update.result()))
    metrics.update(average_worker_metrics(actor_update.result()))
    metrics["critic/explained_variance"] = float(
        core.explained_variance(batch.tensors["values"], returns, mask)
    )
    metrics.update({"cost/mean": episode_cost, "cost/lambda": lagrange_lambda, "cost/limit": algo.cost_limit})
    return metrics | timer.metrics()
