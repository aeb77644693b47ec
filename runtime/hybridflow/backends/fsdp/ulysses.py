"""Ulysses sequence parallelism: each rank of a group holds a slice of the sequence, attention swaps heads.

DeepSpeed-Ulysses (Jacobs et al., 2023). A batch's sequence of ``S`` columns is split into ``P``
contiguous slices, one per rank of the sequence-parallel (SP) group. Everything in a decoder layer
except attention works token by token, so each rank runs it on its own ``S / P`` columns. Around
attention, one all-to-all turns each rank's ``[B, H, S/P, D]`` queries, keys and values (all
heads, its columns) into ``[B, H/P, S, D]`` (its heads, every column); attention runs over the
whole sequence for those heads, and a second all-to-all returns the output to ``[B, S/P, H, D]``.
Activations per rank are those of ``S / P`` tokens (attention's ``S x S`` scores too, for
``H / P`` heads); the weights are whole on every rank (FSDP shards them, independently).

Protocol, for one micro-batch of engine-layout rows (:mod:`hybridflow.engines.layout`), on every
rank of the SP group together, each with the same full batch:

1. Once per model, before sharding: :func:`use_ulysses_attention` checks the head layout
   (:func:`check_ulysses_layout`) and switches the model to :data:`ULYSSES_ATTENTION`, an
   implementation registered with transformers' ``AttentionInterface``.
2. ``with ulysses_context(group, attention_mask):`` installs the group and the batch's *full*
   ``[B, S]`` attention mask for every attention call until the block ends. Each rank's forward
   sees only its columns, so transformers cannot build the causal + padding mask over the whole
   sequence; the context builds it once, and the mask transformers passes (none: see below) is
   never used.
3. Inside the block: :func:`ulysses_token_logprobs_and_entropy` (the sequence-parallel
   :func:`~hybridflow.backends.fsdp.logprobs.token_logprobs_and_entropy`) shards the columns
   (:func:`shard_sequence`), runs the model on them and gathers the log-probs of the whole
   sequence (:func:`gather_sequence`): every rank gets the same ``[B, R]`` results.
4. Still inside the block: the loss and ``backward()``. With activation checkpointing the
   backward pass recomputes each layer's forward, attention and its all-to-alls included, so
   the context must still be installed; attention called outside any context raises instead of
   silently attending over one rank's columns.

Every collective here (the all-to-alls of each attention call in forward *and* backward, the
gather) is called by all ranks of the group in the same order: every rank must run the same
number of forwards and backwards, and each rank's loss must depend on the gathered results,
or the others wait forever. :func:`ulysses_token_logprobs_and_entropy` keeps its local results
connected to the model's output even on a rank none of whose columns is scored.

Gradients: each rank's parameter gradients cover only the contribution of its own tokens (and of
its heads, inside attention); the full gradient is their **sum** over the SP group. Under FSDP
(or DDP), whose gradient reduction *averages* over the data-parallel mesh, that mesh normally
includes the SP ranks (FSDP over every rank of the world, SP groups inside it): the average then
divides by ``dp * sp`` where the batch mean needs ``dp``, so each rank multiplies its loss by
:func:`fsdp_loss_scale` (``sp``). Where gradients are summed over the SP group by hand
(``all_reduce(SUM)``), the loss is not scaled.

Transformers integration: a registered attention implementation that has no entry in
``AttentionMaskInterface`` gets no mask from the model (``masking_utils`` skips mask creation for
it), so the local forward builds none; the model is called with ``attention_mask=None``. Keyword
arguments transformers adds to the attention call (``position_ids``, ``cu_seq_lens_*``,
``output_attentions``...) are ignored; a ``sliding_window`` layer is refused (only full causal
attention is implemented), and so is a KV cache (keys longer than the local queries).

The all-to-all uses ``torch.distributed.all_to_all_single``, which gloo supports on CPU (torch
2.13), so the same code runs on CUDA/NCCL and in the CPU tests (``tests/unit/test_ulysses.py``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from hybridflow.rlmath.logits import token_logprobs_and_entropy_from_logits

__all__ = [
    "ULYSSES_ATTENTION",
    "all_to_all",
    "check_ulysses_layout",
    "fsdp_loss_scale",
    "gather_sequence",
    "padded_sequence_len",
    "sequence_parallel_problem",
    "shard_sequence",
    "ulysses_attention_forward",
    "ulysses_context",
    "ulysses_token_logprobs_and_entropy",
    "use_ulysses_attention",
]

ULYSSES_ATTENTION = "hybridflow_ulysses_sdpa"
"""The name :func:`use_ulysses_attention` registers :func:`ulysses_attention_forward` under and sets
as the model's ``attn_implementation``."""


