"""The operator (kopf, the real handlers) against the API-server emulator, with the test playing KubeRay.

The emulator serves the generated RLHFJob CRD and the real KubeRay v1.7 RayJob CRD; the test moves
each RayJob through KubeRay's states by writing its status, and checks the RLHFJob's phase,
conditions, events, the children it owns, and that reconciles with nothing to do write nothing.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes.client.exceptions import ApiException

from hybridflow_operator.cluster import ApiCluster
from hybridflow_operator.main import OperatorConfig, register
from kube.harness import EmulatedCluster, load_crd, operator_registry, wait_until

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
RAYJOB_CRD = ROOT.parent / "shared" / "kuberay" / "ray.io_rayjobs.yaml"
NS = "default"
GROUP, VERSION, PLURAL = "hybridflow.io", "v1alpha1", "rlhfjobs"


def rayjob_crd() -> dict[str, Any]:
    if RAYJOB_CRD.is_file():
        return dict(load_crd(RAYJOB_CRD))
    # Without ../shared the emulator only needs the names, not KubeRay's schema.
    return {
        "spec": {
            "group": "ray.io",
            "names": {"kind": "RayJob", "plural": "rayjobs"},
            "scope": "Namespaced",
            "versions": [{"name": "v1", "served": True, "subresources": {"status": {}}}],
        }
    }


@pytest.fixture(scope="module")
def cluster() -> Any:
    with EmulatedCluster() as cluster:
        cluster.emulator.register_crd(load_crd(ROOT / "crds" / "hybridflow.io_rlhfjobs.yaml"))
        cluster.emulator.register_crd(rayjob_crd())
        registry = operator_registry()
        config = OperatorConfig(
            {"HYBRIDFLOW_RETRY_BACKOFF_SECONDS": "1", "HYBRIDFLOW_RUNTIME_IMAGE": "img:test"}
        )
        register(registry, config=config, cluster=ApiCluster(cluster.api_client), serve_metrics=False)
        with cluster.run_operator(registry):
            yield cluster


def create_job(cluster: Any, name: str, **spec: Any) -> None:
    doc = yaml.safe_load((ROOT / "examples" / "grpo-tiny.yaml").read_text())
    doc["metadata"] = {"name": name, "namespace": NS}
    doc["spec"].update(spec)
    cluster.custom.create_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, doc)


def job(cluster: Any, name: str) -> dict[str, Any]:
    return dict(cluster.custom.get_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, name))


def phase(cluster: Any, name: str) -> str | None:
    return (job(cluster, name).get("status") or {}).get("phase")


def rayjob(cluster: Any, name: str) -> dict[str, Any] | None:
    try:
        return dict(cluster.custom.get_namespaced_custom_object("ray.io", "v1", NS, "rayjobs", name))
    except Exception:
        return None


def kuberay(cluster: Any, name: str, deployment: str, job_status: str = "", reason: str = "") -> None:
    status = {"jobDeploymentStatus": deployment, "jobStatus": job_status, "reason": reason}
    cluster.custom.patch_namespaced_custom_object_status(
        "ray.io", "v1", NS, "rayjobs", name, {"status": status}
    )


def event_reasons(cluster: Any, name: str) -> list[str]:
    events = cluster.core.list_namespaced_event(NS).items
    return [e.reason for e in events if e.involved_object.name == name]


def test_rlhfjob_lifecycle_through_kuberay_states(cluster: Any) -> None:
    create_job(cluster, "life", maxRestarts=1)
    wait_until(lambda: rayjob(cluster, "life-1"), message="the first attempt's RayJob")
    uid = job(cluster, "life")["metadata"]["uid"]
    for read in (
        cluster.core.read_namespaced_config_map("life-config", NS),
        cluster.core.read_namespaced_service_account("life-controller", NS),
        cluster.rbac.read_namespaced_role("life-controller", NS),
        cluster.rbac.read_namespaced_role_binding("life-controller", NS),
    ):
        assert [ref.uid for ref in read.metadata.owner_references] == [uid]
    first = rayjob(cluster, "life-1")
    assert (
        first is not None and first["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["groupName"] == "default"
    )

    kuberay(cluster, "life-1", "Initializing")
    wait_until(lambda: phase(cluster, "life") == "Initializing")
    kuberay(cluster, "life-1", "Running", "RUNNING")
    wait_until(lambda: phase(cluster, "life") == "Running")
    status = job(cluster, "life")["status"]
    assert status["jobDeploymentStatus"] == "Running" and status["attempts"] == 1

    kuberay(cluster, "life-1", "Failed", "FAILED", reason="AppFailed")
    wait_until(lambda: rayjob(cluster, "life-2"), message="a retry as a new RayJob")
    # The status is patched after the new attempt's children are created: wait for it too.
    wait_until(lambda: phase(cluster, "life") == "Retrying")
    kuberay(cluster, "life-2", "Running", "RUNNING")
    wait_until(lambda: phase(cluster, "life") == "Running")
    kuberay(cluster, "life-2", "Complete", "SUCCEEDED")
    wait_until(lambda: phase(cluster, "life") == "Succeeded")
    conditions = {c["type"]: c["status"] for c in job(cluster, "life")["status"]["conditions"]}
    assert conditions["Succeeded"] == "True" and conditions["Failed"] == "False"
    reasons = event_reasons(cluster, "life")
    for reason in ("Initializing", "Running", "Retrying", "Succeeded"):
        assert reason in reasons


def test_reconciles_with_nothing_to_do_write_nothing(cluster: Any) -> None:
    create_job(cluster, "quiet")
    wait_until(lambda: rayjob(cluster, "quiet-1"))
    kuberay(cluster, "quiet-1", "Running", "RUNNING")
    wait_until(lambda: phase(cluster, "quiet") == "Running")
    time.sleep(1.5)  # let the reconciles triggered by the transition finish (the timer keeps reading)
    writes = len(cluster.emulator.write_requests())
    time.sleep(3.5)  # the 1 s timer reconciles the job three more times
    extra = cluster.emulator.write_requests()[writes:]
    assert extra == [], [(r.method, r.name, r.subresource, r.data) for r in extra[:4]]


def test_the_api_server_rejects_an_invalid_spec_before_the_operator_sees_it(cluster: Any) -> None:
    """The CRD's schema and CEL rules answer 422 naming the field; nothing is stored or created.

    (A spec the operator cannot parse after admission, e.g. from an older CRD, sets
    ``Validated=False``: tests/unit/test_reconcile.py covers that path.)
    """
    with pytest.raises(ApiException) as rejected:
        create_job(cluster, "bad", algorithm={"name": "ppo2"})
    assert rejected.value.status == 422
    body = json.loads(rejected.value.body)
    assert body["reason"] == "Invalid"
    assert [c["field"] for c in body["details"]["causes"]] == ["spec.algorithm.name"]
    with pytest.raises(ApiException) as cel:
        create_job(cluster, "bad", resourcePools=[{"name": "pool", "nodes": 1, "gpusPerNode": 1}])
    assert cel.value.status == 422 and "spec.roles" in cel.value.body  # a CEL rule: the actor's pool
    assert rayjob(cluster, "bad-1") is None


def test_suspend_reaches_the_rayjob_and_deletion_cascades(cluster: Any) -> None:
    create_job(cluster, "pause")
    wait_until(lambda: rayjob(cluster, "pause-1"))
    kuberay(cluster, "pause-1", "Running", "RUNNING")
    cluster.custom.patch_namespaced_custom_object(
        GROUP, VERSION, NS, PLURAL, "pause", {"spec": {"suspend": True}}
    )
    wait_until(lambda: (rayjob(cluster, "pause-1") or {}).get("spec", {}).get("suspend") is True)
    cluster.custom.delete_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, "pause")
    wait_until(lambda: rayjob(cluster, "pause-1") is None, message="owner-reference garbage collection")
