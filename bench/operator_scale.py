"""Operator figures at 200 and 2,000 RLHFJobs against the strict API-server double.

The double (tests/kube: CRD schemas and CEL, KubeRay v1.7's RayJob schema, Kubernetes' own
schemas, RBAC for ServiceAccount tokens) runs in this process, with both CRDs stored as objects
too (the operator reads ``customresourcedefinitions/rayjobs.ray.io`` to learn what the installed
KubeRay serves; without the object it takes KubeRay for missing); the operator runs as its own
process (``python -m hybridflow_operator``, as in the image) with a token of its own, so every
request it makes is counted apart. Two stand-ins, processes of their own too (this script with
``--kuberay`` and ``--controllers``), play KubeRay and the jobs' controllers: KubeRay moves every
RayJob through Initializing -> Running, holds it Running, and completes the jobs when told, in
the order they started, at ``RATE_PER_SECOND``. While a job runs its controller pushes
``status.progress`` with the runtime's own :class:`hybridflow.incluster.status.StatusPusher`
(the real body, through its throttle) every :data:`PUSH_SECONDS`, with the job's own
ServiceAccount token (RBAC-checked), from as many connections as :data:`PUSH_WORKERS`: the
pushes never wait behind KubeRay's writes, nor KubeRay's behind them (KubeRay is one process,
each controller is its own pod). Jobs arrive at ``RATE_PER_SECOND``; each size runs on a fresh
double, fresh stand-ins and a fresh operator.

Each size runs in three phases: the creates (``RATE_PER_SECOND``); the steady state, once every
job is Running and the operator's writes have settled: :data:`STEADY_SECONDS` with all N jobs
Running and pushing; then the completions, and a restarted operator.

Figures per size N (suffix ``_N``):

* ``create_to_rayjob_p50_ms`` / ``p99``: from the create request returning to the RayJob's
  ADDED event, as the double delivers it to the stand-in's watch (target p50 <= 100 ms, and p50
  at 2,000 within 1.5x of p50 at 200), with ``load_average_1m``: the machine's 1-minute load
  average over the creates (the mean of one sample a second), the load these latencies were
  measured under;
* the steady state: ``operator_cpu_cores`` (the operator process's CPU seconds over the window's
  wall seconds, /proc/<pid>/stat; target <= 0.5), ``operator_rss_mb`` at the end of the window
  (target below the chart's memory limit, ``resources.limits.memory`` in
  helm/hybridflow/values.yaml), ``progress_pushes_per_second`` (pushes the double served in the
  window, against ``progress_pushes_offered_per_second`` = N / PUSH_SECONDS),
  ``operator_cpu_ms_per_push``, ``steady_operator_writes`` and ``steady_operator_reconciles``
  (target 0: a push triggers nothing; ``steady_reconciles_by_trigger`` names any), the cores the
  double (``double_cpu_cores``) and the stand-ins (``stand_in_cpu_cores``) took meanwhile, and
  ``steady_load_average_1m`` (the load at the window's end: its 1-minute average is the window's);
  ``settle_seconds``: from every job Running to the window (``steady_settled`` false: the
  operator's writes or passes never stood still for SETTLE_SECONDS within SETTLE_TIMEOUT_SECONDS);
* ``writes_per_job_lifecycle``: the operator's writes (creates, patches, deletes; status and
  Events included) from creation to Succeeded, per job (target <= 10, whatever the size and the
  load); ``writes_by_verb``, ``writes_by_request`` (by verb and resource), ``write_answers`` (the
  double's status codes), ``status_patches_by_phase`` (the phase each status patch wrote) and
  ``status_patch_sequences`` (per job, the most common four) say which; ``jobs_over_10_writes``
  counts the jobs above the budget, and ``pending_patches_*`` tells an extra Pending (the
  operator's first status waits ``PENDING_WRITE_DELAY_SECONDS`` for KubeRay's first) written
  before KubeRay's status reached the double (KubeRay late) from one written after it (the
  operator had not yet taken in the RayJob event). ``kuberay_first_status_p50_ms`` / ``p99`` /
  ``max``: from the operator's RayJob create to the stand-in's first RayJob status, at the double;
  ``kuberay_to_operator_status_p50_ms`` / ``p99_ms`` / ``max_ms``: from KubeRay's Initializing or
  Running reaching the double to the operator's status patch for it (the event's delivery, the
  operator's queue and its pass; measured during the creates, under ``load_average_1m``: more
  than PENDING_WRITE_DELAY_SECONDS there is an extra Pending); ``progress_pushes_per_job`` are
  the controllers', counted apart;
* ``reads_per_reconcile``: the operator's GETs of single objects per reconcile (target 0: it
  reads its caches, filled by list+watch; the startup read of the RayJob CRD is not a reconcile's);
* ``noop_reconcile_writes``: writes of a restarted operator that reconciles every finished job
  again with nothing changed (target 0);
* ``operator_rss_mb_created`` / ``operator_rss_mb_finished``: the operator's resident memory
  right after the last create / once every job has finished;
* ``operator_cpu_ms_per_job``, ``double_cpu_ms_per_job`` (this process: the double and the
  creating loop), ``stand_in_cpu_ms_per_job``: CPU time per job from the first create until every
  job Succeeded, the steady window left out (the jobs still run longer than they did when each
  completed 20 s after starting: ``progress_pushes_per_job`` says how many pushes that is);
  ``load_average_1m_end``: the machine's, at the end of the size's run;
* what :class:`Sampler` saw: ``creating_*_cpu_cores_peak`` (the most cores the operator, this
  process and the stand-ins took over any 10 s of the creates: one core is all the double can
  take, in one interpreter), ``creating_double_lag_*`` / ``steady_double_lag_*`` (how long an
  empty call waited for the double's loop: a double busy beyond one core delays every request
  and every watch event), ``operator_rss_mb_peak`` (over the run, a sample a second) and the
  phase it was reached in;
* ``stand_in_lags`` (how late the stand-ins' KubeRay writes and pushes went out after they were
  due), ``stand_in_errors``, and ``run_seconds`` (the size's whole run).

``HYBRIDFLOW_BENCH_JOBS`` (comma-separated sizes, default ``200,2000``) overrides the sizes,
``HYBRIDFLOW_BENCH_STEADY_SECONDS`` the steady window; quick mode (``HYBRIDFLOW_BENCH_QUICK=1``)
runs 20 jobs and a 10 s window. The last line printed is one JSON object.
"""

from __future__ import annotations

import collections
import functools
import gc
import heapq
import http.client
import inspect
import json
import os
import queue
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from hybridflow.incluster.status import StatusPusher  # noqa: E402
from hybridflow.metrics.step_report import StepReport  # noqa: E402
from hybridflow_operator.status import PENDING_WRITE_DELAY_SECONDS  # noqa: E402
from kube.emulator import ApiServerEmulator  # noqa: E402
from kube.harness import EmulatedCluster, load_crd, wait_until  # noqa: E402

