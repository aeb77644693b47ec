"""Operator figures against the API-server emulator with 200 RLHFJobs.

The emulator (tests/kube) serves the generated RLHFJob CRD and the KubeRay RayJob CRD in this
process; the operator runs as its own process (``python -m hybridflow_operator``, as in the
image) against it through a kubeconfig. Jobs are created one after another; a watch on RayJobs
timestamps each job's first RayJob.

* ``create_to_rayjob_p50_ms`` / ``p99``: from the create request returning to the RayJob's
  ADDED event, with jobs arriving at 10 per second (target p50 <= 100 ms); ``burst_*``: the
  same for another 200 jobs created back to back, and how many jobs per second got a RayJob;
* ``api_writes_per_job``: every write the operator made (children, status, events) / jobs;
* ``noop_reconcile_writes``: writes during a quiet window in which the timer reconciles every
  job at least twice with nothing to do (target 0);
* ``operator_rss_mb``: the operator process's resident memory at the end.

The last line printed is one JSON object.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from kube.harness import EmulatedCluster, wait_until  # noqa: E402

QUICK = os.environ.get("HYBRIDFLOW_BENCH_QUICK") == "1"
"""Quick mode (``make bench-smoke``): a few jobs, to prove the bench runs and prints its JSON line."""
JOBS = int(os.environ.get("HYBRIDFLOW_BENCH_JOBS", "20" if QUICK else "200"))
CREATE_INTERVAL_SECONDS = 0.1
"""Jobs arrive at 10 per second, a rate the operator sustains; ``burst_*`` figures create them all at once."""
NAMESPACE = "default"
TIMER_SECONDS = 5.0
RAYJOB_CRD = ROOT.parent / "shared" / "kuberay" / "ray.io_rayjobs.yaml"


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def job_manifest(name: str) -> dict[str, Any]:
    doc = yaml.safe_load((ROOT / "examples" / "grpo-tiny.yaml").read_text())
    doc["metadata"] = {"name": name, "namespace": NAMESPACE}
    return dict(doc)


def create_jobs(cluster: EmulatedCluster, prefix: str, *, interval_seconds: float) -> dict[str, float]:
    """Create JOBS jobs, one every ``interval_seconds``; returns when each create request returned."""
    created: dict[str, float] = {}
    for i in range(JOBS):
        name = f"{prefix}-{i:03d}"
        started = time.monotonic()
        cluster.custom.create_namespaced_custom_object(
            "hybridflow.io", "v1alpha1", NAMESPACE, "rlhfjobs", job_manifest(name)
        )
        created[name] = time.monotonic()
        time.sleep(max(0.0, interval_seconds - (created[name] - started)))
    return created


def wait_for_rayjobs(created: dict[str, float], seen: dict[str, float]) -> None:
    deadline = time.monotonic() + 300
    while not all(n in seen for n in created):
        if time.monotonic() > deadline:
            raise AssertionError(
                f"only {sum(n in seen for n in created)} of {len(created)} jobs got a RayJob in 300 s"
            )
        time.sleep(0.05)


def main() -> None:
    with EmulatedCluster() as cluster:
        cluster.emulator.register_crd(
            yaml.safe_load((ROOT / "crds" / "hybridflow.io_rlhfjobs.yaml").read_text())
        )
        if RAYJOB_CRD.is_file():
            cluster.emulator.register_crd(yaml.safe_load(RAYJOB_CRD.read_text()))
        else:
            cluster.emulator.register_custom_resource(
                group="ray.io", version="v1", plural="rayjobs", kind="RayJob", subresources={"status"}
            )
        kubeconfig = Path(tempfile.mkdtemp()) / "kubeconfig"
        kubeconfig.write_text(yaml.safe_dump(cluster.kubeconfig(NAMESPACE)))
        env = {
            **os.environ,
            "KUBECONFIG": str(kubeconfig),
            "WATCH_NAMESPACES": NAMESPACE,
            "HYBRIDFLOW_OPERATOR_METRICS_PORT": "0",
            "HYBRIDFLOW_RECONCILE_INTERVAL_SECONDS": str(TIMER_SECONDS),
        }
        operator = subprocess.Popen(
            [sys.executable, "-m", "hybridflow_operator"],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            figures = measure(cluster, operator.pid)
        except AssertionError:
            operator.terminate()
            _, errors = operator.communicate(timeout=20)
            print(errors[-4000:], file=sys.stderr)
            raise
        finally:
            if operator.poll() is None:
                operator.terminate()
                try:
                    operator.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    operator.kill()
    print(json.dumps(figures))


def measure(cluster: EmulatedCluster, operator_pid: int) -> dict[str, Any]:
    from kubernetes import watch

    seen: dict[str, float] = {}
    stop = threading.Event()

    def watch_rayjobs() -> None:
        stream = watch.Watch()
        while not stop.is_set():
            for event in stream.stream(
                cluster.custom.list_namespaced_custom_object,
                "ray.io",
                "v1",
                NAMESPACE,
                "rayjobs",
                timeout_seconds=2,
            ):
                if event["type"] == "ADDED":
                    name = event["object"]["metadata"]["name"]
                    seen.setdefault(name.rsplit("-", 1)[0], time.monotonic())

    watcher = threading.Thread(target=watch_rayjobs, daemon=True)
    watcher.start()
    # Wait until the operator answers: a first job gets its RayJob.
    cluster.custom.create_namespaced_custom_object(
        "hybridflow.io", "v1alpha1", NAMESPACE, "rlhfjobs", job_manifest("warmup")
    )
    wait_until(lambda: "warmup" in seen, timeout_seconds=60, message="the operator's first RayJob")
    time.sleep(1.0)
    writes_before = len(cluster.emulator.write_requests())
    created = create_jobs(cluster, "job", interval_seconds=CREATE_INTERVAL_SECONDS)
    wait_for_rayjobs(created, seen)
    burst = create_jobs(cluster, "burst", interval_seconds=0.0)
    wait_for_rayjobs(burst, seen)
    # Let the follow-up reconciles (RayJob observed -> status) settle, then watch a quiet window.
    time.sleep(2 * TIMER_SECONDS)
    writes_settled = len(cluster.emulator.write_requests())
    time.sleep(2 * TIMER_SECONDS + 1)
    quiet_writes = cluster.emulator.write_requests()[writes_settled:]
    noop_writes = len(quiet_writes)
    for request in quiet_writes[:10]:
        print(
            f"write in the quiet window: {request.method.value} {request.url.path} {request.data}",
            file=sys.stderr,
        )
    stop.set()

    latencies = sorted((seen[n] - created[n]) * 1000 for n in created)
    burst_latencies = sorted((seen[n] - burst[n]) * 1000 for n in burst)
    burst_seconds = max(seen[n] for n in burst) - min(burst.values())
    # The benchmark's own creates are not the operator's writes.
    own_writes = writes_settled - writes_before - 2 * JOBS
    return {
        "jobs": JOBS,
        "create_to_rayjob_p50_ms": round(statistics.median(latencies), 1),
        "create_to_rayjob_p99_ms": round(latencies[int(0.99 * (len(latencies) - 1))], 1),
        "burst_create_to_rayjob_p50_ms": round(statistics.median(burst_latencies), 1),
        "burst_create_to_rayjob_p99_ms": round(burst_latencies[int(0.99 * (len(burst_latencies) - 1))], 1),
        "burst_jobs_per_second": round(JOBS / burst_seconds, 1),
        "api_writes_per_job": round(own_writes / (2 * JOBS), 2),
        "noop_reconcile_writes": noop_writes,
        "operator_rss_mb": round(rss_mb(operator_pid), 1),
        "targets": {"create_to_rayjob_p50_ms": "<= 100", "noop_reconcile_writes": "0"},
    }


if __name__ == "__main__":
    main()
