"""The controller's in-cluster sinks: the status.progress patch and the Prometheus gauges."""

import math
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml
from jsonschema import Draft4Validator
from prometheus_client import CollectorRegistry, generate_latest

from hybridflow.incluster import StatusPusher, TrainingMetricsExporter, placement_status, progress_status
from hybridflow.metrics.step_report import StepReport

pytestmark = pytest.mark.unit

NOW = datetime(2026, 11, 29, 12, 0, 0, tzinfo=UTC)
CRD = Path(__file__).resolve().parents[2] / "crds" / "hybridflow.io_rlhfjobs.yaml"


def report(step: int, checkpoint: int | None = None, total: int = 10) -> StepReport:
    metrics = {"reward/mean": 0.25, "perf/tokens_per_second": 1234.7, "timing/generate": 0.5}
    return StepReport(step, total, metrics, eta_seconds=42.9, last_checkpoint_step=checkpoint)


def test_progress_status_uses_the_crd_field_names() -> None:
    body = progress_status(report(3, checkpoint=2), NOW)
    assert body == {
        "status": {
            "progress": {
                "step": 3,
                "totalSteps": 10,
                "percent": 30.0,
                "etaSeconds": 42,
                "updatedAt": "2026-11-29T12:00:00Z",
                "reward": 0.25,
                "tokensPerSecond": 1234,
                "lastCheckpointStep": 2,
            }
        }
    }


def test_pushes_are_throttled_except_checkpoints_and_the_last_step() -> None:
    sent: list[dict[str, Any]] = []
    clock = [0.0]
    pusher = StatusPusher(sent.append, min_interval_seconds=10, clock=lambda: clock[0], now=lambda: NOW)
    pusher(report(1))  # first report: pushed
    clock[0] = 3
    pusher(report(2))  # throttled
    clock[0] = 5
    pusher(report(3, checkpoint=3))  # a new checkpoint: pushed
    clock[0] = 6
    pusher(report(4, checkpoint=3))  # throttled
    clock[0] = 16
    pusher(report(5, checkpoint=3))  # interval elapsed: pushed
    clock[0] = 17
    pusher(report(10, checkpoint=3))  # final step: pushed
    assert [b["status"]["progress"]["step"] for b in sent] == [1, 3, 5, 10]


def test_a_failed_push_never_raises_and_is_retried() -> None:
    calls: list[int] = []

    def flaky(body: dict[str, Any]) -> None:
        calls.append(body["status"]["progress"]["step"])
        if len(calls) == 1:
            raise ConnectionError("apiserver unavailable")

    pusher = StatusPusher(flaky, min_interval_seconds=100, clock=lambda: 0.0, now=lambda: NOW)
    pusher(report(1))
    pusher(report(2))  # the failed push did not start the throttle window
    assert calls == [1, 2] and pusher.failures == 1


def test_exporter_turns_step_metrics_into_labelled_gauges() -> None:
    registry = CollectorRegistry()
    exporter = TrainingMetricsExporter("team-a", "grpo-qwen", registry=registry)
    exporter(report(4))
    text = generate_latest(registry).decode()
    assert 'hybridflow_step{namespace="team-a",rlhfjob="grpo-qwen"} 4.0' in text
    assert 'hybridflow_reward_mean{namespace="team-a",rlhfjob="grpo-qwen"} 0.25' in text
    assert 'hybridflow_phase_seconds{namespace="team-a",phase="generate",rlhfjob="grpo-qwen"} 0.5' in text


def status_schema_errors(body: dict[str, Any]) -> list[str]:
    """What the API server's schema check of the status subresource would say about ``body``."""
    crd = yaml.safe_load(CRD.read_text())
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]
    return [f"{'.'.join(map(str, e.path))}: {e.message}" for e in Draft4Validator(schema).iter_errors(body)]


