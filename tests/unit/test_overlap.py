"""Overlapped generation and training, the parts that need no cluster: the schedule, the bridge,
the weight push's wire format, staleness and idle figures.

The push is exercised over a real gloo group whose three members are threads of this process
(one sender, two receivers), the same ``Bridge`` and wire code the workers run.
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any, cast

import pytest
import torch
import torch.distributed as dist

from hybridflow.algorithms.prefetch import PrefetchedRollout, ReadyBatch, staleness_metrics
from hybridflow.controller import Batch, WorkerGroup
from hybridflow.controller.bridge import Bridge, bridge_members, new_process_group
from hybridflow.resharding.bucket_broadcast import (
    decode_header,
    encode_header,
    receive_buckets,
    send_buckets,
    split_flat,
)
from hybridflow.trainer.overlap import generation_steps, load_in_flight, save_in_flight

pytestmark = pytest.mark.unit


# --------------------------------------------------------------------------- the schedule


def test_generations_run_at_most_max_staleness_steps_ahead() -> None:
    assert list(generation_steps(1, 0, 5)) == [1]  # synchronous: only the step itself
    assert list(generation_steps(1, 1, 5)) == [1, 2]
    assert list(generation_steps(3, 2, 5)) == [3, 4, 5]
    assert list(generation_steps(5, 2, 5)) == [5]  # nothing beyond the last step


def test_every_sample_is_exactly_min_s_and_k_minus_1_updates_old() -> None:
    """Replays the schedule: generation j waits behind the pushes made before it was submitted."""
    for s in range(4):
        total, submitted_with = 9, {}
        pushed = 0  # version the rollout holds; pushes happen after each step's update
        for step in range(1, total + 1):
            for due in generation_steps(step, s, total):
                submitted_with.setdefault(due, pushed)
            trainer_version = step - 1
            assert trainer_version - submitted_with[step] == min(s, step - 1)
            pushed = step


def test_staleness_histogram_and_its_bound() -> None:
    versions = torch.tensor([3, 3, 2, 3])
    assert staleness_metrics(versions, 3, 2) == {
        "staleness/mean": 0.25,
        "staleness/max": 1.0,
        "staleness/samples/0": 3.0,
        "staleness/samples/1": 1.0,
        "staleness/samples/2": 0.0,
    }
    with pytest.raises(RuntimeError, match=r"samples 0\.\.2 updates behind .*allows 0\.\.1"):
        staleness_metrics(torch.tensor([3, 1]), 3, 1)
    with pytest.raises(RuntimeError, match="-1"):
        staleness_metrics(torch.tensor([4]), 3, 1)  # from a policy the trainer has not made


def test_prefetched_rollout_serves_the_steps_batch_and_syncs_nothing() -> None:
    prompts = Batch.from_dict({"uid": ["a"]})
    generated = Batch.from_dict({"policy_version": torch.tensor([1, 1])})
    view = PrefetchedRollout(cast(WorkerGroup, None), max_staleness=1)
    assert view.staleness_metrics() == {}
    view.serve(prompts, ReadyBatch(generated), trainer_version=2)
    assert view.sync_weights() == 0
    assert view.generate_sequences(prompts) is generated
    assert view.staleness_metrics()["staleness/samples/1"] == 2.0


def test_in_flight_generations_round_trip_through_the_checkpoint_file(tmp_path: Any) -> None:
    prompts = Batch.from_dict({"uid": ["a", "b"]}, meta={"seed": 7})
    responses = Batch.from_dict({"responses": torch.arange(4).reshape(2, 2), "response_text": ["x", "y"]})
    path = tmp_path / "ahead.pt"
    assert load_in_flight(path) == {}
    save_in_flight(path, {3: (prompts, responses)})
    ((step, (p, r)),) = load_in_flight(path).items()
    assert step == 3 and p.meta["seed"] == 7 and list(p.non_tensors["uid"]) == ["a", "b"]
    assert torch.equal(r.tensors["responses"], responses.tensors["responses"])


# --------------------------------------------------------------------------- the bridge and the wire


def test_bridge_members_put_the_sources_rank_0_first() -> None:
    members = bridge_members(3)
    assert [(m.side, m.pool_rank, m.bridge_rank) for m in members] == [
        ("source", 0, 0),
        ("target", 0, 1),
        ("target", 1, 2),
        ("target", 2, 3),
    ]
    with pytest.raises(ValueError, match="target pool"):
        bridge_members(0)


def test_header_round_trip_and_flat_split() -> None:
    bucket = [
        ("w", torch.arange(6.0).reshape(2, 3)),
        ("mask", torch.tensor([True, False])),
        ("h", torch.ones(1, dtype=torch.bfloat16)),
    ]
    entries = decode_header(encode_header(bucket))
    assert entries == [("w", (2, 3), torch.float32), ("mask", (2,), torch.bool), ("h", (1,), torch.bfloat16)]
    flat = torch.cat([t.reshape(-1).view(torch.uint8) for _, t in bucket])
    for (name, tensor), (got_name, got) in zip(bucket, split_flat(flat, entries), strict=True):
        assert name == got_name and torch.equal(tensor, got) and got.dtype == tensor.dtype
    with pytest.raises(ValueError, match="header describes"):
        split_flat(flat[:-1], entries)
    odd = [
        ("flag", torch.tensor([True, False, True])),
        ("x", torch.tensor([1.5, -2.0])),
    ]  # x starts at byte 3
    flat = torch.cat([t.reshape(-1).view(torch.uint8) for _, t in odd])
    assert torch.equal(split_flat(flat, decode_header(encode_header(odd)))[1][1], odd[1][1])
    with pytest.raises(ValueError, match="complex64 cannot be pushed"):
        encode_header([("z", torch.zeros(1, dtype=torch.complex64))])


def test_weight_buckets_reach_every_rollout_rank_over_a_gloo_bridge() -> None:
    world = 3
    master = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False)
    buckets = [
        [("model.embed.weight", torch.randn(5, 4)), ("model.norm.weight", torch.ones(4))],
        [],  # empty buckets are skipped
        [("lm_head.weight", torch.randn(3, 4).to(torch.bfloat16))],
    ]
    results: dict[int, Any] = {}
    trailers: dict[int, dict[str, Any]] = {}
    errors: list[BaseException] = []

    def member(rank: int) -> None:
        try:
            store = master if rank == 0 else dist.TCPStore("127.0.0.1", master.port, world, is_master=False)
            group = new_process_group(
                dist.PrefixStore("bridge/weights", store), rank, world, "gloo", timedelta(seconds=60)
            )
            bridge = Bridge("weights", group, rank, world)
            device = torch.device("cpu")
            if rank == 0:
                trailer = {"plan": {"mode": "full", "version": 2}, "checksums": {"lm_head.weight": -5}}
                results[rank] = send_buckets(
                    bridge, iter(buckets), root=0, device=device, trailer=lambda: trailer
                )
            else:
                received: dict[str, Any] = {}
                results[rank] = [
                    [(name, tensor.clone()) for name, tensor in bucket]
                    for bucket in receive_buckets(bridge, root=0, device=device, trailer=received)
                ]
                trailers[rank] = received
        except BaseException as error:  # surfaced below, not lost in the thread
            errors.append(error)

    threads = [threading.Thread(target=member, args=(rank,)) for rank in range(world)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors, errors
    expected = [bucket for bucket in buckets if bucket]
    assert results[0] == sum(t.numel() * t.element_size() for b in expected for _, t in b)
    for rank in (1, 2):
        assert len(results[rank]) == len(expected)
        for sent, received in zip(expected, results[rank], strict=True):
            assert [n for n, _ in sent] == [n for n, _ in received]
            for (_, a), (_, b) in zip(sent, received, strict=True):
                assert torch.equal(a, b) and a.dtype == b.dtype
        # The sender's fingerprint follows the buckets (hybridflow.resharding.fingerprint).
        assert trailers[rank] == {"plan": {"mode": "full", "version": 2}, "checksums": {"lm_head.weight": -5}}


def test_unknown_bridge_backend_names_the_choices() -> None:
    store = dist.HashStore()
    with pytest.raises(ValueError, match="'gloo' or 'nccl'"):
        new_process_group(store, 0, 1, "mpi", timedelta(seconds=1))
