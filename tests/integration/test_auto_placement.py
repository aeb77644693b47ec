"""``spec.placement: auto`` end to end: ``hybridflow run`` plans the job, logs the plan and trains with it.

One fresh ``hybridflow`` process on the tiny GRPO example with a 2-GPU budget (simulated), one
step. The planner's choices themselves are tested without processes in tests/unit/test_planner.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tiny_inputs import make_tiny

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "hybridflow.cli"]


def test_auto_placement_plans_logs_and_trains(tmp_path: Path) -> None:
    make_tiny(tmp_path / "model", tmp_path / "data", prompts=32)
    doc = yaml.safe_load((ROOT / "examples" / "grpo-tiny.yaml").read_text())
    spec = doc["spec"]
    spec["models"] = {"actor": {"path": str(tmp_path / "model")}}
    spec["data"]["trainFiles"] = [str(tmp_path / "data" / "target_char.jsonl")]
    spec["rollout"]["maxResponseTokens"] = 8
    spec["training"]["totalSteps"] = 1
    spec["placement"] = "auto"
    spec["resourcePools"] = [{"name": "budget", "nodes": 1, "gpusPerNode": 2}]
    spec["roles"] = {"actor": "budget"}
    spec["outputDir"] = str(tmp_path / "out")
    manifest = tmp_path / "job.yaml"
    manifest.write_text(yaml.safe_dump(doc))

    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "PYTHONUNBUFFERED": "1"}
    result = subprocess.run(
        [*CLI, "run", str(manifest)], capture_output=True, text=True, timeout=600, env=env, check=False
    )

    assert result.returncode == 0, result.stderr[-3000:]
    [line] = [line for line in result.stdout.splitlines() if line.startswith("placement auto: ")]
    assert "actor" in line and "reference" in line and "step " in line
    assert "step 1/1" in result.stdout
    records = [json.loads(row) for row in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [record["step"] for record in records] == [1]
