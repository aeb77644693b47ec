"""The train-inference mismatch: how far the rollout's log-probs are from the trainer's, and the corrections.

The setting. The rollout engine samples each response token ``y_t`` from its own distribution
``mu`` and reports ``log mu(y_t)`` (``rollout_log_probs``). ``mu`` is not the trainer's policy
``pi_old`` (its log-probs before the update: ``old_log_probs``, or on-policy the update's own
first forward, the same weights): the engine computes in another dtype or with other kernels
(vLLM in bf16 against an fp32 or bf16 FSDP forward), and with ``maxStaleness > 0`` it also holds
weights up to that many updates old. PPO's ratio ``pi / pi_old`` assumes the tokens were drawn
from ``pi_old``; they were drawn from ``mu``. The per-token importance ratio
``rho_t = pi_old(y_t) / mu(y_t)`` measures the gap and corrects it: each token's clipped loss is
multiplied by a detached weight ``w_t`` built from ``rho_t`` (the decoupled objective of
off-policy PPO, where ``pi_old`` is the proximal policy).

Conventions are :mod:`hybridflow.rlmath.core`'s: ``[batch, response_len]`` tensors, a mask that
selects the valid response tokens (selected with ``torch.where``, never multiplied, so padding
cannot leak), detached 0-d results, log-ratios clamped to ``[-20, 20]`` before ``exp``.

:func:`mismatch_metrics` (every step, whether or not a correction is on):

* ``kl``: KL(mu || pi_old) per token, k3 estimate ``mean(rho - 1 - log rho)`` over ``mu``'s own
  samples (Schulman, "Approximating KL divergence", 2020). k3 because it is unbiased
  (``E_mu[rho] = 1``, so the ``rho - 1`` term only removes variance) and never negative per
  token: numeric noise gives ``log rho`` of both signs, whose k1 mean cancels towards 0 or below
  it, while k3 is about ``mean((log rho)^2) / 2``, which grows with the noise as a gap should.
* ``abs_log_prob_diff`` and ``abs_log_prob_diff_max``: mean and largest ``|log rho_t|``.
* ``ratio_std``, ``ratio_min``, ``ratio_max``: the spread of ``rho`` before any correction.

:func:`correction_weights` (when ``spec.rollout.importanceSampling`` turns one on):

* ``token-truncate`` (truncated importance sampling, TIS: Espeholt et al., 2018, "IMPALA"; Yao
  et al., 2025, "Your efficient RL framework secretly brings you off-policy RL training", for the
  rollout-trainer mismatch): ``w_t = min(rho_t, max_weight)``. Bounded variance, a small bias
  where the cap binds.
* ``token-mask`` (masked importance sampling at the token level): ``w_t = 1`` when
  ``lower <= rho_t <= upper``, else 0: the token is dropped.
* ``sequence-mask``: a response is kept or dropped whole by its geometric-mean ratio
  ``exp(mean_t log rho_t)`` (Liu, Li et al., 2025, "When speed kills stability: demystifying RL
  collapse from the training-inference mismatch"; veRL's rollout correction, geometric rejection).
  The geometric mean does not drift with the length, as the product of the ratios does, so one
  band fits short and long responses; it is close to 1 even for a sizeable per-token gap, hence
  the narrow default band (``spec.rollout.importanceSampling.maskUpper``).

Kept tokens of the mask corrections train with weight 1 (rejection, not reweighting). A dropped
token keeps its place in the loss's denominator: the counts are global over the mini-batch and
taken before any forward pass (:mod:`hybridflow.workers.mini_batches`), and on-policy ``rho`` is
known only after the forward, so a dropped token is exactly a weight of 0 and the split into
micro-batches and ranks still never changes the loss.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import get_args

import torch

from hybridflow.spec.rollout import RolloutCorrectionName

__all__ = [
    "ROLLOUT_CORRECTIONS",
    "RolloutCorrection",
    "RolloutCorrectionKind",
    "correction_weights",
    "mismatch_metrics",
    "truncated_importance_weights",
]

RolloutCorrectionKind = RolloutCorrectionName
"""``spec.rollout.importanceSampling.correction``: one list of names for the spec and the math."""
ROLLOUT_CORRECTIONS: tuple[str, ...] = get_args(RolloutCorrectionKind)

# As in hybridflow.rlmath.core: exp() of a larger log-ratio overflows float32 long before it means anything.
_MAX_LOG_RATIO = 20.0


@dataclass(frozen=True)
class RolloutCorrection:
    """One correction and its bounds: ``max_weight`` for ``token-truncate``, ``[lower, upper]`` for the masks."""

    kind: RolloutCorrectionKind
    max_weight: float = 2.0
    lower: float = 0.5
    upper: float = 2.0

    def __post_init__(self) -> None:
        if self.kind not in ROLLOUT_CORRECTIONS:
            raise ValueError(
                f"rollout correction {self.kind!r} is not supported; use one of {', '.join(ROLLOUT_CORRECTIONS)}"
            )
        if self.max_weight < 1:
            raise ValueError(f"max_weight={self.max_weight} must be >= 1 (a cap below 1 shrinks every token)")
        if not 0 < self.lower < 1 < self.upper:
            raise ValueError(
                f"the kept band [{self.lower}, {self.upper}] must satisfy 0 < lower < 1 < upper (a band "
                "without 1 would drop the tokens on which rollout and trainer agree)"
            )


def _valid(mask: torch.Tensor) -> torch.Tensor:
    return mask if mask.dtype == torch.bool else mask != 0


def _log_ratio(trainer_logprob: torch.Tensor, rollout_logprob: torch.Tensor) -> torch.Tensor:
    """``log rho = trainer - rollout`` in float32 (bf16 inputs would round the tiny gaps away), clamped."""
    difference = trainer_logprob.detach().float() - rollout_logprob.detach().float()
    return torch.clamp(difference, -_MAX_LOG_RATIO, _MAX_LOG_RATIO)


def _mean(values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    selected = torch.where(valid, values, torch.zeros_like(values))
    return selected.sum() / valid.sum().clamp_min(1).to(values.dtype)


def _extreme(values: torch.Tensor, valid: torch.Tensor, *, largest: bool) -> torch.Tensor:
    """Max (or min) over the valid positions, of which there is at least one."""
    chosen = values[valid]
    return chosen.max() if largest else chosen.min()


def mismatch_metrics(
    trainer_logprob: torch.Tensor, rollout_logprob: torch.Tensor, response_mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    """The gap between the trainer's (``pi_old``) and the rollout's (``mu``) log-probs over the valid tokens.

    Keys ``kl``, ``abs_log_prob_diff``, ``abs_log_prob_diff_max``, ``ratio_std``, ``ratio_min``,
    ``ratio_max`` (see the module docstring), detached float64 scalars. All are 0 (the ratios 1)
    when the two agree; a batch with no valid token gives the same values. ``ratio_std`` is the
    biased (population) standard deviation: 0 for one token.

    Computed in float64, with k3 as ``expm1(log r) - log r``: a numeric gap is ~1e-3 per token, so
    k3 is ~1e-7, below float32's resolution next to 1, where ``exp(log r) - 1 - log r`` would be
    rounding noise.
    """
    valid = _valid(response_mask)
    with torch.no_grad():
        log_ratio = _log_ratio(trainer_logprob, rollout_logprob).double()
        ratio = torch.exp(log_ratio)
        gap = log_ratio.abs()
        if not bool(valid.any()):
            zero, one = torch.zeros((), dtype=torch.float64), torch.ones((), dtype=torch.float64)
            return {
                "kl": zero,
                "abs_log_prob_diff": zero,
                "abs_log_prob_diff_max": zero,
                "ratio_std": zero,
                "ratio_min": one,
                "ratio_max": one,
            }
        ratio_mean = _mean(ratio, valid)
        return {
            "kl": _mean(torch.expm1(log_ratio) - log_ratio, valid),
            "abs_log_prob_diff": _mean(gap, valid),
            "abs_log_prob_diff_max": _extreme(gap, valid, largest=True),
            "ratio_std": _mean((ratio - ratio_mean).square(), valid).sqrt(),
            "ratio_min": _extreme(ratio, valid, largest=False),
            "ratio_max": _extreme(ratio, valid, largest=True),
        }


def truncated_importance_weights(
    trainer_logprob: torch.Tensor,
    rollout_logprob: torch.Tensor,
    response_mask: torch.Tensor,
    max_weight: float,
) -> torch.Tensor:
    """Per-token ``min(rho_t, max_weight)``, detached; 0 at masked positions (``token-truncate``).

    Truncating from above bounds the variance a very stale or very unlikely token adds (see the
    module docstring for the sources); the weights carry no gradient.
    """
    valid = _valid(response_mask)
    with torch.no_grad():
        weights = torch.clamp(torch.exp(_log_ratio(trainer_logprob, rollout_logprob)), max=max_weight)
        return torch.where(valid, weights, torch.zeros_like(weights))


def _kept(log_ratio: torch.Tensor, valid: torch.Tensor, correction: RolloutCorrection) -> torch.Tensor:
    """Where a mask correction keeps the token (bool, ``[batch, response_len]``); compared in log space."""
    low, high = math.log(correction.lower), math.log(correction.upper)
    if correction.kind == "token-mask":
        return valid & (log_ratio >= low) & (log_ratio <= high)
    # sequence-mask: one verdict per row, from the mean log-ratio of its valid tokens (a row with
    # none has nothing to drop).
    selected = torch.where(valid, log_ratio, torch.zeros_like(log_ratio))
    row_mean = selected.sum(dim=-1) / valid.sum(dim=-1).clamp_min(1).to(log_ratio.dtype)
    keep_row = (row_mean >= low) & (row_mean <= high)
    return valid & keep_row.unsqueeze(-1)


def correction_weights(
    correction: RolloutCorrection,
    trainer_logprob: torch.Tensor,
    rollout_logprob: torch.Tensor,
    response_mask: torch.Tensor,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token weights ``[batch, response_len]`` (detached, 0 at masked positions) and their statistics.

    Statistics over the valid tokens: ``is_weight_mean`` always; ``is_truncated_fraction`` (tokens
    at the cap) for ``token-truncate``; ``is_masked_fraction`` (tokens dropped) for the masks.
    """
    valid = _valid(response_mask)
    with torch.no_grad():
        stats: dict[str, torch.Tensor] = {}
        if correction.kind == "token-truncate":
            weights = truncated_importance_weights(
                trainer_logprob, rollout_logprob, valid, correction.max_weight
            )
            stats["is_truncated_fraction"] = _mean((weights >= correction.max_weight).float(), valid)
        else:
            kept = _kept(_log_ratio(trainer_logprob, rollout_logprob), valid, correction)
            weights = kept.float()
            stats["is_masked_fraction"] = _mean((valid & ~kept).float(), valid)
        stats["is_weight_mean"] = _mean(weights, valid)
        return weights, stats
