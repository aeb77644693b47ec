"""GRPO: group-normalised outcome advantages, no critic, KL to the reference as a loss.

Each prompt is sampled ``samples_per_prompt`` times; a response's advantage is its score
standardised within its group (Shao et al., 2024). With ``kl.mode: reward`` the summed sequence
KL is subtracted from the score before normalisation instead of being a loss term.
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
        advantages = core.grpo_outcome_advantages(
            scores, list(batch.non_tensors["uid"]), batch.tensors["response_mask"].float()
        )
    with timer.phase("actor_update"):
        updates = workers.actor.update_policy(batch.with_fields(advantages=advantages))
    return metrics | average_worker_metrics(updates) | timer.metrics()
