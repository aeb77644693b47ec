"""kopf wiring: which events trigger the reconcile, operator settings and startup.

Triggers, all calling :func:`hybridflow_operator.reconcile.reconcile` on the current RLHFJob:

* any event of an RLHFJob (``on.event``: no kopf bookkeeping is written on the object, so a
  reconcile that changes nothing writes nothing);
* any event of a RayJob labelled as ours: the owning RLHFJob is read and reconciled;
* a periodic sweep over the RLHFJobs seen so far, for transitions that only time causes
  (deadline, TTL). It is a plain thread rather than a kopf timer: kopf puts a finalizer on
  every object that has a timer, which would be a write per job that the design avoids.

A per-job lock serialises the reconciles of one job across these triggers, and each reconcile
reads the job afresh under that lock, so a pass never acts on a body older than the previous
pass's status write. Run with
``python -m hybridflow_operator`` (which registers on kopf's default registry and runs it).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import defaultdict
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

import kopf

from hybridflow.spec import GROUP, PLURAL, VERSION
from hybridflow_operator.builders import RayJobDefaults
from hybridflow_operator.builders.metadata import JOB_LABEL, MANAGED_BY, MANAGED_BY_LABEL
from hybridflow_operator.cluster import ApiCluster, Cluster
from hybridflow_operator.metrics import OperatorMetrics
from hybridflow_operator.reconcile import ReconcileResult, reconcile

__all__ = ["OperatorConfig", "register"]

log = logging.getLogger("hybridflow_operator")

DEFAULT_IMAGE = "ghcr.io/hybridflow/hybridflow-runtime:0.1.0"
TIMER_SECONDS = 30.0


class OperatorConfig:
    """Settings read once from the environment (the chart sets them)."""

    def __init__(self, env: Mapping[str, str] = os.environ) -> None:
        self.defaults = RayJobDefaults(
            image=env.get("HYBRIDFLOW_RUNTIME_IMAGE", DEFAULT_IMAGE),
            head_cpu=env.get("HYBRIDFLOW_HEAD_CPU", "2"),
            head_memory=env.get("HYBRIDFLOW_HEAD_MEMORY", "8Gi"),
        )
        self.metrics_port = int(env.get("HYBRIDFLOW_OPERATOR_METRICS_PORT", "8080"))
        self.timer_seconds = float(env.get("HYBRIDFLOW_RECONCILE_INTERVAL_SECONDS", str(TIMER_SECONDS)))


def register(
    registry: kopf.OperatorRegistry,
    *,
    config: OperatorConfig,
    cluster: Cluster | None = None,
    metrics: OperatorMetrics | None = None,
    serve_metrics: bool = True,
) -> OperatorMetrics:
    """Register the handlers on ``registry`` (the default one in production, a fresh one in tests)."""
    metrics = metrics or OperatorMetrics()
    api: Cluster = cluster or ApiCluster.from_environment()
    locks: defaultdict[str, threading.Lock] = defaultdict(threading.Lock)

    def run(namespace: str, name: str, trigger: str) -> ReconcileResult | None:
        key = f"{namespace}/{name}"
        started = time.monotonic()
        metrics.reconciles.labels(trigger=trigger).inc()
        try:
            with locks[key]:
                # The triggering body may be older than the last reconcile's status write (a timer
                # or a RayJob event): read the job afresh so each pass starts from what is stored.
                body = api.get("RLHFJob", namespace, name)
                if body is None or (body.get("metadata") or {}).get("deletionTimestamp"):
                    metrics.observe_phase(key, None)
                    return None
                result = reconcile(body, api, config.defaults, now=datetime.now(UTC))
                metrics.observe_attempts(key, int((body.get("status") or {}).get("attempts") or 0))
        except Exception as err:
            metrics.errors.labels(error=type(err).__name__).inc()
            log.exception("reconcile of RLHFJob %s failed", key)
            return None
        finally:
            metrics.latency.observe(time.monotonic() - started)
        metrics.writes.inc(result.writes)
        metrics.observe_phase(key, None if result.deleted else result.phase)
        return result

    known: set[tuple[str, str]] = set()
    stop_sweeping = threading.Event()

    def sweep() -> None:
        while not stop_sweeping.wait(config.timer_seconds):
            for namespace, name in sorted(known):
                run(namespace, name, "timer")

    @kopf.on.startup(registry=registry)
    def startup(settings: kopf.OperatorSettings, **_: Any) -> None:
        # The reconcile writes status itself; kopf must not add its own annotations or events.
        settings.posting.enabled = False
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="hybridflow.io")
        settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix="hybridflow.io")
        if serve_metrics:
            metrics.serve(config.metrics_port)
        threading.Thread(target=sweep, name="hybridflow-sweep", daemon=True).start()

    @kopf.on.cleanup(registry=registry)
    def cleanup(**_: Any) -> None:
        stop_sweeping.set()

    @kopf.on.event(GROUP, VERSION, PLURAL, registry=registry)
    def job_changed(*, namespace: str | None, name: str, type: str, **_: Any) -> None:
        if type == "DELETED":
            known.discard((str(namespace), name))
            metrics.observe_phase(f"{namespace}/{name}", None)
            return
        known.add((str(namespace), name))
        run(str(namespace), name, "rlhfjob")

    @kopf.on.event("ray.io", "v1", "rayjobs", labels={MANAGED_BY_LABEL: MANAGED_BY}, registry=registry)
    def rayjob_changed(body: kopf.Body, **_: Any) -> None:
        meta = body.get("metadata") or {}
        owner = (meta.get("labels") or {}).get(JOB_LABEL)
        owners = [ref for ref in meta.get("ownerReferences") or [] if ref.get("kind") == "RLHFJob"]
        name = owners[0]["name"] if owners else owner
        if name:
            run(str(meta["namespace"]), str(name), "rayjob")

    return metrics
