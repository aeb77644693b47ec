"""kopf wiring: the caches the reconcile reads, what triggers it, its schedule, and startup.

Reads. kopf watches RLHFJobs and, with a server-side label selector
(``app.kubernetes.io/managed-by=hybridflow-operator``), the five kinds of children. Every
watch event updates :class:`JobCache`; the reconcile reads the job and its children from
there and never GETs from the API server, so a pass with nothing to do makes no request.

Triggers, each running :func:`hybridflow_operator.reconcile.reconcile` for one job:

* an RLHFJob event that changes what the operator acts on: a new job, a spec change
  (``metadata.generation``), deletion, or operator-owned status keys that differ from what
  this process last wrote. A ``status.progress`` push by the controller changes none of those
  and triggers nothing, nor does the echo of the operator's own status write;
* any event of a RayJob labelled as ours (KubeRay's state moves the phase), except the watch
  delivering a RayJob this process just created (:meth:`JobCache.own_create_echo`), and the
  deletion of any other child (it is recreated);
* the job's recheck time: each pass returns when a time-based transition is due (retry
  backoff, deadline, TTL), or a bounded exponential backoff after a failed API request, and
  :class:`Scheduler` runs that job's next pass then. There is no periodic sweep over all jobs.

Failed requests. Each request a pass reports in ``ReconcileResult.failures`` (a child's write,
the TTL delete, the status patch, an Event) is logged with the API's status, reason and message
and counted in ``hybridflow_operator_reconcile_errors_total{error=<the API's reason>}``; a
reconcile that raised is counted by the exception's class. Both back off as above.

A per-job lock serialises the passes of one job across triggers; each pass reads the newest
cached body under that lock, and compares against the status this process last wrote
(``JobCache.written``) until the watch delivers that write, so a lagging cache never causes a
second write.

High availability. With ``HYBRIDFLOW_LEADER_ELECTION=true`` (the chart's default with more
than one replica) only the holder of the Lease ``hybridflow-operator`` reconciles; every
replica keeps its caches warm, and a replica that takes the Lease over reconciles every
cached job once. Health: ``/healthz`` (the scheduler thread is alive) and ``/readyz`` (the
operator finished starting and its watches are listed) on ``HYBRIDFLOW_OPERATOR_HEALTH_PORT``.

Run with ``python -m hybridflow_operator``.
"""

from __future__ import annotations

import heapq
import logging
import os
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from typing import Any

import kopf

from hybridflow.spec import GROUP, PLURAL, VERSION
from hybridflow_operator.builders import RayJobDefaults
from hybridflow_operator.builders.metadata import JOB_LABEL, MANAGED_BY, MANAGED_BY_LABEL
from hybridflow_operator.cluster import ApiCluster, ApiError, Cluster
from hybridflow_operator.health import HealthServer
from hybridflow_operator.kuberay import (
    ASSUMED_CURRENT,
    RAYJOB_CRD_NAME,
    SUPPORTED_KUBERAY,
    KubeRayFeatures,
    features_from_crd,
)
from hybridflow_operator.leader import LeaderElection
from hybridflow_operator.metrics import OperatorMetrics
from hybridflow_operator.names import job_label_value
from hybridflow_operator.reconcile import ReconcileResult, reconcile
from hybridflow_operator.relist import Relister, WatchRestarts
from hybridflow_operator.status import OPERATOR_OWNED_KEYS, RetryPolicy, RLHFJobStatus

__all__ = ["JobCache", "OperatorConfig", "Scheduler", "register"]

log = logging.getLogger("hybridflow_operator")

DEFAULT_IMAGE = "ghcr.io/hybridflow/hybridflow-runtime:0.1.0"
CHILD_KINDS: tuple[tuple[str, str, str, str], ...] = (
    ("", "v1", "configmaps", "ConfigMap"),
    ("", "v1", "serviceaccounts", "ServiceAccount"),
    ("rbac.authorization.k8s.io", "v1", "roles", "Role"),
    ("rbac.authorization.k8s.io", "v1", "rolebindings", "RoleBinding"),
    ("networking.k8s.io", "v1", "networkpolicies", "NetworkPolicy"),
    ("", "v1", "services", "Service"),
    ("ray.io", "v1", "rayjobs", "RayJob"),
)
MANAGED_SELECTOR = f"{MANAGED_BY_LABEL}={MANAGED_BY}"
ECHO_PATIENCE_SECONDS = 60.0
"""How long a timed pass waits for the watch to deliver the job's own creates before it runs anyway."""
ECHO_RECHECK_SECONDS = 1.0
HANDLER_THREADS = 32
"""kopf runs the (synchronous) handlers on a thread pool, by default min(32, cores + 4) threads: 6
on 2 cores. A pass blocks its thread on API requests, so with a few busy jobs every event of every
other job waits behind them, the caches lag and the queued events' bodies pile up in memory
(bench/operator_scale.py at 2,000 jobs)."""


