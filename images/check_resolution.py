"""Does the runtime image's pinned Python set resolve for the image's Python and platform?

``make images`` needs a Docker engine, which CI has not, so a pin that no longer resolves (a new
vllm requiring another torch, a wheel yanked, a Python the image does not have) would surface
only on the first machine that builds the image. This asks pip the same question without
building anything: ``pip install --dry-run --report`` for the image's interpreter (its Python
version and ABI, Linux x86_64 manylinux wheels only), reading package metadata only (PEP 658),
for exactly what ``images/runtime/Dockerfile`` installs in its GPU flavour: its torch pin, then
what ``images/requirements.py gpu`` lists (the base dependencies, the ``gpu`` and ``pod`` extras),
under ``constraints/gpu.txt``.

Run by CI (``make images-check``); exits 1 naming what did not resolve, else prints the versions
of the pinned packages and the number of distributions the image would hold.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

from requirements import requirements  # images/requirements.py: this script's folder is on sys.path

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "images" / "runtime" / "Dockerfile"
CONSTRAINTS = ROOT / "constraints" / "gpu.txt"
UBUNTU_PYTHON = {"ubuntu24.04": "3.12", "ubuntu22.04": "3.10"}
"""The distribution's ``python3`` per base image tag (the image installs Ubuntu's Python)."""
MANYLINUX_GLIBC = range(17, 40)
"""glibc 2.17 to 2.39 (Ubuntu 24.04's): manylinux wheels the image can load."""


def image_python(dockerfile: str) -> str:
    """The Python version of the image, from its default base (``ARG BASE=nvidia/cuda:...-ubuntu24.04``)."""
    base = re.search(r"^ARG\s+BASE=\S+?-(ubuntu\d+\.\d+)\s*$", dockerfile, re.M)
    if base is None or base.group(1) not in UBUNTU_PYTHON:
        raise SystemExit(f"{DOCKERFILE}: cannot tell the image's Python from its ARG BASE line")
    return UBUNTU_PYTHON[base.group(1)]


def image_requirements(dockerfile: str) -> list[str]:
    """What the GPU flavour's pip installs ask for: the torch pin, then ``requirements.py gpu``."""
    torch = re.search(r"-c constraints/gpu\.txt (torch==\S+)", dockerfile)
    if torch is None or "images/requirements.py" not in dockerfile:
        raise SystemExit(
            f"{DOCKERFILE}: expected `pip install -c constraints/gpu.txt torch==X` and images/requirements.py"
        )
    return [torch.group(1), *requirements(tomllib.loads((ROOT / "pyproject.toml").read_text()), "gpu")]


def main() -> int:
    dockerfile = DOCKERFILE.read_text()
    python = image_python(dockerfile)
    abi = "cp" + python.replace(".", "")
    platforms = [f"manylinux_2_{v}_x86_64" for v in MANYLINUX_GLIBC] + [
        "manylinux2014_x86_64",
        "linux_x86_64",
    ]
    requirements = image_requirements(dockerfile)
    with tempfile.TemporaryDirectory() as scratch:
        report = Path(scratch) / "report.json"
        command = [
            sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
            "--report", str(report), "--only-binary=:all:", "--python-version", python,
            "--implementation", "cp", "--abi", abi, *(f"--platform={p}" for p in platforms),
            "-c", str(CONSTRAINTS), *requirements,
        ]  # fmt: skip
        result = subprocess.run(command, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            errors = [line for line in result.stderr.splitlines() if line.startswith("ERROR")]
            print(
                f"the runtime image's Python set does not resolve for Python {python} (linux x86_64):",
                file=sys.stderr,
            )
            print("\n".join(errors or result.stderr.splitlines()[-20:]), file=sys.stderr)
            return 1
        installed = json.loads(report.read_text())["install"]
    versions = {item["metadata"]["name"].lower(): item["metadata"]["version"] for item in installed}
    pinned = [line.split("==")[0] for line in CONSTRAINTS.read_text().splitlines() if "==" in line]
    print(
        f"runtime image (Python {python}): {len(installed)} distributions resolve; "
        + ", ".join(f"{name} {versions.get(name, 'missing')}" for name in pinned)
    )
    return 0 if all(name in versions for name in pinned) else 1


if __name__ == "__main__":
    raise SystemExit(main())
