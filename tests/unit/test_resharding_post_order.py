"""Both ends of every resharding pair post their point-to-point ops in the same order (no processes).

NCCL pairs the point-to-point messages between two ranks by posting order, whatever their tags;
gloo pairs them by tag, so a CPU run never shows a transfer whose two ends disagree (issue 25).
The transfers post exactly the lists that the pure functions of
:mod:`hybridflow.resharding.post_order` (``exchange_posts``, ``exchange_buckets``) and
:func:`hybridflow.resharding.fsdp.fsdp_buckets` return, so these tests check those lists:

* for every layout the planner can choose on 1, 2, 4 and 8 GPUs (``planner.parallel``'s
  enumeration, plus the generation pipeline sizes the spec lets the torch engine use), on both
  the megatron -> generation path (the 3D-HybridEngine and the two baselines) and the FSDP ->
  generation path, whole and in buckets small enough to force many;
* that the executors post those lists and nothing else (their ``torch.distributed`` calls
  recorded, no process group);
* on a simulated wire that pairs messages as NCCL does (by order) or as gloo does (by tag), that
  the transfers deliver every rank its exact generation shard, and that two swapped receives,
  which the by-tag wire forgives, corrupt the by-order result and are reported by the check
  with the pair and the position.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, Literal

import pytest
import torch
import torch.distributed as dist

from hybridflow.mesh import DeviceMesh
from hybridflow.planner.parallel import generation_tensor_sizes, training_layouts
from hybridflow.planner.shapes import ModelShape, Workload
from hybridflow.resharding import (
    DecoderSpec,
    Design,
    ModelLayout,
    PostedOp,
    ReshardingError,
    TransitionPlan,
    build_plan,
    check_post_order,
    decoder_layout,
    exchange_buckets,
    exchange_posts,
    require_post_order,
)
from hybridflow.resharding import transfer as transfer_module
from hybridflow.resharding.fsdp import (
    FSDPPlan,
    FSDPResharder,
    contiguous_tp_ranks,
    fsdp_buckets,
    fsdp_generation_plan,
    fsdp_rows,
)
from hybridflow.resharding.meter import TrafficMeter
from hybridflow.resharding.plan import buffer_kind
from hybridflow.resharding.transfer import Resharder, SubgroupCache, TrainingShard

pytestmark = pytest.mark.unit

WORLDS = (1, 2, 4, 8)
GPUS_PER_NODE = 8

# Heads, layers and vocabulary that let t and p reach 8 (the first) and a GQA model with
# replicated biases whose two key/value heads stop t at 2 (the second).
MODELS = {
    "qwen2-8h-8l": ModelShape(
        "qwen2-8h-8l",
        DecoderSpec(
            arch="qwen2",
            vocab_size=128,
            hidden_size=64,
            intermediate_size=128,
            num_layers=8,
            num_heads=8,
            num_kv_heads=8,
            head_dim=8,
            rms_norm_eps=1e-6,
            rope_theta=10_000.0,
            max_position_embeddings=512,
            qkv_bias=True,
        ),
    ),
    "llama-gqa-bias": ModelShape(
        "llama-gqa-bias",
        DecoderSpec(
            arch="llama",
            vocab_size=96,
            hidden_size=64,
            intermediate_size=96,
            num_layers=4,
            num_heads=8,
            num_kv_heads=2,
            head_dim=8,
            rms_norm_eps=1e-6,
            rope_theta=10_000.0,
            max_position_embeddings=512,
            qkv_bias=False,
            o_bias=True,
            mlp_bias=True,
        ),
    ),
}

# (bucket_bytes, wire dtype, itemsize): one parameter per bucket, a few per bucket, the whole
# model in one (the job's 64 MiB buckets hold a tiny model whole).
BUCKETINGS = ((1, "bfloat16", 2), (8192, "bfloat16", 2), (64 << 20, "float32", 4))


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def _workload(
    model: ModelShape, backend: Literal["fsdp", "megatron"], engine: Literal["torch", "vllm"]
) -> Workload:
    return Workload(
        actor=model, sequences=8, prompt_tokens=16, response_tokens=16, backend=backend, rollout_engine=engine
    )


@dataclass(frozen=True)
class MegatronTransition:
    """Training ``p-t`` on ``world`` ranks to generation ``p_g-t_g``."""

    model: str
    world: int
    p: int
    t: int
    p_g: int
    t_g: int

    def train(self) -> DeviceMesh:
        return DeviceMesh.training(self.world, pp=self.p, tp=self.t)

    def describe(self) -> str:
        return f"{self.model} on {self.world}: p{self.p}-t{self.t} -> p{self.p_g}-t{self.t_g}"


@dataclass(frozen=True)
class FSDPTransition:
    """FSDP2 over ``world`` ranks to generation TP ``t_g``, TP rank per rank ``tp_ranks``."""

    model: str
    world: int
    t_g: int
    tp_ranks: tuple[int, ...]

    def describe(self) -> str:
        return f"{self.model} on {self.world}: FSDP -> t_g {self.t_g}, TP ranks {self.tp_ranks}"


def megatron_transitions(model: str, world: int) -> list[MegatronTransition]:
    """The planner's megatron layouts and generation TP sizes; generation PP as the spec allows.

    The planner proposes ``p_g = 1``; the spec lets the torch engine (the 3D-HybridEngine's
    ``HybridRolloutWorker``) also generate with any ``rollout.pipelineParallelSize`` dividing
    the training's, and vLLM only with 1.
    """
    shape = MODELS[model]
    found: set[MegatronTransition] = set()
    for engine in ("torch", "vllm"):
        workload = _workload(shape, "megatron", engine)
        for layout in training_layouts(shape, world, GPUS_PER_NODE, workload):
            for t_g in generation_tensor_sizes(shape, layout, GPUS_PER_NODE, workload):
                for p_g in _divisors(layout.pp) if engine == "torch" else [1]:
                    found.add(MegatronTransition(model, world, layout.pp, layout.tp, p_g, t_g))
    return sorted(found, key=lambda x: (x.p, x.t, x.p_g, x.t_g))


def fsdp_transitions(model: str, world: int) -> list[FSDPTransition]:
    """The planner's FSDP generation TP sizes, with the job's strided TP groups and vLLM's contiguous ones."""
    shape = MODELS[model]
    found: set[FSDPTransition] = set()
    for engine in ("torch", "vllm"):
        workload = _workload(shape, "fsdp", engine)
        for layout in training_layouts(shape, world, GPUS_PER_NODE, workload):
            for t_g in generation_tensor_sizes(shape, layout, GPUS_PER_NODE, workload):
                job = tuple(coord.tp for coord in DeviceMesh.fsdp_generation(world, tp=t_g).coords)
                for tp_ranks in (job, contiguous_tp_ranks(world, t_g)):
                    found.add(FSDPTransition(model, world, t_g, tp_ranks))
    return sorted(found, key=lambda x: (x.t_g, x.tp_ranks))


