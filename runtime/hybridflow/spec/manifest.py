"""Reading an RLHFJob manifest: the one edge where untyped YAML becomes a typed ``RLHFJob``.

Two entry points, one per caller:

* ``load_job_manifest(path)`` for ``hybridflow run job.yaml``: reads the file, validates it,
  and resolves relative local paths (models, tokenizers, data, outputDir) against the
  manifest's directory, so a manifest works whatever the current directory is and the Ray
  workers (whose working directory differs) get absolute paths. ``checkpoint.path`` is not
  resolved: it is relative to the checkpoint volume or outputDir by definition.
* ``parse_job_manifest(document, source)`` for data already in memory (the operator's view of
  the object, a ConfigMap's content). It resolves nothing: in a cluster paths are paths
  inside the pods.

Both raise :class:`SpecError` listing every problem, never a pydantic traceback.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import yaml
from pydantic import ValidationError

from hybridflow.spec.errors import SpecError, describe_validation_error
from hybridflow.spec.job import API_VERSION, KIND, RLHFJob
from hybridflow.spec.models import ModelSource

SERVER_OWNED_KEYS = ("status",)
"""Top-level keys of an object read from the API server that belong to the operator, not the spec."""


def load_job_manifest(path: str | os.PathLike[str]) -> RLHFJob:
    """Read, validate and path-resolve the RLHFJob manifest at ``path``."""
    manifest_path = Path(path)
    source = str(manifest_path)
    try:
        text = manifest_path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SpecError(source, ["cannot read the manifest: no such file"]) from None
    except IsADirectoryError:
        raise SpecError(source, ["cannot read the manifest: it is a directory, not a file"]) from None
    except UnicodeDecodeError:
        raise SpecError(source, ["cannot read the manifest: not UTF-8 text"]) from None
    except OSError as error:
        raise SpecError(source, [f"cannot read the manifest: {error.strerror or error}"]) from None
    try:
        document = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise SpecError(source, [f"not valid YAML: {_describe_yaml_error(error)}"]) from None
    job = parse_job_manifest(document, source)
    return resolve_local_paths(job, manifest_path.parent)


def parse_job_manifest(document: object, source: str) -> RLHFJob:
    """Validate manifest data (a mapping, as YAML or the API server gives it) into an ``RLHFJob``.

    ``source`` names where the data came from in every error line. Keys must be the camelCase
    ones of the CRD; the server-owned ``status`` is ignored. A document of another
    apiVersion or kind is reported as such alone, since its field errors would be noise.
    """
    if document is None:
        raise SpecError(source, ["the manifest is empty; expected an RLHFJob mapping"])
    if not isinstance(document, Mapping):
        raise SpecError(
            source, [f"the manifest is a {type(document).__name__}, not a mapping; expected an RLHFJob"]
        )
    identity_problems = [
        f"{key}: required field is missing (expected {expected!r})"
        if key not in document
        else f"{key}: {document[key]!r} is not {expected!r}; this is not an RLHFJob manifest"
        for key, expected in (("apiVersion", API_VERSION), ("kind", KIND))
        if document.get(key) != expected
    ]
    if identity_problems:
        raise SpecError(source, identity_problems)
    spec_data = {key: value for key, value in document.items() if key not in SERVER_OWNED_KEYS}
    try:
        return RLHFJob.model_validate(spec_data, by_alias=True, by_name=False)
    except ValidationError as error:
        raise SpecError(source, describe_validation_error(error, RLHFJob)) from None


def resolve_local_paths(job: RLHFJob, base_dir: str | os.PathLike[str]) -> RLHFJob:
    """A copy of ``job`` whose relative local paths are absolute, taken relative to ``base_dir``.

    Resolved: every model's ``path`` and ``tokenizerPath``, ``data.trainFiles``, ``data.valFiles`` and
    ``outputDir``. ``~`` expands to the home directory. Absolute paths are kept as written.
    """
    base = Path(base_dir).absolute()

    def resolve(path: str) -> str:
        expanded = Path(path).expanduser()
        return str(expanded) if expanded.is_absolute() else os.path.normpath(base / expanded)

    def resolve_model(model: ModelSource | None) -> ModelSource | None:
        if model is None:
            return None
        tokenizer = resolve(model.tokenizer_path) if model.tokenizer_path is not None else None
        return model.model_copy(update={"path": resolve(model.path), "tokenizer_path": tokenizer})

    spec = job.spec
    models = spec.models.model_copy(
        update={role: resolve_model(getattr(spec.models, role)) for role in type(spec.models).model_fields}
    )
    data = spec.data.model_copy(
        update={
            "train_files": tuple(resolve(path) for path in spec.data.train_files),
            "val_files": tuple(resolve(path) for path in spec.data.val_files),
        }
    )
    resolved_spec = spec.model_copy(
        update={"models": models, "data": data, "output_dir": resolve(spec.output_dir)}
    )
    return job.model_copy(update={"spec": resolved_spec})


def _describe_yaml_error(error: yaml.YAMLError) -> str:
    """One line: the problem and where, instead of PyYAML's multi-line excerpt."""
    if isinstance(error, yaml.MarkedYAMLError):
        problem = ", ".join(part for part in (error.context, error.problem) if part) or "syntax error"
        mark = error.problem_mark or error.context_mark
        if mark is not None:
            return f"{problem} (line {mark.line + 1}, column {mark.column + 1})"
        return problem
    return str(error).replace("\n", " ")
