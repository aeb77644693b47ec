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

from hybridflow.controller import Batch, WorkerContext
from hybridflow.rlmath.aggregation import LossNormalizer, local_counts
from hybridflow.rlmath.rollout_correction import RolloutCorrection
from hybridflow.spec import RLHFJobSpec

__all__ = [
    "DPSum",
    "dp_sum_over",
    "global_normalizers",
    "kl_exceeded",
    "local_mini_batches",
    "rollout_correction",
    "token_budget_micro_batches",
    "trim_padding",
    "update_micro_batches",
]

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


def rollout_correction(spec: RLHFJobSpec, *, dtypes_differ: bool) -> RolloutCorrection | None:
    """The correction the actor applies to its policy loss, or None (:meth:`RolloutSpec.corrects`).

    ``dtypes_differ``: :func:`hybridflow.workers.weight_push.dtypes_differ` on the actor's rank.
    When it is on, the batch must carry the rollout's log-probs, which every rollout returns.
    """
    rollout = spec.rollout
    if not rollout.corrects(dtypes_differ=dtypes_differ):
        return None
    choice = rollout.importance_sampling
    lower, upper = choice.mask_band
    return RolloutCorrection(choice.correction, max_weight=choice.max_weight, lower=lower, upper=upper)


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


# --------------------------------------------------------------------------- token-budget micro-batches

FULL_WIDTH_FIELDS = ("input_ids", "attention_mask", "position_ids")
"""``[rows, prompt + response]`` fields; every other ``[rows, R]`` tensor is per response token."""


def trim_padding(micro: Batch) -> Batch:
    """Drop the columns that are padding in every row: leading prompt columns, trailing response columns.

    The engine layout pads every prompt on the left to ``data.maxPromptTokens`` and every
    response on the right to ``rollout.maxResponseTokens``; a micro-batch of short rows carries
    that padding through every layer. Trimming keeps the layout (left-padded prompt, right-padded
    response, response starting at the same column) and every valid token, so the results for
    the valid tokens are those of the untrimmed batch; at least one prompt column and one
    response column stay.
    """
    response_len = int(micro.tensors["responses"].shape[1])
    attention = micro.tensors["attention_mask"] != 0
    prompt_width = attention.shape[1] - response_len
    used_prompt = attention[:, :prompt_width].any(dim=0).nonzero()
    first = min(int(used_prompt[0]) if len(used_prompt) else prompt_width - 1, prompt_width - 1)
    used_response = (micro.tensors["response_mask"] != 0).any(dim=0).nonzero()
    keep_response = max(1, int(used_response[-1]) + 1 if len(used_response) else 1)
    fields: dict[str, torch.Tensor] = {}
    for name, tensor in micro.tensors.items():
        if name in FULL_WIDTH_FIELDS:
            fields[name] = tensor[:, first : prompt_width + keep_response]
        elif tensor.dim() >= 2 and tensor.shape[1] == response_len:
            fields[name] = tensor[:, :keep_response]
        else:
            fields[name] = tensor
    return Batch(fields, micro.non_tensors, micro.meta)


def token_budget_micro_batches(
    mini: Batch, max_tokens: int, *, dp_sum: DPSum, dp_size: int, dp_rank: int, packed: bool = False
) -> list[Batch]:
    """This rank's micro-batches of about ``max_tokens`` (padded) tokens each, trimmed of padding.

    Rows are sorted by length so that short rows share micro-batches (less padding after
    :func:`trim_padding`), then packed greedily: a micro-batch takes rows while its rows times
    its widest row stay within ``max_tokens`` (a single longer row gets one alone). The order
    does not matter to the loss, whose counts are global. Every DP rank must run the same number
    of forward passes (FSDP gathers each layer's parameters collectively), so the count is the
    largest any rank needs, capped by the fewest rows any rank has; one all-reduce settles both.
    A rank that needs fewer splits its largest micro-batches; one that needs more than the cap
    merges its smallest (and exceeds the budget).

    ``packed`` (``spec.training.packSequences``): the pass runs on the rows' real tokens laid end
    to end, so a micro-batch takes rows while the sum of their real lengths stays within the
    budget instead.
    """
    response_len = int(mini.tensors["responses"].shape[1])
    attention = mini.tensors["attention_mask"] != 0
    prompt_lengths = attention[:, :-response_len].sum(dim=1)
    # A row's last valid response column (trimming keeps up to the widest one in the micro-batch).
    columns = torch.arange(1, response_len + 1).expand_as(mini.tensors["response_mask"])
    response_extents = torch.where(mini.tensors["response_mask"] != 0, columns, 0).amax(dim=1).clamp_min(1)
    order = torch.argsort(prompt_lengths + response_extents, descending=True, stable=True)
    ordered = mini.rows(order.numpy())
    groups: list[list[int]] = []
    prompt_width = response_width = real_tokens = 0
    for index, (prompt, response) in enumerate(
        zip(prompt_lengths[order].tolist(), response_extents[order].tolist(), strict=True)
    ):
        wider = (max(prompt_width, prompt, 1), max(response_width, response))
        if packed:  # real tokens, end to end
            cost = real_tokens + prompt + response
        else:  # rows x the widest row, after trimming
            cost = (len(groups[-1]) + 1) * (wider[0] + wider[1]) if groups else 0
        if groups and cost <= max_tokens:
            groups[-1].append(index)
            prompt_width, response_width = wider
            real_tokens += prompt + response
        else:
            groups.append([index])
            prompt_width, response_width = max(prompt, 1), response
            real_tokens = prompt + response
    # One collective for max(needed) and min(rows): a one-hot column per rank, summed.
    table = torch.zeros((2, dp_size), dtype=torch.float64)
    table[:, dp_rank] = torch.tensor([float(len(groups)), float(len(ordered))])
    table = dp_sum(table)
    count = int(min(table[0].max(), table[1].min()))
    while len(groups) < count:  # split the group with the most rows
        largest = max(range(len(groups)), key=lambda g: len(groups[g]))
        group = groups.pop(largest)
        groups[largest:largest] = [group[: len(group) // 2], group[len(group) // 2 :]]
    while len(groups) > count:  # merge the two smallest neighbours
        pair = min(range(len(groups) - 1), key=lambda g: len(groups[g]) + len(groups[g + 1]))
        groups[pair : pair + 2] = [groups[pair] + groups[pair + 1]]
    return [trim_padding(ordered.rows(group)) for group in groups]


def update_micro_batches(spec: RLHFJobSpec, ctx: WorkerContext, mini: Batch, dp_sum: DPSum) -> list[Batch]:
    """The FSDP update loops' micro-batches: by token budget when the spec sets one, else by rows."""
    budget = spec.training.max_tokens_per_micro_batch
    if budget is None:
        return mini.chunk_by_size(spec.training.micro_batch_size_per_gpu)
    return token_budget_micro_batches(
        mini,
        budget,
        dp_sum=dp_sum,
        dp_size=ctx.mesh.dp_size,
        dp_rank=ctx.coord.dp,
        packed=spec.training.pack_sequences,
    )
