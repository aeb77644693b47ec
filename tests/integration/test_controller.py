"""The single controller on a local Ray with 8 simulated GPUs: pools, colocation, protocols, failures."""

from __future__ import annotations

import time

import pytest
import ray
import torch
from controller_roles import BrokenConstructor, Probe

from hybridflow.controller import (
    Batch,
    CallTimeoutError,
    DeviceMesh,
    PlacementError,
    ProtocolError,
    ResourcePool,
    RoleMappingError,
    RoleSpec,
    WorkerDiedError,
    WorkerError,
    deploy,
)

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("ray_cluster")]

LEFT = ResourcePool("left", nodes=2, gpus_per_node=2, cpus_per_gpu=0.1)
RIGHT = ResourcePool("right", nodes=1, gpus_per_node=4, cpus_per_gpu=0.1)


def gpus_available(expected: float = 8.0, wait_seconds: float = 20.0) -> float:
    """Free GPUs once they reach ``expected`` (or after ``wait_seconds``): resource views lag removals."""
    deadline = time.monotonic() + wait_seconds
    while True:
        free = float(ray.available_resources().get("GPU", 0.0))
        if free >= expected or time.monotonic() > deadline:
            return free
        time.sleep(0.1)


def test_split_pools_run_separate_worlds_in_parallel() -> None:
    roles = {
        "actor": RoleSpec(Probe, "left", mesh=DeviceMesh.training(4, tp=2), kwargs={"offset": 0.5}),
        "critic": RoleSpec(Probe, "right"),
    }
    with deploy([LEFT, RIGHT], roles, placement_timeout_seconds=30) as d:
        assert not d.colocated("actor", "critic")
        actor_info, critic_info = d["actor"].whoami(), d["critic"].whoami()
        assert [i["rank"] for i in actor_info] == [0, 1, 2, 3]
        assert {i["world"] for i in actor_info + critic_info} == {4}
        assert {i["backend"] for i in actor_info} == {"gloo"}
        assert [i["env_rank"] for i in critic_info] == ["0", "1", "2", "3"]
        assert [(i["coord"].tp, i["coord"].dp) for i in actor_info] == [(0, 0), (1, 0), (0, 1), (1, 1)]
        assert {i["pid"] for i in actor_info}.isdisjoint({i["pid"] for i in critic_info})
        # each pool is its own torch.distributed world: 0+1+2+3 in both
        assert d["actor"].all_reduce_rank() == [6.0] * 4
        assert d["critic"].all_reduce_rank() == [6.0] * 4

        # mesh-aware split: 2 DP groups of 2 TP ranks; 10 rows pad to 10 (even), 7 rows pad to 8
        batch = Batch.from_dict({"x": torch.arange(7), "text": [str(i) for i in range(7)]})
        out = d["actor"].add_offset(batch)
        assert out["y"].tolist() == [i + 0.5 for i in range(7)]
        assert out["dp"].tolist() == [0, 0, 0, 0, 1, 1, 1]
        assert out["text"].tolist() == [str(i) for i in range(7)]
        assert d["critic"].add_offset(batch)["dp"].tolist() == [0, 0, 1, 1, 2, 2, 3]

        assert d["critic"].take([1, 2, 3, 4]) == [100, 201, 302, 403]
        assert d["critic"].only_rank_zero() == 0
        assert d["critic"].train_step(Batch.from_dict({"x": torch.arange(8)})) == [{"rows": 2.0}] * 4
        with pytest.raises(ProtocolError, match="10 rows cannot be split evenly across 4 DP ranks"):
            d["critic"].train_step(Batch.from_dict({"x": torch.arange(10)}))
        with pytest.raises(AttributeError, match="no method 'not_exposed' registered"):
            d["critic"].not_exposed()

        # non-blocking calls on different pools overlap in time
        actor_future = d["actor"].sleep_and_time(1.0)
        critic_future = d["critic"].sleep_and_time.submit(1.0)
        spans = actor_future.result() + critic_future.result()
        assert max(start for start, _ in spans) < min(end for _, end in spans)
    assert gpus_available() == 8.0


