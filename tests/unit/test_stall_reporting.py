"""A stalled run is reported as reason ``Stalled``: the CLI's last line, the operator's mapping of it."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import pytest
import yaml

from hybridflow.cli import EXIT_STALLED, STALLED_PREFIX
from hybridflow.spec import parse_job_manifest
from hybridflow_operator.status import (
    STALLED_MARKER,
    ObservedRayJob,
    RetryPolicy,
    RLHFJobStatus,
    desired_status,
)

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
T0 = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
NO_BACKOFF = RetryPolicy(base_seconds=0, max_seconds=0)  # the next attempt starts in this very decision

# What KubeRay v1.7 copies from Ray's job info when the entrypoint exits non-zero.
KUBERAY_MESSAGE = (
    f"Job entrypoint command failed with exit code {EXIT_STALLED}, last available logs (truncated to "
    "20,000 chars):\nstep 3/40 | reward 0.1\n"
    f"{STALLED_PREFIX}rollout.generate_sequences stalled: ranks [1] gave no answer within 1800 s"
)


def rayjob(deployment: str, ray: str, reason: str, message: str) -> ObservedRayJob:
    return ObservedRayJob.from_body(
        {
            "metadata": {"name": "grpo-tiny-1"},
            "spec": {"suspend": False},
            "status": {
                "jobDeploymentStatus": deployment,
                "jobStatus": ray,
                "reason": reason,
                "message": message,
                "startTime": "2026-01-02T03:04:05Z",
            },
        }
    )


def rayjob2(deployment: str, ray: str) -> ObservedRayJob:
    """Attempt 2 of the same job."""
    return ObservedRayJob.from_body(
        {
            "metadata": {"name": "grpo-tiny-2"},
            "spec": {"suspend": False},
            "status": {
                "jobDeploymentStatus": deployment,
                "jobStatus": ray,
                "startTime": "2026-01-02T03:04:06Z",
            },
        }
    )


def test_the_operator_reads_the_cli_stall_line() -> None:
    assert STALLED_MARKER == STALLED_PREFIX


@pytest.mark.parametrize(
    ("deployment", "ray", "reason"), [("Complete", "FAILED", ""), ("Failed", "FAILED", "AppFailed")]
)
def test_a_stalled_attempt_is_retried_with_reason_stalled_and_a_warning_event(
    deployment: str, ray: str, reason: str
) -> None:
    manifest = yaml.safe_load((ROOT / "examples" / "grpo-tiny.yaml").read_text())
    job = parse_job_manifest(manifest, "test")
    first = desired_status(job, RLHFJobStatus(), [], now=T0, generation=1).status
    running = desired_status(
        job, first, [rayjob("Running", "RUNNING", "", "")], now=T0, generation=1, retry_policy=NO_BACKOFF
    ).status
    decision = desired_status(
        job,
        running,
        [rayjob(deployment, ray, reason, KUBERAY_MESSAGE)],
        now=T0,
        generation=1,
        retry_policy=NO_BACKOFF,
    )
    assert decision.status.phase == "Retrying" and decision.start_attempt == 2
    assert decision.status.reason == "Stalled"
    stalled = decision.status.condition("Stalled")
    assert stalled is not None and stalled.status == "True" and stalled.reason == "Stalled"
    assert "rollout.generate_sequences stalled" in stalled.message
    again = desired_status(  # the next attempt runs: no longer stalled
        job,
        decision.status,
        [rayjob(deployment, ray, reason, KUBERAY_MESSAGE), rayjob2("Running", "RUNNING")],
        now=T0,
        generation=1,
        retry_policy=NO_BACKOFF,
    )
    assert again.status.phase == "Running" and again.status.condition("Stalled").status == "False"
    [event] = decision.events
    assert event.type == "Warning" and "(Stalled: " in event.message
    assert "rollout.generate_sequences stalled" in event.message


def test_a_deadline_is_not_renamed_a_stall() -> None:
    manifest = yaml.safe_load((ROOT / "examples" / "grpo-tiny.yaml").read_text())
    job = parse_job_manifest(manifest, "test")
    first = desired_status(job, RLHFJobStatus(), [], now=T0, generation=1).status
    decision = desired_status(
        job,
        first,
        [rayjob("Failed", "FAILED", "DeadlineExceeded", KUBERAY_MESSAGE)],
        now=T0,
        generation=1,
        retry_policy=NO_BACKOFF,
    )
    assert decision.status.phase == "Failed" and decision.status.reason == "DeadlineExceeded"
    assert decision.status.condition("Stalled").status == "False"
