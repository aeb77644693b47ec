"""How a Qwen2/Llama decoder's HF parameters are partitioned for tensor and pipeline parallelism.

This module is pure (no torch, no processes): it names every HF parameter of a decoder, says
how Megatron-style tensor parallelism cuts it and which pipeline stage owns it, and gives the
exact slice a ``(pp_rank, tp_rank)`` coordinate of a ``(p, t)`` layout holds. Everything the
resharding plan (:mod:`hybridflow.resharding.plan`) reasons about is expressed in these terms,
so any training backend can feed it: it only has to hand over, under HF names, the slices this
module describes.

Tensor parallelism follows Megatron-LM's conventions, written on the HF tensors:

* column-parallel (split on dim 0, the output features): ``q_proj``, ``k_proj``, ``v_proj``
  (and their Qwen2 biases), ``gate_proj``, ``up_proj``; vocab-parallel: ``embed_tokens`` and
  ``lm_head`` (rows are vocabulary ids). Attention projections are split by heads; in the HF
  layout a head's rows are contiguous, so "by heads" is a contiguous dim-0 split whose pieces
  must hold whole heads (:attr:`ParamSpec.split_unit`). Megatron stores q/k/v fused and
  interleaved by query group and gate/up fused per rank; its TP rank ``j`` nevertheless holds
  exactly the HF rows this module assigns to ``j`` (query groups ``[j*G/t, (j+1)*G/t)`` with
  their query heads), so a Megatron backend converts its local fused tensors to these slices
  locally, without communication.
* row-parallel (split on dim 1, the input features): ``o_proj``, ``down_proj``. Their biases,
  when a model has them, are added after the all-reduce and are replicated.
* replicated on every TP rank: the RMSNorm weights.

Pipeline parallelism splits the ``L`` decoder layers into ``p`` contiguous stages of ``L/p``
layers (Megatron's default); the embedding lives on stage 0, the final norm and ``lm_head`` on
the last stage.

Because every split is contiguous and even, the slices of a ``t``-way split are unions of
consecutive slices of any finer ``t' = k*t`` split, and the layers of a ``p``-way stage are the
union of consecutive stages of a ``k*p``-way split. That is the whole reason a HybridFlow
generation shard (coarser layout) contains the training shards of its micro-DP group.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

__all__ = [
    "Block",
    "DecoderSpec",
    "ModelLayout",
    "ParamSpec",
    "ReshardingError",
    "Section",
    "decoder_layout",
]


class ReshardingError(ValueError):
    """A layout, plan or shard that does not fit the model or the meshes (the message says how)."""


Section = Literal["embedding", "layer", "head"]
"""Where a parameter sits in the pipeline: ``embedding`` on the first stage, ``layer`` with its
decoder layer's stage, ``head`` (final norm, ``lm_head``) on the last stage."""


@dataclass(frozen=True)
class Block:
    """A contiguous block of one parameter: ``[start, stop)`` along ``dim``, or the whole tensor.

    ``shape`` is the block's own shape. ``dim is None`` means the whole tensor (a replicated
    parameter); then ``start == 0`` and ``stop`` is the size of dim 0, so that two whole blocks
    of the same parameter compare equal.
    """

    name: str
    dim: int | None
    start: int
    stop: int
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count

    @property
    def partitioned(self) -> bool:
        return self.dim is not None

    def index(self) -> tuple[slice, ...]:
        """The tensor index of this block in the full parameter: ``full[block.index()]``."""
        if self.dim is None:
            return (slice(None),)
        return (*(slice(None),) * self.dim, slice(self.start, self.stop))

    def contains(self, other: Block) -> bool:
        """Whether ``other`` (a block of the same parameter) lies inside this block."""
        if other.name != self.name or other.dim != self.dim:
            return False
        return self.start <= other.start and other.stop <= self.stop


