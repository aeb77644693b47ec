"""Resharding layouts and plans, without processes: slices, groups, sources and Table 2's figures.

The plans are also *simulated* here: each rank's generation tensors are assembled from the
training blocks its plan names, cut out of numbered tensors, and compared with the slice its
generation layout requires. The 8-rank gloo job (tests/integration/test_resharding.py) runs the
same plans for real.
"""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch

from hybridflow.mesh import DeviceMesh
from hybridflow.resharding import (
    DESIGNS,
    DecoderSpec,
    Design,
    ModelLayout,
    ReshardingError,
    TransitionPlan,
    build_plan,
    decoder_layout,
    hybridflow_plan,
    micro_dp_groups,
    table2,
    vanilla_plan,
)

pytestmark = pytest.mark.unit

WORLD = 8
# Small enough that simulating 66 plans x 8 ranks on numbered tensors takes a second, and
# every dimension still splits up to 8 ways (the allgather baseline's t*d) in whole heads.
SPEC = DecoderSpec(
    arch="qwen2",
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_layers=4,
    num_heads=8,
    num_kv_heads=8,
    head_dim=8,
    rms_norm_eps=1e-6,
    rope_theta=10_000.0,
    max_position_embeddings=512,
    qkv_bias=True,
)
LAYOUT = decoder_layout(SPEC)

TRAINING_LAYOUTS = [(p, t) for p in (1, 2) for t in (1, 2, 4, 8) if p * t <= WORLD]
TRANSITIONS = [
    (p, t, p_g, t_g)
    for p, t in TRAINING_LAYOUTS
    for p_g in (1, 2)
    if p % p_g == 0
    for t_g in (1, 2, 4, 8)
    if t % t_g == 0
]


def numbered(layout: ModelLayout) -> dict[str, torch.Tensor]:
    """Full parameters whose every element is distinct, so any misplaced element shows."""
    tensors, offset = {}, 0
    for param in layout:
        tensors[param.name] = torch.arange(offset, offset + param.numel, dtype=torch.float64).view(
            param.shape
        )
        offset += param.numel
    return tensors


FULL = numbered(LAYOUT)


# --------------------------------------------------------------------------- layout


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_layout_names_and_shapes_are_the_hf_state_dict(arch: str) -> None:
    from hybridflow.models import build_tiny_model

    model = build_tiny_model(arch, 384, hidden=64, layers=2, heads=2)  # type: ignore[arg-type]
    layout = decoder_layout(DecoderSpec.from_hf_config(model.config))
    state = model.state_dict()
    assert [param.name for param in layout] == list(state)
    assert all(param.shape == tuple(state[param.name].shape) for param in layout)


def test_llama_biases_follow_megatron_column_and_row_parallel_rules() -> None:
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        attention_bias=True,
        mlp_bias=True,
        tie_word_embeddings=False,
    )
    layout = decoder_layout(DecoderSpec.from_hf_config(config))
    split = {param.name.removeprefix("model.layers.0."): param.split_dim for param in layout}
    assert split["self_attn.q_proj.bias"] == 0 and split["self_attn.k_proj.bias"] == 0
    assert split["self_attn.o_proj.weight"] == 1 and split["self_attn.o_proj.bias"] is None
    assert split["mlp.up_proj.bias"] == 0 and split["mlp.down_proj.bias"] is None
    assert layout.param("model.layers.0.self_attn.k_proj.weight").shape == (32, 64)


@pytest.mark.parametrize(("p", "t"), TRAINING_LAYOUTS)
def test_layout_slices_tile_every_parameter_exactly(p: int, t: int) -> None:
    for param in LAYOUT:
        owners = {LAYOUT.stage(param, p)}
        assert len(owners) == 1
        stage = owners.pop()
        pieces = []
        for pp_rank in range(p):
            for tp_rank in range(t):
                index = LAYOUT.shard_index(param.name, p, t, pp_rank, tp_rank)
                assert (index is None) == (pp_rank != stage), param.name
                if index is not None:
                    pieces.append(FULL[param.name][index])
        if param.partitioned:
            assert param.split_dim is not None
            assert torch.equal(torch.cat(pieces, dim=param.split_dim), FULL[param.name]), param.name
        else:
            assert all(torch.equal(piece, FULL[param.name]) for piece in pieces), param.name


def test_stages_are_contiguous_layers_with_embedding_first_and_head_last() -> None:
    first = {param.name for param in LAYOUT.stage_params(2, 0)}
    last = {param.name for param in LAYOUT.stage_params(2, 1)}
    assert "model.embed_tokens.weight" in first and "lm_head.weight" in last and "model.norm.weight" in last
    assert {"model.layers.0.mlp.up_proj.weight", "model.layers.1.mlp.up_proj.weight"} <= first
    assert {"model.layers.2.mlp.up_proj.weight", "model.layers.3.mlp.up_proj.weight"} <= last