def _labels(value: str) -> tuple[tuple[str, str], ...]:
    """``k=v,k2=v2`` as label pairs; a malformed entry stops the operator at start, naming it."""
    pairs = []
    for item in (part.strip() for part in value.split(",") if part.strip()):
        key, sep, label = item.partition("=")
        if not sep or not key:
            raise ValueError(f"HYBRIDFLOW_KUBERAY_POD_LABELS: {item!r} is not key=value")
        pairs.append((key, label))
    if not pairs:
        raise ValueError("HYBRIDFLOW_KUBERAY_POD_LABELS: empty; the KubeRay operator's pods need a label")
    return tuple(pairs)


def _flag(value: str) -> bool:
    return value.strip().lower() in ("1", "true", "yes")


class OperatorConfig:
    """Settings read once from the environment (the chart sets them)."""

    def __init__(self, env: Mapping[str, str] = os.environ) -> None:
        self.defaults = RayJobDefaults(
            image=env.get("HYBRIDFLOW_RUNTIME_IMAGE", DEFAULT_IMAGE),
            head_cpu=env.get("HYBRIDFLOW_HEAD_CPU", "2"),
            head_memory=env.get("HYBRIDFLOW_HEAD_MEMORY", "8Gi"),
            kuberay_pod_labels=_labels(
                env.get("HYBRIDFLOW_KUBERAY_POD_LABELS", "app.kubernetes.io/name=kuberay-operator")
            ),
        )
        self.metrics_port = int(env.get("HYBRIDFLOW_OPERATOR_METRICS_PORT", "8080"))
        self.health_port = int(env.get("HYBRIDFLOW_OPERATOR_HEALTH_PORT", "8081"))
        self.retry_policy = RetryPolicy(
            base_seconds=float(env.get("HYBRIDFLOW_RETRY_BACKOFF_SECONDS", "10")),
            max_seconds=float(env.get("HYBRIDFLOW_RETRY_BACKOFF_MAX_SECONDS", "600")),
        )
        self.error_backoff_seconds = float(env.get("HYBRIDFLOW_ERROR_BACKOFF_SECONDS", "1"))
        self.error_backoff_max_seconds = float(env.get("HYBRIDFLOW_ERROR_BACKOFF_MAX_SECONDS", "300"))
        self.leader_election = _flag(env.get("HYBRIDFLOW_LEADER_ELECTION", "false"))
        self.namespace = env.get("POD_NAMESPACE", "default")
        self.identity = env.get("POD_NAME") or f"hybridflow-operator-{os.getpid()}"
        self.timer_workers = int(env.get("HYBRIDFLOW_TIMER_WORKERS", "4"))
        self.namespaces = [n for n in env.get("WATCH_NAMESPACES", "").split(",") if n]


JobKey = tuple[str, str]