QUICK = os.environ.get("HYBRIDFLOW_BENCH_QUICK") == "1"
"""Quick mode (``make bench-smoke``): a few jobs, to prove the bench runs and prints its JSON line."""
SIZES = [int(n) for n in os.environ.get("HYBRIDFLOW_BENCH_JOBS", "20" if QUICK else "200,2000").split(",")]
RATE_PER_SECOND = float(os.environ.get("HYBRIDFLOW_BENCH_RATE", "10"))
FREEZE_EVERY_JOBS = 100
"""Jobs created between two :func:`keep_out_of_collections` of the bench process (10 s at 10/s)."""
FREEZE_EVERY_SECONDS = 10.0
"""The same while nothing is created (the steady state, the completions): pushes store versions too."""
PUSH_SECONDS = float(inspect.signature(StatusPusher).parameters["min_interval_seconds"].default)
"""A controller pushes progress this often: the runtime's :class:`StatusPusher` pushes at most once
per ``min_interval_seconds`` (10 s, its default, which ``hybridflow run --in-cluster`` keeps:
``StatusPusher.in_cluster`` in runtime/hybridflow/cli.py), and a training step ends more often
than that. Quick mode keeps it too."""
STEADY_SECONDS = float(os.environ.get("HYBRIDFLOW_BENCH_STEADY_SECONDS", "10" if QUICK else "60"))
"""The steady state's measured window: every job Running, each pushing every PUSH_SECONDS (quick
mode: one PUSH_SECONDS, so that every job pushes once in it)."""
SETTLE_SECONDS = 3.0
"""The operator's writes and passes stay unchanged this long before the window opens (its last
Running patches, and any events it is behind on), and the window opens no earlier than
PENDING_WRITE_DELAY_SECONDS + this after the last create: the creating pass of each job leaves a
recheck at the end of its pending hold, which runs (and writes nothing) even after KubeRay's
first status was written; it is no push's doing."""
SETTLE_TIMEOUT_SECONDS = 180.0
"""At most this long from every job Running to the window; an operator still busy then is measured
busy (``steady_settled`` false)."""
FIRST_STEP_SECONDS = 1.0
"""From KubeRay's Running to the controller's first step report (it pushes at once: the first push)."""
TOTAL_STEPS = 100_000
"""The controllers' ``totalSteps``: never reached, so no final-step push outside the throttle."""
PUSH_WORKERS = 16
"""Threads of the stand-in pushing progress, each with a connection of its own (2,000 controllers
push concurrently; a thread waits for the double's answer, so one thread would serialise them)."""
KUBERAY_WORKERS = 2
"""Threads of the stand-in writing RayJob status (each job's writes on one, in order)."""
NAMESPACE = "default"
OPERATOR_TOKEN = "hybridflow-operator-bench"
STAND_IN_TOKEN = "kuberay-stand-in-bench"
RAYJOB_CRD = ROOT.parent / "shared" / "kuberay" / "ray.io_rayjobs.yaml"
RLHFJOB_CRD = ROOT / "crds" / "hybridflow.io_rlhfjobs.yaml"
GROUP, VERSION, PLURAL = "hybridflow.io", "v1alpha1", "rlhfjobs"
JOB_LABEL = "hybridflow.io/job"
LIFECYCLE_BUDGET = 10
"""Writes per job: 6 creates (ConfigMap, ServiceAccount, Role, RoleBinding, NetworkPolicy,
RayJob), 3 status patches (Initializing, Running, Succeeded) and the Succeeded Event."""
CHART_VALUES = ROOT / "helm" / "hybridflow" / "values.yaml"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (/proc/<pid>/stat, clock ticks)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def chart_memory_limit() -> tuple[str, float]:
    """The chart's ``resources.limits.memory`` for the operator, as written and in MiB (what
    :func:`rss_mb` reports)."""
    text = str(yaml.safe_load(CHART_VALUES.read_text())["resources"]["limits"]["memory"])
    units = {"Ki": 1 / 1024, "Mi": 1, "Gi": 1024, "K": 1e3 / 2**20, "M": 1e6 / 2**20, "G": 1e9 / 2**20}
    for suffix in sorted(units, key=len, reverse=True):
        if text.endswith(suffix):
            return text, float(text.removesuffix(suffix)) * units[suffix]
    return text, float(text) / 2**20


def job_manifest(name: str) -> dict[str, Any]:
    doc = yaml.safe_load((ROOT / "examples" / "grpo-cluster.yaml").read_text())
    doc["metadata"] = {"name": name, "namespace": NAMESPACE}
    return dict(doc)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * (len(ordered) - 1) + 0.5))]


class Write:
    """One write the double received from the operator or KubeRay's stand-in (``RecordingEmulator``)."""

    __slots__ = ("at", "deployment", "job", "name", "phase", "resource", "status", "token", "verb")

    def __init__(self, at: float, token: str, verb: str, resource: str, name: str | None, data: Any) -> None:
        self.at, self.token, self.verb, self.resource, self.name = at, token, verb, resource, name
        body: dict[str, Any] = data if isinstance(data, dict) else {}
        meta = body.get("metadata") or {}
        involved = body.get("involvedObject") or body.get("regarding") or {}
        self.job = (meta.get("labels") or {}).get(JOB_LABEL) or involved.get("name") or name
        status: dict[str, Any] = body["status"] if isinstance(body.get("status"), dict) else {}
        self.phase = status.get("phase")
        self.deployment = status.get("jobDeploymentStatus")
        self.status = 0

    @property
    def key(self) -> str:
        return f"{self.verb} {self.resource}"


class RecordingEmulator(ApiServerEmulator):
    """The double, noting when each write of the operator and of KubeRay's stand-in arrived, and
    what it answered (the controllers' pushes are only counted, by ``requests_by_token``)."""

    recorded: list[Write]

    async def _handle(self, request: Any) -> Any:
        write = None
        if request.method.value in ("POST", "PUT", "PATCH", "DELETE") and request.resource is not None:
            token = (
                str(next((v for k, v in request.headers.items() if k.lower() == "authorization"), ""))
                .removeprefix("Bearer ")
                .strip()
            )
            if token in (OPERATOR_TOKEN, STAND_IN_TOKEN):
                verb = {"POST": "create", "PUT": "update", "PATCH": "patch", "DELETE": "delete"}[
                    request.method.value
                ]
                resource = str(request.resource.plural) + (
                    f"/{request.subresource}" if request.subresource else ""
                )
                write = Write(time.monotonic(), token, verb, resource, request.name, request.data)
                self.recorded.append(write)
        response = await super()._handle(request)
        if write is not None:
            write.status = int(getattr(response, "status", 0) or 0)
        return response


