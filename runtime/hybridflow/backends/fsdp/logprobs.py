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

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers.cache_utils import Cache, DynamicLayer

from hybridflow.backends.fsdp.parallelize import decoder_layers
from hybridflow.rlmath.logits import token_logprobs_and_entropy_from_logits

__all__ = [
    "PackedSequences",
    "SharedPrompts",
    "find_shared_prompts",
    "first_used_column",
    "pack_sequences",
    "packed_token_logprobs_and_entropy",
    "packed_token_values",
    "shared_prompt_logits",
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
    shared_prompt_min_tokens: int | None = None,
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

    With ``shared_prompt_min_tokens`` set, rows that share a prompt (the ``n`` samples of one
    prompt) run it once (:func:`find_shared_prompts`, :func:`shared_prompt_logits`) when that
    saves at least that many prompt tokens (``spec.training.sharedPromptMinTokens``); the
    results equal the unshared ones up to floating-point summation order, with or without
    activation checkpointing.
    """
    _check_layout(input_ids, response_len)
    if not temperature > 0:
        raise ValueError(f"temperature={temperature} must be positive (use 1.0 for greedy rollouts)")
    shared = None
    if shared_prompt_min_tokens is not None:
        shared = find_shared_prompts(input_ids, attention_mask, response_len=response_len)
        prompt_width = int(input_ids.shape[1]) - response_len
        if shared is not None and shared.saved_rows * prompt_width < shared_prompt_min_tokens:
            shared = None
    if shared is not None:
        logits = shared_prompt_logits(
            model, input_ids, attention_mask, position_ids, response_len=response_len, shared=shared
        )
    else:
        output = model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=False,
            logits_to_keep=response_len + 1,
        )
        # The kept columns are T-R-1 .. T-1; the last one predicts past the end of the sequence.
        logits = output.logits[:, :-1, :]
    # Chunked over positions: no fp32 [B, R, vocab] copy (hybridflow.rlmath.logits).
    return token_logprobs_and_entropy_from_logits(
        logits,
        input_ids[:, -response_len:],
        temperature=temperature,
        with_entropy=with_entropy,
        entropy_grad=entropy_grad,
    )


# --------------------------------------------------------------------------- shared prompts


@dataclass(frozen=True)
class SharedPrompts:
    """Which rows of a micro-batch carry the same prompt (same tokens in the same columns).

    ``first_rows [U]`` is one row per distinct prompt (the first that carries it), ``inverse
    [B]`` the position in ``first_rows`` of each row's prompt: row ``b``'s prompt is row
    ``first_rows[inverse[b]]``'s.
    """

    first_rows: torch.Tensor
    inverse: torch.Tensor

    @property
    def saved_rows(self) -> int:
        """Prompt rows not run: one per row beyond the first of each distinct prompt."""
        return len(self.inverse) - len(self.first_rows)


def find_shared_prompts(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, *, response_len: int
) -> SharedPrompts | None:
    """The distinct prompts of engine-layout rows, or ``None`` when no two rows share one.

    Two rows share a prompt when their prompt columns hold the same tokens under the same mask
    (padding compares equal whatever id fills it). GRPO, RLOO and the other group algorithms
    sample ``n`` responses per prompt, so a micro-batch usually holds ``n`` copies of each.
    """
    _check_layout(input_ids, response_len)
    prompt_width = int(input_ids.shape[1]) - response_len
    prompts = input_ids[:, :prompt_width].masked_fill(attention_mask[:, :prompt_width] == 0, -1)
    _, inverse = torch.unique(prompts, dim=0, return_inverse=True)
    distinct = int(inverse.max()) + 1
    if distinct == int(input_ids.shape[0]):
        return None
    rows = torch.arange(len(inverse), device=inverse.device)
    first_rows = torch.full((distinct,), len(inverse), dtype=rows.dtype, device=rows.device)
    first_rows = first_rows.scatter_reduce(0, inverse, rows, reduce="amin")
    return SharedPrompts(first_rows=first_rows, inverse=inverse)


class _PromptPassLayer(DynamicLayer):
    """One layer's cache in the prompt pass: the keys and values are *assigned*, never appended.

    Assignment makes the layer's cache write idempotent: when activation checkpointing
    recomputes the layer in backward, it stores the same (recomputed) states again instead of
    appending a second copy.
    """

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.keys, self.values = key_states, value_states
        return key_states, value_states


class _ResponsePassLayer(DynamicLayer):
    """One layer's cache in the response pass: the prompts' states per row, read and never written.

    ``update`` returns the prompt's states followed by the response's without storing anything,
    so the layer is a pure function of its inputs and a checkpoint recompute sees exactly what
    the forward saw.
    """

    def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        super().__init__()
        self.lazy_initialization(keys, values)
        self.keys, self.values = keys, values

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.keys is not None and self.values is not None
        return torch.cat([self.keys, key_states], dim=-2), torch.cat([self.values, value_states], dim=-2)


@contextmanager
def _cache_kept_under_checkpointing(model: nn.Module) -> Iterator[None]:
    """Let checkpointed decoder layers take our caches during the forward passes that start here.

    transformers (``GradientCheckpointingLayer.__call__``) drops ``past_key_values`` in a
    checkpointed layer in train mode, unless the layer declares ``_can_checkpoint_with_cache``
    (a layer whose cache use is safe to replay). The two cache layers above are safe (the write
    is an idempotent assignment, the read is pure), so the flag is set on the decoder layers
    for these calls only; the backward replay runs the call recorded then and needs no flag.
    """
    layers = [m for m in model.modules() if getattr(m, "gradient_checkpointing", False)]
    for layer in layers:
        setattr(layer, "_can_checkpoint_with_cache", True)  # noqa: B010 - an instance flag transformers reads
    try:
        yield
    finally:
        for layer in layers:
            del layer._can_checkpoint_with_cache  # back to the class's False


def shared_prompt_logits(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    *,
    response_len: int,
    shared: SharedPrompts,
) -> torch.Tensor:
    """The logits ``[B, R, vocab]`` that score each row's response, running each distinct prompt once.

    Two forward passes, as decoding does: the distinct prompts fill a KV cache (``U`` rows of
    ``T - R`` columns) and give the logits of their last column, which score the first
    response token; the cache is then indexed out to the ``B`` rows (differentiable: a prompt's
    gradient sums over its rows), and the responses (``B`` rows of ``R`` columns) attend to it.
    A prompt token never attends to a response token, so its keys and values are the same in
    every row that carries it: each response token sees what it sees in one full pass, and the
    prompt costs ``U`` rows instead of ``B``. Under FSDP2 the model runs forward twice before
    backward, which FSDP2 supports (each pass unshards, reshards and, in backward,
    reduce-scatters its own gradient contribution).

    Works under activation checkpointing: the caches are :class:`_PromptPassLayer` (written by
    assignment) and :class:`_ResponsePassLayer` (read only), whose replay in backward gives the
    forward's results, and :func:`_cache_kept_under_checkpointing` keeps transformers from
    dropping them (``tests/unit/test_training_backend.py`` compares the gradients).
    """
    prompt_width = int(input_ids.shape[1]) - response_len
    rows = shared.first_rows
    prompt_layers = [_PromptPassLayer() for _ in decoder_layers(model)]
    prompt_cache = Cache(layers=list(prompt_layers))
    with _cache_kept_under_checkpointing(model):
        prompt_out = model(
            input_ids=input_ids[rows, :prompt_width],
            attention_mask=attention_mask[rows, :prompt_width],
            position_ids=position_ids[rows, :prompt_width],
            past_key_values=prompt_cache,
            use_cache=True,
            logits_to_keep=1,
        )
        states = [(layer.keys, layer.values) for layer in prompt_layers]
        filled = [(keys, values) for keys, values in states if keys is not None and values is not None]
        if len(filled) != len(states):
            raise RuntimeError(
                f"{type(model).__name__} did not fill the KV cache of the prompt pass; prompt sharing needs one"
            )
        response_cache = Cache(
            layers=[
                _ResponsePassLayer(keys[shared.inverse], values[shared.inverse]) for keys, values in filled
            ]
        )
        response_out = model(
            input_ids=input_ids[:, prompt_width:],
            attention_mask=attention_mask,
            position_ids=position_ids[:, prompt_width:],
            past_key_values=response_cache,
            use_cache=True,
            logits_to_keep=response_len,
        )
    # Column T-R-1 (the prompt's last) scores response token 0; response columns 0..R-2 the rest.
    return torch.cat([prompt_out.logits[shared.inverse], response_out.logits[:, :-1, :]], dim=1)


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