@dataclass(frozen=True)
class ParamSpec:
    """One HF parameter: its shape, its TP split and its place in the pipeline.

    ``split_dim`` is ``None`` for a parameter every TP rank holds whole. ``split_unit`` is the
    granularity a split must respect along ``split_dim`` (``head_dim`` for attention
    projections: no rank may hold part of a head; 1 otherwise). ``layer`` is the decoder layer
    index for ``section == "layer"``.
    """

    name: str
    shape: tuple[int, ...]
    split_dim: int | None
    split_unit: int
    section: Section
    layer: int | None = None

    @property
    def partitioned(self) -> bool:
        return self.split_dim is not None

    @property
    def numel(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count

    def check_split(self, parts: int) -> None:
        """Raise :class:`ReshardingError` unless a ``parts``-way split gives equal whole-unit pieces."""
        if self.split_dim is None:
            return
        size = self.shape[self.split_dim]
        if size % (parts * self.split_unit):
            unit = f" in units of {self.split_unit}" if self.split_unit > 1 else ""
            raise ReshardingError(
                f"{self.name}: dim {self.split_dim} has size {size}, which does not split {parts} ways{unit}"
            )

    def block(self, parts: int, index: int) -> Block:
        """Piece ``index`` of a ``parts``-way split (the whole tensor if replicated)."""
        if self.split_dim is None:
            return Block(self.name, None, 0, self.shape[0], self.shape)
        self.check_split(parts)
        if not 0 <= index < parts:
            raise ReshardingError(f"{self.name}: piece {index} of a {parts}-way split does not exist")
        width = self.shape[self.split_dim] // parts
        shape = list(self.shape)
        shape[self.split_dim] = width
        return Block(self.name, self.split_dim, index * width, (index + 1) * width, tuple(shape))


@dataclass(frozen=True)
class DecoderSpec:
    """The architecture facts of a Qwen2/Llama decoder that layouts and the TP engine need.

    Built from an HF config with :meth:`from_hf_config` (duck-typed: this module does not import
    transformers). Only untied embeddings are supported: a tied ``lm_head`` would make the last
    stage hold a second copy of the embedding, which neither the plan nor the engine models yet.
    """

    arch: Literal["qwen2", "llama"]
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    qkv_bias: bool
    o_bias: bool = False
    mlp_bias: bool = False

    @classmethod
    def from_hf_config(cls, config: Any) -> DecoderSpec:
        """Read a transformers ``Qwen2Config``/``LlamaConfig`` (or an object with the same fields)."""
        arch = getattr(config, "model_type", None)
        if arch not in ("qwen2", "llama"):
            raise ReshardingError(f"model_type={arch!r} is not supported; allowed: qwen2, llama")
        if getattr(config, "tie_word_embeddings", False):
            raise ReshardingError(
                "tie_word_embeddings=True is not supported by resharding; use an untied model"
            )
        rope = getattr(config, "rope_parameters", None) or {}
        rope_type = rope.get("rope_type", "default")
        if rope_type != "default":
            raise ReshardingError(f"rope_type={rope_type!r} is not supported; allowed: default")
        theta = rope.get("rope_theta", getattr(config, "rope_theta", None))
        if theta is None:
            raise ReshardingError("the config has no rope_theta")
        if arch == "qwen2" and getattr(config, "use_sliding_window", False):
            raise ReshardingError(
                "use_sliding_window=True is not supported; the TP engine has no sliding window"
            )
        heads = int(config.num_attention_heads)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        attention_bias = bool(getattr(config, "attention_bias", False))
        return cls(
            arch=arch,
            vocab_size=int(config.vocab_size),
            hidden_size=int(config.hidden_size),
            intermediate_size=int(config.intermediate_size),
            num_layers=int(config.num_hidden_layers),
            num_heads=heads,
            num_kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(config.rms_norm_eps),
            rope_theta=float(theta),
            max_position_embeddings=int(config.max_position_embeddings),
            qkv_bias=arch == "qwen2" or attention_bias,
            o_bias=arch == "llama" and attention_bias,
            mlp_bias=arch == "llama" and bool(getattr(config, "mlp_bias", False)),
        )


@dataclass(frozen=True)
class ModelLayout:
    """Every parameter of a model in HF ``state_dict`` order, plus the element size in bytes."""

    params: tuple[ParamSpec, ...]
    num_layers: int
    itemsize: int

    def __post_init__(self) -> None:
        names = [param.name for param in self.params]
        if len(set(names)) != len(names):
            raise ReshardingError("a model layout names a parameter twice")

    def __iter__(self) -> Iterator[ParamSpec]:
        return iter(self.params)

    def param(self, name: str) -> ParamSpec:
        for param in self.params:
            if param.name == name:
                return param
        raise ReshardingError(f"the model has no parameter {name!r}")

    @property
    def partitioned_bytes(self) -> int:
        """Bytes of the TP-partitioned parameters: the ``M`` that Table 2's formulas are exact for."""
        return sum(param.numel for param in self.params if param.partitioned) * self.itemsize

    @property
    def replicated_bytes(self) -> int:
        """Bytes of the TP-replicated parameters (the RMSNorm weights), accounted separately."""
        return sum(param.numel for param in self.params if not param.partitioned) * self.itemsize

    @property
    def total_bytes(self) -> int:
        return self.partitioned_bytes + self.replicated_bytes

    def check(self, pp_size: int, tp_size: int) -> None:
        """Raise :class:`ReshardingError` unless a ``pp_size`` x ``tp_size`` layout splits this model evenly."""
        if pp_size < 1 or tp_size < 1:
            raise ReshardingError(f"parallel sizes must be >= 1, got pp={pp_size} tp={tp_size}")
        if self.num_layers % pp_size:
            raise ReshardingError(f"{self.num_layers} layers do not split into {pp_size} pipeline stages")
        for param in self.params:
            param.check_split(tp_size)

    def stage(self, param: ParamSpec, pp_size: int) -> int:
        """The pipeline stage (of ``pp_size``) that owns ``param``."""
        if param.section == "embedding":
            return 0
        if param.section == "head":
            return pp_size - 1
        assert param.layer is not None
        return param.layer // (self.num_layers // pp_size)

    def stage_params(self, pp_size: int, pp_rank: int) -> list[ParamSpec]:
        """The parameters stage ``pp_rank`` of ``pp_size`` owns, in HF order."""
        return [param for param in self.params if self.stage(param, pp_size) == pp_rank]

    def shard(self, pp_size: int, tp_size: int, pp_rank: int, tp_rank: int) -> list[Block]:
        """The blocks coordinate ``(pp_rank, tp_rank)`` of a ``(pp_size, tp_size)`` layout holds, HF order."""
        self.check(pp_size, tp_size)
        return [param.block(tp_size, tp_rank) for param in self.stage_params(pp_size, pp_rank)]

    def shard_index(
        self, name: str, pp_size: int, tp_size: int, pp_rank: int, tp_rank: int
    ) -> tuple[slice, ...] | None:
        """The tensor index of ``name`` that ``(pp_rank, tp_rank)`` holds, or ``None`` if its stage lacks it."""
        param = self.param(name)
        self.check(pp_size, tp_size)
        if self.stage(param, pp_size) != pp_rank:
            return None
        return param.block(tp_size, tp_rank).index()


def _layer_params(spec: DecoderSpec, layer: int) -> list[ParamSpec]:
    """Decoder layer ``layer``'s parameters, in HF ``state_dict`` order."""
    hidden, head_dim, ffn = spec.hidden_size, spec.head_dim, spec.intermediate_size
    q_rows, kv_rows = spec.num_heads * head_dim, spec.num_kv_heads * head_dim
    prefix = f"model.layers.{layer}."
    params: list[ParamSpec] = []

    def add(suffix: str, shape: tuple[int, ...], split_dim: int | None, unit: int = 1) -> None:
        params.append(ParamSpec(prefix + suffix, shape, split_dim, unit, "layer", layer))

    for proj, rows in (("q_proj", q_rows), ("k_proj", kv_rows), ("v_proj", kv_rows)):
        add(f"self_attn.{proj}.weight", (rows, hidden), 0, head_dim)
        if spec.qkv_bias:
            add(f"self_attn.{proj}.bias", (rows,), 0, head_dim)
    add("self_attn.o_proj.weight", (hidden, q_rows), 1, head_dim)
    if spec.o_bias:
        add("self_attn.o_proj.bias", (hidden,), None)
    for proj in ("gate_proj", "up_proj"):
        add(f"mlp.{proj}.weight", (ffn, hidden), 0)
        if spec.mlp_bias:
            add(f"mlp.{proj}.bias", (ffn,), 0)
    add("mlp.down_proj.weight", (hidden, ffn), 1)
    if spec.mlp_bias:
        add("mlp.down_proj.bias", (hidden,), None)
    add("input_layernorm.weight", (hidden,), None)
    add("post_attention_layernorm.weight", (hidden,), None)
    return params


def decoder_layout(spec: DecoderSpec, itemsize: int = 4) -> ModelLayout:
    """The layout of a Qwen2/Llama causal LM's parameters (names and shapes as in its HF ``state_dict``)."""
    hidden = spec.hidden_size
    params: list[ParamSpec] = [
        ParamSpec("model.embed_tokens.weight", (spec.vocab_size, hidden), 0, 1, "embedding")
    ]
    for layer in range(spec.num_layers):
        params.extend(_layer_params(spec, layer))
    params.append(ParamSpec("model.norm.weight", (hidden,), None, 1, "head"))
    params.append(ParamSpec("lm_head.weight", (spec.vocab_size, hidden), 0, 1, "head"))
    return ModelLayout(tuple(params), spec.num_layers, itemsize)