def _layout(model: str, itemsize: int = 4) -> ModelLayout:
    return decoder_layout(MODELS[model].decoder, itemsize)


def _plans(transition: MegatronTransition) -> Iterator[TransitionPlan]:
    """The HybridFlow plan (it must build), then each baseline where the model splits its way."""
    layout, train = _layout(transition.model), transition.train()
    yield build_plan("hybridflow", layout, train, pp=transition.p_g, tp=transition.t_g)
    for design in ("vanilla", "allgather"):
        try:
            yield build_plan(design, layout, train, pp=transition.p_g, tp=transition.t_g)
        except ReshardingError:
            continue  # e.g. allgather's t*d-way split that the heads do not allow


def _fsdp_plan(transition: FSDPTransition, itemsize: int = 4) -> FSDPPlan:
    return fsdp_generation_plan(
        _layout(transition.model, itemsize), transition.world, transition.t_g, transition.tp_ranks
    )


def _flat(buckets: Sequence[Any]) -> tuple[PostedOp[Any], ...]:
    return tuple(post for bucket in buckets for post in bucket.posts)


CASES = [(model, world) for model in MODELS for world in WORLDS]


# --------------------------------------------------------------------------- the enumeration


def test_the_enumeration_reaches_every_kind_of_layout() -> None:
    qwen8 = megatron_transitions("qwen2-8h-8l", 8)
    shapes = {(x.p, x.t, x.p_g, x.t_g) for x in qwen8}
    assert {(1, 8, 1, 1), (1, 8, 1, 8), (8, 1, 1, 1), (8, 1, 4, 1), (2, 4, 2, 2), (1, 4, 1, 2)} <= shapes
    assert len(qwen8) == 35  # sum over (p, t) of divisors(p) x divisors(t), p*t | 8
    assert max(x.t for x in megatron_transitions("llama-gqa-bias", 8)) == 2  # two key/value heads
    assert {x.t_g for x in fsdp_transitions("qwen2-8h-8l", 8)} == {1, 2, 4, 8}
    assert {x.t_g for x in fsdp_transitions("llama-gqa-bias", 8)} == {1, 2}
    assert len(megatron_transitions("qwen2-8h-8l", 1)) == len(fsdp_transitions("qwen2-8h-8l", 1)) == 1


