"""Architecture as a test: the import rules of ../shared/DESIGN.md.

* No importable top-level ``operator`` module or package at the repository root (it would
  shadow the standard library's ``operator`` and break kopf, kubernetes and pytest).
* ``hybridflow_operator`` never imports torch, ray or vllm (the operator image has none).
* ``hybridflow`` never imports kopf; ``hybridflow.spec`` imports neither side's stack.

Each rule is checked twice: statically over every source file (catches imports on code paths
a plain import does not reach) and dynamically in a fresh interpreter.
"""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
RUNTIME = ROOT / "runtime" / "hybridflow"
OPERATOR = ROOT / "operator" / "hybridflow_operator"


def imported_top_level_modules(package_dir: Path) -> dict[str, set[str]]:
    """Top-level module names imported by each file (relative imports excluded)."""
    found: dict[str, set[str]] = {}
    for path in sorted(package_dir.rglob("*.py")):
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
        found[str(path.relative_to(ROOT))] = names
    return found


def offenders(package_dir: Path, forbidden: set[str]) -> dict[str, set[str]]:
    return {
        file: names & forbidden
        for file, names in imported_top_level_modules(package_dir).items()
        if names & forbidden
    }


def test_no_top_level_operator_module_at_the_repository_root() -> None:
    assert not (ROOT / "operator" / "__init__.py").exists()
    assert not (ROOT / "operator.py").exists()
    probe = "import operator, sys; print(operator.__file__ if hasattr(operator, '__file__') else 'builtin')"
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True)
    assert str(ROOT / "operator") not in out.stdout


def test_operator_sources_do_not_import_the_ml_stack() -> None:
    assert offenders(OPERATOR, {"torch", "ray", "vllm", "megatron", "transformers"}) == {}


def test_operator_uses_only_the_shared_spec_from_the_runtime() -> None:
    """The operator may import ``hybridflow.spec`` (pydantic only) and nothing else from the runtime."""
    for path in sorted(OPERATOR.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("hybridflow."):
                assert node.module.startswith("hybridflow.spec"), f"{path}: imports {node.module}"
            if isinstance(node, ast.Import):
                for alias in node.names:
                    assert not alias.name.startswith("hybridflow.") or alias.name.startswith(
                        "hybridflow.spec"
                    ), path


def test_runtime_sources_do_not_import_kopf() -> None:
    assert offenders(RUNTIME, {"kopf", "hybridflow_operator"}) == {}


def _modules_loaded_by(import_line: str) -> set[str]:
    code = f"import sys; {import_line}; print('\\n'.join(sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], cwd="/", capture_output=True, text=True, check=True)
    return {name.split(".")[0] for name in out.stdout.split()}


def test_importing_every_operator_module_loads_no_ml_stack() -> None:
    modules = sorted(
        ".".join(p.relative_to(ROOT / "operator").with_suffix("").parts).removesuffix(".__init__")
        for p in OPERATOR.rglob("*.py")
        if p.name != "__main__.py"  # runs the operator
    )
    loaded = _modules_loaded_by("; ".join(f"import {m}" for m in modules))
    assert not loaded & {"torch", "ray", "vllm", "megatron", "transformers"}


def test_importing_the_runtime_loads_no_kopf() -> None:
    modules = sorted(
        ".".join(p.relative_to(ROOT / "runtime").with_suffix("").parts).removesuffix(".__init__")
        for p in RUNTIME.rglob("*.py")
        if p.name != "__main__.py"
    )
    loaded = _modules_loaded_by("; ".join(f"import {m}" for m in modules))
    assert "hybridflow" in loaded
    assert not loaded & {"kopf", "hybridflow_operator"}
