"""REINFORCE with a batch-mean baseline, as a plugin: ``algorithm.name: my_reinforce:train_step``."""

from hybridflow.algorithms.api import AlgorithmState, JobWorkers, RewardScorer
from hybridflow.algorithms.common import average_worker_metrics
from hybridflow.controller import Batch


def train_step(workers: JobWorkers, prompts: Batch, scorer: RewardScorer, state: AlgorithmState) -> dict[str, float]:
    workers.rollout.sync_weights()  # the rollout generates with the actor's current weights
    batch = workers.rollout.generate_sequences(prompts)  # samplesPerPrompt responses per prompt
    scores, metrics = scorer.scores(batch)  # one score per response: rule functions, reward model
    mask = batch.tensors["response_mask"].float()
    advantages = (scores - scores.mean())[:, None] * mask  # the same advantage on every token
    # No old log-probs: one mini-batch and one epoch, so the actor's own forward supplies them.
    updates = workers.actor.update_policy(batch.with_fields(advantages=advantages))
    metrics.update(average_worker_metrics(updates))
    metrics["reward/mean"] = float(scores.mean())
    metrics["tokens/step"] = float(batch.tensors["attention_mask"].sum())
    return metrics
