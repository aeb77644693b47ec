"""Scenario processes that start when the suite is collected and are awaited by the tests that read them.

Why: a scenario that runs in a process of its own (its own Ray, many CPU-bound workers: the
vLLM tensor-parallel one takes about 165 s on 2 cores) can run while the unit tier, a
single-threaded pytest process, uses one core; run at its turn it holds the suite up for all
of its time. ``make test`` has a budget of 15 minutes.

Protocol. A test module that wants this defines ``start_in_background() -> None``, which calls
:func:`start`; ``tests/conftest.py`` calls it once, after collection, if a selected test of the
module uses the fixture the module names in ``BACKGROUND_FIXTURE``. The module's fixture then
calls :func:`finished` for the process's outcome (starting it there if collection did not).
Anything that must not overlap a scenario (vLLM's shared-memory files collide between two
tensor-parallel runs) calls :func:`wait_all` first. Output goes to files, not pipes, so a
chatty process never blocks on a full pipe.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Outcome", "finished", "is_started", "start", "wait_all"]


@dataclass(frozen=True)
class Outcome:
    """How a background process ended: its exit status and the tails of its output."""

    returncode: int
    stdout: str
    stderr: str


@dataclass
class _Running:
    process: subprocess.Popen[bytes]
    work: Path
    deadline: float


_RUNNING: dict[str, _Running] = {}
_DONE: dict[str, Outcome] = {}


def is_started(name: str) -> bool:
    return name in _RUNNING or name in _DONE


def start(
    name: str, command: Sequence[str], *, env: Mapping[str, str], work: Path, timeout_seconds: float
) -> None:
    """Start ``command`` as ``name`` (once), its output in ``work``; it must end within ``timeout_seconds``."""
    if is_started(name):
        return
    work.mkdir(parents=True, exist_ok=True)
    with open(work / "stdout.txt", "wb") as out, open(work / "stderr.txt", "wb") as err:
        process = subprocess.Popen(list(command), env=dict(env), stdout=out, stderr=err)
    _RUNNING[name] = _Running(process, work, time.monotonic() + timeout_seconds)


def finished(name: str) -> Outcome:
    """Wait for ``name`` to end (killed at its deadline) and return how it ended."""
    if name in _DONE:
        return _DONE[name]
    running = _RUNNING.pop(name)
    try:
        returncode = running.process.wait(timeout=max(0.0, running.deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        running.process.kill()
        running.process.wait()
        returncode = -9
    outcome = Outcome(
        returncode,
        (running.work / "stdout.txt").read_text(errors="replace")[-3000:],
        (running.work / "stderr.txt").read_text(errors="replace")[-6000:]
        + ("\n(killed at its deadline)" if returncode == -9 else ""),
    )
    _DONE[name] = outcome
    return outcome


def wait_all() -> None:
    """Wait for every background process still running."""
    for name in list(_RUNNING):
        finished(name)
