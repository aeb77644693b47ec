"""``wait_for_ranks``'s timeout: never reported before it has passed, always once it has.

``ray.wait`` is replaced by a stand-in that answers as Ray can: an empty ``ready`` list a few
microseconds before the timeout it was given (its clock counts milliseconds). No Ray cluster.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from hybridflow.controller import worker_group
from hybridflow.controller.errors import CallTimeoutError


class EarlyWait:
    """``ray.wait`` that returns empty-handed ``early_seconds`` before each timeout, then finishes."""

    def __init__(self, early_seconds: float, finish_after: int | None) -> None:
        self.early_seconds = early_seconds
        self.finish_after = finish_after
        self.calls = 0

    def __call__(self, pending: list[Any], *, num_returns: int, timeout: float | None) -> tuple[list, list]:
        self.calls += 1
        if self.finish_after is not None and self.calls > self.finish_after:
            return pending[:num_returns], pending[num_returns:]
        time.sleep(max(0.0, (timeout or 0.0) - self.early_seconds))
        return [], pending


def test_an_early_empty_answer_before_the_deadline_keeps_waiting(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = EarlyWait(early_seconds=0.05, finish_after=1)
    monkeypatch.setattr(worker_group.ray, "wait", fake)
    monkeypatch.setattr(worker_group.ray, "get", lambda ref: f"result of {ref}")

    results = worker_group.wait_for_ranks(
        {0: "ref-0"}, what="rollout.generate", where={}, timeout_seconds=0.2
    )

    assert results == {0: "result of ref-0"}
    assert fake.calls == 2


def test_the_timeout_is_reported_only_once_it_has_passed(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = EarlyWait(early_seconds=0.05, finish_after=None)
    monkeypatch.setattr(worker_group.ray, "wait", fake)
    timeout = 0.2
    started = time.monotonic()

    with pytest.raises(
        CallTimeoutError,
        match=r"rollout.generate did not finish within 0.2 s; still running on ranks \[0, 1\]",
    ):
        worker_group.wait_for_ranks(
            {0: "ref-0", 1: "ref-1"}, what="rollout.generate", where={}, timeout_seconds=timeout
        )

    assert time.monotonic() - started >= timeout
    assert fake.calls >= 2
