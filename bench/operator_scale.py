"""Operator figures at 200 and 2,000 RLHFJobs against the strict API-server double.

The double (tests/kube: CRD schemas and CEL, KubeRay v1.7's RayJob schema, Kubernetes' own
schemas, RBAC for ServiceAccount tokens) runs in this process; the operator runs as its own
process (``python -m hybridflow_operator``, as in the image) with a token of its own, so every
request it makes is counted apart. A stand-in, also a process of its own (this script with
``--stand-in``), plays KubeRay and the controllers: it moves every RayJob through Initializing ->
Running -> Complete, and while a job runs it pushes ``status.progress`` every ``PUSH_SECONDS``
with the job's own ServiceAccount token (RBAC-checked). Jobs arrive at ``RATE_PER_SECOND``; each
size runs on a fresh double, a fresh stand-in and a fresh operator.

Figures per size N (suffix ``_N``):

* ``create_to_rayjob_p50_ms`` / ``p99``: from the create request returning to the RayJob's
  ADDED event, as the double delivers it to the stand-in's watch (target p50 <= 100 ms, and p50
  at 2,000 within 1.5x of p50 at 200);
* ``writes_per_job_lifecycle``: the operator's writes (creates, patches, deletes; status and
  Events included) from creation to Succeeded, per job (target <= 10); the controllers'
  ``progress_pushes_per_job`` are counted apart;
* ``reads_per_reconcile``: the operator's GETs of single objects per reconcile (target 0: it
  reads its caches, filled by list+watch);
* ``noop_reconcile_writes``: writes of a restarted operator that reconciles every finished job
  again with nothing changed (target 0);
* ``operator_rss_mb``: the operator's resident memory once every job has finished;
* ``operator_cpu_ms_per_job``, ``double_cpu_ms_per_job`` (this process: the double and the
  creating loop), ``stand_in_cpu_ms_per_job``: CPU time per job from the first create until every
  job Succeeded; ``load_average_1m``: the machine's, at the end of the size's run.

``HYBRIDFLOW_BENCH_JOBS`` (comma-separated sizes, default ``200,2000``) overrides the sizes;
quick mode (``HYBRIDFLOW_BENCH_QUICK=1``) runs 20 jobs. The last line printed is one JSON object.
"""

from __future__ import annotations

import gc
import heapq
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from kube.harness import EmulatedCluster, load_crd, wait_until  # noqa: E402

QUICK = os.environ.get("HYBRIDFLOW_BENCH_QUICK") == "1"
"""Quick mode (``make bench-smoke``): a few jobs, to prove the bench runs and prints its JSON line."""
SIZES = [int(n) for n in os.environ.get("HYBRIDFLOW_BENCH_JOBS", "20" if QUICK else "200,2000").split(",")]
RATE_PER_SECOND = float(os.environ.get("HYBRIDFLOW_BENCH_RATE", "10"))
FREEZE_EVERY_JOBS = 100
"""Jobs created between two :func:`keep_out_of_collections` of the bench process (10 s at 10/s)."""
PUSH_SECONDS = 2.0 if QUICK else 10.0
"""A controller pushes progress this often (the real one: at most every 10 s)."""
RUN_SECONDS = 4.0 if QUICK else 20.0
"""How long each job stays Running (two progress pushes at the default)."""
NAMESPACE = "default"
OPERATOR_TOKEN = "hybridflow-operator-bench"
STAND_IN_TOKEN = "kuberay-stand-in-bench"
RAYJOB_CRD = ROOT.parent / "shared" / "kuberay" / "ray.io_rayjobs.yaml"
GROUP, VERSION, PLURAL = "hybridflow.io", "v1alpha1", "rlhfjobs"


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


def job_manifest(name: str) -> dict[str, Any]:
    doc = yaml.safe_load((ROOT / "examples" / "grpo-cluster.yaml").read_text())
    doc["metadata"] = {"name": name, "namespace": NAMESPACE}
    return dict(doc)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * (len(ordered) - 1) + 0.5))]


