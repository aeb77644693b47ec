"""The megatron backend's pure parts in one process: config validation, HF <-> megatron conversion
per TP rank, and the row alignment of the packed layout.

No process group and no megatron model: the conversions are checked against an independent
construction of megatron's fused layouts from the HF tensors. The multi-rank checks (the real
model, gathers, log-probs, training, checkpoints) live in
``tests/integration/test_megatron_backend_distributed.py``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from hybridflow.backends.megatron import DecoderArch, padded_vocab_size
from hybridflow.backends.megatron.convert import (
    Unit,
    hf_shapes,
    hf_to_megatron,
    megatron_local_shapes,
    megatron_to_hf,
    megatron_to_hf_shards,
    units,
)
from hybridflow.backends.megatron.pipeline import left_align, response_columns
from hybridflow.models import build_tiny_model, tiny_config

pytestmark = pytest.mark.unit


def arch_of(kind: str = "qwen2", *, heads: int = 4, kv_heads: int = 2, vocab: int = 384) -> DecoderArch:
    return DecoderArch.from_hf_config(
        tiny_config(kind, vocab, hidden=128, heads=heads, kv_heads=kv_heads)  # type: ignore[arg-type]
    )


def random_hf(arch: DecoderArch, unit: Unit, seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=generator) for name, shape in hf_shapes(arch, unit).items()}


# ------------------------------------------------------------------------------ config


def test_arch_reads_qwen2_and_llama_configs() -> None:
    qwen = arch_of("qwen2")
    assert (qwen.hidden_size, qwen.num_heads, qwen.num_kv_heads, qwen.head_dim, qwen.heads_per_group) == (
        128,
        4,
        2,
        32,
        2,
    )
    assert qwen.qkv_bias and qwen.vocab_size == 384 and qwen.rope_theta == 10_000.0
    assert not arch_of("llama").qkv_bias
    as_dict = tiny_config("qwen2", 384, hidden=128, heads=4, kv_heads=2).to_dict()
    assert DecoderArch.from_hf_config(as_dict) == qwen


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"tie_word_embeddings": True}, "tie_word_embeddings"),
        ({"model_type": "gpt2"}, "model_type"),
        ({"use_sliding_window": True}, "use_sliding_window"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, "rope_type"),
    ],
)
def test_arch_refuses_what_it_cannot_represent_naming_the_field(
    change: dict[str, object], field: str
) -> None:
    config = tiny_config("qwen2", 384).to_dict() | change
    with pytest.raises(ValueError, match=field):
        DecoderArch.from_hf_config(config)


def test_arch_refuses_llama_biases() -> None:
    config = tiny_config("llama", 384).to_dict() | {"attention_bias": True}
    with pytest.raises(ValueError, match="attention_bias"):
        DecoderArch.from_hf_config(config)


def test_parallel_sizes_must_split_heads_ffn_and_layers() -> None:
    arch = arch_of(kv_heads=2)
    arch.check_parallel(tp_size=2, pp_size=2)
    with pytest.raises(ValueError, match="num_key_value_heads=2"):
        arch.check_parallel(tp_size=4, pp_size=1)
    with pytest.raises(ValueError, match="num_hidden_layers=2"):
        arch.check_parallel(tp_size=1, pp_size=3)


def test_vocab_padding() -> None:
    assert padded_vocab_size(384, 2) == 384
    assert padded_vocab_size(385, 2) == 386
    assert padded_vocab_size(384, 2, multiple=128) == 512
    with pytest.raises(ValueError, match="tp_size=0"):
        padded_vocab_size(384, 0)


# ------------------------------------------------------------------------------ conversion units


def test_units_list_every_hf_parameter_in_state_dict_order() -> None:
    for kind, kv_heads in (("qwen2", 2), ("llama", 4)):
        model = build_tiny_model(kind, 384, hidden=128, heads=4, kv_heads=kv_heads)  # type: ignore[arg-type]
        arch = DecoderArch.from_hf_config(model.config)
        names = [name for unit in units(arch) for name in unit.hf_names]
        assert names == list(model.state_dict())
        shapes = {name: shape for unit in units(arch) for name, shape in hf_shapes(arch, unit).items()}
        assert shapes == {name: tuple(t.shape) for name, t in model.state_dict().items()}


def test_critic_units_swap_the_lm_head_for_the_value_head() -> None:
    names = [name for unit in units(arch_of(), value_head=True) for name in unit.hf_names]
    assert "lm_head.weight" not in names
    assert names[-2:] == ["value_head.weight", "value_head.bias"]


def test_layer_units_name_stage_local_megatron_parameters() -> None:
    qkv = next(unit for unit in units(arch_of()) if unit.kind == "qkv" and unit.layer == 1)
    assert qkv.megatron_names(first_layer=1) == (
        "decoder.layers.0.self_attention.linear_qkv.weight",
        "decoder.layers.0.self_attention.linear_qkv.bias",
    )
    assert qkv.section == "layer"


# ------------------------------------------------------------------------------ conversion


def expected_fused_qkv(
    arch: DecoderArch, hf: dict[str, torch.Tensor], rank: int, tp: int, kind: str
) -> torch.Tensor:
    """Megatron's layout written out head by head: for each of the rank's groups, its q heads, k, v."""
    d, per = arch.head_dim, arch.heads_per_group
    q, k, v = (hf[next(n for n in hf if n.endswith(f"{p}_proj.{kind}"))] for p in "qkv")
    groups = arch.num_kv_heads // tp
    rows = []
    for group in range(rank * groups, (rank + 1) * groups):
        for head in range(group * per, (group + 1) * per):
            rows.append(q[head * d : (head + 1) * d])
        rows.append(k[group * d : (group + 1) * d])
        rows.append(v[group * d : (group + 1) * d])
    return torch.cat(rows)


@pytest.mark.parametrize(
    ("kind", "kv_heads", "tp"), [("qwen2", 2, 1), ("qwen2", 2, 2), ("llama", 4, 4), ("qwen2", 1, 1)]
)
def test_fused_qkv_is_megatrons_interleaved_group_layout(kind: str, kv_heads: int, tp: int) -> None:
    arch = arch_of(kind, kv_heads=kv_heads)
    unit = next(unit for unit in units(arch) if unit.kind == "qkv")
    hf = random_hf(arch, unit)
    for rank in range(tp):
        local = hf_to_megatron(arch, unit, hf, tp_rank=rank, tp_size=tp)
        assert torch.equal(
            local["self_attention.linear_qkv.weight"], expected_fused_qkv(arch, hf, rank, tp, "weight")
        )
        if arch.qkv_bias:
            assert torch.equal(
                local["self_attention.linear_qkv.bias"], expected_fused_qkv(arch, hf, rank, tp, "bias")
            )


def test_fused_fc1_is_gate_rows_then_up_rows_of_the_rank() -> None:
    arch = arch_of()
    unit = next(unit for unit in units(arch) if unit.kind == "fc1")
    hf = random_hf(arch, unit)
    gate, up = hf[unit.hf_names[0]], hf[unit.hf_names[1]]
    local = hf_to_megatron(arch, unit, hf, tp_rank=1, tp_size=2)["mlp.linear_fc1.weight"]
    assert torch.equal(local, torch.cat([gate[64:], up[64:]]))


@pytest.mark.parametrize(("kind", "kv_heads", "tp"), [("qwen2", 2, 2), ("llama", 4, 4), ("qwen2", 2, 1)])
def test_round_trip_is_bit_exact_and_shards_are_even_hf_slices(kind: str, kv_heads: int, tp: int) -> None:
    arch = arch_of(kind, kv_heads=kv_heads)
    for index, unit in enumerate(units(arch, value_head=False) + units(arch, value_head=True)[-1:]):
        hf = random_hf(arch, unit, seed=index)
        per_rank = [hf_to_megatron(arch, unit, hf, tp_rank=rank, tp_size=tp) for rank in range(tp)]
        shapes = megatron_local_shapes(arch, unit, tp_size=tp)
        assert all({s: tuple(t.shape) for s, t in local.items()} == shapes for local in per_rank)
        back = megatron_to_hf(arch, unit, per_rank)
        assert list(back) == list(unit.hf_names)
        assert all(torch.equal(back[name], hf[name]) for name in hf), unit
        for rank, local in enumerate(per_rank):
            for name, shard in megatron_to_hf_shards(arch, unit, local, tp_rank=rank, tp_size=tp).items():
                assert torch.equal(shard.tensor, hf[name][shard.index()]), (name, rank)
                if shard.dim is not None:
                    width = hf[name].shape[shard.dim] // tp
                    assert (shard.start, shard.stop) == (rank * width, (rank + 1) * width), name


@pytest.mark.parametrize(("kind", "kv_heads", "tp"), [("qwen2", 2, 2), ("llama", 4, 4), ("qwen2", 2, 1)])
def test_each_rank_reads_only_its_pieces_from_the_files_and_gets_the_same_tensors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str, kv_heads: int, tp: int
) -> None:
    """The loader's source (safetensors rows and row-chunked columns) gives what full tensors give."""
    from safetensors.torch import save_file

    from hybridflow.models import safetensors_rows
    from hybridflow.models.safetensors_rows import SafetensorsRows

    monkeypatch.setattr(safetensors_rows, "READ_CHUNK_BYTES", 1024)  # several chunks per tensor
    arch = arch_of(kind, kv_heads=kv_heads, vocab=390)  # 390: padded vocab rows too
    all_units = units(arch, value_head=False)
    tensors = {}
    for index, unit in enumerate(all_units):
        tensors.update({name: t.to(torch.bfloat16) for name, t in random_hf(arch, unit, seed=index).items()})
    save_file(tensors, tmp_path / "model.safetensors")
    reader = SafetensorsRows(tmp_path)
    largest_read = 0
    original = reader.read_rows

    def counted(name: str, start: int, stop: int) -> torch.Tensor:
        nonlocal largest_read
        piece = original(name, start, stop)
        largest_read = max(largest_read, piece.nbytes)
        return piece

    reader.read_rows = counted  # type: ignore[method-assign]
    for unit in all_units:
        for rank in range(tp):
            expected = hf_to_megatron(arch, unit, tensors, tp_rank=rank, tp_size=tp, vocab_multiple=128)
            got = hf_to_megatron(arch, unit, reader, tp_rank=rank, tp_size=tp, vocab_multiple=128)
            assert got.keys() == expected.keys()
            assert all(torch.equal(got[k], expected[k]) for k in got), (unit, rank)
    embedding = tensors["model.embed_tokens.weight"]
    if tp > 1:  # no read holds a whole split tensor: the embedding is read by the rank's rows
        per_rank_rows = padded_vocab_size(arch.vocab_size, tp, 128) // tp
        assert largest_read <= per_rank_rows * embedding[0].nbytes < embedding.nbytes


