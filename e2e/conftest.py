"""The e2e harness: the API-server double, the operator as in a cluster, a KubeRay stand-in, real training.

``make e2e`` runs this folder (``pytest e2e``), after ``make test`` in CI. Each test gets a fresh
emulated cluster (tests/kube) serving the generated RLHFJob CRD and KubeRay's RayJob CRD, the
operator's real kopf handlers on their own thread (how the operator tests run it), and the
KubeRay stand-in (``kuberay.py``), which runs every RayJob as a real ``hybridflow run
--in-cluster`` process against a local Ray with the job's pools simulated.
"""

from __future__ import annotations

import os
import subprocess
import sys
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

from kuberay import KubeRayStandIn, write_kubeconfig  # noqa: E402

from hybridflow_operator.cluster import ApiCluster  # noqa: E402
from hybridflow_operator.main import OperatorConfig, register  # noqa: E402
from kube.harness import EmulatedCluster, operator_registry  # noqa: E402

RAYJOB_CRD = ROOT.parent / "shared" / "kuberay" / "ray.io_rayjobs.yaml"
NAMESPACE = "default"


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
    root: Path


@pytest.fixture
def e2e(tmp_path: Path) -> Iterator[E2E]:
    with EmulatedCluster() as cluster:
        cluster.emulator.register_crd(
            yaml.safe_load((ROOT / "crds" / "hybridflow.io_rlhfjobs.yaml").read_text())
        )
        cluster.emulator.register_crd(rayjob_crd())
        registry = operator_registry()
        config = OperatorConfig(
            {"HYBRIDFLOW_RECONCILE_INTERVAL_SECONDS": "1", "HYBRIDFLOW_RUNTIME_IMAGE": "img:e2e"}
        )
        register(registry, config=config, cluster=ApiCluster(cluster.api_client), serve_metrics=False)
        kubeconfig = write_kubeconfig(cluster.kubeconfig(NAMESPACE), tmp_path / "kubeconfig")
        with (
            cluster.run_operator(registry),
            KubeRayStandIn(cluster.api_client, kubeconfig, tmp_path) as kuberay,
        ):
            yield E2E(cluster, kuberay, tmp_path)