# --------------------------------------------------------------------------- layout


def check_ulysses_layout(num_heads: int, num_kv_heads: int, sp_size: int) -> None:
    """Raise ``ValueError`` unless ``sp_size`` ranks can each take whole query and KV heads.

    Each rank gets ``num_heads / sp_size`` query heads and ``num_kv_heads / sp_size`` KV heads (so
    a query head's KV head lands on the same rank: both are split into contiguous runs). KV heads
    are not replicated, so fewer KV heads than ranks is refused too (grouped-query models with few
    KV heads need a smaller SP size).
    """
    if sp_size < 1:
        raise ValueError(f"sequence-parallel size {sp_size} must be at least 1")
    if num_heads % sp_size != 0:
        raise ValueError(
            f"num_attention_heads={num_heads} is not divisible by the sequence-parallel size {sp_size}: "
            "Ulysses gives each rank the same number of whole query heads"
        )
    if num_kv_heads < sp_size:
        raise ValueError(
            f"num_key_value_heads={num_kv_heads} is smaller than the sequence-parallel size {sp_size}: "
            "KV heads are split across ranks, not replicated; use a size that divides it"
        )
    if num_kv_heads % sp_size != 0:
        raise ValueError(
            f"num_key_value_heads={num_kv_heads} is not divisible by the sequence-parallel size {sp_size}: "
            "Ulysses gives each rank the same number of whole KV heads"
        )


def sequence_parallel_problem(num_heads: int, num_kv_heads: int, sp_size: int, model_path: str) -> str | None:
    """Why ``spec.training.sequenceParallelSize`` ``sp_size`` cannot split the model at ``model_path``.

    ``None`` when it can. One message for both places that ask: ``hybridflow.preflight`` reads
    the head counts from ``config.json`` before Ray starts, the FSDP backend from the loaded
    model (the last word, for a model no preflight could read).
    """
    try:
        check_ulysses_layout(num_heads, num_kv_heads, sp_size)
    except ValueError as err:
        return (
            f"spec.training.sequenceParallelSize: {sp_size} does not split the attention heads of {model_path} "
            f"({err}); allowed: a size that divides both num_attention_heads={num_heads} and "
            f"num_key_value_heads={num_kv_heads}"
        )
    return None


