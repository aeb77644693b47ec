"""HF <-> megatron-core tensor conversion, one TP rank at a time (pure torch, no communication).

Megatron's TP rank ``r`` of ``t`` holds, for each HF parameter, exactly the slice the
resharding layout (:mod:`hybridflow.resharding.layout`) assigns to ``r``; only the *packing*
differs. The rules, per megatron parameter of the local layer spec:

``embedding.word_embeddings.weight`` / ``output_layer.weight`` (vocab-parallel, dim 0)
    Rows ``[r*P/t, (r+1)*P/t)`` of the vocabulary padded to ``P``
    (:func:`~hybridflow.backends.megatron.config.padded_vocab_size`); rows past the HF
    vocabulary are zero padding.
``self_attention.linear_qkv.{weight,bias}`` (column-parallel, fused, interleaved by group)
    For each of the rank's ``G/t`` key/value groups ``g`` (global groups
    ``[r*G/t, (r+1)*G/t)``), in order: the group's ``H/G`` query heads, its key head, its value
    head, each ``head_dim`` rows: ``[q_g ; k_g ; v_g]``. The rank's q rows are therefore HF
    ``q_proj`` rows ``[r*H*d/t, (r+1)*H*d/t)``, and likewise for k and v: megatron's layout is a
    per-rank permutation of the rank's HF slices, which :func:`megatron_to_hf_shards` undoes
    locally.
``self_attention.linear_proj.weight`` (row-parallel, dim 1)
    ``o_proj`` columns ``[r*H*d/t, (r+1)*H*d/t)``.
``mlp.linear_fc1.weight`` (column-parallel, fused)
    ``[gate_r ; up_r]``: the rank's rows of ``gate_proj`` then of ``up_proj``
    (``glu`` splits the output in two halves and applies SiLU to the first).
``mlp.linear_fc2.weight`` (row-parallel, dim 1)
    ``down_proj`` columns ``[r*F/t, (r+1)*F/t)``.
``input_layernorm`` / ``pre_mlp_layernorm`` / ``decoder.final_layernorm`` weights
    Whole on every rank (HF ``input_layernorm``, ``post_attention_layernorm``, ``model.norm``).

A :class:`Unit` is the smallest set of megatron parameters that converts to a set of HF
parameters on its own (q/k/v share one fused tensor; gate/up another). Units are listed in HF
``state_dict`` order (:func:`units`), which is the order every export yields names in.

All conversions are copies or views of slices and concatenations: HF -> megatron -> HF is
bit-exact.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

import torch

from hybridflow.backends.megatron.config import DecoderArch, padded_vocab_size

__all__ = [
    "VALUE_HEAD_NAMES",
    "FullTensors",
    "HFShard",
    "HFSource",
    "Unit",
    "UnitKind",
    "hf_shapes",
    "hf_to_megatron",
    "megatron_local_shapes",
    "megatron_to_hf",
    "megatron_to_hf_shards",
    "units",
]

UnitKind = Literal[
    "embedding", "qkv", "proj", "fc1", "fc2", "input_norm", "post_norm", "final_norm", "output", "value_head"
]

VALUE_HEAD_NAMES = ("value_head.weight", "value_head.bias")
"""HF-side names of a critic's value head (as in the FSDP backend's ``ValueModel``): a
``[1, hidden]`` weight and a ``[1]`` bias, replicated on every TP rank of the last stage."""


@dataclass(frozen=True)
class Unit:
    """megatron parameters (names relative to the stage's model) that convert to ``hf_names`` together.

    ``megatron_names`` are stage-local: a decoder layer's parameters are named by its index
    within the stage's ``decoder.layers``; ``layer`` is the global layer index (None for the
    embedding and the head). ``section`` says which pipeline stage owns the unit.
    """

    kind: UnitKind
    layer: int | None
    megatron_suffixes: tuple[str, ...]
    hf_names: tuple[str, ...]

    @property
    def section(self) -> Literal["embedding", "layer", "head"]:
        if self.kind == "embedding":
            return "embedding"
        if self.layer is not None:
            return "layer"
        return "head"

    def megatron_names(self, first_layer: int) -> tuple[str, ...]:
        """Full parameter names on a stage whose first decoder layer is global layer ``first_layer``."""
        if self.layer is None:
            return self.megatron_suffixes
        local = self.layer - first_layer
        return tuple(f"decoder.layers.{local}.{suffix}" for suffix in self.megatron_suffixes)


def units(arch: DecoderArch, *, value_head: bool = False) -> list[Unit]:
    """Every conversion unit of the model, in HF ``state_dict`` order.

    ``value_head=True`` describes a critic: the LM head is replaced by the value head
    (:data:`VALUE_HEAD_NAMES`).
    """
    found = [Unit("embedding", None, ("embedding.word_embeddings.weight",), ("model.embed_tokens.weight",))]
    for layer in range(arch.num_layers):
        hf = f"model.layers.{layer}."
        qkv_suffixes: tuple[str, ...] = ("self_attention.linear_qkv.weight",)
        qkv_names: tuple[str, ...] = tuple(hf + f"self_attn.{p}_proj.weight" for p in "qkv")
        if arch.qkv_bias:
            qkv_suffixes += ("self_attention.linear_qkv.bias",)
            qkv_names = tuple(hf + f"self_attn.{p}_proj.{kind}" for p in "qkv" for kind in ("weight", "bias"))
        found += [
            Unit("qkv", layer, qkv_suffixes, qkv_names),
            Unit("proj", layer, ("self_attention.linear_proj.weight",), (hf + "self_attn.o_proj.weight",)),
            Unit(
                "fc1",
                layer,
                ("mlp.linear_fc1.weight",),
                (hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight"),
            ),
            Unit("fc2", layer, ("mlp.linear_fc2.weight",), (hf + "mlp.down_proj.weight",)),
            Unit("input_norm", layer, ("input_layernorm.weight",), (hf + "input_layernorm.weight",)),
            Unit(
                "post_norm", layer, ("pre_mlp_layernorm.weight",), (hf + "post_attention_layernorm.weight",)
            ),
        ]
    found.append(Unit("final_norm", None, ("decoder.final_layernorm.weight",), ("model.norm.weight",)))
    if value_head:
        found.append(Unit("value_head", None, ("output_layer.weight", "output_layer.bias"), VALUE_HEAD_NAMES))
    else:
        found.append(Unit("output", None, ("output_layer.weight",), ("lm_head.weight",)))
    return found


def hf_shapes(arch: DecoderArch, unit: Unit) -> dict[str, tuple[int, ...]]:
    """The full HF shape of each of ``unit``'s HF parameters."""
    hidden, d = arch.hidden_size, arch.head_dim
    q_rows, kv_rows = arch.num_heads * d, arch.num_kv_heads * d
    shapes: dict[str, tuple[int, ...]] = {}
    for name in unit.hf_names:
        leaf = name.rsplit(".", 2)[-2:]
        module, kind = leaf[0], leaf[1]
        if unit.kind in ("embedding", "output"):
            shapes[name] = (arch.vocab_size, hidden)
        elif unit.kind == "qkv":
            rows = q_rows if module == "q_proj" else kv_rows
            shapes[name] = (rows, hidden) if kind == "weight" else (rows,)
        elif unit.kind == "proj":
            shapes[name] = (hidden, q_rows)
        elif unit.kind == "fc1":
            shapes[name] = (arch.intermediate_size, hidden)
        elif unit.kind == "fc2":
            shapes[name] = (hidden, arch.intermediate_size)
        elif unit.kind == "value_head":
            shapes[name] = (1, hidden) if kind == "weight" else (1,)
        else:
            shapes[name] = (hidden,)
    return shapes


