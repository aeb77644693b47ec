"""Shared fixtures. One embedded Ray instance serves every integration test of a session.

Importing torch/ray costs seconds on the 2-core CI machines, so the Ray fixture is session-scoped
and declares the custom resources of every pool the tests use; tests keep their worker groups
small and shut them down (releasing the placement groups) before the next test deploys.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

TESTS_DIR = Path(__file__).resolve().parent
# tests/kube/ (the API-server emulator and the kopf harness) is imported as the `kube` package.
sys.path.insert(0, str(TESTS_DIR))

# Ray worker processes inherit this environment: they must import the test-only worker classes
# by module name, exactly as the driver does.
os.environ["PYTHONPATH"] = os.pathsep.join(
    [str(TESTS_DIR / "integration"), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
)
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Hold every Ray GPU worker the tests start (here, in scenario processes and in `hybridflow run`
# subprocesses, which all inherit this) to the device preconditions of a GPU node
# (hybridflow/devices.py): LOCAL_RANK, the device index and one process per device.
os.environ.setdefault("HYBRIDFLOW_GPU_CONTRACT", "emulate")

SIMULATED_GPUS = 8
# Pools the integration tests place: "left"/"right" split the 8 GPUs, "all" spans them, and
# "default", "train" and "generate" are the example manifests' pools (jobs that run_training in
# the test process).
TEST_POOL_CAPACITY = {"left": 4, "right": 4, "all": 8, "default": 8, "train": 8, "generate": 8}


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the scenario processes that selected tests will read (``tests/background.py``)."""
    started: set[str] = set()
    for item in session.items:
        module = getattr(item, "module", None)
        fixture = getattr(module, "BACKGROUND_FIXTURE", None)
        if module is None or fixture is None or module.__name__ in started:
            continue
        if fixture in getattr(item, "fixturenames", ()):
            started.add(module.__name__)
            module.start_in_background()


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[None]:
    ray = pytest.importorskip("ray")
    from hybridflow.controller.resource_pool import node_pool_resource

    ray.init(
        num_cpus=2,
        num_gpus=SIMULATED_GPUS,
        resources={node_pool_resource(name): float(n) for name, n in TEST_POOL_CAPACITY.items()},
        include_dashboard=False,
        configure_logging=False,
        log_to_driver=False,
    )
    yield
    ray.shutdown()
