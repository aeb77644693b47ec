"""Transition plans between the training and generation layouts of the actor (pure, no processes).

A :class:`TransitionPlan` says, for every rank of the actor's worker group, which parameter
blocks it holds while training, which it must hold while generating, which peers send it what,
and from which received (or own) blocks each generation tensor is assembled. The transfer
(:mod:`hybridflow.resharding.transfer`) executes a plan without further decisions, and the
plan alone predicts the bytes each rank receives and the parameter memory it holds, so the
figures can be checked against the paper's Table 2 without starting a process.

Three designs, as in the paper's Table 2 (``p-t-d`` the training layout, ``p_g-t_g`` the
generation layout, ``M`` the model's weight bytes):

* ``hybridflow`` (the 3D-HybridEngine): generation TP/PP groups at strides ``t/t_g`` and
  ``p/p_g`` (:meth:`DeviceMesh.generation`); the ``d_g = p*t/(p_g*t_g)`` ranks of a micro-DP
  group hold the pieces of one generation shard and exchange them, one all-gather per group.
  Each rank's training shard lies inside its generation shard (checked when the plan is
  built), so it is reused in place. Traffic ``(tp - t_g p_g)/(t_g p_g tp) M``, peak
  ``M/(t_g p_g)``, redundant 0.
* ``vanilla``: generation groups of consecutive ranks (:meth:`DeviceMesh.training` with the
  generation sizes). A rank's training slice is in general not inside its generation slice,
  so each rank all-gathers the whole model across its ``t*p`` model-parallel group, keeps its
  generation slice and keeps its training shard aside: traffic ``(tp-1)/(tp) M``, peak ``M``,
  redundant ``M/(tp)``.
* ``allgather`` (DeepSpeed-Chat style): the training state is partitioned over all ``tpd``
  ranks (ZeRO-3: here each rank's Megatron shard is further split ``d`` ways along the same
  dimension), every rank gathers the whole model into a fresh buffer and keeps its partition
  aside: traffic ``(tpd-1)/(tpd) M``, peak ``M``, redundant ``M/(tpd)``.

What ``M`` is. Table 2 treats the model as if every byte were split ``t`` ways. The RMSNorm
weights of a Qwen2/Llama model are not: Megatron replicates them on every TP rank. This module
therefore accounts for two kinds of bytes separately (:class:`ParamBytes`): *partitioned*
parameters, for which Table 2 holds exactly with ``M = ModelLayout.partitioned_bytes``, and
*replicated* ones, which move only when a rank's generation stage spans training stages it
did not hold (``p_g < p``) and are reported next to the formula, never folded into it. Every
rank holds its training data as two flat buffers (one per kind) so that the two kinds never
share a storage and each figure is exact.

Who sends what. Every message is one of the sender's two training buffers, whole: the
partitioned buffer goes to every peer of the exchange group (every peer needs every
partitioned block of the group: its generation shard, or for the baselines the whole model,
contains them all); the replicated buffer of a stage goes only to peers at other stages that
lack it, from the holder with the receiver's own TP position, which spreads the load. A plan
checks that every message is needed in full; no byte is sent that is not used.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from fractions import Fraction
from typing import Literal, get_args

from hybridflow.mesh import DeviceMesh
from hybridflow.resharding.layout import Block, ModelLayout, ReshardingError

__all__ = [
    "BUFFER_KINDS",
    "DESIGNS",
    "BlockSource",
    "BufferKind",
    "Design",
    "Message",
    "ParamBytes",
    "RankPlan",
    "Table2Row",
    "TransitionPlan",
    "allgather_plan",
    "buffer_kind",
    "build_plan",
    "hybridflow_plan",
    "micro_dp_groups",
    "table2",
    "vanilla_plan",
]

Design = Literal["hybridflow", "vanilla", "allgather"]
DESIGNS: tuple[Design, ...] = get_args(Design)

BufferKind = Literal["partitioned", "replicated"]
"""Which of a rank's two flat training buffers a block lives in (see the module docstring)."""
BUFFER_KINDS: tuple[BufferKind, ...] = get_args(BufferKind)


