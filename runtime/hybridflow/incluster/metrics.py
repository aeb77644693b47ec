"""Prometheus metrics of a training run, served by the controller (the RayJob head) on ``/metrics``.

Names, units and labels come from :data:`hybridflow.metrics.catalogue.TRAINING_METRICS`, the same
entries that say which step-report key each metric is (and so what ``metrics.jsonl`` and
TensorBoard record). Every catalogued metric is registered up front, so the exposition text
always carries its ``# HELP``/``# TYPE`` lines; a series appears once a step reported the key
(MFU, for example, never appears on a GPU the peak table does not know). A numeric key no entry
describes is exported as ``hybridflow_training_metric{name="<key>"}``.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Gauge, start_http_server

from hybridflow.metrics.catalogue import TRAINING_METRICS, UNCATALOGUED, MetricDefinition, find_definition
from hybridflow.metrics.step_report import StepReport

__all__ = ["TrainingMetricsExporter", "report_values"]


def report_values(report: StepReport) -> dict[str, float]:
    """A step report as one flat dict of step-report keys (the catalogue's ``key`` field).

    NaN and infinities are kept: Prometheus stores them, and a reward or loss that became NaN is
    what the chart's ``HybridFlowNonFiniteTraining`` alert is for (dropping it would leave the
    gauge at its last finite value, a diverged run looking healthy). Only the CRD's status,
    which JSON cannot carry them in, leaves them out."""
    values: dict[str, float] = {
        "step": float(report.step),
        "total_steps": float(report.total_steps),
        "eta_seconds": float(report.eta_seconds),
    }
    if report.last_checkpoint_step is not None:
        values["checkpoint/last_step"] = float(report.last_checkpoint_step)
    for key, value in report.metrics.items():
        if isinstance(value, int | float) and not isinstance(value, bool):
            values[key] = float(value)
    return values


class TrainingMetricsExporter:
    """A StepReport sink that sets the catalogue's gauges; ``serve(port)`` starts the HTTP endpoint."""

    def __init__(self, namespace: str, job: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self._job = {"namespace": namespace, "rlhfjob": job}
        self._gauges: dict[str, Gauge] = {
            definition.name: Gauge(
                definition.name,
                f"{definition.help} Unit: {definition.unit}.",
                list(definition.all_labels),
                registry=self.registry,
            )
            for definition in (*TRAINING_METRICS, UNCATALOGUED)
        }

    def _set(self, definition: MetricDefinition, labels: dict[str, str], value: float) -> None:
        self._gauges[definition.name].labels(**self._job, **labels).set(value)

    def __call__(self, report: StepReport) -> None:
        for key, value in report_values(report).items():
            found = find_definition(key)
            if found is None:
                self._set(UNCATALOGUED, {"name": key}, value)
            else:
                definition, labels = found
                self._set(definition, dict(labels), value)

    def serve(self, port: int) -> None:
        start_http_server(port, registry=self.registry)
