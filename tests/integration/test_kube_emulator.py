"""The API-server emulator behaves as the real API server where the operator depends on it.

Each test drives one gap of kmock 0.8 (see ``tests/kube/emulator.py``) through the official
``kubernetes`` client, the way the operator's code talks to a cluster; the last one runs a tiny
kopf operator against the emulator end to end.
"""

from __future__ import annotations

import json
import sys
import textwrap
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import kopf
import kubernetes.client
import kubernetes.watch
import pytest
import yaml
from kubernetes.client import ApiException

from kube.emulator import ApiServerEmulator
from kube.harness import EmulatedCluster, operator_registry, registry_for_module, wait_until

pytestmark = pytest.mark.integration

RLHFJOBS = ("hybridflow.io", "v1alpha1")
RAYJOBS = ("ray.io", "v1")
NAMESPACE = "default"
# The client sends a merge patch to custom objects unless told otherwise, even for a list body.
JSON_PATCH = "application/json-patch+json"


@pytest.fixture
def cluster() -> Iterator[EmulatedCluster]:
    with EmulatedCluster() as cluster:
        emulator = cluster.emulator
        emulator.register_custom_resource(
            group="hybridflow.io",
            version="v1alpha1",
            plural="rlhfjobs",
            kind="RLHFJob",
            subresources={"status"},
        )
        emulator.register_custom_resource(
            group="ray.io", version="v1", plural="rayjobs", kind="RayJob", subresources={"status"}
        )
        yield cluster


def rlhfjob(name: str, *, steps: int = 10, **metadata: Any) -> dict[str, Any]:
    return {
        "apiVersion": "hybridflow.io/v1alpha1",
        "kind": "RLHFJob",
        "metadata": {"name": name, **metadata},
        "spec": {"steps": steps},
    }


def create_job(cluster: EmulatedCluster, name: str, **kwargs: Any) -> dict[str, Any]:
    created: dict[str, Any] = cluster.custom.create_namespaced_custom_object(
        *RLHFJOBS, NAMESPACE, "rlhfjobs", rlhfjob(name, **kwargs)
    )
    return created


def get_job(cluster: EmulatedCluster, name: str) -> dict[str, Any]:
    job: dict[str, Any] = cluster.custom.get_namespaced_custom_object(*RLHFJOBS, NAMESPACE, "rlhfjobs", name)
    return job


def owned_by(owner: Mapping[str, Any]) -> list[dict[str, Any]]:
    meta = owner["metadata"]
    return [
        {"apiVersion": owner["apiVersion"], "kind": owner["kind"], "name": meta["name"], "uid": meta["uid"]}
    ]


def status_of(error: ApiException) -> tuple[int, str]:
    """The code and reason of the error, checking that the body is a Status as the API sends."""
    status = json.loads(error.body)
    assert status["kind"] == "Status" and status["code"] == error.status
    return error.status, status["reason"]


# --- create, replace, conflicts ------------------------------------------------------------------


def test_create_answers_201_with_server_set_metadata(cluster: EmulatedCluster) -> None:
    manifest = rlhfjob("a")
    manifest["status"] = {"phase": "Running"}  # dropped: status is written through /status only
    job = cluster.custom.create_namespaced_custom_object(*RLHFJOBS, NAMESPACE, "rlhfjobs", manifest)

    assert job is not None, "the client returns the body only for 201 Created"
    meta = job["metadata"]
    assert meta["namespace"] == NAMESPACE, "the namespace comes from the URL"
    assert meta["uid"] and meta["creationTimestamp"].endswith("Z")
    assert int(meta["resourceVersion"]) > 0 and meta["generation"] == 1
    assert "status" not in job
    config_map = cluster.core.create_namespaced_config_map(NAMESPACE, {"metadata": {"name": "c"}})
    assert config_map.metadata.uid and config_map.metadata.namespace == NAMESPACE