@dataclass(frozen=True)
class ParamBytes:
    """A byte count split into TP-partitioned and TP-replicated parameters (see the module docstring)."""

    partitioned: int = 0
    replicated: int = 0

    @property
    def total(self) -> int:
        return self.partitioned + self.replicated

    def __add__(self, other: ParamBytes) -> ParamBytes:
        return ParamBytes(self.partitioned + other.partitioned, self.replicated + other.replicated)

    def __sub__(self, other: ParamBytes) -> ParamBytes:
        return ParamBytes(self.partitioned - other.partitioned, self.replicated - other.replicated)


def buffer_kind(block: Block) -> BufferKind:
    """The training buffer a block lives in: partitioned blocks and whole (replicated) ones apart."""
    return "partitioned" if block.partitioned else "replicated"


def _bytes(blocks: Sequence[Block], itemsize: int) -> ParamBytes:
    partitioned = sum(block.numel for block in blocks if block.partitioned)
    replicated = sum(block.numel for block in blocks if not block.partitioned)
    return ParamBytes(partitioned * itemsize, replicated * itemsize)


@dataclass(frozen=True)
class Message:
    """``src`` sends ``dst`` its whole training buffer of ``kind`` (``numel`` elements)."""

    src: int
    dst: int
    kind: BufferKind
    numel: int


@dataclass(frozen=True)
class BlockSource:
    """One piece of a generation tensor: the training block ``block`` of rank ``rank``.

    ``rank`` is the receiving rank itself when the piece is its own training data (reused in
    place by ``hybridflow``, copied into the gathered model by the baselines).
    """

    rank: int
    block: Block


@dataclass(frozen=True)
class RankPlan:
    """What one rank does in a transition.

    * ``training``: the blocks it holds while training; its two flat buffers hold the
      partitioned blocks (in this order) and the replicated ones.
    * ``generation``: per parameter of its generation shard, the slice it must hold and the
      sources that tile it, in order along the split dimension.
    * ``receives`` / ``sends``: its messages (see :class:`Message`); ``gathered`` lists the
      (rank, kind) buffers that make up the model it assembles, its own included.
    * ``reuses_training``: whether its own training buffers are part of its generation
      weights (``hybridflow``) or copied into a fresh gathered buffer (the baselines).
    """

    rank: int
    group: tuple[int, ...]
    training: tuple[Block, ...]
    generation: tuple[tuple[Block, tuple[BlockSource, ...]], ...]
    receives: tuple[Message, ...]
    sends: tuple[Message, ...]
    reuses_training: bool

    def training_numel(self, kind: BufferKind) -> int:
        return sum(block.numel for block in self.training if buffer_kind(block) == kind)

    @property
    def gathered(self) -> tuple[tuple[int, BufferKind], ...]:
        own = [(self.rank, kind) for kind in BUFFER_KINDS if self.training_numel(kind)]
        return (*own, *((message.src, message.kind) for message in self.receives))

    @property
    def kept(self) -> tuple[tuple[int, BufferKind], ...]:
        """The gathered buffers the generation weights read (the others are freed after the transition)."""
        used = {
            (source.rank, buffer_kind(source.block)) for _, sources in self.generation for source in sources
        }
        return tuple(buffer for buffer in self.gathered if buffer in used)