class Operator:
    """``python -m hybridflow_operator`` against the double, with its own token and metrics port."""

    def __init__(self, cluster: EmulatedCluster) -> None:
        config = cluster.kubeconfig(NAMESPACE)
        config["users"][0]["user"]["token"] = OPERATOR_TOKEN
        directory = Path(tempfile.mkdtemp())
        self.kubeconfig = directory / "kubeconfig"
        self.kubeconfig.write_text(yaml.safe_dump(config))
        self.metrics_port = free_port()
        env = {
            **os.environ,
            "KUBECONFIG": str(self.kubeconfig),
            "WATCH_NAMESPACES": NAMESPACE,
            "HYBRIDFLOW_OPERATOR_METRICS_PORT": str(self.metrics_port),
            "HYBRIDFLOW_OPERATOR_HEALTH_PORT": str(free_port()),
        }
        # Its log goes to a file: a pipe nobody reads until the end would block a chatty operator.
        self.log = (directory / "operator.log").open("w+")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "hybridflow_operator"],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=self.log,
            text=True,
        )

    def reconciles(self) -> float:
        return sum(self.reconciles_by_trigger().values())

    def reconciles_by_trigger(self) -> dict[str, float]:
        text = (
            urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5).read().decode()
        )
        counts: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith("hybridflow_operator_reconciles_total{"):
                labels, value = line.rsplit(" ", 1)
                trigger = labels.partition('trigger="')[2].partition('"')[0]
                counts[trigger] = counts.get(trigger, 0.0) + float(value)
        return counts

    def stop(self) -> str:
        """Stop the process (if it runs) and return its log."""
        if self.process.poll() is None:
            self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.log.flush()
        self.log.seek(0)
        return self.log.read()


