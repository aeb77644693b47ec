"""No file or package in the repository is named after a standard-library module.

A script puts its own folder first on ``sys.path``, so ``bench/operator.py`` made every script in
``bench/`` (and every process it starts: Ray's agents inherit the path) import it instead of the
standard library's ``operator``; ``make bench`` then failed with Ray's "node timed out during
startup". The same holds for the root, ``e2e/``, ``examples/`` and the test folders on
``sys.path``; inside a package a stdlib name is harmless to imports but confusing to read, so the
rule is simply: nowhere.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
STDLIB = frozenset(sys.stdlib_module_names)


def tracked_python_files() -> list[Path]:
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    if listed.returncode != 0:  # not a git checkout (an sdist): every .py file outside the venv
        return [p.relative_to(ROOT) for p in ROOT.rglob("*.py") if ".venv" not in p.parts]
    return [Path(line) for line in listed.stdout.splitlines() if (ROOT / line).is_file()]


def shadowing_names(paths: list[Path]) -> list[str]:
    """Each module (file stem) or package (a folder with ``__init__.py``) named like a stdlib module.

    A folder without ``__init__.py`` is at most a namespace package, which never wins over a
    module of the same name anywhere on ``sys.path``: the ``operator/`` source root is one
    (``tests/unit/test_architecture.py`` checks that ``import operator`` stays the stdlib's).
    """
    packages = {path.parent for path in paths if path.name == "__init__.py"}
    found: set[str] = set()
    for path in paths:
        if path.stem not in ("__init__", "__main__") and path.stem in STDLIB:
            found.add(str(path))
        found.update(f"{folder}/" for folder in path.parents if folder in packages and folder.name in STDLIB)
    return sorted(found)


def test_no_tracked_module_or_package_shadows_the_standard_library() -> None:
    assert shadowing_names(tracked_python_files()) == []


def test_the_check_finds_a_shadowing_file_in_a_script_folder() -> None:
    paths = [
        Path("bench/operator.py"),
        Path("e2e/types.py"),
        Path("runtime/x/json/__init__.py"),
        Path("runtime/x/json/a.py"),
        Path("operator/pkg/__init__.py"),
        Path("bench/ok.py"),
    ]
    assert shadowing_names(paths) == ["bench/operator.py", "e2e/types.py", "runtime/x/json/"]
