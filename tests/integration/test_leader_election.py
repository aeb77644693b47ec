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
    clock.now += timedelta(seconds=8)
    assert a.try_acquire_or_renew()  # renewed within its deadline: b must wait 15 s from now
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


def test_a_leader_stops_at_its_renew_deadline_before_its_lease_runs_out(cluster: EmulatedCluster) -> None:
    """client-go's margin: the holder stops writing 10 s after its last renewal began; nobody may
    take the Lease before 15 s, so two replicas never reconcile at once."""
    clock = Clock()
    api = ApiCluster(cluster.api_client)
    a = LeaderElection(api, namespace="default", identity="a", clock=clock)
    b = LeaderElection(api, namespace="default", identity="b", clock=clock)
    assert a.try_acquire_or_renew()
    clock.now += timedelta(seconds=10)  # a's renewals failed since (the API was unreachable for it)
    assert not a.is_leader
    assert not b.try_acquire_or_renew()  # ... and the lease still keeps b out for 5 s more
    clock.now += timedelta(seconds=5)
    assert b.try_acquire_or_renew()
    with pytest.raises(ValueError, match="renew deadline"):
        LeaderElection(api, namespace="default", identity="c", lease_seconds=10, renew_deadline_seconds=10)


def test_a_stopping_leader_releases_the_lease_and_drops_its_job_gauges(cluster: EmulatedCluster) -> None:
    clock = Clock()
    api = ApiCluster(cluster.api_client)
    deposed: list[str] = []
    a = LeaderElection(api, namespace="default", identity="a", clock=clock)
    b = LeaderElection(api, namespace="default", identity="b", clock=clock)
    a._on_deposed = lambda: deposed.append("a")
    assert a.try_acquire_or_renew()
    a._check_deposed()
    assert a.release()  # what SIGTERM's cleanup does (LeaderElection.stop)
    assert deposed == ["a"] and not a.is_leader
    stored = api.get_lease("default", LEASE_NAME)
    assert stored is not None and not stored["spec"].get("holderIdentity")
    assert b.try_acquire_or_renew()  # at once, not after the 15 s lease


def test_the_metrics_of_a_deposed_leader_hold_no_job() -> None:
    from hybridflow_operator.metrics import OperatorMetrics

    metrics = OperatorMetrics()
    metrics.observe_phase("default/a", "Running")
    metrics.observe_attempts("default/a", 2)
    metrics.forget_jobs()
    text = "\n".join(
        f"{sample.name}{sample.labels} {sample.value}"
        for family in metrics.registry.collect()
        for sample in family.samples
        if sample.name.startswith(("hybridflow_operator_jobs", "hybridflow_operator_job_attempts"))
    )
    assert "rlhfjob" not in text and " 1.0" not in text, text
