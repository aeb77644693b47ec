"""Log-probs and entropy of sampled tokens from logits, a chunk of positions at a time.

A forward pass's logits are ``[batch, length, vocab]`` in the compute dtype. The textbook
``log_softmax(logits.float())`` then materialises fp32 copies of the whole tensor (the cast, the
log-softmax, the softmax for the entropy), which for a 150k vocabulary is the largest allocation
of an RL step. Here the positions are flattened and processed ``chunk_tokens`` at a time: only
one chunk's fp32 ``[chunk, vocab]`` temporaries exist at once. Under autograd, when there is more
than one chunk, each chunk runs inside activation checkpointing, so backward recomputes the
chunk's fp32 softmax instead of keeping every chunk's; what stays alive between forward and
backward is the logits tensor itself (which the model's LM head produced anyway) and two
``[batch, length]`` results. A single chunk is not checkpointed: its temporaries would exist
again during the recompute in backward, on top of the same saved activations, so recomputing
would cost a second softmax and save no peak memory.

The entropy is a differentiable term of the loss only with an entropy bonus
(``algorithm.entropyCoef`` > 0); otherwise it is a metric, and ``entropy_grad=False`` computes it
without autograd from the same logits, so backward never runs through it.

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


def _scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    z = logits.float()
    return z / temperature if temperature != 1.0 else z


def _chunk(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``[n, vocab]`` logits, ``[n]`` targets -> log-probs ``[n]`` and the entropy ``[n]`` (or None), fp32."""
    z = _scaled(logits, temperature)
    log_probs = torch.log_softmax(z, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return log_probs, entropy_from_logits(z) if with_entropy else None


def token_logprobs_and_entropy_from_logits(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = True,
    entropy_grad: bool = True,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs ``[B, L]`` of ``targets`` under ``logits / temperature`` ``[B, L, V]`` and optionally the entropy.

    Both results are fp32 whatever the logits' dtype. ``chunk_tokens`` bounds the positions whose
    fp32 softmax exists at once; it changes memory, never the result. ``entropy_grad=False``
    returns the entropy without a graph (equal in value to the differentiable one).
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens={chunk_tokens} must be >= 1")
    if logits.shape[:-1] != targets.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} and targets {tuple(targets.shape)} disagree on [batch, length]"
        )
    flat_logits = logits.reshape(-1, logits.shape[-1])
    flat_targets = targets.reshape(-1)
    starts = range(0, flat_targets.numel(), chunk_tokens)
    checkpointed = len(starts) > 1 and torch.is_grad_enabled() and logits.requires_grad
    graph_entropy = with_entropy and entropy_grad
    log_probs: list[torch.Tensor] = []
    entropies: list[torch.Tensor] = []
    for start in starts:
        chunk = (flat_logits[start : start + chunk_tokens], flat_targets[start : start + chunk_tokens])
        if checkpointed:
            piece, entropy = checkpoint(_chunk, *chunk, temperature, graph_entropy, use_reentrant=False)
        else:
            piece, entropy = _chunk(*chunk, temperature, graph_entropy)
        if with_entropy and not entropy_grad:
            with torch.no_grad():
                entropy = entropy_from_logits(_scaled(chunk[0].detach(), temperature))
        log_probs.append(piece)
        if entropy is not None:
            entropies.append(entropy)
    if not log_probs:
        empty = flat_logits.new_zeros(targets.shape, dtype=torch.float32)
        return empty, empty.clone() if with_entropy else None
    joined = torch.cat(log_probs).reshape(targets.shape)
    return joined, torch.cat(entropies).reshape(targets.shape) if with_entropy else None
