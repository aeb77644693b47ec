"""Crash injection into checkpoint publication, and resume at an epoch boundary.

The crash model: the process dies between any two file-system calls. The test wraps every
``os`` call the manager (and ``shutil.rmtree``) makes, raises at the k-th call for every k of
a save, and then asks a fresh manager, as the next run would, for the newest checkpoint: it
must be the previous one or the new one, complete, never a half-written or half-deleted one.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from hybridflow.checkpoint import CheckpointManager
from hybridflow.checkpoint.manager import CONTROLLER_STATE
from hybridflow.data import PromptDataset, PromptRow, PromptSampler

pytestmark = pytest.mark.unit

FILE_SYSTEM_CALLS = (
    "open",
    "write",
    "fsync",
    "close",
    "replace",
    "rename",
    "unlink",
    "rmdir",
    "mkdir",
    "scandir",
)


class SimulatedCrash(BaseException):
    """The process died here (a BaseException, so no ``except OSError`` cleanup can swallow it)."""


@contextmanager
def crash_at(call_number: int | None) -> Iterator[list[str]]:
    """Count the ``os`` calls made inside the block; die at call ``call_number`` (None: never)."""
    made: list[str] = []
    originals = {name: getattr(os, name) for name in FILE_SYSTEM_CALLS}

    def wrap(name: str):  # type: ignore[no-untyped-def]
        def call(*args, **kwargs):  # type: ignore[no-untyped-def]
            if call_number is not None and len(made) == call_number:
                raise SimulatedCrash(f"crash before os.{name} (call {call_number})")
            made.append(name)
            return originals[name](*args, **kwargs)

        return call

    for name in FILE_SYSTEM_CALLS:
        setattr(os, name, wrap(name))
    try:
        yield made
    finally:
        for name, original in originals.items():
            setattr(os, name, original)


def save(manager: CheckpointManager, step: int) -> None:
    """What the runner does: workers write shards into the staging directory, then publish."""
    staging = manager.begin(step)
    (staging / "actor").mkdir()
    for rank in range(2):
        (staging / "actor" / f"shard_{rank}.bin").write_bytes(bytes([step, rank]) * 64)
    manager.publish(staging, step, {"sampler": {"epoch": 0, "position": step, "seed": 0}})


def assert_complete(directory: Path, state: dict[str, object], step: int) -> None:
    # The old copy of a step being replaced is a valid fallback under its hidden name.
    assert directory.name in (CheckpointManager.name(step), f".{CheckpointManager.name(step)}.replaced")
    assert state["step"] == step
    for rank in range(2):
        assert (directory / "actor" / f"shard_{rank}.bin").read_bytes() == bytes([step, rank]) * 64
    assert json.loads((directory / CONTROLLER_STATE).read_text())["sampler"]["position"] == step


@pytest.mark.parametrize("keep_last", [1, 2])
@pytest.mark.parametrize("replacing", [False, True], ids=["new-step", "same-step-again"])
def test_a_save_interrupted_at_any_call_is_never_taken_as_latest(
    tmp_path: Path, keep_last: int, replacing: bool
) -> None:
    def prepare(root: Path) -> CheckpointManager:
        manager = CheckpointManager(root, keep_last=keep_last)
        for step in (1, 2):
            save(manager, step)
        return manager

    new_step = 2 if replacing else 3
    with crash_at(None) as made:
        save(prepare(tmp_path / "count"), new_step)
    # Counting only the calls of the save under test: the preparation ran before the count.
    total = len(made) - len(_calls_to_prepare(tmp_path / "count-prep", keep_last))
    assert total > 10
    outcomes = set()
    for k in range(total + 1):
        root = tmp_path / f"crash-{k}"
        manager = prepare(root)
        try:
            with crash_at(k):
                save(manager, new_step)
        except SimulatedCrash:
            pass
        found = CheckpointManager(root, keep_last=keep_last).latest()
        assert found is not None, f"crash at call {k} left no checkpoint"
        directory, state = found
        step = int(state["step"])  # type: ignore[call-overload]
        assert step in (2, new_step), f"crash at call {k}: latest is {directory.name}"
        assert_complete(directory, state, step)
        outcomes.add(step)
        # The next save after a crash succeeds and cleans every hidden leftover.
        save(CheckpointManager(root, keep_last=keep_last), 4)
        assert [p.name for p in root.iterdir() if p.name.startswith(".")] == []
    assert outcomes == {2, new_step}


def _calls_to_prepare(root: Path, keep_last: int) -> list[str]:
    with crash_at(None) as made:
        manager = CheckpointManager(root, keep_last=keep_last)
        for step in (1, 2):
            save(manager, step)
    return made


class OneIdPerCharacter:
    """A tokenizer without a chat template: one id per character."""

    chat_template = None

    def apply_chat_template(
        self, conversation: object, *, add_generation_prompt: bool, tokenize: bool
    ) -> str:
        raise AssertionError("never asked without a chat template")

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        return [ord(c) for c in text]


def test_resume_from_a_checkpoint_at_an_epoch_boundary_continues_with_the_next_epoch(tmp_path: Path) -> None:
    """8 prompts, 4 per step: step 2 ends epoch 0; the resumed run's step 3 draws epoch 1's first batch."""
    rows = [
        PromptRow(
            file_index=0,
            row_index=i,
            prompt=f"q{i}",
            data_source="toy",
            ground_truth=str(i),
            reward_style="rule",
            extra_info={},
        )
        for i in range(8)
    ]
    dataset = PromptDataset.from_rows(rows, OneIdPerCharacter(), max_prompt_tokens=100)
    uninterrupted = PromptSampler(dataset, seed=3)
    straight = [uninterrupted.next_indices(4) for _ in range(4)]

    first_run = PromptSampler(dataset, seed=3)
    manager = CheckpointManager(tmp_path, keep_last=2)
    for _step in (1, 2):
        first_run.next_indices(4)
    staging = manager.begin(2)
    manager.publish(staging, 2, {"sampler": dict(first_run.state_dict())})

    _, state = manager.latest()  # type: ignore[misc]
    resumed = PromptSampler(dataset, seed=3)
    resumed.load_state_dict(state["sampler"])
    assert resumed.epoch == 1 and resumed.position == 0
    assert [resumed.next_indices(4) for _ in range(2)] == straight[2:]
    assert sorted(straight[2] + straight[3]) == list(range(8))  # epoch 1 visits every prompt once
