"""The e2e harness: the API-server double, the operator as in a cluster, a KubeRay stand-in, real training.

``make e2e`` runs this folder (``pytest e2e``), after ``make test`` in CI. Each test gets a fresh
emulated cluster (tests/kube) serving the generated RLHFJob CRD and KubeRay's RayJob CRD, the
operator as a cluster runs it (``python -m hybridflow_operator`` in its own process,
``operator_process.py``), and the KubeRay stand-in (``kuberay.py``), which runs every RayJob as a
real ``hybridflow run --in-cluster`` process against a local Ray with the job's pools simulated,
authorized as the head pod's ServiceAccount.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "tests"))  # the emulator and its harness: the `kube` package
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Ray GPU workers are held to a GPU node's device preconditions (runtime/hybridflow/devices.py).
os.environ.setdefault("HYBRIDFLOW_GPU_CONTRACT", "emulate")

from cluster_dns import ClusterDNS  # noqa: E402
from kuberay import KubeRayStandIn, write_kubeconfig  # noqa: E402
from operator_process import OperatorProcess  # noqa: E402

from kube.chart_rbac import install_chart_rbac  # noqa: E402
from kube.harness import EmulatedCluster  # noqa: E402
from kube.kueue import KueueStandIn, kueue_rayjob_webhook, register_kueue  # noqa: E402

RAYJOB_CRD = ROOT.parent / "shared" / "kuberay" / "ray.io_rayjobs.yaml"
NAMESPACE = "default"
OPERATOR_TOKEN = "hybridflow-operator"
"""The operator's bearer token: the emulator's fault injection tells its writes apart by it, and
authorizes it as the chart's ServiceAccount (exactly the chart's RBAC, never admin)."""
RELEASE_NAMESPACE = "hybridflow-system"


def rayjob_crd() -> dict[str, Any]:
    if RAYJOB_CRD.is_file():
        return dict(yaml.safe_load(RAYJOB_CRD.read_text()))
    return {  # without ../shared the emulator only needs the names, not KubeRay's schema
        "spec": {
            "group": "ray.io",
            "names": {"kind": "RayJob", "plural": "rayjobs"},
            "scope": "Namespaced",
            "versions": [{"name": "v1", "served": True, "subresources": {"status": {}}}],
        }
    }


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model and the toy prompts, as a volume the jobs would mount read-only."""
    base = tmp_path_factory.mktemp("models")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "hybridflow.cli",
            "make-tiny",
            "--model-dir",
            str(base / "model"),
            "--data-dir",
            str(base / "data"),
            "--prompts",
            "64",
        ],
        check=True,
        capture_output=True,
    )
    return base


@dataclass
class E2E:
    cluster: EmulatedCluster
    kuberay: KubeRayStandIn
    operator: OperatorProcess
    root: Path


# What the chart's Deployment sets (helm/hybridflow/templates/deployment.yaml), with retries
# waiting 2 s instead of 10 s so the fault scenarios stay short.
OPERATOR_ENV = {
    "HYBRIDFLOW_RUNTIME_IMAGE": "img:e2e",
    "HYBRIDFLOW_RETRY_BACKOFF_SECONDS": "2",
    "HYBRIDFLOW_RETRY_BACKOFF_MAX_SECONDS": "10",
}


@pytest.fixture(scope="session")
def cluster_dns(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterDNS]:
    """The cluster's DNS (``cluster_dns.py``): Services' names resolve while they exist."""
    with ClusterDNS(tmp_path_factory.mktemp("dns")) as dns:
        yield dns


@pytest.fixture
def e2e(tmp_path: Path, cluster_dns: ClusterDNS) -> Iterator[E2E]:
    with EmulatedCluster() as cluster:
        cluster.emulator.register_crd(
            yaml.safe_load((ROOT / "crds" / "hybridflow.io_rlhfjobs.yaml").read_text())
        )
        cluster.emulator.register_crd(rayjob_crd())
        register_kueue(cluster.emulator)
        cluster.emulator.validating_webhooks.append(kueue_rayjob_webhook("0.19"))
        account = install_chart_rbac(
            cluster, release_namespace=RELEASE_NAMESPACE, watched=[NAMESPACE], scratch=tmp_path
        )
        cluster.emulator.identities[OPERATOR_TOKEN] = account
        operator_kubeconfig = write_kubeconfig(
            cluster.kubeconfig_with_token(OPERATOR_TOKEN, NAMESPACE), tmp_path / "kubeconfig"
        )
        (tmp_path / "accounts").mkdir()

        def kubeconfig_for(account: str, namespace: str) -> Path:
            user = f"system:serviceaccount:{namespace}:{account}"
            return write_kubeconfig(
                cluster.kubeconfig_as(user, namespace), tmp_path / "accounts" / f"{namespace}-{account}"
            )

        operator = OperatorProcess(
            operator_kubeconfig, tmp_path / "operator.log", namespace=NAMESPACE, env=OPERATOR_ENV
        )
        operator.start()
        try:
            with KubeRayStandIn(cluster.api_client, kubeconfig_for, tmp_path, cluster_dns) as kuberay:
                yield E2E(cluster, kuberay, operator, tmp_path)
        finally:
            operator.stop()


@pytest.fixture
def kueue(e2e: E2E) -> Iterator[KueueStandIn]:
    """Kueue's job framework for the queued RayJobs (``kube.kueue``): admits everything it may."""
    with KueueStandIn(e2e.cluster.api_client, namespace=NAMESPACE, interval_seconds=0.3) as stand_in:
        yield stand_in
    assert not stand_in.errors, stand_in.errors


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    report = yield
    if report.when == "call":
        item.stash[CALL_PASSED] = report.passed
    return report


CALL_PASSED = pytest.StashKey[bool]()


@pytest.fixture
def figures(request: pytest.FixtureRequest) -> Iterator[dict[str, object]]:
    """What a scenario measured, as it measures it (set each figure before asserting on it).

    Written to ``$HYBRIDFLOW_E2E_RESULTS`` (one JSON line; ``bench/e2e.py`` sums them) after the
    test, passed or failed: a failed scenario reports what it saw (an orphaned child, a lost step)
    instead of nothing.
    """
    measured: dict[str, object] = {"scenario": request.node.name}
    started = time.monotonic()
    yield measured
    target = os.environ.get("HYBRIDFLOW_E2E_RESULTS")
    if target:
        line = {
            **measured,
            "passed": request.node.stash.get(CALL_PASSED, False),
            "seconds": round(time.monotonic() - started, 1),
        }
        with open(target, "a", encoding="utf-8") as out:
            out.write(json.dumps(line) + "\n")