class JobCache:
    """What the watches delivered: RLHFJobs by (namespace, name), children by (namespace, job label).

    Children carry the job's label, ``hybridflow.io/job``, whose value is the job's name only up to
    63 characters (longer names are cut and hashed, ``names.job_label_value``), so children are
    kept by (namespace, label value) and :meth:`children_of` finds a job's by its name; a child
    event is mapped back to its job through the jobs cached under that label.

    Mutated only from kopf's handlers (and :class:`Relister`); read under the job's lock by the
    reconcile. Plain dicts with whole-value replacement, so a reader never sees a half-updated
    entry. Every entry remembers when it was last put (a counter), so that a relist can tell
    what it saw from what changed after it.
    """

    def __init__(self) -> None:
        self.jobs: dict[JobKey, dict[str, Any]] = {}
        self.children: defaultdict[JobKey, dict[tuple[str, str], dict[str, Any]]] = defaultdict(dict)
        """By (namespace, job label value), then (kind, name)."""
        self.written: dict[JobKey, RLHFJobStatus] = {}
        """The status each job's last pass left stored, until the watch delivers it."""
        self.created: dict[JobKey, set[str]] = {}
        """RayJobs each job's passes created, until the watch delivers them (:meth:`own_create_echo`)."""
        self.unseen: dict[JobKey, dict[tuple[str, str], float]] = {}
        """Children each job's passes created, by (kind, name), with when (monotonic), until the watch
        delivers them: while a job has one, the cache is behind this process's own writes."""
        self._job_by_label: dict[JobKey, JobKey] = {}
        self._put_at: dict[tuple[str, str, str, str], int] = {}
        """(kind, namespace, label-or-job, name) -> :attr:`clock` when last put."""
        self.clock = 0

    def put_job(self, key: JobKey, body: Mapping[str, Any]) -> None:
        self.jobs[key] = dict(body)
        self._job_by_label[(key[0], job_label_value(key[1]))] = key
        self.clock += 1
        self._put_at[("RLHFJob", key[0], key[1], key[1])] = self.clock

    def drop_job(self, key: JobKey) -> None:
        self.jobs.pop(key, None)
        label = (key[0], job_label_value(key[1]))
        if self._job_by_label.get(label) == key:
            del self._job_by_label[label]
        self._put_at.pop(("RLHFJob", key[0], key[1], key[1]), None)

    def children_of(self, key: JobKey) -> dict[tuple[str, str], dict[str, Any]]:
        return self.children.get((key[0], job_label_value(key[1])), {})

    def own_create_echo(
        self, key: JobKey, name: str, event_type: str | None, body: Mapping[str, Any]
    ) -> bool:
        """Is this RayJob event the watch delivering a RayJob this process created?

        Such an ADDED event (no status yet) holds nothing the creating pass did not know, so it
        triggers no pass. A pass there would also race the watches of the children created just
        before the RayJob: one that had not delivered its child yet made the pass create it again
        (409, then a read). Any other event of that RayJob ends the wait for the echo.
        """
        pending = self.created.get(key)
        if not pending or name not in pending:
            return False
        pending.discard(name)
        if not pending:
            del self.created[key]
        return event_type == "ADDED" and not body.get("status")

    def put_child(self, body: Mapping[str, Any], deleted: bool) -> JobKey | None:
        """Cache (or forget) a child; the key of its job (as cached, else its label's), or None
        for an object without the job label."""
        meta = body.get("metadata") or {}
        job = (meta.get("labels") or {}).get(JOB_LABEL)
        if not job:
            return None
        label = (str(meta.get("namespace")), str(job))
        child = (str(body.get("kind")), str(meta.get("name")))
        stamp = (child[0], label[0], label[1], child[1])
        if deleted:
            self.children[label].pop(child, None)
            self._put_at.pop(stamp, None)
        else:
            self.children[label][child] = _cached_form(body)
            self.clock += 1
            self._put_at[stamp] = self.clock
        key = self._job_by_label.get(label, label)
        pending = self.unseen.get(key)
        if pending is not None:
            pending.pop(child, None)
            if not pending:
                self.unseen.pop(key, None)
        return key

    def behind(self, key: JobKey, now: float, patience: float) -> bool:
        """Whether ``key``'s children as cached lag behind what this process created for it (a create
        the watch has not delivered yet), for at most ``patience`` seconds after that create."""
        pending = self.unseen.get(key)
        if not pending:
            return False
        return now - min(pending.values()) < patience

    def stale_jobs(self, listed: set[JobKey], since: int) -> list[JobKey]:
        """Cached jobs a list begun at :attr:`clock` ``since`` did not return and no event put since."""
        return [  # snapshots: kopf's handler threads may put meanwhile
            key
            for key in list(self.jobs)
            if key not in listed and self._put_at.get(("RLHFJob", key[0], key[1], key[1]), 0) <= since
        ]

    def stale_children(self, kind: str, listed: set[tuple[str, str]], since: int) -> list[dict[str, Any]]:
        """Cached children of ``kind`` a list (of (namespace, name)) begun at ``since`` did not return."""
        stale = []
        for (namespace, label), children in list(self.children.items()):
            for (child_kind, name), body in list(children.items()):
                if child_kind != kind or (namespace, name) in listed:
                    continue
                if self._put_at.get((kind, namespace, label, name), 0) <= since:
                    stale.append(body)
        return stale

    def relevant_job_change(self, key: JobKey, body: Mapping[str, Any]) -> bool:
        """Does ``body`` (a new version of the job) change anything the operator acts on?"""
        old = self.jobs.get(key)
        meta = body.get("metadata") or {}
        if old is None or meta.get("deletionTimestamp"):
            return True
        if (old.get("metadata") or {}).get("generation") != meta.get("generation"):
            return True
        if (old.get("metadata") or {}).get("uid") != meta.get("uid"):
            return True
        if _replacements(body.get("status")) != _replacements(old.get("status")):
            return True  # a server-mode job's controller reports a replaced rollout replica: an Event
        stored = _owned_status(body.get("status"))
        written = self.written.get(key)
        if written is not None:
            if stored == _owned_status(written.to_json()):
                self.written.pop(key, None)  # the watch caught up with our write
                return False
            return stored != _owned_status(old.get("status"))  # someone else wrote our keys
        return stored != _owned_status(old.get("status"))