def padded_sequence_len(sequence_len: int, sp_size: int) -> int:
    """``sequence_len`` rounded up to a multiple of ``sp_size``: the width every rank's slice divides."""
    return -(-sequence_len // sp_size) * sp_size


def shard_sequence(tensor: torch.Tensor, *, sp_rank: int, sp_size: int, fill: int) -> torch.Tensor:
    """Rank ``sp_rank``'s contiguous slice of the columns of ``tensor [B, S, ...]``, padded with ``fill``.

    ``S`` is first padded on the right to :func:`padded_sequence_len` with ``fill``: for
    ``input_ids`` the pad token, for ``position_ids`` 0 (any valid position: the padded columns
    are masked out as keys and their outputs are never read), for an attention mask 0. Pure.
    """
    if not 0 <= sp_rank < sp_size:
        raise ValueError(f"sp_rank={sp_rank} is not a rank of a sequence-parallel group of {sp_size}")
    sequence_len = int(tensor.shape[1])
    padding = padded_sequence_len(sequence_len, sp_size) - sequence_len
    if padding:
        filler = tensor.new_full((tensor.shape[0], padding, *tensor.shape[2:]), fill)
        tensor = torch.cat([tensor, filler], dim=1)
    local_len = int(tensor.shape[1]) // sp_size
    return tensor[:, sp_rank * local_len : (sp_rank + 1) * local_len]


# --------------------------------------------------------------------------- collectives


def _all_to_all(x: torch.Tensor, group: dist.ProcessGroup, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Send chunk ``j`` of ``x`` along ``scatter_dim`` to rank ``j``; concatenate what arrives along ``gather_dim``.

    What arrives from rank ``i`` is placed ``i``-th, so rank order is column (or head) order.
    """
    size = dist.get_world_size(group)
    if size == 1:
        return x
    if x.shape[scatter_dim] % size != 0:
        raise ValueError(
            f"all-to-all: dimension {scatter_dim} of shape {tuple(x.shape)} does not split into {size} equal chunks"
        )
    send = torch.stack(x.chunk(size, dim=scatter_dim))  # [size, ...], contiguous
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    return torch.cat(received.unbind(0), dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    """:func:`_all_to_all` with its inverse (dimensions swapped) as the backward: the exchange is a
    permutation of elements across ranks, so its adjoint is the reverse permutation."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, group: dist.ProcessGroup, scatter_dim: int, gather_dim: int
    ) -> torch.Tensor:
        ctx.group, ctx.scatter_dim, ctx.gather_dim = group, scatter_dim, gather_dim
        return _all_to_all(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return _all_to_all(grad.contiguous(), ctx.group, ctx.gather_dim, ctx.scatter_dim), None, None, None


def all_to_all(
    x: torch.Tensor, group: dist.ProcessGroup, *, scatter_dim: int, gather_dim: int
) -> torch.Tensor:
    """Differentiable all-to-all over ``group``: split ``scatter_dim`` across ranks, join ``gather_dim``.

    ``[B, H, S/P, D]`` with ``scatter_dim=1, gather_dim=2`` becomes ``[B, H/P, S, D]`` (this rank's
    heads, every column); ``scatter_dim=2, gather_dim=1`` takes it back. Collective; the backward
    is the inverse all-to-all, also collective.
    """
    out: torch.Tensor = _AllToAll.apply(x, group, scatter_dim, gather_dim)
    return out


class _GatherSequence(torch.autograd.Function):
    """All-gather of per-rank column slices; the backward hands each rank the gradient of its slice.

    Not the sum over ranks that a generic all-gather's adjoint would give: every rank computes
    the *same* loss from the gathered tensor, so the loss's gradient with respect to rank ``r``'s
    slice is already complete on rank ``r`` (summing would count it ``P`` times).
    """

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        size = dist.get_world_size(group)
        ctx.size, ctx.rank = size, dist.get_rank(group)
        if size == 1:
            return local
        pieces = [torch.empty_like(local) for _ in range(size)]
        dist.all_gather(pieces, local.contiguous(), group=group)
        return torch.cat(pieces, dim=1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad.chunk(ctx.size, dim=1)[ctx.rank].contiguous(), None


def gather_sequence(local: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Each rank's ``[B, S/P, ...]`` slice joined into ``[B, S_padded, ...]`` on every rank (differentiable).

    Collective. The backward returns each rank the gradient of its own slice, which is right when
    every rank computes the same loss from the result (see :class:`_GatherSequence`); slice the
    padding off (``[:, :S]``) before using it.
    """
    out: torch.Tensor = _GatherSequence.apply(local, group)
    return out


def fsdp_loss_scale(sp_size: int) -> int:
    """The factor each rank multiplies its loss by when FSDP/DDP average gradients over a mesh that includes its SP group.

    Each rank's gradient is its tokens' share; the batch gradient is the sum over the SP group,
    then the mean over the data-parallel replicas: ``(1/dp) sum_dp sum_sp g = (1/(dp*sp)) sum_all
    (sp * g)``, and FSDP's reduce-scatter computes ``(1/(dp*sp)) sum_all``. Do not scale where the
    SP gradients are summed by hand instead.
    """
    if sp_size < 1:
        raise ValueError(f"sequence-parallel size {sp_size} must be at least 1")
    return sp_size


# --------------------------------------------------------------------------- attention


@dataclass(frozen=True)
class _ActiveBatch:
    """What :func:`ulysses_context` installs for the attention calls of one micro-batch."""

    group: dist.ProcessGroup
    sp_size: int
    sp_rank: int
    batch_size: int
    sequence_len: int
    padded_len: int
    mask: torch.Tensor | None
    """``[B, 1, S_padded, S_padded]`` bool (True: may attend), or None when no column is padding:
    sdpa's ``is_causal`` then applies, the case its fastest kernels accept."""


_active: _ActiveBatch | None = None
"""Process-wide, not a ``ContextVar``: the backward pass (and activation-checkpoint recompute in
it) may run on autograd's device threads, which do not see a context variable set here."""


@contextmanager
def ulysses_context(group: dist.ProcessGroup, attention_mask: torch.Tensor) -> Iterator[None]:
    """Install ``group`` and the batch's full ``[B, S]`` attention mask for Ulysses attention calls.

    ``attention_mask`` is the unsharded batch's (0 at padding, either side), on the model's
    device, the same on every rank of ``group`` (each enters the context). It is padded on the
    right to a multiple of the group size, as :func:`shard_sequence` pads the inputs. The
    causal + padding mask over the whole sequence is built once here (``B x S^2`` bools, as
    transformers builds for sdpa over a padded batch). Keep the block open through
    ``backward()`` (see the module docstring). One batch at a time: nesting raises.
    """
    global _active
    if _active is not None:
        raise RuntimeError("ulysses_context is already active; Ulysses runs one micro-batch at a time")
    if attention_mask.dim() != 2:
        raise ValueError(f"attention_mask must be [batch, seq_len], got shape {tuple(attention_mask.shape)}")
    sp_size, sp_rank = dist.get_world_size(group), dist.get_rank(group)
    batch_size, sequence_len = (int(n) for n in attention_mask.shape)
    padded_len = padded_sequence_len(sequence_len, sp_size)
    valid = F.pad(attention_mask.bool(), (0, padded_len - sequence_len), value=False)
    mask = None
    if not bool(valid.all()):
        causal = torch.ones(padded_len, padded_len, dtype=torch.bool, device=valid.device).tril()
        # Same pattern as transformers' causal_mask_function & padding_mask_function: query q
        # attends key k when k <= q and k is a real token. A padding query attends nothing;
        # sdpa returns 0 there (and a 0 gradient), and no result reads it.
        mask = causal[None, None] & valid[:, None, None, :]
    _active = _ActiveBatch(group, sp_size, sp_rank, batch_size, sequence_len, padded_len, mask)
    try:
        yield
    finally:
        _active = None


def ulysses_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Transformers' attention-function signature: local ``[B, H, S/P, D]`` in, ``[B, S/P, H, D]`` out.

    Called by each attention layer of a model set to :data:`ULYSSES_ATTENTION`, inside
    :func:`ulysses_context`. Queries, keys and values go through :func:`all_to_all` to this
    rank's heads over the whole sequence (KV heads split like query heads, so grouped-query
    attention keeps each query head with its KV head), transformers' own sdpa attention runs
    with the context's mask, and the output goes back to this rank's columns. The
    ``attention_mask`` argument (built, if at all, for the local columns) is ignored; see the
    module docstring for the other keyword arguments.
    """
    batch = _active
    if batch is None:
        raise RuntimeError(
            f"{type(module).__name__} uses Ulysses attention but ran outside ulysses_context (a forward, or "
            "an activation-checkpoint recompute in a backward, outside the block); its columns are one "
            "rank's slice and cannot be attended alone"
        )
    if kwargs.get("sliding_window") is not None:
        raise ValueError(
            f"{type(module).__name__} uses sliding-window attention; Ulysses attention implements full causal "
            "attention only"
        )
    if is_causal is False or not getattr(module, "is_causal", True):
        raise ValueError(
            f"{type(module).__name__} is not causal; Ulysses attention implements causal attention only"
        )
    check_ulysses_layout(int(query.shape[1]), int(key.shape[1]), batch.sp_size)
    local_len = int(query.shape[2])
    if (
        int(key.shape[2]) != local_len
        or local_len * batch.sp_size != batch.padded_len
        or int(query.shape[0]) != batch.batch_size
    ):
        raise ValueError(
            f"Ulysses attention got queries {tuple(query.shape)} and keys {tuple(key.shape)}, but the context "
            f"holds {batch.batch_size} rows of {batch.padded_len} columns over {batch.sp_size} ranks "
            f"({batch.padded_len // batch.sp_size} each, no KV cache)"
        )
    group = batch.group
    full_query = all_to_all(query, group, scatter_dim=1, gather_dim=2)
    full_key = all_to_all(key, group, scatter_dim=1, gather_dim=2)
    full_value = all_to_all(value, group, scatter_dim=1, gather_dim=2)
    # [B, S, H/P, D]: transformers' sdpa returns the heads transposed back behind the columns.
    heads_out, _ = sdpa_attention_forward(
        module,
        full_query,
        full_key,
        full_value,
        batch.mask,
        dropout=dropout,
        scaling=scaling,
        is_causal=True,
    )
    return all_to_all(heads_out, group, scatter_dim=1, gather_dim=2), None


def use_ulysses_attention(model: nn.Module, sp_size: int) -> None:
    """Switch ``model`` (an HF Qwen2/Llama-style causal LM) to Ulysses attention for ``sp_size`` ranks.

    ``model`` must be a transformers ``PreTrainedModel`` (``TypeError`` otherwise, naming the
    class). Checks the head layout first (:func:`check_ulysses_layout`, ``ValueError``), registers
    :func:`ulysses_attention_forward` as :data:`ULYSSES_ATTENTION` (idempotent, per process) and
    sets it as the model's implementation; from then on every forward of the model must run
    inside :func:`ulysses_context`. Call it on every rank before sharding.
    ``model.set_attn_implementation("sdpa")`` switches back.
    """
    if not isinstance(model, PreTrainedModel):
        raise TypeError(
            f"{type(model).__name__} is not a Hugging Face model; Ulysses attention is installed through "
            "transformers' attention interface"
        )
    config = model.config
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    check_ulysses_layout(heads, kv_heads, sp_size)
    AttentionInterface.register(ULYSSES_ATTENTION, ulysses_attention_forward)
    model.set_attn_implementation(ULYSSES_ATTENTION)


# --------------------------------------------------------------------------- log-probs


def ulysses_token_logprobs_and_entropy(
    model: nn.Module,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    *,
    response_len: int,
    temperature: float = 1.0,
    with_entropy: bool = True,
    entropy_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`~hybridflow.backends.fsdp.logprobs.token_logprobs_and_entropy` with the sequence split over the SP group.

    Called inside :func:`ulysses_context` (whose group and attention mask it uses) by every rank
    of the group, each with the same full ``input_ids`` / ``position_ids`` ``[B, S]``; returns
    the same ``[B, R]`` log-probs (and entropy) on every rank, equal to the unsplit pass up to
    floating-point summation order. The model must be set up by :func:`use_ulysses_attention`.

    Each rank computes logits only for its columns that score a response token (column ``t``
    scores the token at ``t + 1``, as in the unsplit pass), plus the columns after them in its
    slice; a rank with none keeps its last column, whose log-prob the final slice drops, so
    that its backward still runs through its whole graph (its all-to-alls are collectives).
    """
    batch = _active
    if batch is None:
        raise RuntimeError("ulysses_token_logprobs_and_entropy runs inside ulysses_context")
    if tuple(input_ids.shape) != (batch.batch_size, batch.sequence_len):
        raise ValueError(
            f"input_ids {tuple(input_ids.shape)} do not match the attention mask of ulysses_context "
            f"({batch.batch_size}, {batch.sequence_len})"
        )
    if not 0 < response_len < batch.sequence_len:
        raise ValueError(
            f"response_len={response_len} must be positive and shorter than the sequence ({batch.sequence_len} "
            "columns): at least one prompt column has to predict the first response token"
        )
    if not temperature > 0:
        raise ValueError(f"temperature={temperature} must be positive (use 1.0 for greedy rollouts)")
    pad_token_id = getattr(getattr(model, "config", None), "pad_token_id", None) or 0
    local_len = batch.padded_len // batch.sp_size
    start = batch.sp_rank * local_len
    first_scoring = batch.sequence_len - response_len - 1  # global column scoring response token 0
    kept_from = min(max(first_scoring - start, 0), local_len - 1)  # local column
    local_ids = shard_sequence(input_ids, sp_rank=batch.sp_rank, sp_size=batch.sp_size, fill=pad_token_id)
    local_positions = shard_sequence(position_ids, sp_rank=batch.sp_rank, sp_size=batch.sp_size, fill=0)
    output = model(
        input_ids=local_ids,
        attention_mask=None,
        position_ids=local_positions,
        use_cache=False,
        logits_to_keep=local_len - kept_from,
    )
    # The token each kept column predicts; past the sequence's end any id will do (never read).
    next_ids = F.pad(input_ids[:, 1:], (0, batch.padded_len - batch.sequence_len + 1), value=pad_token_id)
    targets = next_ids[:, start + kept_from : start + local_len]
    log_probs, entropy = token_logprobs_and_entropy_from_logits(
        output.logits,
        targets,
        temperature=temperature,
        with_entropy=with_entropy,
        entropy_grad=entropy_grad,
    )
    scored = slice(first_scoring, batch.sequence_len - 1)
    gathered_log_probs = gather_sequence(F.pad(log_probs, (kept_from, 0)), batch.group)[:, scored]
    if entropy is None:
        return gathered_log_probs, None
    return gathered_log_probs, gather_sequence(F.pad(entropy, (kept_from, 0)), batch.group)[:, scored]
