"""Per-token log-probs, entropy and values of the response part of packed sequences, megatron edition.

Same layout and results as :mod:`hybridflow.backends.fsdp.logprobs` (its docstring describes
the packed layout: left-padded prompt, right-padded response of ``R`` columns, response token
``j`` scored by column ``T - R - 1 + j``), so a worker can switch backends by import. What
differs is where the logits live:

* The output layer is vocab-parallel: TP rank ``r`` holds the logits of vocabulary rows
  ``[r*P/t, (r+1)*P/t)`` only. :func:`vocab_parallel_logprobs_and_entropy` computes the
  log-softmax across the TP group without gathering the vocabulary: an all-reduce of the max
  (for stability), of the sum of exponentials, of the target's logit (held by one rank) and,
  for the entropy, of ``sum(p * z)``. Padding rows of the vocabulary (see
  :func:`~hybridflow.backends.megatron.config.padded_vocab_size`) are masked to probability 0,
  so results equal a softmax over the HF vocabulary exactly (up to summation order).
* The logits exist only on the last pipeline stage; the forward runs through the stages with
  megatron's schedule (:mod:`~hybridflow.backends.megatron.pipeline`) and the results are
  broadcast over each PP group, so every rank returns them, as under FSDP.

The differentiable all-reduce sums forward and passes the gradient through unchanged. That is
exact under one rule, which the code keeps: a reduced value is consumed only by computations
every TP rank performs identically (so each rank's loss is the same function of the reduced
values, and the gradient of a rank's own partial sum is the incoming gradient), never by a
rank-local one. The entropy is therefore written ``log Z - (sum exp(z) z) / Z`` with both sums
reduced first; the textbook ``log Z - sum(p z)`` with ``p = exp(z) / Z`` computed per rank would
feed the reduced ``Z`` into a rank-local sum, and the identity backward would then drop the
other ranks' share of its gradient.

Both public scoring functions are collectives over the whole world (every rank, same number of
micro-batches; the ranks of a DP replica with the same rows) and run under ``torch.no_grad()``;
training goes through :func:`~hybridflow.backends.megatron.optim.forward_backward`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from torch import nn

from hybridflow.backends.megatron.load import model_info
from hybridflow.backends.megatron.pipeline import (
    MicroBatch,
    check_layout,
    response_columns,
    run_micro_batches,
)

__all__ = [
    "logprob_head",
    "token_logprobs_and_entropy",
    "token_values",
    "value_head",
    "vocab_parallel_logprobs_and_entropy",
]


class _SumOverTensorParallel(torch.autograd.Function):
    """All-reduce (sum) over the TP group; the backward passes the gradient through (see the module docstring)."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor) -> torch.Tensor:
        reduced = tensor.clone()
        dist.all_reduce(reduced, group=parallel_state.get_tensor_model_parallel_group())
        return reduced

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


def _tp_sum(tensor: torch.Tensor) -> torch.Tensor:
    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        return tensor
    reduced: torch.Tensor = _SumOverTensorParallel.apply(tensor)
    return reduced


