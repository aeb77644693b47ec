"""FSDP2 row shards -> generation TP blocks (pure): the plan, simulated on numbered tensors, and its bytes."""

from __future__ import annotations

import pytest
import torch

from hybridflow.resharding import DecoderSpec, ReshardingError, decoder_layout
from hybridflow.resharding.fsdp import (
    contiguous_tp_ranks,
    fsdp_generation_plan,
    fsdp_rows,
    strided_tp_ranks,
)

pytestmark = pytest.mark.unit

SPEC = DecoderSpec(
    arch="qwen2",
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=8,
    num_kv_heads=8,
    head_dim=8,
    rms_norm_eps=1e-6,
    rope_theta=10_000.0,
    max_position_embeddings=512,
    qkv_bias=True,
)
LAYOUT = decoder_layout(SPEC)


def test_fsdp_rows_follow_torch_chunk() -> None:
    for rows, world in ((10, 4), (8, 8), (3, 4), (128, 2)):
        chunks = torch.arange(rows).chunk(world)
        for rank in range(world):
            start, stop = fsdp_rows(rows, world, rank)
            expected = chunks[rank].tolist() if rank < len(chunks) else []
            assert list(range(start, stop)) == expected


@pytest.mark.parametrize(("world", "t_g"), [(2, 1), (2, 2), (4, 2), (8, 2), (8, 4)])
@pytest.mark.parametrize("mapping", [contiguous_tp_ranks, strided_tp_ranks])
def test_every_rank_assembles_exactly_its_generation_block(world: int, t_g: int, mapping: object) -> None:
    tp_ranks = mapping(world, t_g)  # type: ignore[operator]
    plan = fsdp_generation_plan(LAYOUT, world, t_g, tp_ranks)
    full = {p.name: torch.arange(p.numel, dtype=torch.float32).view(p.shape) for p in LAYOUT}
    for rank in range(world):
        for index, param in enumerate(LAYOUT.params):
            want = plan.generation[rank][index]
            block = torch.full(want.shape, -1.0)
            for piece in plan.pieces[index]:
                if piece.dst != rank:
                    continue
                rows = full[param.name][piece.row_start : piece.row_stop]
                source = rows if piece.cols is None else rows[:, piece.cols[0] : piece.cols[1]]
                offset = want.start if want.dim == 0 else 0
                block[piece.row_start - offset : piece.row_stop - offset] = source
            torch.testing.assert_close(block, full[param.name][want.index()])


def test_a_rank_receives_its_block_minus_what_it_holds_never_the_whole_model() -> None:
    world, t_g = 8, 2
    strided = fsdp_generation_plan(LAYOUT, world, t_g, strided_tp_ranks(world, t_g))
    contiguous = fsdp_generation_plan(LAYOUT, world, t_g, contiguous_tp_ranks(world, t_g))
    model = LAYOUT.total_bytes
    for rank in range(world):
        assert strided.generation_bytes(rank) < model
        # Strided: each rank's rows lie inside its block, so row-split parameters cost 1/t_g - 1/d.
        row_split = sum(p.numel for p in LAYOUT if p.split_dim == 0) * LAYOUT.itemsize
        assert strided.bytes_received(rank) >= row_split * (1 / t_g - 1 / world) - 1
        assert strided.bytes_received(rank) < model / t_g
    assert sum(map(strided.bytes_received, range(world))) < sum(map(contiguous.bytes_received, range(world)))
    single = fsdp_generation_plan(LAYOUT, world, 1, (0,) * world)
    assert single.bytes_received(0) == model * (world - 1) // world  # t_g = 1: all-gather of the model


def test_bad_layouts_are_refused() -> None:
    with pytest.raises(ReshardingError, match="must divide"):
        fsdp_generation_plan(LAYOUT, 4, 3, (0, 1, 2, 0))
    with pytest.raises(ReshardingError, match="tp_ranks"):
        fsdp_generation_plan(LAYOUT, 2, 2, (0, 0, 1))