class StandIn:
    """KubeRay and the jobs' controllers, in two processes of their own.

    ``--kuberay`` plays KubeRay (:class:`KubeRayProcess`), ``--controllers`` the jobs'
    controllers (:class:`ControllersProcess`); KubeRay tells the controllers, through a pipe,
    when a job's cluster runs (its controller starts) and when it completed (it stops). Processes
    of their own, so that their work (decoding every RayJob event, the status writes, the pushes)
    holds neither the interpreter lock of the double, which serves the operator (in one
    interpreter the two took turns, and the stand-in's share grew with the jobs in flight), nor
    each other's: the watch that times ``create_to_rayjob`` never waits behind a push. Each
    job's controller pushes progress with the token of the job's ServiceAccount, registered
    here; KubeRay's requests carry :data:`STAND_IN_TOKEN`. :meth:`complete` tells KubeRay to
    complete every job; on :meth:`stop` both report, as one JSON object each, when KubeRay's
    watch saw each RayJob (``time.monotonic()``, one clock for every process of the machine),
    the progress pushes, how late their lanes ran, and their errors.
    """

    def __init__(self, cluster: EmulatedCluster, jobs: list[str]) -> None:
        self.tokens = {
            job: cluster.kubeconfig_as(f"system:serviceaccount:{NAMESPACE}:{job}-controller")["users"][0][
                "user"
            ]["token"]
            for job in jobs
        }
        directory = Path(tempfile.mkdtemp())
        self.config = directory / "stand-in.json"
        self.config.write_text(json.dumps({"server": cluster.url, "tokens": self.tokens}))
        self.logs = [(directory / f"{role}.log").open("w+") for role in ("kuberay", "controllers")]
        started, told = os.pipe()  # KubeRay -> controllers: "run JOB" / "done JOB"
        try:
            self.controllers = subprocess.Popen(
                [sys.executable, __file__, "--controllers", str(self.config)],
                stdin=started,
                stdout=subprocess.PIPE,
                stderr=self.logs[1],
                text=True,
            )
            self.process = subprocess.Popen(
                [sys.executable, __file__, "--kuberay", str(self.config), str(told)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=self.logs[0],
                text=True,
                pass_fds=(told,),
            )
        finally:
            os.close(started)
            os.close(told)
        self.rayjob_seen: dict[str, float] = {}
        self.pushes = 0
        self.lags: dict[str, float] = {}
        self.errors: list[str] = []
        self._stopped = False

    def pids(self) -> tuple[int, int]:
        return self.process.pid, self.controllers.pid

    def cpu_seconds(self) -> float:
        """CPU time of both processes (KubeRay's and the controllers')."""
        return sum(cpu_seconds(pid) for pid in self.pids())

    def complete(self, rate_per_second: float) -> None:
        """Complete every job, in the order their RayJobs were seen, ``rate_per_second`` of them a second."""
        assert self.process.stdin is not None
        self.process.stdin.write(f"complete {rate_per_second}\n")
        self.process.stdin.flush()

    def stop(self) -> None:
        """End both (KubeRay stops when its stdin closes, the controllers when KubeRay's pipe does)
        and take their reports."""
        if self._stopped:
            return
        self._stopped = True
        for process, log, role in (
            (self.process, self.logs[0], "KubeRay's stand-in"),
            (self.controllers, self.logs[1], "the controllers' stand-in"),
        ):
            try:
                out, _ = process.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                out, _ = process.communicate()
            log.seek(0)
            err = log.read()
            lines = out.strip().splitlines()
            if process.returncode != 0 or not lines:
                self.errors.append(f"{role} exited with {process.returncode}: {err[-2000:]}")
                continue
            report = json.loads(lines[-1])
            self.rayjob_seen = report.get("rayjob_seen", self.rayjob_seen)
            self.pushes += report.get("pushes", 0)
            self.lags.update(report["lags"])
            self.errors.extend(report["errors"])


def spread(values: list[float]) -> dict[str, float]:
    """p50 / p99 / max of durations in seconds, in milliseconds."""
    if not values:
        return {}
    return {
        "p50_ms": round(1000 * statistics.median(values), 1),
        "p99_ms": round(1000 * percentile(values, 0.99), 1),
        "max_ms": round(1000 * max(values), 1),
    }


class Timeline:
    """A heap of (due time, job, action) and a thread that hands each action to a lane when due."""

    def __init__(self, lane_of: Any) -> None:
        self._lane_of = lane_of
        self._heap: list[tuple[float, int, str, str]] = []
        self._sequence = 0
        self._lock = threading.Condition()
        self.stopped = threading.Event()
        self.errors: list[str] = []
        self._errors_lock = threading.Lock()
        self.thread = threading.Thread(target=self._dispatch, daemon=True)

    def at(self, due: float, job: str, action: str) -> None:
        with self._lock:
            self._sequence += 1
            heapq.heappush(self._heap, (due, self._sequence, job, action))
            self._lock.notify()

    def stop(self) -> None:
        self.stopped.set()
        with self._lock:
            self._lock.notify()

    def error(self, text: str) -> None:
        with self._errors_lock:
            if len(self.errors) < 100:
                self.errors.append(text)

    def _dispatch(self) -> None:
        while not self.stopped.is_set():
            with self._lock:
                while not self.stopped.is_set() and (not self._heap or self._heap[0][0] > time.monotonic()):
                    self._lock.wait(0.05 if not self._heap else max(0.0, self._heap[0][0] - time.monotonic()))
                if self.stopped.is_set():
                    return
                due, _, job, action = heapq.heappop(self._heap)
            self._lane_of(job, action).put((due, job, action))


class KubeRayProcess:
    """KubeRay's stand-in (``python bench/operator_scale.py --kuberay CONFIG FD``): a watch on
    RayJobs and, on lanes of their own, the status writes.

    Every RayJob seen goes Initializing 0.2 s and Running 0.5 s later (KubeRay's first look at it
    and its cluster starting), keeping the ``startTime`` of Initializing as KubeRay does, and
    stays Running until ``complete`` arrives on stdin. Each job's writes go on one lane, in
    order; ``run JOB`` / ``done JOB`` go to the controllers' process (pipe FD) once its Running /
    Complete is written.
    """

    def __init__(self, server: str, told_fd: int) -> None:
        from kubernetes.client import ApiClient, Configuration, CustomObjectsApi

        def client() -> Any:
            configuration = Configuration(host=server)
            configuration.api_key = {"BearerToken": STAND_IN_TOKEN}
            configuration.api_key_prefix = {"BearerToken": "Bearer"}
            return CustomObjectsApi(ApiClient(configuration))

        self.custom = client()
        self._clients = [client() for _ in range(KUBERAY_WORKERS)]
        self._told = os.fdopen(told_fd, "w")
        self._told_lock = threading.Lock()
        self.rayjob_seen: dict[str, float] = {}
        self._started: dict[str, str] = {}
        self._lags: list[float] = []
        self._resource_version = ""
        self._lanes: list[queue.Queue[tuple[float, str, str] | None]] = [
            queue.Queue() for _ in range(KUBERAY_WORKERS)
        ]
        self.timeline = Timeline(lambda job, _action: self._lanes[hash(job) % KUBERAY_WORKERS])
        self._threads = [
            self.timeline.thread,
            threading.Thread(target=self._watch, daemon=True),
            *(threading.Thread(target=self._write, args=(i,), daemon=True) for i in range(KUBERAY_WORKERS)),
        ]

    def run_until_stdin_closes(self) -> None:
        for thread in self._threads:
            thread.start()
        for line in sys.stdin:
            command = line.split()
            if command[:1] == ["complete"]:
                rate = float(command[1])
                start = time.monotonic()
                for index, job in enumerate(sorted(self.rayjob_seen, key=lambda j: self.rayjob_seen[j])):
                    self.timeline.at(start + index / rate, job, "Complete")
        self.timeline.stop()
        for lane in self._lanes:
            lane.put(None)
        for thread in self._threads:
            thread.join(timeout=10)
        self._told.close()  # the controllers' process ends, and reports
        lags = {f"kuberay_{k}": v for k, v in spread(self._lags).items()}
        print(json.dumps({"rayjob_seen": self.rayjob_seen, "lags": lags, "errors": self.timeline.errors}))

    def _tell(self, line: str) -> None:
        with self._told_lock:
            self._told.write(line + "\n")
            self._told.flush()

    def _watch(self) -> None:
        from kubernetes import watch

        stream = watch.Watch()
        while not self.timeline.stopped.is_set():
            try:
                self._watch_once(stream)
            except Exception as err:  # a dropped stream: watch again from where it stopped
                self.timeline.error(f"watch: {type(err).__name__}: {str(err)[:300]}")

    def _watch_once(self, stream: Any) -> None:
        # Each stream ends after a few seconds (to notice stop()); the next one resumes after the
        # last event seen, as an informer does. Without a resourceVersion every reconnection
        # would list all RayJobs again as ADDED: 2,000 objects encoded and decoded every 2 s.
        since = {"resource_version": self._resource_version} if self._resource_version else {}
        for event in stream.stream(
            self.custom.list_namespaced_custom_object,
            "ray.io",
            "v1",
            NAMESPACE,
            "rayjobs",
            timeout_seconds=2,
            **since,
        ):
            self._resource_version = event["object"]["metadata"]["resourceVersion"]
            if event["type"] != "ADDED":
                continue
            job = event["object"]["metadata"]["labels"][JOB_LABEL]
            if job not in self.rayjob_seen:
                seen = self.rayjob_seen[job] = time.monotonic()
                self.timeline.at(seen + 0.2, job, "Initializing")
                self.timeline.at(seen + 0.5, job, "Running")

    def _write(self, lane: int) -> None:
        custom = self._clients[lane]
        while (item := self._lanes[lane].get()) is not None:
            due, job, action = item
            self._lags.append(max(0.0, time.monotonic() - due))
            try:
                self._status(custom, job, action)
            except Exception as err:  # report, and keep playing the other jobs
                self.timeline.error(f"{job} {action}: {type(err).__name__}: {str(err)[:300]}")

    def _status(self, custom: Any, job: str, action: str) -> None:
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        status: dict[str, Any] = {"jobDeploymentStatus": action}
        if action == "Initializing":
            status["startTime"] = self._started.setdefault(job, now)  # KubeRay keeps it after
        if action == "Running":
            status["jobStatus"] = "RUNNING"
        if action == "Complete":
            status.update(jobStatus="SUCCEEDED", endTime=now)
        custom.patch_namespaced_custom_object_status(
            "ray.io", "v1", NAMESPACE, "rayjobs", f"{job}-1", {"status": status}
        )
        if action == "Running":
            self._tell(f"run {job}")
        if action == "Complete":
            self._tell(f"done {job}")


class ControllersProcess:
    """The jobs' controllers (``python bench/operator_scale.py --controllers CONFIG``, told on
    stdin by KubeRay's stand-in which jobs run): their progress pushes.

    A controller makes its first step report :data:`FIRST_STEP_SECONDS` after its cluster runs,
    then one every :data:`PUSH_SECONDS`, into the runtime's :class:`StatusPusher` (which pushes
    each: due by its throttle, whose clock is the report's due time), until its job completed.
    The next report is due PUSH_SECONDS after the last one was due, not after it was sent: the
    rate offered stays N / PUSH_SECONDS whatever the double manages (``push_*`` lags in the
    report say how late the pushes went out). :data:`PUSH_WORKERS` threads push, each on a
    connection of its own.
    """

    def __init__(self, server: str, tokens: dict[str, str]) -> None:
        address = urllib.parse.urlsplit(server)
        self.host, self.port = address.hostname or "127.0.0.1", address.port or 80
        self.tokens = tokens
        self.pushes = 0
        self._counts = threading.Lock()
        self._pushers: dict[str, StatusPusher] = {}
        self._report_due: dict[str, float] = {}
        self._steps: dict[str, int] = {}
        self._done: set[str] = set()
        self._lags: list[float] = []
        self._local = threading.local()
        self._lane: queue.Queue[tuple[float, str, str] | None] = queue.Queue()
        self.timeline = Timeline(lambda _job, _action: self._lane)
        self._threads = [
            self.timeline.thread,
            *(threading.Thread(target=self._push, daemon=True) for _ in range(PUSH_WORKERS)),
        ]

    def run_until_stdin_closes(self) -> None:
        for thread in self._threads:
            thread.start()
        for line in sys.stdin:
            command, _, job = line.strip().partition(" ")
            if command == "run":
                self.timeline.at(time.monotonic() + FIRST_STEP_SECONDS, job, "step")
            elif command == "done":
                self._done.add(job)
        self.timeline.stop()
        for _ in range(PUSH_WORKERS):
            self._lane.put(None)
        for thread in self._threads:
            thread.join(timeout=10)
        lags = {f"push_{k}": v for k, v in spread(self._lags).items()}
        print(json.dumps({"pushes": self.pushes, "lags": lags, "errors": self.timeline.errors}))

    def _push(self) -> None:
        while (item := self._lane.get()) is not None:
            due, job, _ = item
            if job in self._done:
                continue
            self._lags.append(max(0.0, time.monotonic() - due))
            pusher = self._pushers.get(job)
            if pusher is None:
                pusher = self._pushers[job] = StatusPusher(
                    self._patcher(job),
                    min_interval_seconds=PUSH_SECONDS,
                    clock=functools.partial(self._report_due.__getitem__, job),
                )
            step = self._steps[job] = self._steps.get(job, 0) + 1
            self._report_due[job] = due
            pusher(
                StepReport(
                    step=step,
                    total_steps=TOTAL_STEPS,
                    metrics={"reward/mean": 0.01 * step, "perf/tokens_per_second": 5000.0},
                    eta_seconds=PUSH_SECONDS * (TOTAL_STEPS - step),
                    last_checkpoint_step=None,
                )
            )
            self.timeline.at(due + PUSH_SECONDS, job, "step")

    def _patcher(self, job: str) -> Any:
        """What the controller's StatusPusher patches through: ``rlhfjobs/<job>/status`` with the
        job's ServiceAccount token (a merge patch, as ``patch_namespaced_custom_object_status``
        sends), on this thread's connection to the double."""
        path = f"/apis/{GROUP}/{VERSION}/namespaces/{NAMESPACE}/{PLURAL}/{job}/status"
        headers = {
            "Authorization": f"Bearer {self.tokens[job]}",
            "Content-Type": "application/merge-patch+json",
            "Accept": "application/json",
        }

        def patch(body: dict[str, Any]) -> None:
            connection = getattr(self._local, "connection", None)
            if connection is None:
                connection = self._local.connection = http.client.HTTPConnection(
                    self.host, self.port, timeout=60
                )
            try:
                connection.request("PATCH", path, body=json.dumps(body), headers=headers)
                response = connection.getresponse()
                answer = response.read()
            except Exception as err:
                connection.close()
                self._local.connection = None
                self.timeline.error(f"{job} push: {type(err).__name__}: {str(err)[:300]}")
                raise
            if response.status != 200:
                self.timeline.error(f"{job} push: {response.status}: {answer[:300]!r}")
                raise RuntimeError(f"push answered {response.status}")
            with self._counts:
                self.pushes += 1

        return patch


def keep_out_of_collections() -> None:
    """Move everything this process holds out of the cyclic garbage collector's reach.

    The double keeps every version of every object and every watch event for the whole run
    (kmock's history, the watch log), none of it garbage; each of the collector's full passes
    walked all of it again, a pause that grew with the jobs stored (5.6 s of CPU in one pass at
    2,000 jobs), in the process that serves the operator. A real API server keeps its history in
    etcd. Collected first, so no garbage cycle is frozen; objects still die by reference counting.
    """
    gc.collect()
    gc.freeze()


def operator_requests(cluster: EmulatedCluster) -> dict[str, int]:
    counts: dict[str, int] = {}
    for (token, verb, _plural), count in list(cluster.emulator.requests_by_token.items()):
        if token == OPERATOR_TOKEN:
            counts[verb] = counts.get(verb, 0) + count
    return counts


def operator_reads(cluster: EmulatedCluster) -> int:
    """The operator's GETs of single objects, less its startup read of the RayJob CRD (no reconcile's)."""
    return sum(
        count
        for (token, verb, plural), count in list(cluster.emulator.requests_by_token.items())
        if token == OPERATOR_TOKEN and verb == "get" and plural != "customresourcedefinitions"
    )


def writes(counts: dict[str, int]) -> int:
    return sum(counts.get(verb, 0) for verb in ("create", "update", "patch", "delete"))


def controller_pushes(cluster: EmulatedCluster, tokens: set[str]) -> int:
    """Status patches the double received with the jobs' controller tokens."""
    return sum(
        count
        for (token, verb, plural), count in list(cluster.emulator.requests_by_token.items())
        if verb == "patch" and plural == PLURAL and token in tokens
    )


def store_crds(cluster: EmulatedCluster) -> None:
    """Make sure both CRDs are stored as objects too, as a cluster with HybridFlow and KubeRay
    installed has them: the operator reads ``rayjobs.ray.io`` at startup (and watches it) to learn
    what KubeRay serves, and without the object it takes KubeRay for missing. The double's
    ``register_crd`` stores them now; a double that does not gets them created here."""
    import kubernetes

    extensions = kubernetes.client.ApiextensionsV1Api(cluster.api_client)
    for path in (RLHFJOB_CRD, RAYJOB_CRD):
        try:
            extensions.create_custom_resource_definition(body=load_crd(path), _preload_content=False)
        except kubernetes.client.ApiException as err:
            if err.status != 409:  # 409: stored already
                raise


def measure(size: int) -> dict[str, Any]:
    emulator = RecordingEmulator()
    emulator.recorded = []
    with EmulatedCluster(emulator) as cluster:
        cluster.emulator.register_crd(load_crd(RLHFJOB_CRD))
        cluster.emulator.register_crd(load_crd(RAYJOB_CRD))
        store_crds(cluster)
        operator = Operator(cluster)
        stand_in = StandIn(cluster, [job_name(index) for index in range(size)])
        try:
            return run(cluster, operator, stand_in, size)
        except AssertionError:
            print(operator.stop()[-4000:], file=sys.stderr)
            stand_in.stop()
            print(f"stand-in errors: {stand_in.errors[:3]}", file=sys.stderr)
            raise
        finally:
            stand_in.stop()
            operator.stop()


def job_name(index: int) -> str:
    return f"job-{index:04d}"


def phases(cluster: EmulatedCluster) -> list[str | None]:
    # Read the double's storage (allowed from other threads): listing 2,000 jobs through the
    # client every few seconds would cost the double what it needs to serve the operator.
    return [(job.get("status") or {}).get("phase") for job in cluster.emulator.objects_of(GROUP, PLURAL)]


def wait_while_freezing(predicate: Any, *, timeout_seconds: float, message: str) -> None:
    """:func:`wait_until`, with :func:`keep_out_of_collections` every FREEZE_EVERY_SECONDS."""
    frozen = time.monotonic()

    def check() -> Any:
        nonlocal frozen
        if time.monotonic() - frozen >= FREEZE_EVERY_SECONDS:
            keep_out_of_collections()
            frozen = time.monotonic()
        return predicate()

    wait_until(check, timeout_seconds=timeout_seconds, interval_seconds=0.5, message=message)


class Sampler:
    """A thread of this process sampling, per phase of the run, how the processes fare.

    Every 0.5 s it times an empty call on the double's loop (under its lock, as a request
    waits for it: the double's lag), and every second it reads the CPU time of the operator, of
    this process and of the stand-ins, and the operator's resident memory. ``phase`` is set by
    the run ("creating", "settling", "steady", "completing").
    """

    def __init__(self, cluster: EmulatedCluster, operator: Operator, stand_in: StandIn) -> None:
        self.cluster, self.operator, self.stand_in = cluster, operator, stand_in
        self.phase = "starting"
        self.samples: list[tuple[float, str, float, float, float, float]] = []
        """(time, phase, operator CPU s, this process's CPU s, stand-ins' CPU s, operator RSS MiB)."""
        self.lags: dict[str, list[float]] = collections.defaultdict(list)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-sampler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=70)

    def _run(self) -> None:
        sampled = 0.0
        while not self._stop.wait(0.5):
            phase, started = self.phase, time.monotonic()
            try:
                self.cluster.run_on_server(lambda: None, timeout_seconds=60)
                self.lags[phase].append(time.monotonic() - started)
                if started - sampled >= 1.0:
                    sampled = started
                    self.samples.append(
                        (
                            started,
                            phase,
                            cpu_seconds(self.operator.process.pid),
                            time.process_time(),
                            self.stand_in.cpu_seconds(),
                            rss_mb(self.operator.process.pid),
                        )
                    )
            except Exception:  # a process gone at the end, a timeout: skip the sample
                continue

    def peak_cores(self, phase: str, column: int, span: float = 10.0) -> float | None:
        """The most cores a process took over any ``span`` seconds of ``phase`` (or all of it, if shorter)."""
        rows = [row for row in self.samples if row[1] == phase]
        best = None
        end = 0
        for start, row in enumerate(rows):
            end = max(end, start)
            while end < len(rows) and rows[end][0] - row[0] < span:
                end += 1
            if end == len(rows):
                break
            cores = (float(rows[end][column]) - float(row[column])) / (rows[end][0] - row[0])
            best = cores if best is None else max(best, cores)
        if best is None and len(rows) >= 2 and rows[-1][0] > rows[0][0]:  # a phase shorter than span
            best = (float(rows[-1][column]) - float(rows[0][column])) / (rows[-1][0] - rows[0][0])
        return None if best is None else round(best, 2)

    def figures(self) -> dict[str, Any]:
        creating, steady = self.lags.get("creating", []), self.lags.get("steady", [])
        return {
            "creating_operator_cpu_cores_peak": self.peak_cores("creating", 2),
            "creating_double_cpu_cores_peak": self.peak_cores("creating", 3),
            "creating_stand_in_cpu_cores_peak": self.peak_cores("creating", 4),
            **{f"creating_double_lag_{k}": v for k, v in spread(creating).items()},
            **{f"steady_double_lag_{k}": v for k, v in spread(steady).items()},
            "operator_rss_mb_peak": round(max((row[5] for row in self.samples), default=0.0), 1),
            "operator_rss_mb_peak_phase": max(self.samples, key=lambda row: row[5])[1]
            if self.samples
            else None,
        }


