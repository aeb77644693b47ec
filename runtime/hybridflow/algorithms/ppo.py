"""PPO with a learned critic: GAE advantages, clipped policy and value losses (Ouyang et al., 2022).

The KL to the reference is, by ``spec.algorithm.kl.mode``, a per-token penalty in the reward
(the InstructGPT recipe; its coefficient follows the fixed or adaptive controller) or a loss term
in the actor update. The critic update and the actor update are submitted together: on separate
pools they run in parallel, colocated they run one after the other in the same processes (the
timing of each is what it adds to the step: ``hybridflow.algorithms.timing``).
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
    algo = state.spec.algorithm
    assert workers.critic is not None, "PPO needs a critic role"
    timer = StepTimer()
    batch, metrics = rollout_and_score(workers, prompts, scorer, state.spec, timer)
    with timer.phase("values"):
        batch = batch.union(workers.critic.compute_values(batch))
    with timer.phase("advantages"):
        mask = batch.tensors["response_mask"].float()
        token_rewards = kl_penalized_token_rewards(batch, batch.tensors["scores"], state, metrics)
        advantages, returns = core.compute_gae_advantages(
            token_rewards, batch.tensors["values"], mask, algo.gamma, algo.gae_lambda
        )
        batch = batch.with_fields(advantages=core.masked_whiten(advantages, mask), returns=returns)
    critic_update = timer.submit("critic_update", workers.critic.update_critic, batch)
    actor_update = timer.submit("actor_update", workers.actor.update_policy, batch)
    metrics.update(average_worker_metrics(critic_update.result()))
    metrics.update(average_worker_metrics(actor_update.result()))
    metrics["critic/explained_variance"] = float(
        core.explained_variance(batch.tensors["values"], returns, mask)
    )
    return metrics | timer.metrics()
