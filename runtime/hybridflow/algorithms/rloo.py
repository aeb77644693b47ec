"""RLOO: each response's baseline is the mean score of the other responses to its prompt.

Like GRPO there is no critic; unlike GRPO the advantage is not divided by the group's standard
deviation, and the baseline leaves the response itself out, which keeps the gradient estimate
unbiased (Ahmadian et al., 2024). KL follows ``spec.algorithm.kl.mode`` as in GRPO.
"""

from __future__ import annotations

from hybridflow.algorithms.api import JobWorkers, RewardScorer, StepTimer
from hybridflow.algorithms.common import average_worker_metrics, kl_adjusted_scores, rollout_and_score
from hybridflow.algorithms.state import AlgorithmState
from hybridflow.controller import Batch
from hybridflow.rlmath import core


def train_step(
    workers: JobWorkers, prompts: Batch, scorer: RewardScorer, state: AlgorithmState
) -> dict[str, float]:
    timer = StepTimer()
    batch, metrics = rollout_and_score(workers, prompts, scorer, state.spec, timer)
    with timer.phase("advantages"):
        scores = kl_adjusted_scores(batch, state)
        advantages = core.rloo_outcome_advantages(
            scores, list(batch.non_tensors["uid"]), batch.tensors["response_mask"].float()
        )
    with timer.phase("actor_update"):
        updates = workers.actor.update_policy(batch.with_fields(advantages=advantages))
    return metrics | average_worker_metrics(updates) | timer.metrics()