def run(cluster: EmulatedCluster, operator: Operator, stand_in: StandIn, size: int) -> dict[str, Any]:
    def watching(token: str) -> int:
        return sum(
            count
            for (who, verb, _), count in list(cluster.emulator.requests_by_token.items())
            if who == token and verb == "watch"
        )

    wait_until(lambda: watching(OPERATOR_TOKEN), timeout_seconds=60, message="the operator's watches")
    wait_until(lambda: watching(STAND_IN_TOKEN), timeout_seconds=60, message="the stand-in's watch")
    time.sleep(1.0)
    keep_out_of_collections()
    controller_tokens = set(stand_in.tokens.values())
    operator_cpu_before = cpu_seconds(operator.process.pid)
    stand_in_cpu_before = stand_in.cpu_seconds()
    double_cpu_before = time.process_time()
    sampler = Sampler(cluster, operator, stand_in)
    sampler.phase = "creating"
    sampler.start()
    created: dict[str, float] = {}
    loads: list[float] = []
    sampled = 0.0
    for index in range(size):
        name = job_name(index)
        started = time.monotonic()
        if started - sampled >= 1.0:
            loads.append(os.getloadavg()[0])
            sampled = started
        cluster.custom.create_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, job_manifest(name))
        created[name] = time.monotonic()
        if (index + 1) % FREEZE_EVERY_JOBS == 0:
            keep_out_of_collections()
        time.sleep(max(0.0, 1.0 / RATE_PER_SECOND - (time.monotonic() - started)))
    loads.append(os.getloadavg()[0])
    last_create = time.monotonic()
    sampler.phase = "settling"
    rss_created = rss_mb(operator.process.pid)

    # The steady state: every job Running, the operator done writing, then the window.
    wait_while_freezing(
        lambda: phases(cluster).count("Running") == size,
        timeout_seconds=120,
        message="every job Running",
    )
    settling = time.monotonic()
    last_work: list[tuple[float, float]] = [(-1.0, -1.0)]
    unchanged_since = [settling]

    def operator_settled() -> bool:
        # Its writes and its passes both unchanged: an operator behind on its watch events still
        # has passes to run (they write nothing, but they are no push's doing either).
        work = (float(writes(operator_requests(cluster))), operator.reconciles())
        if work != last_work[0]:
            last_work[0], unchanged_since[0] = work, time.monotonic()
        now = time.monotonic()
        return now - unchanged_since[0] >= SETTLE_SECONDS and now - last_create >= (
            PENDING_WRITE_DELAY_SECONDS + SETTLE_SECONDS
        )

    try:
        wait_while_freezing(
            operator_settled, timeout_seconds=SETTLE_TIMEOUT_SECONDS, message="the operator settles"
        )
        settled_in_time = True
    except AssertionError:  # it never stopped: the window says what it kept doing
        settled_in_time = False
    settle_seconds = time.monotonic() - settling
    keep_out_of_collections()
    sampler.phase = "steady"
    steady = steady_state(cluster, operator, stand_in, controller_tokens, size)
    steady.update(steady_settled=settled_in_time, settle_seconds=round(settle_seconds, 1))

    sampler.phase = "completing"
    stand_in.complete(RATE_PER_SECOND)
    wait_while_freezing(
        lambda: phases(cluster).count("Succeeded") == size,
        timeout_seconds=120 + size / RATE_PER_SECOND,
        message="every job Succeeded",
    )
    stand_in_cpu = stand_in.cpu_seconds() - stand_in_cpu_before - steady.pop("stand_in_cpu")
    sampler.stop()
    stand_in.stop()  # every RayJob is Complete: nothing left for it to do
    if stand_in.errors:
        print(f"{len(stand_in.errors)} stand-in errors, first: {stand_in.errors[:3]}", file=sys.stderr)
    cluster.wait_until_idle(quiet_seconds=2.0, timeout_seconds=60)
    lifecycle = operator_requests(cluster)
    reads = operator_reads(cluster)
    reconciles = operator.reconciles()
    rss = rss_mb(operator.process.pid)
    operator_cpu = cpu_seconds(operator.process.pid) - operator_cpu_before - steady.pop("operator_cpu")
    double_cpu = time.process_time() - double_cpu_before - steady.pop("double_cpu")
    breakdown = writes_breakdown(cluster, size)

    # A second reconcile of every job with nothing changed: a restarted operator lists them all.
    errors = operator.stop()
    before_restart = operator_requests(cluster)
    restarted = Operator(cluster)
    try:
        wait_until(
            lambda: restarted.reconciles() >= size if _alive(restarted) else None,
            timeout_seconds=120,
            interval_seconds=0.5,
            message="the restarted operator reconciles every job",
        )
        cluster.wait_until_idle(quiet_seconds=2.0, timeout_seconds=60)
    finally:
        errors += restarted.stop()
    noop_writes = writes(operator_requests(cluster)) - writes(before_restart)
    if "Traceback" in errors:
        print(errors[-3000:], file=sys.stderr)
    warnings = [line for line in errors.splitlines() if "WARNING" in line or "ERROR" in line]
    if warnings:
        print(f"{len(warnings)} operator warnings, first: {warnings[:3]}", file=sys.stderr)

    latencies = [(stand_in.rayjob_seen[name] - created[name]) * 1000 for name in created]
    return {
        "create_to_rayjob_p50_ms": round(statistics.median(latencies), 1),
        "create_to_rayjob_p99_ms": round(percentile(latencies, 0.99), 1),
        "load_average_1m": round(statistics.mean(loads), 2),
        **steady,
        **sampler.figures(),
        "writes_per_job_lifecycle": round(writes(lifecycle) / size, 2),
        "writes_by_verb": {verb: lifecycle.get(verb, 0) for verb in ("create", "patch", "update", "delete")},
        **breakdown,
        "progress_pushes_per_job": round(stand_in.pushes / size, 2),
        "reconciles_per_job": round(reconciles / size, 2),
        "reads_per_reconcile": round(reads / max(1.0, reconciles), 3),
        "noop_reconcile_writes": noop_writes,
        "operator_rss_mb_created": round(rss_created, 1),
        "operator_rss_mb_finished": round(rss, 1),
        "operator_cpu_ms_per_job": round(1000 * operator_cpu / size, 1),
        "double_cpu_ms_per_job": round(1000 * double_cpu / size, 1),
        "stand_in_cpu_ms_per_job": round(1000 * stand_in_cpu / size, 1),
        "stand_in_lags": stand_in.lags,
        "stand_in_errors": len(stand_in.errors),
        "load_average_1m_end": round(os.getloadavg()[0], 2),
    }


