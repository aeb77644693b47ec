"""Loading an FSDP model with each rank reading only its own shard: meta device, then safetensors slices.

Why: the plain path (:mod:`~hybridflow.backends.fsdp.load`) has every rank build the whole model
in fp32 on the host and then keep a slice of it (``fully_shard``). For a 7B actor that is ~28 GB
of host memory per rank, ~240 GB per 8-GPU node at once for actor, reference and critic, beside
Ray's object store. Here the host holds at most one rank's slice of one tensor at a time.

Protocol (every rank of the worker group, collectively, in this order):

1. :func:`build_on_meta`: the model's modules with parameters on the ``meta`` device (no
   memory), from ``config.json`` alone, after checking that the checkpoint holds exactly the
   parameters the model needs (the same refusal as the plain path: never a partly random model).
2. :func:`~hybridflow.backends.fsdp.parallelize.shard_model` on that meta model (FSDP2 shards
   meta parameters as it shards real ones, without allocating).
3. :func:`materialize_and_load`: ``to_empty`` allocates each rank's ``Shard(0)`` slices on its
   device, then each parameter's local rows (its global offset from the DTensor's placement) are
   read from the checkpoint and copied in place (``copy_`` casts without a full temporary).
   Rows of a row-major tensor are contiguous in a safetensors file, so they are read with plain
   positioned reads (:class:`~hybridflow.models.safetensors_rows.SafetensorsRows`), at most
   ``safetensors_rows.READ_CHUNK_BYTES`` at a time.
   Not through ``safe_open``'s memory map: every page it touches stays resident in the process
   while the file is open, which would double the host peak (the shard, plus its file pages).
   Non-persistent buffers (the rotary embedding's ``inv_freq``) are not in checkpoints: they
   are recomputed by the module's own constructor on the CPU, from the config.

The result equals the plain path bit for bit (``tests/unit/test_fsdp_sharded_load.py``), so the
two are interchangeable; the plain path remains for models this one cannot build (a
non-persistent buffer of a module other than a rotary embedding, a checkpoint that is not
safetensors), which :func:`sharded_load_supported` tells apart.
"""

from __future__ import annotations

import json
import math
from collections.abc import Container
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, PretrainedConfig

from hybridflow.backends.fsdp.load import SCORE_HEAD_KEY, ValueModel, _model_dir
from hybridflow.backends.fsdp.weights import hf_name
from hybridflow.models import safetensors_rows
from hybridflow.models.safetensors_rows import SafetensorsRows

__all__ = [
    "ShardedLoadReport",
    "build_on_meta",
    "checkpoint_bytes",
    "materialize_and_load",
    "sharded_load_supported",
]


@dataclass(frozen=True)
class ShardedLoadReport:
    """What :func:`materialize_and_load` read: bytes from the files, and the largest single read."""

    bytes_read: int
    largest_read_bytes: int
    tensors: int


