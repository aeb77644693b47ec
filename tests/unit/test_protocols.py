"""Dispatch and collect are pure functions of (call, mesh): tested here without Ray."""

from typing import Any

import pytest
import torch

from hybridflow.controller.batch import Batch
from hybridflow.controller.protocols import (
    BROADCAST,
    DP_SPLIT,
    DP_SPLIT_EXACT,
    PER_RANK,
    RANK_ZERO,
    CallArgs,
    Dispatched,
    ProtocolError,
    TransferProtocol,
    method_spec,
    register,
)
from hybridflow.mesh import DeviceMesh

pytestmark = pytest.mark.unit


def rows(n: int) -> Batch:
    return Batch.from_dict({"x": torch.arange(n), "tag": [f"r{i}" for i in range(n)]})


def run(protocol: TransferProtocol, mesh: DeviceMesh, fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Play the worker group without Ray: run ``fn`` per rank, collect like the controller does."""
    d = protocol.dispatch(CallArgs(args, kwargs), mesh)
    outputs = {r: fn(r, *c.args, **c.kwargs) for r, c in enumerate(d.per_rank) if c is not None}
    return protocol.collect({r: outputs[r] for r in d.collect_from}, mesh, d.context)


def test_broadcast_sends_the_same_arguments_everywhere() -> None:
    mesh = DeviceMesh.data_parallel(3)
    d = BROADCAST.dispatch(CallArgs((1,), {"k": 2}), mesh)
    assert all(c == CallArgs((1,), {"k": 2}) for c in d.per_rank)
    assert run(BROADCAST, mesh, lambda r, a, k: r * 10 + a + k, 1, k=2) == [3, 13, 23]


def test_per_rank_gives_item_i_to_rank_i_and_checks_lengths() -> None:
    mesh = DeviceMesh.data_parallel(2)
    assert run(PER_RANK, mesh, lambda r, a, b: (r, a, b), ["a0", "a1"], b=["b0", "b1"]) == [
        (0, "a0", "b0"),
        (1, "a1", "b1"),
    ]
    with pytest.raises(ProtocolError, match=r"list of 2 items.*argument 0 has 3 items"):
        PER_RANK.dispatch(CallArgs((["a", "b", "c"],)), mesh)
    with pytest.raises(ProtocolError, match="argument 'b' has int"):
        PER_RANK.dispatch(CallArgs((), {"b": 5}), mesh)


def test_dp_split_even_batch_round_trips() -> None:
    mesh = DeviceMesh.data_parallel(4)
    out = run(DP_SPLIT, mesh, lambda r, b: b.with_fields(y=b["x"] * 2), rows(8))
    assert out["y"].tolist() == [2 * i for i in range(8)]
    assert out["tag"].tolist() == [f"r{i}" for i in range(8)]


def test_dp_split_pads_uneven_batches_and_removes_the_padding() -> None:
    mesh = DeviceMesh.data_parallel(4)
    seen: list[int] = []

    def worker(rank: int, b: Batch) -> Batch:
        seen.append(len(b))
        return b.with_fields(y=b["x"] + 100)

    out = run(DP_SPLIT, mesh, worker, rows(10))
    assert seen == [3, 3, 3, 3]
    assert out["y"].tolist() == [i + 100 for i in range(10)]


def test_dp_split_unpads_outputs_with_several_rows_per_input() -> None:
    """A worker that returns n samples per prompt (rows kept in order) still gets its padding removed."""
    mesh = DeviceMesh.data_parallel(4)
    out = run(DP_SPLIT, mesh, lambda r, b: b.repeat(3), rows(5))
    assert out["x"].tolist() == [i for i in range(5) for _ in range(3)]


def test_dp_split_rejects_output_that_cannot_be_unpadded() -> None:
    mesh = DeviceMesh.data_parallel(2)
    with pytest.raises(ProtocolError, match="cannot remove 1 padding rows"):
        run(DP_SPLIT, mesh, lambda r, b: b.rows(slice(0, 1)), rows(3))


def test_exact_split_refuses_padding() -> None:
    with pytest.raises(ProtocolError, match="10 rows cannot be split evenly across 4 DP ranks"):
        DP_SPLIT_EXACT.dispatch(CallArgs((rows(10),)), DeviceMesh.data_parallel(4))


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (CallArgs((1, 2)), "at least one Batch"),
        (CallArgs((rows(0),)), "empty batch"),
        (CallArgs((rows(4), rows(5))), "same rows"),
    ],
)
def test_dp_split_errors(call: CallArgs, message: str) -> None:
    with pytest.raises(ProtocolError, match=message):
        DP_SPLIT.dispatch(call, DeviceMesh.data_parallel(2))


def test_mesh_aware_split_shares_shards_within_a_dp_group_and_collects_tp0_of_last_stage() -> None:
    mesh = DeviceMesh.training(8, pp=2, tp=2)  # dp = 2
    d = DP_SPLIT.dispatch(CallArgs((rows(4), "flag")), mesh)
    for rank in range(8):
        call = d.per_rank[rank]
        assert call is not None
        assert call.args[0]["x"].tolist() == ([0, 1] if mesh.coord(rank).dp == 0 else [2, 3])
        assert call.args[1] == "flag"
    # the same object for all peers of a DP group, so the object store holds it once
    assert d.per_rank[0] is d.per_rank[1] is d.per_rank[4] is d.per_rank[5]
    assert d.collect_from == (4, 6)

    def worker(rank: int, b: Batch, flag: str) -> Batch | None:
        c = mesh.coord(rank)
        if c.tp != 0 or c.pp != 1:
            return None  # only the output ranks hold the result
        return b.with_fields(who=torch.full((len(b),), rank))

    out = run(DP_SPLIT, mesh, worker, rows(4), "flag")
    assert out["who"].tolist() == [4, 4, 6, 6]


def test_generation_mesh_split_uses_generation_dp_ranks() -> None:
    gen = DeviceMesh.generation(DeviceMesh.training(8, tp=4), tp=2)  # dp = 4
    d = DP_SPLIT.dispatch(CallArgs((rows(8),)), gen)
    shard_of = {r: d.per_rank[r].args[0]["x"].tolist() for r in range(8)}  # type: ignore[union-attr]
    for group in gen.groups("tp"):
        assert len({tuple(shard_of[r]) for r in group}) == 1
    assert sorted(x for r in d.collect_from for x in shard_of[r]) == list(range(8))


def test_non_batch_outputs_come_back_per_dp_rank() -> None:
    mesh = DeviceMesh.data_parallel(2)
    assert run(DP_SPLIT, mesh, lambda r, b: {"n": len(b)}, rows(4)) == [{"n": 2}, {"n": 2}]
    assert run(DP_SPLIT, mesh, lambda r, b: None, rows(4)) is None


def test_rank_zero_runs_only_on_rank_zero() -> None:
    mesh = DeviceMesh.data_parallel(3)
    d = RANK_ZERO.dispatch(CallArgs(("x",)), mesh)
    assert d.per_rank[1:] == [None, None]
    assert run(RANK_ZERO, mesh, lambda r, x: (r, x), "x") == (0, "x")


def test_user_protocol_registers_like_the_builtins() -> None:
    """A custom protocol: the last rank only, result doubled by the collector."""

    def dispatch(call: CallArgs, mesh: DeviceMesh) -> Dispatched:
        last = mesh.world_size - 1
        return Dispatched([None] * last + [call], (last,))

    last_rank = TransferProtocol(
        "last_rank", dispatch, lambda outputs, mesh, ctx: 2 * next(iter(outputs.values()))
    )

    class W:
        @register(last_rank, blocking=False)
        def f(self) -> int:
            return 1

    spec = method_spec(W, "f")
    assert spec is not None and spec.protocol is last_rank and not spec.blocking
    assert run(last_rank, DeviceMesh.data_parallel(4), lambda r: r) == 6
    assert method_spec(W, "__init__") is None


def test_register_needs_a_protocol() -> None:
    with pytest.raises(TypeError, match="TransferProtocol"):
        register("broadcast")  # type: ignore[arg-type]