def steady_state(
    cluster: EmulatedCluster, operator: Operator, stand_in: StandIn, tokens: set[str], size: int
) -> dict[str, Any]:
    """STEADY_SECONDS with every job Running and pushing: what the operator costs doing nothing."""
    pid = operator.process.pid
    writes_before = writes(operator_requests(cluster))
    reconciles_before = operator.reconciles_by_trigger()
    pushes_before = controller_pushes(cluster, tokens)
    cpu_before, stand_in_before, double_before = (
        cpu_seconds(pid),
        stand_in.cpu_seconds(),
        time.process_time(),
    )
    started = time.monotonic()
    frozen = started
    while (left := STEADY_SECONDS - (time.monotonic() - started)) > 0:
        time.sleep(min(1.0, left))
        if time.monotonic() - frozen >= FREEZE_EVERY_SECONDS and left > 1.0:
            keep_out_of_collections()
            frozen = time.monotonic()
    cpu = cpu_seconds(pid) - cpu_before
    stand_in_cpu = stand_in.cpu_seconds() - stand_in_before
    double_cpu = time.process_time() - double_before
    wall = time.monotonic() - started
    pushes = controller_pushes(cluster, tokens) - pushes_before
    reconciles = {
        trigger: round(count - reconciles_before.get(trigger, 0.0))
        for trigger, count in operator.reconciles_by_trigger().items()
        if count != reconciles_before.get(trigger, 0.0)
    }
    figures = {
        "operator_cpu_cores": round(cpu / wall, 3),
        "operator_rss_mb": round(rss_mb(pid), 1),
        "progress_pushes_per_second": round(pushes / wall, 1),
        "progress_pushes_offered_per_second": round(size / PUSH_SECONDS, 1),
        "operator_cpu_ms_per_push": round(1000 * cpu / max(1, pushes), 3),
        "double_cpu_cores": round(double_cpu / wall, 3),
        "stand_in_cpu_cores": round(stand_in_cpu / wall, 3),
        "steady_operator_writes": writes(operator_requests(cluster)) - writes_before,
        "steady_load_average_1m": round(os.getloadavg()[0], 2),
        "steady_seconds": round(wall, 1),
        "steady_operator_reconciles": round(sum(reconciles.values())),
        "steady_reconciles_by_trigger": reconciles,
        # Taken out of the lifecycle's CPU figures by the caller:
        "operator_cpu": cpu,
        "stand_in_cpu": stand_in_cpu,
        "double_cpu": double_cpu,
    }
    print(
        f"{size} jobs, steady state: "
        f"{json.dumps({k: v for k, v in figures.items() if not k.endswith('_cpu')})}",
        file=sys.stderr,
    )
    return figures


