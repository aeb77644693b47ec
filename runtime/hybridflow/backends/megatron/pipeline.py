"""Running micro-batches of packed sequences through the pipeline stages with megatron's schedules.

Scoring (:mod:`~hybridflow.backends.megatron.logprobs`) and training
(:mod:`~hybridflow.backends.megatron.optim`) both go through :func:`run_micro_batches`, which
hands the micro-batches to megatron-core's ``get_forward_backward_func()``: no pipelining for
PP = 1, 1F1B (one forward, one backward, activations sent between stages with point-to-point
ops) for PP > 1. Megatron's schedule is used instead of hand-written send/recv because the
backward pass through the stages, the DDP gradient sync (``no_sync`` until the last
micro-batch, then ``finalize_model_grads``) and activation memory (at most ``p`` micro-batches
in flight) come with it, identically on NCCL and gloo.

Protocol: every rank of the world calls it at the same time with the same number of
micro-batches; the ranks of one DP replica (a TP x PP block) pass the *same* micro-batches,
which their DP rank received. Only the last stage sees the model's output; it applies ``head``
(the log-softmax or value read-out plus the caller's loss) and its results are then broadcast
over each PP group, so every rank returns the same list. A head that raises does so on the last
stage only; the other stages then wait in the schedule or the broadcast until the process
group's timeout, as with any failed collective.

Positions, padding and attention. The engine layout (:mod:`hybridflow.engines.layout`) left-pads
prompts and right-pads responses, with ``position_ids = cumsum(mask) - 1``. megatron-core's
RoPE takes the position of a token from its column (it has no ``position_ids`` input), so each
row is first rotated left by its count of leading pad tokens (:func:`left_align`): its real
tokens then sit in columns ``0..n-1`` (column = HF position id, exactly) followed by its padding.
With all padding at the end of every row, the plain causal mask is exact for every real token
(a real token never attends to a later column), so no ``[b, 1, s, s]`` mask is built and
megatron's causal path is used as is. Outputs are read back at the rotated columns
(:func:`response_columns`). A row whose real tokens are not contiguous, or whose position ids
are not ``0..n-1`` along them, is refused.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from functools import partial

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func
from torch import nn

__all__ = ["MicroBatch", "OutputHead", "check_layout", "left_align", "response_columns", "run_micro_batches"]

MicroBatch = Mapping[str, torch.Tensor]
"""A micro-batch: ``input_ids``, ``attention_mask``, ``position_ids`` ``[b, T]`` and whatever the head reads."""

OutputHead = Callable[[torch.Tensor, MicroBatch], tuple[torch.Tensor, dict[str, torch.Tensor]]]
"""``head(output, micro) -> (loss, results)`` on the last stage: ``output`` is the model's
``[b, T, ...]`` output in *aligned* columns (see the module docstring), ``micro`` the micro-batch
with ``shift`` ``[b]`` (each row's rotation) added. ``loss`` is a scalar the backward pass
starts from (ignored when scoring); ``results`` are tensors returned to every rank."""

_ALIGNED_IDS = "_aligned_input_ids"


def left_align(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(aligned input_ids, shift)``: each row rotated left by its ``shift`` leading pad tokens.

    Raises ``ValueError`` if a row's real tokens are not one contiguous run or its position ids
    along them are not ``0, 1, 2, ...`` (the layout the module docstring relies on).
    """
    if (
        input_ids.dim() != 2
        or attention_mask.shape != input_ids.shape
        or position_ids.shape != input_ids.shape
    ):
        raise ValueError(
            "input_ids, attention_mask and position_ids must all be [batch, seq_len], got "
            f"{tuple(input_ids.shape)}, {tuple(attention_mask.shape)}, {tuple(position_ids.shape)}"
        )
    width = input_ids.shape[1]
    real = attention_mask.bool()
    shift = (real.long().cumsum(dim=1) == 0).sum(dim=1)
    columns = torch.arange(width, device=input_ids.device)
    index = (columns.unsqueeze(0) + shift.unsqueeze(1)) % width
    aligned_real = real.gather(1, index)
    lengths = real.sum(dim=1)
    if not torch.equal(aligned_real, columns.unsqueeze(0) < lengths.unsqueeze(1)):
        raise ValueError(
            "each row's real tokens (attention_mask == 1) must be one contiguous run: a left-padded "
            "prompt followed by a right-padded response"
        )
    aligned_positions = position_ids.gather(1, index)
    if not torch.equal(aligned_positions[aligned_real], columns.expand_as(aligned_positions)[aligned_real]):
        raise ValueError(
            "position_ids must count 0, 1, 2, ... along each row's real tokens (cumsum(mask) - 1)"
        )
    return input_ids.gather(1, index), shift


def response_columns(shift: torch.Tensor, *, seq_len: int, response_len: int) -> torch.Tensor:
    """``[b, R]`` aligned columns whose outputs predict (or value the state before) each response token.

    Response token ``j`` sits at column ``T - R + j`` of the engine layout, so its predicting
    column is ``T - R - 1 + j`` there and ``T - R - 1 + j - shift`` after :func:`left_align`.
    Rows with no prompt token get clamped indices (their outputs are garbage the caller masks).
    """
    base = seq_len - response_len - 1 - shift
    columns = base.unsqueeze(1) + torch.arange(response_len, device=shift.device).unsqueeze(0)
    return columns.clamp(0, seq_len - 1)


def check_layout(input_ids: torch.Tensor, response_len: int) -> None:
    """Raise ``ValueError`` unless ``input_ids`` is ``[B, T]`` with ``0 < response_len < T``."""
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [batch, seq_len], got shape {tuple(input_ids.shape)}")
    if not 0 < response_len < input_ids.shape[1]:
        raise ValueError(
            f"response_len={response_len} must be positive and shorter than the sequence "
            f"({input_ids.shape[1]} columns): at least one prompt column has to predict the first response token"
        )


def _prepare(micro: MicroBatch, device: torch.device) -> dict[str, torch.Tensor]:
    prepared = {name: tensor.to(device) for name, tensor in micro.items()}
    aligned, shift = left_align(prepared["input_ids"], prepared["attention_mask"], prepared["position_ids"])
    prepared[_ALIGNED_IDS] = aligned
    prepared["shift"] = shift
    return prepared


def _broadcast_results(
    results: list[dict[str, torch.Tensor]], *, count: int, device: torch.device
) -> list[dict[str, torch.Tensor]]:
    """The last stage's ``results`` on every rank of each PP group (metadata, then one flat buffer)."""
    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return results
    group = parallel_state.get_pipeline_model_parallel_group()
    source = dist.get_process_group_ranks(group)[-1]
    is_source = parallel_state.is_pipeline_last_stage()
    layout: list[object] = [
        [[(key, tuple(value.shape)) for key, value in result.items()] for result in results]
        if is_source
        else None
    ]
    dist.broadcast_object_list(layout, src=source, group=group, device=device)
    shapes: list[list[tuple[str, tuple[int, ...]]]] = layout[0]  # type: ignore[assignment]
    if len(shapes) != count:
        raise RuntimeError(f"the last stage returned {len(shapes)} results for {count} micro-batches")
    total = sum(torch.Size(shape).numel() for entry in shapes for _, shape in entry)
    pieces = [value.detach().float().reshape(-1) for result in results for value in result.values()]
    if is_source and pieces:
        flat = torch.cat(pieces)
    else:  # also the source when the heads returned no tensors at all (every stage agrees: total is 0)
        flat = torch.empty(total, dtype=torch.float32, device=device)
    if total:
        dist.broadcast(flat, src=source, group=group)
    out: list[dict[str, torch.Tensor]] = []
    offset = 0
    for entry in shapes:
        unpacked: dict[str, torch.Tensor] = {}
        for key, shape in entry:
            width = torch.Size(shape).numel()
            unpacked[key] = flat[offset : offset + width].view(shape).clone()
            offset += width
        out.append(unpacked)
    return out


def run_micro_batches(
    model: nn.Module, micro_batches: Sequence[MicroBatch], head: OutputHead, *, forward_only: bool
) -> list[dict[str, torch.Tensor]]:
    """Forward (and, unless ``forward_only``, backward) every micro-batch through the stages.

    Returns, on every rank, one ``results`` dict per micro-batch (float32 tensors, detached).
    With ``forward_only=False``, ``model`` must be the DDP wrapper
    (:func:`~hybridflow.backends.megatron.parallelize.wrap_data_parallel`): the gradient of
    the sum of the heads' losses accumulates into the parameters' ``main_grad`` and is averaged
    over DP ranks at the end. megatron divides each micro-batch's loss by the number of
    micro-batches; this function multiplies it back, so the sum is what the caller wrote.
    See the module docstring for the protocol.
    """
    if not micro_batches:
        raise ValueError("run_micro_batches needs at least one micro-batch")
    device = next(model.parameters()).device
    prepared = [_prepare(micro, device) for micro in micro_batches]
    count = len(prepared)

    def loss_func(
        micro: dict[str, torch.Tensor], output: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        loss, results = head(output, micro)
        return loss * count, {key: value.detach() for key, value in results.items()}

    def forward_step(
        data: Iterator[dict[str, torch.Tensor]], stage_model: nn.Module
    ) -> tuple[torch.Tensor, partial[tuple[torch.Tensor, dict[str, torch.Tensor]]]]:
        micro = next(data)
        aligned = micro[_ALIGNED_IDS]
        positions = torch.arange(aligned.shape[1], device=aligned.device).expand_as(aligned)
        output: torch.Tensor = stage_model(aligned, positions, None)
        return output, partial(loss_func, micro)

    first = prepared[0][_ALIGNED_IDS]
    schedule = get_forward_backward_func()
    stored = schedule(
        forward_step_func=forward_step,
        data_iterator=iter(prepared),
        model=[model],
        num_microbatches=count,
        seq_length=first.shape[1],
        micro_batch_size=first.shape[0],
        forward_only=forward_only,
    )
    results: list[dict[str, torch.Tensor]] = list(stored) if parallel_state.is_pipeline_last_stage() else []
    return _broadcast_results(results, count=count, device=device)
