"""Hugging Face export of a trained actor: writing with a manifest (:mod:`.hf`), the parity gate (:mod:`.parity`).

The order of use: rank 0 calls :func:`export_hf`, then :func:`verify_export` /
:func:`check_export_parity` decide whether the directory may be published. Nothing here imports
vLLM unless :func:`check_vllm_export_parity` is called.
"""

from hybridflow.export.hf import (
    EXPORT_DTYPES,
    EXPORT_KINDS,
    MANIFEST_FILE,
    ExportDtype,
    ExportKind,
    ExportVerificationError,
    Manifest,
    ManifestFile,
    export_hf,
    verify_export,
)
from hybridflow.export.parity import (
    DEFAULT_PROBE_TEXTS,
    ExportParityError,
    ParityReport,
    build_probe_token_ids,
    check_export_parity,
    check_vllm_export_parity,
    probe_log_probs,
    probe_token_limit,
    vllm_available,
)

__all__ = [
    "DEFAULT_PROBE_TEXTS",
    "EXPORT_DTYPES",
    "EXPORT_KINDS",
    "MANIFEST_FILE",
    "ExportDtype",
    "ExportKind",
    "ExportParityError",
    "ExportVerificationError",
    "Manifest",
    "ManifestFile",
    "ParityReport",
    "build_probe_token_ids",
    "check_export_parity",
    "check_vllm_export_parity",
    "export_hf",
    "probe_log_probs",
    "probe_token_limit",
    "verify_export",
    "vllm_available",
]