def writes_breakdown(cluster: EmulatedCluster, size: int) -> dict[str, Any]:
    """Which writes the operator made, per job, and, for an extra Pending, whether KubeRay was late."""
    emulator = cluster.emulator
    assert isinstance(emulator, RecordingEmulator)
    recorded = list(emulator.recorded)
    ours = [w for w in recorded if w.token == OPERATOR_TOKEN]
    by_request = collections.Counter(w.key for w in ours)
    by_phase = collections.Counter(w.phase or "-" for w in ours if w.resource == f"{PLURAL}/status")
    answers = collections.Counter(str(w.status) for w in ours)
    per_job: dict[str, list[Write]] = collections.defaultdict(list)
    for write in ours:
        per_job[str(write.job)].append(write)
    rayjob_created = {w.job: w.at for w in ours if w.key == "create rayjobs" and w.status == 201}
    kuberay_first: dict[str, float] = {}
    kuberay_writes: dict[str, dict[str, float]] = collections.defaultdict(dict)
    for write in recorded:
        if write.token == STAND_IN_TOKEN and write.resource == "rayjobs/status" and write.name:
            job = write.name.removesuffix("-1")
            kuberay_first.setdefault(job, write.at)
            kuberay_writes[job].setdefault(str(write.deployment), write.at)
    # How long the operator took to answer KubeRay's Initializing and Running with its status
    # patch (the watch event's delivery, the operator's queue and its pass).
    reactions = [
        write.at - kuberay_writes[job][str(write.phase)]
        for job, job_writes in per_job.items()
        for write in job_writes
        if write.resource == f"{PLURAL}/status"
        and write.phase in ("Initializing", "Running")
        and write.at >= kuberay_writes.get(job, {}).get(str(write.phase), float("inf"))
    ]
    pending_before = pending_after = 0
    for job, job_writes in per_job.items():
        for write in job_writes:
            if write.resource == f"{PLURAL}/status" and write.phase == "Pending":
                if kuberay_first.get(job, float("inf")) < write.at:
                    pending_after += 1
                else:
                    pending_before += 1
    first_status = [
        1000 * (kuberay_first[job] - at) for job, at in rayjob_created.items() if job in kuberay_first
    ]
    over = {job: w for job, w in per_job.items() if len(w) > LIFECYCLE_BUDGET}
    sequences = collections.Counter(
        " > ".join(w.phase or "-" for w in job_writes if w.resource == f"{PLURAL}/status")
        for job_writes in per_job.values()
    )
    kuberay_of: dict[str, list[Write]] = collections.defaultdict(list)
    for write in recorded:
        if write.token == STAND_IN_TOKEN and write.name:
            kuberay_of[write.name.removesuffix("-1")].append(write)
    examples = [job for job, w in over.items() if any(x.phase == "Pending" for x in w)][:2]
    examples += [job for job, w in over.items() if any(x.status == 409 for x in w)][:2]
    examples += [job for job in over if job not in examples][: max(0, 4 - len(examples))]
    for job in examples:
        job_writes = over[job]
        start = job_writes[0].at
        trail = ", ".join(
            f"+{w.at - start:.2f}s {'KubeRay ' + str(w.deployment) if w.token == STAND_IN_TOKEN else w.key}"
            f"{' ' + w.phase if w.phase else ''}{f' ({w.status})' if w.token == OPERATOR_TOKEN else ''}"
            for w in sorted([*job_writes, *kuberay_of.get(job, [])], key=lambda w: w.at)
        )
        print(f"{size} jobs: {job} made {len(job_writes)} writes: {trail}", file=sys.stderr)
    return {
        "writes_by_request": dict(sorted(by_request.items())),
        "write_answers": dict(sorted(answers.items())),
        "status_patches_by_phase": dict(sorted(by_phase.items())),
        "status_patch_sequences": dict(sequences.most_common(4)),
        "jobs_over_10_writes": len(over),
        "pending_patches_before_kuberay_status": pending_before,
        "pending_patches_after_kuberay_status": pending_after,
        "kuberay_first_status_p50_ms": round(statistics.median(first_status), 1) if first_status else None,
        "kuberay_first_status_p99_ms": round(percentile(first_status, 0.99), 1) if first_status else None,
        "kuberay_first_status_max_ms": round(max(first_status), 1) if first_status else None,
        **{f"kuberay_to_operator_status_{k}": v for k, v in spread(reactions).items()},
    }


