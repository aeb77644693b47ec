"""The operator's own Prometheus metrics (served on ``HYBRIDFLOW_OPERATOR_METRICS_PORT``, default 8080).

:data:`OPERATOR_METRICS` is the one list of them (name, kind, unit, help, labels): the
collectors below are built from it, and ``docs/observability.md`` and the chart's dashboards
are checked against it by tests. The operator may not import the runtime's metric catalogue
(it imports nothing of ``hybridflow`` but the spec), so the entry type is this module's own,
with the same fields as ``hybridflow.metrics.catalogue.MetricDefinition``.

Who calls what: ``main.register`` counts each reconcile and its trigger, times it, counts the
writes it made, each API request of the pass that failed (by the API's reason) and, when the
pass raised, the error class; after each pass it reports the job's phase
(:meth:`OperatorMetrics.observe_phase`) and the attempts the job's status records
(:meth:`OperatorMetrics.observe_attempts`); a deleted job is forgotten by both.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Literal

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

__all__ = ["OPERATOR_METRICS", "OperatorMetricDefinition", "OperatorMetrics"]


@dataclass(frozen=True)
class OperatorMetricDefinition:
    name: str
    kind: Literal["gauge", "counter", "histogram"]
    unit: str
    help: str
    labels: tuple[str, ...] = ()
    key: None = None
    group: str = "operator"
    job_labels: tuple[str, ...] = ()

    @property
    def all_labels(self) -> tuple[str, ...]:
        return self.labels

    @property
    def exposed_names(self) -> tuple[str, ...]:
        if self.kind == "counter":
            return (f"{self.name}_total",)
        if self.kind == "histogram":
            return tuple(f"{self.name}_{suffix}" for suffix in ("bucket", "count", "sum"))
        return (self.name,)


RECONCILES = OperatorMetricDefinition(
    "hybridflow_operator_reconciles",
    "counter",
    "reconciles",
    "Reconciles run, by trigger (rlhfjob, rayjob, timer).",
    ("trigger",),
)
ERRORS = OperatorMetricDefinition(
    "hybridflow_operator_reconcile_errors",
    "counter",
    "reconciles",
    "Failed API requests of a pass, by the API's reason (Forbidden, Conflict, ...), and passes that raised, by the error's class.",
    ("error",),
)
LATENCY = OperatorMetricDefinition(
    "hybridflow_operator_reconcile_seconds",
    "histogram",
    "seconds",
    "Reconcile latency, from trigger to done.",
)
WRITES = OperatorMetricDefinition(
    "hybridflow_operator_api_writes",
    "counter",
    "writes",
    "API writes made by reconciles (a no-op reconcile makes none).",
)
JOBS = OperatorMetricDefinition(
    "hybridflow_operator_jobs", "gauge", "jobs", "RLHFJobs by the phase this operator saw last.", ("phase",)
)
ATTEMPTS = OperatorMetricDefinition(
    "hybridflow_operator_job_attempts",
    "gauge",
    "attempts",
    "Attempts (RayJobs) each RLHFJob's status records; above 1 after a retry.",
    ("namespace", "rlhfjob"),
)
OPERATOR_METRICS: tuple[OperatorMetricDefinition, ...] = (RECONCILES, ERRORS, LATENCY, WRITES, JOBS, ATTEMPTS)


def _help(definition: OperatorMetricDefinition) -> str:
    return f"{definition.help} Unit: {definition.unit}."


class OperatorMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.reconciles = Counter(
            RECONCILES.name, _help(RECONCILES), list(RECONCILES.labels), registry=self.registry
        )
        self.errors = Counter(ERRORS.name, _help(ERRORS), list(ERRORS.labels), registry=self.registry)
        self.latency = Histogram(LATENCY.name, _help(LATENCY), registry=self.registry)
        self.writes = Counter(WRITES.name, _help(WRITES), registry=self.registry)
        self.jobs = Gauge(JOBS.name, _help(JOBS), list(JOBS.labels), registry=self.registry)
        self.attempts = Gauge(ATTEMPTS.name, _help(ATTEMPTS), list(ATTEMPTS.labels), registry=self.registry)
        self._phases: dict[str, str] = {}
        self._lock = threading.Lock()

    def observe_phase(self, job_key: str, phase: str | None) -> None:
        """Record ``job_key``'s phase (None: the job is gone) and move it between the per-phase
        gauge's counts (called after every pass: its cost must not grow with the number of jobs)."""
        with self._lock:
            old = self._phases.get(job_key)
            if phase is None:
                self._phases.pop(job_key, None)
                self._forget_attempts(job_key)
            else:
                self._phases[job_key] = phase
            if old == phase:
                return
            if old is not None:
                self.jobs.labels(phase=old).dec()
            if phase is not None:
                self.jobs.labels(phase=phase).inc()

    def observe_attempts(self, job_key: str, attempts: int) -> None:
        """Record the attempts ``job_key`` (``namespace/name``) has made so far."""
        namespace, _, name = job_key.partition("/")
        self.attempts.labels(namespace=namespace, rlhfjob=name).set(attempts)

    def _forget_attempts(self, job_key: str) -> None:
        namespace, _, name = job_key.partition("/")
        with contextlib.suppress(KeyError):
            self.attempts.remove(namespace, name)

    def forget_jobs(self) -> None:
        """Drop every per-job figure (the phase counts, the attempts): a replica that stops leading
        no longer knows them, and only the leader exports job state."""
        with self._lock:
            for phase in set(self._phases.values()):
                self.jobs.labels(phase=phase).set(0)
            self._phases.clear()
            self.attempts.clear()

    def serve(self, port: int) -> None:
        start_http_server(port, registry=self.registry)
