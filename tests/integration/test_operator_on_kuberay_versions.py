"""The operator (kopf, the real handlers) as the chart installs it, against what each KubeRay serves.

Every test runs the operator with exactly the chart's RBAC (``kube.chart_rbac``: no admin), on a
fresh API-server double serving the RayJob CRD of one KubeRay version
(``kube.kuberay_rules.served_rayjob_crd``: the fields an older KubeRay's CRD lacks are pruned by
the API server), and plays KubeRay by writing RayJob statuses. What each shows:

* every RayJob the operator builds passes that version's validation (``kuberay_rules``);
* on KubeRay 1.5.x (no ``preRunningDeadlineSeconds``) the operator keeps the startup timeout;
* KubeRay older than 1.5.1 is refused with a condition naming the minimum version;
* a KubeRay installed after the operator is found through the CRD watch;
* jobs named with 63, 64, 200 and 253 characters run to Succeeded;
* a job and a RayJob deleted while the watches were gone (410 Gone, then a relist) leave no stray write.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import kmock
import kubernetes.client
import pytest
import yaml

from hybridflow_operator.cluster import ApiCluster
from hybridflow_operator.main import OperatorConfig, register
from hybridflow_operator.names import rayjob_name
from kube.chart_rbac import chart_registry, helm_binary, install_chart_rbac
from kube.harness import EmulatedCluster, load_crd, wait_until
from kube.kuberay_rules import served_rayjob_crd, validate_rayjob

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(helm_binary() is None, reason="needs helm (make setup installs it)"),
]

ROOT = Path(__file__).resolve().parents[2]
RAYJOB_CRD = ROOT.parent / "shared" / "kuberay" / "ray.io_rayjobs.yaml"
GROUP, VERSION, PLURAL = "hybridflow.io", "v1alpha1", "rlhfjobs"
NS = "default"
RELEASE_NAMESPACE = "hybridflow-system"

needs_kuberay_crds = pytest.mark.skipif(
    not RAYJOB_CRD.is_file(), reason="needs ../shared/kuberay (KubeRay v1.7 CRDs)"
)


@contextmanager
def operator_on(version: str | None, tmp_path: Path) -> Iterator[EmulatedCluster]:
    """A double serving KubeRay ``version``'s RayJob CRD (None: KubeRay not installed), and the
    operator running as the chart's ServiceAccount, watching ``default``."""
    with EmulatedCluster() as cluster:
        cluster.emulator.register_crd(load_crd(ROOT / "crds" / "hybridflow.io_rlhfjobs.yaml"))
        if version is not None:
            cluster.emulator.register_crd(served_rayjob_crd(load_crd(RAYJOB_CRD), version))
        account = install_chart_rbac(
            cluster, release_namespace=RELEASE_NAMESPACE, watched=[NS], scratch=tmp_path
        )
        registry, client = chart_registry(cluster, account)
        config = OperatorConfig(
            {
                "HYBRIDFLOW_RETRY_BACKOFF_SECONDS": "1",
                "HYBRIDFLOW_RUNTIME_IMAGE": "img:test",
                "WATCH_NAMESPACES": NS,
            }
        )
        register(registry, config=config, cluster=ApiCluster(client), serve_metrics=False)
        with cluster.run_operator(registry, namespaces=[NS]):
            yield cluster


def create_job(cluster: EmulatedCluster, name: str, **spec: Any) -> None:
    doc = yaml.safe_load((ROOT / "examples" / "grpo-cluster.yaml").read_text())
    doc["metadata"] = {"name": name, "namespace": NS}
    doc["spec"].update(spec)
    cluster.custom.create_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, doc)


def status(cluster: EmulatedCluster, name: str) -> dict[str, Any]:
    job = cluster.custom.get_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, name)
    return dict(job.get("status") or {})


def condition(cluster: EmulatedCluster, name: str, kind: str) -> dict[str, Any]:
    return next((c for c in status(cluster, name).get("conditions") or [] if c["type"] == kind), {})