def _checkpoint_files(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.safetensors"))


def _non_persistent_buffer_owners(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if m._non_persistent_buffers_set]


def sharded_load_supported(path: str | Path) -> bool:
    """Whether :func:`build_on_meta` can build the model in ``path``: safetensors, rotary-only buffers."""
    directory = _model_dir(path)
    if not _checkpoint_files(directory):
        return False
    config = AutoConfig.from_pretrained(directory, local_files_only=True)
    with torch.device("meta"):
        probe = AutoModelForCausalLM.from_config(config)
    owners = _non_persistent_buffer_owners(probe)
    return all("RotaryEmbedding" in type(m).__name__ and hasattr(m, "config") for m in owners)


def _checkpoint_name(model_key: str, kind: str, keys: Container[str]) -> str | None:
    """The checkpoint tensor that fills model parameter/buffer ``model_key`` (``None``: no source).

    A causal LM's names are the checkpoint's. A value model's backbone is the checkpoint's base
    model: ``backbone.layers.0...`` is ``model.layers.0...`` in a causal-LM or reward-model
    directory (or ``layers.0...`` in a bare base-model one), and its head may be ``score.weight``.
    """
    name = hf_name(model_key)
    if kind == "causal-lm":
        return name if name in keys else None
    if name.startswith("backbone."):
        inner = name.removeprefix("backbone.")
        for candidate in (f"model.{inner}", inner):
            if candidate in keys:
                return candidate
        return None
    if name == "value_head.weight" and SCORE_HEAD_KEY in keys:
        return SCORE_HEAD_KEY
    return None


def build_on_meta(path: str | Path, *, kind: str, dtype: torch.dtype, attn_implementation: str) -> nn.Module:
    """Step 1 of the protocol: the model of ``path`` with every parameter on the meta device.

    ``kind`` is ``"causal-lm"`` (actor, reference) or ``"value"`` (critic: a
    :class:`~hybridflow.backends.fsdp.load.ValueModel` over the base model). Raises
    ``ValueError`` naming the directory and the keys when the checkpoint does not hold exactly
    the model's parameters (the causal LM's ``lm_head`` may be tied; a value model may leave the
    checkpoint's heads unused), as :func:`~hybridflow.backends.fsdp.load.load_causal_lm` does.
    """
    directory = _model_dir(path)
    config: PretrainedConfig = AutoConfig.from_pretrained(directory, local_files_only=True)
    with torch.device("meta"):
        if kind == "causal-lm":
            model: nn.Module = AutoModelForCausalLM.from_config(
                config, dtype=dtype, attn_implementation=attn_implementation
            )
        else:
            backbone = AutoModel.from_config(config, dtype=dtype, attn_implementation=attn_implementation)
            model = ValueModel(backbone)
    inner_config = getattr(
        model if kind == "causal-lm" else getattr(model, "backbone", model), "config", None
    )
    if inner_config is not None:
        inner_config.use_cache = False  # training forwards never decode (as load.py does)
    keys = set(SafetensorsRows(directory).names())
    state = model.state_dict()
    missing = sorted(
        k
        for k in state
        if _checkpoint_name(k, kind, keys) is None and not (kind == "value" and k.startswith("value_head."))
    )
    if kind == "causal-lm" and getattr(config, "tie_word_embeddings", False):
        missing = [k for k in missing if k != "lm_head.weight"]
    used = {_checkpoint_name(k, kind, keys) for k in state}
    allowed_unused = ("lm_head.", "score.") if kind == "value" else ()
    unused = sorted(k for k in keys if k not in used and not k.startswith(allowed_unused))
    if missing or unused:
        raise ValueError(
            f"{directory} does not match its config.json architecture: missing weights {missing or 'none'}, "
            f"unused weights {unused or 'none'}; refusing to train a partly random model"
        )
    return model.eval()


def _local_rows(tensor: torch.Tensor) -> tuple[int, int]:
    """This rank's rows ``[start, stop)`` of dim 0 of the global tensor ``tensor`` stands for."""
    if not isinstance(tensor, DTensor):
        return 0, int(tensor.shape[0]) if tensor.dim() else 0
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local_shape, offset = compute_local_shape_and_global_offset(
        tensor.shape, tensor.device_mesh, tensor.placements
    )
    if tensor.dim() == 0:
        return 0, 0
    return int(offset[0]), int(offset[0]) + int(local_shape[0])


def materialize_and_load(
    model: nn.Module, path: str | Path, *, kind: str, device: torch.device
) -> ShardedLoadReport:
    """Steps 3 of the protocol, after ``shard_model``: allocate this rank's shards and fill them.

    Reads every parameter's local rows from the checkpoint (only those bytes), recomputes the
    non-persistent buffers, zeroes a value head the checkpoint has no ``score`` for, and re-ties
    a tied LM head. Returns what was read; raises ``ValueError`` on a shape mismatch, naming the
    tensor.
    """
    directory = _model_dir(path)
    model.to_empty(device=device)
    rows = SafetensorsRows(directory)
    keys = set(rows.names())
    bytes_read = largest = tensors = 0
    with torch.no_grad():
        for model_key, tensor in [*model.named_parameters(), *model.named_buffers()]:
            source = _checkpoint_name(model_key, kind, keys)
            local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
            if source is None:
                if kind == "value" and hf_name(model_key).startswith("value_head."):
                    local.zero_()
                continue
            if rows.shape(source) != tuple(tensor.shape):
                raise ValueError(
                    f"{directory}: {source} has shape {rows.shape(source)}, the model's "
                    f"{model_key} needs {tuple(tensor.shape)}"
                )
            start, stop = _local_rows(tensor)
            if tensor.dim() == 0:
                piece = rows.read_rows(source, 0, 1)
                local.copy_(piece)
                bytes_read, largest, tensors = (
                    bytes_read + piece.nbytes,
                    max(largest, piece.nbytes),
                    tensors + 1,
                )
                continue
            row_bytes = max(1, math.prod(tensor.shape[1:]) * rows.element_size(source))
            step = max(1, safetensors_rows.READ_CHUNK_BYTES // row_bytes)
            for first in range(start, stop, step):
                last = min(stop, first + step)
                piece = rows.read_rows(source, first, last)
                local[first - start : last - start].copy_(piece)  # casts in place, no full temporary
                bytes_read, largest = bytes_read + piece.nbytes, max(largest, piece.nbytes)
                del piece
            tensors += 1
        for owner in _non_persistent_buffer_owners(model):
            fresh = type(owner)(owner.config)  # a rotary embedding: buffers from the config, on the CPU
            for name in owner._non_persistent_buffers_set:
                getattr(owner, name).copy_(getattr(fresh, name))
    inner = model if kind == "causal-lm" else getattr(model, "backbone", model)
    if kind == "causal-lm" and getattr(inner.config, "tie_word_embeddings", False):
        tie = getattr(inner, "tie_weights", None)
        if tie is not None:
            tie()
    return ShardedLoadReport(bytes_read=bytes_read, largest_read_bytes=largest, tensors=tensors)


def checkpoint_bytes(path: str | Path) -> int:
    """The size of every tensor in the checkpoint, as stored (what a full load reads)."""
    directory = _model_dir(path)
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        total = json.loads(index.read_text()).get("metadata", {}).get("total_size")
        if isinstance(total, int):
            return total
    return sum(f.stat().st_size for f in _checkpoint_files(directory))
