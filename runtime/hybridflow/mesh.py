"""Device meshes: where each global rank of a worker group sits in its parallel layout.

A :class:`DeviceMesh` is an explicit table ``rank -> MeshCoord`` rather than a formula, because
the two layouts the actor uses order ranks differently:

* the training layout (:meth:`DeviceMesh.training`) follows Megatron's order: tensor-parallel
  rank varies fastest, then data-parallel, then pipeline stage;
  ``rank = tp + t * (dp + d * pp)``.
* the generation layout of the 3D-HybridEngine (:meth:`DeviceMesh.generation`) regroups the same
  ranks: generation TP/PP groups are taken at strides ``t/t_g`` and ``p/p_g`` and the ranks
  that end up holding the same generation shard form a *micro-DP group* of size
  ``d_g = p*t / (p_g*t_g)``. Each rank's training shard then lies inside its generation shard,
  so moving between the layouts is one all-gather inside each micro-DP group.

Transfer protocols (``protocols.py``) read only this table: which DP shard a rank receives
(``coord.dp``) and whether it holds outputs (``is_output_rank``: TP rank 0 of the last stage).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DeviceMesh", "MeshCoord", "MeshError"]


class MeshError(ValueError):
    """A layout that does not fit the group's world size or the divisibility rules."""


@dataclass(frozen=True)
class MeshCoord:
    """One rank's coordinates. ``micro_dp_*`` are non-trivial only in a generation layout."""

    pp: int
    tp: int
    dp: int
    micro_dp_rank: int = 0
    micro_dp_size: int = 1