def rayjob(cluster: EmulatedCluster, name: str) -> dict[str, Any] | None:
    try:
        return dict(cluster.custom.get_namespaced_custom_object("ray.io", "v1", NS, "rayjobs", name))
    except Exception:
        return None


def kuberay(cluster: EmulatedCluster, name: str, **fields: Any) -> None:
    cluster.custom.patch_namespaced_custom_object_status(
        "ray.io", "v1", NS, "rayjobs", name, {"status": fields}
    )


def operator_writes(cluster: EmulatedCluster) -> list[str]:
    """Every write the operator (the chart's ServiceAccount) made, as ``METHOD path``."""
    operators = {token for token, user in cluster.emulator.identities.items() if RELEASE_NAMESPACE in user}
    return [
        f"{request.method.value} {request.url.path}"
        for request in cluster.emulator.write_requests()
        if next((v for k, v in request.headers.items() if k.lower() == "authorization"), "").removeprefix(
            "Bearer "
        )
        in operators
    ]


@needs_kuberay_crds
@pytest.mark.parametrize("version", ["1.5.1", "1.6", "1.7"])
def test_every_rayjob_built_passes_that_kuberays_validation(version: str, tmp_path: Path) -> None:
    with operator_on(version, tmp_path) as cluster:
        create_job(cluster, "job", startupTimeoutSeconds=600)
        built = wait_until(lambda: rayjob(cluster, "job-1"), message="the RayJob")
        assert validate_rayjob(built, version) is None
        assert built["spec"]["rayClusterSpec"]["rayVersion"] == "2.60.0"
        assert ("preRunningDeadlineSeconds" in built["spec"]) == (version != "1.5.1")
        assert built["spec"]["rayClusterSpec"]["authOptions"] == {"mode": "token"}


@needs_kuberay_crds
def test_on_kuberay_1_5_the_operator_stops_an_attempt_that_does_not_start_in_time(tmp_path: Path) -> None:
    with operator_on("1.5.1", tmp_path) as cluster:
        create_job(cluster, "slow", startupTimeoutSeconds=2, maxRestarts=1)
        wait_until(lambda: rayjob(cluster, "slow-1"), message="the RayJob")
        kuberay(
            cluster,
            "slow-1",
            jobDeploymentStatus="Initializing",
            startTime=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        )
        # The job's status says StartupTimeout only until the retry starts, which can be sooner than
        # a poll sees it: wait for what lasts, the stopped attempt's mark and the next attempt.
        wait_until(
            lambda: (
                ((rayjob(cluster, "slow-1") or {}).get("metadata") or {})
                .get("annotations", {})
                .get("hybridflow.io/stopped")
                == "StartupTimeout"
            ),
            message="the first attempt stopped for its startup timeout",
            timeout_seconds=30,
        )
        stopped = rayjob(cluster, "slow-1") or {}
        assert stopped["spec"]["suspend"] is True
        wait_until(lambda: rayjob(cluster, "slow-2"), message="the retry", timeout_seconds=30)
        assert status(cluster, "slow")["attempts"] == 2


@needs_kuberay_crds
def test_a_kuberay_older_than_1_5_1_is_refused_naming_the_minimum(tmp_path: Path) -> None:
    with operator_on("1.5.0", tmp_path) as cluster:
        create_job(cluster, "old")
        wait_until(lambda: condition(cluster, "old", "ChildrenReady").get("reason") == "KubeRayUnsupported")
        assert "1.5.1" in condition(cluster, "old", "ChildrenReady")["message"]
        assert rayjob(cluster, "old-1") is None


