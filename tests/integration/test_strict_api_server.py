"""The emulator rejects what a real API server rejects, through the official client.

The emulator serves the generated RLHFJob CRD and KubeRay v1.7's RayJob CRD with their schemas,
so a write is pruned, defaulted, type-checked and CEL-checked as kube-apiserver does it
(``tests/kube/validation.py``); built-in objects are checked against Kubernetes' own schemas.
Each case below is a write that a real cluster answers with 422 and a Status body naming the
field, next to the write that it accepts.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes.client import ApiException

from hybridflow.spec import in_cluster_problems, parse_job_manifest
from hybridflow_operator.builders import RayJobDefaults, build_children
from hybridflow_operator.builders.metadata import JobRef
from kube.harness import EmulatedCluster, load_crd

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
RAYJOB_CRD = ROOT.parent / "shared" / "kuberay" / "ray.io_rayjobs.yaml"
NS = "default"
RLHF = ("hybridflow.io", "v1alpha1", NS, "rlhfjobs")


@pytest.fixture(scope="module")
def cluster() -> Iterator[EmulatedCluster]:
    with EmulatedCluster() as cluster:
        cluster.emulator.register_crd(load_crd(ROOT / "crds" / "hybridflow.io_rlhfjobs.yaml"))
        if RAYJOB_CRD.is_file():
            cluster.emulator.register_crd(load_crd(RAYJOB_CRD))
        yield cluster


def manifest(name: str, **spec: Any) -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((ROOT / "examples" / "grpo-cluster.yaml").read_text())
    doc["metadata"] = {"name": name, "namespace": NS}
    doc["spec"].update(spec)
    return doc


def rejection(call: Any) -> dict[str, Any]:
    """The Status body of a write that must fail with 422."""
    with pytest.raises(ApiException) as raised:
        call()
    assert raised.value.status == 422, raised.value.body
    body: dict[str, Any] = json.loads(raised.value.body)
    assert body["kind"] == "Status" and body["reason"] == "Invalid" and body["code"] == 422
    return body


def fields(body: dict[str, Any]) -> list[str]:
    return [cause["field"] for cause in body["details"]["causes"]]


def test_a_string_in_a_number_field_is_rejected(cluster: EmulatedCluster) -> None:
    training = {**manifest("x")["spec"]["training"], "totalSteps": "40"}
    body = rejection(
        lambda: cluster.custom.create_namespaced_custom_object(*RLHF, manifest("s1", training=training))
    )
    assert fields(body) == ["spec.training.totalSteps"]
    assert body["details"]["causes"][0]["reason"] == "FieldValueTypeInvalid"
    cluster.custom.create_namespaced_custom_object(*RLHF, manifest("s1"))  # the same job, typed right


def test_unknown_fields_are_rejected_in_strict_mode_and_pruned_otherwise(cluster: EmulatedCluster) -> None:
    training = {**manifest("x")["spec"]["training"], "totalStep": 40}
    body = rejection(
        lambda: cluster.custom.create_namespaced_custom_object(*RLHF, manifest("u1", training=training))
    )
    assert fields(body) == ["spec.training.totalStep"]
    created = cluster.custom.create_namespaced_custom_object(
        *RLHF, manifest("u1", training=training), field_validation="Warn"
    )
    assert "totalStep" not in created["spec"]["training"]  # pruned, as with the API server's default


def test_the_server_applies_schema_defaults(cluster: EmulatedCluster) -> None:
    doc = manifest("d1")
    del doc["spec"]["maxRestarts"]
    created = cluster.custom.create_namespaced_custom_object(*RLHF, doc)
    assert created["spec"]["maxRestarts"] == 3 and created["spec"]["suspend"] is False


def test_cel_rules_and_transition_rules_with_old_self(cluster: EmulatedCluster) -> None:
    pools = [{"name": "gpus", "nodes": 1, "gpusPerNode": 2}]
    body = rejection(
        lambda: cluster.custom.create_namespaced_custom_object(*RLHF, manifest("c1", resourcePools=pools))
    )
    assert "spec.roles.actor" in fields(body)  # the actor's pool must exist: a CEL rule
    checkpoint = {**manifest("x")["spec"]["checkpoint"], "path": "a"}
    cluster.custom.create_namespaced_custom_object(*RLHF, manifest("c1", checkpoint=checkpoint))
    # checkpoint.path may be anything on create, but never change afterwards (oldSelf).
    body = rejection(
        lambda: cluster.custom.patch_namespaced_custom_object(
            *RLHF, "c1", {"spec": {"checkpoint": {"path": "b"}}}
        )
    )
    assert fields(body) == ["spec.checkpoint.path"]
    assert "immutable" in body["message"]
    cluster.custom.patch_namespaced_custom_object(*RLHF, "c1", {"spec": {"suspend": True}})


def test_in_cluster_rules_reject_restarts_without_a_checkpoint_volume(cluster: EmulatedCluster) -> None:
    checkpoint = {key: value for key, value in manifest("x")["spec"]["checkpoint"].items() if key != "volume"}
    body = rejection(
        lambda: cluster.custom.create_namespaced_custom_object(*RLHF, manifest("ic", checkpoint=checkpoint))
    )
    assert fields(body) == ["spec.checkpoint.volume"]
    laptop = yaml.safe_load((ROOT / "examples" / "grpo-tiny.yaml").read_text())
    laptop["metadata"] = {"name": "ic", "namespace": NS}
    body = rejection(lambda: cluster.custom.create_namespaced_custom_object(*RLHF, laptop))
    assert sorted(fields(body)) == ["spec.checkpoint.volume", "spec.outputDir"]
    # `hybridflow validate --in-cluster` says the same (the spec's rules are the CEL's twins).
    spec = parse_job_manifest(laptop, source="laptop").spec
    assert [line.split(":")[0] for line in in_cluster_problems(spec)] == fields(body)
    assert all(
        cause["message"].split(" (got")[0] in " ".join(in_cluster_problems(spec))
        for cause in body["details"]["causes"]
    )
    cluster.custom.create_namespaced_custom_object(
        *RLHF, {**laptop, "spec": {**laptop["spec"], "maxRestarts": 0}}
    )


def test_status_is_validated_on_its_own_subresource(cluster: EmulatedCluster) -> None:
    cluster.custom.create_namespaced_custom_object(*RLHF, manifest("st1"))
    body = rejection(
        lambda: cluster.custom.patch_namespaced_custom_object_status(
            *RLHF, "st1", {"status": {"progress": {"reward": "0.25"}}}
        )
    )
    assert fields(body) == ["status.progress.reward"]
    body = rejection(
        lambda: cluster.custom.patch_namespaced_custom_object_status(
            *RLHF, "st1", {"status": {"phase": "Done"}}
        )
    )
    assert body["details"]["causes"][0]["reason"] == "FieldValueNotSupported"
    done = cluster.custom.patch_namespaced_custom_object_status(
        *RLHF, "st1", {"status": {"progress": {"reward": 0.25, "step": 1}}}
    )
    assert done["status"]["progress"] == {"reward": 0.25, "step": 1}


@pytest.mark.skipif(not RAYJOB_CRD.is_file(), reason="needs ../shared/kuberay (KubeRay v1.7 CRDs)")
def test_rayjobs_are_checked_against_kuberay_v1_7(cluster: EmulatedCluster) -> None:
    job = parse_job_manifest(manifest("rj"), source="test")
    owner = JobRef(namespace=NS, name="rj", uid="00000000-0000-0000-0000-000000000001")
    rayjob = build_children(job, owner, attempt=1, defaults=RayJobDefaults(image="img:1"))[-1]
    broken = json.loads(json.dumps(rayjob))
    broken["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0][
        "imagePullPolicy"
    ] = 7
    broken["spec"]["backoffLimit"] = "none"
    body = rejection(
        lambda: cluster.custom.create_namespaced_custom_object("ray.io", "v1", NS, "rayjobs", broken)
    )
    assert sorted(fields(body)) == [
        "spec.backoffLimit",
        "spec.rayClusterSpec.headGroupSpec.template.spec.containers[0].imagePullPolicy",
    ]
    cluster.custom.create_namespaced_custom_object("ray.io", "v1", NS, "rayjobs", rayjob)


def post(cluster: EmulatedCluster, path: str, body: dict[str, Any]) -> None:
    """A raw POST: the typed client refuses, before sending, what this test wants the server to refuse."""
    request = urllib.request.Request(
        cluster.url + path, json.dumps(body).encode(), {"Content-Type": "application/json"}, method="POST"
    )
    try:
        urllib.request.urlopen(request, timeout=10).close()
    except urllib.error.HTTPError as err:
        raise _api_error(err) from err


def _api_error(err: urllib.error.HTTPError) -> ApiException:
    error = ApiException(status=err.code, reason=str(err.reason))
    error.body = err.read().decode()
    return error


def test_built_in_objects_are_checked_against_kubernetes_schemas(cluster: EmulatedCluster) -> None:
    configmaps = f"/api/v1/namespaces/{NS}/configmaps"
    bad = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "cm"}, "data": {"steps": 40}}
    assert fields(rejection(lambda: post(cluster, configmaps, bad))) == ["data.steps"]
    role = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": {"name": "r"},
        "rule": [],
    }
    roles = f"/apis/rbac.authorization.k8s.io/v1/namespaces/{NS}/roles"
    assert fields(rejection(lambda: post(cluster, roles, role))) == ["<root>"]
    label = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "cm", "labels": {"a": "b c"}}}
    assert fields(rejection(lambda: post(cluster, configmaps, label))) == ["metadata.labels.a"]
    post(cluster, configmaps, {**bad, "data": {"steps": "40"}})
