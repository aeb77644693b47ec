"""Two operator replicas against the strict double: exactly one holds the Lease; the other takes
over only after it expires; the health endpoints answer."""

from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest

from hybridflow_operator.cluster import ApiCluster
from hybridflow_operator.health import HealthServer
from hybridflow_operator.leader import LEASE_NAME, LeaderElection
from kube.harness import EmulatedCluster

pytestmark = pytest.mark.integration


class Clock:
    def __init__(self) -> None:
        self.now = datetime(2026, 12, 1, 8, 0, tzinfo=UTC)

    def __call__(self) -> datetime:
        return self.now


@pytest.fixture
def cluster() -> Iterator[EmulatedCluster]:
    with EmulatedCluster() as cluster:
        yield cluster


def test_one_leader_at_a_time_and_takeover_after_expiry(cluster: EmulatedCluster) -> None:
    clock = Clock()
    api = ApiCluster(cluster.api_client)
    elected: list[str] = []
    a = LeaderElection(api, namespace="default", identity="a", lease_seconds=15, clock=clock)
    b = LeaderElection(api, namespace="default", identity="b", lease_seconds=15, clock=clock)
    a._on_elected = lambda: elected.append("a")
    b._on_elected = lambda: elected.append("b")

    assert a.try_acquire_or_renew() and a.is_leader
    assert not b.try_acquire_or_renew() and not b.is_leader
    clock.now += timedelta(seconds=10)
    assert a.try_acquire_or_renew()  # renewed: b must wait 15 s from now
    clock.now += timedelta(seconds=10)
    assert not b.try_acquire_or_renew()
    clock.now += timedelta(seconds=6)  # a stopped renewing 16 s ago: its lease has run out
    assert not a.is_leader
    assert b.try_acquire_or_renew() and b.is_leader
    stored = api.get_lease("default", LEASE_NAME)
    assert stored is not None and stored["spec"]["holderIdentity"] == "b"
    assert stored["spec"]["leaseTransitions"] == 1
    assert not a.try_acquire_or_renew() and not a.is_leader  # the old holder learns it lost
    assert elected == ["a", "b"]


def test_a_stale_replace_loses_with_409(cluster: EmulatedCluster) -> None:
    clock = Clock()
    api = ApiCluster(cluster.api_client)
    a = LeaderElection(api, namespace="default", identity="a", clock=clock)
    assert a.try_acquire_or_renew()
    stale = api.get_lease("default", LEASE_NAME)
    clock.now += timedelta(seconds=2)
    assert a.try_acquire_or_renew()  # a renews: the resourceVersion moves on
    assert stale is not None
    body = {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {
            "name": LEASE_NAME,
            "namespace": "default",
            "resourceVersion": stale["metadata"]["resourceVersion"],
        },
        "spec": {"holderIdentity": "b", "leaseDurationSeconds": 15},
    }
    assert api.replace_lease("default", LEASE_NAME, body) is False


def test_health_endpoints() -> None:
    state = {"alive": True, "ready": False}
    server = HealthServer(0, alive=lambda: state["alive"], ready=lambda: state["ready"])
    server.start()
    try:

        def status(path: str) -> int:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{server.port}{path}", timeout=5) as reply:
                    return int(reply.status)
            except urllib.error.HTTPError as err:
                return err.code

        assert (status("/healthz"), status("/readyz")) == (200, 503)
        state.update(alive=False, ready=True)
        assert (status("/healthz"), status("/readyz"), status("/other")) == (503, 200, 404)
    finally:
        server.stop()
