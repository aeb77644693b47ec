"""The exports a job published beside its checkpoints: where they live and the list of those that passed.

Layout under the job's checkpoint directory (``spec.checkpointDir``)::

    exports/
        step-<N>/               an export that passed its parity gate (hybridflow.export.publish)
        step-<N>.rejected/      one the gate refused, kept for a post-mortem, never listed
        artifacts.json          every export that passed, oldest first (:class:`Artifact` objects)

Who reads and writes: the trainer's runner appends to ``artifacts.json`` after each export that
passed (:func:`record_artifact`, atomically) and reads it back on resume; ``hybridflow report``
reads it and the directory names. Only files: no torch, so a report needs no ML stack.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "ARTIFACTS_FILE",
    "EXPORTS_DIRECTORY",
    "REJECTED_SUFFIX",
    "STATUS_ARTIFACTS",
    "Artifact",
    "export_directory",
    "read_artifacts",
    "record_artifact",
    "rejected_directory",
]

EXPORTS_DIRECTORY = "exports"
"""Beside the checkpoints (``spec.checkpoint_dir``): on the checkpoint volume in a cluster."""

ARTIFACTS_FILE = "artifacts.json"

REJECTED_SUFFIX = ".rejected"
"""Added to the name of an export directory the parity gate refused."""

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


def export_directory(checkpoint_dir: str | os.PathLike[str], step: int) -> Path:
    return Path(checkpoint_dir) / EXPORTS_DIRECTORY / f"step-{step}"


def rejected_directory(checkpoint_dir: str | os.PathLike[str], step: int) -> Path:
    """Where the export of ``step`` is kept when its parity gate refused it."""
    directory = export_directory(checkpoint_dir, step)
    return directory.with_name(directory.name + REJECTED_SUFFIX)


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
    """Add ``artifact`` (replacing one of the same step) and rewrite the list atomically; returns it."""
    artifacts = [known for known in read_artifacts(checkpoint_dir) if known.step != artifact.step]
    artifacts = sorted([*artifacts, artifact], key=lambda known: known.step)
    path = Path(checkpoint_dir) / EXPORTS_DIRECTORY / ARTIFACTS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(f".{path.name}.{os.getpid()}")
    staging.write_text(json.dumps([asdict(known) for known in artifacts], indent=1))
    os.replace(staging, path)
    return artifacts
