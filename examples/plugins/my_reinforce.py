"""REINFORCE with a batch-mean baseline, as a plugin: ``algorithm.name: my_reinforce:train_step``."""

from hybridflow.algorithms.api import AlgorithmState, JobWorkers, RewardScorer, StepTimer
from hybridflow.algorithms.common import average_worker_metrics, rollout_and_score
from hybridflow.controller import Batch


def train_step(workers: JobWorkers, prompts: Batch, scorer: RewardScorer, state: AlgorithmState) -> dict[str, float]:
    timer = StepTimer()  # seconds per phase, reported as timing/<phase> (the rest as timing/other)
    # Sync the weights, generate samplesPerPrompt responses per prompt and score them. kl.coef 0 and
    # one mini-batch per step: no reference pass, and the actor's own forward gives the old log-probs.
    batch, metrics = rollout_and_score(workers, prompts, scorer, state.spec, timer)
    with timer.phase("advantages"):
        scores, mask = batch.tensors["scores"], batch.tensors["response_mask"].float()
        advantages = (scores - scores.mean())[:, None] * mask  # the same advantage on every token
    with timer.phase("actor_update"):
        updates = workers.actor.update_policy(batch.with_fields(advantages=advantages))
    return metrics | average_worker_metrics(updates) | timer.metrics()
