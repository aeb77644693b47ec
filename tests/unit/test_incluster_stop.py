"""The preStop hook's protocol with the controller (hybridflow.incluster.stop), on a shared directory.

The checkpoint volume is a directory here, as every pod of a job sees it; the controller is a
thread that saves for a while once a hook asked, the hook the real ``stop_pod``. Nothing here
resolves a name or opens a socket: the protocol needs none (the head Service's name stops
resolving while the pods of a deleted cluster sit in their hooks: ``e2e/`` shows it with a real
resolver).
"""

from __future__ import annotations

import socket
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Gauge

from hybridflow.incluster.stop import (
    CONTROL_DIR,
    ControllerBeat,
    ControllerRecord,
    MetricsServer,
    StopRequests,
    prune_other_clusters,
    read_record,
    stop_pod,
    wait_for_stopping_controllers,
)

pytestmark = pytest.mark.unit

BEAT = 0.05


def env(
    checkpoints: Path, cluster: str = "job-1-abcde", pod: str = "job-1-abcde-train-worker-x"
) -> dict[str, str]:
    """What KubeRay and the operator give a Ray container (no head Service name is needed)."""
    return {
        "HYBRIDFLOW_CHECKPOINT_DIR": str(checkpoints),
        "RAY_CLUSTER_NAME": cluster,
        "RAY_CLOUD_INSTANCE_ID": pod,
        "FQ_RAY_IP": "job-1-abcde-head-svc.research.svc.cluster.local",  # never looked up
    }


class Controller:
    """The controller's side in a thread: once asked (by a hook or SIGTERM), it saves for
    ``save_seconds`` and exits; ``killed`` stops it without its last words (a SIGKILL)."""

    def __init__(self, checkpoints: Path, cluster: str = "job-1-abcde", save_seconds: float = 0.5) -> None:
        self.requested = threading.Event()
        self.beat = ControllerBeat(checkpoints, cluster, self.requested, beat_seconds=BEAT).start()
        self.save_seconds = save_seconds
        self.exited_at: float | None = None
        self._killed = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        self.requested.wait(30)
        if self._killed.is_set():
            return
        self.beat.stopping(grace_seconds=600)
        time.sleep(self.save_seconds)
        self.exited_at = time.monotonic()
        self.beat.exited()

    def kill(self) -> None:
        self._killed.set()
        self.beat._done.set()  # the beat thread dies with the process
        self.requested.set()


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    def refuse(*args: object, **kwargs: object) -> object:
        raise AssertionError("the stop protocol must not touch the network")

    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    yield


def test_the_hook_asks_for_the_stop_and_returns_once_the_controller_has_exited(
    tmp_path: Path, no_network: None
) -> None:
    controller = Controller(tmp_path)
    lines: list[str] = []
    started = time.monotonic()
    assert stop_pod(env(tmp_path), timeout_seconds=30, poll_seconds=BEAT, say=lines.append) == 0
    assert controller.exited_at is not None and time.monotonic() >= controller.exited_at  # after the save
    assert time.monotonic() - started >= controller.save_seconds
    assert controller.beat.asked_by == "the preStop hook of pod job-1-abcde-train-worker-x"
    assert lines == ["hybridflow stop (job-1-abcde-train-worker-x): the controller has exited"]
    assert read_record(controller.beat.record.path).state == "exited"  # type: ignore[union-attr]


def test_every_pod_of_a_deleted_cluster_waits_for_the_one_save(tmp_path: Path, no_network: None) -> None:
    controller = Controller(tmp_path, save_seconds=0.6)
    codes: dict[str, int] = {}
    returned: dict[str, float] = {}

    def hook(pod: str) -> None:
        codes[pod] = stop_pod(
            env(tmp_path, pod=pod), timeout_seconds=30, poll_seconds=BEAT, say=lambda _: None
        )
        returned[pod] = time.monotonic()

    pods = ["head", "train-worker-0", "train-worker-1"]
    threads = [threading.Thread(target=hook, args=(pod,)) for pod in pods]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert codes == dict.fromkeys(pods, 0)
    assert controller.exited_at is not None and min(returned.values()) >= controller.exited_at
    assert sorted(StopRequests(tmp_path, "job-1-abcde").askers()) == sorted(pods)


def test_nothing_to_wait_for_without_a_volume_or_a_controller(tmp_path: Path) -> None:
    lines: list[str] = []
    no_volume = {k: v for k, v in env(tmp_path).items() if k != "HYBRIDFLOW_CHECKPOINT_DIR"}
    assert stop_pod(no_volume, timeout_seconds=30, say=lines.append) == 0
    assert "no checkpoint volume" in lines[-1]
    started = time.monotonic()
    assert stop_pod(env(tmp_path), timeout_seconds=30, say=lines.append) == 0  # the driver never started
    assert time.monotonic() - started < 1 and "no controller ran" in lines[-1]


def test_a_killed_controller_is_seen_gone_when_its_record_stands_still(tmp_path: Path) -> None:
    controller = Controller(tmp_path)
    controller.kill()
    lines: list[str] = []
    started = time.monotonic()
    code = stop_pod(env(tmp_path), timeout_seconds=30, poll_seconds=BEAT, stale_seconds=0.5, say=lines.append)
    assert code == 0 and 0.5 <= time.monotonic() - started < 5 and "has not moved" in lines[-1]


def test_a_controller_still_saving_at_the_timeout_is_left_to_the_kubelet(tmp_path: Path) -> None:
    Controller(tmp_path, save_seconds=30)
    lines: list[str] = []
    assert stop_pod(env(tmp_path), timeout_seconds=0.5, poll_seconds=BEAT, say=lines.append) == 1
    assert "leaving it to the kubelet" in lines[-1]


def test_a_new_cluster_waits_for_the_previous_ones_save_and_prunes_what_is_done(tmp_path: Path) -> None:
    previous = Controller(tmp_path, cluster="job-1-abcde", save_seconds=0.6)
    previous.requested.set()  # its pods are in their hooks
    time.sleep(0.1)
    lines: list[str] = []
    waited = wait_for_stopping_controllers(tmp_path, "job-1-fghjk", poll_seconds=BEAT, say=lines.append)
    assert waited >= 0.4 and "still saving" in lines[0] and previous.exited_at is not None
    old = ControllerRecord(tmp_path, "job-0-zzzzz")
    old.write("exited")
    StopRequests(tmp_path, "job-0-zzzzz").ask("pod")
    running = ControllerRecord(tmp_path, "job-2-running")
    running.write("running")
    StopRequests(tmp_path, "job-3-neverstarted").ask("pod")  # its controller never wrote a record
    prune_other_clusters(tmp_path, "job-1-fghjk")
    left = sorted(p.name for p in (tmp_path / CONTROL_DIR).iterdir())
    assert left == ["job-2-running.json"]  # exited clusters and their requests are gone
    assert wait_for_stopping_controllers(tmp_path, "job-1-fghjk", say=lambda _: None) < 0.1  # none stopping


def test_the_controller_serves_metrics(tmp_path: Path) -> None:
    registry = CollectorRegistry()
    Gauge("hybridflow_test_gauge", "a gauge", registry=registry).set(3)
    server = MetricsServer(0, registry, host="127.0.0.1").start()
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics") as answer:
            assert b"hybridflow_test_gauge 3.0" in answer.read()
    finally:
        server.close()
