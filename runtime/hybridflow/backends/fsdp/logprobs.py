"""Per-token log-probs, entropy and values of the response part of packed sequences.

Layout (from :func:`hybridflow.engines.layout.response_tensors`): each row is the prompt
(left-padded) followed by the response (right-padded); the response is the last
``response_len`` positions. Logits at position ``t`` predict token ``t + 1``, so the response
tokens are predicted by positions ``[-response_len - 1, -1)``.
"""

from __future__ import annotations

import torch
from torch import nn

from hybridflow.algorithms.core import entropy_from_logits

__all__ = ["token_logprobs_and_entropy", "token_values"]


def token_logprobs_and_entropy(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    *,
    response_len: int,
    temperature: float = 1.0,
    with_entropy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    logits = model(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
    ).logits
    logits = logits[:, -response_len - 1 : -1, :].float() / temperature
    targets = input_ids[:, -response_len:]
    log_probs = torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = entropy_from_logits(logits) if with_entropy else None
    return log_probs, entropy


def token_values(
    value_model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    *,
    response_len: int,
) -> torch.Tensor:
    """The value at each position that predicts a response token (``[:, -R-1:-1]``)."""
    values = value_model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)
    return values[:, -response_len - 1 : -1].float()
