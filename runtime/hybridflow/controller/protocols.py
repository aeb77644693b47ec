"""Transfer protocols: how a controller call fans out to the ranks of a group and how results return.

A worker method is exposed to the controller by decorating it with :func:`register`, naming a
:class:`TransferProtocol`. A protocol is two pure functions of the call and the group's
:class:`~hybridflow.mesh.DeviceMesh`:

``dispatch(call, mesh) -> Dispatched``
    the arguments each global rank receives (``None``: the rank does not run the method), the
    ranks whose return values the controller needs (``collect_from``), and a context value
    handed to ``collect`` (e.g. how many padding rows were added).

``collect(outputs, mesh, context) -> result``
    ``outputs`` maps each rank in ``collect_from`` to its return value.

Both run in the controller process; they are tested without Ray. The worker group takes care of
the rest: putting each distinct argument object into the object store once (ranks of one DP group
share a shard by reference), launching the calls, waiting with failure detection, and telling
ranks outside ``collect_from`` to drop their return value instead of shipping it back.

Users add protocols by building a :class:`TransferProtocol` with their own two functions and
passing it to :func:`register`, exactly like the built-ins below.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from hybridflow.controller.batch import Batch, BatchError
from hybridflow.mesh import DeviceMesh

__all__ = [
    "BROADCAST",
    "DP_SPLIT",
    "DP_SPLIT_EXACT",
    "PER_RANK",
    "RANK_ZERO",
    "CallArgs",
    "Dispatched",
    "MethodSpec",
    "ProtocolError",
    "TransferProtocol",
    "method_spec",
    "register",
    "split_by_dp",
]


class ProtocolError(ValueError):
    """The call's arguments do not fit the method's protocol (named in the message)."""


@dataclass(frozen=True)
class CallArgs:
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)

    def values(self) -> list[tuple[str, Any]]:
        """(label, value) for every argument, labels for error messages."""
        return [(f"argument {i}", a) for i, a in enumerate(self.args)] + [
            (f"argument {k!r}", v) for k, v in self.kwargs.items()
        ]


@dataclass(frozen=True)
class Dispatched:
    per_rank: list[CallArgs | None]
    collect_from: tuple[int, ...]
    context: Any = None


DispatchFn = Callable[[CallArgs, DeviceMesh], Dispatched]
CollectFn = Callable[[dict[int, Any], DeviceMesh, Any], Any]


@dataclass(frozen=True)
class TransferProtocol:
    name: str
    dispatch: DispatchFn
    collect: CollectFn


@dataclass(frozen=True)
class MethodSpec:
    """What :func:`register` records on a worker method."""

    protocol: TransferProtocol
    blocking: bool = True


_SPEC_ATTRIBUTE = "__hybridflow_method__"
F = TypeVar("F", bound=Callable[..., Any])


def register(protocol: TransferProtocol, *, blocking: bool = True) -> Callable[[F], F]:
    """Expose a worker method to the controller under ``protocol``.

    ``blocking=False`` makes a plain controller call return a future (as ``.submit`` always
    does), for methods meant to overlap with work on other pools, such as generation.
    """
    if not isinstance(protocol, TransferProtocol):
        raise TypeError(f"register() needs a TransferProtocol, got {protocol!r}")

    def mark(fn: F) -> F:
        setattr(fn, _SPEC_ATTRIBUTE, MethodSpec(protocol=protocol, blocking=blocking))
        return fn

    return mark


def method_spec(worker_cls: type, method: str) -> MethodSpec | None:
    """The registration of ``worker_cls.method``, or None when it is not exposed."""
    fn = getattr(worker_cls, method, None)
    spec = getattr(fn, _SPEC_ATTRIBUTE, None)
    return spec if isinstance(spec, MethodSpec) else None


def registered_methods(worker_cls: type) -> list[str]:
    return sorted(name for name in dir(worker_cls) if method_spec(worker_cls, name) is not None)


# -- broadcast ------------------------------------------------------------------------------


def _dispatch_broadcast(call: CallArgs, mesh: DeviceMesh) -> Dispatched:
    return Dispatched([call] * mesh.world_size, tuple(range(mesh.world_size)))


def _collect_all_in_rank_order(outputs: dict[int, Any], mesh: DeviceMesh, context: Any) -> list[Any]:
    return [outputs[rank] for rank in sorted(outputs)]


BROADCAST = TransferProtocol("broadcast", _dispatch_broadcast, _collect_all_in_rank_order)
"""Every rank gets the same arguments; the result is the list of all ranks' returns."""


# -- one item per rank ----------------------------------------------------------------------


def _dispatch_per_rank(call: CallArgs, mesh: DeviceMesh) -> Dispatched:
    n = mesh.world_size
    for label, value in call.values():
        if not isinstance(value, list | tuple) or len(value) != n:
            got = f"{len(value)} items" if isinstance(value, list | tuple) else type(value).__name__
            raise ProtocolError(
                f"per-rank call needs every argument to be a list of {n} items (one per rank); {label} has {got}"
            )
    per_rank: list[CallArgs | None] = [
        CallArgs(tuple(a[r] for a in call.args), {k: v[r] for k, v in call.kwargs.items()}) for r in range(n)
    ]
    return Dispatched(per_rank, tuple(range(n)))


