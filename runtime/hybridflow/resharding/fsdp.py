"""FSDP2 (data-parallel sharded) -> a tensor-parallel generation layout: each rank gets only its shard.

FSDP2 keeps every parameter split by rows (``Shard(0)``, ``torch.chunk`` sizes) over all ``d``
ranks of the actor. A generation engine with tensor parallel size ``t_g`` wants, on a rank with
generation TP rank ``j``, block ``j`` of each parameter in the
:mod:`~hybridflow.resharding.layout` split (rows for column-parallel and vocab-parallel
parameters, columns for row-parallel ones, the whole tensor for the RMSNorm weights). The plan
(:func:`fsdp_generation_plan`, pure) intersects the two: rank ``s`` sends rank ``r`` exactly the
part of its rows that lies in ``r``'s generation block, nothing else. So a rank receives its
``1/t_g`` block minus what it holds already, never the whole model unless ``t_g = 1``; with the
generation TP rank ``j = r // (d/t_g)`` ("strided", HybridFlow's choice and the job's,
``DeviceMesh.fsdp_generation``: each rank's rows lie inside its generation block) a
column-parallel parameter costs ``(1/t_g - 1/d)`` of its bytes; with contiguous TP groups
(``j = r % t_g``, vLLM's default) the ranks with ``j != r // (d/t_g)`` receive a whole ``1/t_g``
block.

Execution (:class:`FSDPResharder`), per rank, collective over the actor's ranks in lockstep:

1. :meth:`FSDPResharder.generation_buckets` walks the parameters in layout (HF) order, cut into
   buckets of at most ``bucket_bytes`` of *generation* bytes (computed from shapes alone, so
   every rank cuts the same buckets), and for each bucket posts one message per peer (the
   pieces for it, back to back, cast to the engine's dtype first) with ``batch_isend_irecv``
   through the :class:`~hybridflow.resharding.meter.TrafficMeter`. The cut and every bucket's
   ops in posting order come from :func:`fsdp_buckets` (pure), which the check of
   :mod:`~hybridflow.resharding.post_order` reads too: sender and receiver of every message
   list its pieces in the same order (parameter, then the plan's piece order).
2. It assembles each generation block from its own piece and the received ones into a tensor of
   the block's shape and yields the bucket as ``[(HF name, block)]``. The caller loads it into
   its engine before advancing; the bucket is cleared when the next one is requested, so the
   extra memory is bounded by about two buckets (send and receive buffers plus the blocks).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hybridflow.resharding.layout import Block, ModelLayout, ParamSpec, ReshardingError
from hybridflow.resharding.meter import TrafficMeter
from hybridflow.resharding.post_order import PostedOp, cut_buckets, dtype_name

__all__ = [
    "FSDPBucket",
    "FSDPPiece",
    "FSDPPlan",
    "FSDPResharder",
    "contiguous_tp_ranks",
    "fsdp_buckets",
    "fsdp_generation_plan",
    "fsdp_rows",
    "strided_tp_ranks",
]


def fsdp_rows(rows: int, world: int, rank: int) -> tuple[int, int]:
    """The rows ``[start, stop)`` FSDP2 gives ``rank`` of ``world`` (``torch.chunk``: full chunks first)."""
    chunk = -(-rows // world)
    start = min(rank * chunk, rows)
    return start, min(start + chunk, rows)


def contiguous_tp_ranks(world: int, t_g: int) -> tuple[int, ...]:
    """Generation TP rank of each global rank when TP groups are consecutive ranks (vLLM's groups)."""
    return tuple(rank % t_g for rank in range(world))


def strided_tp_ranks(world: int, t_g: int) -> tuple[int, ...]:
    """Generation TP rank ``r // (d/t_g)``: every rank's FSDP rows lie inside its generation block."""
    return tuple(rank // (world // t_g) for rank in range(world))


@dataclass(frozen=True)
class FSDPPiece:
    """Rows ``[row_start, row_stop)`` and columns ``cols`` (``None``: all) of parameter ``name``, ``src`` -> ``dst``."""

    name: str
    src: int
    dst: int
    row_start: int
    row_stop: int
    cols: tuple[int, int] | None
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class FSDPPlan:
    """Who sends whom which piece, and each rank's generation blocks (see the module docstring)."""

    layout: ModelLayout
    world: int
    t_g: int
    tp_ranks: tuple[int, ...]
    generation: tuple[tuple[Block, ...], ...]
    """Per rank, its generation blocks in layout order."""
    pieces: tuple[tuple[FSDPPiece, ...], ...]
    """Per parameter (layout order), every non-empty piece (own pieces, ``src == dst``, included)."""

    def bytes_received(self, rank: int) -> int:
        return (
            sum(p.numel for params in self.pieces for p in params if p.dst == rank and p.src != rank)
            * self.layout.itemsize
        )

    def generation_bytes(self, rank: int) -> int:
        return sum(block.numel for block in self.generation[rank]) * self.layout.itemsize


def _piece(param: ParamSpec, src: int, dst: int, world: int, want: Block) -> FSDPPiece | None:
    start, stop = fsdp_rows(param.shape[0], world, src)
    cols: tuple[int, int] | None = None
    if want.dim == 0:
        start, stop = max(start, want.start), min(stop, want.stop)
    elif want.dim == 1:
        cols = (want.start, want.stop)
    elif want.dim is not None:
        raise ReshardingError(f"{param.name}: generation split on dim {want.dim} is not supported")
    if stop <= start:
        return None
    shape = list(param.shape)
    shape[0] = stop - start
    if cols is not None:
        shape[1] = cols[1] - cols[0]
    return FSDPPiece(param.name, src, dst, start, stop, cols, tuple(shape))


def fsdp_generation_plan(layout: ModelLayout, world: int, t_g: int, tp_ranks: Sequence[int]) -> FSDPPlan:
    """The plan from ``world``-way FSDP2 row shards to generation TP rank ``tp_ranks[r]`` of ``t_g``."""
    if t_g < 1 or world % t_g:
        raise ReshardingError(f"generation tensor parallel size {t_g} must divide the actor's {world} ranks")
    if len(tp_ranks) != world or any(not 0 <= j < t_g for j in tp_ranks):
        raise ReshardingError(
            f"tp_ranks={tuple(tp_ranks)} must give each of {world} ranks a TP rank below {t_g}"
        )
    layout.check(1, t_g)
    generation = tuple(tuple(param.block(t_g, tp_ranks[rank]) for param in layout) for rank in range(world))
    pieces: list[tuple[FSDPPiece, ...]] = []
    for index, param in enumerate(layout.params):
        found = []
        for dst in range(world):
            want = generation[dst][index]
            for src in range(world):
                piece = _piece(param, src, dst, world, want)
                if piece is not None:
                    found.append(piece)
        pieces.append(tuple(found))
    return FSDPPlan(layout, world, t_g, tuple(tp_ranks), generation, tuple(pieces))


@dataclass(frozen=True)
class FSDPBucket:
    """One bucket of :meth:`FSDPResharder.generation_buckets`: parameter indices (layout order) and its posts."""

    indices: tuple[int, ...]
    posts: tuple[PostedOp[FSDPPiece], ...]


def fsdp_buckets(
    plan: FSDPPlan, rank: int, *, bucket_bytes: int, itemsize: int, dtype: str
) -> tuple[FSDPBucket, ...]:
    """What :meth:`FSDPResharder.generation_buckets` posts on ``rank``, bucket by bucket (pure).

    The rank's generation blocks are cut into buckets of at most ``bucket_bytes`` at
    ``itemsize`` bytes per element; every rank's blocks of one parameter have the same size, so
    every rank cuts the same buckets. Per bucket (batch = its index): one send per peer that
    needs some of this rank's rows, then one receive per peer holding rows this rank needs,
    each in the order peers first appear in the bucket's pieces; a message's payload is its
    pieces in parameter order, then the plan's piece order, on both ends. Tag 0.
    """
    sizes = [block.numel * itemsize for block in plan.generation[rank]]
    buckets = []
    for batch, indices in enumerate(cut_buckets(sizes, bucket_bytes)):
        outgoing: dict[int, list[FSDPPiece]] = {}
        incoming: dict[int, list[FSDPPiece]] = {}
        for index in indices:
            for piece in plan.pieces[index]:
                if piece.src == rank and piece.dst != rank:
                    outgoing.setdefault(piece.dst, []).append(piece)
                elif piece.dst == rank and piece.src != rank:
                    incoming.setdefault(piece.src, []).append(piece)
        posts = [PostedOp(batch, "send", dst, 0, tuple(pieces), dtype) for dst, pieces in outgoing.items()]
        posts += [PostedOp(batch, "recv", src, 0, tuple(pieces), dtype) for src, pieces in incoming.items()]
        buckets.append(FSDPBucket(tuple(indices), tuple(posts)))
    return tuple(buckets)


def _local_view(local: torch.Tensor, piece: FSDPPiece, local_start: int) -> torch.Tensor:
    rows = local[piece.row_start - local_start : piece.row_stop - local_start]
    return rows if piece.cols is None else rows[:, piece.cols[0] : piece.cols[1]]


def _block_view(block_tensor: torch.Tensor, want: Block, piece: FSDPPiece) -> torch.Tensor:
    row_offset = want.start if want.dim == 0 else 0
    return block_tensor[piece.row_start - row_offset : piece.row_stop - row_offset]


class FSDPResharder:
    """Runs an :class:`FSDPPlan` on one rank over ``group`` (the actor's FSDP group; ranks are group ranks)."""

    def __init__(
        self,
        plan: FSDPPlan,
        rank: int,
        *,
        group: dist.ProcessGroup | None = None,
        meter: TrafficMeter | None = None,
    ) -> None:
        self.plan = plan
        self.rank = rank
        self.group = group
        self.meter = meter if meter is not None else TrafficMeter()

    def generation_buckets(
        self, local_shards: Mapping[str, torch.Tensor], *, bucket_bytes: int, dtype: torch.dtype
    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """This rank's generation blocks, bucket by bucket (collective in lockstep; see the module docstring).

        ``local_shards``: this rank's FSDP2 rows of every parameter, by HF name (``to_local()``).
        The ops of each bucket are :func:`fsdp_buckets`', posted in its order.
        """
        plan, me, world = self.plan, self.rank, self.plan.world
        buckets = fsdp_buckets(
            plan, me, bucket_bytes=bucket_bytes, itemsize=dtype.itemsize, dtype=dtype_name(dtype)
        )
        params = plan.layout.params
        position = {param.name: index for index, param in enumerate(params)}
        local_starts: dict[str, int] = {}
        for param in params:
            local = local_shards.get(param.name)
            start, stop = fsdp_rows(param.shape[0], world, me)
            expected = (stop - start, *param.shape[1:])
            if local is None or tuple(local.shape) != expected:
                got = None if local is None else tuple(local.shape)
                raise ReshardingError(
                    f"rank {me}: FSDP shard of {param.name} should have shape {expected}, got {got}"
                )
            local_starts[param.name] = start
        for bucket in buckets:
            blocks: dict[int, torch.Tensor] = {}
            for index in bucket.indices:
                param, want = params[index], plan.generation[me][index]
                local = local_shards[param.name]
                block = torch.empty(want.shape, dtype=dtype, device=local.device)
                blocks[index] = block
                for piece in plan.pieces[index]:
                    if piece.src == me and piece.dst == me:
                        _block_view(block, want, piece).copy_(
                            _local_view(local, piece, local_starts[param.name])
                        )
            device = next(iter(blocks.values())).device
            ops: list[dist.P2POp] = []
            receives: list[tuple[PostedOp[FSDPPiece], torch.Tensor]] = []
            for post in bucket.posts:
                flat = torch.empty(post.numel, dtype=dtype, device=device)
                if post.op == "send":  # one flat message per peer, cast while copying in
                    offset = 0
                    for piece in post.payload:
                        view = _local_view(local_shards[piece.name], piece, local_starts[piece.name])
                        flat[offset : offset + piece.numel].view(piece.shape).copy_(view)
                        offset += piece.numel
                    ops.append(dist.P2POp(dist.isend, flat, self._peer(post.peer), self.group))
                else:
                    receives.append((post, flat))
                    ops.append(dist.P2POp(dist.irecv, flat, self._peer(post.peer), self.group))
            if ops:
                for work in self.meter.batch_isend_irecv(ops):
                    work.wait()
            del ops
            for post, flat in receives:
                offset = 0
                for piece in post.payload:
                    index = position[piece.name]
                    _block_view(blocks[index], plan.generation[me][index], piece).copy_(
                        flat[offset : offset + piece.numel].view(piece.shape)
                    )
                    offset += piece.numel
            del receives
            bucket_tensors = [(params[index].name, blocks.pop(index)) for index in bucket.indices]
            yield bucket_tensors
            bucket_tensors.clear()

    def _peer(self, group_rank: int) -> int:
        """The global rank of ``group_rank`` (P2P ops take global ranks)."""
        return group_rank if self.group is None else dist.get_global_rank(self.group, group_rank)
