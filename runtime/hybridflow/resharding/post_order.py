"""The point-to-point ops each rank posts in a weight transition, in posting order, and their check (pure).

Why this exists. NCCL pairs point-to-point messages by posting order: between an ordered pair
of ranks ``(a, b)``, the k-th send ``a`` posts to ``b`` meets the k-th receive ``b`` posts from
``a``, whatever their tags. gloo pairs them by tag. A transfer whose two ends post in different
orders therefore passes every CPU test and, on GPUs, silently fills one tensor with another of
the same size, fails on a size mismatch, or hangs. Both ends of every pair must post the same
sequence, element by element: the same payload (blocks, back to back), hence the same size, in
the same dtype, with the same tag (for gloo), in the same batch.

Protocol. Every executor of :mod:`hybridflow.resharding` posts its messages as the list a pure
function of this package returns for its rank, in that order and nothing else; the check reads
the same lists, so what it verifies is what runs:

* :meth:`Resharder.to_generation <hybridflow.resharding.transfer.Resharder.to_generation>`:
  :func:`exchange_posts`, one ``batch_isend_irecv`` (batch 0) per transition, every block of a
  message its own op, tagged with the block's position in the sender's ``RankPlan.training``.
* :meth:`Resharder.generation_buckets
  <hybridflow.resharding.transfer.Resharder.generation_buckets>`: :func:`exchange_buckets`,
  one batch per bucket (its index), receives first, then sends.
* :meth:`FSDPResharder.generation_buckets
  <hybridflow.resharding.fsdp.FSDPResharder.generation_buckets>`:
  :func:`~hybridflow.resharding.fsdp.fsdp_buckets`, one batch per bucket, one flat message per
  peer and direction whose payload is the pieces back to back (tag 0).

A batch is one ``batch_isend_irecv`` call followed by waiting for all of it; a rank posts its
batches in increasing order and posts none where it has nothing to send or receive. A send
posted in batch ``k`` must therefore meet its receive in batch ``k`` too: in a later batch the
receiver would wait for batch ``k`` first, and neither side would move.

:func:`check_post_order` takes every rank's list and returns, for each pair whose two ends
disagree, the first position where they do (later positions follow from the first);
:func:`require_post_order` raises :class:`ReshardingError` naming them. Broadcasts
(:mod:`~hybridflow.resharding.bucket_broadcast`) are collectives in one stream whose sizes the
receivers read from the header, so they have no order to check here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import zip_longest
from typing import Generic, Literal, Protocol, TypeVar

from hybridflow.resharding.layout import Block, ReshardingError
from hybridflow.resharding.plan import TransitionPlan, buffer_kind

__all__ = [
    "ExchangeBucket",
    "Payload",
    "PostOrderMismatch",
    "PostedOp",
    "check_post_order",
    "cut_buckets",
    "dtype_name",
    "exchange_buckets",
    "exchange_posts",
    "require_post_order",
]


class Payload(Protocol):
    """One piece of a message: a :class:`Block` of a training shard, or an FSDP piece."""

    @property
    def name(self) -> str: ...

    @property
    def numel(self) -> int: ...


P = TypeVar("P", bound=Payload)


@dataclass(frozen=True)
class PostedOp(Generic[P]):
    """One point-to-point op a rank posts: direction, peer, what it carries (see the module docstring).

    ``peer`` is a rank of the plan (the executor maps it to a global rank where they differ);
    ``payload`` the pieces the message's buffer holds back to back; ``dtype`` the element type
    on the wire, as ``torch`` names it without the prefix (``"bfloat16"``).
    """

    batch: int
    op: Literal["send", "recv"]
    peer: int
    tag: int
    payload: tuple[P, ...]
    dtype: str

    @property
    def numel(self) -> int:
        return sum(piece.numel for piece in self.payload)

    def matches(self, other: PostedOp[P]) -> bool:
        """Whether a send and a receive (either way round) carry the same message in the same batch."""
        return (self.batch, self.tag, self.payload, self.dtype) == (
            other.batch,
            other.tag,
            other.payload,
            other.dtype,
        )

    def describe(self) -> str:
        names = [piece.name for piece in self.payload]
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        return f"{self.op} in batch {self.batch}, tag {self.tag}: {shown} ({self.numel} x {self.dtype})"


@dataclass(frozen=True)
class PostOrderMismatch(Generic[P]):
    """Pair ``src -> dst`` first disagrees at ``position`` of its sequence; ``None``: that end posts nothing there."""

    src: int
    dst: int
    position: int
    send: PostedOp[P] | None
    recv: PostedOp[P] | None

    def describe(self) -> str:
        sent = self.send.describe() if self.send is not None else "nothing"
        received = self.recv.describe() if self.recv is not None else "nothing"
        return (
            f"rank {self.src} -> rank {self.dst}, op {self.position} of the pair: rank {self.src} posts "
            f"{sent}; rank {self.dst} posts {received}"
        )


def check_post_order(posts: Mapping[int, Sequence[PostedOp[P]]]) -> list[PostOrderMismatch[P]]:
    """Every pair whose sends and receives differ, at its first differing position (empty: all agree).

    ``posts[rank]`` is the rank's ops in posting order; a peer absent from ``posts`` posts
    nothing. For each ordered pair ``(a, b)`` the sends ``a`` posts to ``b`` are compared, in
    order, with the receives ``b`` posts from ``a`` (:meth:`PostedOp.matches`).
    """
    sends: dict[tuple[int, int], list[PostedOp[P]]] = {}
    receives: dict[tuple[int, int], list[PostedOp[P]]] = {}
    for rank, ops in posts.items():
        for op in ops:
            if op.op == "send":
                sends.setdefault((rank, op.peer), []).append(op)
            else:
                receives.setdefault((op.peer, rank), []).append(op)
    found: list[PostOrderMismatch[P]] = []
    for src, dst in sorted(sends.keys() | receives.keys()):
        pairs = zip_longest(sends.get((src, dst), ()), receives.get((src, dst), ()))
        for position, (send, recv) in enumerate(pairs):
            if send is None or recv is None or not send.matches(recv):
                found.append(PostOrderMismatch(src, dst, position, send, recv))
                break
    return found


def require_post_order(posts: Mapping[int, Sequence[PostedOp[P]]], *, what: str = "the transition") -> None:
    """Raise :class:`ReshardingError` naming the pairs whose two ends post different sequences."""
    found = check_post_order(posts)
    if found:
        shown = "; ".join(mismatch.describe() for mismatch in found[:5])
        more = f" (and {len(found) - 5} more pairs)" if len(found) > 5 else ""
        raise ReshardingError(
            f"{what}: {len(found)} rank pairs post their point-to-point ops in different orders, "
            f"which NCCL would pair wrongly: {shown}{more}"
        )


def dtype_name(dtype: object) -> str:
    """A ``torch.dtype`` as :class:`PostedOp` names it (``torch.bfloat16`` -> ``"bfloat16"``)."""
    return str(dtype).removeprefix("torch.")


def cut_buckets(sizes: Sequence[int], bucket_bytes: int) -> list[list[int]]:
    """Indices of ``sizes`` in order, cut into buckets of at most ``bucket_bytes`` (a larger item alone)."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes={bucket_bytes} must be positive")
    buckets: list[list[int]] = []
    size = 0
    for index, nbytes in enumerate(sizes):
        if not buckets or (buckets[-1] and size + nbytes > bucket_bytes):
            buckets.append([])
            size = 0
        buckets[-1].append(index)
        size += nbytes
    return buckets


