"""Where checkpoints live and how one becomes visible.

Layout under the job's checkpoint directory::

    step_000010/            a complete checkpoint
        actor/              the actor's sharded model, optimizer and scheduler (every rank writes)
        critic/             the critic's, when the job has one
        controller.json     step, data position, KL controller, RNG seeds: the controller's state
    latest                  text file naming the newest complete checkpoint

Publication protocol: everything is written into ``.step_000010.partial/``; only when every
worker returned is ``controller.json`` written (to a temporary name, fsynced, renamed) and the
directory renamed to ``step_000010`` (one atomic rename on the shared filesystem), then
``latest`` is replaced atomically (write a temporary file, fsync, rename). A checkpoint that is
replaced (a rerun reached the same step again) is renamed to ``.step_*.replaced``, still a valid
fallback, until the new one is in place; one that is deleted is first renamed to
``.step_*.trash``. So a ``step_*`` directory is either complete or absent: a crash between any
two file-system calls leaves either the previous checkpoint or the new one as ``latest``,
never a half-written or half-deleted one (``tests/unit/test_checkpoint_faults.py`` crashes the
save at every call). Hidden leftovers (``.step_*.partial``, ``.step_*.trash``) are removed by the
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
LATEST_POINTER = "latest"


def _write_durably(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` atomically: temporary file, fsync, rename, fsync of the directory."""
    temporary = path.with_name(f".{path.name}.tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        data = text.encode("utf-8")
        while data:
            data = data[os.write(fd, data) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(temporary, path)
    _fsync_directory(path.parent)


def _fsync_directory(directory: Path) -> None:
    """Make renames inside ``directory`` survive a power loss (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


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
        for stale in [*self.root.glob(".step_*.partial"), *self.root.glob(".step_*.trash")]:
            shutil.rmtree(stale, ignore_errors=True)
        staging = self.root / f".{self.name(step)}.partial"
        staging.mkdir()
        return staging

    def publish(self, staging: Path, step: int, controller_state: dict[str, Any]) -> Path:
        """Write the controller state, then make the checkpoint visible (see the module docstring)."""
        _write_durably(
            staging / CONTROLLER_STATE,
            json.dumps({"step": step, **controller_state}, indent=2, sort_keys=True),
        )
        final = self.root / self.name(step)
        replaced = self.root / f".{final.name}.replaced"
        if final.exists():  # a rerun that reached the same step again: the old copy stays usable until
            os.rename(final, replaced)  # the new one is in place (latest() falls back to it)
        os.rename(staging, final)
        _fsync_directory(self.root)
        _write_durably(self.root / LATEST_POINTER, final.name + "\n")
        for old in self.root.glob(".step_*.replaced"):
            self._delete(old)
        self._prune()
        return final

    def latest(self) -> tuple[Path, dict[str, Any]] | None:
        """The newest complete checkpoint and its controller state, or None.

        A ``step_*`` directory is complete by construction (see the module docstring), so the
        newest one wins even when the ``latest`` pointer lags behind it (a crash between the
        rename and the pointer's update); the pointer is for people and other tools.
        """
        complete = [*self.root.glob("step_*"), *self.root.glob(".step_*.replaced")]
        for directory in sorted(
            complete, key=lambda d: (d.name.strip(".")[:11], not d.name.startswith(".")), reverse=True
        ):
            state_file = directory / CONTROLLER_STATE
            if state_file.is_file():
                return directory, json.loads(state_file.read_text(encoding="utf-8"))
        return None

    def _prune(self) -> None:
        complete = sorted(d for d in self.root.glob("step_*") if (d / CONTROLLER_STATE).is_file())
        for old in complete[: -self.keep_last]:
            self._delete(old)

    def _delete(self, directory: Path) -> None:
        """Rename out of sight, then delete: a crash mid-delete leaves only a hidden ``.trash`` directory."""
        trash = self.root / f".{directory.name.strip('.').removesuffix('.replaced')}.trash"
        os.rename(directory, trash)
        shutil.rmtree(trash, ignore_errors=True)
