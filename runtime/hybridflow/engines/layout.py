"""From an engine's ragged token lists to the fixed-shape tensors the trainer consumes.

The layout (veRL's), for ``B = len(prompts) * n`` rows, prompt width ``P`` and response
width ``R``::

    input_ids       [B, P + R]   pad..pad prompt | response pad..pad
    attention_mask  [B, P + R]   0 ..  0  1 .. 1 | 1  ..  1  0 .. 0  (inserted tokens are attended: 1)
    position_ids    [B, P + R]   0 ..  0  0 .. k | k+1 ..    (keeps counting through padding)
    prompts         [B, P]       the left half of input_ids
    responses       [B, R]       the right half of input_ids
    response_mask   [B, R]       1 where responses holds a generated token (eos included); 0 at padding
                                 and at tokens a multi-turn trajectory inserted (the loss and KL skip them)
    rollout_log_probs [B, R]     the engine's log-probs, 0 at padding (only when it returned them)

Prompts are left-padded and responses right-padded so that every response starts at column
``P``: the logits that predict ``responses[:, t]`` are those at column ``P + t - 1`` of a
forward pass over ``input_ids``, for every row alike. ``position_ids`` count real tokens, so a
padded row sees the positions it would see alone (as in generation); the positions of padding
columns are never attended to and only need to be valid. All tensors are int64 except
``rollout_log_probs`` (float32); masks are 0/1 int64 like HF attention masks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NotRequired, TypedDict

import torch

from hybridflow.engines.base import RolloutOutput


class RolloutTensors(TypedDict):
    """The tensors :func:`response_tensors` returns, keyed by the trainer's field names."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    prompts: torch.Tensor
    responses: torch.Tensor
    response_mask: torch.Tensor
    rollout_log_probs: NotRequired[torch.Tensor]


def response_tensors(
    prompts: Sequence[Sequence[int]],
    output: RolloutOutput,
    pad_id: int,
    max_prompt_len: int,
    max_response_len: int,
) -> RolloutTensors:
    """Pack ``prompts`` (one per prompt, as given to ``generate``) and ``output`` into tensors.

    ``output`` holds ``n`` responses per prompt, interleaved (``n = len(output) // len(prompts)``
    must divide exactly); each prompt is repeated ``n`` times to match. ``P = max_prompt_len``
    and ``R = max_response_len`` fix the widths so every batch of a run has the same shapes.
    A prompt longer than ``P`` or a response longer than ``R`` raises ``ValueError`` naming
    the row: truncation is the data pipeline's and the sampling params' job, and silently
    cutting tokens here would make the trainer score text the engine never produced.
    """
    if max_prompt_len < 1 or max_response_len < 1:
        raise ValueError(
            f"max_prompt_len={max_prompt_len} and max_response_len={max_response_len} must be positive"
        )
    if not prompts:
        raise ValueError("no prompts to pack")
    if len(output) % len(prompts) != 0 or len(output) == 0:
        raise ValueError(
            f"{len(output)} responses for {len(prompts)} prompts: expected n responses per prompt, n >= 1"
        )
    samples_per_prompt = len(output) // len(prompts)
    rows = len(output)

    prompt_ids = torch.full((rows, max_prompt_len), pad_id, dtype=torch.long)
    prompt_mask = torch.zeros((rows, max_prompt_len), dtype=torch.long)
    response_ids = torch.full((rows, max_response_len), pad_id, dtype=torch.long)
    response_attention = torch.zeros((rows, max_response_len), dtype=torch.long)
    response_mask = torch.zeros((rows, max_response_len), dtype=torch.long)
    log_probs = (
        torch.zeros((rows, max_response_len), dtype=torch.float32) if output.logprobs is not None else None
    )

    for row in range(rows):
        prompt = prompts[row // samples_per_prompt]
        response = output.response_token_ids[row]
        if len(prompt) > max_prompt_len:
            raise ValueError(
                f"prompt {row // samples_per_prompt} has {len(prompt)} tokens, more than max_prompt_len={max_prompt_len}"
            )
        if len(response) > max_response_len:
            raise ValueError(
                f"response {row} has {len(response)} tokens, more than max_response_len={max_response_len}"
            )
        if prompt:
            prompt_ids[row, max_prompt_len - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
            prompt_mask[row, max_prompt_len - len(prompt) :] = 1
        if response:
            response_ids[row, : len(response)] = torch.tensor(response, dtype=torch.long)
            response_attention[row, : len(response)] = 1
            if output.loss_masks is not None:
                response_mask[row, : len(response)] = torch.tensor(output.loss_masks[row], dtype=torch.long)
            else:
                response_mask[row, : len(response)] = 1
            if log_probs is not None and output.logprobs is not None:
                log_probs[row, : len(response)] = torch.tensor(output.logprobs[row], dtype=torch.float32)

    prompt_positions = (prompt_mask.cumsum(dim=-1) - 1).clamp_min(0)
    # A prompt of L tokens has positions 0..L-1, so its response starts at position L.
    response_positions = prompt_mask.sum(dim=-1, keepdim=True) + torch.arange(max_response_len)
    packed = RolloutTensors(
        input_ids=torch.cat([prompt_ids, response_ids], dim=-1),
        attention_mask=torch.cat([prompt_mask, response_attention], dim=-1),
        position_ids=torch.cat([prompt_positions, response_positions], dim=-1),
        prompts=prompt_ids,
        responses=response_ids,
        response_mask=response_mask,
    )
    if log_probs is not None:
        packed["rollout_log_probs"] = log_probs
    return packed
