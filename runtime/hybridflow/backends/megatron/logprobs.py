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

No fp32 ``[B, R, V/t]`` tensor exists: the log-softmax and entropy run a chunk of positions at
a time (as :mod:`hybridflow.rlmath.logits` does for FSDP), in one autograd function whose
backward is written out (``d log p(y)/dz_j = [j = y] - p_j``, ``dH/dz_j = p_j (E_p[z] - z_j)``),
so backward recomputes each chunk's softmax from three saved numbers per position and needs no
collective: no rank can ever wait in backward for a peer that recomputes in another order.

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
from hybridflow.rlmath.logits import DEFAULT_CHUNK_TOKENS

__all__ = [
    "logprob_head",
    "token_logprobs_and_entropy",
    "token_values",
    "value_head",
    "vocab_parallel_logprobs_and_entropy",
]


class _VocabParallelLogProbs(torch.autograd.Function):
    """Log-probs and entropy of flattened ``[N, V/t]`` logits, fp32 one chunk of positions at a time.

    Forward: per chunk, the fp32 tempered logits give this rank's max, sum of exponentials,
    target logit and ``sum(exp(z) z)``; two all-reduces over the TP group (the max, then the
    three sums for every position at once) complete them. Saved for backward: the logits
    themselves (the caller holds them anyway) and three fp32 numbers per position (max,
    ``log Z``, ``E_p[z]``), never an fp32 ``[N, V/t]`` tensor.

    Backward needs no communication: with ``p = softmax(z)`` over the whole vocabulary (this
    rank's columns recomputed from the saved per-position numbers),
    ``d log p(y) / dz_j = [j = y] - p_j`` and ``dH / dz_j = p_j (E_p[z] - z_j)``, both local to
    the column: the gradients of the textbook log-softmax over the whole (unpadded) vocabulary,
    sliced to this rank's columns (padding columns get 0).
    """

    @staticmethod
    def forward(
        ctx: Any,
        logits: torch.Tensor,
        targets: torch.Tensor,
        vocab_size: int,
        first: int,
        temperature: float,
        with_entropy: bool,
        chunk_tokens: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        positions, per_rank = logits.shape
        valid = torch.arange(first, first + per_rank, device=logits.device) < vocab_size
        local_targets = targets - first
        mine = (local_targets >= 0) & (local_targets < per_rank)
        picked_columns = local_targets.clamp(0, per_rank - 1)
        chunks = [slice(start, start + chunk_tokens) for start in range(0, positions, chunk_tokens)]

        def tempered(rows: slice) -> torch.Tensor:
            z = logits[rows].float()
            if temperature != 1.0:
                z = z / temperature
            return z.masked_fill(~valid, float("-inf"))

        maxes = torch.cat([tempered(rows).amax(dim=-1) for rows in chunks]) if chunks else logits.new_zeros(0)
        maxes = maxes.float()
        group = parallel_state.get_tensor_model_parallel_group()
        tp_size = parallel_state.get_tensor_model_parallel_world_size()
        if tp_size > 1:
            dist.all_reduce(maxes, op=dist.ReduceOp.MAX, group=group)
        sums = torch.zeros((positions, 3), dtype=torch.float32, device=logits.device)
        for rows in chunks:
            shifted = tempered(rows) - maxes[rows, None]
            exp = shifted.exp()
            sums[rows, 0] = exp.sum(dim=-1)
            picked = shifted.gather(-1, picked_columns[rows, None]).squeeze(-1)
            sums[rows, 1] = torch.where(mine[rows], picked, torch.zeros_like(picked))
            if with_entropy:
                # The padding columns' -inf is zeroed before multiplying (0 * -inf is NaN).
                sums[rows, 2] = (exp * torch.where(valid, shifted, torch.zeros_like(shifted))).sum(dim=-1)
        if tp_size > 1:
            dist.all_reduce(sums, group=group)
        log_z = sums[:, 0].log()
        log_probs = sums[:, 1] - log_z
        expected_z = sums[:, 2] / sums[:, 0]  # E_p[z - max]
        entropy = log_z - expected_z if with_entropy else torch.zeros_like(log_probs)
        ctx.save_for_backward(logits, picked_columns, mine, valid, maxes, log_z, expected_z)
        ctx.settings = (temperature, with_entropy, chunk_tokens)
        return log_probs, entropy

    @staticmethod
    def backward(ctx: Any, grad_log_probs: torch.Tensor, grad_entropy: torch.Tensor) -> tuple[Any, ...]:
        logits, picked_columns, mine, valid, maxes, log_z, expected_z = ctx.saved_tensors
        temperature, with_entropy, chunk_tokens = ctx.settings
        grad_logits = torch.empty_like(logits)
        for start in range(0, logits.shape[0], chunk_tokens):
            rows = slice(start, start + chunk_tokens)
            z = logits[rows].float()
            if temperature != 1.0:
                z = z / temperature
            shifted = torch.where(valid, z - maxes[rows, None], torch.zeros_like(z))
            p = torch.where(valid, (shifted - log_z[rows, None]).exp(), torch.zeros_like(z))
            g_lp = grad_log_probs[rows].float()
            grad_z = -p * g_lp[:, None]
            own = torch.where(mine[rows], g_lp, torch.zeros_like(g_lp))
            grad_z.scatter_add_(-1, picked_columns[rows, None], own[:, None])
            if with_entropy:
                grad_z += grad_entropy[rows].float()[:, None] * p * (expected_z[rows, None] - shifted)
            if temperature != 1.0:
                grad_z = grad_z / temperature
            grad_logits[rows] = grad_z.to(logits.dtype)
        return grad_logits, None, None, None, None, None, None


def vocab_parallel_logprobs_and_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    vocab_size: int,
    temperature: float = 1.0,
    with_entropy: bool = True,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``log p(target)`` and the entropy from this TP rank's slice of the logits ``[..., P/t]``.

    ``targets`` (``[...]``, global token ids) and the leading dimensions of ``logits`` match.
    ``vocab_size`` is the HF vocabulary: columns at or past it are padding and get probability
    0. Collective over the TP group (all TP ranks, same shapes); differentiable, with no
    collective in backward. Computed in fp32 whatever the logits' dtype, after dividing by
    ``temperature``, ``chunk_tokens`` positions at a time (as :mod:`hybridflow.rlmath.logits`
    does for FSDP): only one chunk's fp32 ``[chunk, P/t]`` temporaries exist at once, in forward
    and in backward. ``chunk_tokens`` changes memory, never the result.
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens={chunk_tokens} must be >= 1")
    if logits.shape[:-1] != targets.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} and targets {tuple(targets.shape)} disagree on the leading dimensions"
        )
    first = parallel_state.get_tensor_model_parallel_rank() * logits.shape[-1]
    log_probs, entropy = _VocabParallelLogProbs.apply(
        logits.reshape(-1, logits.shape[-1]),
        targets.reshape(-1),
        vocab_size,
        first,
        temperature,
        with_entropy,
        chunk_tokens,
    )
    log_probs = log_probs.reshape(targets.shape)
    return log_probs, entropy.reshape(targets.shape) if with_entropy else None


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
