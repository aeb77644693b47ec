"""Building a megatron-core GPTModel from an HF checkpoint directory, each rank loading only its shard.

Protocol: after :func:`~hybridflow.backends.megatron.parallelize.initialize_parallel_state`,
every rank calls :func:`load_causal_lm` (actor, reference) or :func:`load_value_model` (critic)
on the same local directory. Each rank builds only its pipeline stage (the embedding on the first
stage, its ``L/p`` decoder layers, the final norm and head on the last) with its TP slice of
every tensor, and fills it by reading from the checkpoint's safetensors only its own part of
the HF tensors its stage needs, one conversion unit at a time
(:func:`~hybridflow.backends.megatron.convert.hf_to_megatron`). There is no communication:
every rank reads the files itself, so they must be visible to every rank (a shared volume).

Every parameter ends up from the checkpoint: megatron initialises them randomly on the current
CUDA device (see :meth:`~hybridflow.backends.megatron.config.DecoderArch.transformer_config_kwargs`
for why it cannot skip that) and :func:`load_hf_weights` overwrites each one; a parameter the
checkpoint does not provide raises instead of keeping its random values. The critic's value
head is zero (or the ``score`` head of a reward-model directory), as in the FSDP backend.

The built model carries a :class:`ModelInfo` (read it with :func:`model_info`): the
architecture and vocab padding that the weight export and the vocab-parallel log-softmax need,
so those functions take the model alone, like their FSDP counterparts.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer import TransformerConfig
from torch import nn

from hybridflow.backends.megatron.config import DecoderArch, padded_vocab_size
from hybridflow.backends.megatron.convert import Unit, hf_to_megatron, units
from hybridflow.models.safetensors_rows import SafetensorsRows

__all__ = [
    "SCORE_HEAD_KEY",
    "ModelInfo",
    "ValueHead",
    "build_gpt_model",
    "first_layer",
    "load_causal_lm",
    "load_hf_weights",
    "load_value_model",
    "model_info",
    "owned_units",
    "unwrap",
]

SCORE_HEAD_KEY = "score.weight"
"""The head of ``*ForSequenceClassification`` checkpoints with ``num_labels=1`` (reward models)."""

_INFO_ATTRIBUTE = "hybridflow_info"


@dataclass(frozen=True)
class ModelInfo:
    """What the rest of the backend needs to know about a built model besides its modules."""

    arch: DecoderArch
    vocab_multiple: int
    value_head: bool


class ValueHead(nn.Module):
    """A critic's value head in the place of megatron's output layer: ``hidden -> 1``, replicated on every TP rank.

    ``GPTModel`` calls its output layer as ``output_layer(hidden, weight=..., runtime_gather_output=...)``
    and unpacks ``(output, bias)``; this module accepts and ignores those keyword arguments, so
    the model's forward (and megatron's pipeline schedules around it) run unchanged and return
    ``[batch, seq, 1]`` values on the last stage. Its parameters are plain (not
    ``tensor_model_parallel``): every TP rank holds and updates the same copy; their gradients
    agree across TP ranks because the hidden states entering the head do.
    """

    def __init__(self, hidden_size: int, *, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1, hidden_size, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.zeros(1, dtype=dtype, device=device))

    def forward(
        self,
        hidden_states: torch.Tensor,
        weight: torch.Tensor | None = None,
        runtime_gather_output: Any = None,
    ) -> tuple[torch.Tensor, None]:
        del weight, runtime_gather_output  # the vocab-parallel output layer's arguments
        return F.linear(hidden_states, self.weight, self.bias), None


def unwrap(model: nn.Module) -> GPTModel:
    """The ``GPTModel`` inside megatron's wrappers (DDP, Float16Module: each keeps it as ``.module``)."""
    inner: Any = model
    while not isinstance(inner, GPTModel):
        if not hasattr(inner, "module"):
            raise TypeError(f"{type(model).__name__} is not a megatron GPTModel or a wrapper of one")
        inner = inner.module
    return inner


