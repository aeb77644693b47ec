"""Executing a :class:`~hybridflow.resharding.plan.TransitionPlan` over ``torch.distributed``.

The same code runs on gloo (CPU tensors) and NCCL (CUDA tensors). Per rank, the protocol is:

1. Construction of :class:`Resharder` is **collective** over the whole world: it creates the
   plan's exchange groups (one process group per micro-DP group for HybridFlow) through
   :class:`SubgroupCache`, which every rank must call in the same order with the same plans.
   Build it once per (training layout, generation layout) and reuse it every RL step.
2. ``to_generation(shard)`` is collective inside the rank's exchange group: every member calls
   it with its :class:`TrainingShard`. It is the all-gather of the plan, posted as one batch of
   point-to-point sends and receives (``batch_isend_irecv``): every member sends its buffer to
   every peer that needs it and receives each peer's buffer into a buffer of its own. Bytes
   received are those of an all-gather; what differs is where they land. ``all_gather`` and
   ``all_gather_into_tensor`` write every member's chunk, the caller's own included, into one
   output (``all_gather`` with a list output even flattens through a temporary of the whole
   gathered size on gloo and NCCL), so the training shard would either be copied (a redundant
   ``M/(tp)``) or have to live permanently inside a generation-sized buffer that cannot be
   partly freed. Separate receive buffers keep the training shard where it is, read in place
   by the generation engine (zero redundant bytes), and let ``to_training`` free exactly the
   generation-only memory. The baselines run through the same path; they copy their own
   buffer into the gathered model instead of reusing it, as their designs do.
3. Between the two calls the caller generates with the returned :class:`GenerationShard` and
   must not modify its training shard (HybridFlow's generation weights *are* that memory).
4. ``to_training(generation)`` is local: it releases the generation shard (every received
   buffer and copy; the training shard is untouched, it never stopped being the trainer's).
   An engine holding the shard sees it released and refuses to generate until it is given the
   next one.

Both calls return a :class:`TransitionStats` (seconds, bytes received, parameter memory) that
the observability layer can export as they are. Memory figures are measured from the tensors
that exist (distinct storages, by their ``untyped_storage``), not copied from the plan; the
tests check that the two agree. They do not see temporaries inside the communication library
(none on the point-to-point path with gloo; NCCL keeps small internal staging buffers).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Literal

import torch
import torch.distributed as dist

from hybridflow.resharding.layout import Block, ReshardingError
from hybridflow.resharding.meter import PeakMemory, TrafficMeter
from hybridflow.resharding.plan import (
    BUFFER_KINDS,
    BufferKind,
    Design,
    ParamBytes,
    TransitionPlan,
    buffer_kind,
)
from hybridflow.resharding.post_order import dtype_name, exchange_buckets, exchange_posts

__all__ = [
    "BucketRecord",
    "GenerationShard",
    "Resharder",
    "SubgroupCache",
    "TrainingShard",
    "TransitionStats",
]


def _offsets(blocks: Sequence[Block]) -> dict[Block, int]:
    """Element offset of each block inside its kind's flat buffer (the plan's order)."""
    offsets: dict[Block, int] = {}
    cursor = dict.fromkeys(BUFFER_KINDS, 0)
    for block in blocks:
        kind = buffer_kind(block)
        offsets[block] = cursor[kind]
        cursor[kind] += block.numel
    return offsets


def _storage_bytes(tensors: Iterable[tuple[BufferKind, torch.Tensor]]) -> ParamBytes:
    """Bytes of the distinct storages behind ``tensors``, by kind (a storage counts once)."""
    seen: dict[int, tuple[BufferKind, int]] = {}
    for kind, tensor in tensors:
        storage = tensor.untyped_storage()
        if storage.nbytes():
            seen[storage.data_ptr()] = (kind, storage.nbytes())
    partitioned = sum(size for kind, size in seen.values() if kind == "partitioned")
    replicated = sum(size for kind, size in seen.values() if kind == "replicated")
    return ParamBytes(partitioned, replicated)


# --------------------------------------------------------------------------- shards


def _block_tensor(block: Block, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """A backend's local tensor for ``block`` (by HF name), checked to have the block's shape."""
    tensor = tensors.get(block.name)
    if tensor is None:
        raise ReshardingError(f"the training shard lacks {block.name}")
    if tuple(tensor.shape) != block.shape:
        raise ReshardingError(
            f"{block.name}: the local tensor has shape {tuple(tensor.shape)}, expected {block.shape}"
        )
    return tensor


class TrainingShard:
    """A rank's training parameters, block by block, as the plan names them (``RankPlan.training``).

    Two forms, one interface (:meth:`view` gives a block as a tensor of its shape):

    * **flat** (the constructor, :meth:`allocate`, :meth:`pack`, :meth:`from_full`): two flat
      buffers, one per :data:`BufferKind`, with the partitioned blocks back to back in the first
      and the replicated ones in the second, and every block a view of its buffer. Tests and
      benchmarks start from here; a backend that does not keep its parameters apart from
      others' uses :meth:`pack` (one copy per step).
    * **the backend's own tensors** (:meth:`of_tensors`): each block is the tensor the backend
      handed over, held as it is (no copy): views of the trainer's live parameters where its
      layout allows (megatron's DDP keeps its parameters inside flat buffers of its own, in its
      own order), copies only where it does not. :meth:`buffer` refuses this form.

    The transfer reads blocks through :meth:`view` only, so both forms move the same bytes.
    """

    def __init__(self, blocks: Sequence[Block], partitioned: torch.Tensor, replicated: torch.Tensor) -> None:
        self.blocks = tuple(blocks)
        self._buffers: dict[BufferKind, torch.Tensor] | None = {
            "partitioned": partitioned,
            "replicated": replicated,
        }
        offsets = _offsets(self.blocks)
        for kind, buffer in self._buffers.items():
            expected = sum(block.numel for block in self.blocks if buffer_kind(block) == kind)
            if buffer.dim() != 1 or buffer.numel() != expected or not buffer.is_contiguous():
                raise ReshardingError(
                    f"the {kind} buffer must be a contiguous 1-D tensor of {expected} elements, "
                    f"got shape {tuple(buffer.shape)}"
                )
        if partitioned.dtype != replicated.dtype or partitioned.device != replicated.device:
            raise ReshardingError("both buffers of a training shard must share one dtype and device")
        self._views: dict[Block, torch.Tensor] = {
            block: self._buffers[buffer_kind(block)][offsets[block] : offsets[block] + block.numel].view(
                block.shape
            )
            for block in self.blocks
        }
        self._dtype, self._device = partitioned.dtype, partitioned.device

    @classmethod
    def of_tensors(cls, blocks: Sequence[Block], tensors: Mapping[str, torch.Tensor]) -> TrainingShard:
        """Hold a backend's tensors (by HF name, each of its block's shape) as the shard, without copying.

        Each tensor must be contiguous (it is handed to the communication library as it is) and
        all must share one dtype and device. The shard references them: the caller must not
        modify them while the shard is in use (between ``to_generation`` and ``to_training``,
        or while iterating :meth:`Resharder.generation_buckets`).
        """
        shard = cls.__new__(cls)
        shard.blocks = tuple(blocks)
        shard._buffers = None
        shard._views = {}
        if not shard.blocks:
            raise ReshardingError("a training shard needs at least one block")
        for block in shard.blocks:
            tensor = _block_tensor(block, tensors)
            if not tensor.is_contiguous():
                raise ReshardingError(f"{block.name}: the local tensor is not contiguous")
            shard._views[block] = tensor
        first = next(iter(shard._views.values()))
        if any(t.dtype != first.dtype or t.device != first.device for t in shard._views.values()):
            raise ReshardingError("every tensor of a training shard must share one dtype and device")
        shard._dtype, shard._device = first.dtype, first.device
        return shard

    @classmethod
    def allocate(
        cls, blocks: Sequence[Block], dtype: torch.dtype, device: torch.device | str
    ) -> TrainingShard:
        """Uninitialised flat buffers for ``blocks``; fill them through :meth:`views`."""
        sizes = {kind: sum(b.numel for b in blocks if buffer_kind(b) == kind) for kind in BUFFER_KINDS}
        return cls(
            blocks,
            torch.empty(sizes["partitioned"], dtype=dtype, device=device),
            torch.empty(sizes["replicated"], dtype=dtype, device=device),
        )

    @classmethod
    def pack(
        cls,
        blocks: Sequence[Block],
        tensors: Mapping[str, torch.Tensor],
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> TrainingShard:
        """Copy a backend's local shards (by HF name, each of its block's shape) into fresh flat buffers."""
        if not tensors:
            raise ReshardingError("no local tensors to pack into a training shard")
        first = next(iter(tensors.values()))
        shard = cls.allocate(blocks, dtype or first.dtype, device or first.device)
        views = shard.views()
        for block in shard.blocks:
            views[block.name].copy_(_block_tensor(block, tensors))
        return shard

    @classmethod
    def from_full(
        cls,
        blocks: Sequence[Block],
        full: Mapping[str, torch.Tensor],
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> TrainingShard:
        """Cut ``blocks`` out of full HF tensors (a whole state dict): how tests and benchmarks start."""
        return cls.pack(blocks, {b.name: full[b.name][b.index()] for b in blocks}, dtype=dtype, device=device)

    @property
    def flat(self) -> bool:
        """Whether the shard is two flat buffers (else: the backend's own tensors)."""
        return self._buffers is not None

    def buffer(self, kind: BufferKind) -> torch.Tensor:
        if self._buffers is None:
            raise ReshardingError("this training shard holds the backend's own tensors, not flat buffers")
        return self._buffers[kind]

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    @property
    def device(self) -> torch.device:
        return self._device

    def view(self, block: Block) -> torch.Tensor:
        return self._views[block]

    def views(self) -> dict[str, torch.Tensor]:
        """Each block as a tensor of its shape, sharing the shard's memory."""
        return {block.name: self._views[block] for block in self.blocks}

    def tensors(self) -> Iterator[tuple[BufferKind, torch.Tensor]]:
        """Every tensor the shard holds, by kind: the two buffers, or the backend's tensors."""
        if self._buffers is not None:
            yield from ((kind, buffer) for kind, buffer in self._buffers.items() if buffer.numel())
        else:
            yield from ((buffer_kind(block), tensor) for block, tensor in self._views.items())

    def storage_pointers(self) -> set[int]:
        """Data pointers of the storages behind the shard (to tell its memory from received buffers)."""
        return {tensor.untyped_storage().data_ptr() for _, tensor in self.tensors()}

    def nbytes(self) -> ParamBytes:
        """Bytes of the shard's blocks, by kind (for a flat shard: its two buffers)."""
        total = ParamBytes()
        for block in self.blocks:
            size = block.numel * self._dtype.itemsize
            total += ParamBytes(size, 0) if block.partitioned else ParamBytes(0, size)
        return total


class GenerationShard:
    """The weights one rank's generation engine reads, by HF name.

    Each parameter's generation slice (:meth:`slice`, a :class:`Block` of the full tensor) is
    held as the tuple of blocks that tile it along its split dimension (:meth:`blocks`), in
    order; concatenating them gives the slice (:meth:`tensor`, which copies when there is more
    than one). Engines compute on the blocks directly so that nothing is copied: with
    HybridFlow one of them is the rank's own training memory. After :meth:`release` (called by
    :meth:`Resharder.to_training`) every access raises :class:`ReshardingError`.
    """

    def __init__(self, slices: Mapping[str, Block], blocks: Mapping[str, Sequence[torch.Tensor]]) -> None:
        self._slices = dict(slices)
        self._blocks: dict[str, tuple[torch.Tensor, ...]] | None = {
            name: tuple(b) for name, b in blocks.items()
        }
        for name, block in self._slices.items():
            pieces = self._blocks[name]
            if block.dim is None:
                if len(pieces) != 1 or tuple(pieces[0].shape) != block.shape:
                    raise ReshardingError(f"{name}: a replicated parameter is one whole block")
            elif sum(piece.shape[block.dim] for piece in pieces) != block.stop - block.start:
                raise ReshardingError(f"{name}: the blocks do not tile the generation slice")

    @classmethod
    def from_full(cls, slices: Mapping[str, Block], full: Mapping[str, torch.Tensor]) -> GenerationShard:
        """Engine-owned copies of the slices of full tensors (no resharding involved)."""
        return cls(slices, {name: (full[name][block.index()].clone(),) for name, block in slices.items()})

    def _live(self) -> dict[str, tuple[torch.Tensor, ...]]:
        if self._blocks is None:
            raise ReshardingError(
                "the generation shard was released (Resharder.to_training); reshard again for the next rollout"
            )
        return self._blocks

    @property
    def released(self) -> bool:
        return self._blocks is None

    def names(self) -> list[str]:
        return list(self._slices)

    def __contains__(self, name: object) -> bool:
        return name in self._slices

    def slice(self, name: str) -> Block:
        return self._slices[name]

    def blocks(self, name: str) -> tuple[torch.Tensor, ...]:
        return self._live()[name]

    def tensor(self, name: str) -> torch.Tensor:
        """The generation slice as one tensor (a copy unless it is a single block)."""
        pieces = self.blocks(name)
        dim = self._slices[name].dim
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=dim if dim is not None else 0)

    def replace(self, name: str, tensor: torch.Tensor) -> None:
        """Hold ``tensor`` (the whole generation slice) as the parameter's only block, engine-owned."""
        block = self._slices[name]
        if tuple(tensor.shape) != block.shape:
            raise ReshardingError(
                f"{name}: expected the generation slice's shape {block.shape}, got {tuple(tensor.shape)}"
            )
        self._live()[name] = (tensor,)

    def tensors(self) -> Iterator[tuple[BufferKind, torch.Tensor]]:
        for name, pieces in self._live().items():
            for piece in pieces:
                yield buffer_kind(self._slices[name]), piece

    def read_bytes(self) -> ParamBytes:
        """Bytes the engine reads: the generation slices themselves."""
        total = ParamBytes()
        for kind, piece in self.tensors():
            size = piece.numel() * piece.element_size()
            total += ParamBytes(size, 0) if kind == "partitioned" else ParamBytes(0, size)
        return total

    def release(self) -> None:
        self._blocks = None


