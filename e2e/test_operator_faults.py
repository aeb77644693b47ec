"""The operator broken on purpose while it runs a real job, and what credentials may reach.

* Crash injection: the operator process is SIGKILLed at every write it makes while it brings a
  job up, twice per write point: once before the write reaches the API server (the write is
  lost) and once after it landed but before the answer came back. Each time the operator is
  started again from nothing but what the API server holds.
* API faults: the first attempt at every write answers 409 Conflict, and every watch
  connection is dropped every few seconds.
* Secrets: a marker Secret reaches the training process by reference (env and envFrom) and
  appears in none of what a person or a log collector can read; the job's Ray answers only
  clients holding its token.

Each scenario ends as a user checks it: Succeeded, every step trained once, one child of each
kind (one RayJob: no retry was needed), and nothing left after the RLHFJob is deleted.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from test_e2e import (
    FAULTS_EXAMPLE,
    GROUP,
    PLURAL,
    VERSION,
    apply,
    children,
    duplicate_children,
    lost_or_repeated,
    manifest,
    metrics_steps,
    phase_is,
    status,
    wait_for,
)

from conftest import E2E, NAMESPACE, OPERATOR_TOKEN
from kube.emulator import WriteFault, WriteSeen

CHILD_KINDS = {"ConfigMap", "ServiceAccount", "Role", "RoleBinding", "NetworkPolicy", "RayJob"}


@dataclass
class CrashEveryWritePoint:
    """The fault schedule: each distinct operator write (verb, resource, name) is crashed twice,
    ``lost`` the first time it is tried and ``applied`` the next, until ``stop`` is set."""

    kill: threading.Event
    crashed: dict[tuple[str, str, str], list[WriteFault]] = field(default_factory=dict)
    stop: bool = False

    def __call__(self, write: WriteSeen) -> WriteFault | None:
        if self.stop or write.token != OPERATOR_TOKEN or self.kill.is_set():
            return None
        point = (write.verb, write.plural, write.name or "")
        done = self.crashed.setdefault(point, [])
        if len(done) == 2:
            return None
        fault: WriteFault = "lost" if not done else "applied"
        done.append(fault)
        self.kill.set()  # the test's loop kills and restarts the operator
        return fault


def finish_and_delete(e2e: E2E, name: str, claim: str, steps: int, figures: dict[str, object]) -> None:
    """The job Succeeded in one attempt, every step trained once, one child of each kind, nothing
    left after the RLHFJob is deleted; each figure recorded before it is asserted."""
    done = wait_for(f"{name} Succeeded", lambda: phase_is(e2e, name, "Succeeded"))
    assert done["attempts"] == 1, done  # the operator's faults never cost the job an attempt
    trained = metrics_steps(e2e, claim)
    figures["lost_or_repeated_steps"] = lost_or_repeated(trained, steps)
    assert trained == list(range(1, steps + 1)), trained
    owned = children(e2e, name)
    figures["duplicate_children"] = duplicate_children(owned, 1)
    assert {child.split("/")[0] for child in owned} == CHILD_KINDS, owned
    assert duplicate_children(owned, attempts=1) == 0, owned
    e2e.cluster.custom.delete_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, name)
    try:
        wait_for("every child deleted", lambda: children(e2e, name) == [] or None, timeout_seconds=60)
    finally:
        figures["orphaned_children"] = len(children(e2e, name))


def test_the_operator_killed_at_every_write_point_converges_without_duplicates_or_orphans(
    e2e: E2E, tiny: Path, figures: dict[str, object]
) -> None:
    name, claim, steps = "crashes", "crashes-ckpt", 2
    kill = threading.Event()
    schedule = CrashEveryWritePoint(kill)
    e2e.cluster.emulator.write_faults = schedule
    apply(e2e, manifest(FAULTS_EXAMPLE, tiny, name, steps=steps, claim=claim))
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if kill.wait(timeout=0.5):
            e2e.operator.kill()
            kill.clear()
            e2e.operator.start()  # a fresh process: caches from the API server only
            continue
        if (status(e2e, name).get("progress") or {}).get("step", 0) >= 1:
            break  # the job is up and training: every write point of bringing it up was hit
    schedule.stop = True
    points = sorted(schedule.crashed)
    figures.update(crash_points=len(points), operator_restarts=e2e.operator.starts - 1)
    assert len(points) >= len(CHILD_KINDS) + 1, points  # every child's create and the status write
    assert all(faults == ["lost", "applied"] for faults in schedule.crashed.values()), schedule.crashed
    finish_and_delete(e2e, name, claim, steps, figures)


def test_conflicts_and_dropped_watches_still_converge(
    e2e: E2E, tiny: Path, figures: dict[str, object]
) -> None:
    name, claim, steps = "flaky-api", "flaky-api-ckpt", 2
    conflicted: set[tuple[str, str, str]] = set()

    def first_try_conflicts(write: WriteSeen) -> WriteFault | None:
        point = (write.verb, write.plural, write.name or "")
        if write.token != OPERATOR_TOKEN or point in conflicted:
            return None
        conflicted.add(point)
        return "conflict"

    e2e.cluster.emulator.write_faults = first_try_conflicts
    stop = threading.Event()
    drops = 0

    def drop_watches() -> None:
        nonlocal drops
        while not stop.wait(3.0):
            e2e.cluster.drop_watches()
            drops += 1

    dropper = threading.Thread(target=drop_watches, daemon=True)
    dropper.start()
    try:
        apply(e2e, manifest(FAULTS_EXAMPLE, tiny, name, steps=steps, claim=claim))
        finish_and_delete(e2e, name, claim, steps, figures)
    finally:
        stop.set()
        dropper.join()
        figures.update(conflicts=len(conflicted), dropped_watch_rounds=drops)
    assert len(conflicted) >= len(CHILD_KINDS) and drops >= 3, (conflicted, drops)


MARKER = "hf-marker-7f3c9e1d2b"
GCS_PROBE = """
import sys
from ray._raylet import GcsClient

