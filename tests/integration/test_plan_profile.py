"""``hybridflow plan --profile`` on a CPU: every constant measured from the tiny job's own code paths.

One calibration of the tiny GRPO example's actor (worker processes at Ray's priority, gloo),
30-60 s on two cores. The figures vary with the machine's load, so the checks are what each
must be whatever the load: positive, within its physical bounds, and with the fixed costs the
tiny model is known to have (27 parameter tensors: an optimizer step is milliseconds of
per-tensor work, far above its memory traffic). The cost model's use of each constant is
tested without processes in tests/unit/test_planner.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hybridflow.host import available_cores
from hybridflow.models import write_tiny_model
from hybridflow.planner.calibrate import calibrate_device
from hybridflow.planner.cost import OPTIMIZER_BYTES_PER_PARAMETER
from hybridflow.planner.hardware import SIMULATED_CPU_GPU
from hybridflow.planner.job import workload_from_spec
from hybridflow.spec import load_job_manifest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def test_profile_measures_every_constant_of_a_simulated_gpu(tmp_path: Path) -> None:
    spec = load_job_manifest(ROOT / "examples" / "grpo-tiny.yaml").spec
    model = write_tiny_model(tmp_path / "tiny-model")
    spec = spec.model_copy(update={"models": spec.models.model_validate({"actor": {"path": str(model)}})})
    workload = workload_from_spec(spec)

    device = calibrate_device(workload, SIMULATED_CPU_GPU, repeats=3)

    assert device.name == "cpu (measured with tiny-model)"
    assert device.peak_flops > 1e8 and device.memory_bandwidth_bytes_per_second > 1e8
    assert device.call_overhead_seconds >= 0 and device.decode_step_overhead_seconds >= 0
    # A training pass (forward with entropy, backward) costs more than the forward alone.
    assert 1.0 < device.training_pass_ratio < 20.0
    # The optimizer step's fixed work is what is left after its traffic: positive for 27 tensors.
    traffic = OPTIMIZER_BYTES_PER_PARAMETER * workload.actor.params / device.memory_bandwidth_bytes_per_second
    assert device.optimizer_step_overhead_seconds > traffic
    assert device.optimizer_step_overhead_seconds < 1.0
    assert device.decode_efficiency is not None and 0 < device.decode_efficiency <= 1
    cores = available_cores()
    assert device.host_cores == cores
    assert device.compute_slots is not None and 0.5 * cores / 2 <= device.compute_slots <= cores
    assert device.collective_latency_seconds > 0
    # Four workers pinned to two cores, then to one (one core only: just the latter).
    expected = [2.0, 4.0] if cores >= 2 else [4.0]
    assert [ratio for ratio, _ in device.oversubscribed_collective_latencies] == expected
    assert all(seconds > 0 for _, seconds in device.oversubscribed_collective_latencies)
    assert device.all_cores_speedup > 0
