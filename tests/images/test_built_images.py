"""What a pod relies on in each built image, checked by running the image.

The operator's pods (helm/hybridflow/templates/deployment.yaml) and the RayJob's pods
(hybridflow_operator/builders/rayjob.py) assume: the user and group 10001 the Dockerfiles create,
a writable HOME and caches, the binaries KubeRay's probes exec, the entrypoints on the PATH, and
nothing of the build (the pip CA secret, sources, wheels, compilers in the operator) left behind.
"""

from __future__ import annotations

import socket
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from containers import Containers

from hybridflow_operator.builders.rayjob import HOME_DIR, RUN_AS_USER
from kube.kuberay_pods import probe_command

ROOT = Path(__file__).resolve().parents[2]
RAYJOB_CRD = ROOT.parent / "shared" / "kuberay" / "ray.io_rayjobs.yaml"
USER = f"{RUN_AS_USER}:{RUN_AS_USER}"
POD_OPTIONS = ("--user", USER, "--cap-drop", "ALL", "--security-opt", "no-new-privileges")
"""What every pod's securityContext sets: the uid and gid, no capabilities, no privilege escalation."""
RAY_AGENT_PORT = 52365
"""KubeRay's default (utils/constant.go ``DefaultDashboardAgentListenPort``)."""


HEAD_WGET_PROBE = probe_command(head=True, params={})[2]
"""The head's exec probe of KubeRay 1.5 (and 1.6+ below Ray 2.53), as ``kube.kuberay_pods`` builds it."""


@pytest.mark.parametrize("image", ["operator", "runtime-cpu"])
def test_the_image_runs_as_the_user_the_pods_name(containers: Containers, image: str) -> None:
    result = containers.run(image, "sh", "-c", "id -u; id -g")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [str(RUN_AS_USER), str(RUN_AS_USER)]


def test_runtime_home_and_the_caches_are_writable_as_the_pods_user(
    containers: Containers, tmp_path: Path
) -> None:
    """HOME is the builders' HOME_DIR, and Hugging Face, torch, Triton, vLLM and Ray can write there
    and to /tmp, with or without the emptyDirs the pods mount over HOME and /tmp (an emptyDir is a
    fresh directory of mode 0777 owned by root)."""
    empty_dirs = []
    for name in ("home", "tmp"):
        (tmp_path / name).mkdir()
        (tmp_path / name).chmod(0o777)
        empty_dirs.append(tmp_path / name)
    script = (
        "import os, pathlib, tempfile; home = pathlib.Path.home(); print(home)\n"
        "for d in ['.cache/huggingface', '.cache/torch', '.triton', '.cache/vllm', '.config']:\n"
        "    p = home / d; p.mkdir(parents=True, exist_ok=True); (p / 'probe').write_text('x')\n"
        "pathlib.Path(tempfile.mkdtemp(prefix='ray-')).joinpath('probe').write_text('x')\n"
        "print('ok')"
    )
    for mounts in ((), ("-v", f"{empty_dirs[0]}:{HOME_DIR}", "-v", f"{empty_dirs[1]}:/tmp")):
        result = containers.run("runtime-cpu", "python", "-c", script, options=(*POD_OPTIONS, *mounts))
        assert result.returncode == 0, result.stderr
        assert result.stdout.split() == [HOME_DIR, "ok"], result.stdout


def test_runtime_imports_its_stack_and_answers_its_entrypoints(containers: Containers) -> None:
    imports = containers.run(
        "runtime-cpu",
        "python",
        "-c",
        "import torch, vllm, megatron.core, ray, hybridflow; print(torch.__version__, ray.__version__)",
        options=POD_OPTIONS,
    )
    assert imports.returncode == 0, imports.stderr
    assert imports.stdout.split()[0].endswith("+cpu"), imports.stdout
    for command in (["hybridflow", "--help"], ["hybridflow", "stop", "--help"], ["ray", "--version"]):
        result = containers.run("runtime-cpu", *command, options=POD_OPTIONS)
        assert result.returncode == 0, (command, result.stderr)


@pytest.fixture
def ray_head(containers: Containers) -> Iterator[str]:
    """A Ray head started as KubeRay starts it (``ray start --head --block``, dashboard on all
    interfaces), as the pods' user, on its own loopback (``--network=none``)."""
    name = containers.start(
        "runtime-cpu",
        "ray", "start", "--head", "--block", "--dashboard-host=0.0.0.0", "--num-cpus=1",
        "--disable-usage-stats",
        options=(*POD_OPTIONS, "--network=none", "--shm-size=512m", "-e", "RAY_AUTH_MODE=disabled"),
    )  # fmt: skip
    try:
        yield name
    finally:
        containers.remove(name)