client = GcsClient(address=sys.argv[1], cluster_id=None)
client.internal_kv_keys(b"", namespace=None, timeout=10)
print("answered")
"""


def ask_gcs(address: str, token: str) -> subprocess.CompletedProcess[str]:
    """One request to the Ray head's GCS (port 6379 of the head pod) with ``token``."""
    return subprocess.run(
        [sys.executable, "-c", GCS_PROBE, address],
        env={**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_secrets_reach_the_job_by_reference_and_appear_nowhere_else(
    e2e: E2E, tiny: Path, figures: dict[str, object]
) -> None:
    name, claim, steps = "secretive", "secretive-ckpt", 2
    e2e.cluster.core.create_namespaced_secret(
        NAMESPACE,
        {
            "metadata": {"name": "hub-credentials"},
            "data": {"HF_TOKEN": base64.b64encode(MARKER.encode()).decode()},
        },
    )
    doc = manifest(FAULTS_EXAMPLE, tiny, name, steps=steps, claim=claim)
    doc["spec"]["pods"] = {
        "env": [
            {
                "name": "WANDB_API_KEY",
                "valueFrom": {"secretKeyRef": {"name": "hub-credentials", "key": "HF_TOKEN"}},
            }
        ],
        "envFrom": [{"secretRef": {"name": "hub-credentials"}}],
    }
    apply(e2e, doc)
    running = wait_for(
        "the entrypoint running",
        lambda: (
            (status(e2e, name).get("rayJobName") or None)
            if (status(e2e, name).get("progress") or {}).get("step", 0) >= 1
            else None
        ),
    )
    attempt = e2e.kuberay.attempts[running]
    environ = Path(f"/proc/{attempt.entrypoint.pid}/environ").read_bytes()
    assert f"WANDB_API_KEY={MARKER}".encode() in environ and f"HF_TOKEN={MARKER}".encode() in environ
    assert b"RAY_AUTH_MODE=token" in environ  # the RayJob asked KubeRay for Ray's token auth
    token = next(v for k, _, v in (i.partition(b"=") for i in environ.split(b"\0")) if k == b"RAY_AUTH_TOKEN")
    stranger, member = (ask_gcs(attempt.ray_address, secret) for secret in ("0" * 32, token.decode()))
    assert stranger.returncode != 0 and "InvalidAuthToken" in stranger.stderr, stranger.stderr[-2000:]
    assert member.returncode == 0 and "answered" in member.stdout, member.stderr[-2000:]  # the probe works
    wait_for(f"{name} Succeeded", lambda: phase_is(e2e, name, "Succeeded"))

    api = e2e.cluster
    readable = {
        "RLHFJob": json.dumps(
            api.custom.get_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, name)
        ),
        "RayJob": json.dumps(
            api.custom.list_namespaced_custom_object("ray.io", "v1", NAMESPACE, "rayjobs")["items"]
        ),
        "Events": json.dumps(
            api.api_client.sanitize_for_serialization(api.core.list_namespaced_event(NAMESPACE))
        ),
        "ConfigMaps": json.dumps(
            api.api_client.sanitize_for_serialization(api.core.list_namespaced_config_map(NAMESPACE))
        ),
        "operator log": e2e.operator.tail(10_000_000),
    }
    for path in [*(e2e.root / "pods").rglob("*"), *(e2e.root / "volumes" / claim).rglob("*")]:
        if path.is_file():
            readable[str(path.relative_to(e2e.root))] = path.read_text(errors="replace")
    leaks = sorted(where for where, text in readable.items() if MARKER in text)
    figures.update(places_searched=len(readable), secret_leaks=len(leaks))
    assert leaks == [], f"the secret's value appears in {leaks}"
    assert len(readable) > len(CHILD_KINDS)  # the checkpoints, metrics and logs were read too
    finish_and_delete(e2e, name, claim, steps, figures)
