"""What the actor and critic update loops of every backend share: global loss counts and the KL stop.

Protocol of an update call (``update_policy`` / ``update_critic``, one per RL step, on every DP
rank with its ``DP_SPLIT_EXACT`` rows): the rank cuts its rows into local mini-batches (the
same number on every rank), then, before any forward pass, :func:`global_normalizers` sums each
mini-batch's valid tokens and sequences over the DP group in **one** all-reduce, so each
micro-batch's loss can be divided by counts of the whole mini-batch
(:mod:`hybridflow.rlmath.aggregation`). After each epoch, :func:`kl_exceeded` averages the
epoch's k3 KL estimate over the DP group (a second all-reduce) so that every rank takes the
same early-stop decision and the ranks never disagree on how many collectives follow.

``dp_sum`` is the backend's sum over its data-parallel group (the default group under FSDP,
megatron's DP group), or the identity for one rank.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from hybridflow.controller import Batch
from hybridflow.rlmath.aggregation import LossNormalizer, local_counts

__all__ = ["DPSum", "dp_sum_over", "global_normalizers", "kl_exceeded", "local_mini_batches"]

DPSum = Callable[[torch.Tensor], torch.Tensor]


def dp_sum_over(group: dist.ProcessGroup | None, device: torch.device) -> DPSum:
    """A sum over ``group`` (None: the default group) that runs on ``device`` (gloo: CPU, NCCL: CUDA)."""

    def dp_sum(tensor: torch.Tensor) -> torch.Tensor:
        if not dist.is_initialized() or dist.get_world_size(group) == 1:
            return tensor
        reduced = tensor.to(device)
        dist.all_reduce(reduced, group=group)
        return reduced.cpu()

    return dp_sum


def local_mini_batches(
    batch: Batch, local_mini_batch_size: int, *, on_policy: bool, epochs: int
) -> list[Batch]:
    """This rank's mini-batches; checks the on-policy contract when the batch has no old log-probs.

    Without ``old_log_probs`` the controller skipped the separate scoring pass because the
    update is one mini-batch and one epoch: the update then takes the detached log-probs of
    its own forward as the old ones (ratio exactly 1). Anything else needs the pass.
    """
    minis = batch.chunk_by_size(local_mini_batch_size)
    if on_policy and (len(minis) != 1 or epochs != 1):
        raise ValueError(
            f"the batch has no old_log_probs, which is only allowed for one mini-batch and one epoch; got "
            f"{len(minis)} mini-batches of {local_mini_batch_size} rows and ppoEpochs={epochs}"
        )
    return minis


def global_normalizers(minis: Sequence[Batch], *, dp_size: int, dp_sum: DPSum) -> list[LossNormalizer]:
    """Per mini-batch, its (tokens, sequences) summed over the DP group; one collective for all."""
    counts = torch.tensor(
        [local_counts(mini.tensors["response_mask"]) for mini in minis], dtype=torch.float64
    ).reshape(len(minis), 2)
    counts = dp_sum(counts)
    return [LossNormalizer(tokens=float(t), sequences=float(s), dp_size=dp_size) for t, s in counts.tolist()]


def kl_exceeded(target_kl: float | None, epoch_k3: Sequence[float], *, dp_size: int, dp_sum: DPSum) -> bool:
    """Whether the epoch's mean k3 KL, averaged over DP ranks, is above ``target_kl`` (None: never)."""
    if target_kl is None or not epoch_k3:
        return False
    local = torch.tensor([sum(epoch_k3) / len(epoch_k3)], dtype=torch.float64)
    return float(dp_sum(local)[0]) / dp_size > target_kl