@needs_kuberay_crds
def test_a_kuberay_installed_after_the_operator_is_found(tmp_path: Path) -> None:
    with operator_on(None, tmp_path) as cluster:
        create_job(cluster, "early")
        wait_until(lambda: condition(cluster, "early", "ChildrenReady").get("reason") == "KubeRayMissing")
        crd = load_crd(RAYJOB_CRD)
        cluster.emulator.register_crd(crd, store=False)  # served from now on...
        body = {"apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
                "metadata": {"name": "rayjobs.ray.io"}, "spec": crd["spec"]}  # fmt: skip
        # ... and installed: the operator's CRD watch sees it.
        kubernetes.client.ApiextensionsV1Api(cluster.api_client).create_custom_resource_definition(body)
        wait_until(
            lambda: rayjob(cluster, "early-1"),
            message="the RayJob, once KubeRay is there",
            timeout_seconds=30,
        )


@needs_kuberay_crds
def test_jobs_named_with_any_valid_length_run_to_succeeded(tmp_path: Path) -> None:
    """Children carry the name hashed down to 63 characters in their job label: the operator
    must find them by it, or it never sees a child and creates each one again and again."""
    names = {length: ("a" * (length - 1)) + "z" for length in (63, 64, 200, 253)}
    with operator_on("1.7", tmp_path) as cluster:
        for name in names.values():
            create_job(cluster, name)
        for length, name in names.items():
            child = rayjob_name(name, 1)
            wait_until(
                lambda child=child: rayjob(cluster, child),
                message=f"the RayJob of the {length}-character job",
            )
            kuberay(cluster, child, jobDeploymentStatus="Running", jobStatus="RUNNING")
            wait_until(
                lambda name=name: status(cluster, name).get("phase") == "Running",
                message=f"{length}: Running",
            )
            kuberay(
                cluster,
                child,
                jobDeploymentStatus="Complete",
                jobStatus="SUCCEEDED",
                endTime="2026-12-03T00:00:00Z",
            )
            wait_until(
                lambda name=name: status(cluster, name).get("phase") == "Succeeded", message=f"{length}"
            )
        time.sleep(2)  # a pass that did not find its children would be creating them again now
        posts = [
            write for write in operator_writes(cluster) if write.startswith("POST") and "/events" not in write
        ]
        assert len(posts) == 6 * len(names), posts  # each child created once


@needs_kuberay_crds
def test_after_a_relist_the_caches_drop_what_was_deleted_while_the_watch_was_gone(tmp_path: Path) -> None:
    """410 Gone: kopf re-lists and delivers no DELETED events for what vanished in the gap."""
    with operator_on("1.7", tmp_path) as cluster:
        create_job(cluster, "gone")
        create_job(cluster, "kept", maxRestarts=1)
        for name in ("gone", "kept"):
            wait_until(lambda name=name: rayjob(cluster, f"{name}-1"), message=name)
            kuberay(cluster, f"{name}-1", jobDeploymentStatus="Running", jobStatus="RUNNING")
            wait_until(lambda name=name: status(cluster, name).get("phase") == "Running")
        time.sleep(1)
        before = len(operator_writes(cluster))
        jobs = kmock.resource(GROUP, VERSION, PLURAL)
        rayjobs = kmock.resource("ray.io", "v1", "rayjobs")

        def deletions() -> None:
            cluster.emulator.delete_stored_object(jobs, "gone", NS)  # its children go with it (GC)
            cluster.emulator.delete_stored_object(rayjobs, "kept-1", NS)

        old_uid = (rayjob(cluster, "kept-1") or {})["metadata"]["uid"]
        cluster.watch_gap(deletions)
        # The kept job's RayJob is gone: its attempt starts again; the gone job is forgotten.
        wait_until(
            lambda: (rayjob(cluster, "kept-1") or {}).get("metadata", {}).get("uid") not in (None, old_uid),
            message="the kept job's attempt made again",
            timeout_seconds=30,
        )
        time.sleep(3)  # rechecks and backoffs of the gone job would write by now
        after = operator_writes(cluster)[before:]
        assert not [write for write in after if "/gone" in write], after  # no 404 patch, no re-created child
        assert status(cluster, "kept")["attempts"] == 1
