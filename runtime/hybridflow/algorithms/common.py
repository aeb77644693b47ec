"""The part of an RL step every algorithm shares: sync, generate, score, old and reference log-probs."""

from __future__ import annotations

from typing import Any

import torch

from hybridflow.algorithms.api import JobWorkers, RewardScorer, needs_old_log_probs, needs_weight_sync
from hybridflow.algorithms.state import AlgorithmState
from hybridflow.algorithms.timing import StepTimer
from hybridflow.controller import Batch
from hybridflow.metrics.catalogue import combine_values
from hybridflow.rlmath import core
from hybridflow.spec import RLHFJobSpec

__all__ = [
    "average_worker_metrics",
    "kl_adjusted_scores",
    "kl_penalized_token_rewards",
    "rollout_and_score",
    "sequence_kl",
]


def rollout_and_score(
    workers: JobWorkers, prompts: Batch, scorer: RewardScorer, spec: RLHFJobSpec, timer: StepTimer
) -> tuple[Batch, dict[str, float]]:
    """Generate ``samples_per_prompt`` responses per prompt and add scores and the log-probs needed.

    ``scores`` (one per row) always; ``token_scores`` too when a reward function returned a
    token-level reward (:meth:`~hybridflow.rewards.scorer.RewardScorer.score_tokens`).

    ``old_log_probs`` only when :func:`~hybridflow.algorithms.api.needs_old_log_probs` (else the
    actor's update takes its own), ``ref_log_probs`` only when the job has a reference (a KL
    term). The actor and reference passes are submitted before scoring, so the reward
    functions run in the controller's process pool while the workers compute. ``timer``
    records ``weight_sync`` (when :func:`~hybridflow.algorithms.api.needs_weight_sync`),
    ``generate``, ``reward`` and, when they run, ``old_log_probs`` and
    ``ref_log_probs`` (only the wait they add after scoring: see
    :mod:`~hybridflow.algorithms.timing`); the caller returns ``timer.metrics()``.
    """
    if needs_weight_sync(spec):
        with timer.phase("weight_sync"):
            workers.rollout.sync_weights()
    with timer.phase("generate"):
        batch = workers.rollout.generate_sequences(prompts)
    old = ref = None
    if needs_old_log_probs(spec):
        old = timer.submit("old_log_probs", workers.actor.compute_log_probs, batch)
    if workers.reference is not None:
        ref = timer.submit("ref_log_probs", workers.reference.compute_ref_log_probs, batch)
    with timer.phase("reward"):
        scores, token_scores, metrics = scorer.score_tokens(batch)
    for future in (old, ref):
        if future is not None:
            batch = batch.union(future.result())
    batch = batch.with_fields(scores=scores)
    if token_scores is not None:
        batch = batch.with_fields(token_scores=token_scores)
    mask = batch.tensors["response_mask"].float()
    metrics.update(
        {
            "reward/mean": float(scores.mean()),
            "reward/std": float(scores.std()) if len(scores) > 1 else 0.0,
            "response/length_mean": float(mask.sum(dim=1).mean()),
            "tokens/step": float(batch.tensors["attention_mask"].sum()),
        }
    )
    if "old_log_probs" in batch.tensors and "ref_log_probs" in batch.tensors:
        kl = core.kl_penalty(
            batch.tensors["old_log_probs"], batch.tensors["ref_log_probs"], spec.algorithm.kl.estimator
        )
        metrics["kl/actor_ref"] = float(core.masked_mean(kl, mask))
    return batch, metrics


def sequence_kl(batch: Batch, estimator: core.KLEstimator) -> torch.Tensor:
    """Per-sequence summed KL(actor || reference) over response tokens."""
    mask = batch.tensors["response_mask"].float()
    per_token = core.kl_penalty(batch.tensors["old_log_probs"], batch.tensors["ref_log_probs"], estimator)
    return core.masked_sum(per_token, mask, dim=1)


def average_worker_metrics(per_rank: list[dict[str, float]] | Any) -> dict[str, float]:
    """The step's value of each metric an update returns, over DP ranks: the mean, or the max or min
    of an extreme (the catalogue's ``combine``: a step's largest log-prob gap is any rank's largest)."""
    keys = sorted({k for m in per_rank for k in m})
    return {k: combine_values(k, [m[k] for m in per_rank if k in m]) for k in keys}


def kl_adjusted_scores(batch: Batch, state: AlgorithmState) -> torch.Tensor:
    """Sequence scores, minus ``coef * summed KL`` when ``kl.mode`` is ``reward`` (outcome-baseline algorithms)."""
    kl = state.spec.algorithm.kl
    scores = batch.tensors["scores"]
    if kl.mode == "reward" and "ref_log_probs" in batch.tensors:
        scores = scores - state.kl_controller.value * sequence_kl(batch, kl.estimator)
    return scores


def kl_penalized_token_rewards(
    batch: Batch, scores: torch.Tensor, state: AlgorithmState, metrics: dict[str, float]
) -> torch.Tensor:
    """``scores`` on each response's last token and, when ``kl.mode`` is ``reward``, ``-coef * KL``
    on every token (the InstructGPT penalty). Updates the KL controller and records its coefficient.

    When the batch has ``token_scores`` (a token-level reward: :func:`rollout_and_score`), they
    replace the placed ``scores``: each value stays on its token, so GAE credits it there."""
    kl = state.spec.algorithm.kl
    mask = batch.tensors["response_mask"].float()
    token_rewards = (
        batch.tensors["token_scores"]
        if "token_scores" in batch.tensors
        else core.place_outcome_score(scores, mask)
    )
    if kl.mode != "reward" or "ref_log_probs" not in batch.tensors:
        return token_rewards
    token_rewards, mean_kl = core.apply_kl_penalty_to_rewards(
        token_rewards,
        batch.tensors["old_log_probs"],
        batch.tensors["ref_log_probs"],
        mask,
        state.kl_controller.value,
        kl.estimator,
    )
    state.kl_controller.update(float(mean_kl), len(batch))
    metrics["kl/coef"] = state.kl_controller.value
    return token_rewards
