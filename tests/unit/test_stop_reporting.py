"""A stop the controller was asked for is reported as such and spends no restart.

A drained node deletes one pod of a running attempt; its preStop hook asks the controller to save
and exit (``hybridflow.incluster.stop``), Ray reports the job FAILED, KubeRay the RayJob Failed.
The controller's last line says why; the operator retries without counting it against
``spec.maxRestarts`` (a rolling node-pool upgrade over a 4-node job drained it four times).
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import pytest
import yaml

from hybridflow.cli import EXIT_PREEMPTED
from hybridflow.incluster.stop import STOPPED_ON_REQUEST
from hybridflow.spec import parse_job_manifest
from hybridflow_operator.status import (
    STOP_MARKER,
    ObservedRayJob,
    RetryPolicy,
    RLHFJobStatus,
    desired_status,
)

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
NOW = datetime(2026, 1, 2, 4, 0, 0, tzinfo=UTC)  # after every attempt below ended
NO_BACKOFF = RetryPolicy(base_seconds=0, max_seconds=0)


def kuberay_message(code: int, last: str) -> str:
    """What KubeRay v1.7 copies from Ray's job info when the entrypoint exits non-zero."""
    return (
        f"Job entrypoint command failed with exit code {code}, last available logs (truncated to 20,000 "
        f"chars):\nstep 7/40 | reward 0.4\n{last}"
    )


STOPPED = kuberay_message(
    EXIT_PREEMPTED,
    f"{STOPPED_ON_REQUEST}the preStop hook of pod job-1-x-train-worker-0; the checkpoint holds step 7, "
    "and the next attempt resumes after it",
)
CRASHED = kuberay_message(1, "RuntimeError: NCCL error")


def attempt(number: int, message: str | None) -> ObservedRayJob:
    """Attempt ``number``: failed with ``message``, or running (None)."""
    status = (
        {"jobDeploymentStatus": "Running", "jobStatus": "RUNNING"}
        if message is None
        else {
            "jobDeploymentStatus": "Failed",
            "jobStatus": "FAILED",
            "reason": "AppFailed",
            "message": message,
        }
    )
    return ObservedRayJob.from_body(
        {
            "metadata": {"name": f"grpo-tiny-{number}", "labels": {"hybridflow.io/attempt": str(number)}},
            "spec": {"suspend": False},
            "status": {**status, "startTime": "2026-01-02T03:04:05Z", "endTime": "2026-01-02T03:05:05Z"},
        }
    )


def test_the_operator_reads_the_controllers_stop_line() -> None:
    assert STOP_MARKER == STOPPED_ON_REQUEST


def decide(max_restarts: int, *messages: str | None) -> tuple[str, str, int | None, list[str]]:
    manifest = yaml.safe_load((ROOT / "examples" / "grpo-tiny.yaml").read_text())
    manifest["spec"]["maxRestarts"] = max_restarts
    job = parse_job_manifest(manifest, "test")
    attempts = [attempt(n, message) for n, message in enumerate(messages, 1)]
    before = [*attempts[:-1], attempt(len(attempts), None)]  # the last attempt while it ran
    running = desired_status(job, RLHFJobStatus(), before, now=NOW, retry_policy=NO_BACKOFF).status
    decision = desired_status(job, running, attempts, now=NOW, retry_policy=NO_BACKOFF)
    events = [f"{event.type} {event.reason}: {event.message}" for event in decision.events]
    return decision.status.phase or "", decision.status.reason or "", decision.start_attempt, events


def test_a_requested_stop_is_retried_even_with_no_restarts_left() -> None:
    phase, reason, start, events = decide(0, STOPPED)
    assert (phase, reason, start) == ("Retrying", "StopRequested", 2)
    [event] = events
    assert event.startswith("Normal StopRequested: attempt 1 stopped on request (the preStop hook of pod")
    assert "not counted against spec.maxRestarts" in event and "(attempt 2 of 2)" in event


def test_a_crash_with_no_restarts_left_still_fails_the_job() -> None:
    phase, reason, start, _ = decide(0, CRASHED)
    assert (phase, reason, start) == ("Failed", "AppFailed", None)


def test_four_drains_of_a_rolling_upgrade_spend_no_restart_and_crashes_still_count() -> None:
    """maxRestarts 1: four stops and one crash are retried; the second crash ends the job."""
    assert decide(1, STOPPED, STOPPED, STOPPED, STOPPED)[:3] == ("Retrying", "StopRequested", 5)
    assert decide(1, STOPPED, STOPPED, CRASHED, STOPPED, STOPPED)[:3] == ("Retrying", "StopRequested", 6)
    assert decide(1, STOPPED, CRASHED, STOPPED)[:3] == ("Retrying", "StopRequested", 4)
    phase, reason, start, events = decide(1, STOPPED, CRASHED, STOPPED, CRASHED)
    assert (phase, reason, start) == ("Failed", "AppFailed", None)
    assert "attempt 4 of 4" in events[0]  # two stops on top of maxRestarts + 1
