"""Where checkpoints live and how one becomes visible.

Layout under the job's checkpoint directory::

    step_000010/            a complete checkpoint
        actor/              the actor's sharded model, optimizer and scheduler (every rank writes)
        critic/             the critic's, when the job has one
        controller.json     step, data position, KL controller, RNG seeds: the controller's state
    latest                  text file naming the newest complete checkpoint

Publication protocol: everything is written into ``.step_000010.partial/``; only when every
worker returned and ``controller.json`` is written is the directory renamed to ``step_000010``
(one atomic rename on the shared filesystem), then ``latest`` is replaced atomically (write a
temporary file, rename). A crash at any point leaves either the previous checkpoint or the new
one as ``latest``, never a half-written one; leftover ``.partial`` directories are removed by the
next save. Only the ``keep_last`` newest complete checkpoints are kept.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

__all__ = ["CheckpointManager"]

CONTROLLER_STATE = "controller.json"


class CheckpointManager:
    def __init__(self, root: str | os.PathLike[str], *, keep_last: int) -> None:
        self.root = Path(root)
        self.keep_last = max(1, keep_last)

    @staticmethod
    def name(step: int) -> str:
        return f"step_{step:06d}"

    def begin(self, step: int) -> Path:
        """A fresh staging directory for ``step`` (workers write their shards under it)."""
        self.root.mkdir(parents=True, exist_ok=True)
        for stale in self.root.glob(".step_*.partial"):
            shutil.rmtree(stale, ignore_errors=True)
        staging = self.root / f".{self.name(step)}.partial"
        staging.mkdir()
        return staging

    def publish(self, staging: Path, step: int, controller_state: dict[str, Any]) -> Path:
        """Write the controller state, then make the checkpoint visible (see the module docstring)."""
        with open(staging / CONTROLLER_STATE, "w", encoding="utf-8") as f:
            json.dump({"step": step, **controller_state}, f, indent=2, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        final = self.root / self.name(step)
        if final.exists():  # a rerun that reached the same step again: replace it
            shutil.rmtree(final)
        os.rename(staging, final)
        pointer = self.root / ".latest.tmp"
        pointer.write_text(final.name + "\n", encoding="utf-8")
        os.replace(pointer, self.root / "latest")
        self._prune()
        return final

    def latest(self) -> tuple[Path, dict[str, Any]] | None:
        """The newest complete checkpoint and its controller state, or None."""
        candidates = []
        pointer = self.root / "latest"
        if pointer.exists():
            candidates.append(self.root / pointer.read_text(encoding="utf-8").strip())
        candidates += sorted(self.root.glob("step_*"), reverse=True)
        for directory in candidates:
            state_file = directory / CONTROLLER_STATE
            if state_file.is_file():
                return directory, json.loads(state_file.read_text(encoding="utf-8"))
        return None

    def _prune(self) -> None:
        complete = sorted(d for d in self.root.glob("step_*") if (d / CONTROLLER_STATE).is_file())
        for old in complete[: -self.keep_last]:
            shutil.rmtree(old, ignore_errors=True)