# --------------------------------------------------------------------------- groups


class SubgroupCache:
    """Process groups by membership, created on first request and reused afterwards.

    :meth:`get` is collective over the whole world the first time a partition is asked for
    (``new_subgroups_by_enumeration`` calls ``new_group`` for every group of the partition on
    every rank), so every rank must ask for the same partitions in the same order; later
    requests are local. A rank gets the group it belongs to.
    """

    def __init__(self) -> None:
        self._groups: dict[tuple[int, ...], dist.ProcessGroup] = {}

    def get(self, partition: Sequence[Sequence[int]]) -> dist.ProcessGroup:
        me = dist.get_rank()
        key = tuple(sorted(tuple(group) for group in partition))
        mine = next((group for group in key if me in group), None)
        if mine is None:
            raise ReshardingError(f"rank {me} is in none of the groups {key}")
        if mine not in self._groups:
            created, _ = dist.new_subgroups_by_enumeration([list(group) for group in key])
            if created is None:
                raise ReshardingError(f"rank {me}: torch.distributed created no group for it in {key}")
            for group in key:
                if me in group:
                    self._groups[group] = created
        return self._groups[mine]


# --------------------------------------------------------------------------- stats


@dataclass(frozen=True)
class TransitionStats:
    """What one rank measured in one transition (the observability layer exports :meth:`as_metrics`).

    * ``seconds``: wall time of the call on this rank (CUDA work synchronised).
    * ``received``: bytes received from peers.
    * ``peak``: Table 2's peak parameter memory, the largest model the rank assembled at once
      (its own training buffers count when they are part of it).
    * ``peak_total``: every parameter byte alive at that moment, a training shard kept aside
      included.
    * ``held``: parameter memory alive at the end of the call (while generating, for
      ``to_generation``; the training shard alone, for ``to_training``).
    * ``redundant``: held but not read by the generation engine (``to_generation`` only).
    * ``freed``: parameter memory released by the call (``to_training`` only).
    * ``wire_sent`` / ``wire_received``: bytes this rank handed to ``torch.distributed`` in the
      call, counted by the :class:`~hybridflow.resharding.meter.TrafficMeter` (not the plan).
    * ``peak_memory``: the call's own peak memory measured from the process
      (:class:`~hybridflow.resharding.meter.PeakMemory`: ``VmHWM`` minus the resident size
      before on CPU, ``max_memory_allocated`` minus allocated on CUDA); ``None`` where the
      process cannot be measured. It includes packing and library temporaries.
    * ``reused``: training-shard bytes the generation weights read in place (resident before
      the call, so not in ``peak_memory``); ``peak_memory + reused`` is the measured
      counterpart of Table 2's peak.
    """

    design: Design
    direction: Literal["to_generation", "to_training"]
    rank: int
    seconds: float
    received: ParamBytes
    peak: ParamBytes
    peak_total: ParamBytes
    held: ParamBytes
    redundant: ParamBytes
    freed: ParamBytes
    wire_sent: int = 0
    wire_received: int = 0
    peak_memory: int | None = None
    reused: int = 0

    @property
    def bytes_received(self) -> int:
        return self.received.total

    def as_metrics(self) -> dict[str, float | int | str]:
        """Flat ``{name: value}``, byte counts split as ``<field>_partitioned`` / ``_replicated``."""
        flat: dict[str, float | int | str] = {}
        for name, value in asdict(self).items():
            if isinstance(value, dict):
                for kind, count in value.items():
                    flat[f"{name}_{kind}_bytes"] = count
            elif value is None:
                continue
            else:
                flat[name] = value
        flat["bytes_received"] = self.bytes_received
        return flat


