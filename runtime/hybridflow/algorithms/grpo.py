"""GRPO: group-normalised outcome advantages, no critic, KL to the reference as a loss.

Each prompt is sampled ``samples_per_prompt`` times; a response's advantage is its score
standardised within its group (Shao et al., 2024). With ``kl.mode: reward`` the summed sequence
KL is subtracted from the score before normalisation instead of being a loss term.
"""

from __future__ import annotations

from hybridflow.algorithms.api import JobWorkers, RewardScorer
from hybridflow.algorithms.common import average_worker_metrics, kl_adjusted_scores, rollout_and_score
from hybridflow.algorithms.state import AlgorithmState
from hybridflow.controller import Batch
from hybridflow.rlmath import core


def train_step(
    workers: JobWorkers, prompts: Batch, scorer: RewardScorer, state: AlgorithmState
) -> dict[str, float]:
    spec = state.spec
    batch, metrics = rollout_and_score(workers, prompts, scorer, spec)
    scores = kl_adjusted_scores(batch, state)
    advantages = core.grpo_outcome_advantages(
        scores, list(batch.non_tensors["uid"]), batch.tensors["response_mask"].float()
    )
    metrics.update(
        average_worker_metrics(workers.actor.update_policy(batch.with_fields(advantages=advantages)))
    )
    return metrics