def _cached_form(body: Mapping[str, Any]) -> dict[str, Any]:
    """What the cache keeps of a child: everything a pass reads of it.

    A RayJob keeps its metadata, ``spec.suspend`` and status (``ObservedRayJob`` reads no more):
    its pod templates, nine tenths of it, are the operator's own output and never read back,
    and at thousands of jobs they were most of the operator's memory and of what each of the
    garbage collector's full passes walked. Other children are kept whole (a ConfigMap's data is
    compared with what it should hold).
    """
    raw = dict(body)
    if raw.get("kind") != "RayJob":
        return raw
    spec = raw.get("spec") or {}
    return {
        "apiVersion": raw.get("apiVersion"),
        "kind": "RayJob",
        "metadata": raw.get("metadata") or {},
        "spec": {"suspend": spec.get("suspend", False)},
        "status": raw.get("status") or {},
    }


def _replacements(status: object) -> tuple[object, object]:
    """The rollout service and its replacement count in a status's progress (``(None, None)``: none)."""
    progress = status.get("progress") if isinstance(status, Mapping) else None
    rollout = progress.get("rollout") if isinstance(progress, Mapping) else None
    if not isinstance(rollout, Mapping):
        return None, None
    return rollout.get("startedAt"), rollout.get("replicasReplaced")


def _owned_status(status: object) -> dict[str, Any]:
    if not isinstance(status, Mapping):
        return {}
    return {key: status.get(key) for key in OPERATOR_OWNED_KEYS if status.get(key) not in (None, [], {})}


class KubeRayState:
    """What the installed KubeRay serves, as last read; ``for_builders`` what a pass builds for."""

    def __init__(self) -> None:
        self.features: KubeRayFeatures | None = None
        self._lock = threading.Lock()

    def update(self, features: KubeRayFeatures) -> bool:
        with self._lock:
            changed = features != self.features
            self.features = features
            return changed

    def for_builders(self) -> KubeRayFeatures:
        """The features read, or (nothing read, or no CRD yet) the newest supported KubeRay's: a
        RayJob create then answers 404 (``KubeRayMissing``) until KubeRay is installed."""
        features = self.features
        return features if features is not None and features.installed else ASSUMED_CURRENT


class NoDiffBase(kopf.DiffBaseStorage):
    """kopf's diff base, kept empty: it serves on.create/on.update/on.resume handlers, and this
    operator has none (every handler is on.event, and :class:`JobCache` tells what changed). kopf
    still builds one for every event it processes, a deep copy of the whole body (a RayJob's pod
    templates included) and a second one to clean it; an empty one costs nothing. Nothing is
    stored on any object."""

    def build(self, *, body: kopf.Body, extra_fields: Iterable[Any] | None = None) -> kopf.BodyEssence:
        return kopf.BodyEssence()

    def fetch(self, *, body: kopf.Body) -> kopf.BodyEssence | None:
        return kopf.BodyEssence()

    def store(self, *, body: kopf.Body, patch: kopf.Patch, essence: kopf.BodyEssence) -> None:
        return None