def test_generate_name_and_duplicate_create(cluster: EmulatedCluster) -> None:
    generated = cluster.core.create_namespaced_config_map(NAMESPACE, {"metadata": {"generateName": "run-"}})
    assert generated.metadata.name.startswith("run-") and len(generated.metadata.name) == len("run-") + 5

    create_job(cluster, "a")
    with pytest.raises(ApiException) as duplicate:
        create_job(cluster, "a")
    assert status_of(duplicate.value) == (409, "AlreadyExists")
    with pytest.raises(ApiException) as missing:
        get_job(cluster, "absent")
    assert status_of(missing.value) == (404, "NotFound")
    with pytest.raises(ApiException) as nameless:
        cluster.core.create_namespaced_config_map(NAMESPACE, {"metadata": {}})
    assert status_of(nameless.value) == (422, "Invalid")


def test_replace_and_optimistic_concurrency(cluster: EmulatedCluster) -> None:
    stale = create_job(cluster, "a")
    fresh = cluster.custom.patch_namespaced_custom_object(
        *RLHFJOBS, NAMESPACE, "rlhfjobs", "a", {"metadata": {"labels": {"x": "1"}}}
    )
    with pytest.raises(ApiException) as conflict:
        cluster.custom.replace_namespaced_custom_object(
            *RLHFJOBS, NAMESPACE, "rlhfjobs", "a", {**stale, "spec": {"steps": 20}}
        )
    assert status_of(conflict.value) == (409, "Conflict")

    replaced = cluster.custom.replace_namespaced_custom_object(
        *RLHFJOBS, NAMESPACE, "rlhfjobs", "a", {**fresh, "spec": {"steps": 20}}
    )
    assert replaced["spec"] == {"steps": 20} and replaced["metadata"]["uid"] == stale["metadata"]["uid"]
    assert int(replaced["metadata"]["resourceVersion"]) > int(fresh["metadata"]["resourceVersion"])

    config_map = cluster.core.create_namespaced_config_map(
        NAMESPACE, {"metadata": {"name": "c"}, "data": {"k": "1"}}
    )
    config_map.data = {"k": "2"}
    assert cluster.core.replace_namespaced_config_map("c", NAMESPACE, config_map).data == {"k": "2"}


def test_json_patch_test_op_checks_the_server_resource_version(cluster: EmulatedCluster) -> None:
    job = create_job(cluster, "a")
    version = job["metadata"]["resourceVersion"]
    add_finalizer = [
        {"op": "test", "path": "/metadata/resourceVersion", "value": version},
        {"op": "add", "path": "/metadata/finalizers", "value": ["example.com/cleanup"]},
    ]
    patched = cluster.custom.patch_namespaced_custom_object(
        *RLHFJOBS, NAMESPACE, "rlhfjobs", "a", add_finalizer, _content_type=JSON_PATCH
    )
    assert patched["metadata"]["finalizers"] == ["example.com/cleanup"]

    with pytest.raises(ApiException) as stale:  # the same test op, now against an older version
        cluster.custom.patch_namespaced_custom_object(
            *RLHFJOBS, NAMESPACE, "rlhfjobs", "a", add_finalizer, _content_type=JSON_PATCH
        )
    assert status_of(stale.value) == (422, "Invalid")


# --- metadata semantics ---------------------------------------------------------------------------


def test_resource_version_and_generation_semantics(cluster: EmulatedCluster) -> None:
    def patch(body: dict[str, Any], *, status: bool = False) -> dict[str, Any]:
        api = cluster.custom
        patch_fn = api.patch_namespaced_custom_object_status if status else api.patch_namespaced_custom_object
        result: dict[str, Any] = patch_fn(*RLHFJOBS, NAMESPACE, "rlhfjobs", "a", body)
        return result

    created = create_job(cluster, "a")
    labelled = patch({"metadata": {"labels": {"team": "rl"}}})
    with_status = patch({"status": {"phase": "Running"}}, status=True)
    respecced = patch({"spec": {"steps": 99}})
    unchanged = patch({"spec": {"steps": 99}})

    versions = [
        int(body["metadata"]["resourceVersion"]) for body in (created, labelled, with_status, respecced)
    ]
    assert versions == sorted(set(versions)), "every write gets a new, larger resourceVersion"
    assert unchanged["metadata"]["resourceVersion"] == respecced["metadata"]["resourceVersion"], (
        "a no-op write"
    )
    generations = [body["metadata"]["generation"] for body in (created, labelled, with_status, respecced)]
    assert generations == [1, 1, 1, 2], "only spec changes bump the generation"