# --------------------------------------------------------------------------- the Resharder's posts


def _training_tags(plan: TransitionPlan, rank: int) -> dict[Block, int]:
    """A block's tag: its position in its sender's ``RankPlan.training`` (both ends know the plan)."""
    return {block: index for index, block in enumerate(plan.rank(rank).training)}


def exchange_posts(plan: TransitionPlan, rank: int, dtype: str) -> tuple[PostedOp[Block], ...]:
    """What :meth:`Resharder.to_generation` posts on ``rank``, in order: one batch, sends then receives.

    A message of the plan (one training buffer of a kind, :class:`~hybridflow.resharding.plan.Message`)
    travels as one op per block, in the sender's training order: the sender posts the blocks as
    its shard holds them (no packing) and the receiver receives each into its place in a flat
    buffer. Sends go by ``(dst, kind)`` and receives by ``(src, kind)``, the plan's order.
    """
    me = plan.rank(rank)
    posts: list[PostedOp[Block]] = []
    mine = _training_tags(plan, rank)
    for message in me.sends:
        for block in me.training:
            if buffer_kind(block) == message.kind:
                posts.append(PostedOp(0, "send", message.dst, mine[block], (block,), dtype))
    for message in me.receives:
        for tag, block in enumerate(plan.rank(message.src).training):
            if buffer_kind(block) == message.kind:
                posts.append(PostedOp(0, "recv", message.src, tag, (block,), dtype))
    return tuple(posts)


@dataclass(frozen=True)
class ExchangeBucket:
    """One bucket of :meth:`Resharder.generation_buckets`: positions in ``RankPlan.generation``, and its posts."""

    indices: tuple[int, ...]
    posts: tuple[PostedOp[Block], ...]


def exchange_buckets(
    plan: TransitionPlan, rank: int, *, bucket_bytes: int, itemsize: int, dtype: str
) -> tuple[ExchangeBucket, ...]:
    """What :meth:`Resharder.generation_buckets` posts on ``rank``, bucket by bucket (HybridFlow plans only).

    The rank's generation parameters, in plan order, are cut into buckets of at most
    ``bucket_bytes`` generation bytes at ``itemsize`` bytes per element. The cut depends on the
    plan alone, and the members of a micro-DP group hold the same generation slices (checked
    here), so they cut the same buckets. Per bucket: a receive for every source block a peer
    holds (in generation order), then a send for every block of this rank a peer's generation
    slices read (peers in group order, then their generation order). Each block is tagged with
    its position in its sender's training blocks.
    """
    if plan.design != "hybridflow":
        raise ReshardingError(
            f"generation_buckets needs a hybridflow plan (micro-DP groups), not {plan.design!r}"
        )
    me = plan.rank(rank)
    wants = [want for want, _ in me.generation]
    for peer in me.group:
        if [want for want, _ in plan.rank(peer).generation] != wants:
            raise ReshardingError(f"internal: ranks {rank} and {peer} of a micro-DP group differ")
    tags = {member: _training_tags(plan, member) for member in me.group}
    peers = [peer for peer in me.group if peer != rank]
    buckets = []
    for batch, indices in enumerate(cut_buckets([want.numel * itemsize for want in wants], bucket_bytes)):
        names = {wants[index].name for index in indices}
        posts: list[PostedOp[Block]] = [
            PostedOp(batch, "recv", source.rank, tags[source.rank][source.block], (source.block,), dtype)
            for index in indices
            for source in me.generation[index][1]
            if source.rank != rank
        ]
        posts += [
            PostedOp(batch, "send", peer, tags[rank][source.block], (source.block,), dtype)
            for peer in peers
            for want, sources in plan.rank(peer).generation
            if want.name in names
            for source in sources
            if source.rank == rank
        ]
        buckets.append(ExchangeBucket(tuple(indices), tuple(posts)))
    return tuple(buckets)
