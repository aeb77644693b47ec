"""vLLM's groups built from the generation layout's ranks (hybridflow.engines.vllm_groups)."""

from __future__ import annotations

import pytest

from hybridflow.engines.vllm_groups import mapped_group_ranks, vllm_rank_order
from hybridflow.mesh import DeviceMesh


def test_strided_generation_groups_become_vllms_consecutive_logical_groups() -> None:
    # t 4 d 2 -> t_g 2 (the paper's example): generation TP groups [0,2] [1,3] [4,6] [5,7].
    generation = DeviceMesh.generation(DeviceMesh.training(8, tp=4), tp=2)
    groups = generation.groups("tp")
    assert groups == [[0, 2], [1, 3], [4, 6], [5, 7]]
    order = vllm_rank_order(groups, 8)
    assert order == (0, 2, 1, 3, 4, 6, 5, 7)
    # vLLM asks for its TP groups as consecutive logical ranks, its DP/PP groups as singletons.
    assert mapped_group_ranks([[0, 1], [2, 3], [4, 5], [6, 7]], order) == groups
    assert mapped_group_ranks([[r] for r in range(8)], order) == [[r] for r in order]
    # Every rank computes the same order whatever order the groups come in.
    assert vllm_rank_order(list(reversed(groups)), 8) == order


def test_consecutive_groups_map_to_themselves() -> None:
    assert vllm_rank_order([[0, 1], [2, 3]], 4) == (0, 1, 2, 3)


@pytest.mark.parametrize(
    "groups, world, message",
    [
        ([[2, 0], [1, 3]], 4, r"group \[2, 0\] is not in ascending rank order"),
        ([[0, 1], [1, 2]], 4, r"do not cover each of the world's 4 ranks exactly once"),
        ([[0, 1], [2, 3]], 6, r"do not cover each of the world's 6 ranks exactly once"),
        ([[0, 1, 2], [3]], 4, r"differ in size"),
        ([], 4, r"none given"),
    ],
)
def test_groups_vllm_cannot_take_are_refused_with_the_group_named(
    groups: list[list[int]], world: int, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        vllm_rank_order(groups, world)


def test_a_group_that_would_not_ascend_after_mapping_is_refused() -> None:
    # A 4-rank group over the order (0, 2, 1, 3) would be [0, 2, 1, 3]: torch numbers its
    # members 0, 1, 2, 3 by rank, vLLM by position, and the two would disagree on ranks 1 and 2.
    with pytest.raises(ValueError, match=r"logical ranks \[0, 1, 2, 3\] maps to global ranks \[0, 2, 1, 3\]"):
        mapped_group_ranks([[0, 1, 2, 3]], (0, 2, 1, 3))
