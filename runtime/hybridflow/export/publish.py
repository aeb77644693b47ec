"""A job's exports: written, checked by the parity gate, then listed as artifacts (``spec.checkpoint.export``).

Protocol (the trainer's runner drives it after a step's checkpoint; the actor's rank 0 runs
:func:`export_checked`, every actor rank having gathered the full weights and scored the
probes with the trainer's own forward pass):

1. :func:`~hybridflow.export.hf.export_hf` writes ``<exports>/step-<N>`` atomically, with its
   sha256 manifest, the tokenizer and the config.
2. :func:`~hybridflow.export.parity.check_export_parity` re-hashes it, loads it with
   transformers (the base plus the adapter for an adapter export) and compares its log-probs
   on the probes with the trainer's.
3. Passed: the export is an :class:`~hybridflow.checkpoint.exports.Artifact`, which the runner
   appends to ``<exports>/artifacts.json`` (:mod:`hybridflow.checkpoint.exports`: the list
   survives restarts, a resumed attempt reads it back) and reports as ``status.artifacts``. Refused: the directory is renamed ``step-<N>.rejected`` (kept for a
   post-mortem, never listed) and the report says by how much and where.
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from hybridflow.checkpoint.exports import REJECTED_SUFFIX, Artifact
from hybridflow.export.hf import MANIFEST_FILE, ExportDtype, ExportKind, export_hf
from hybridflow.export.parity import ExportParityError, ParityReport, check_export_parity
from hybridflow.models.lora import LoRAConfig

__all__ = ["ExportOutcome", "export_checked"]


@dataclass(frozen=True)
class ExportOutcome:
    """What one export came to: the artifact when it passed, and the gate's report either way."""

    artifact: Artifact | None
    report: ParityReport
    directory: str


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
        rejected = directory.with_name(directory.name + REJECTED_SUFFIX)
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