def model_info(model: nn.Module) -> ModelInfo:
    """The :class:`ModelInfo` of a model built by :func:`build_gpt_model` (wrapped or not)."""
    info = getattr(unwrap(model), _INFO_ATTRIBUTE, None)
    if not isinstance(info, ModelInfo):
        raise TypeError("this GPTModel was not built by hybridflow.backends.megatron.load.build_gpt_model")
    return info


def first_layer(model: nn.Module) -> int:
    """The global index of the first decoder layer this rank's stage holds."""
    layers = unwrap(model).decoder.layers
    return int(layers[0].layer_number) - 1 if len(layers) else 0


def build_gpt_model(
    arch: DecoderArch,
    *,
    dtype: torch.dtype = torch.float32,
    value_head: bool = False,
    vocab_multiple: int = 1,
    activation_checkpointing: bool = False,
) -> GPTModel:
    """This rank's stage of a GPTModel for ``arch`` in the current parallel state, randomly initialised.

    Collective in the sense that every rank must build its stage (megatron creates nothing
    collectively here, but the stages only work together). ``dtype`` float32 or bfloat16 (see
    :meth:`DecoderArch.transformer_config_kwargs`). ``value_head`` swaps the LM head for a
    :class:`ValueHead` (zero). ``vocab_multiple`` is megatron's ``make_vocab_size_divisible_by``
    (see :func:`~hybridflow.backends.megatron.config.padded_vocab_size`).
    ``activation_checkpointing``: recompute every layer in backward (see
    :meth:`DecoderArch.transformer_config_kwargs`).

    Pipeline parallelism sends ``[seq, micro_batch, hidden]`` activations whose shape is
    exchanged per micro-batch (``variable_seq_lengths``), so micro-batches of one call may differ
    in size.
    """
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    pp_size = parallel_state.get_pipeline_model_parallel_world_size()
    arch.check_parallel(tp_size=tp_size, pp_size=pp_size)
    config = TransformerConfig(
        **arch.transformer_config_kwargs(
            tp_size=tp_size,
            pp_size=pp_size,
            dtype=dtype,
            variable_seq_lengths=pp_size > 1,
            activation_checkpointing=activation_checkpointing,
        )
    )
    padded = padded_vocab_size(arch.vocab_size, tp_size, vocab_multiple)
    model = GPTModel(
        config,
        get_gpt_layer_local_spec(normalization="RMSNorm"),
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        **arch.gpt_model_kwargs(padded_vocab=padded),
    )
    if value_head and parallel_state.is_pipeline_last_stage():
        device = model.decoder.final_layernorm.weight.device
        model.output_layer = ValueHead(arch.hidden_size, dtype=dtype, device=device)
    setattr(
        model, _INFO_ATTRIBUTE, ModelInfo(arch=arch, vocab_multiple=vocab_multiple, value_head=value_head)
    )
    return model


def owned_units(model: nn.Module) -> list[Unit]:
    """The conversion units whose parameters this rank's stage holds, in HF order."""
    info = model_info(model)
    gpt = unwrap(model)
    start = first_layer(model)
    stop = start + len(gpt.decoder.layers)
    owned = []
    for unit in units(info.arch, value_head=info.value_head):
        if unit.section == "embedding":
            keep = gpt.pre_process
        elif unit.section == "head":
            keep = gpt.post_process
        else:
            assert unit.layer is not None
            keep = start <= unit.layer < stop
        if keep:
            owned.append(unit)
    return owned


