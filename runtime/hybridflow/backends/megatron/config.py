"""The architecture facts of an HF Qwen2/Llama checkpoint, and the megatron-core config built from them.

:class:`DecoderArch` is read once from an HF ``config.json`` (or a transformers config object)
and validated there, so an unsupported checkpoint fails at load with a message naming the
field, not deep inside megatron. Everything else in this backend (the model builder, the weight
conversion, the vocab-parallel log-softmax) takes its sizes from it.

What maps onto megatron-core's ``TransformerConfig`` and ``GPTModel`` arguments
(:func:`transformer_config`, :func:`gpt_model_kwargs`):

=========================  ====================================================================
HF                         megatron-core
=========================  ====================================================================
RMSNorm, ``rms_norm_eps``  ``normalization="RMSNorm"``, ``layernorm_epsilon``
SwiGLU MLP                 ``gated_linear_unit=True``, ``activation_func=silu``
RoPE, ``rope_theta``       ``position_embedding_type="rope"``, ``rotary_base``, non-interleaved
                           (HF's ``rotate_half``), ``rotary_percent=1``
GQA                        ``num_query_groups = num_key_value_heads``
head_dim                   ``kv_channels``
q/k/v bias (Qwen2)         ``add_qkv_bias=True``; no other linear has a bias
                           (``add_bias_linear=False``)
untied lm_head             ``share_embeddings_and_output_weights=False``
=========================  ====================================================================

Not supported, refused by :meth:`DecoderArch.from_hf_config`: tied embeddings (Qwen2.5 0.5B/1.5B;
the resharding layout refuses them too), RoPE scaling, sliding-window attention, Llama's
``attention_bias`` / ``mlp_bias`` (megatron-core's ``add_bias_linear`` would add biases to every
linear layer, which no Llama checkpoint has).

Kernels: every fusion is off (``bias_activation_fusion``, ``masked_softmax_fusion``,
``apply_rope_fusion``, ``gradient_accumulation_fusion``...) and the layer spec is
``get_gpt_layer_local_spec`` (megatron-core's own modules, no Transformer Engine or Apex), so
the same model builds wherever megatron-core imports. On GPUs that leaves speed on the table
(TE's fused attention); the spec is one place to change when that matters.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

__all__ = ["DecoderArch", "padded_vocab_size"]

Arch = Literal["qwen2", "llama"]


def padded_vocab_size(vocab_size: int, tp_size: int, multiple: int = 1) -> int:
    """``vocab_size`` rounded up to a multiple of ``multiple * tp_size``: the rows of megatron's
    vocab-parallel embedding and output layer.

    Megatron-LM pads to ``make_vocab_size_divisible_by`` (128) times the TP size; the default
    here is 1, i.e. the least padding that splits evenly. With a vocabulary that the TP size
    divides (every real checkpoint, and the tiny test models), that means no padding at all and
    TP rank ``r`` holds exactly the HF rows ``[r*V/t, (r+1)*V/t)``, the even split the
    resharding layout (:mod:`hybridflow.resharding.layout`) assumes. Padding rows are zero, are
    masked out of every softmax (:mod:`~hybridflow.backends.megatron.logprobs`) and are never
    exported.
    """
    if vocab_size < 1 or tp_size < 1 or multiple < 1:
        raise ValueError(
            f"vocab_size={vocab_size}, tp_size={tp_size} and multiple={multiple} must all be positive"
        )
    unit = multiple * tp_size
    return -(-vocab_size // unit) * unit


@dataclass(frozen=True)
class DecoderArch:
    """A Qwen2/Llama decoder's sizes, validated for this backend."""

    arch: Arch
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

    @property
    def heads_per_group(self) -> int:
        """Query heads sharing one key/value head (1 without GQA)."""
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_hf_config(cls, config: Any) -> DecoderArch:
        """Read a transformers ``Qwen2Config``/``LlamaConfig`` or the dict of a ``config.json``.

        Raises ``ValueError`` naming the field for an architecture this backend cannot represent
        exactly (see the module docstring).
        """

        def get(key: str, default: Any = None) -> Any:
            return config.get(key, default) if isinstance(config, dict) else getattr(config, key, default)

        model_type = get("model_type")
        if model_type not in ("qwen2", "llama"):
            raise ValueError(
                f"model_type={model_type!r} is not supported by the megatron backend; allowed: qwen2, llama"
            )
        if get("tie_word_embeddings", False):
            raise ValueError(
                "tie_word_embeddings=True is not supported by the megatron backend (nor by resharding); "
                "use a checkpoint with a separate lm_head"
            )
        rope = get("rope_parameters") or get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ValueError(
                f"rope_type={rope_type!r} is not supported by the megatron backend; allowed: default"
            )
        theta = rope.get("rope_theta", get("rope_theta"))
        if theta is None:
            raise ValueError("the config has no rope_theta")
        if model_type == "qwen2" and get("use_sliding_window", False):
            raise ValueError("use_sliding_window=True is not supported by the megatron backend")
        if model_type == "llama":
            for field in ("attention_bias", "mlp_bias"):
                if get(field, False):
                    raise ValueError(
                        f"{field}=True is not supported by the megatron backend: megatron-core cannot give "
                        "the Llama projections biases without giving them to every linear layer"
                    )
        heads = int(get("num_attention_heads"))
        kv_heads = int(get("num_key_value_heads") or heads)
        hidden = int(get("hidden_size"))
        head_dim = int(get("head_dim") or hidden // heads)
        if heads % kv_heads:
            raise ValueError(f"num_key_value_heads={kv_heads} must divide num_attention_heads={heads}")
        return cls(
            arch=model_type,
            vocab_size=int(get("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(get("intermediate_size")),
            num_layers=int(get("num_hidden_layers")),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(get("rms_norm_eps")),
            rope_theta=float(theta),
            max_position_embeddings=int(get("max_position_embeddings")),
            qkv_bias=model_type == "qwen2",
        )

    @classmethod
    def from_directory(cls, path: str | Path) -> DecoderArch:
        """Read ``config.json`` of a local HF model directory (never a model hub)."""
        config_file = Path(path) / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(
                f"{path} is not a Hugging Face model directory (no config.json); models load from a "
                "local path or volume, never from a model hub"
            )
        return cls.from_hf_config(json.loads(config_file.read_text()))

    def check_parallel(self, *, tp_size: int, pp_size: int) -> None:
        """Raise ``ValueError`` unless a ``tp_size`` x ``pp_size`` layout splits this model evenly.

        TP splits whole key/value groups (each rank holds ``num_kv_heads / tp`` groups with their
        query heads; megatron's replicated-KV mode for ``tp > num_kv_heads`` is not supported,
        its weights do not split into HF slices) and the MLP's intermediate rows; PP gives every
        stage ``num_layers / pp`` consecutive layers.
        """
        if tp_size < 1 or pp_size < 1:
            raise ValueError(f"parallel sizes must be positive, got tp={tp_size} pp={pp_size}")
        if self.num_kv_heads % tp_size:
            raise ValueError(
                f"tensor parallel size {tp_size} must divide num_key_value_heads={self.num_kv_heads}"
            )
        if self.intermediate_size % tp_size:
            raise ValueError(
                f"tensor parallel size {tp_size} must divide intermediate_size={self.intermediate_size}"
            )
        if self.num_layers % pp_size:
            raise ValueError(
                f"pipeline parallel size {pp_size} must divide num_hidden_layers={self.num_layers}"
            )

    # -- megatron-core arguments ---------------------------------------------------------

    def transformer_config_kwargs(
        self,
        *,
        tp_size: int,
        pp_size: int,
        dtype: torch.dtype,
        variable_seq_lengths: bool,
        activation_checkpointing: bool = False,
    ) -> dict[str, Any]:
        """Keyword arguments of megatron-core's ``TransformerConfig`` for this decoder.

        Parameters are created on the current CUDA device and randomly initialised from
        megatron's RNG tracker before the checkpoint overwrites every one of them; see the
        comment on ``perform_initialization`` for why the initialisation cannot be skipped.
        ``dtype`` bfloat16 selects megatron's mixed precision (bf16 parameters, fp32
        main weights in the optimizer); float32 trains in fp32.

        ``activation_checkpointing`` (``spec.training.activationCheckpointing``): megatron's full
        recompute, every layer on its own (``recompute_granularity="full"``, ``"uniform"``, one
        layer per checkpoint): only each layer's input stays alive between forward and backward,
        and backward runs the layer's forward again under megatron's RNG tracker (so dropout, were
        there any, would draw the same masks). Selective recompute (the attention core only) saves
        less with these unfused kernels.
        """
        if dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"dtype={dtype} is not supported; use torch.float32 or torch.bfloat16")
        recompute: dict[str, Any] = (
            {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
            if activation_checkpointing
            else {}
        )
        return recompute | {
            "num_layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "ffn_hidden_size": self.intermediate_size,
            "num_attention_heads": self.num_heads,
            "num_query_groups": self.num_kv_heads,
            "kv_channels": self.head_dim,
            "normalization": "RMSNorm",
            "layernorm_epsilon": self.rms_norm_eps,
            "gated_linear_unit": True,
            "activation_func": torch.nn.functional.silu,
            "add_bias_linear": False,
            "add_qkv_bias": self.qkv_bias,
            "hidden_dropout": 0.0,
            "attention_dropout": 0.0,
            "bias_activation_fusion": False,
            "bias_dropout_fusion": False,
            "masked_softmax_fusion": False,
            "persist_layer_norm": False,
            "apply_rope_fusion": False,
            "gradient_accumulation_fusion": False,
            "use_cpu_initialization": False,
            # Random init that the checkpoint then overwrites: with perform_initialization=False
            # megatron-core (0.16) never marks its TP-sharded weights ``tensor_model_parallel``,
            # and its gradient norm then counts them on TP rank 0 only.
            "perform_initialization": True,
            "params_dtype": dtype,
            "pipeline_dtype": dtype,
            "bf16": dtype == torch.bfloat16,
            "tensor_model_parallel_size": tp_size,
            "pipeline_model_parallel_size": pp_size,
            "sequence_parallel": False,
            "variable_seq_lengths": variable_seq_lengths,
            # No MoE here; megatron refuses variable_seq_lengths with the default ("allgather")
            # MoE dispatcher even for dense models.
            "moe_token_dispatcher_type": "alltoall",
        }

    def gpt_model_kwargs(self, *, padded_vocab: int) -> dict[str, Any]:
        """Keyword arguments of megatron-core's ``GPTModel`` besides config, spec and stage flags."""
        return {
            "vocab_size": padded_vocab,
            "max_sequence_length": self.max_position_embeddings,
            "position_embedding_type": "rope",
            "rotary_base": int(self.rope_theta) if float(self.rope_theta).is_integer() else self.rope_theta,
            "rotary_percent": 1.0,
            "share_embeddings_and_output_weights": False,
            "parallel_output": True,
        }
