"""How per-token losses become one number per optimizer step, and how that survives splitting.

A mini-batch (one optimizer step) is split twice before any loss is computed: across
data-parallel ranks (each gets its rows) and, on each rank, into micro-batches (one
forward/backward each, gradients accumulating). The result must not depend on either split:
``microBatchSizePerGpu`` and the DP size are memory and speed knobs. So every micro-batch
contributes its *sum* of per-token (or per-sequence) terms, divided by the *global* count of
the whole mini-batch, summed over micro-batches and DP ranks, and multiplied by the DP size
because FSDP and megatron's DDP average gradients over the DP group. Summing the
contributions of every micro-batch of every rank then gives exactly the loss of the whole
mini-batch taken at once.

The modes (``spec.algorithm.lossAggregation``), for per-token terms ``l[i, t]`` over the valid
tokens of ``N`` sequences with ``T_i`` valid tokens each:

* ``token-mean``: ``sum_i sum_t l[i, t] / sum_i T_i``. Every token weighs the same; the
  default of veRL and DAPO (Yu et al., 2025, section 3.3 "token-level policy gradient loss"),
  which argues that longer responses should not be down-weighted per token.
* ``seq-mean-token-mean``: ``1/N sum_i (1/T_i sum_t l[i, t])``. Every sequence weighs the
  same; the original PPO/GRPO formulation (Shao et al., 2024, eq. 3), which gives a token of a
  short response more weight than one of a long response.
* ``seq-mean-token-sum``: ``1/N sum_i sum_t l[i, t]``. Sums over tokens, averages over
  sequences; Dr. GRPO (Liu et al., 2025, "Understanding R1-Zero-like training") divides by a
  constant instead of the length to remove GRPO's length bias, which this mode does with the
  constant ``N``.

Pure functions, no distributed calls: the workers all-reduce the local counts
(:func:`local_counts`) over the DP group and build a :class:`LossNormalizer` from the sums.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

import torch

__all__ = [
    "LOSS_AGGREGATIONS",
    "LossAggregation",
    "LossNormalizer",
    "aggregate",
    "local_counts",
]

LossAggregation = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"]
LOSS_AGGREGATIONS: tuple[str, ...] = get_args(LossAggregation)


@dataclass(frozen=True)
class LossNormalizer:
    """The whole mini-batch's counts, as seen by one rank's micro-batches.

    ``tokens`` and ``sequences`` are summed over every micro-batch of every DP rank of the
    mini-batch; ``dp_size`` is the number of ranks whose gradients are averaged.
    """

    tokens: float
    sequences: float
    dp_size: int = 1

    def __post_init__(self) -> None:
        if self.dp_size < 1:
            raise ValueError(f"dp_size must be >= 1, got {self.dp_size}")

    def denominator(self, mode: LossAggregation) -> float:
        """The global count a micro-batch's sum is divided by (at least 1: an empty batch gives 0)."""
        return max(1.0, self.tokens if mode == "token-mean" else self.sequences)


def local_counts(response_mask: torch.Tensor) -> tuple[float, float]:
    """(valid tokens, sequences) of one rank's part of a mini-batch; the workers sum them over DP."""
    return float((response_mask != 0).sum()), float(response_mask.shape[0])


def _valid(mask: torch.Tensor) -> torch.Tensor:
    return mask if mask.dtype == torch.bool else mask != 0


def aggregate(
    per_token: torch.Tensor,
    response_mask: torch.Tensor,
    mode: LossAggregation = "token-mean",
    normalizer: LossNormalizer | None = None,
) -> torch.Tensor:
    """Reduce ``[batch, response_len]`` per-token terms to a scalar by ``mode``.

    With ``normalizer`` None the batch is the whole mini-batch (a plain mean by ``mode``).
    Otherwise the result is this micro-batch's share: its sum divided by the global count and
    multiplied by ``normalizer.dp_size``, so backward on every share accumulates the gradient
    of the whole mini-batch's loss. Masked positions never contribute (selected away, so a NaN
    in padding cannot leak); a row with no valid token contributes 0.
    """
    if mode not in LOSS_AGGREGATIONS:
        raise ValueError(
            f"loss aggregation {mode!r} is not supported; use one of {', '.join(LOSS_AGGREGATIONS)}"
        )
    valid = _valid(response_mask)
    selected = torch.where(valid, per_token, torch.zeros_like(per_token))
    if mode == "token-mean":
        total = selected.sum()
    else:
        row_sums = selected.sum(dim=-1)
        if mode == "seq-mean-token-mean":
            row_sums = row_sums / valid.sum(dim=-1).clamp_min(1).to(per_token.dtype)
        total = row_sums.sum()
    if normalizer is None:
        local = LossNormalizer(*local_counts(valid))
        return total / local.denominator(mode)
    return total * normalizer.dp_size / normalizer.denominator(mode)