def load_hf_weights(model: nn.Module, path: str | Path) -> None:
    """Overwrite every parameter of this rank's stage from the HF checkpoint in ``path``.

    Reads, one conversion unit at a time, only this TP rank's pieces of the HF tensors of the
    units the stage owns (rows, or for the row-parallel weights columns cut from row chunks:
    :class:`~hybridflow.models.safetensors_rows.SafetensorsRows`, no memory map) and copies them
    into the parameters (casting to their dtype). The host holds the stage plus one unit's pieces,
    never a whole HF tensor that is split (the embedding, say). A critic's value
    head is set from ``score.weight`` when the directory is a reward model, else left as it is
    (zero). Raises ``ValueError`` naming the tensors when the checkpoint lacks any the model
    needs, or when a shape disagrees, and ``RuntimeError`` if a parameter was left unwritten.
    """
    directory = Path(path)
    info = model_info(model)
    gpt = unwrap(model)
    checkpoint = SafetensorsRows(directory)
    if not checkpoint.names():
        raise FileNotFoundError(f"{directory} holds no safetensors weights")
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    parameters = dict(gpt.named_parameters())
    written: set[str] = set()
    start = first_layer(model)
    for unit in owned_units(model):
        names = unit.megatron_names(start)
        if unit.kind == "value_head":
            if SCORE_HEAD_KEY in checkpoint:
                score = checkpoint.read(SCORE_HEAD_KEY)
                if tuple(score.shape) != (1, info.arch.hidden_size):
                    raise ValueError(
                        f"{directory}: {SCORE_HEAD_KEY} has shape {tuple(score.shape)}; a reward model needs "
                        f"num_labels=1, i.e. (1, {info.arch.hidden_size})"
                    )
                with torch.no_grad():
                    parameters[names[0]].copy_(score)
            written.update(names)
            continue
        missing = [name for name in unit.hf_names if name not in checkpoint]
        if missing:
            raise ValueError(f"{directory} lacks {missing}; refusing to train a partly uninitialised model")
        local = hf_to_megatron(
            info.arch, unit, checkpoint, tp_rank=tp_rank, tp_size=tp_size, vocab_multiple=info.vocab_multiple
        )
        for name, suffix in zip(names, unit.megatron_suffixes, strict=True):
            parameter = parameters[name]
            tensor = local[suffix]
            if tuple(tensor.shape) != tuple(parameter.shape):
                raise ValueError(
                    f"{directory}: {unit.hf_names} give {name} the shape {tuple(tensor.shape)}, the model "
                    f"has {tuple(parameter.shape)}"
                )
            with torch.no_grad():
                parameter.copy_(tensor)
            written.add(name)
    unwritten = sorted(set(parameters) - written)
    if unwritten:
        raise RuntimeError(f"the conversion left parameters unwritten: {unwritten}")


def load_causal_lm(
    path: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    vocab_multiple: int = 1,
    activation_checkpointing: bool = False,
) -> GPTModel:
    """The causal LM in ``path`` (a local HF directory) as this rank's GPTModel stage, in eval mode.

    Called by the actor and reference workers on every rank after
    :func:`~hybridflow.backends.megatron.parallelize.initialize_parallel_state`. Eval mode only
    matters for dropout, which these models do not have.
    """
    arch = DecoderArch.from_directory(path)
    model = build_gpt_model(
        arch, dtype=dtype, vocab_multiple=vocab_multiple, activation_checkpointing=activation_checkpointing
    )
    load_hf_weights(model, path)
    return model.eval()


def load_value_model(
    path: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    vocab_multiple: int = 1,
    activation_checkpointing: bool = False,
) -> GPTModel:
    """A critic: the decoder of the model in ``path`` with a :class:`ValueHead` on the last stage.

    ``path`` is a causal-LM directory (its LM head is left unused; the value head starts at
    zero) or a reward-model directory (``score.weight`` becomes the value head's weight), as in
    the FSDP backend's ``load_value_model``.
    """
    arch = DecoderArch.from_directory(path)
    model = build_gpt_model(
        arch,
        dtype=dtype,
        value_head=True,
        vocab_multiple=vocab_multiple,
        activation_checkpointing=activation_checkpointing,
    )
    load_hf_weights(model, path)
    return model.eval()