# --------------------------------------------------------------------------- resharder


@dataclass
class BucketRecord:
    """What :meth:`Resharder.generation_buckets` allocated, measured from the tensors it created.

    * ``buckets``: buckets yielded.
    * ``largest_bucket_bytes``: the most bytes of tensors created for one bucket (receive buffers
      and casts of the rank's own blocks into the engine's dtype): the transfer's own extra
      memory, which the bucket size bounds.
    * ``cast_bytes``: bytes of own blocks copied to change dtype, over all buckets (0 when the
      trainer's dtype is the engine's: the own blocks are handed over as they are).
    * ``own_bytes``: bytes of the rank's own training blocks handed to the consumer, cast or not.
    """

    buckets: int = 0
    largest_bucket_bytes: int = 0
    cast_bytes: int = 0
    own_bytes: int = 0


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class Resharder:
    """Runs one plan's transitions on one rank; see the module docstring for the protocol.

    Construction is collective over the world (it creates the exchange groups); use one
    :class:`SubgroupCache` per process so that groups are created once. Every exchange goes
    through ``meter`` (the process's :class:`TrafficMeter`; a new one by default), so the
    stats' wire bytes are what was handed to ``torch.distributed``.

    Messages are posted block by block: a rank sends each of its training blocks as the tensor
    its :class:`TrainingShard` holds (a view of a flat buffer, or of the trainer's own
    parameter), so nothing is packed on the sending side; the tag of a block is its position in
    the sender's ``RankPlan.training``, which both sides know from the plan. Which ops a rank
    posts, and in which order, is decided by the pure functions of
    :mod:`~hybridflow.resharding.post_order` (:func:`exchange_posts`, :func:`exchange_buckets`);
    this class posts exactly their lists, so the check that both ends of every pair post the
    same sequence (which NCCL needs) runs on what is executed.
    """

    def __init__(
        self, plan: TransitionPlan, rank: int, groups: SubgroupCache, meter: TrafficMeter | None = None
    ) -> None:
        self.plan = plan
        self.rank = rank
        self.meter = meter if meter is not None else TrafficMeter()
        self._me = plan.rank(rank)
        self._group = groups.get(plan.groups) if any(len(group) > 1 for group in plan.groups) else None
        self._offsets = {r: _offsets(plan.rank(r).training) for r in self._me.group}

    def _synchronize(self, device: torch.device) -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def _check(self, shard: TrainingShard) -> None:
        if shard.blocks != self._me.training:
            raise ReshardingError(
                f"rank {self.rank}: the training shard's blocks are not the plan's for this rank"
            )

    def _run(self, ops: list[dist.P2POp]) -> None:
        works = self.meter.batch_isend_irecv(ops) if ops else []
        while works:  # a work references its buffer: drop each once done, so unused ones can be freed
            works.pop().wait()

    def to_generation(
        self, shard: TrainingShard, *, measure_memory: bool = True
    ) -> tuple[GenerationShard, TransitionStats]:
        """Train -> generate: exchange inside the exchange group (collective there), build the shard.

        ``measure_memory=False`` leaves ``peak_memory`` unmeasured (``None``), for a caller whose
        own :class:`PeakMemory` window spans a larger transition (packing included): the probe
        resets the process's high-water mark, so windows cannot nest.
        """
        self._check(shard)
        device = shard.device
        self._synchronize(device)
        wire_before = self.meter.total
        probe = PeakMemory(device)
        with probe if measure_memory else contextlib.nullcontext(probe):
            start = time.perf_counter()
            generation, received, peak, peak_total = self._exchange(shard)
            seconds = time.perf_counter() - start
        wire = self.meter.total - wire_before
        own = shard.storage_pointers()
        reused = sum(
            _nbytes(piece) for _, piece in generation.tensors() if piece.untyped_storage().data_ptr() in own
        )
        held = self._held(generation.tensors(), shard)
        stats = TransitionStats(
            design=self.plan.design,
            direction="to_generation",
            rank=self.rank,
            seconds=seconds,
            received=received,
            peak=peak,
            peak_total=peak_total,
            held=held,
            redundant=held - generation.read_bytes(),
            freed=ParamBytes(),
            wire_sent=wire.sent,
            wire_received=wire.received,
            peak_memory=probe.bytes,
            reused=reused,
        )
        return generation, stats

    @staticmethod
    def _held(pieces: Iterable[tuple[BufferKind, torch.Tensor]], shard: TrainingShard) -> ParamBytes:
        """Parameter bytes alive: the storages of ``pieces`` that are not the shard's, plus the shard's blocks.

        The shard counts by its blocks, not its storages: a shard of the trainer's own tensors
        lives inside the trainer's buffers, of which the blocks are this rank's part.
        """
        own = shard.storage_pointers()
        return (
            _storage_bytes(
                (kind, piece) for kind, piece in pieces if piece.untyped_storage().data_ptr() not in own
            )
            + shard.nbytes()
        )

    def _exchange(self, shard: TrainingShard) -> tuple[GenerationShard, ParamBytes, ParamBytes, ParamBytes]:
        """The exchange itself: the generation shard, bytes received, peak and peak_total (from storages)."""
        me = self._me
        device, dtype = shard.device, shard.dtype
        # Each (rank, kind) of the gathered model: a received flat buffer, or for the baselines a
        # fresh copy of the rank's own blocks (HybridFlow reads its own blocks where they are).
        gathered: dict[tuple[int, BufferKind], torch.Tensor] = {}
        if not me.reuses_training:
            for kind in BUFFER_KINDS:
                mine = [block for block in me.training if buffer_kind(block) == kind]
                if mine:
                    gathered[(self.rank, kind)] = (
                        shard.buffer(kind).clone()
                        if shard.flat
                        else torch.cat([shard.view(block).reshape(-1) for block in mine])
                    )
        for m in me.receives:
            gathered[(m.src, m.kind)] = torch.empty(m.numel, dtype=dtype, device=device)
        ops: list[dist.P2POp] = []
        for post in exchange_posts(self.plan, self.rank, dtype_name(dtype)):
            (block,) = post.payload
            if post.op == "send":
                tensor = shard.view(block)
            else:  # the block's place in the flat receive buffer of its (sender, kind)
                offset = self._offsets[post.peer][block]
                tensor = gathered[(post.peer, buffer_kind(block))][offset : offset + block.numel]
            ops.append(
                dist.P2POp(
                    dist.isend if post.op == "send" else dist.irecv, tensor, post.peer, self._group, post.tag
                )
            )
        self._run(ops)
        del ops
        self._synchronize(device)
        own_bytes = shard.nbytes() if me.reuses_training else ParamBytes()
        others = _storage_bytes((kind, tensor) for (_, kind), tensor in gathered.items())
        peak = others + own_bytes
        peak_total = others + shard.nbytes()
        slices: dict[str, Block] = {}
        blocks: dict[str, list[torch.Tensor]] = {}
        for want, sources in me.generation:
            slices[want.name] = want
            pieces = blocks.setdefault(want.name, [])
            for source in sources:
                if source.rank == self.rank and me.reuses_training:
                    pieces.append(shard.view(source.block))
                    continue
                buffer = gathered[(source.rank, buffer_kind(source.block))]
                offset = self._offsets[source.rank][source.block]
                pieces.append(buffer[offset : offset + source.block.numel].view(source.block.shape))
        generation = GenerationShard(slices, blocks)
        # The buffers the transport filled (a size mismatch with the sender fails the receive).
        received = ParamBytes()
        for m in me.receives:
            size = gathered[(m.src, m.kind)].nbytes
            received += ParamBytes(size, 0) if m.kind == "partitioned" else ParamBytes(0, size)
        return generation, received, peak, peak_total  # unread gathered buffers are freed on return

    def generation_buckets(
        self,
        shard: TrainingShard,
        *,
        bucket_bytes: int,
        dtype: torch.dtype | None = None,
        record: BucketRecord | None = None,
    ) -> Iterator[GenerationShard]:
        """Train -> generate for an engine that copies the weights into memory of its own, bucket by bucket.

        HybridFlow plans only. Collective in lockstep inside the micro-DP group: every member
        creates the iterator and advances it to the end. The rank's generation parameters, in
        plan order, are cut into buckets of at most ``bucket_bytes`` of generation bytes in
        ``dtype`` (one larger parameter forms a bucket alone); the cut depends on the plan alone
        and the members of a micro-DP group hold the same generation slices, so they cut the
        same buckets. Per bucket, each member posts the blocks its peers need for those
        parameters and receives the ones it lacks, then gets the bucket as a
        :class:`GenerationShard` (only the bucket's parameters): its own blocks as the shard
        holds them (views of the trainer's memory: no copy) unless ``dtype`` differs from the
        shard's (then cast once, and sent cast: weights travel in the engine's dtype), the
        peers' blocks in fresh receive buffers. The bucket is released when the next one is
        asked for, so the extra memory is one bucket's receive buffers and casts (``record``
        measures it) plus whatever the consumer keeps. The training shard must not change
        until the iteration ends. The cut and each bucket's ops, in posting order, are
        :func:`~hybridflow.resharding.post_order.exchange_buckets`'.
        """
        dtype = dtype or shard.dtype
        buckets = exchange_buckets(
            self.plan, self.rank, bucket_bytes=bucket_bytes, itemsize=dtype.itemsize, dtype=dtype_name(dtype)
        )
        self._check(shard)
        me = self._me
        wants = [want for want, _ in me.generation]
        device = shard.device
        itemsize = dtype.itemsize
        record = record if record is not None else BucketRecord()
        for bucket in buckets:
            indices = bucket.indices
            used = [
                source.block
                for index in indices
                for source in me.generation[index][1]
                if source.rank == self.rank
            ]
            sent = [post.payload[0] for post in bucket.posts if post.op == "send"]
            created = 0
            mine: dict[Block, torch.Tensor] = {}
            for block in [*used, *sent]:
                if block in mine:
                    continue
                tensor = shard.view(block)
                if tensor.dtype != dtype:
                    tensor = tensor.to(dtype)
                    created += _nbytes(tensor)
                    record.cast_bytes += _nbytes(tensor)
                mine[block] = tensor
            ops: list[dist.P2POp] = []
            received: dict[tuple[int, Block], torch.Tensor] = {}
            for post in bucket.posts:
                (block,) = post.payload
                if post.op == "send":
                    ops.append(dist.P2POp(dist.isend, mine[block], post.peer, self._group, post.tag))
                    continue
                buffer = torch.empty(block.shape, dtype=dtype, device=device)
                created += _nbytes(buffer)
                received[(post.peer, block)] = buffer
                ops.append(dist.P2POp(dist.irecv, buffer, post.peer, self._group, post.tag))
            self._run(ops)
            del ops
            self._synchronize(device)
            slices = {wants[index].name: wants[index] for index in indices}
            pieces: dict[str, list[torch.Tensor]] = {}
            for index in indices:
                want, sources = me.generation[index]
                pieces[want.name] = [
                    mine[source.block] if source.rank == self.rank else received[(source.rank, source.block)]
                    for source in sources
                ]
                record.own_bytes += sum(
                    source.block.numel * itemsize for source in sources if source.rank == self.rank
                )
            generation = GenerationShard(slices, pieces)
            del received, mine, pieces
            record.buckets += 1
            record.largest_bucket_bytes = max(record.largest_bucket_bytes, created)
            yield generation
            generation.release()

    def to_training(self, generation: GenerationShard, shard: TrainingShard) -> TransitionStats:
        """Generate -> train: release the generation-only memory (local, no communication).

        ``shard`` is the training shard passed to :meth:`to_generation`; its memory stays.
        """
        start = time.perf_counter()
        before = self._held(generation.tensors(), shard)
        generation.release()
        held = shard.nbytes()
        return TransitionStats(
            design=self.plan.design,
            direction="to_training",
            rank=self.rank,
            seconds=time.perf_counter() - start,
            received=ParamBytes(),
            peak=ParamBytes(),
            peak_total=before,
            held=held,
            redundant=ParamBytes(),
            freed=before - held,
        )