PER_RANK = TransferProtocol("per_rank", _dispatch_per_rank, _collect_all_in_rank_order)
"""Argument lists of world-size length; rank i gets item i. The result is the list of returns."""


# -- split by data-parallel rank (mesh aware) -----------------------------------------------


@dataclass(frozen=True)
class _SplitContext:
    input_rows: int
    pad: int


def _split_dispatcher(pad_allowed: bool) -> DispatchFn:
    def dispatch(call: CallArgs, mesh: DeviceMesh) -> Dispatched:
        batches = [(label, v) for label, v in call.values() if isinstance(v, Batch)]
        if not batches:
            raise ProtocolError("a DP-split call needs at least one Batch argument to split")
        sizes = {label: len(b) for label, b in batches}
        if len(set(sizes.values())) > 1:
            raise ProtocolError(f"Batch arguments of a DP-split call must have the same rows, got {sizes}")
        rows = next(iter(sizes.values()))
        if rows == 0:
            raise ProtocolError("cannot split an empty batch (0 rows) across DP ranks")
        dp = mesh.dp_size
        pad = (-rows) % dp
        if pad and not pad_allowed:
            raise ProtocolError(
                f"a batch of {rows} rows cannot be split evenly across {dp} DP ranks, and this "
                f"method does not allow padding (it would duplicate samples); send a multiple of {dp}"
            )

        def shards_of(value: Any) -> list[Any]:
            if not isinstance(value, Batch):
                return [value] * dp
            try:
                padded, _ = value.pad_to_multiple(dp)
                return padded.split(dp)
            except BatchError as err:
                raise ProtocolError(f"cannot split the batch across {dp} DP ranks: {err}") from err

        arg_shards = [shards_of(a) for a in call.args]
        kwarg_shards = {k: shards_of(v) for k, v in call.kwargs.items()}
        by_dp = [
            CallArgs(tuple(s[i] for s in arg_shards), {k: s[i] for k, s in kwarg_shards.items()})
            for i in range(dp)
        ]
        # Every rank of a DP group (its TP and PP peers) receives the same shard object.
        per_rank: list[CallArgs | None] = [by_dp[mesh.coord(r).dp] for r in range(mesh.world_size)]
        return Dispatched(per_rank, tuple(mesh.output_rank_of_dp()), _SplitContext(rows, pad))

    return dispatch


def _collect_dp_outputs(outputs: dict[int, Any], mesh: DeviceMesh, context: Any) -> Any:
    assert isinstance(context, _SplitContext)
    ordered = [outputs[rank] for rank in mesh.output_rank_of_dp()]
    if all(o is None for o in ordered):
        return None
    if not all(isinstance(o, Batch) for o in ordered):
        # Non-batch results (e.g. metric dicts) come back as one item per DP rank.
        return ordered
    merged = Batch.concat(ordered)
    if context.pad == 0:
        return merged
    padded_rows = context.input_rows + context.pad
    if len(merged) % padded_rows:
        raise ProtocolError(
            f"cannot remove {context.pad} padding rows: the workers returned {len(merged)} rows "
            f"for {padded_rows} padded input rows, not a whole multiple"
        )
    rows_per_input = len(merged) // padded_rows
    return merged.unpad(context.pad * rows_per_input)


def split_by_dp(*, pad: bool = True) -> TransferProtocol:
    """Split every Batch argument into one shard per DP rank of the group's mesh.

    Each rank receives the shard of its DP coordinate, so all TP/PP peers of a DP group get the
    same data; other arguments are broadcast. Results are collected from one output rank per DP
    group (TP rank 0 of the last pipeline stage) and concatenated in DP order. When the rows do
    not divide, the batch is padded by repeating its first rows and the padding is removed from
    the concatenated output (which may hold a whole multiple of the input rows, e.g. n samples
    per prompt, provided each worker keeps row order). ``pad=False`` refuses such batches: use it
    for training updates, where duplicated samples would bias the gradient.
    """
    name = "dp_split" if pad else "dp_split_exact"
    return TransferProtocol(name, _split_dispatcher(pad), _collect_dp_outputs)


DP_SPLIT = split_by_dp(pad=True)
DP_SPLIT_EXACT = split_by_dp(pad=False)


# -- rank zero only -------------------------------------------------------------------------


def _dispatch_rank_zero(call: CallArgs, mesh: DeviceMesh) -> Dispatched:
    return Dispatched([call] + [None] * (mesh.world_size - 1), (0,))


def _collect_rank_zero(outputs: dict[int, Any], mesh: DeviceMesh, context: Any) -> Any:
    return outputs[0]


RANK_ZERO = TransferProtocol("rank_zero", _dispatch_rank_zero, _collect_rank_zero)
"""Only global rank 0 runs the method (e.g. writing a small file); its return is the result."""
