"""Architecture as a test: the import rules of ../shared/DESIGN.md.

* No importable top-level ``operator`` module or package at the repository root (it would
  shadow the standard library's ``operator`` and break kopf, kubernetes and pytest).
* ``hybridflow_operator`` never imports torch, ray or vllm (the operator image has none).
* ``hybridflow`` never imports kopf; ``hybridflow.spec`` imports neither side's stack.
* The runtime's layers point one way (``RUNTIME_LAYERS``, lowest first): a module imports only
  modules of its own layer or below; the torch-only layers (everything below the controller)
  never load Ray; the backends do not import each other.

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


# --------------------------------------------------------------------------- the runtime's layers

RUNTIME_LAYERS: tuple[tuple[str, ...], ...] = (
    ("hybridflow.spec",),
    # leaves: pure math, topology, rules, data and files; no Ray, no workers
    (
        "hybridflow.mesh",
        "hybridflow.host",
        "hybridflow.devices",
        "hybridflow.rlmath",
        "hybridflow.rewards",
        "hybridflow.rewards.rules",
        "hybridflow.rewards.parallel",
        "hybridflow.models",
        "hybridflow.data",
        "hybridflow.metrics",
        "hybridflow.checkpoint",
        "hybridflow.compilation",
        "hybridflow.plugins",
    ),
    # torch-only SPMD code a worker process calls; no Ray
    ("hybridflow.backends", "hybridflow.engines", "hybridflow.resharding", "hybridflow.export"),
    ("hybridflow.controller",),
    ("hybridflow.workers", "hybridflow.rewards.scorer"),
    # the worker API an algorithm sees (algorithms.api) and the algorithms over it
    ("hybridflow.algorithms",),
    ("hybridflow.trainer", "hybridflow.incluster", "hybridflow.cli", "hybridflow"),
)
RAY_FREE_LAYERS = 3  # the layers below the controller
BACKENDS = ("hybridflow.backends.fsdp", "hybridflow.backends.megatron")


def _module_name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT / "runtime").with_suffix("").parts).removesuffix(".__init__")


def _layer_of(module: str) -> int:
    """The layer of the longest prefix of ``module`` that ``RUNTIME_LAYERS`` names."""
    best, best_len = -1, -1
    for index, prefixes in enumerate(RUNTIME_LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = index, len(prefix)
    if best < 0:
        raise AssertionError(f"{module} is in no layer of RUNTIME_LAYERS; add it where it belongs")
    return best


def _runtime_imports() -> dict[str, set[str]]:
    """Each runtime module -> the ``hybridflow.*`` modules it imports (anywhere in the file)."""
    found: dict[str, set[str]] = {}
    for path in sorted(RUNTIME.rglob("*.py")):
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module)
                names.update(f"{node.module}.{alias.name}" for alias in node.names)
            elif isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
        found[_module_name(path)] = {n for n in names if n.startswith("hybridflow.")}
    return found


def _resolvable(name: str) -> str:
    """``from pkg import name`` may name a module or an attribute; keep the longest existing module path."""
    parts = name.split(".")
    while parts:
        candidate = ROOT / "runtime" / Path(*parts)
        if candidate.with_suffix(".py").exists() or (candidate / "__init__.py").exists():
            return ".".join(parts)
        parts.pop()
    return name


def test_runtime_layers_point_one_way() -> None:
    upward = sorted(
        f"{module} (layer {_layer_of(module)}) imports {target} (layer {_layer_of(target)})"
        for module, targets in _runtime_imports().items()
        for target in {_resolvable(t) for t in targets}
        if _layer_of(target) > _layer_of(module)
    )
    assert upward == []


def test_backends_do_not_import_each_other() -> None:
    crossing = sorted(
        f"{module} imports {target}"
        for module, targets in _runtime_imports().items()
        for target in targets
        for own in BACKENDS
        for other in BACKENDS
        if own != other and module.startswith(own) and target.startswith(other)
    )
    assert crossing == []


def test_torch_only_layers_do_not_import_ray() -> None:
    ray_free = {
        module: names & {"ray"}
        for module, names in (
            (_module_name(p), imported) for p, imported in _top_level_imports_by_path().items()
        )
        if _layer_of(module) < RAY_FREE_LAYERS and names & {"ray"}
    }
    assert ray_free == {}


def _top_level_imports_by_path() -> dict[Path, set[str]]:
    return {ROOT / file: names for file, names in imported_top_level_modules(RUNTIME).items()}


def test_importing_the_torch_only_layers_loads_no_ray() -> None:
    """Dynamically too: a package ``__init__`` on the way (``hybridflow.controller``'s loads Ray) would show here."""
    modules = sorted(
        _module_name(p)
        for p in RUNTIME.rglob("*.py")
        if _layer_of(_module_name(p)) < RAY_FREE_LAYERS
        and not _module_name(p).startswith(("hybridflow.backends.megatron", "hybridflow.engines.vllm_engine"))
    )
    loaded = _modules_loaded_by("; ".join(f"import {m}" for m in modules))
    assert "torch" in loaded
    assert "ray" not in loaded
