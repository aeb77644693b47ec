"""Print the requirements an image installs before its source, one per line, from pyproject.toml.

The images install their dependencies in a layer of their own, before the project's source is
copied in, so that a code change rebuilds only the last layer. That layer needs the list without
the source: this script reads it from ``pyproject.toml`` with the standard library only (it runs
inside the build, on the base image's Python 3.11+, before anything is installed).

    python3 images/requirements.py base   # the operator image: the base dependencies
    python3 images/requirements.py cpu    # the runtime image's CPU flavour: base + the cpu and pod extras
    python3 images/requirements.py gpu    # its GPU flavour: base + the gpu and pod extras

``setuptools`` (the build backend, from ``[build-system]``) is listed too: the source layer
installs the project with ``--no-build-isolation --no-deps``, offline.
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

FLAVOURS = ("base", "cpu", "gpu")


def requirements(pyproject: dict, flavour: str) -> list[str]:
    """The project's base dependencies, the flavour's extras (none for ``base``; ``pod``, Ray's
    dashboard and agent, for both runtime flavours) and the build backend."""
    if flavour not in FLAVOURS:
        raise ValueError(f"flavour {flavour!r}: expected one of {', '.join(FLAVOURS)}")
    project = pyproject["project"]
    extras = project["optional-dependencies"]
    extra = [] if flavour == "base" else [*extras[flavour], *extras["pod"]]
    return [*project["dependencies"], *extra, *pyproject["build-system"]["requires"]]


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[1] not in FLAVOURS:
        print(f"usage: {argv[0]} {{{'|'.join(FLAVOURS)}}} [run from the project root]", file=sys.stderr)
        return 2
    pyproject = tomllib.loads(Path("pyproject.toml").read_text(encoding="utf-8"))
    print("\n".join(requirements(pyproject, argv[1])))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
