"""Checkpoint publication: only complete checkpoints are ever visible; old ones are pruned."""

import json
from pathlib import Path

import pytest

from hybridflow.checkpoint import CheckpointManager

pytestmark = pytest.mark.unit


def test_publish_makes_a_complete_checkpoint_latest(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, keep_last=2)
    assert manager.latest() is None
    staging = manager.begin(10)
    (staging / "actor").mkdir()
    assert manager.latest() is None  # nothing visible while staging
    final = manager.publish(staging, 10, {"sampler": {"epoch": 0, "position": 8, "seed": 0}})
    assert final.name == "step_000010" and not staging.exists()
    directory, state = manager.latest()  # type: ignore[misc]
    assert directory == final and state["step"] == 10 and state["sampler"]["position"] == 8
    assert (tmp_path / "latest").read_text().strip() == "step_000010"


def test_interrupted_save_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, keep_last=2)
    manager.publish(manager.begin(1), 1, {})
    manager.begin(2)  # crashed before publish
    directory, state = manager.latest()  # type: ignore[misc]
    assert directory.name == "step_000001" and state["step"] == 1
    manager.publish(manager.begin(2), 2, {})  # the next save clears the leftover staging dir
    assert [p.name for p in tmp_path.glob(".step_*")] == []


def test_keep_last_prunes_old_checkpoints(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, keep_last=2)
    for step in (1, 2, 3):
        manager.publish(manager.begin(step), step, {})
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_000002", "step_000003"]


def test_a_stale_latest_pointer_falls_back_to_the_newest_complete(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, keep_last=3)
    manager.publish(manager.begin(1), 1, {})
    (tmp_path / "latest").write_text("step_000009\n")
    directory, _ = manager.latest()  # type: ignore[misc]
    assert directory.name == "step_000001"
    assert json.loads((directory / "controller.json").read_text())["step"] == 1