# --------------------------------------------------------------------------- both ends agree


@pytest.mark.parametrize(("model", "world"), CASES)
def test_resharder_exchange_posts_agree_on_every_layout(model: str, world: int) -> None:
    for transition in megatron_transitions(model, world):
        for plan in _plans(transition):
            posts = {rank: exchange_posts(plan, rank, "float32") for rank in range(world)}
            require_post_order(posts, what=f"{plan.design} {transition.describe()}")
            for rank in range(world):  # every block of every message of the plan is one send, once
                me = plan.rank(rank)
                sent = [(m.dst, b) for m in me.sends for b in me.training if buffer_kind(b) == m.kind]
                assert [(p.peer, p.payload[0]) for p in posts[rank] if p.op == "send"] == sent


@pytest.mark.parametrize(("model", "world"), CASES)
def test_resharder_bucket_posts_agree_on_every_layout(model: str, world: int) -> None:
    for transition in megatron_transitions(model, world):
        layout = _layout(transition.model)
        plan = build_plan("hybridflow", layout, transition.train(), pp=transition.p_g, tp=transition.t_g)
        for bucket_bytes, dtype, itemsize in BUCKETINGS:
            buckets = {
                rank: exchange_buckets(plan, rank, bucket_bytes=bucket_bytes, itemsize=itemsize, dtype=dtype)
                for rank in range(world)
            }
            posts = {rank: _flat(found) for rank, found in buckets.items()}
            require_post_order(posts, what=f"buckets of {bucket_bytes} B, {transition.describe()}")
            if bucket_bytes == 1:  # one generation parameter per bucket
                assert all(len(found) == len(plan.rank(rank).generation) for rank, found in buckets.items())
            # The buckets move what the whole-model exchange moves, cut differently.
            for rank in range(world):
                bucketed = sorted((p.op, p.peer, p.tag) for p in posts[rank])
                assert bucketed == sorted((p.op, p.peer, p.tag) for p in exchange_posts(plan, rank, dtype))


