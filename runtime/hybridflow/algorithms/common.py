"""The part of an RL step every algorithm shares: sync, generate, score, old and reference log-probs."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from hybridflow.algorithms.api import JobWorkers, RewardScorer, needs_old_log_probs
from hybridflow.algorithms.state import AlgorithmState
from hybridflow.controller import Batch
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
    workers: JobWorkers, prompts: Batch, scorer: RewardScorer, spec: RLHFJobSpec
) -> tuple[Batch, dict[str, float]]:
    """Generate ``samples_per_prompt`` responses per prompt and add scores and the log-probs needed.

    ``old_log_probs`` only when :func:`~hybridflow.algorithms.api.needs_old_log_probs` (else the
    actor's update takes its own), ``ref_log_probs`` only when the job has a reference (a KL
    term). The actor and reference passes are submitted before scoring, so the reward
    functions run in the controller's process pool while the workers compute. The returned
    metrics include ``timing/*`` seconds per phase (weight sync, generation, reward and
    log-probs together), the breakdown dashboards show.
    """
    clock = time.monotonic()
    timing: dict[str, float] = {}

    def lap(phase: str) -> None:
        nonlocal clock
        now = time.monotonic()
        timing[f"timing/{phase}"] = now - clock
        clock = now

    workers.rollout.sync_weights()
    lap("weight_sync")
    batch = workers.rollout.generate_sequences(prompts)
    lap("generate")
    old = workers.actor.compute_log_probs.submit(batch) if needs_old_log_probs(spec) else None
    ref = workers.reference.compute_ref_log_probs.submit(batch) if workers.reference is not None else None
    scores, metrics = scorer.scores(batch)
    lap("reward")
    for future in (old, ref):
        if future is not None:
            batch = batch.union(future.result())
    batch = batch.with_fields(scores=scores)
    lap("log_probs")
    metrics.update(timing)
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
    """Mean over DP ranks of the metric dicts an update returns."""
    keys = sorted({k for m in per_rank for k in m})
    return {k: float(np.mean([m[k] for m in per_rank if k in m])) for k in keys}


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
    on every token (the InstructGPT penalty). Updates the KL controller and records its coefficient."""
    kl = state.spec.algorithm.kl
    mask = batch.tensors["response_mask"].float()
    token_rewards = core.place_outcome_score(scores, mask)
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
