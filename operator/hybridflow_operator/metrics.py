"""The operator's own Prometheus metrics (served on ``--metrics-port``, default 8080).

* ``hybridflow_operator_reconciles_total{trigger}``: reconciles run, by what triggered them;
* ``hybridflow_operator_reconcile_errors_total{error}``: reconciles that raised, by exception type;
* ``hybridflow_operator_reconcile_seconds``: latency histogram;
* ``hybridflow_operator_api_writes_total``: writes the reconciles made (0 per no-op reconcile);
* ``hybridflow_operator_jobs{phase}``: RLHFJobs this operator saw last in each phase.
"""

from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

__all__ = ["OperatorMetrics"]


class OperatorMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.reconciles = Counter(
            "hybridflow_operator_reconciles", "Reconciles run", ["trigger"], registry=self.registry
        )
        self.errors = Counter(
            "hybridflow_operator_reconcile_errors",
            "Reconciles that raised",
            ["error"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "hybridflow_operator_reconcile_seconds", "Reconcile latency", registry=self.registry
        )
        self.writes = Counter(
            "hybridflow_operator_api_writes", "API writes made by reconciles", registry=self.registry
        )
        self.jobs = Gauge("hybridflow_operator_jobs", "RLHFJobs by phase", ["phase"], registry=self.registry)
        self._phases: dict[str, str] = {}
        self._lock = threading.Lock()

    def observe_phase(self, job_key: str, phase: str | None) -> None:
        """Record ``job_key``'s phase (None: the job is gone) and refresh the per-phase gauge."""
        with self._lock:
            if phase is None:
                self._phases.pop(job_key, None)
            else:
                self._phases[job_key] = phase
            counts: dict[str, int] = {}
            for value in self._phases.values():
                counts[value] = counts.get(value, 0) + 1
            for label in {*counts, *(s.labels["phase"] for m in self.jobs.collect() for s in m.samples)}:
                self.jobs.labels(phase=label).set(counts.get(label, 0))

    def serve(self, port: int) -> None:
        start_http_server(port, registry=self.registry)
