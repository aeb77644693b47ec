"""Per-token log-probs, entropy and values of the response part of packed sequences.

Layout (:mod:`hybridflow.engines.layout`): each row of ``input_ids [B, T]`` is the prompt,
left-padded, followed by the response, right-padded; the response is the last ``R =
response_len`` columns and starts at the same column ``T - R`` in every row. The output at
column ``t`` (logits, or the value of the state after reading tokens ``..t``) belongs to the
token at ``t + 1``, so the response tokens are scored by columns ``T - R - 1 .. T - 2``, i.e.
``[:, -R - 1 : -1]`` (veRL's convention).

``position_ids`` must come from the attention mask (``cumsum(mask) - 1``, as the layout builds
them), so a left-padded row sees the positions it would see unpadded, exactly as during
generation. Columns of response padding get finite garbage that the caller masks out with
``response_mask``.

These are plain forward passes: under FSDP2 every rank of the group must run them on its own
batch at the same time (each layer's forward all-gathers its parameters), with the same number of
micro-batches. Gradients flow through the results when grad mode is on (the actor's update);
the scoring calls run them under ``torch.no_grad()``. The log-softmax and entropy run a chunk of
positions at a time (:mod:`hybridflow.rlmath.logits`), so besides the model's own ``[B, R + 1,
vocab]`` logits no fp32 ``[B, R, vocab]`` tensor exists.

Packed sequences (``spec.training.packSequences``): :func:`pack_sequences` lays a micro-batch's
rows end to end in one row of only their real tokens, with ``position_ids`` restarting at 0 for
each sequence and no attention mask. transformers reads the restarts as sequence boundaries:
sdpa and eager get a block-diagonal causal mask (no token attends across sequences), and
flash-attention runs its variable-length kernel on the same boundaries. Each token sees exactly
the tokens and positions it sees in the padded layout, so the results are the padded ones up to
floating-point summation order (``tests/unit/test_fsdp_backend.py``), and no compute goes to
padding. :func:`packed_token_logprobs_and_entropy` and :func:`packed_token_values` return the
padded ``[B, R]`` shapes (0 at padding) so callers do not change.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from hybridflow.rlmath.logits import token_logprobs_and_entropy_from_logits

__all__ = [
    "PackedSequences",
    "first_used_column",
    "pack_sequences",
    "packed_token_logprobs_and_entropy",
    "packed_token_values",
    "token_logprobs_and_entropy",
    "token_values",
]


def first_used_column(attention_mask: torch.Tensor, response_len: int) -> int:
    """The first column any row attends to, at most the last prompt column.

    Columns before it are left padding in every row: dropping them leaves every valid token's
    inputs, positions (``position_ids`` come from the mask) and attended tokens as they were, so
    its results are the untrimmed ones up to floating-point summation order. One prompt column
    always stays: it scores the first response token.
    """
    prompt_width = int(attention_mask.shape[1]) - response_len
    used = attention_mask[:, :prompt_width].any(dim=0).nonzero()
    return min(int(used[0]) if len(used) else prompt_width - 1, prompt_width - 1)


def _check_layout(input_ids: torch.Tensor, response_len: int) -> None:
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [batch, seq_len], got shape {tuple(input_ids.shape)}")
    if not 0 < response_len < input_ids.shape[1]:
        raise ValueError(
            f"response_len={response_len} must be positive and shorter than the sequence "
            f"({input_ids.shape[1]} columns): at least one prompt column has to predict the first response token"
        )


def token_logprobs_and_entropy(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    *,
    response_len: int,
    temperature: float = 1.0,
    with_entropy: bool = True,
    entropy_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs ``[B, R]`` of the response tokens under ``model`` and, optionally, the entropy ``[B, R]``.

    ``model`` is an HF causal LM (sharded or not). Logits are divided by ``temperature``, the
    one the rollout sampled with, so the log-probs are those of the distribution the tokens were
    drawn from. Both results are fp32 whatever the compute dtype. Entropy is that of the
    tempered distribution at each response position
    (:func:`hybridflow.rlmath.core.entropy_from_logits`); with ``entropy_grad=False`` it carries no
    graph (a metric, not a loss term).

    Only the last ``R + 1`` columns' logits are computed (``logits_to_keep``): the LM head and
    the softmax never touch the prompt, whose logits would cost ``[B, T - R, vocab]``. Measured
    on CPU, the kept logits are bit-identical to the same columns of a full forward pass.
    """
    _check_layout(input_ids, response_len)
    if not temperature > 0:
        raise ValueError(f"temperature={temperature} must be positive (use 1.0 for greedy rollouts)")
    output = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        use_cache=False,
        logits_to_keep=response_len + 1,
    )
    # The kept columns are T-R-1 .. T-1; the last one predicts past the end of the sequence.
    # Chunked over positions: no fp32 [B, R, vocab] copy (hybridflow.rlmath.logits).
    return token_logprobs_and_entropy_from_logits(
        output.logits[:, :-1, :],
        input_ids[:, -response_len:],
        temperature=temperature,
        with_entropy=with_entropy,
        entropy_grad=entropy_grad,
    )