def vocab_parallel_logprobs_and_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    vocab_size: int,
    temperature: float = 1.0,
    with_entropy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``log p(target)`` and the entropy from this TP rank's slice of the logits ``[..., P/t]``.

    ``targets`` (``[...]``, global token ids) and the leading dimensions of ``logits`` match.
    ``vocab_size`` is the HF vocabulary: columns at or past it are padding and get probability
    0. Collective over the TP group (all TP ranks, same shapes); differentiable. Computed in
    fp32 whatever the logits' dtype, after dividing by ``temperature``.
    """
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    per_rank = logits.shape[-1]
    first = tp_rank * per_rank
    columns = torch.arange(first, first + per_rank, device=logits.device)
    valid = columns < vocab_size
    if not bool(valid.all()):
        logits = logits.masked_fill(~valid, float("-inf"))
    maxes = logits.detach().amax(dim=-1, keepdim=True)
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        dist.all_reduce(maxes, op=dist.ReduceOp.MAX, group=parallel_state.get_tensor_model_parallel_group())
    shifted = logits - maxes
    exp = shifted.exp()
    sum_exp = _tp_sum(exp.sum(dim=-1))
    log_z = sum_exp.log()
    local_targets = targets - first
    mine = (local_targets >= 0) & (local_targets < per_rank)
    picked = shifted.gather(-1, local_targets.clamp(0, per_rank - 1).unsqueeze(-1)).squeeze(-1)
    log_probs = _tp_sum(torch.where(mine, picked, torch.zeros_like(picked))) - log_z
    if not with_entropy:
        return log_probs, None
    # H = log Z - sum(exp(z) * z) / Z, with both sums reduced before they meet: see the module
    # docstring for why no rank-local value may depend on a reduced one. The padding columns'
    # -inf is zeroed before multiplying (0 * -inf is NaN, in the forward and the gradient).
    weighted = (exp * torch.where(valid, shifted, torch.zeros_like(shifted))).sum(dim=-1)
    entropy = log_z - _tp_sum(weighted) / sum_exp
    return log_probs, entropy


def logprob_head(*, response_len: int, temperature: float, with_entropy: bool, vocab_size: int) -> Any:
    """An output head (:data:`~hybridflow.backends.megatron.pipeline.OutputHead`) giving ``log_probs`` / ``entropy`` ``[b, R]``.

    The loss it returns is zero; :func:`~hybridflow.backends.megatron.optim.forward_backward`
    wraps it with the caller's loss.
    """

    def head(output: torch.Tensor, micro: MicroBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        seq_len = micro["input_ids"].shape[1]
        columns = response_columns(micro["shift"], seq_len=seq_len, response_len=response_len)
        picked = output.gather(1, columns.unsqueeze(-1).expand(-1, -1, output.shape[-1]))
        targets = micro["input_ids"][:, -response_len:]
        log_probs, entropy = vocab_parallel_logprobs_and_entropy(
            picked, targets, vocab_size=vocab_size, temperature=temperature, with_entropy=with_entropy
        )
        results = {"log_probs": log_probs}
        if entropy is not None:
            results["entropy"] = entropy
        return log_probs.new_zeros(()), results

    return head


def value_head(*, response_len: int) -> Any:
    """An output head giving the critic's ``values`` ``[b, R]`` (fp32) at the response's predicting columns."""

    def head(output: torch.Tensor, micro: MicroBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        seq_len = micro["input_ids"].shape[1]
        columns = response_columns(micro["shift"], seq_len=seq_len, response_len=response_len)
        values = output.squeeze(-1).gather(1, columns).float()
        return values.new_zeros(()), {"values": values}

    return head


def _micro_batches(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    micro_batch_size: int | None,
) -> list[MicroBatch]:
    rows = input_ids.shape[0]
    size = rows if micro_batch_size is None else micro_batch_size
    if size < 1:
        raise ValueError(f"micro_batch_size={micro_batch_size} must be positive")
    return [
        {
            "input_ids": input_ids[start : start + size],
            "attention_mask": attention_mask[start : start + size],
            "position_ids": position_ids[start : start + size],
        }
        for start in range(0, rows, size)
    ]


def token_logprobs_and_entropy(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    *,
    response_len: int,
    temperature: float = 1.0,
    with_entropy: bool = True,
    micro_batch_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs ``[B, R]`` of the response tokens and, optionally, the entropy ``[B, R]`` (fp32, no grad).

    Same arguments and results as the FSDP backend's function, plus ``micro_batch_size``: the
    rows go through the pipeline in micro-batches of that many (default: all at once), which
    is what keeps the stages busy when PP > 1. Collective; see the module docstring.
    """
    check_layout(input_ids, response_len)
    if not temperature > 0:
        raise ValueError(f"temperature={temperature} must be positive (use 1.0 for greedy rollouts)")
    info = model_info(model)
    if info.value_head:
        raise ValueError("this model is a critic (value head); use token_values")
    head = logprob_head(
        response_len=response_len,
        temperature=temperature,
        with_entropy=with_entropy,
        vocab_size=info.arch.vocab_size,
    )
    with torch.no_grad():
        results = run_micro_batches(
            model,
            _micro_batches(input_ids, attention_mask, position_ids, micro_batch_size),
            head,
            forward_only=True,
        )
    log_probs = torch.cat([result["log_probs"] for result in results])
    entropy = torch.cat([result["entropy"] for result in results]) if with_entropy else None
    return log_probs, entropy


def token_values(
    value_model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    *,
    response_len: int,
    micro_batch_size: int | None = None,
) -> torch.Tensor:
    """The critic's values ``[B, R]`` (fp32, no grad) at the columns that predict each response token.

    ``value_model`` comes from :func:`~hybridflow.backends.megatron.load.load_value_model`.
    Same meaning as the FSDP backend's ``token_values``; collective.
    """
    check_layout(input_ids, response_len)
    if not model_info(value_model).value_head:
        raise ValueError("this model has no value head; load it with load_value_model")
    with torch.no_grad():
        results = run_micro_batches(
            value_model,
            _micro_batches(input_ids, attention_mask, position_ids, micro_batch_size),
            value_head(response_len=response_len),
            forward_only=True,
        )
    return torch.cat([result["values"] for result in results])
