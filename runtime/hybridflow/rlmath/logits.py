"""Log-probs and entropy of sampled tokens from logits, a chunk of positions at a time.

A forward pass's logits are ``[batch, length, vocab]`` in the compute dtype. The textbook
``log_softmax(logits.float())`` then materialises fp32 copies of the whole tensor (the cast, the
log-softmax, the softmax for the entropy), which for a 150k vocabulary is the largest allocation
of an RL step. Here the positions are flattened and processed ``chunk_tokens`` at a time: only
one chunk's fp32 ``[chunk, vocab]`` temporaries exist at once. Under autograd each chunk runs
inside activation checkpointing, so backward recomputes the chunk's fp32 softmax instead of
keeping every chunk's; what stays alive between forward and backward is the logits tensor itself
(which the model's LM head produced anyway) and two ``[batch, length]`` results.

Results equal the unchunked computation (same fp32 math per position); tests check values and
gradients.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from hybridflow.rlmath.core import entropy_from_logits

__all__ = ["DEFAULT_CHUNK_TOKENS", "token_logprobs_and_entropy_from_logits"]

DEFAULT_CHUNK_TOKENS = 1024
"""Positions per chunk: 1024 x a 152k vocabulary is ~0.6 GB of fp32 temporaries per chunk."""


def _chunk(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool
) -> torch.Tensor:
    """``[n, vocab]`` logits, ``[n]`` targets -> ``[n, 2]`` (log-prob, entropy or 0), fp32."""
    z = logits.float()
    if temperature != 1.0:
        z = z / temperature
    log_probs = torch.log_softmax(z, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = entropy_from_logits(z) if with_entropy else torch.zeros_like(log_probs)
    return torch.stack([log_probs, entropy], dim=-1)


def token_logprobs_and_entropy_from_logits(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = True,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs ``[B, L]`` of ``targets`` under ``logits / temperature`` ``[B, L, V]`` and optionally the entropy.

    Both results are fp32 whatever the logits' dtype. ``chunk_tokens`` bounds the positions whose
    fp32 softmax exists at once; it changes memory, never the result.
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens={chunk_tokens} must be >= 1")
    if logits.shape[:-1] != targets.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} and targets {tuple(targets.shape)} disagree on [batch, length]"
        )
    flat_logits = logits.reshape(-1, logits.shape[-1])
    flat_targets = targets.reshape(-1)
    checkpointed = torch.is_grad_enabled() and logits.requires_grad
    pieces = []
    for start in range(0, flat_targets.numel(), chunk_tokens):
        chunk = (flat_logits[start : start + chunk_tokens], flat_targets[start : start + chunk_tokens])
        if checkpointed:
            pieces.append(checkpoint(_chunk, *chunk, temperature, with_entropy, use_reentrant=False))
        else:
            pieces.append(_chunk(*chunk, temperature, with_entropy))
    joined = torch.cat(pieces) if pieces else flat_logits.new_zeros((0, 2), dtype=torch.float32)
    log_probs = joined[:, 0].reshape(targets.shape)
    entropy = joined[:, 1].reshape(targets.shape) if with_entropy else None
    return log_probs, entropy