def token_values(
    value_model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    *,
    response_len: int,
) -> torch.Tensor:
    """The critic's values ``[B, R]`` (fp32) at the columns that predict each response token.

    ``values[:, t]`` is the value of the state just before response token ``t`` is emitted
    (column ``T - R - 1 + t``), the ``V(s_t)`` that GAE pairs with the reward of token ``t``.
    ``value_model`` is a :class:`~hybridflow.backends.fsdp.load.ValueModel` (sharded or not).
    """
    _check_layout(input_ids, response_len)
    values: torch.Tensor = value_model(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids
    )
    return values[:, -response_len - 1 : -1].float()


# --------------------------------------------------------------------------- packed sequences


@dataclass(frozen=True)
class PackedSequences:
    """A micro-batch's rows as one row of real tokens, and where each scored response token sits.

    ``input_ids`` / ``position_ids`` are ``[1, N]`` (``N`` real tokens); ``predictors`` ``[K]``
    are the packed positions whose output scores response token ``(rows[k], columns[k])`` of the
    padded ``[B, R]`` layout, the token itself being ``targets[k]``.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    predictors: torch.Tensor
    targets: torch.Tensor
    rows: torch.Tensor
    columns: torch.Tensor
    shape: tuple[int, int]

    def unpack(self, values: torch.Tensor) -> torch.Tensor:
        """``values [K]`` into the padded ``[B, R]`` layout, 0 where nothing was scored (differentiable)."""
        out = values.new_zeros(self.shape)
        return out.index_put((self.rows, self.columns), values)


def pack_sequences(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, *, response_len: int
) -> PackedSequences:
    """Pack engine-layout rows (left-padded prompt, right-padded response) into one row.

    A row's real tokens are contiguous (the layout guarantees it; anything else raises), so
    each keeps its order and its positions ``0 .. length - 1``, the ones the layout gives it. A
    response token needs at least one token before it in its row to be scored.
    """
    _check_layout(input_ids, response_len)
    mask = attention_mask != 0
    batch, width = mask.shape
    lengths = mask.sum(dim=1)
    columns = torch.arange(width, device=mask.device).expand(batch, width)
    first = torch.where(mask, columns, width).amin(dim=1)
    last = torch.where(mask, columns, -1).amax(dim=1)
    broken = (lengths > 0) & (last - first + 1 != lengths)
    if bool(broken.any()):
        row = int(broken.nonzero()[0])
        raise ValueError(f"row {row}'s attention mask has holes; packing needs each row's tokens contiguous")
    offsets = lengths.cumsum(0) - lengths
    total = int(lengths.sum())
    starts = torch.repeat_interleave(offsets, lengths)
    position_ids = torch.arange(total, device=mask.device) - starts
    response = mask[:, width - response_len :]
    rows, response_columns = response.nonzero(as_tuple=True)
    packed_index = offsets[rows] + (width - response_len + response_columns) - first[rows]
    if bool((packed_index <= offsets[rows]).any()):
        row = int(rows[packed_index <= offsets[rows]][0])
        raise ValueError(f"row {row} has a response token with no token before it to predict it")
    flat = input_ids[mask]
    return PackedSequences(
        input_ids=flat.unsqueeze(0),
        position_ids=position_ids.unsqueeze(0),
        predictors=packed_index - 1,
        targets=flat[packed_index],
        rows=rows,
        columns=response_columns,
        shape=(batch, response_len),
    )


def packed_token_logprobs_and_entropy(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    response_len: int,
    temperature: float = 1.0,
    with_entropy: bool = True,
    entropy_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`token_logprobs_and_entropy` over the packed rows: same ``[B, R]`` results (0 at padding).

    Only the predicting positions' logits are computed (``logits_to_keep`` with their indices).
    """
    if not temperature > 0:
        raise ValueError(f"temperature={temperature} must be positive (use 1.0 for greedy rollouts)")
    packed = pack_sequences(input_ids, attention_mask, response_len=response_len)
    output = model(
        input_ids=packed.input_ids,
        attention_mask=None,
        position_ids=packed.position_ids,
        use_cache=False,
        logits_to_keep=packed.predictors,
    )
    log_probs, entropy = token_logprobs_and_entropy_from_logits(
        output.logits[0],
        packed.targets,
        temperature=temperature,
        with_entropy=with_entropy,
        entropy_grad=entropy_grad,
    )
    return packed.unpack(log_probs), packed.unpack(entropy) if entropy is not None else None


def packed_token_values(
    value_model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, response_len: int
) -> torch.Tensor:
    """:func:`token_values` over the packed rows: the same ``[B, R]`` values (0 at padding)."""
    packed = pack_sequences(input_ids, attention_mask, response_len=response_len)
    values: torch.Tensor = value_model(
        input_ids=packed.input_ids, attention_mask=None, position_ids=packed.position_ids
    )
    return packed.unpack(values[0, packed.predictors].float())