@pytest.mark.parametrize(("model", "world"), CASES)
def test_fsdp_bucket_posts_agree_on_every_layout(model: str, world: int) -> None:
    for transition in fsdp_transitions(model, world):
        for bucket_bytes, dtype, itemsize in BUCKETINGS:
            plan = _fsdp_plan(transition, itemsize)
            buckets = {
                rank: fsdp_buckets(plan, rank, bucket_bytes=bucket_bytes, itemsize=itemsize, dtype=dtype)
                for rank in range(world)
            }
            posts = {rank: _flat(found) for rank, found in buckets.items()}
            require_post_order(posts, what=f"buckets of {bucket_bytes} B, {transition.describe()}")
            received = sum(post.numel for post in posts[0] if post.op == "recv") * itemsize
            assert received == plan.bytes_received(0)
            if bucket_bytes == 1:
                assert len(buckets[0]) == len(plan.layout.params) > 1


# --------------------------------------------------------------------------- the check itself


def _swap_two_receives(ops: Sequence[PostedOp[Any]]) -> tuple[int, tuple[PostedOp[Any], ...]]:
    """Swap the first two receives of equal size from one peer; returns the first's position in that pair."""
    ops = list(ops)
    by_peer: dict[int, list[int]] = defaultdict(list)
    for index, op in enumerate(ops):
        if op.op == "recv":
            by_peer[op.peer].append(index)
    for indices in by_peer.values():
        for i, first in enumerate(indices):
            for second in indices[i + 1 :]:
                if ops[first].numel == ops[second].numel:
                    ops[first], ops[second] = ops[second], ops[first]
                    return i, tuple(ops)
    raise AssertionError("no two receives from one peer to swap")


def test_two_swapped_receives_are_reported_with_the_pair_and_position() -> None:
    transition = MegatronTransition("qwen2-8h-8l", 8, 1, 4, 1, 2)
    plan = build_plan("hybridflow", _layout(transition.model), transition.train(), pp=1, tp=2)
    posts = {rank: exchange_posts(plan, rank, "float32") for rank in range(8)}
    assert check_post_order(posts) == []
    position, posts[3] = _swap_two_receives(posts[3])
    (mismatch,) = check_post_order(posts)
    assert (mismatch.src, mismatch.dst, mismatch.position) == (2, 3, position)
    assert mismatch.send is not None and mismatch.recv is not None
    assert mismatch.send.payload != mismatch.recv.payload
    assert mismatch.send.numel == mismatch.recv.numel  # same size: NCCL would not even fail
    with pytest.raises(ReshardingError) as raised:
        require_post_order(posts, what="t4 -> t2")
    message = str(raised.value)
    assert f"rank 2 -> rank 3, op {position} of the pair" in message
    assert mismatch.send.payload[0].name in message and mismatch.recv.payload[0].name in message


def test_a_missing_op_a_dtype_and_a_bucket_cut_that_differ_are_reported() -> None:
    transition = FSDPTransition("qwen2-8h-8l", 4, 2, (0, 0, 1, 1))
    plan = _fsdp_plan(transition)

    def posts_of(
        rank: int, *, bucket_bytes: int = 8192, dtype: str = "bfloat16"
    ) -> tuple[PostedOp[Any], ...]:
        return _flat(fsdp_buckets(plan, rank, bucket_bytes=bucket_bytes, itemsize=2, dtype=dtype))

    posts = {rank: posts_of(rank) for rank in range(4)}
    assert check_post_order(posts) == []

    dropped = dict(posts)
    last_recv = max(i for i, op in enumerate(posts[1]) if op.op == "recv")
    dropped[1] = posts[1][:last_recv] + posts[1][last_recv + 1 :]
    (mismatch,) = check_post_order(dropped)
    assert (mismatch.src, mismatch.dst) == (posts[1][last_recv].peer, 1) and mismatch.recv is None
    assert mismatch.send is not None and mismatch.send.payload == posts[1][last_recv].payload
    assert "rank 1 posts nothing" in mismatch.describe()

    cast = {**posts, 2: posts_of(2, dtype="float16")}  # rank 2 sends and receives in another dtype
    pairs = {(rank, op.peer) for rank, ops in posts.items() for op in ops if op.op == "send"}
    assert {(m.src, m.dst) for m in check_post_order(cast)} == {pair for pair in pairs if 2 in pair}

    recut = {**posts, 0: posts_of(0, bucket_bytes=1)}  # rank 0 disagrees about the bucket size
    found = check_post_order(recut)
    assert found and all(0 in (m.src, m.dst) for m in found)
    assert any(m.send is not None and m.recv is not None and m.send.batch != m.recv.batch for m in found)


