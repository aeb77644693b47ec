"""Running a multi-process torch.distributed job from a test, without Ray or torchrun.

Protocol: ``target(rank, port, *args)`` runs in each of ``world_size`` spawned processes, forms
a gloo group on ``tcp://127.0.0.1:<port>``, runs its checks, and writes ``rank<r>.json`` in
``work_dir`` (a mapping of check name to outcome). :func:`run_spawned_ranks` waits for all of
them with a deadline (a hung collective fails the test instead of the session) and returns the
outcomes regrouped as ``{check: {rank: outcome}}``. One spawned job per test module keeps the
2-core CI machines from paying the torch import once per check.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pytest
import torch.multiprocessing as mp

__all__ = ["free_port", "run_spawned_ranks"]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def run_spawned_ranks(
    target: Callable[..., None],
    args: tuple[Any, ...],
    *,
    world_size: int,
    work_dir: Path,
    deadline_seconds: float,
    what: str,
    expected: Iterable[str] = (),
) -> dict[str, dict[int, Any]]:
    """Spawn ``target`` on ``world_size`` ranks (port first, then ``args``); see the module docstring.

    Every name in ``expected`` is in the result, with no ranks when none reported it.
    """
    context = mp.start_processes(
        target, args=(free_port(), *args), nprocs=world_size, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + deadline_seconds
    try:
        while not context.join(timeout=1.0):
            if time.monotonic() > deadline:
                pytest.fail(f"{what} did not finish within {deadline_seconds} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.terminate()
                process.join(5)
    results: dict[str, dict[int, Any]] = {name: {} for name in expected}
    for rank in range(world_size):
        for name, outcome in json.loads((work_dir / f"rank{rank}.json").read_text()).items():
            results.setdefault(name, {})[rank] = outcome
    return results
