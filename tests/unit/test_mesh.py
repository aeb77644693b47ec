"""Device meshes: Megatron training order and the 3D-HybridEngine generation regrouping."""

import itertools

import pytest

from hybridflow.mesh import DeviceMesh, MeshError

pytestmark = pytest.mark.unit


def test_training_layout_follows_megatron_order() -> None:
    mesh = DeviceMesh.training(8, pp=2, tp=2)
    assert (mesh.pp_size, mesh.tp_size, mesh.dp_size) == (2, 2, 2)
    # rank = tp + t * (dp + d * pp)
    assert [(c.pp, c.dp, c.tp) for c in mesh.coords] == [
        (0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1), (1, 0, 0), (1, 0, 1), (1, 1, 0), (1, 1, 1),
    ]  # fmt: skip
    assert mesh.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert mesh.groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert mesh.groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert mesh.output_rank_of_dp() == [4, 6]


def test_layout_that_does_not_divide_is_rejected() -> None:
    with pytest.raises(MeshError, match="does not divide the group's 6 ranks"):
        DeviceMesh.training(6, tp=4)


def test_design_example_generation_groups() -> None:
    """DESIGN.md: 8 ranks, train 1-4-2 -> generate 1-2-2-2."""
    train = DeviceMesh.training(8, pp=1, tp=4)
    gen = DeviceMesh.generation(train, pp=1, tp=2)
    assert gen.groups("tp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert gen.groups("micro_dp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert gen.dp_size == 4
    assert all(c.micro_dp_size == 2 for c in gen.coords)


def _train_slice(train: DeviceMesh, rank: int) -> set[tuple[int, int]]:
    """(layer-block, tp-block) cells of a p*t grid that a training rank holds."""
    c = train.coord(rank)
    return {(c.pp, c.tp)}


def _gen_slice(train: DeviceMesh, gen: DeviceMesh, rank: int) -> set[tuple[int, int]]:
    c = gen.coord(rank)
    pp_stride, tp_stride = train.pp_size // gen.pp_size, train.tp_size // gen.tp_size
    return {
        (c.pp * pp_stride + i, c.tp * tp_stride + j)
        for i, j in itertools.product(range(pp_stride), range(tp_stride))
    }


@pytest.mark.parametrize(("p", "t"), [(p, t) for p in (1, 2) for t in (1, 2, 4, 8) if p * t <= 8])
def test_every_training_shard_lies_inside_its_generation_shard(p: int, t: int) -> None:
    train = DeviceMesh.training(8, pp=p, tp=t)
    for t_g in [x for x in (1, 2, 4, 8) if t % x == 0]:
        for p_g in [x for x in (1, 2) if p % x == 0]:
            gen = DeviceMesh.generation(train, pp=p_g, tp=t_g)
            d_g = (p * t) // (p_g * t_g)
            micro = gen.groups("micro_dp")
            assert all(len(g) == d_g for g in micro)
            assert len(gen.groups("tp")[0]) == t_g
            for rank in range(8):
                assert _train_slice(train, rank) <= _gen_slice(train, gen, rank)
            for group in micro:
                # the micro-DP group's training shards exactly tile one generation shard
                covered = set().union(*(_train_slice(train, r) for r in group))
                assert covered == _gen_slice(train, gen, group[0])
                assert {train.coord(r).dp for r in group} == {train.coord(group[0]).dp}


def test_generation_sizes_must_divide_training_sizes() -> None:
    with pytest.raises(MeshError, match="must divide"):
        DeviceMesh.generation(DeviceMesh.training(8, tp=4), tp=3)


def test_unknown_axis() -> None:
    with pytest.raises(MeshError, match="unknown mesh axis"):
        DeviceMesh.data_parallel(2).groups("ep")


def test_fsdp_generation_layout_keeps_each_ranks_rows_in_its_block() -> None:
    from hybridflow.resharding.fsdp import strided_tp_ranks

    mesh = DeviceMesh.fsdp_generation(8, tp=2)
    assert (mesh.pp_size, mesh.tp_size, mesh.dp_size) == (1, 2, 4)
    # Rank r holds rows [r/8, (r+1)/8): inside generation block r // 4 of 2.
    assert tuple(c.tp for c in mesh.coords) == strided_tp_ranks(8, 2) == (0, 0, 0, 0, 1, 1, 1, 1)
    assert mesh.groups("tp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert mesh.output_rank_of_dp() == [0, 1, 2, 3]
    assert DeviceMesh.fsdp_generation(4, tp=4).groups("tp") == [[0, 1, 2, 3]]
    with pytest.raises(MeshError, match="3 does not divide the group's 8 ranks"):
        DeviceMesh.fsdp_generation(8, tp=3)