class Scheduler:
    """Runs each job's next pass at the time its last pass asked for; one thread, a heap of due times.

    A job has at most one pending time (the earliest asked for). Due passes run on a small
    thread pool, so a burst of deadlines does not serialise. ``clock`` is monotonic seconds.
    """

    def __init__(
        self, run: Callable[[JobKey], object], *, workers: int, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._run = run
        self._clock = clock
        self._heap: list[tuple[float, JobKey]] = []
        self._due: dict[JobKey, float] = {}
        self._wakeup = threading.Condition()
        self._stopped = False
        self._pool = ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="hybridflow-recheck")
        self._thread = threading.Thread(target=self._loop, name="hybridflow-scheduler", daemon=True)
        self.heartbeat = self._clock()

    def start(self) -> None:
        self._thread.start()

    def alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self) -> None:
        with self._wakeup:
            self._stopped = True
            self._wakeup.notify()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def at(self, key: JobKey, delay_seconds: float) -> None:
        """Run ``key``'s pass in ``delay_seconds`` (or earlier, if already due earlier)."""
        due = self._clock() + max(0.0, delay_seconds)
        with self._wakeup:
            if key in self._due and self._due[key] <= due:
                return
            self._due[key] = due
            heapq.heappush(self._heap, (due, key))
            self._wakeup.notify()

    def forget(self, key: JobKey) -> None:
        with self._wakeup:
            self._due.pop(key, None)

    def pending(self) -> dict[JobKey, float]:
        with self._wakeup:
            return dict(self._due)

    def _loop(self) -> None:
        while True:
            with self._wakeup:
                self.heartbeat = self._clock()
                if self._stopped:
                    return
                now = self._clock()
                while self._heap and self._heap[0][0] <= now:
                    due, key = heapq.heappop(self._heap)
                    if self._due.get(key) == due:
                        del self._due[key]
                        self._pool.submit(self._run, key)
                timeout = (self._heap[0][0] - now) if self._heap else 5.0
                self._wakeup.wait(min(timeout, 5.0))


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
    cache = JobCache()
    locks: defaultdict[JobKey, threading.Lock] = defaultdict(threading.Lock)
    failures: defaultdict[JobKey, int] = defaultdict(int)
    leader = LeaderElection.from_config(config, api) if config.leader_election else None
    ready = threading.Event()

    def child_gone(child: dict[str, Any]) -> None:
        """A child a relist no longer returns: as its DELETED event (the job may be gone too)."""
        key = cache.put_child(child, deleted=True)
        if key is None or key not in cache.jobs:
            return
        if job_is_gone(key):
            forget_job(key)
            return
        run(key, "relist")

    kuberay = KubeRayState()

    def read_kuberay(crd: Mapping[str, Any] | None = None, *, read: bool = True) -> None:
        """Learn what the installed KubeRay serves (``hybridflow_operator.kuberay``); when it changed
        after startup, every job gets a pass (jobs waiting for KubeRay go on, or are refused)."""
        if read:
            try:
                crd = api.get_crd(RAYJOB_CRD_NAME)
            except ApiError as err:
                log.warning(
                    "reading CustomResourceDefinition %s failed (%s): assuming KubeRay %s",
                    RAYJOB_CRD_NAME,
                    err,
                    SUPPORTED_KUBERAY[-1],
                )
                return
        features = features_from_crd(crd)
        if kuberay.update(features):
            log.info(
                "KubeRay: the RayJob CRD %s (%s)",
                "is served" if features.installed else "is missing",
                features.version_range,
            )
            if ready.is_set():
                reconcile_everything()

    relister = Relister(
        api,
        cache,
        namespaces=config.namespaces,
        label_selector=MANAGED_SELECTOR,
        on_job_gone=lambda key: forget_job(key),
        on_child_gone=child_gone,
    )
    kind_of_plural = {plural: kind for _group, _version, plural, kind in CHILD_KINDS} | {PLURAL: "RLHFJob"}
    watch_restarts = WatchRestarts(
        lambda plural: relister.noted(kind_of_plural[plural]) if plural in kind_of_plural else None
    )

    def run(key: JobKey, trigger: str, skip: Callable[[], bool] | None = None) -> ReconcileResult | None:
        """One pass for ``key`` under its lock; none when ``skip`` (asked under the lock) says so.

        A timed pass (a recheck, a backoff) waits while the job's cache is behind this process's own
        creates (:meth:`JobCache.behind`): with the watches lagging (thousands of jobs, a slow API
        server), it would take a child it created itself for a missing one (409, a read) and a
        RayJob KubeRay has already moved on for one it has not (a Pending written for nothing).
        The watch delivering the child triggers nothing, so the pass comes back a little later.
        """
        if leader is not None and not leader.is_leader:
            return None
        if trigger == "timer" and cache.behind(key, time.monotonic(), ECHO_PATIENCE_SECONDS):
            scheduler.at(key, ECHO_RECHECK_SECONDS)
            return None
        if skip is not None:
            with locks[key]:  # after any pass of this job in flight, which records what it created
                if skip():
                    return None
        started = time.monotonic()
        metrics.reconciles.labels(trigger=trigger).inc()
        result: ReconcileResult | None = None
        try:
            with locks[key]:
                body = cache.jobs.get(key)
                if body is None or (body.get("metadata") or {}).get("deletionTimestamp"):
                    metrics.observe_phase(f"{key[0]}/{key[1]}", None)
                    scheduler.forget(key)
                    return None
                result = reconcile(
                    body,
                    cache.children_of(key).values(),
                    api,
                    config.defaults,
                    now=datetime.now(UTC),
                    last_written=cache.written.get(key),
                    retry_policy=config.retry_policy,
                    kuberay=kuberay.for_builders(),
                )
                rayjobs = {name for kind, name in result.created if kind == "RayJob"}
                if rayjobs:
                    cache.created[key] = cache.created.get(key, set()) | rayjobs
                if result.created:
                    when = time.monotonic()
                    unseen = cache.unseen.setdefault(key, {})
                    unseen.update(
                        {child: when for child in result.created if child not in cache.children_of(key)}
                    )
                    if not unseen:
                        cache.unseen.pop(key, None)
                if result.status is not None:
                    cache.written[key] = result.status
                    metrics.observe_attempts(f"{key[0]}/{key[1]}", result.status.attempts)
        except Exception as err:
            metrics.errors.labels(error=type(err).__name__).inc()
            log.exception("reconcile of RLHFJob %s/%s failed", *key)
        finally:
            metrics.latency.observe(time.monotonic() - started)
        for failure in result.failures if result is not None else ():
            # The API's reason (Forbidden, Invalid, NotFound, Conflict, Unreachable...), by which
            # the metric counts; the status patch and Events leave no condition, so this is where they show.
            metrics.errors.labels(error=failure.reason or str(failure.status)).inc()
            log.warning("RLHFJob %s/%s: %s (retried with backoff)", key[0], key[1], failure)
        if result is None or result.failed:
            failures[key] += 1
            delay = min(
                config.error_backoff_max_seconds, config.error_backoff_seconds * 2 ** (failures[key] - 1)
            )
            scheduler.at(key, delay)
            if result is None:
                return None
        else:
            failures.pop(key, None)
            if result.recheck_after_seconds is not None:
                scheduler.at(key, result.recheck_after_seconds)
        metrics.writes.inc(result.writes)
        metrics.observe_phase(f"{key[0]}/{key[1]}", None if result.deleted else result.phase)
        return result

    scheduler = Scheduler(lambda key: run(key, "timer"), workers=config.timer_workers)

    def reconcile_everything() -> None:
        for key in list(cache.jobs):
            scheduler.at(key, 0.0)

    @kopf.on.startup(registry=registry)
    def startup(settings: kopf.OperatorSettings, **_: Any) -> None:
        # The reconcile writes status itself; kopf must not add its own annotations or events.
        settings.posting.enabled = False
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="hybridflow.io")
        settings.persistence.diffbase_storage = NoDiffBase()
        settings.execution.max_workers = max(settings.execution.max_workers or 0, HANDLER_THREADS)
        for group, version, plural, _kind in CHILD_KINDS:
            # Server-side filtering: the operator never lists or watches other ConfigMaps, Roles...
            settings.watching.label_selectors[(group, plural) if group else (version, plural)] = (
                MANAGED_SELECTOR
            )
        # Fill the child caches before kopf delivers the first RLHFJob (startup handlers run before
        # the watches start): a pass must never take a child it has not heard of yet for a missing one.
        for child in api.list_children(config.namespaces, MANAGED_SELECTOR):
            cache.put_child(child, deleted=False)
        read_kuberay()
        watch_restarts.install()  # a 410 relists that kind, even when the relist finds nothing
        if serve_metrics:
            metrics.serve(config.metrics_port)
            HealthServer(config.health_port, alive=scheduler.alive, ready=lambda: ready.is_set()).start()
        scheduler.start()
        if leader is not None:
            leader.start(on_elected=reconcile_everything, on_deposed=metrics.forget_jobs)
        ready.set()

    @kopf.on.cleanup(registry=registry)
    def cleanup(**_: Any) -> None:
        scheduler.stop()
        relister.stop()
        watch_restarts.uninstall()
        if leader is not None:
            leader.stop()

    def forget_job(key: JobKey) -> None:
        cache.drop_job(key)
        cache.unseen.pop(key, None)
        cache.written.pop(key, None)
        cache.created.pop(key, None)
        scheduler.forget(key)
        metrics.observe_phase(f"{key[0]}/{key[1]}", None)

    def job_is_gone(key: JobKey) -> bool:
        """Whether the cached job ``key`` no longer exists as cached (deleted, or a namesake).

        The garbage collector deletes a job's children right after the job, and the children's
        DELETED events can come before the job's: a pass then would re-create children for a
        job that is gone. A child's deletion is rare, so it costs one read of the job."""
        cached_uid = (cache.jobs.get(key, {}).get("metadata") or {}).get("uid")
        try:
            stored = api.get("RLHFJob", key[0], key[1])
        except ApiError as err:
            log.warning("RLHFJob %s/%s: reading it after a child's deletion failed: %s", *key, err)
            return False  # keep it: the next event or recheck decides
        return stored is None or (stored.get("metadata") or {}).get("uid") != cached_uid

    @kopf.on.event(GROUP, VERSION, PLURAL, registry=registry)
    def job_changed(*, body: kopf.Body, namespace: str | None, name: str, type: str | None, **_: Any) -> None:
        key = (str(namespace), name)
        if type == "DELETED":
            forget_job(key)
            return
        if type is None:  # listed, not watched: a (re)list, which reports no deletions
            relister.noted("RLHFJob")
        relevant = cache.relevant_job_change(key, body)
        cache.put_job(key, body)
        if relevant:
            run(key, "rlhfjob")

    def child_handler(kind: str) -> Callable[..., None]:
        def child_changed(*, body: kopf.Body, type: str | None, **_: Any) -> None:
            if type is None:  # listed, not watched: a (re)list, which reports no deletions
                relister.noted(kind)
            key = cache.put_child(body, deleted=type == "DELETED")
            if key is None or key not in cache.jobs:
                return
            if type == "DELETED" and job_is_gone(key):
                forget_job(key)
                return
            if kind == "RayJob":
                name = str((body.get("metadata") or {}).get("name"))
                run(key, "rayjob", skip=lambda: cache.own_create_echo(key, name, type, body))
            elif type == "DELETED":
                run(key, kind.lower())

        child_changed.__name__ = f"{kind.lower()}_changed"
        return child_changed

    @kopf.on.event(
        "apiextensions.k8s.io",
        "v1",
        "customresourcedefinitions",
        registry=registry,
        when=lambda name, **_: name == RAYJOB_CRD_NAME,
    )
    def rayjob_crd_changed(*, body: kopf.Body, type: str | None, **_: Any) -> None:
        # KubeRay installed (or upgraded, or removed) while the operator runs.
        read_kuberay(None if type == "DELETED" else dict(body), read=False)

    for group, version, plural, kind in CHILD_KINDS:
        on_child = (
            kopf.on.event(group, version, plural, labels={MANAGED_BY_LABEL: MANAGED_BY}, registry=registry)
            if group
            else kopf.on.event(version, plural, labels={MANAGED_BY_LABEL: MANAGED_BY}, registry=registry)
        )
        on_child(child_handler(kind))

    return metrics