# --------------------------------------------------------------------------- the executors post the lists


@dataclass
class RecordedOp:
    """Stands in for ``dist.P2POp`` (which needs a process group): what an executor hands over."""

    op: Callable[..., Any]
    tensor: torch.Tensor
    peer: int
    group: Any = None
    tag: int = 0


class NoGroups(SubgroupCache):
    def get(self, partition: Sequence[Sequence[int]]) -> Any:
        return None


class Wire:
    """Delivers point-to-point ops between threads, paired by order (NCCL) or by tag (gloo).

    A send is buffered when posted; a receive waits for its match. By order, the k-th receive
    ``b`` posts from ``a`` takes the k-th send ``a`` posted to ``b``; by tag, the oldest send
    from ``a`` to ``b`` with the receive's tag. Sizes and dtypes must agree, or it raises (NCCL
    would fail or hang); a receive that is never matched raises after a timeout (a hang).
    """

    def __init__(self, pairing: Literal["order", "tag"]) -> None:
        self.pairing = pairing
        self.sent: dict[tuple[int, int], list[tuple[int, torch.Tensor] | None]] = defaultdict(list)
        self.posted: dict[int, list[tuple[str, int, int, int, str]]] = defaultdict(list)
        self.cond = threading.Condition()

    def _take(self, src: int, dst: int, tag: int) -> torch.Tensor | None:
        queue = self.sent[(src, dst)]
        for index, item in enumerate(queue):
            if item is not None and (self.pairing == "order" or item[0] == tag):
                queue[index] = None
                return item[1]
        return None

    def meter(self, rank: int) -> TrafficMeter:
        wire = self

        class WireMeter(TrafficMeter):
            def batch_isend_irecv(self, ops: Sequence[Any]) -> list[Any]:
                with wire.cond:
                    for op in ops:
                        kind = "send" if op.op is dist.isend else "recv"
                        dtype = str(op.tensor.dtype).removeprefix("torch.")
                        wire.posted[rank].append((kind, op.peer, op.tag, op.tensor.numel(), dtype))
                        if kind == "send":
                            wire.sent[(rank, op.peer)].append((op.tag, op.tensor.detach().clone()))
                    wire.cond.notify_all()
                for op in ops:
                    if op.op is dist.isend:
                        continue
                    with wire.cond:
                        found: list[torch.Tensor] = []

                        def ready(op: Any = op, found: list[torch.Tensor] = found) -> bool:
                            tensor = wire._take(op.peer, rank, op.tag)
                            if tensor is not None:
                                found.append(tensor)
                            return bool(found)

                        if not wire.cond.wait_for(ready, timeout=10):
                            raise TimeoutError(f"rank {rank}: a receive from rank {op.peer} never matched")
                    sent = found[0]
                    if (sent.numel(), sent.dtype) != (op.tensor.numel(), op.tensor.dtype):
                        raise RuntimeError(
                            f"rank {rank}: received {sent.numel()} x {sent.dtype} into {op.tensor.numel()} x {op.tensor.dtype}"
                        )
                    op.tensor.copy_(sent.view(op.tensor.shape))
                return []

        return WireMeter()


def _signature(posts: Sequence[PostedOp[Any]]) -> list[tuple[str, int, int, int, str]]:
    return [(post.op, post.peer, post.tag, post.numel, post.dtype) for post in posts]


