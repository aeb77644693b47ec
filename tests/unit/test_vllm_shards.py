"""vLLM's tensor-parallel parameters in HF terms (pure): which blocks fill each, in which order."""

from __future__ import annotations

import pytest

from hybridflow.engines.vllm_shards import check_vllm_split, vllm_shard_modules
from hybridflow.resharding import DecoderSpec, ReshardingError, decoder_layout

pytestmark = pytest.mark.unit

SPEC = DecoderSpec(
    arch="qwen2",
    vocab_size=384,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    rms_norm_eps=1e-6,
    rope_theta=10_000.0,
    max_position_embeddings=512,
    qkv_bias=True,
)


def by_name(t_g: int, rank: int) -> dict[str, object]:
    return {param.name: param for param in vllm_shard_modules(SPEC, t_g, rank)}


def test_fused_parameters_take_the_hf_blocks_in_vllm_order() -> None:
    params = by_name(2, 1)
    qkv = params["model.layers.0.self_attn.qkv_proj.weight"]
    assert [b.name.split(".")[-2] for b in qkv.blocks] == ["q_proj", "k_proj", "v_proj"]  # type: ignore[attr-defined]
    # rank 1 of 2: query heads 2-3 (rows 32-64), kv head 1 (rows 16-32)
    assert [(b.start, b.stop) for b in qkv.blocks] == [(32, 64), (16, 32), (16, 32)]  # type: ignore[attr-defined]
    assert qkv.rows == 32 + 16 + 16  # type: ignore[attr-defined]
    gate_up = params["model.layers.1.mlp.gate_up_proj.weight"]
    assert [(b.name.split(".")[-2], b.start, b.stop) for b in gate_up.blocks] == [  # type: ignore[attr-defined]
        ("gate_proj", 64, 128),
        ("up_proj", 64, 128),
    ]
    down = params["model.layers.1.mlp.down_proj.weight"]
    assert [(b.dim, b.start, b.stop) for b in down.blocks] == [(1, 64, 128)]  # type: ignore[attr-defined]
    assert down.rows == 64  # type: ignore[attr-defined]


def test_every_hf_block_is_used_once_and_the_ranks_cover_the_model() -> None:
    layout = decoder_layout(SPEC)
    for t_g in (1, 2):
        covered: dict[str, int] = {}
        for rank in range(t_g):
            for param in vllm_shard_modules(SPEC, t_g, rank):
                for block in param.blocks:
                    covered[block.name] = covered.get(block.name, 0) + block.numel
        for param in layout:
            replicas = t_g if not param.partitioned else 1
            assert covered[param.name] == param.numel * replicas


def test_norms_are_whole_and_vocab_rows_split_contiguously() -> None:
    params = by_name(2, 0)
    norm = params["model.layers.0.input_layernorm.weight"]
    assert norm.blocks[0].dim is None and norm.rows == 64  # type: ignore[attr-defined]
    head = params["lm_head.weight"]
    assert head.vocab_parallel and [(b.start, b.stop) for b in head.blocks] == [(0, 192)]  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"num_kv_heads": 1, "num_heads": 2, "head_dim": 32}, "num_key_value_heads=1"),
        ({"vocab_size": 320}, "vocab_size=320"),
    ],
)
def test_models_vllm_would_cut_differently_are_refused(change: dict[str, int], message: str) -> None:
    import dataclasses

    with pytest.raises(ReshardingError, match=message):
        check_vllm_split(dataclasses.replace(SPEC, **change), 2)
    check_vllm_split(dataclasses.replace(SPEC, **change), 1)  # one rank holds everything: no constraint
