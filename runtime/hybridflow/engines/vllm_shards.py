"""Which HF tensor slices make up each of vLLM's tensor-parallel parameters (pure: no vLLM, no processes).

A vLLM engine with tensor parallel size ``t_g`` holds, on TP rank ``j``, one shard of every
weight, stored in vLLM's own modules: ``qkv_proj`` (q, k and v rows of the rank's heads, one
after the other), ``gate_up_proj`` (the rank's gate rows, then its up rows), ``o_proj`` and
``down_proj`` (the rank's input columns, row-parallel), ``embed_tokens`` and ``lm_head``
(vocab-parallel rows, padded), and the RMSNorm weights whole. This module states that mapping
on HF names, for the rollout's weight sync to hand each rank only its shard:

* :func:`vllm_shard_modules` lists, for a :class:`~hybridflow.resharding.layout.DecoderSpec`,
  every vLLM parameter (module path plus ``weight``/``bias``) with the HF blocks of TP rank
  ``j`` that fill it, in the order they are concatenated, and the parameter's row count
  (vocab-parallel parameters have padding rows beyond the blocks).
* The blocks are exactly :meth:`ModelLayout.shard` of a ``(1, t_g)`` layout at ``(0, j)``:
  vLLM cuts q/k/v by heads, gate/up by rows, o/down by columns and the vocabulary by
  contiguous rows, as Megatron does, so the generation shard a resharding plan delivers for
  generation TP rank ``j`` *is* vLLM rank ``j``'s shard, under HF names, with no further
  communication. :func:`check_vllm_split` refuses models where vLLM would cut differently
  (kv heads fewer than ``t_g``: vLLM replicates them; a vocabulary that is not a multiple of
  vLLM's padding unit times ``t_g``: vLLM's per-rank vocabulary ranges would not be equal
  contiguous splits).

The engine (:mod:`hybridflow.engines.vllm_engine`) copies the blocks of one vLLM parameter
into their rows of that parameter, one after the other (nothing is concatenated, and nothing of
full size is ever built when ``t_g > 1``).
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridflow.resharding.layout import Block, DecoderSpec, ModelLayout, ReshardingError, decoder_layout

__all__ = ["VOCAB_PADDING", "VLLMShardParam", "check_vllm_split", "vllm_shard_modules"]

VOCAB_PADDING = 64
"""vLLM pads a vocab-parallel embedding to a multiple of this before splitting it
(``DEFAULT_VOCAB_PADDING_SIZE``)."""

_FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
"""HF module -> (vLLM fused module, position inside it): vLLM's ``packed_modules_mapping``
for Qwen2/Llama, with the order of the pieces in the fused rows."""


@dataclass(frozen=True)
class VLLMShardParam:
    """One vLLM parameter on one TP rank: its name, the HF blocks that fill it, its row count.

    ``rows`` is the parameter's size along dim 0; it exceeds the blocks' total only for a
    vocab-parallel parameter whose padding rows vLLM keeps at zero.
    """

    name: str
    blocks: tuple[Block, ...]
    rows: int

    @property
    def vocab_parallel(self) -> bool:
        return self.name in ("model.embed_tokens.weight", "lm_head.weight")


def check_vllm_split(spec: DecoderSpec, tensor_parallel_size: int) -> None:
    """Raise :class:`ReshardingError` unless vLLM splits this model ``t_g`` ways as :mod:`layout` does."""
    t_g = tensor_parallel_size
    if t_g < 1:
        raise ReshardingError(f"tensor parallel size must be >= 1, got {t_g}")
    if t_g == 1:
        return
    if spec.num_kv_heads % t_g:
        raise ReshardingError(
            f"num_key_value_heads={spec.num_kv_heads} does not split {t_g} ways; vLLM would replicate "
            "kv heads across ranks, which the resharding layout does not model"
        )
    decoder_layout(spec).check(1, t_g)
    if spec.vocab_size % (VOCAB_PADDING * t_g):
        raise ReshardingError(
            f"vocab_size={spec.vocab_size} is not a multiple of {VOCAB_PADDING} x {t_g}: vLLM pads the "
            "vocabulary before splitting it, so its per-rank rows would not be equal contiguous splits"
        )


def _vllm_name(hf_name: str) -> tuple[str, int]:
    parts = hf_name.split(".")
    if len(parts) >= 2 and parts[-2] in _FUSED:
        fused, position = _FUSED[parts[-2]]
        return ".".join([*parts[:-2], fused, parts[-1]]), position
    return hf_name, 0


def vllm_shard_modules(spec: DecoderSpec, tensor_parallel_size: int, tp_rank: int) -> list[VLLMShardParam]:
    """Every vLLM parameter of TP rank ``tp_rank`` of ``tensor_parallel_size``, in HF order of first use."""
    check_vllm_split(spec, tensor_parallel_size)
    layout: ModelLayout = decoder_layout(spec)
    blocks = layout.shard(1, tensor_parallel_size, 0, tp_rank)
    grouped: dict[str, list[tuple[int, Block]]] = {}
    for block in blocks:
        name, position = _vllm_name(block.name)
        grouped.setdefault(name, []).append((position, block))
    params: list[VLLMShardParam] = []
    for name, members in grouped.items():
        ordered = tuple(block for _, block in sorted(members, key=lambda item: item[0]))
        rows = sum(block.shape[0] for block in ordered) if ordered[0].dim == 0 else ordered[0].shape[0]
        params.append(VLLMShardParam(name, ordered, rows))
    return params