@dataclass(frozen=True)
class DeviceMesh:
    """Parallel sizes plus the coordinates of every global rank (index = rank)."""

    pp_size: int
    tp_size: int
    dp_size: int
    coords: tuple[MeshCoord, ...]

    @property
    def world_size(self) -> int:
        return len(self.coords)

    # -- constructors --------------------------------------------------------------------

    @classmethod
    def data_parallel(cls, world_size: int) -> DeviceMesh:
        """Every rank is its own DP shard (FSDP, plain data parallel)."""
        return cls.training(world_size, pp=1, tp=1)

    @classmethod
    def training(cls, world_size: int, *, pp: int = 1, tp: int = 1) -> DeviceMesh:
        """Megatron order (tp fastest, then dp, then pp); ``dp = world / (pp * tp)``."""
        if pp < 1 or tp < 1:
            raise MeshError(f"parallel sizes must be >= 1, got pp={pp} tp={tp}")
        if world_size % (pp * tp):
            raise MeshError(
                f"pipeline x tensor parallel = {pp} x {tp} = {pp * tp} does not divide the "
                f"group's {world_size} ranks"
            )
        dp = world_size // (pp * tp)
        coords = tuple(
            MeshCoord(pp=rank // (tp * dp), tp=rank % tp, dp=(rank // tp) % dp) for rank in range(world_size)
        )
        return cls(pp_size=pp, tp_size=tp, dp_size=dp, coords=coords)

    @classmethod
    def generation(cls, train: DeviceMesh, *, pp: int = 1, tp: int = 1) -> DeviceMesh:
        """The HybridFlow generation layout ``p_g-t_g-d_g-d`` derived from a training layout.

        ``tp`` (t_g) must divide the training TP size t and ``pp`` (p_g) the training PP size p.
        A rank with training coordinates (pp_r, tp_r, dp_r) gets generation TP rank
        ``tp_r // (t/t_g)`` and generation PP rank ``pp_r // (p/p_g)``: it owns a contiguous
        block of its training slices. Its position among the ranks that own the *same* block
        (same dp_r, same generation tp/pp rank) is its micro-DP rank; those ``d_g`` ranks form
        the micro-DP group and become ``d_g`` generation DP replicas, so the generation layout
        has ``d * d_g`` DP ranks.

        With 8 ranks trained as p=1 t=4 d=2 and generated with t_g=2, generation TP groups are
        [0,2] [1,3] [4,6] [5,7] and micro-DP groups [0,1] [2,3] [4,5] [6,7].
        """
        t, p, d = train.tp_size, train.pp_size, train.dp_size
        if tp < 1 or pp < 1 or t % tp or p % pp:
            raise MeshError(
                f"generation layout pp={pp} tp={tp} must divide the training layout pp={p} tp={t}"
            )
        tp_stride, pp_stride = t // tp, p // pp
        micro_dp_size = tp_stride * pp_stride
        coords = []
        for c in train.coords:
            micro_rank = (c.pp % pp_stride) * tp_stride + (c.tp % tp_stride)
            coords.append(
                MeshCoord(
                    pp=c.pp // pp_stride,
                    tp=c.tp // tp_stride,
                    dp=c.dp * micro_dp_size + micro_rank,
                    micro_dp_rank=micro_rank,
                    micro_dp_size=micro_dp_size,
                )
            )
        return cls(pp_size=pp, tp_size=tp, dp_size=d * micro_dp_size, coords=tuple(coords))

    @classmethod
    def fsdp_generation(cls, world_size: int, *, tp: int) -> DeviceMesh:
        """The generation layout of an FSDP2 actor over ``world_size`` ranks at tensor parallel ``tp``.

        FSDP2 gives rank ``r`` the ``r``-th contiguous ``1/d`` of every parameter's rows, so with
        generation TP rank ``r // (d/t_g)`` each rank's rows lie inside its generation block
        wherever the block is a range of rows (HybridFlow's choice; the other parameters are
        split by columns or replicated, where no choice helps). Generation TP groups are then
        strided (``[0, 2], [1, 3]`` for 4 ranks at ``t_g = 2``), replica ``r % (d/t_g)``.
        """
        if tp < 1 or world_size % tp:
            raise MeshError(
                f"generation tensor parallel size {tp} does not divide the group's {world_size} ranks"
            )
        replicas = world_size // tp
        coords = tuple(MeshCoord(pp=0, tp=rank // replicas, dp=rank % replicas) for rank in range(world_size))
        return cls(pp_size=1, tp_size=tp, dp_size=replicas, coords=coords)

    # -- queries -------------------------------------------------------------------------

    def coord(self, rank: int) -> MeshCoord:
        return self.coords[rank]

    def is_output_rank(self, rank: int) -> bool:
        """Ranks whose results the controller collects: TP rank 0 of the last pipeline stage."""
        c = self.coords[rank]
        return c.tp == 0 and c.pp == self.pp_size - 1

    def output_rank_of_dp(self) -> list[int]:
        """For each DP rank (in order), the global rank whose output represents it."""
        found: dict[int, int] = {}
        for rank in range(self.world_size):
            if self.is_output_rank(rank):
                found.setdefault(self.coords[rank].dp, rank)
        return [found[dp] for dp in range(self.dp_size)]

    def groups(self, axis: str) -> list[list[int]]:
        """Ranks that differ only along ``axis`` (``"tp"``, ``"pp"``, ``"dp"`` or ``"micro_dp"``).

        For ``"micro_dp"`` these are the micro-DP groups of a generation layout; for ``"dp"`` in
        a generation layout they are whole generation DP groups.
        """
        if axis not in ("tp", "pp", "dp", "micro_dp"):
            raise MeshError(f"unknown mesh axis {axis!r}; allowed: tp, pp, dp, micro_dp")
        buckets: dict[tuple[int, ...], list[int]] = {}
        for rank, c in enumerate(self.coords):
            if axis == "tp":
                key: tuple[int, ...] = (c.pp, c.dp)
            elif axis == "pp":
                key = (c.tp, c.dp)
            elif axis == "dp":
                key = (c.pp, c.tp)
            else:
                key = (c.pp, c.tp, c.dp - c.micro_dp_rank)
            buckets.setdefault(key, []).append(rank)
        return sorted(buckets.values())

    def describe(self) -> str:
        return f"pp={self.pp_size} tp={self.tp_size} dp={self.dp_size} ({self.world_size} ranks)"