def test_attention_is_split_by_whole_heads() -> None:
    q = LAYOUT.param("model.layers.0.self_attn.q_proj.weight")
    assert (q.block(8, 3).start, q.block(8, 3).stop) == (3 * 8, 4 * 8)  # head 3's 8 rows
    spec = DecoderSpec(**{**SPEC.__dict__, "num_kv_heads": 2})
    with pytest.raises(
        ReshardingError,
        match=r"k_proj\.weight: dim 0 has size 16, which does not split 4 ways in units of 8",
    ):
        decoder_layout(spec).check(1, 4)
    with pytest.raises(ReshardingError, match="4 layers do not split into 3 pipeline stages"):
        LAYOUT.check(3, 1)


def test_unsupported_configs_are_refused_with_the_field() -> None:
    from transformers import LlamaConfig

    with pytest.raises(ReshardingError, match="tie_word_embeddings=True"):
        DecoderSpec.from_hf_config(LlamaConfig(tie_word_embeddings=True))
    with pytest.raises(ReshardingError, match="model_type='gpt2'"):
        DecoderSpec.from_hf_config(type("Config", (), {"model_type": "gpt2"})())


def test_partitioned_and_replicated_bytes_split_the_model() -> None:
    norms = (2 * SPEC.num_layers + 1) * SPEC.hidden_size * 4
    assert LAYOUT.replicated_bytes == norms
    assert LAYOUT.partitioned_bytes + LAYOUT.replicated_bytes == sum(param.numel for param in LAYOUT) * 4


# --------------------------------------------------------------------------- plans


def simulate(plan: TransitionPlan, rank: int) -> dict[str, torch.Tensor]:
    """A rank's generation tensors, assembled from the training blocks its plan names."""
    out = {}
    for want, sources in plan.rank(rank).generation:
        owned = {block for block in plan.rank(rank).training}
        for source in sources:
            holder = plan.rank(source.rank)
            assert source.block in holder.training, "a source block its holder does not hold"
            if source.rank != rank:
                assert any(m.src == source.rank for m in plan.rank(rank).receives), (
                    "a source it never receives"
                )
            else:
                assert source.block in owned
        pieces = [FULL[source.block.name][source.block.index()] for source in sources]
        out[want.name] = pieces[0] if want.dim is None else torch.cat(pieces, dim=want.dim)
    return out


def expected_generation(plan: TransitionPlan, rank: int) -> dict[str, torch.Tensor]:
    """What the generation layout requires of ``rank``, straight from the layout."""
    mesh, c = plan.generation_mesh, plan.generation_mesh.coord(rank)
    out = {}
    for param in LAYOUT.stage_params(mesh.pp_size, c.pp):
        index = LAYOUT.shard_index(param.name, mesh.pp_size, mesh.tp_size, c.pp, c.tp)
        assert index is not None
        out[param.name] = FULL[param.name][index]
    return out


PLANS = {
    (design, *transition): build_plan(
        design,
        LAYOUT,
        DeviceMesh.training(WORLD, pp=transition[0], tp=transition[1]),
        pp=transition[2],
        tp=transition[3],
    )
    for transition in TRANSITIONS
    for design in DESIGNS
}


def plan_id(key: tuple[Design, int, int, int, int]) -> str:
    design, p, t, p_g, t_g = key
    return f"{design}-p{p}t{t}-to-p{p_g}t{t_g}"


@pytest.mark.parametrize("key", list(PLANS), ids=plan_id)
def test_every_rank_assembles_exactly_its_generation_slice(key: tuple[Design, int, int, int, int]) -> None:
    plan = PLANS[key]
    for rank in range(WORLD):
        got = simulate(plan, rank)
        expected = expected_generation(plan, rank)
        assert list(got) == list(expected)
        assert all(torch.equal(got[name], expected[name]) for name in expected), rank


@pytest.mark.parametrize("transition", TRANSITIONS, ids=lambda x: "p{}t{}-to-p{}t{}".format(*x))
def test_hybridflow_training_shard_lies_inside_the_generation_shard(
    transition: tuple[int, int, int, int],
) -> None:
    plan = PLANS[("hybridflow", *transition)]
    for rank_plan in plan.ranks:
        generation = [want for want, _ in rank_plan.generation]
        for block in rank_plan.training:
            assert any(want.contains(block) for want in generation), (rank_plan.rank, block)
        # and its own blocks are read from itself, in place
        own_sources = {
            s.block for _, sources in rank_plan.generation for s in sources if s.rank == rank_plan.rank
        }
        assert own_sources == set(rank_plan.training)
        assert rank_plan.reuses_training


