"""A job's exports: written, checked by the parity gate, then listed as artifacts (``spec.checkpoint.export``).

Protocol (the trainer's runner drives it after a step's checkpoint; the actor's rank 0 runs
:func:`export_checked`, every actor rank having gathered the full weights and scored the
probes with the trainer's own forward pass):

1. :func:`~hybridflow.export.hf.export_hf` writes ``<exports>/step-<N>`` atomically, with its
   sha256 manifest, the tokenizer and the config.
2. :func:`~hybridflow.export.parity.check_export_parity` re-hashes it, loads it with
   transformers (the base plus the adapter for an adapter export) and compares its log-probs
   on the probes with the trainer's.
3. Passed: the export is an :class:`Artifact`, appended to ``<exports>/artifacts.json`` (the
   list survives restarts: a resumed attempt reads it back), which the runner reports as
   ``status.artifacts``. Refused: the directory is renamed ``step-<N>.rejected`` (kept for a
   post-mortem, never listed) and the report says by how much and where.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from hybridflow.export.hf import MANIFEST_FILE, ExportDtype, ExportKind, export_hf
from hybridflow.export.parity import ExportParityError, ParityReport, check_export_parity
from hybridflow.models.lora import LoRAConfig

__all__ = [
    "ARTIFACTS_FILE",
    "EXPORTS_DIRECTORY",
    "STATUS_ARTIFACTS",
    "Artifact",
    "ExportOutcome",
    "export_checked",
    "export_directory",
    "read_artifacts",
    "record_artifact",
]

EXPORTS_DIRECTORY = "exports"
"""Beside the checkpoints (``spec.checkpoint_dir``): on the checkpoint volume in a cluster."""

ARTIFACTS_FILE = "artifacts.json"

STATUS_ARTIFACTS = 100
"""The newest exports ``status.artifacts`` lists (every export stays in :data:`ARTIFACTS_FILE`): a
status is one object the API server caps in size, and a job exporting every few steps for days
would outgrow it."""


@dataclass(frozen=True)
class Artifact:
    """One published export, as ``status.artifacts`` lists it (camelCase there)."""

    step: int
    kind: str
    path: str
    manifest_sha256: str
    """sha256 of the export's manifest, which lists every file's own sha256: one value that pins them all."""
    parity_max_abs_diff: float

    def status(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "kind": self.kind,
            "path": self.path,
            "manifestSha256": self.manifest_sha256,
            "parityMaxAbsDiff": round(self.parity_max_abs_diff, 6),
        }


@dataclass(frozen=True)
class ExportOutcome:
    """What one export came to: the artifact when it passed, and the gate's report either way."""

    artifact: Artifact | None
    report: ParityReport
    directory: str


def export_directory(checkpoint_dir: str | os.PathLike[str], step: int) -> Path:
    return Path(checkpoint_dir) / EXPORTS_DIRECTORY / f"step-{step}"


def _sha256(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


def export_checked(
    state_dict: Mapping[str, torch.Tensor],
    directory: Path,
    *,
    step: int,
    kind: ExportKind,
    dtype: ExportDtype,
    source_model_dir: str,
    tokenizer_dir: str,
    lora: LoRAConfig | None,
    probes: Sequence[Sequence[int]],
    trainer_log_probs: Sequence[torch.Tensor],
    tolerance: float,
) -> ExportOutcome:
    """Steps 1 and 2 of the protocol on rank 0; a refused export is moved aside (``.rejected``)."""
    export_hf(
        state_dict,
        directory,
        step=step,
        kind=kind,
        source_model_dir=source_model_dir,
        tokenizer_dir=tokenizer_dir,
        dtype=dtype,
        lora=lora,
    )
    try:
        report = check_export_parity(
            directory,
            probes,
            trainer_log_probs,
            tolerance=tolerance,
            base_model_dir=source_model_dir if kind == "adapter" else None,
        )
    except ExportParityError as refused:
        rejected = directory.with_name(directory.name + ".rejected")
        shutil.rmtree(rejected, ignore_errors=True)
        directory.rename(rejected)
        return ExportOutcome(None, refused.report, str(rejected))
    artifact = Artifact(
        step=step,
        kind=kind,
        path=str(directory),
        manifest_sha256=_sha256(directory / MANIFEST_FILE),
        parity_max_abs_diff=report.max_abs_diff,
    )
    return ExportOutcome(artifact, report, str(directory))


def read_artifacts(checkpoint_dir: str | os.PathLike[str]) -> list[Artifact]:
    """The artifacts recorded so far (a fresh job: none); an unreadable file is an error naming it."""
    path = Path(checkpoint_dir) / EXPORTS_DIRECTORY / ARTIFACTS_FILE
    if not path.exists():
        return []
    try:
        return [Artifact(**entry) for entry in json.loads(path.read_text())]
    except (ValueError, TypeError) as error:
        raise ValueError(
            f"{path}: not a list of export artifacts ({error}); remove it to start the list anew"
        ) from error


def record_artifact(checkpoint_dir: str | os.PathLike[str], artifact: Artifact) -> list[Artifact]:
    """Step 3: add ``artifact`` (replacing one of the same step) and rewrite the list atomically; returns it."""
    artifacts = [known for known in read_artifacts(checkpoint_dir) if known.step != artifact.step]
    artifacts = sorted([*artifacts, artifact], key=lambda known: known.step)
    path = Path(checkpoint_dir) / EXPORTS_DIRECTORY / ARTIFACTS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(f".{path.name}.{os.getpid()}")
    staging.write_text(json.dumps([asdict(known) for known in artifacts], indent=1))
    os.replace(staging, path)
    return artifacts
