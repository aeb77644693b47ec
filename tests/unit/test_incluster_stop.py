"""The preStop hook's protocol with the controller (hybridflow.incluster.stop), over real HTTP."""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Gauge

from hybridflow.incluster.stop import ControllerServer, StopMarker, controller_address, stop_controller

pytestmark = pytest.mark.unit


def controller(token: str | None = None) -> tuple[ControllerServer, threading.Event]:
    registry = CollectorRegistry()
    Gauge("hybridflow_test_gauge", "a gauge", registry=registry).set(3)
    requested = threading.Event()
    return ControllerServer(0, registry, requested, token=token, host="127.0.0.1").start(), requested


def exits_after_stop(
    server: ControllerServer, requested: threading.Event, seconds: float
) -> threading.Thread:
    """The controller: once asked, it finishes its step and checkpoint (``seconds``), then exits."""

    def run() -> None:
        requested.wait(30)
        time.sleep(seconds)
        server.close()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_the_hook_asks_for_the_stop_and_returns_once_the_controller_has_exited() -> None:
    server, requested = controller()
    with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics") as answer:
        assert b"hybridflow_test_gauge 3.0" in answer.read()  # /metrics is still served
    exits_after_stop(server, requested, 0.5)
    lines: list[str] = []
    started = time.monotonic()
    assert (
        stop_controller(
            "127.0.0.1", server.port, token=None, timeout_seconds=30, poll_seconds=0.1, say=lines.append
        )
        == 0
    )
    assert requested.is_set() and time.monotonic() - started >= 0.5  # it waited for the checkpoint
    assert "asked the controller" in lines[0] and "has exited" in lines[-1]


def test_with_ray_token_auth_a_stop_needs_the_token() -> None:
    server, requested = controller(token="s3cret")
    try:
        assert (
            stop_controller("127.0.0.1", server.port, token="wrong", timeout_seconds=5, say=lambda _: None)
            == 2
        )
        assert not requested.is_set()
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/stop") as answer:
            assert json.loads(answer.read()) == {"stopping": False}
    finally:
        server.close()
    server, requested = controller(token="s3cret")
    exits_after_stop(server, requested, 0.1)
    assert (
        stop_controller(
            "127.0.0.1", server.port, token="s3cret", timeout_seconds=30, poll_seconds=0.1, say=lambda _: None
        )
        == 0
    )


def test_no_controller_means_nothing_to_wait_for_and_a_stuck_one_is_left_to_the_kubelet() -> None:
    server, requested = controller()
    port = server.port
    server.close()
    assert stop_controller("127.0.0.1", port, token=None, timeout_seconds=5, say=lambda _: None) == 0
    server, requested = controller()
    try:
        assert (
            stop_controller(
                "127.0.0.1",
                server.port,
                token=None,
                timeout_seconds=0.5,
                poll_seconds=0.1,
                say=lambda _: None,
            )
            == 1
        )
        assert requested.is_set()
    finally:
        server.close()


def test_a_worker_finds_the_controller_at_its_ray_head(tmp_path: Path) -> None:
    env = {"RAY_TMPDIR": str(tmp_path)}
    assert controller_address({**env, "HYBRIDFLOW_CONTROLLER_ADDRESS": "127.0.0.1"}) == "127.0.0.1"
    assert controller_address({**env, "FQ_RAY_IP": "job-head-svc.ns.svc.cluster.local"}) == (
        "job-head-svc.ns.svc.cluster.local"
    )
    (tmp_path / "ray").mkdir()
    (tmp_path / "ray" / "ray_current_cluster").write_text("10.1.2.3:6379\n")  # the head pod's IP
    assert controller_address({**env, "FQ_RAY_IP": "job-head-svc"}) == "10.1.2.3"


def test_a_controller_starting_while_another_stops_waits_for_its_checkpoint(tmp_path: Path) -> None:
    now = [1000.0]
    marker = StopMarker(tmp_path, clock=lambda: now[0])
    assert marker.wait(poll_seconds=0) == 0  # nobody stopping
    marker.write(grace_seconds=600)
    waiting = StopMarker(tmp_path, clock=lambda: now[0])

    def finish_later() -> None:
        time.sleep(0.2)
        now[0] += 5
        marker.clear()  # the stopping controller's checkpoint is complete

    threading.Thread(target=finish_later, daemon=True).start()
    assert waiting.wait(poll_seconds=0.05, say=lambda _: None) == 5
    marker.write(grace_seconds=600)
    now[0] += 601  # a stop that was killed leaves its marker: it expires with the grace period
    assert waiting.wait(poll_seconds=0.05, say=lambda _: None) == 0