def test_status_subresource_isolation(cluster: EmulatedCluster) -> None:
    create_job(cluster, "a", steps=10)
    through_status = cluster.custom.patch_namespaced_custom_object_status(
        *RLHFJOBS, NAMESPACE, "rlhfjobs", "a", {"spec": {"steps": 1}, "status": {"phase": "Running"}}
    )
    assert through_status["spec"] == {"steps": 10} and through_status["status"] == {"phase": "Running"}

    through_main = cluster.custom.patch_namespaced_custom_object(
        *RLHFJOBS, NAMESPACE, "rlhfjobs", "a", {"spec": {"steps": 2}, "status": {"phase": "Failed"}}
    )
    assert through_main["spec"] == {"steps": 2} and through_main["status"] == {"phase": "Running"}

    replaced_status = cluster.custom.replace_namespaced_custom_object_status(
        *RLHFJOBS, NAMESPACE, "rlhfjobs", "a", {**through_main, "status": {"phase": "Succeeded"}}
    )
    assert replaced_status["status"] == {"phase": "Succeeded"}


# --- selectors and watches ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("selector", "expected"),
    [
        ("tier=gpu", {"a", "b"}),
        ("tier==gpu,pool=left", {"a"}),
        ("tier!=gpu", {"c", "d"}),
        ("pool in (left,right)", {"a", "b", "c"}),
        ("pool notin (left)", {"b", "c", "d"}),
        ("pool", {"a", "b", "c"}),
        ("!pool", {"d"}),
    ],
)
def test_label_selectors_on_list(cluster: EmulatedCluster, selector: str, expected: set[str]) -> None:
    labels = {
        "a": {"tier": "gpu", "pool": "left"},
        "b": {"tier": "gpu", "pool": "right"},
        "c": {"tier": "cpu", "pool": "right"},
        "d": {"tier": "cpu"},
    }
    for name, object_labels in labels.items():
        cluster.core.create_namespaced_config_map(
            NAMESPACE, {"metadata": {"name": name, "labels": object_labels}}
        )

    listed = cluster.core.list_namespaced_config_map(NAMESPACE, label_selector=selector)
    assert {item.metadata.name for item in listed.items} == expected


def watch_events(cluster: EmulatedCluster, count: int, **params: Any) -> list[tuple[str, str]]:
    """The first ``count`` events of a watch on rlhfjobs (fails if the server ends it earlier)."""
    events: list[tuple[str, str]] = []
    watch = kubernetes.watch.Watch()
    for event in watch.stream(
        cluster.custom.list_namespaced_custom_object,
        *RLHFJOBS,
        NAMESPACE,
        "rlhfjobs",
        timeout_seconds=5,
        **params,
    ):
        events.append((event["type"], event["object"]["metadata"]["name"]))
        if len(events) == count:
            watch.stop()
    return events


def test_watch_starts_after_the_given_resource_version(cluster: EmulatedCluster) -> None:
    create_job(cluster, "old-1")
    create_job(cluster, "old-2")
    listed = cluster.custom.list_namespaced_custom_object(*RLHFJOBS, NAMESPACE, "rlhfjobs")
    create_job(cluster, "new")
    cluster.custom.patch_namespaced_custom_object(
        *RLHFJOBS, NAMESPACE, "rlhfjobs", "old-1", {"spec": {"steps": 2}}
    )
    cluster.custom.delete_namespaced_custom_object(*RLHFJOBS, NAMESPACE, "rlhfjobs", "old-2")

    since_list = watch_events(cluster, 3, resource_version=listed["metadata"]["resourceVersion"])
    assert since_list == [("ADDED", "new"), ("MODIFIED", "old-1"), ("DELETED", "old-2")]
    from_scratch = watch_events(cluster, 2)
    assert sorted(from_scratch) == [("ADDED", "new"), ("ADDED", "old-1")]