def _rows(total: int, tp_rank: int, tp_size: int) -> slice:
    width = total // tp_size
    return slice(tp_rank * width, (tp_rank + 1) * width)


def _vocab_rows(arch: DecoderArch, tp_rank: int, tp_size: int, vocab_multiple: int) -> tuple[int, int, int]:
    """(first padded row of the rank, first real row, end of its real rows) of a vocab-parallel tensor."""
    per_rank = padded_vocab_size(arch.vocab_size, tp_size, vocab_multiple) // tp_size
    start = tp_rank * per_rank
    return start, min(start, arch.vocab_size), min(start + per_rank, arch.vocab_size)


def _qkv_split(
    arch: DecoderArch, fused: torch.Tensor, tp_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A rank's fused ``[q_g ; k_g ; v_g]*`` rows as its (q, k, v) HF row blocks (views or copies)."""
    groups, d, per = arch.num_kv_heads // tp_size, arch.head_dim, arch.heads_per_group
    grouped = fused.reshape(groups, (per + 2) * d, *fused.shape[1:])
    q = grouped[:, : per * d].reshape(groups * per * d, *fused.shape[1:])
    k = grouped[:, per * d : (per + 1) * d].reshape(groups * d, *fused.shape[1:])
    v = grouped[:, (per + 1) * d :].reshape(groups * d, *fused.shape[1:])
    return q, k, v


def _qkv_fuse(
    arch: DecoderArch, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tp_size: int
) -> torch.Tensor:
    groups, d, per = arch.num_kv_heads // tp_size, arch.head_dim, arch.heads_per_group
    rest = q.shape[1:]
    fused = torch.cat(
        [q.reshape(groups, per * d, *rest), k.reshape(groups, d, *rest), v.reshape(groups, d, *rest)], dim=1
    )
    return fused.reshape(groups * (per + 2) * d, *rest)


class HFSource(Protocol):
    """Where :func:`hf_to_megatron` reads a unit's HF tensors from, piece by piece.

    Every piece a TP rank needs is a row range (``rows``) or, for the row-parallel weights
    (``o_proj``, ``down_proj``), a column range (``columns``) of one HF tensor, or a whole small
    tensor (``whole``: norms, biases of replicated layers). A loader passes a reader of the
    checkpoint's files (:class:`hybridflow.models.safetensors_rows.SafetensorsRows`), so a rank
    reads only its pieces; tests and the weight export pass full tensors
    (:class:`FullTensors`).
    """

    def shape(self, name: str) -> tuple[int, ...]: ...

    def read_rows(self, name: str, start: int, stop: int) -> torch.Tensor: ...

    def read_columns(self, name: str, start: int, stop: int) -> torch.Tensor: ...

    def read(self, name: str) -> torch.Tensor: ...


class FullTensors:
    """An :class:`HFSource` over full HF tensors already in memory (views, never copies)."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.tensors[name].shape)

    def read_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        return self.tensors[name][start:stop]

    def read_columns(self, name: str, start: int, stop: int) -> torch.Tensor:
        return self.tensors[name][:, start:stop]

    def read(self, name: str) -> torch.Tensor:
        return self.tensors[name]


def hf_to_megatron(
    arch: DecoderArch,
    unit: Unit,
    hf: Mapping[str, torch.Tensor] | HFSource,
    *,
    tp_rank: int,
    tp_size: int,
    vocab_multiple: int = 1,
) -> dict[str, torch.Tensor]:
    """TP rank ``tp_rank``'s megatron tensors of ``unit`` (by megatron suffix) from its HF tensors.

    ``hf`` holds the full HF tensors, or is an :class:`HFSource` that reads only the pieces this
    rank needs. Results are fresh contiguous tensors in the HF tensors' dtype and device; the
    caller copies them into the model's parameters.
    """
    source: HFSource = FullTensors(hf) if isinstance(hf, Mapping) else hf
    out: dict[str, torch.Tensor] = {}
    names = unit.hf_names
    if unit.kind in ("embedding", "output"):
        shape = source.shape(names[0])
        start, real_start, real_stop = _vocab_rows(arch, tp_rank, tp_size, vocab_multiple)
        per_rank = padded_vocab_size(arch.vocab_size, tp_size, vocab_multiple) // tp_size
        real = source.read_rows(names[0], real_start, real_stop)
        local = real.new_zeros((per_rank, *shape[1:]))
        local[real_start - start : real_stop - start] = real
        out[unit.megatron_suffixes[0]] = local
    elif unit.kind == "qkv":
        kinds = ("weight", "bias") if arch.qkv_bias else ("weight",)
        for suffix, kind in zip(unit.megatron_suffixes, kinds, strict=True):
            q, k, v = (
                _rows_of(source, next(n for n in names if n.endswith(f"{p}_proj.{kind}")), tp_rank, tp_size)
                for p in "qkv"
            )
            out[suffix] = _qkv_fuse(arch, q, k, v, tp_size).contiguous()
    elif unit.kind == "fc1":
        gate, up = (_rows_of(source, name, tp_rank, tp_size) for name in names[:2])
        out[unit.megatron_suffixes[0]] = torch.cat([gate, up])
    elif unit.kind in ("proj", "fc2"):
        columns = _rows(source.shape(names[0])[1], tp_rank, tp_size)
        out[unit.megatron_suffixes[0]] = source.read_columns(
            names[0], columns.start, columns.stop
        ).contiguous()
    else:  # norms and the value head: replicated on every TP rank
        for suffix, name in zip(unit.megatron_suffixes, names, strict=True):
            out[suffix] = source.read(name).clone()
    return out


def _rows_of(source: HFSource, name: str, tp_rank: int, tp_size: int) -> torch.Tensor:
    rows = _rows(source.shape(name)[0], tp_rank, tp_size)
    return source.read_rows(name, rows.start, rows.stop)


@dataclass(frozen=True)
class HFShard:
    """One TP rank's piece of one HF parameter: ``full[index]`` where ``index`` cuts ``[start, stop)`` along ``dim``.

    ``dim is None`` means the rank holds the whole tensor (replicated). For vocab-parallel
    tensors ``[start, stop)`` covers only the rank's real (non-padding) rows, which is the even
    split ``[r*V/t, (r+1)*V/t)`` whenever no padding is needed.
    """

    tensor: torch.Tensor
    dim: int | None
    start: int
    stop: int

    def index(self) -> tuple[slice, ...]:
        """The tensor index of this piece in the full HF parameter."""
        if self.dim is None:
            return (slice(None),)
        return (*(slice(None),) * self.dim, slice(self.start, self.stop))


def megatron_to_hf_shards(
    arch: DecoderArch,
    unit: Unit,
    local: Mapping[str, torch.Tensor],
    *,
    tp_rank: int,
    tp_size: int,
    vocab_multiple: int = 1,
) -> dict[str, HFShard]:
    """TP rank ``tp_rank``'s HF pieces of ``unit`` from its megatron tensors (by megatron suffix).

    Pieces are views of ``local`` where the layout allows (norms, gate/up halves, real vocab
    rows, q/k/v when the rank holds a single key/value group); otherwise (row-parallel column
    slices are views too, just not contiguous; q/k/v of several groups) fresh copies. Treat
    them as read-only.
    """
    shapes = hf_shapes(arch, unit)
    names = unit.hf_names
    out: dict[str, HFShard] = {}
    if unit.kind in ("embedding", "output"):
        start, real_start, real_stop = _vocab_rows(arch, tp_rank, tp_size, vocab_multiple)
        tensor = local[unit.megatron_suffixes[0]][real_start - start : real_stop - start]
        out[names[0]] = HFShard(tensor, 0, real_start, real_stop)
    elif unit.kind == "qkv":
        kinds = ("weight", "bias") if arch.qkv_bias else ("weight",)
        for suffix, kind in zip(unit.megatron_suffixes, kinds, strict=True):
            for proj, piece in zip("qkv", _qkv_split(arch, local[suffix], tp_size), strict=True):
                name = next(n for n in names if n.endswith(f"{proj}_proj.{kind}"))
                rows = _rows(shapes[name][0], tp_rank, tp_size)
                out[name] = HFShard(piece, 0, rows.start, rows.stop)
    elif unit.kind == "fc1":
        fused = local[unit.megatron_suffixes[0]]
        half = fused.shape[0] // 2
        rows = _rows(arch.intermediate_size, tp_rank, tp_size)
        out[names[0]] = HFShard(fused[:half], 0, rows.start, rows.stop)
        out[names[1]] = HFShard(fused[half:], 0, rows.start, rows.stop)
    elif unit.kind in ("proj", "fc2"):
        cols = _rows(shapes[names[0]][1], tp_rank, tp_size)
        out[names[0]] = HFShard(local[unit.megatron_suffixes[0]], 1, cols.start, cols.stop)
    else:
        for suffix, name in zip(unit.megatron_suffixes, names, strict=True):
            out[name] = HFShard(local[suffix], None, 0, shapes[name][0])
    return {name: out[name] for name in names}  # HF order (q/k/v weights and biases interleave)


def megatron_to_hf(
    arch: DecoderArch,
    unit: Unit,
    per_rank: Sequence[Mapping[str, torch.Tensor]],
    *,
    vocab_multiple: int = 1,
) -> dict[str, torch.Tensor]:
    """The full HF tensors of ``unit`` from every TP rank's megatron tensors (``per_rank[r]`` is rank ``r``'s).

    Replicated tensors are taken from rank 0. Results are fresh tensors in HF order.
    """
    tp_size = len(per_rank)
    pieces = [
        megatron_to_hf_shards(arch, unit, local, tp_rank=rank, tp_size=tp_size, vocab_multiple=vocab_multiple)
        for rank, local in enumerate(per_rank)
    ]
    out: dict[str, torch.Tensor] = {}
    for name in unit.hf_names:
        first = pieces[0][name]
        if first.dim is None:
            out[name] = first.tensor.clone()
        else:
            out[name] = torch.cat([rank_pieces[name].tensor for rank_pieces in pieces], dim=first.dim)
    return out


def megatron_local_shapes(
    arch: DecoderArch, unit: Unit, *, tp_size: int, vocab_multiple: int = 1
) -> dict[str, tuple[int, ...]]:
    """The shape of each of ``unit``'s megatron tensors on any one TP rank (by megatron suffix).

    Derived by converting meta tensors of the HF shapes, so it can never disagree with
    :func:`hf_to_megatron`. Lets a rank that does not own a unit (another pipeline stage)
    allocate the buffers it receives the unit into.
    """
    meta = {name: torch.empty(shape, device="meta") for name, shape in hf_shapes(arch, unit).items()}
    converted = hf_to_megatron(arch, unit, meta, tp_rank=0, tp_size=tp_size, vocab_multiple=vocab_multiple)
    return {suffix: tuple(tensor.shape) for suffix, tensor in converted.items()}