@pytest.mark.parametrize("key", list(PLANS), ids=plan_id)
def test_plan_figures_equal_table_2_with_m_the_partitioned_bytes(
    key: tuple[Design, int, int, int, int],
) -> None:
    design, p, t, p_g, t_g = key
    plan = PLANS[key]
    d = WORLD // (p * t)
    row = table2(design, p=p, t=t, d=d, p_g=p_g, t_g=t_g, model_bytes=LAYOUT.partitioned_bytes)
    for rank in range(WORLD):
        assert plan.bytes_received(rank).partitioned == row.traffic
        assert plan.peak_bytes(rank).partitioned == row.peak
        assert plan.redundant_bytes(rank).partitioned == row.redundant


@pytest.mark.parametrize("transition", TRANSITIONS, ids=lambda x: "p{}t{}-to-p{}t{}".format(*x))
def test_replicated_bytes_move_only_across_merged_stages(transition: tuple[int, int, int, int]) -> None:
    """Norms are replicated over TP: a rank fetches only the other training stages' norms of its generation stage, once."""
    p, _, p_g, _ = transition
    plan = PLANS[("hybridflow", *transition)]
    norms_of_stage = [
        sum(param.numel for param in LAYOUT.stage_params(p, stage) if not param.partitioned) * 4
        for stage in range(p)
    ]
    for rank in range(WORLD):
        own = plan.train.coord(rank).pp
        merged = range(own // (p // p_g) * (p // p_g), (own // (p // p_g) + 1) * (p // p_g))
        expected = sum(norms_of_stage[stage] for stage in merged if stage != own)
        assert plan.bytes_received(rank).replicated == expected
        assert plan.redundant_bytes(rank).replicated == 0
        assert plan.peak_total_bytes(rank) == plan.peak_bytes(rank) == plan.generation_bytes(rank)


@pytest.mark.parametrize("key", list(PLANS), ids=plan_id)
def test_messages_stay_inside_the_exchange_group_and_pair_up(key: tuple[Design, int, int, int, int]) -> None:
    plan = PLANS[key]
    sent = {m for rank_plan in plan.ranks for m in rank_plan.sends}
    received = {m for rank_plan in plan.ranks for m in rank_plan.receives}
    assert sent == received
    for rank_plan in plan.ranks:
        assert rank_plan.group in plan.groups and rank_plan.rank in rank_plan.group
        assert all(m.src in rank_plan.group and m.src != rank_plan.rank for m in rank_plan.receives)
        assert all(m.numel == plan.rank(m.src).training_numel(m.kind) for m in rank_plan.receives)


def test_design_example_groups() -> None:
    """DESIGN.md: 8 ranks, train 1-4-2 -> generate 1-2-2-2."""
    train = DeviceMesh.training(WORLD, pp=1, tp=4)
    gen = DeviceMesh.generation(train, pp=1, tp=2)
    plan = hybridflow_plan(LAYOUT, train, gen)
    assert plan.groups == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert micro_dp_groups(train, gen) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert plan.generation_mesh.groups("tp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    # rank 1 (training TP rank 1 of 4) holds generation TP slice 0 of 2: its own quarter and rank 0's
    rank1 = plan.rank(1)
    q = dict(rank1.generation)[LAYOUT.param("model.layers.0.self_attn.q_proj.weight").block(2, 0)]
    assert [source.rank for source in q] == [0, 1]
    assert [(m.src, m.kind) for m in rank1.receives] == [(0, "partitioned")]
    vanilla = vanilla_plan(LAYOUT, train, pp=1, tp=2)
    assert vanilla.groups == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert vanilla.generation_mesh.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_table_2_traffic_ratio_of_the_example_is_3_5() -> None:
    figures = {
        design: table2(design, p=1, t=4, d=2, p_g=1, t_g=2, model_bytes=LAYOUT.partitioned_bytes)
        for design in DESIGNS
    }
    assert figures["allgather"].traffic / figures["hybridflow"].traffic == Fraction(7, 2)
    assert figures["vanilla"].traffic / figures["hybridflow"].traffic == 3
    assert figures["hybridflow"].peak == Fraction(LAYOUT.partitioned_bytes, 2)


def test_layouts_that_do_not_fit_are_refused() -> None:
    train = DeviceMesh.training(WORLD, pp=1, tp=4)
    with pytest.raises(ReshardingError, match="must divide the training layout"):
        vanilla_plan(LAYOUT, train, pp=1, tp=8)
    with pytest.raises(ReshardingError, match="is not the HybridFlow regrouping"):
        hybridflow_plan(LAYOUT, train, DeviceMesh.training(WORLD, pp=1, tp=2))
    with pytest.raises(ReshardingError, match="design='zero'"):
        build_plan("zero", LAYOUT, train, pp=1, tp=1)  # type: ignore[arg-type]