def test_watch_with_a_selector_sees_objects_enter_and_leave_it(cluster: EmulatedCluster) -> None:
    create_job(cluster, "leaves", labels={"tier": "gpu"})
    create_job(cluster, "enters", labels={"tier": "cpu"})
    version = cluster.custom.list_namespaced_custom_object(*RLHFJOBS, NAMESPACE, "rlhfjobs")["metadata"]
    for name, tier in (("leaves", "cpu"), ("enters", "gpu")):
        cluster.custom.patch_namespaced_custom_object(
            *RLHFJOBS, NAMESPACE, "rlhfjobs", name, {"metadata": {"labels": {"tier": tier}}}
        )

    events = watch_events(cluster, 2, resource_version=version["resourceVersion"], label_selector="tier=gpu")
    assert events == [("DELETED", "leaves"), ("ADDED", "enters")]


def test_two_watchers_of_a_resource_get_the_same_events(cluster: EmulatedCluster) -> None:
    """Each event is encoded once and shared; each watcher still sees it as its filter does."""
    create_job(cluster, "a", labels={"tier": "gpu"})
    version = cluster.custom.list_namespaced_custom_object(*RLHFJOBS, NAMESPACE, "rlhfjobs")["metadata"]
    cluster.custom.patch_namespaced_custom_object(
        *RLHFJOBS, NAMESPACE, "rlhfjobs", "a", {"metadata": {"labels": {"tier": "cpu"}}}
    )
    since = version["resourceVersion"]
    assert watch_events(cluster, 1, resource_version=since) == [("MODIFIED", "a")]
    assert watch_events(cluster, 1, resource_version=since) == [("MODIFIED", "a")]
    assert watch_events(cluster, 1, resource_version=since, label_selector="tier=gpu") == [("DELETED", "a")]


def test_a_tests_own_reactions_answer_before_the_emulation(cluster: EmulatedCluster) -> None:
    """kmock's reactions keep their meaning: one answers every request its filters match (a
    method and path, or any predicate), and the emulation serves everything else."""
    create_job(cluster, "a")
    create_job(cluster, "b")
    path = f"/apis/hybridflow.io/v1alpha1/namespaces/{NAMESPACE}/rlhfjobs"
    cluster.emulator[f"get {path}/a"] << 503
    cluster.emulator[lambda request: request.name == "b" and request.method.value == "PATCH"] << 429
    for _ in range(2):
        with pytest.raises(ApiException) as unavailable:
            get_job(cluster, "a")
        assert unavailable.value.status == 503
    with pytest.raises(ApiException) as throttled:
        cluster.custom.patch_namespaced_custom_object(
            *RLHFJOBS, NAMESPACE, "rlhfjobs", "b", {"spec": {"steps": 3}}
        )
    assert throttled.value.status == 429
    assert get_job(cluster, "b")["metadata"]["name"] == "b"
    cluster.custom.patch_namespaced_custom_object(
        *RLHFJOBS, NAMESPACE, "rlhfjobs", "a", {"spec": {"steps": 3}}
    )
    steps = {
        job["metadata"]["name"]: job["spec"]["steps"]
        for job in cluster.emulator.objects_of(*RLHFJOBS[:1], "rlhfjobs")
    }
    assert steps == {"a": 3, "b": 3}  # kmock applies a write even when a reaction answers it


# --- deletion ---------------------------------------------------------------------------------------


def test_finalizers_hold_deletion_until_removed(cluster: EmulatedCluster) -> None:
    job = create_job(cluster, "a", finalizers=["example.com/cleanup"])
    cluster.custom.delete_namespaced_custom_object(*RLHFJOBS, NAMESPACE, "rlhfjobs", "a")
    deleting = get_job(cluster, "a")
    assert deleting["metadata"]["deletionTimestamp"]
    assert deleting["metadata"]["generation"] == job["metadata"]["generation"] + 1

    cluster.custom.patch_namespaced_custom_object(
        *RLHFJOBS, NAMESPACE, "rlhfjobs", "a", {"metadata": {"finalizers": None}}
    )
    with pytest.raises(ApiException) as gone:
        get_job(cluster, "a")
    assert gone.value.status == 404


