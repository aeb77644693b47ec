"""A hung collective (a worker that stops answering without dying) is detected within the stall timeout."""

from __future__ import annotations

import json
import os
import time

import pytest

from hybridflow.controller import ResourcePool, RoleSpec, WorkerStalledError, deploy

pytestmark = pytest.mark.integration


@pytest.mark.usefixtures("ray_cluster")
def test_a_hung_collective_is_reported_as_a_stall_naming_role_and_method() -> None:
    from fault_roles import HungCollective

    pool = ResourcePool("right", nodes=1, gpus_per_node=2, cpus_per_gpu=0.1)
    stall_seconds = 2.0
    with deploy(
        [pool],
        {"rollout": RoleSpec(HungCollective, "right")},
        placement_timeout_seconds=30,
        stall_timeout_seconds=stall_seconds,
    ) as job:
        assert job["rollout"].answer() == [0, 1]  # healthy calls are unaffected
        started = time.monotonic()
        with pytest.raises(WorkerStalledError) as caught:
            job["rollout"].all_reduce_with_a_silent_peer()
        detected_after = time.monotonic() - started
    message = str(caught.value)
    assert "rollout.all_reduce_with_a_silent_peer stalled" in message
    assert "ranks [0, 1]" in message and "pool 'right'" in message and "spec.stallTimeoutSeconds" in message
    assert detected_after >= stall_seconds  # not before the timeout; the upper bound is the timeout's job
    record("fault:hung-collective", stall_detection_seconds=round(detected_after, 2))


def record(scenario: str, **figures: float) -> None:
    """Append the scenario's measured figures to ``$HYBRIDFLOW_E2E_RESULTS`` (bench/e2e.py sums them)."""
    target = os.environ.get("HYBRIDFLOW_E2E_RESULTS")
    if target:
        with open(target, "a", encoding="utf-8") as out:
            out.write(json.dumps({"scenario": scenario, "passed": True, **figures}) + "\n")
