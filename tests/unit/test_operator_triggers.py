"""What triggers a reconcile (JobCache) and when timed passes run (Scheduler), without kopf or a cluster."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from hybridflow_operator.main import JobCache, Scheduler
from hybridflow_operator.status import RLHFJobStatus

pytestmark = pytest.mark.unit

KEY = ("default", "job")


def body(generation: int = 1, **status: Any) -> dict[str, Any]:
    return {
        "metadata": {"name": "job", "namespace": "default", "uid": "u1", "generation": generation},
        "status": status,
    }


def test_progress_pushes_and_our_own_status_echo_trigger_nothing() -> None:
    cache = JobCache()
    first = body()
    assert cache.relevant_job_change(KEY, first)  # a new job
    cache.jobs[KEY] = first
    assert not cache.relevant_job_change(KEY, body(progress={"step": 3}))  # the controller's push
    cache.written[KEY] = RLHFJobStatus(phase="Running", attempts=1)
    echo = body(phase="Running", attempts=1, progress={"step": 3})
    assert not cache.relevant_job_change(KEY, echo)  # the watch delivers our own write
    assert KEY not in cache.written  # ... and the cache has caught up
    cache.jobs[KEY] = echo
    assert cache.relevant_job_change(KEY, body(phase="Succeeded", attempts=2))  # someone forged our keys
    assert cache.relevant_job_change(KEY, body(generation=2, phase="Running", attempts=1))  # a spec edit


def test_a_pushed_rollout_replacement_triggers_a_pass_and_other_rollout_figures_do_not() -> None:
    """Server mode: the operator turns the controller's replacement count into an Event."""
    cache = JobCache()

    def rollout(replaced: int, serving: int) -> dict[str, object]:
        return {
            "step": 3,
            "rollout": {
                "startedAt": "2026-12-05T08:00:00Z",
                "replicasReplaced": replaced,
                "replicasServing": serving,
            },
        }

    cache.jobs[KEY] = body(phase="Running", attempts=1, progress=rollout(0, 2))
    assert not cache.relevant_job_change(KEY, body(phase="Running", attempts=1, progress=rollout(0, 1)))
    assert cache.relevant_job_change(KEY, body(phase="Running", attempts=1, progress=rollout(1, 1)))


def test_children_are_cached_by_their_job_label() -> None:
    cache = JobCache()
    rayjob = {
        "kind": "RayJob",
        "metadata": {"name": "job-1", "namespace": "default", "labels": {"hybridflow.io/job": "job"}},
    }
    assert cache.put_child(rayjob, deleted=False) == KEY
    assert list(cache.children[KEY]) == [("RayJob", "job-1")]
    assert cache.put_child(rayjob, deleted=True) == KEY and not cache.children[KEY]
    assert (
        cache.put_child(
            {"kind": "ConfigMap", "metadata": {"name": "x", "namespace": "default"}}, deleted=False
        )
        is None
    )


@pytest.mark.parametrize("length", [63, 64, 200, 253])
def test_children_of_a_job_with_a_long_name_are_found_by_its_hashed_label(length: int) -> None:
    """A name over 63 characters labels its children with a cut, hashed value (names.job_label_value)."""
    from hybridflow_operator.names import job_label_value

    name = ("a" * length)[:length]
    key = ("default", name)
    cache = JobCache()
    cache.put_job(key, {"metadata": {"name": name, "namespace": "default", "uid": "u"}})
    child = {
        "kind": "RayJob",
        "metadata": {
            "name": "x-1",
            "namespace": "default",
            "labels": {"hybridflow.io/job": job_label_value(name)},
        },
    }
    assert cache.put_child(child, deleted=False) == key
    assert list(cache.children_of(key)) == [("RayJob", "x-1")]
    assert cache.put_child(child, deleted=True) == key and not cache.children_of(key)