def test_owner_references_cascade_deletion(cluster: EmulatedCluster) -> None:
    job = create_job(cluster, "job")
    keeper = cluster.core.create_namespaced_config_map(NAMESPACE, {"metadata": {"name": "keeper"}})
    config = cluster.core.create_namespaced_config_map(
        NAMESPACE, {"metadata": {"name": "config", "ownerReferences": owned_by(job)}}
    )
    rayjob = cluster.custom.create_namespaced_custom_object(
        *RAYJOBS,
        NAMESPACE,
        "rayjobs",
        {
            "apiVersion": "ray.io/v1",
            "kind": "RayJob",
            "metadata": {"name": "ray", "ownerReferences": owned_by(job)},
        },
    )
    # A grandchild (cascade), and a child with a second owner that outlives the job (kept).
    cluster.core.create_namespaced_pod(
        NAMESPACE, {"metadata": {"name": "head", "ownerReferences": owned_by(rayjob)}}
    )
    keeper_ref = {"apiVersion": "v1", "kind": "ConfigMap", "name": "keeper", "uid": keeper.metadata.uid}
    cluster.core.create_namespaced_config_map(
        NAMESPACE, {"metadata": {"name": "shared", "ownerReferences": [*owned_by(job), keeper_ref]}}
    )
    assert config.metadata.owner_references[0].uid == job["metadata"]["uid"]

    cluster.custom.delete_namespaced_custom_object(*RLHFJOBS, NAMESPACE, "rlhfjobs", "job")

    assert {cm.metadata.name for cm in cluster.core.list_namespaced_config_map(NAMESPACE).items} == {
        "keeper",
        "shared",
    }
    assert cluster.custom.list_namespaced_custom_object(*RAYJOBS, NAMESPACE, "rayjobs")["items"] == []
    assert cluster.core.list_namespaced_pod(NAMESPACE).items == []


def test_a_child_created_after_its_owner_was_deleted_is_collected(cluster: EmulatedCluster) -> None:
    """As the API server's garbage collector does: a create naming only owners that no longer
    exist succeeds, and the object is collected (a controller that had not seen the deletion)."""
    job = create_job(cluster, "job")
    cluster.custom.delete_namespaced_custom_object(*RLHFJOBS, NAMESPACE, "rlhfjobs", "job")
    late = cluster.core.create_namespaced_config_map(
        NAMESPACE, {"metadata": {"name": "late", "ownerReferences": owned_by(job)}}
    )
    assert late.metadata.uid  # created (201)...
    assert [cm.metadata.name for cm in cluster.core.list_namespaced_config_map(NAMESPACE).items] == []
    kept = cluster.core.create_namespaced_config_map(NAMESPACE, {"metadata": {"name": "no-owner"}})
    assert [cm.metadata.name for cm in cluster.core.list_namespaced_config_map(NAMESPACE).items] == [
        kept.metadata.name
    ]


def test_a_crd_manifest_registers_its_resource() -> None:
    crd_path = Path(__file__).resolve().parents[2] / "crds" / "hybridflow.io_rlhfjobs.yaml"
    if not crd_path.exists():
        pytest.skip(f"{crd_path} is not generated")
    emulator = ApiServerEmulator()
    (resource,) = emulator.register_crd(yaml.safe_load(crd_path.read_text()))

    info = emulator.resources[resource]
    assert (resource.group, resource.version, resource.plural) == ("hybridflow.io", "v1alpha1", "rlhfjobs")
    assert (info.kind, info.namespaced, info.subresources) == ("RLHFJob", True, {"status"})


def test_namespaces_are_listed(cluster: EmulatedCluster) -> None:
    cluster.core.create_namespace({"metadata": {"name": "team-a"}})
    assert {ns.metadata.name for ns in cluster.core.list_namespace().items} == {"default", "team-a"}
    assert cluster.core.read_namespace("team-a").metadata.uid


# --- a kopf operator end to end -------------------------------------------------------------------


