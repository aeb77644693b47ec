"""Pushing training progress into the RLHFJob's ``status.progress`` (and ``status.artifacts``) from the controller.

Protocol with the operator: the controller owns ``status.progress`` and ``status.artifacts`` (the
exports that passed their parity gate, ``spec.checkpoint.export``) and nothing else in the status;
the operator owns phase, conditions and attempts and never writes those two. The
controller patches through the status subresource with the job's own ServiceAccount, whose Role
allows ``get``/``patch`` on this one RLHFJob's status only.

With ``spec.placement: auto`` the chosen plan (:func:`placement_status`) is pushed once when the
attempt starts (:meth:`StatusPusher.push_placement`) and carried in every later progress patch,
so one lost push is repaired by the next.

Pushes are throttled (at most one per ``min_interval_seconds``, except the final step,
checkpoint steps, a step that published an export, and a step after which a server-mode job's
rollout replica was replaced) so that a fast loop does not load the API server. A failed push is logged and
retried at the next report: progress is advisory, and a training run never dies because the API
server was briefly unreachable.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from hybridflow.metrics.step_report import StepReport
from hybridflow.planner import Plan
from hybridflow.planner.report import describe_plan
from hybridflow.spec import GROUP, PLURAL, VERSION

__all__ = ["StatusPusher", "placement_status", "progress_status"]

log = logging.getLogger(__name__)

PatchFn = Callable[[dict[str, Any]], None]


def _finite(value: float | None) -> float | None:
    """``value`` if it is a finite number: JSON has no NaN or infinity, and the API server rejects them."""
    if value is None or not math.isfinite(value):
        return None
    return float(value)


def placement_status(plan: Plan, device: str) -> dict[str, Any]:
    """``status.progress.placement`` for a plan of ``placement: auto`` (the CRD's PlannedPlacement)."""
    placement: dict[str, Any] = {
        "kind": plan.placement.kind,
        "summary": describe_plan(plan)[:4096],
        "device": device,
    }
    seconds = _finite(plan.step_seconds)
    if seconds is not None:
        placement["estimatedStepSeconds"] = round(max(0.0, seconds), 6)
    return placement


def progress_status(
    report: StepReport, now: datetime, placement: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The ``status.progress`` object for a step, in the CRD's field names and types.

    Every value has the type the CRD's status schema gives it (numbers as JSON numbers, never
    strings): the API server validates the whole patch and answers 422 to one wrong field, so a
    single mistyped key would keep every progress field out of ``kubectl get``. A non-finite
    reward or throughput (a diverged step) is left out rather than sent.
    """
    reward = _finite(report.metrics.get("reward/mean"))
    tokens = _finite(report.metrics.get("perf/tokens_per_second"))
    eta = _finite(report.eta_seconds)
    progress: dict[str, Any] = {
        "step": report.step,
        "totalSteps": report.total_steps,
        "percent": min(100.0, round(100.0 * report.step / max(1, report.total_steps), 1)),
        "updatedAt": now.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }
    if eta is not None:
        progress["etaSeconds"] = max(0, int(eta))
    if reward is not None:
        progress["reward"] = round(reward, 4)
    if tokens is not None:
        progress["tokensPerSecond"] = max(0, int(tokens))
    if report.last_checkpoint_step is not None:
        progress["lastCheckpointStep"] = report.last_checkpoint_step
    if placement is not None:
        progress["placement"] = placement
    if report.rollout is not None:
        progress["rollout"] = report.rollout
    status: dict[str, Any] = {"progress": progress}
    if report.artifacts:
        status["artifacts"] = list(report.artifacts)
    return {"status": status}


class StatusPusher:
    """A StepReport sink that merge-patches ``status.progress``, throttled (see the module docstring)."""

    def __init__(
        self,
        patch: PatchFn,
        *,
        min_interval_seconds: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        now: Callable[[], datetime] = lambda: datetime.now(UTC),
        placement: dict[str, Any] | None = None,
    ) -> None:
        self._patch = patch
        self.placement = placement
        self._min_interval = min_interval_seconds
        self._clock = clock
        self._now = now
        self._last_push: float | None = None
        self._last_checkpoint: int | None = None
        self._last_replaced: Any = 0
        self._last_artifacts = 0
        self.failures = 0

    def __call__(self, report: StepReport) -> None:
        now = self._clock()
        checkpointed = report.last_checkpoint_step != self._last_checkpoint
        final = report.step >= report.total_steps
        due = self._last_push is None or now - self._last_push >= self._min_interval
        replaced = (
            report.rollout is not None and report.rollout.get("replicasReplaced") != self._last_replaced
        )
        exported = len(report.artifacts) != self._last_artifacts
        if not (due or final or checkpointed or replaced or exported):
            return
        try:
            self._patch(progress_status(report, self._now(), self.placement))
        except Exception as err:  # progress is advisory: log and try again at the next report
            self.failures += 1
            log.warning("could not push progress for step %d: %s", report.step, err)
            return
        self._last_push = now
        self._last_checkpoint = report.last_checkpoint_step
        if report.rollout is not None:
            self._last_replaced = report.rollout.get("replicasReplaced")
        self._last_artifacts = len(report.artifacts)

    def push_placement(self) -> None:
        """Push the chosen plan now (before the first step); failures are logged, as for progress."""
        if self.placement is None:
            return
        try:
            self._patch({"status": {"progress": {"placement": self.placement}}})
        except Exception as err:
            self.failures += 1
            log.warning("could not push the placement plan: %s", err)

    @classmethod
    def in_cluster(cls, namespace: str, name: str, **kwargs: Any) -> StatusPusher:
        """A pusher that patches ``rlhfjobs/<name>/status`` with the pod's service account.

        Outside a pod (no ``KUBERNETES_SERVICE_HOST``; the e2e harness runs the entrypoint as a
        plain process) it uses ``$KUBECONFIG`` instead.
        """
        import os

        from kubernetes import client, config

        if "KUBERNETES_SERVICE_HOST" not in os.environ and os.environ.get("KUBECONFIG"):
            config.load_kube_config()
        else:
            config.load_incluster_config()
        api = client.CustomObjectsApi()

        def patch(body: dict[str, Any]) -> None:
            api.patch_namespaced_custom_object_status(GROUP, VERSION, namespace, PLURAL, name, body)

        return cls(patch, **kwargs)