def test_a_relist_finds_what_was_deleted_while_the_watch_was_gone() -> None:
    """After 410 Gone kopf re-lists and delivers no DELETED events: the caches drop what the list
    no longer returns, and keep what an event put there after the list began."""
    from hybridflow_operator.relist import Relister

    cache = JobCache()
    labels = {"hybridflow.io/job": "job"}
    for name in ("job", "gone"):
        cache.put_job(("default", name), {"metadata": {"name": name, "namespace": "default"}})
    kept = {"kind": "RayJob", "metadata": {"name": "job-1", "namespace": "default", "labels": labels}}
    deleted = {"kind": "RayJob", "metadata": {"name": "job-2", "namespace": "default", "labels": labels}}
    cache.put_child(kept, deleted=False)
    cache.put_child(deleted, deleted=False)

    class Listing:
        def list_jobs(self, namespaces: Any) -> list[dict[str, Any]]:
            # An event puts a new job while the list is under way: newer than the list.
            cache.put_job(("default", "new"), {"metadata": {"name": "new", "namespace": "default"}})
            return [{"metadata": {"name": "job", "namespace": "default"}}]

        def list_children(self, namespaces: Any, selector: str, kinds: Any = None) -> list[dict[str, Any]]:
            assert kinds == ["RayJob"]
            return [kept]

    gone_jobs: list[tuple[str, str]] = []
    gone_children: list[dict[str, Any]] = []
    relister = Relister(
        Listing(),
        cache,
        namespaces=["default"],
        label_selector="x=y",
        on_job_gone=gone_jobs.append,
        on_child_gone=gone_children.append,
    )
    relister.relist("RLHFJob")
    relister.relist("RayJob")
    assert gone_jobs == [("default", "gone")]
    assert [c["metadata"]["name"] for c in gone_children] == ["job-2"]


def test_the_cache_keeps_what_a_pass_reads_of_a_rayjob() -> None:
    cache = JobCache()
    labels = {"hybridflow.io/job": "job"}
    rayjob = {
        "apiVersion": "ray.io/v1",
        "kind": "RayJob",
        "metadata": {"name": "job-1", "namespace": "default", "labels": labels},
        "spec": {"suspend": True, "entrypoint": "hybridflow run", "rayClusterSpec": {"headGroupSpec": {}}},
        "status": {"jobDeploymentStatus": "Running"},
    }
    cache.put_child(rayjob, deleted=False)
    kept = cache.children[KEY][("RayJob", "job-1")]
    assert kept["spec"] == {"suspend": True}  # the pod templates are the operator's own output
    assert kept["metadata"] == rayjob["metadata"] and kept["status"] == rayjob["status"]
    config = {
        "kind": "ConfigMap",
        "metadata": {"name": "job-config", "namespace": "default", "labels": labels},
        "data": {"a": "b"},
    }
    cache.put_child(config, deleted=False)
    assert cache.children[KEY][("ConfigMap", "job-config")] == config


def test_the_watch_delivering_our_own_rayjob_triggers_nothing_once() -> None:
    cache = JobCache()
    added: dict[str, Any] = {"metadata": {"name": "job-1"}}
    assert not cache.own_create_echo(KEY, "job-1", "ADDED", added)  # not created by this process
    cache.created[KEY] = {"job-1"}
    assert cache.own_create_echo(KEY, "job-1", "ADDED", added)
    assert not cache.own_create_echo(KEY, "job-1", "MODIFIED", {**added, "status": {"x": 1}})  # KubeRay
    cache.created[KEY] = {"job-2"}
    # A status already there means the event is newer than our create (events were batched).
    assert not cache.own_create_echo(KEY, "job-2", "ADDED", {**added, "status": {"x": 1}})
    assert KEY not in cache.created  # either way the wait for the echo is over


def test_a_job_runs_at_its_earliest_recheck_time_once() -> None:
    ran: list[tuple[str, str]] = []
    done = threading.Event()

    def run(key: tuple[str, str]) -> None:
        ran.append(key)
        done.set()

    scheduler = Scheduler(run, workers=1)
    scheduler.start()
    try:
        scheduler.at(KEY, 60.0)
        scheduler.at(KEY, 0.05)  # an earlier time wins
        scheduler.at(KEY, 30.0)  # a later one does not postpone it
        assert done.wait(5.0)
        time.sleep(0.2)
        assert ran == [KEY] and scheduler.pending() == {}
        scheduler.at(("default", "other"), 0.05)
        scheduler.forget(("default", "other"))
        time.sleep(0.3)
        assert ran == [KEY] and scheduler.alive()
    finally:
        scheduler.stop()