def desired_config_map(job: Mapping[str, Any]) -> dict[str, Any]:
    """The builder of the tiny operator: the one ConfigMap an RLHFJob owns."""
    meta = job["metadata"]
    return {
        "metadata": {"name": f"{meta['name']}-config", "ownerReferences": owned_by(job)},
        "data": {"steps": str(job["spec"]["steps"])},
    }


def tiny_operator(reconciled: list[str]) -> kopf.OperatorRegistry:
    """A level-triggered operator: every create, update and resume converges the same way."""
    registry = operator_registry()

    @kopf.on.resume(*RLHFJOBS, "rlhfjobs", registry=registry)
    @kopf.on.create(*RLHFJOBS, "rlhfjobs", registry=registry)
    @kopf.on.update(*RLHFJOBS, "rlhfjobs", registry=registry)
    def reconcile(body: kopf.Body, patch: kopf.Patch, namespace: str, **_: Any) -> None:
        core = kubernetes.client.CoreV1Api()  # the default configuration, as in a real operator
        desired = desired_config_map(body)
        name = desired["metadata"]["name"]
        try:
            observed = core.read_namespaced_config_map(name, namespace)
        except ApiException as e:
            if e.status != 404:
                raise
            core.create_namespaced_config_map(namespace, desired)
        else:
            if observed.data != desired["data"]:
                core.patch_namespaced_config_map(name, namespace, {"data": desired["data"]})
        if body.get("status", {}).get("configMap") != name:
            patch.status["configMap"] = name
        reconciled.append(body["metadata"]["resourceVersion"])

    @kopf.on.delete(*RLHFJOBS, "rlhfjobs", registry=registry)
    def deleted(**_: Any) -> None:
        """Makes kopf hold a finalizer, added and removed with JSON patches that test resourceVersion."""

    return registry


def test_kopf_operator_converges_and_a_second_reconcile_writes_nothing(cluster: EmulatedCluster) -> None:
    reconciled: list[str] = []
    create_job(cluster, "job", steps=3)

    def config_data() -> dict[str, str] | None:
        try:
            data: dict[str, str] | None = cluster.core.read_namespaced_config_map(
                "job-config", NAMESPACE
            ).data
        except ApiException:
            return None
        return data

    with cluster.run_operator(tiny_operator(reconciled)):
        wait_until(lambda: get_job(cluster, "job").get("status", {}).get("configMap") == "job-config")
        assert config_data() == {"steps": "3"}

        cluster.custom.patch_namespaced_custom_object(
            *RLHFJOBS, NAMESPACE, "rlhfjobs", "job", {"spec": {"steps": 5}}
        )
        wait_until(lambda: config_data() == {"steps": "5"})
        cluster.wait_until_idle()

    # A restart resumes the job: the reconcile runs again, finds everything converged, writes nothing.
    writes_before = len(cluster.emulator.write_requests())
    runs_before = len(reconciled)
    with cluster.run_operator(tiny_operator(reconciled)):
        wait_until(lambda: len(reconciled) > runs_before)
        cluster.wait_until_idle()
        assert cluster.emulator.write_requests()[writes_before:] == []

        # Deletion goes through kopf's finalizer, then the garbage collector takes the ConfigMap.
        cluster.custom.delete_namespaced_custom_object(*RLHFJOBS, NAMESPACE, "rlhfjobs", "job")
        wait_until(
            lambda: (
                not cluster.custom.list_namespaced_custom_object(*RLHFJOBS, NAMESPACE, "rlhfjobs")["items"]
            )
        )
        assert config_data() is None


def test_handlers_of_a_module_run_from_a_fresh_registry(
    cluster: EmulatedCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    module = tmp_path / "bare_decorators_operator.py"
    module.write_text(
        textwrap.dedent(
            """
            import kopf

            @kopf.on.create("hybridflow.io", "v1alpha1", "rlhfjobs")
            def created(patch, **_):
                patch.status["phase"] = "Pending"
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        registry = registry_for_module(module.stem)
    finally:
        sys.modules.pop(module.stem, None)
    assert registry is not kopf.get_default_registry()

    create_job(cluster, "job")
    with cluster.run_operator(registry):
        wait_until(lambda: get_job(cluster, "job").get("status") == {"phase": "Pending"})
