"""Prometheus metrics of a training run, served by the controller on ``/metrics``.

Every numeric step metric becomes a gauge ``hybridflow_<name>`` (``reward/mean`` ->
``hybridflow_reward_mean``, ``timing/generate`` -> ``hybridflow_timing_generate``), labelled with
the job's namespace and name, plus ``hybridflow_step`` and ``hybridflow_total_steps``. Gauges
are created on first sight, so a metric added to an algorithm is exported without a change here.
"""

from __future__ import annotations

import re

from prometheus_client import CollectorRegistry, Gauge, start_http_server

from hybridflow.trainer.report import StepReport

__all__ = ["TrainingMetricsExporter", "prometheus_name"]

_INVALID = re.compile(r"[^a-zA-Z0-9_]")


def prometheus_name(metric: str) -> str:
    return "hybridflow_" + _INVALID.sub("_", metric).strip("_").lower()


class TrainingMetricsExporter:
    """A StepReport sink that updates gauges; ``serve(port)`` starts the HTTP endpoint."""

    def __init__(self, namespace: str, job: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self._labels = {"namespace": namespace, "rlhfjob": job}
        self._gauges: dict[str, Gauge] = {}

    def _gauge(self, name: str, documentation: str) -> Gauge:
        if name not in self._gauges:
            self._gauges[name] = Gauge(name, documentation, list(self._labels), registry=self.registry)
        return self._gauges[name]

    def __call__(self, report: StepReport) -> None:
        self._gauge("hybridflow_step", "last finished training step").labels(**self._labels).set(report.step)
        self._gauge("hybridflow_total_steps", "training steps of the job").labels(**self._labels).set(
            report.total_steps
        )
        self._gauge("hybridflow_eta_seconds", "estimated seconds to the last step").labels(
            **self._labels
        ).set(report.eta_seconds)
        for metric, value in report.metrics.items():
            if isinstance(value, int | float):
                self._gauge(prometheus_name(metric), f"training metric {metric}").labels(**self._labels).set(
                    value
                )

    def serve(self, port: int) -> None:
        start_http_server(port, registry=self.registry)