def test_colocated_roles_share_one_process_per_gpu() -> None:
    roles = {
        "actor": RoleSpec(Probe, "left", kwargs={"offset": 1.0}),
        "reference": RoleSpec(Probe, "left", kwargs={"offset": 2.0}),
    }
    with deploy([LEFT, RIGHT], roles, placement_timeout_seconds=30) as d:
        assert d.colocated("actor", "reference")
        actor, ref = d["actor"].whoami(), d["reference"].whoami()
        assert [a["pid"] for a in actor] == [r["pid"] for r in ref]
        # two nodes of two GPUs: local ranks restart per node unless both landed on one Ray node
        assert sorted(a["local_rank"] for a in actor) in ([0, 0, 1, 1], [0, 1, 2, 3])
        # Held to a GPU node's view (the suite emulates it, hybridflow/devices.py): each worker
        # sees its own one device, so LOCAL_RANK is 0 and the node-local rank is kept apart.
        assert [a["env_local_rank"] for a in actor] == ["0"] * 4
        assert [int(a["env_node_local_rank"]) for a in actor] == [a["local_rank"] for a in actor]
        assert len({a["visible_devices"] for a in actor}) == 4 and None not in {
            a["visible_devices"] for a in actor
        }
        # each role keeps its own state inside the shared process
        d["actor"].whoami()
        assert [a["calls"] for a in d["actor"].whoami()] == [3] * 4
        assert [r["calls"] for r in d["reference"].whoami()] == [2] * 4
        batch = Batch.from_dict({"x": torch.arange(4)})
        assert d["actor"].add_offset(batch)["y"].tolist() == [1.0, 2.0, 3.0, 4.0]
        assert d["reference"].add_offset(batch)["y"].tolist() == [2.0, 3.0, 4.0, 5.0]
        big = Batch.from_dict({"x": torch.randn(64, 4096), "ids": torch.randint(0, 9, (64, 128))})
        assert d["actor"].echo(big).equals(big)


def test_worker_errors_name_the_role_method_and_rank() -> None:
    with deploy([RIGHT], {"critic": RoleSpec(Probe, "right")}, placement_timeout_seconds=30) as d:
        with pytest.raises(
            WorkerError, match=r"critic\.fail_on_rank failed on rank 2 .*ValueError: refusing on rank 2"
        ):
            d["critic"].fail_on_rank(2)
        with pytest.raises(CallTimeoutError, match=r"critic\.sleep_and_time did not finish within 0.3 s"):
            d["critic"].sleep_and_time(2.0).result(timeout_seconds=0.3)
        started = time.monotonic()
        with pytest.raises(WorkerDiedError, match=r"rank 1 .*died during critic\.die_on_rank"):
            d["critic"].die_on_rank(1)
        assert time.monotonic() - started < 60
    assert gpus_available() == 8.0


def test_bad_mappings_fail_before_anything_starts() -> None:
    with pytest.raises(
        RoleMappingError,
        match="role 'critic' is mapped to pool 'gpu-b', which is not one of the pools: 'left'",
    ):
        deploy([LEFT], {"critic": RoleSpec(Probe, "gpu-b")})
    with pytest.raises(RoleMappingError, match="has 8 ranks but pool 'left' has 4 GPUs"):
        deploy([LEFT], {"actor": RoleSpec(Probe, "left", mesh=DeviceMesh.training(8, tp=2))})
    with pytest.raises(RoleMappingError, match="not a subclass of Worker"):
        deploy([LEFT], {"actor": RoleSpec(dict, "left")})  # type: ignore[arg-type]


def test_pool_larger_than_the_cluster_fails_in_bounded_time() -> None:
    too_big = ResourcePool("all", nodes=2, gpus_per_node=8, cpus_per_gpu=0.1)
    started = time.monotonic()
    with pytest.raises(PlacementError) as info:
        deploy([too_big], {"actor": RoleSpec(Probe, "all")}, placement_timeout_seconds=2)
    assert time.monotonic() - started < 30
    message = str(info.value)
    assert "resource pool 'all' could not be placed within 2 s" in message
    assert "2 node(s) x 8 GPU(s)" in message and "'GPU': 16.0" in message
    assert gpus_available() == 8.0


def test_failing_constructor_tears_the_deployment_down() -> None:
    with pytest.raises(
        WorkerError, match=r"constructing role 'actor' \(BrokenConstructor\) failed on rank 1"
    ):
        deploy([RIGHT], {"actor": RoleSpec(BrokenConstructor, "right")}, placement_timeout_seconds=30)
    assert gpus_available() == 8.0