@dataclass(frozen=True)
class TransitionPlan:
    """The whole train -> generate transition for one design; see the module docstring.

    ``generation_mesh`` is the layout the generation engine runs with: the HybridFlow
    regrouping, consecutive groups for ``vanilla``, or one full replica per rank for
    ``allgather``. ``groups`` are the exchange groups (micro-DP groups for ``hybridflow``);
    each rank exchanges only inside its own.
    """

    design: Design
    layout: ModelLayout
    train: DeviceMesh
    generation_mesh: DeviceMesh
    groups: tuple[tuple[int, ...], ...]
    ranks: tuple[RankPlan, ...]

    def rank(self, rank: int) -> RankPlan:
        return self.ranks[rank]

    def _buffer_bytes(self, buffers: Sequence[tuple[int, BufferKind]]) -> ParamBytes:
        total = ParamBytes()
        for rank, kind in buffers:
            size = self.ranks[rank].training_numel(kind) * self.layout.itemsize
            total += ParamBytes(size, 0) if kind == "partitioned" else ParamBytes(0, size)
        return total

    # -- per-rank figures the transfer measures and Table 2 predicts -----------------------

    def training_bytes(self, rank: int) -> ParamBytes:
        return _bytes(self.ranks[rank].training, self.layout.itemsize)

    def generation_bytes(self, rank: int) -> ParamBytes:
        """Bytes of the generation shard the rank's engine reads."""
        return _bytes([block for block, _ in self.ranks[rank].generation], self.layout.itemsize)

    def bytes_received(self, rank: int) -> ParamBytes:
        return self._buffer_bytes([(m.src, m.kind) for m in self.ranks[rank].receives])

    def peak_bytes(self, rank: int) -> ParamBytes:
        """Table 2's peak: the largest parameter memory of the model the rank assembles.

        That is the whole gathered model (own data and received buffers) right after the
        exchange, before the baselines free what their generation slice does not use. The
        rank's own training data counts once, whether it is reused in place or copied.
        """
        return self._buffer_bytes(self.ranks[rank].gathered)

    def peak_total_bytes(self, rank: int) -> ParamBytes:
        """Every parameter byte alive at the peak: Table 2's peak plus a training shard kept aside."""
        plan = self.ranks[rank]
        aside = ParamBytes() if plan.reuses_training else self.training_bytes(rank)
        return self.peak_bytes(rank) + aside

    def held_bytes(self, rank: int) -> ParamBytes:
        """Parameter memory held while generating: the kept buffers plus a training shard kept aside."""
        plan = self.ranks[rank]
        aside = ParamBytes() if plan.reuses_training else self.training_bytes(rank)
        return self._buffer_bytes(plan.kept) + aside

    def redundant_bytes(self, rank: int) -> ParamBytes:
        """Held while generating but not read by the generation engine (Table 2's redundancy)."""
        return self.held_bytes(rank) - self.generation_bytes(rank)


# --------------------------------------------------------------------------- Table 2


@dataclass(frozen=True)
class Table2Row:
    """The paper's per-GPU figures for one design, exact fractions of bytes."""

    traffic: Fraction
    peak: Fraction
    redundant: Fraction


def table2(design: Design, *, p: int, t: int, d: int, p_g: int, t_g: int, model_bytes: int) -> Table2Row:
    """Table 2 of the HybridFlow paper for training ``p-t-d``, generation ``p_g-t_g`` and ``M = model_bytes``."""
    m = Fraction(model_bytes)
    if design == "hybridflow":
        return Table2Row(
            traffic=Fraction(t * p - t_g * p_g, t_g * p_g * t * p) * m,
            peak=m / (t_g * p_g),
            redundant=Fraction(0),
        )
    if design == "vanilla":
        return Table2Row(traffic=Fraction(t * p - 1, t * p) * m, peak=m, redundant=m / (t * p))
    return Table2Row(traffic=Fraction(t * p * d - 1, t * p * d) * m, peak=m, redundant=m / (t * p * d))


# --------------------------------------------------------------------------- builders


def micro_dp_groups(train: DeviceMesh, gen: DeviceMesh) -> list[list[int]]:
    """The micro-DP groups of a HybridFlow generation layout (consecutive ranks, size ``d_g``)."""
    if gen.world_size != train.world_size:
        raise ReshardingError(
            f"the generation mesh has {gen.world_size} ranks and the training mesh {train.world_size}"
        )
    return gen.groups("micro_dp")


def _split_training(blocks: Sequence[Block]) -> tuple[Block, ...]:
    """Partitioned blocks first, then replicated, each in HF order: the two flat buffers' order."""
    return tuple(b for b in blocks if b.partitioned) + tuple(b for b in blocks if not b.partitioned)


def _choose(holders: list[int], rank: int, position: Callable[[int], int]) -> int:
    """Among ranks holding the same block: the rank itself, else one at its TP position, else the lowest."""
    if rank in holders:
        return rank
    same_position = [h for h in holders if position(h) == position(rank)]
    return min(same_position or holders)


Holders = dict[tuple[int, int], list[tuple[int, Block]]]
"""For one parameter: ``(start, stop)`` of a training block -> the ranks holding it, with the block."""