def test_vocab_padding_rows_are_zero_and_never_exported() -> None:
    arch = arch_of(vocab=384)
    unit = units(arch)[0]
    hf = random_hf(arch, unit)
    per_rank = [
        hf_to_megatron(arch, unit, hf, tp_rank=rank, tp_size=2, vocab_multiple=128) for rank in range(2)
    ]
    first, second = (local["embedding.word_embeddings.weight"] for local in per_rank)
    assert first.shape == second.shape == (256, 128)
    assert torch.equal(first, hf["model.embed_tokens.weight"][:256])
    assert torch.equal(second[:128], hf["model.embed_tokens.weight"][256:]) and not second[128:].any()
    shard = megatron_to_hf_shards(arch, unit, per_rank[1], tp_rank=1, tp_size=2, vocab_multiple=128)
    assert (shard["model.embed_tokens.weight"].start, shard["model.embed_tokens.weight"].stop) == (256, 384)
    back = megatron_to_hf(arch, unit, per_rank, vocab_multiple=128)
    assert torch.equal(back["model.embed_tokens.weight"], hf["model.embed_tokens.weight"])


# ------------------------------------------------------------------------------ packed layout


def test_left_align_rotates_each_row_to_start_at_its_first_real_token() -> None:
    input_ids = torch.tensor([[0, 0, 5, 6, 7, 0], [9, 8, 7, 6, 0, 0], [0, 0, 0, 4, 3, 2]])
    mask = (input_ids != 0).long()
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    aligned, shift = left_align(input_ids, mask, positions)
    assert shift.tolist() == [2, 0, 3]
    assert aligned.tolist() == [[5, 6, 7, 0, 0, 0], [9, 8, 7, 6, 0, 0], [4, 3, 2, 0, 0, 0]]
    # The response is the last 2 columns; token j is predicted by aligned column T - R - 1 + j - shift.
    assert response_columns(shift, seq_len=6, response_len=2).tolist() == [[1, 2], [3, 4], [0, 1]]


def test_left_align_refuses_gaps_and_foreign_positions() -> None:
    gap = torch.tensor([[0, 5, 0, 6]])
    with pytest.raises(ValueError, match="contiguous"):
        left_align(gap, (gap != 0).long(), torch.zeros_like(gap))
    ids = torch.tensor([[0, 5, 6, 7]])
    with pytest.raises(ValueError, match="position_ids"):
        left_align(ids, (ids != 0).long(), torch.arange(4).unsqueeze(0))