class RecordingCluster:
    """The API as a child's deletion sees it: the job already gone, every write recorded."""

    def __init__(self) -> None:
        self.job: dict[str, Any] | None = None
        self.writes: list[tuple[str, str]] = []

    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        return self.job if kind == "RLHFJob" else None

    def create(self, obj: Any) -> bool:
        self.writes.append(("create", obj["kind"]))
        return True

    def patch(self, kind: str, namespace: str, name: str, patch: Any) -> None:
        self.writes.append(("patch", kind))

    def delete(self, kind: str, namespace: str, name: str) -> None:
        self.writes.append(("delete", kind))

    def patch_job_status(self, namespace: str, name: str, status: Any) -> None:
        self.writes.append(("patch", "RLHFJob/status"))

    def emit_event(self, job: Any, event: Any) -> None:
        self.writes.append(("create", "Event"))

    def list_children(self, namespaces: Any, label_selector: str, kinds: Any = None) -> list[dict[str, Any]]:
        return []

    def list_jobs(self, namespaces: Any) -> list[dict[str, Any]]:
        return []

    def find_workload(self, namespace: str, job_uid: str) -> dict[str, Any] | None:
        return None

    def get_crd(self, name: str) -> dict[str, Any] | None:
        return None


def test_a_child_deleted_by_the_garbage_collector_is_not_recreated_for_a_job_that_is_gone() -> None:
    """The GC deletes a job's children right after the job; their DELETED events may come first."""
    import kopf

    from hybridflow_operator.main import OperatorConfig, register

    registry = kopf.OperatorRegistry()
    cluster = RecordingCluster()
    register(registry, config=OperatorConfig({}), cluster=cluster, serve_metrics=False)  # type: ignore[arg-type]
    handlers = {h.fn.__name__: h.fn for h in registry._watching.get_all_handlers()}
    job = yaml.safe_load((Path(__file__).resolve().parents[2] / "examples" / "grpo-tiny.yaml").read_text())
    job["metadata"].update(name="job", namespace="default", uid="u1", generation=1)
    child = {
        "kind": "ServiceAccount",
        "metadata": {
            "name": "job-controller",
            "namespace": "default",
            "labels": {"hybridflow.io/job": "job"},
        },
    }
    cluster.job = job
    handlers["job_changed"](body=job, namespace="default", name="job", type="ADDED")
    assert ("create", "ServiceAccount") in cluster.writes  # the first pass made the children
    cluster.writes.clear()
    cluster.job = None  # deleted; its DELETED event is still on its way
    handlers["serviceaccount_changed"](body=child, type="DELETED")
    assert cluster.writes == []
    handlers["serviceaccount_changed"](body=child, type="ADDED")
    assert cluster.writes == []  # the job is forgotten: later child events do nothing either


def test_a_cache_behind_its_own_creates_says_so_until_the_watch_delivers_them() -> None:
    """A timed pass waits while the watch has not delivered what this process created (the cache
    lags at thousands of jobs): it would create those children again (409) and write a Pending
    KubeRay has already moved past."""
    cache = JobCache()
    cache.put_job(KEY, body())
    cache.unseen[KEY] = {("ConfigMap", "job-config"): 100.0, ("RayJob", "job-1"): 100.0}
    assert cache.behind(KEY, now=101.0, patience=60)
    assert not cache.behind(KEY, now=161.0, patience=60)  # not for ever: the pass runs after a minute
    labels = {"hybridflow.io/job": "job"}
    for kind, name in (("ConfigMap", "job-config"), ("RayJob", "job-1")):
        assert cache.behind(KEY, now=101.0, patience=60)
        cache.put_child(
            {"kind": kind, "metadata": {"name": name, "namespace": "default", "labels": labels}}, False
        )
    assert not cache.behind(KEY, now=101.0, patience=60) and KEY not in cache.unseen