def _tile(
    want: Block, holders: Holders, rank: int, position: Callable[[int], int]
) -> tuple[BlockSource, ...]:
    """Sources whose training blocks tile ``want`` exactly, in order along its split dimension.

    The training blocks of one parameter inside an exchange group all come from one even split,
    so the spans inside ``want`` are disjoint; a gap means the group cannot assemble ``want``.
    """
    sources: list[BlockSource] = []
    cursor = want.start
    for start, stop in sorted(holders):
        if start < want.start or stop > want.stop:
            continue
        if start != cursor:
            break
        members = dict(holders[(start, stop)])
        holder = _choose(list(members), rank, position)
        sources.append(BlockSource(holder, members[holder]))
        cursor = stop
    if cursor != want.stop:
        raise ReshardingError(
            f"internal: rank {rank} cannot assemble {want.name}[{want.start}:{want.stop}] from the "
            f"training blocks of its exchange group"
        )
    return tuple(sources)


def _assemble(
    design: Design,
    layout: ModelLayout,
    train: DeviceMesh,
    generation_mesh: DeviceMesh,
    groups: list[list[int]],
    training: dict[int, tuple[Block, ...]],
    generation: dict[int, list[Block]],
    gathered: dict[int, list[Block]],
    position: Callable[[int], int],
    reuse: bool,
) -> TransitionPlan:
    """Sources, messages and checks common to the three designs.

    ``gathered[rank]`` is what the rank assembles (its generation shard for ``hybridflow``,
    the whole model for the baselines) and decides its messages: it receives a peer's buffer
    of a kind when some gathered block comes from it. ``generation[rank]`` (a subset of the
    gathered model) is what its engine reads, tiled from its own and the received buffers.
    Raises :class:`ReshardingError` if a message would carry a block its receiver never uses.
    """
    plans: dict[int, RankPlan] = {}
    for group in groups:
        holders: dict[str, Holders] = defaultdict(lambda: defaultdict(list))
        for member in group:
            for block in training[member]:
                holders[block.name][(block.start, block.stop)].append((member, block))
        for rank in group:
            used: dict[tuple[int, BufferKind], set[Block]] = defaultdict(set)
            for want in gathered[rank]:
                for source in _tile(want, holders[want.name], rank, position):
                    used[(source.rank, buffer_kind(source.block))].add(source.block)
            receives = []
            for src, kind in sorted(used):
                if src == rank:
                    continue
                sent = [block for block in training[src] if buffer_kind(block) == kind]
                if set(sent) != used[(src, kind)]:
                    raise ReshardingError(
                        f"internal: rank {src} would send rank {rank} {kind} blocks it does not use"
                    )
                receives.append(Message(src, rank, kind, sum(block.numel for block in sent)))
            available = {(rank, "partitioned"), (rank, "replicated"), *((m.src, m.kind) for m in receives)}
            reachable: dict[str, Holders] = {
                name: {
                    span: [(m, b) for m, b in members if (m, buffer_kind(b)) in available]
                    for span, members in spans.items()
                }
                for name, spans in holders.items()
            }
            assembled = tuple(
                (want, _tile(want, reachable[want.name], rank, position)) for want in generation[rank]
            )
            plans[rank] = RankPlan(
                rank=rank,
                group=tuple(group),
                training=training[rank],
                generation=assembled,
                receives=tuple(receives),
                sends=(),
                reuses_training=reuse,
            )
    sends: dict[int, list[Message]] = defaultdict(list)
    for rank_plan in plans.values():
        for message in rank_plan.receives:
            sends[message.src].append(message)
    ranks = tuple(
        replace(plans[rank], sends=tuple(sorted(sends[rank], key=lambda m: (m.dst, m.kind))))
        for rank in range(train.world_size)
    )
    return TransitionPlan(
        design=design,
        layout=layout,
        train=train,
        generation_mesh=generation_mesh,
        groups=tuple(tuple(group) for group in groups),
        ranks=ranks,
    )