class Operator:
    """``python -m hybridflow_operator`` against the double, with its own token and metrics port."""

    def __init__(self, cluster: EmulatedCluster) -> None:
        config = cluster.kubeconfig(NAMESPACE)
        config["users"][0]["user"]["token"] = OPERATOR_TOKEN
        self.kubeconfig = Path(tempfile.mkdtemp()) / "kubeconfig"
        self.kubeconfig.write_text(yaml.safe_dump(config))
        self.metrics_port = free_port()
        env = {
            **os.environ,
            "KUBECONFIG": str(self.kubeconfig),
            "WATCH_NAMESPACES": NAMESPACE,
            "HYBRIDFLOW_OPERATOR_METRICS_PORT": str(self.metrics_port),
            "HYBRIDFLOW_OPERATOR_HEALTH_PORT": str(free_port()),
        }
        self.process = subprocess.Popen(
            [sys.executable, "-m", "hybridflow_operator"],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )

    def reconciles(self) -> float:
        text = (
            urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5).read().decode()
        )
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("hybridflow_operator_reconciles_total{")
        )

    def stop(self) -> str:
        if self.process.poll() is None:
            self.process.terminate()
        try:
            _, errors = self.process.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            _, errors = self.process.communicate()
        return errors or ""


class StandIn:
    """KubeRay and the jobs' controllers, in a process of their own (``--stand-in``).

    Its own process, so that its work (decoding every RayJob event, five status writes per job)
    does not hold the interpreter lock of the double, which serves the operator: in one
    interpreter the two took turns, and the stand-in's share grew with the jobs in flight. Each
    job's controller pushes progress with the token of the job's ServiceAccount, registered
    here; the stand-in's own requests carry :data:`STAND_IN_TOKEN`. On ``stop()`` it reports,
    as one JSON object, when its watch saw each RayJob (``time.monotonic()``, one clock for
    every process of the machine), its progress pushes and its errors.
    """

    def __init__(self, cluster: EmulatedCluster, jobs: list[str]) -> None:
        tokens = {
            job: cluster.kubeconfig_as(f"system:serviceaccount:{NAMESPACE}:{job}-controller")["users"][0][
                "user"
            ]["token"]
            for job in jobs
        }
        self.config = Path(tempfile.mkdtemp()) / "stand-in.json"
        self.config.write_text(json.dumps({"server": cluster.url, "tokens": tokens}))
        self.process = subprocess.Popen(
            [sys.executable, __file__, "--stand-in", str(self.config)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.rayjob_seen: dict[str, float] = {}
        self.pushes = 0
        self.errors: list[str] = []

    def stop(self) -> None:
        """End the stand-in (it stops when its stdin closes) and take its report."""
        if self.process.returncode is not None:
            return  # stopped already
        try:
            out, err = self.process.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            out, err = self.process.communicate()
        lines = out.strip().splitlines()
        if self.process.returncode != 0 or not lines:
            self.errors.append(f"the stand-in exited with {self.process.returncode}: {err[-2000:]}")
            return
        report = json.loads(lines[-1])
        self.rayjob_seen, self.pushes, self.errors = report["rayjob_seen"], report["pushes"], report["errors"]


class StandInProcess:
    """The stand-in's body (``python bench/operator_scale.py --stand-in CONFIG``): a watch on
    RayJobs and a timeline of status writes."""

    def __init__(self, server: str, tokens: dict[str, str]) -> None:
        from kubernetes.client import ApiClient, Configuration, CustomObjectsApi

        def client(token: str) -> Any:
            configuration = Configuration(host=server)
            configuration.api_key = {"BearerToken": token}
            configuration.api_key_prefix = {"BearerToken": "Bearer"}
            return CustomObjectsApi(ApiClient(configuration))

        self._client = client
        self.custom = client(STAND_IN_TOKEN)
        self.tokens = tokens
        self.rayjob_seen: dict[str, float] = {}
        self.pushes = 0
        self.errors: list[str] = []
        self._heap: list[tuple[float, int, str, str]] = []
        self._sequence = 0
        self._lock = threading.Condition()
        self._stop = threading.Event()
        self._controllers: dict[str, Any] = {}
        self._resource_version = ""
        self._threads = [
            threading.Thread(target=self._watch, daemon=True),
            threading.Thread(target=self._act, daemon=True),
        ]

    def run_until_stdin_closes(self) -> None:
        for thread in self._threads:
            thread.start()
        sys.stdin.read()
        self._stop.set()
        with self._lock:
            self._lock.notify()
        for thread in self._threads:
            thread.join(timeout=10)
        print(json.dumps({"rayjob_seen": self.rayjob_seen, "pushes": self.pushes, "errors": self.errors}))

    def _at(self, delay: float, job: str, action: str) -> None:
        with self._lock:
            self._sequence += 1
            heapq.heappush(self._heap, (time.monotonic() + delay, self._sequence, job, action))
            self._lock.notify()

    def _watch(self) -> None:
        from kubernetes import watch

        stream = watch.Watch()
        while not self._stop.is_set():
            try:
                self._watch_once(stream)
            except Exception as err:  # a dropped stream: watch again from where it stopped
                self.errors.append(f"watch: {type(err).__name__}: {str(err)[:300]}")

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
            job = event["object"]["metadata"]["labels"]["hybridflow.io/job"]
            if job not in self.rayjob_seen:
                self.rayjob_seen[job] = time.monotonic()
                self._at(0.2, job, "Initializing")
                self._at(0.5, job, "Running")
                for push in range(1, int(RUN_SECONDS / PUSH_SECONDS) + 1):
                    self._at(0.5 + push * PUSH_SECONDS - 0.1, job, f"progress {push}")
                self._at(0.5 + RUN_SECONDS, job, "Complete")

    def _act(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                while not self._stop.is_set() and (not self._heap or self._heap[0][0] > time.monotonic()):
                    self._lock.wait(0.05 if not self._heap else max(0.0, self._heap[0][0] - time.monotonic()))
                if self._stop.is_set():
                    return
                _, _, job, action = heapq.heappop(self._heap)
            try:
                self._do(job, action)
            except Exception as err:  # report, and keep playing the other jobs
                self.errors.append(f"{job} {action}: {type(err).__name__}: {str(err)[:300]}")

    def _do(self, job: str, action: str) -> None:
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        if action.startswith("progress"):
            step = int(action.split()[1])
            if job not in self._controllers:
                self._controllers[job] = self._client(self.tokens[job])
            body = {
                "status": {
                    "progress": {"step": step, "totalSteps": 40, "reward": 0.1 * step, "updatedAt": now}
                }
            }
            self._controllers[job].patch_namespaced_custom_object_status(
                GROUP, VERSION, NAMESPACE, PLURAL, job, body
            )
            self.pushes += 1
            return
        status: dict[str, Any] = {"jobDeploymentStatus": action, "startTime": now}
        if action == "Running":
            status["jobStatus"] = "RUNNING"
        if action == "Complete":
            status.update(jobStatus="SUCCEEDED", endTime=now)
            self._controllers.pop(job, None)
        self.custom.patch_namespaced_custom_object_status(
            "ray.io", "v1", NAMESPACE, "rayjobs", f"{job}-1", {"status": status}
        )


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


def writes(counts: dict[str, int]) -> int:
    return sum(counts.get(verb, 0) for verb in ("create", "update", "patch", "delete"))


def measure(size: int) -> dict[str, Any]:
    with EmulatedCluster() as cluster:
        cluster.emulator.register_crd(load_crd(ROOT / "crds" / "hybridflow.io_rlhfjobs.yaml"))
        cluster.emulator.register_crd(load_crd(RAYJOB_CRD))
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
    operator_cpu_before = cpu_seconds(operator.process.pid)
    stand_in_cpu_before = cpu_seconds(stand_in.process.pid)
    double_cpu_before = time.process_time()
    created: dict[str, float] = {}
    for index in range(size):
        name = job_name(index)
        started = time.monotonic()
        cluster.custom.create_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, job_manifest(name))
        created[name] = time.monotonic()
        if (index + 1) % FREEZE_EVERY_JOBS == 0:
            keep_out_of_collections()
        time.sleep(max(0.0, 1.0 / RATE_PER_SECOND - (time.monotonic() - started)))

    def succeeded() -> bool:
        # Read the double's storage (allowed from other threads): listing 2,000 jobs through the
        # client every few seconds would cost the double what it needs to serve the operator.
        phases = [
            (job.get("status") or {}).get("phase") for job in cluster.emulator.objects_of(GROUP, PLURAL)
        ]
        return phases.count("Succeeded") == size

    wait_until(
        succeeded,
        timeout_seconds=120 + RUN_SECONDS + size / RATE_PER_SECOND,
        interval_seconds=2.0,
        message="every job Succeeded",
    )
    stand_in_cpu = cpu_seconds(stand_in.process.pid) - stand_in_cpu_before
    stand_in.stop()  # every RayJob is Complete: nothing left for it to do
    if stand_in.errors:
        print(f"{len(stand_in.errors)} stand-in errors, first: {stand_in.errors[:3]}", file=sys.stderr)
    cluster.wait_until_idle(quiet_seconds=2.0, timeout_seconds=60)
    lifecycle = operator_requests(cluster)
    reconciles = operator.reconciles()
    rss = rss_mb(operator.process.pid)
    operator_cpu = cpu_seconds(operator.process.pid) - operator_cpu_before
    double_cpu = time.process_time() - double_cpu_before

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

    latencies = [(stand_in.rayjob_seen[name] - created[name]) * 1000 for name in created]
    return {
        "create_to_rayjob_p50_ms": round(statistics.median(latencies), 1),
        "create_to_rayjob_p99_ms": round(percentile(latencies, 0.99), 1),
        "writes_per_job_lifecycle": round(writes(lifecycle) / size, 2),
        "writes_by_verb": {verb: lifecycle.get(verb, 0) for verb in ("create", "patch", "update", "delete")},
        "progress_pushes_per_job": round(stand_in.pushes / size, 2),
        "reconciles_per_job": round(reconciles / size, 2),
        "reads_per_reconcile": round(lifecycle.get("get", 0) / max(1.0, reconciles), 3),
        "noop_reconcile_writes": noop_writes,
        "operator_rss_mb": round(rss, 1),
        "operator_cpu_ms_per_job": round(1000 * operator_cpu / size, 1),
        "double_cpu_ms_per_job": round(1000 * double_cpu / size, 1),
        "stand_in_cpu_ms_per_job": round(1000 * stand_in_cpu / size, 1),
        "load_average_1m": round(os.getloadavg()[0], 1),
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
    if sys.argv[1:2] == ["--stand-in"]:
        config = json.loads(Path(sys.argv[2]).read_text())
        StandInProcess(config["server"], config["tokens"]).run_until_stdin_closes()
        return
    if not RAYJOB_CRD.is_file():
        raise SystemExit(f"needs KubeRay v1.7's CRDs at {RAYJOB_CRD}")
    figures: dict[str, Any] = {"bench": "operator_scale", "rate_per_second": RATE_PER_SECOND, "sizes": SIZES}
    for size in SIZES:
        result = measure(size)
        print(f"{size} jobs: {json.dumps(result)}", file=sys.stderr)
        figures.update({f"{key}_{size}": value for key, value in result.items()})
    if 200 in SIZES and 2000 in SIZES:
        figures["p50_ratio_2000_over_200"] = round(
            figures["create_to_rayjob_p50_ms_2000"] / figures["create_to_rayjob_p50_ms_200"], 2
        )
    figures["targets"] = {
        "create_to_rayjob_p50_ms": "<= 100",
        "p50_ratio_2000_over_200": "<= 1.5",
        "writes_per_job_lifecycle": "<= 10",
        "reads_per_reconcile": "0",
        "noop_reconcile_writes": "0",
    }
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