def test_kuberays_probes_pass_once_the_head_is_up(containers: Containers, ray_head: str) -> None:
    """KubeRay 1.5 (and 1.6+ below Ray 2.53) execs ``bash -c "wget ... | grep success"``; 1.6+ for
    Ray 2.53+ sends an HTTP GET to the dashboard agent's ``/api/healthz``. Both need bash, wget,
    grep and Ray's dashboard and agent (``ray[default]``) in the image."""
    deadline, result = time.monotonic() + 90, None
    while time.monotonic() < deadline:
        result = containers.exec(ray_head, "bash", "-c", HEAD_WGET_PROBE)
        if result.returncode == 0:
            break
        time.sleep(2)
    assert result is not None and result.returncode == 0, (
        result.stdout + result.stderr if result else "",
        containers.engine.run("logs", ray_head, capture=True).stderr[-2000:],
    )
    http = containers.exec(
        ray_head,
        "python",
        "-c",
        f"import urllib.request; print(urllib.request.urlopen('http://localhost:{RAY_AGENT_PORT}/api/healthz', timeout=5).status)",
    )
    assert http.stdout.strip() == "200", http.stderr


def test_nothing_of_the_build_is_left(containers: Containers) -> None:
    """No pip CA secret, sources, wheels or pip caches in either image; no compiler, setuptools or
    ML stack in the operator's (the runtime keeps gcc: Triton and torch.compile build at run time)."""
    leftovers = (
        "find / -xdev \\( -name pip-ca -o -path /src -o -path /wheels -o -path '*/.cache/pip' \\) -print"
    )
    for image in ("operator", "runtime-cpu"):
        found = containers.run(image, "sh", "-c", leftovers, options=("--user", "0"))
        assert found.stdout.split() == [], (image, found.stdout)
    absent = containers.run(
        "operator",
        "sh",
        "-c",
        "for b in gcc cc make g++; do command -v $b; done; python -c "
        "\"import importlib.util as u; print([m for m in ('setuptools', 'torch', 'ray', 'vllm') if u.find_spec(m)])\"",
    )
    assert absent.returncode == 0 and absent.stdout.split() == ["[]"], absent.stdout + absent.stderr
    needed = containers.run("runtime-cpu", "sh", "-c", "for b in gcc bash wget grep; do command -v $b; done")
    assert len(needed.stdout.split()) == 4, needed.stdout


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_the_operator_image_answers_readyz_against_the_api_server(
    containers: Containers, tmp_path: Path
) -> None:
    """``python -m hybridflow_operator`` from the image, as the chart's Deployment runs it (read-only
    root, /tmp an emptyDir, uid 10001, the chart's RBAC), lists its caches and answers /readyz."""
    from kube.chart_rbac import install_chart_rbac
    from kube.harness import EmulatedCluster

    with EmulatedCluster() as cluster:
        for crd in (ROOT / "crds" / "hybridflow.io_rlhfjobs.yaml", RAYJOB_CRD):
            cluster.emulator.register_crd(yaml.safe_load(crd.read_text()))
        account = install_chart_rbac(
            cluster, release_namespace="hybridflow-system", watched=["research"], scratch=tmp_path
        )
        cluster.emulator.identities["operator-token"] = account
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(yaml.safe_dump(cluster.kubeconfig_with_token("operator-token", "research")))
        kubeconfig.chmod(0o644)
        health, metrics = _free_port(), _free_port()
        name = containers.start(
            "operator",
            options=(
                *POD_OPTIONS, "--network=host", "--read-only", "--tmpfs", "/tmp",
                "-v", f"{kubeconfig}:/etc/hybridflow/kubeconfig:ro", "-e", "KUBECONFIG=/etc/hybridflow/kubeconfig",
                "-e", "WATCH_NAMESPACES=research", "-e", "POD_NAMESPACE=hybridflow-system",
                "-e", f"HYBRIDFLOW_OPERATOR_HEALTH_PORT={health}", "-e", f"HYBRIDFLOW_OPERATOR_METRICS_PORT={metrics}",
                "-e", "HYBRIDFLOW_RUNTIME_IMAGE=hybridflow-runtime:0.1.0",
            ),
        )  # fmt: skip
        try:
            status = _wait_ready(f"http://127.0.0.1:{health}/readyz", timeout_seconds=90)
            logs = containers.engine.run("logs", name, capture=True)
            assert status == 200, logs.stdout[-2000:] + logs.stderr[-2000:]
            scraped = urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics", timeout=5).read().decode()
            assert "hybridflow_operator" in scraped, scraped[:500]
        finally:
            containers.remove(name)


def _wait_ready(url: str, *, timeout_seconds: float) -> int:
    deadline, status = time.monotonic() + timeout_seconds, 0
    while time.monotonic() < deadline:
        try:
            status = urllib.request.urlopen(url, timeout=2).status
        except OSError:
            status = 0
        if status == 200:
            return status
        time.sleep(1)
    return status