@pytest.mark.parametrize("reward", [0.25, -3.0, 1e9, 0.0])
def test_progress_has_the_types_the_crd_declares(reward: float) -> None:
    """A real API server rejects the whole patch when one field has the wrong type (a string reward did)."""
    metrics = {"reward/mean": reward, "perf/tokens_per_second": 99.5}
    body = progress_status(StepReport(7, 5, metrics, eta_seconds=0.0, last_checkpoint_step=5), NOW)
    assert status_schema_errors(body["status"]) == []
    assert isinstance(body["status"]["progress"]["reward"], float)
    assert status_schema_errors({"progress": {"reward": "0.25"}}) != []  # the check can fail


def test_non_finite_figures_are_left_out() -> None:
    metrics = {"reward/mean": math.nan, "perf/tokens_per_second": math.inf}
    progress = progress_status(
        StepReport(1, 10, metrics, eta_seconds=math.inf, last_checkpoint_step=None), NOW
    )
    assert {"reward", "tokensPerSecond", "etaSeconds"}.isdisjoint(progress["status"]["progress"])
    assert status_schema_errors(progress["status"]) == []


def test_the_auto_placement_plan_goes_into_the_status_as_the_crd_declares_it() -> None:
    from hybridflow.planner import A100_80GB, ClusterShape, plan_job
    from hybridflow.planner.shapes import PAPER_MODELS, Workload

    model = PAPER_MODELS["llama-7b"]
    workload = Workload(
        actor=model, critic=model, reward=model, sequences=1024, prompt_tokens=1024, response_tokens=1024
    )
    plan = plan_job(workload, ClusterShape(16, 8), A100_80GB)[0]
    placement = placement_status(plan, A100_80GB.name)
    assert placement["kind"] == "colocate" and placement["estimatedStepSeconds"] == pytest.approx(
        plan.step_seconds
    )
    assert placement["summary"].startswith("colocate [actor+")
    patches: list[dict[str, Any]] = []
    pusher = StatusPusher(
        patches.append, min_interval_seconds=60.0, clock=lambda: 0.0, now=lambda: NOW, placement=placement
    )
    pusher.push_placement()  # before the first step
    pusher(report(1))
    assert patches[0] == {"status": {"progress": {"placement": placement}}}
    assert patches[1]["status"]["progress"]["placement"] == placement  # repeated: a lost push is repaired
    for patch in patches:
        assert status_schema_errors(patch["status"]) == []
    assert (
        status_schema_errors({"progress": {"placement": {"kind": "colocate"}}}) != []
    )  # summary is required


def rollout_health(replaced: int) -> dict[str, Any]:
    """What ``RolloutService.health`` returns for two replicas, ``replaced`` of which were replaced."""
    health: dict[str, Any] = {
        "startedAt": "2026-12-05T08:00:00Z",
        "replicasServing": 2,
        "replicasReplaced": replaced,
        "replicas": [
            {"index": 0, "state": "Serving", "tokensPerSecond": 1200.5, "replaced": replaced},
            {"index": 1, "state": "Starting", "tokensPerSecond": 0.0, "replaced": 0},
        ],
    }
    if replaced:
        health["lastReplacement"] = "replica 0: died: ActorDiedError; serving again after 3.9 s"
    return health


def test_server_mode_pushes_the_replicas_health_as_the_crd_declares_it_and_at_once_after_a_replacement() -> (
    None
):
    patches: list[dict[str, Any]] = []
    pusher = StatusPusher(patches.append, min_interval_seconds=60.0, clock=lambda: 100.0, now=lambda: NOW)
    metrics = {"reward/mean": 0.5}
    pusher(StepReport(1, 10, metrics, 0.0, None, rollout_health(0)))
    pusher(StepReport(2, 10, metrics, 0.0, None, rollout_health(0)))  # throttled: nothing new
    pusher(StepReport(3, 10, metrics, 0.0, None, rollout_health(1)))  # a replacement: pushed at once
    assert [p["status"]["progress"]["step"] for p in patches] == [1, 3]
    rollout = patches[-1]["status"]["progress"]["rollout"]
    assert rollout["replicasReplaced"] == 1 and rollout["replicas"][1]["state"] == "Starting"
    assert status_schema_errors(patches[-1]["status"]) == []
    broken = {"progress": {"rollout": {"replicas": [{"index": 0, "state": "Dead"}]}}}
    assert status_schema_errors(broken) != []  # the check can fail