def _numbered(layout: ModelLayout) -> dict[str, torch.Tensor]:
    """Full parameters of small integers (exact in bf16), a differently shifted sequence for each."""
    return {
        param.name: (torch.arange(param.numel, dtype=torch.float32) + 7 * index)
        .remainder(251)
        .view(param.shape)
        for index, param in enumerate(layout)
    }


def _run_ranks(world: int, body: Callable[[int], Any]) -> list[Any]:
    with ThreadPoolExecutor(max_workers=world) as pool:
        return [future.result() for future in [pool.submit(body, rank) for rank in range(world)]]


RESHARDER_CASES: list[tuple[Design, MegatronTransition]] = [
    ("hybridflow", MegatronTransition("qwen2-8h-8l", 8, 1, 4, 1, 2)),
    ("hybridflow", MegatronTransition("qwen2-8h-8l", 8, 2, 2, 1, 1)),  # replicated norms cross stages
    ("hybridflow", MegatronTransition("llama-gqa-bias", 8, 2, 2, 2, 1)),
    ("allgather", MegatronTransition("qwen2-8h-8l", 4, 1, 2, 1, 1)),
]


@pytest.mark.parametrize(
    ("design", "transition"), RESHARDER_CASES, ids=[f"{d} {x.describe()}" for d, x in RESHARDER_CASES]
)
def test_resharder_posts_its_list_and_by_order_pairing_delivers_the_exact_shard(
    design: Design, transition: MegatronTransition, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(dist, "P2POp", RecordedOp)
    layout = _layout(transition.model)
    plan = build_plan(design, layout, transition.train(), pp=transition.p_g, tp=transition.t_g)
    full = _numbered(layout)
    wire = Wire("order")

    def rank_body(rank: int) -> dict[str, torch.Tensor]:
        resharder = Resharder(plan, rank, NoGroups(), wire.meter(rank))
        shard = TrainingShard.from_full(plan.rank(rank).training, full)
        generation, _ = resharder.to_generation(shard, measure_memory=False)
        return {name: generation.tensor(name).clone() for name in generation.names()}

    results = _run_ranks(transition.world, rank_body)
    for rank, got in enumerate(results):
        assert wire.posted[rank] == _signature(exchange_posts(plan, rank, "float32"))
        for want, _ in plan.rank(rank).generation:
            assert torch.equal(got[want.name], full[want.name][want.index()]), (rank, want.name)

    if design != "hybridflow":
        return
    wire = Wire("order")

    def bucket_body(rank: int) -> dict[str, torch.Tensor]:
        resharder = Resharder(plan, rank, NoGroups(), wire.meter(rank))
        shard = TrainingShard.from_full(plan.rank(rank).training, full)
        got = {}
        for bucket in resharder.generation_buckets(shard, bucket_bytes=8192, dtype=torch.bfloat16):
            got.update({name: bucket.tensor(name).clone() for name in bucket.names()})
        return got

    results = _run_ranks(transition.world, bucket_body)
    for rank, got in enumerate(results):
        expected = exchange_buckets(plan, rank, bucket_bytes=8192, itemsize=2, dtype="bfloat16")
        assert wire.posted[rank] == _signature(_flat(expected))
        for want, _ in plan.rank(rank).generation:
            assert torch.equal(got[want.name], full[want.name][want.index()].to(torch.bfloat16)), (
                rank,
                want.name,
            )


FSDP_CASES = [
    FSDPTransition("qwen2-8h-8l", 4, 2, (0, 0, 1, 1)),  # the job's strided TP groups
    FSDPTransition("llama-gqa-bias", 4, 2, (0, 1, 0, 1)),  # vLLM's contiguous ones
]


@pytest.mark.parametrize("transition", FSDP_CASES, ids=[x.describe() for x in FSDP_CASES])
def test_fsdp_resharder_posts_its_list_and_by_order_pairing_delivers_the_exact_block(
    transition: FSDPTransition, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(dist, "P2POp", RecordedOp)
    plan = _fsdp_plan(transition, itemsize=2)
    full = _numbered(plan.layout)
    wire = Wire("order")

    def rank_body(rank: int) -> dict[str, torch.Tensor]:
        resharder = FSDPResharder(plan, rank, meter=wire.meter(rank))
        local = {
            name: tensor[slice(*fsdp_rows(tensor.shape[0], transition.world, rank))].clone()
            for name, tensor in full.items()
        }
        got = {}
        for bucket in resharder.generation_buckets(local, bucket_bytes=8192, dtype=torch.bfloat16):
            got.update({name: tensor.clone() for name, tensor in bucket})
        return got

    results = _run_ranks(transition.world, rank_body)
    for rank, got in enumerate(results):
        expected = fsdp_buckets(plan, rank, bucket_bytes=8192, itemsize=2, dtype="bfloat16")
        assert wire.posted[rank] == _signature(_flat(expected))
        for want in plan.generation[rank]:
            assert torch.equal(got[want.name], full[want.name][want.index()].to(torch.bfloat16)), (
                rank,
                want.name,
            )


def test_swapped_receives_pass_on_tags_corrupt_by_order_and_are_caught_by_the_check(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 25 in one test: what gloo forgives and NCCL does not, and that the check sees it first."""
    monkeypatch.setattr(dist, "P2POp", RecordedOp)
    transition = MegatronTransition("qwen2-8h-8l", 2, 1, 2, 1, 1)  # rank 1 receives rank 0's half
    layout = _layout(transition.model)
    plan = build_plan("hybridflow", layout, transition.train(), pp=1, tp=1)
    original = exchange_posts

    def swapped(plan: TransitionPlan, rank: int, dtype: str) -> tuple[PostedOp[Any], ...]:
        posts = original(plan, rank, dtype)
        return _swap_two_receives(posts)[1] if rank == 1 else posts

    monkeypatch.setattr(transfer_module, "exchange_posts", swapped)
    found = check_post_order({rank: swapped(plan, rank, "float32") for rank in range(2)})
    assert [(m.src, m.dst, m.position) for m in found] == [(0, 1, 0)]
    full = _numbered(layout)

    def run(pairing: Literal["order", "tag"]) -> dict[str, torch.Tensor]:
        wire = Wire(pairing)

        def body(rank: int) -> dict[str, torch.Tensor]:
            resharder = Resharder(plan, rank, NoGroups(), wire.meter(rank))
            shard = TrainingShard.from_full(plan.rank(rank).training, full)
            generation, _ = resharder.to_generation(shard, measure_memory=False)
            return {name: generation.tensor(name).clone() for name in generation.names()}

        return _run_ranks(2, body)[1]

    def wrong(got: dict[str, torch.Tensor]) -> set[str]:
        wants = [want for want, _ in plan.rank(1).generation]
        return {want.name for want in wants if not torch.equal(got[want.name], full[want.name][want.index()])}

    assert wrong(run("tag")) == set()  # gloo pairs by tag: every CPU test passes
    swapped_names = {m.send.payload[0].name for m in found if m.send is not None} | {
        m.recv.payload[0].name for m in found if m.recv is not None
    }
    assert swapped_names == {"model.embed_tokens.weight", "model.layers.0.mlp.gate_proj.weight"}  # 64 x 64
    assert wrong(run("order")) == swapped_names  # NCCL pairs by order: two tensors silently exchanged


def test_posted_op_describes_itself_for_people() -> None:
    transition = MegatronTransition("qwen2-8h-8l", 2, 1, 2, 1, 1)
    plan = build_plan("hybridflow", _layout(transition.model), transition.train(), pp=1, tp=1)
    first = exchange_posts(plan, 1, "float32")[0]
    assert first.describe() == (f"send in batch 0, tag 0: {first.payload[0].name} ({first.numel} x float32)")
    assert replace(first, op="recv").matches(first)