def _alive(operator: Operator) -> bool:
    if operator.process.poll() is not None:
        raise AssertionError(f"the operator exited: {operator.stop()[-2000:]}")
    try:
        operator.reconciles()
    except OSError:
        return False
    return True


def main() -> None:
    if sys.argv[1:2] in (["--kuberay"], ["--controllers"]):
        config = json.loads(Path(sys.argv[2]).read_text())
        if sys.argv[1] == "--kuberay":
            KubeRayProcess(config["server"], int(sys.argv[3])).run_until_stdin_closes()
        else:
            ControllersProcess(config["server"], config["tokens"]).run_until_stdin_closes()
        return
    if not RAYJOB_CRD.is_file():
        raise SystemExit(f"needs KubeRay v1.7's CRDs at {RAYJOB_CRD}")
    limit_text, limit_mb = chart_memory_limit()
    figures: dict[str, Any] = {
        "bench": "operator_scale",
        "rate_per_second": RATE_PER_SECOND,
        "push_seconds": PUSH_SECONDS,
        "steady_seconds": STEADY_SECONDS,
        "sizes": SIZES,
    }
    for size in SIZES:
        started = time.monotonic()
        result = measure(size)
        result["run_seconds"] = round(time.monotonic() - started, 1)
        print(f"{size} jobs: {json.dumps(result)}", file=sys.stderr)
        figures.update({f"{key}_{size}": value for key, value in result.items()})
    if 200 in SIZES and 2000 in SIZES:
        figures["p50_ratio_2000_over_200"] = round(
            figures["create_to_rayjob_p50_ms_2000"] / figures["create_to_rayjob_p50_ms_200"], 2
        )
    figures["targets"] = {
        "create_to_rayjob_p50_ms": "<= 100",
        "p50_ratio_2000_over_200": "<= 1.5",
        "writes_per_job_lifecycle": f"<= {LIFECYCLE_BUDGET}",
        "reads_per_reconcile": "0",
        "noop_reconcile_writes": "0",
        "operator_cpu_cores": "<= 0.5",
        "operator_rss_mb": f"< {limit_mb:g} (the chart's resources.limits.memory, {limit_text})",
        "steady_operator_writes": "0",
        "steady_operator_reconciles": "0",
        "progress_pushes_per_second": f"= jobs / {PUSH_SECONDS:g} (progress_pushes_offered_per_second)",
    }
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
