"""Figures derived from what a step measured: tokens/s per GPU and the MFU estimate.

MFU here is the usual training-side estimate (Kaplan et al.: ~6 FLOPs per parameter per token
for a forward and backward pass) over the whole step and every GPU of the job:

    mfu = 6 * actor_parameters * step_tokens / (step_seconds * gpus * peak_flops_per_gpu)

It counts only the actor's training FLOPs, so generation, scoring and the critic make it a lower
bound of the hardware's use; what it is for is comparing runs and placements of one model. The
peak is the GPU's dense bf16 tensor-core rate from :data:`PEAK_BF16_FLOPS` (vendor data sheets);
a GPU not in the table (or a CPU run) has no MFU rather than a wrong one.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = [
    "PEAK_BF16_FLOPS",
    "decoder_parameter_count",
    "model_parameter_count",
    "peak_flops",
    "throughput_metrics",
]

# (pattern over torch.cuda.get_device_name(), dense bf16 FLOP/s). First match wins, so the
# specific variants come before the family name. The figures are the vendors' datasheet "BF16
# Tensor Core" rows without sparsity (half of the starred "with sparsity" figure where only that is
# printed). The placement planner's GPU table (hybridflow.planner.gpus) takes its peaks from here;
# its GPUs' rows name their source.
PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    (r"\bB200\b", 2.25e15),
    (r"\bB100\b", 1.75e15),
    (r"\bH100\b.*\bPCIe\b", 756e12),  # NVIDIA H100 datasheet, PCIe: 1,513 TFLOPS sparse
    (r"\bH100\b.*\bNVL\b", 835e12),
    (r"\bH100\b", 989e12),  # NVIDIA H100 datasheet, SXM: 1,979 TFLOPS sparse
    (r"\bH200\b.*\bNVL\b", 835e12),  # NVIDIA H200 datasheet, NVL: 1,671 TFLOPS sparse
    (r"\bH200\b", 989e12),  # NVIDIA H200 datasheet, SXM: 1,979 TFLOPS sparse
    (r"\bH800\b", 989e12),
    (r"\bH20\b", 148e12),
    (r"\bA100\b", 312e12),  # NVIDIA A100 datasheet: 312 TFLOPS, every form factor and memory size
    (r"\bA800\b", 312e12),
    (r"\bL40S\b", 362e12),  # NVIDIA L40S datasheet: 362.05 TFLOPS (733 sparse)
    (r"\bL40\b", 181e12),
    (r"\bL4\b", 121e12),  # NVIDIA L4 datasheet: 242 TFLOPS sparse
    # AWS's A10G (EC2 G5) has no NVIDIA datasheet: Baseten's "NVIDIA A10 vs A10G" spec table.
    (r"\bA10G\b", 70e12),
    (r"\bA10\b", 125e12),  # NVIDIA A10 datasheet: 125 TFLOPS (250 sparse)
    (r"\bMI300X\b", 1307e12),
    (r"\bMI250X?\b", 383e12),
)


def peak_flops(device_name: str) -> float | None:
    """Dense bf16 FLOP/s of one GPU named ``device_name``, or None when the GPU is not known."""
    for pattern, flops in PEAK_BF16_FLOPS:
        if re.search(pattern, device_name, flags=re.IGNORECASE):
            return flops
    return None


def decoder_parameter_count(config: Mapping[str, Any]) -> int:
    """Parameters of a Llama/Qwen2-style decoder from its HF ``config.json`` (biases left out).

    Embeddings (and an untied LM head), per layer the attention projections (grouped-query:
    K and V have ``num_key_value_heads`` heads), a gated MLP (three ``hidden x intermediate``
    matrices) and two norms, and the final norm.
    """
    try:
        hidden = int(config["hidden_size"])
        layers = int(config["num_hidden_layers"])
        heads = int(config["num_attention_heads"])
        intermediate = int(config["intermediate_size"])
        vocab = int(config["vocab_size"])
    except KeyError as err:
        raise ValueError(f"model config: missing {err.args[0]!r}, needed to count parameters") from err
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or hidden // heads)
    attention = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2
    mlp = 3 * hidden * intermediate
    per_layer = attention + mlp + 2 * hidden
    embeddings = vocab * hidden * (1 if config.get("tie_word_embeddings", False) else 2)
    return embeddings + layers * per_layer + hidden


def throughput_metrics(
    step_metrics: Mapping[str, float], *, gpus: int, actor_parameters: int | None
) -> dict[str, float]:
    """``perf/tokens_per_second_per_gpu`` and, when the GPUs' peak is known, ``perf/mfu``.

    Reads ``tokens/step``, ``perf/step_seconds``, ``perf/tokens_per_second`` and the
    ``gpu/peak_flops`` the actor's workers reported (see :func:`hybridflow.metrics.device.device_metrics`).
    """
    derived: dict[str, float] = {}
    tokens_per_second = step_metrics.get("perf/tokens_per_second")
    if tokens_per_second is not None and gpus > 0:
        derived["perf/tokens_per_second_per_gpu"] = tokens_per_second / gpus
    peak = step_metrics.get("gpu/peak_flops")
    seconds = step_metrics.get("perf/step_seconds")
    tokens = step_metrics.get("tokens/step")
    if peak and seconds and tokens is not None and actor_parameters and gpus > 0:
        derived["perf/mfu"] = 6.0 * actor_parameters * tokens / (seconds * gpus * peak)
    return derived


def model_parameter_count(model_dir: str | os.PathLike[str]) -> int | None:
    """:func:`decoder_parameter_count` of the HF model in ``model_dir``; None (no MFU) when unreadable."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
        return decoder_parameter_count(config)
    except (OSError, ValueError, TypeError):
        return None