def hybridflow_plan(layout: ModelLayout, train: DeviceMesh, gen: DeviceMesh) -> TransitionPlan:
    """The 3D-HybridEngine transition from ``train`` to ``gen`` (a :meth:`DeviceMesh.generation` of it).

    Raises :class:`ReshardingError` when the model does not split evenly in either layout, or
    (an internal error) if some rank's training shard were not inside its generation shard.
    """
    layout.check(train.pp_size, train.tp_size)
    layout.check(gen.pp_size, gen.tp_size)
    regrouped = DeviceMesh.generation(train, pp=gen.pp_size, tp=gen.tp_size)
    if gen != regrouped:
        raise ReshardingError(
            f"generation mesh {gen.describe()} is not the HybridFlow regrouping of training mesh {train.describe()}"
        )
    training: dict[int, tuple[Block, ...]] = {}
    generation: dict[int, list[Block]] = {}
    for rank in range(train.world_size):
        c, g = train.coord(rank), gen.coord(rank)
        training[rank] = _split_training(layout.shard(train.pp_size, train.tp_size, c.pp, c.tp))
        generation[rank] = layout.shard(gen.pp_size, gen.tp_size, g.pp, g.tp)
        for block in training[rank]:
            if not any(want.contains(block) for want in generation[rank]):
                raise ReshardingError(
                    f"internal: rank {rank}'s training block {block.name}[{block.start}:{block.stop}] "
                    f"is not inside its generation shard"
                )
    return _assemble(
        "hybridflow",
        layout,
        train,
        gen,
        micro_dp_groups(train, gen),
        training,
        generation,
        generation,
        position=lambda rank: train.coord(rank).tp,
        reuse=True,
    )


def _full_model(layout: ModelLayout) -> list[Block]:
    """Every parameter whole, partitioned ones as the single piece of a 1-way split (so pieces tile it)."""
    return [param.block(1, 0) for param in layout]


def vanilla_plan(layout: ModelLayout, train: DeviceMesh, *, pp: int, tp: int) -> TransitionPlan:
    """Vanilla grouping: all-gather across each ``t*p`` model-parallel group, keep the ``(pp, tp)`` slice."""
    layout.check(train.pp_size, train.tp_size)
    layout.check(pp, tp)
    if train.tp_size % tp or train.pp_size % pp:
        raise ReshardingError(
            f"generation layout pp={pp} tp={tp} must divide the training layout pp={train.pp_size} tp={train.tp_size}"
        )
    gen = DeviceMesh.training(train.world_size, pp=pp, tp=tp)
    groups: dict[int, list[int]] = defaultdict(list)
    training: dict[int, tuple[Block, ...]] = {}
    generation: dict[int, list[Block]] = {}
    for rank in range(train.world_size):
        c, g = train.coord(rank), gen.coord(rank)
        groups[c.dp].append(rank)
        training[rank] = _split_training(layout.shard(train.pp_size, train.tp_size, c.pp, c.tp))
        generation[rank] = layout.shard(pp, tp, g.pp, g.tp)
    full = _full_model(layout)
    return _assemble(
        "vanilla",
        layout,
        train,
        gen,
        sorted(groups.values()),
        training,
        generation,
        {rank: full for rank in range(train.world_size)},
        position=lambda rank: train.coord(rank).tp,
        reuse=False,
    )


def allgather_plan(layout: ModelLayout, train: DeviceMesh) -> TransitionPlan:
    """DeepSpeed-Chat style: ``tpd``-way partitioned training state, every rank gathers the whole model."""
    layout.check(train.pp_size, train.tp_size)
    t, d = train.tp_size, train.dp_size
    layout.check(train.pp_size, t * d)
    training: dict[int, tuple[Block, ...]] = {}
    for rank in range(train.world_size):
        c = train.coord(rank)
        training[rank] = _split_training(
            [param.block(t * d, c.tp * d + c.dp) for param in layout.stage_params(train.pp_size, c.pp)]
        )
    full = _full_model(layout)
    everyone = {rank: full for rank in range(train.world_size)}
    return _assemble(
        "allgather",
        layout,
        train,
        DeviceMesh.training(train.world_size, pp=1, tp=1),
        [list(range(train.world_size))],
        training,
        everyone,
        everyone,
        position=lambda rank: train.coord(rank).tp * d + train.coord(rank).dp,
        reuse=False,
    )


def build_plan(design: Design, layout: ModelLayout, train: DeviceMesh, *, pp: int, tp: int) -> TransitionPlan:
    """The plan of ``design`` from ``train`` to a generation layout ``pp-tp`` (ignored by ``allgather``)."""
    if design == "hybridflow":
        return hybridflow_plan(layout, train, DeviceMesh.generation(train, pp=pp, tp=tp))
    if design == "vanilla":
        return vanilla_plan(layout, train, pp=pp, tp=tp)
    if design == "allgather":
        return allgather_plan(layout, train)
    raise ReshardingError(f"design={design!r} is not known; allowed: {', '.join(DESIGNS)}")
