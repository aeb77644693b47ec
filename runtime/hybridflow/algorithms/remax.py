"""ReMax: REINFORCE with the greedy response's score as the baseline (Li et al., 2023).

Per step, every prompt is also decoded greedily once; a sampled response's advantage is its
score minus the greedy response's score for the same prompt. One extra generation replaces the
critic. KL follows ``spec.algorithm.kl.mode`` as in GRPO.
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
    samples = state.spec.algorithm.samples_per_prompt
    batch, metrics = rollout_and_score(workers, prompts, scorer, state.spec, timer)
    # The weights were synced by rollout_and_score; the greedy pass uses the same policy.
    with timer.phase("generate"):
        greedy = workers.rollout.generate_sequences(prompts.with_meta(samples=1, greedy=True))
    with timer.phase("reward"):
        greedy_scores, _ = scorer.scores(greedy)
    with timer.phase("advantages"):
        scores = kl_adjusted_scores(batch, state)
        advantages = core.remax_outcome_advantages(
            scores, greedy_scores.repeat_interleave(samples), batch.tensors["response_mask"].float()
        )
    metrics["reward/greedy_baseline"] = float(greedy_scores.mean())
    with timer.phase("actor_update"):
        updates = workers.actor.update_policy(batch.with_fields(advantages=advantages))
    return metrics | average_worker_metrics(updates) | timer.metrics()
