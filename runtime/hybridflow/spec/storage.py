"""``spec.volumes`` and ``spec.checkpoint``: persistent storage the job reads from and writes to.

Checkpoints are what makes a failed pod survivable: the operator recreates the run and the
controller resumes from the newest checkpoint it finds. Without a checkpoint volume a cluster
run keeps its checkpoints on the head pod's disk and loses them with the pod.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from hybridflow.spec.base import SpecModel

DNS_SUBDOMAIN_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
"""RFC 1123 subdomain: the name rule of PersistentVolumeClaims."""

ABSOLUTE_PATH_PATTERN = r"^/.*$"
RELATIVE_PATH_PATTERN = r"^[^/].*$"

DEFAULT_STOP_GRACE_PERIOD_SECONDS = 600
"""Ten minutes: a step of a large model plus a sharded checkpoint save to a network volume. Far
above Kubernetes' 30 s default, which would kill nearly every stop before its checkpoint."""
MIN_STOP_GRACE_PERIOD_SECONDS = 30


class VolumeClaimMount(SpecModel):
    """An existing PersistentVolumeClaim and where it is mounted in every pod of the job."""

    claim_name: str = Field(
        pattern=DNS_SUBDOMAIN_PATTERN,
        max_length=253,
        description="Name of a PersistentVolumeClaim in the RLHFJob's namespace.",
    )
    mount_path: str = Field(
        pattern=ABSOLUTE_PATH_PATTERN,
        max_length=4096,
        description="Absolute path the claim is mounted at in the head and worker pods.",
    )


DEFAULT_PARITY_TOLERANCE = {"float32": 1e-3, "bfloat16": 0.1}
"""Largest absolute log-prob gap (nats) the export's parity gate accepts by default, per saved dtype.
float32: the kernels' rounding alone (measured 0 on Qwen2-0.5B's shapes). bfloat16: rounding every
weight to 8 mantissa bits, measured on Qwen2-0.5B's shapes with every weight moved off the bf16
grid: 0.011 at most, 0.003 on average over 279 probe tokens; a wrong export (a missing or
mis-mapped tensor) is off by whole nats."""


class ExportSpec(SpecModel):
    """Hugging Face exports of the actor, each checked and listed in ``status.artifacts`` (docs/export.md)."""

    kind: Literal["full", "merged", "adapter"] | None = Field(
        default=None,
        description=(
            "'full': the whole model as HF safetensors (training.lora unset). 'merged': the LoRA adapter "
            "folded into the base weights, a plain HF model. 'adapter': the LoRA adapter alone, in PEFT's "
            "format (adapter_config.json, adapter_model.safetensors), for vLLM's --lora-modules or PEFT. "
            "Unset: 'merged' with training.lora, else 'full'."
        ),
    )
    interval_steps: int | None = Field(
        default=None,
        ge=1,
        description="Export every this many steps as well as after the last step; unset: after the last step only.",
    )
    dtype: Literal["bfloat16", "float32"] = Field(
        default="bfloat16",
        description="The dtype of the saved weights: bfloat16 as released checkpoints are, or float32 as trained.",
    )
    parity_tolerance: float | None = Field(
        default=None,
        gt=0,
        description=(
            "The parity gate: the export is loaded with transformers and its log-probs on a fixed probe set "
            "compared with the trainer's; an export off by more than this many nats on any token is refused "
            "(kept aside as <step>.rejected, reported in the log and the metrics, not listed). Unset: 1e-3 "
            "for float32, 0.1 for bfloat16."
        ),
    )

    def resolved_kind(self, lora: bool) -> Literal["full", "merged", "adapter"]:
        if self.kind is not None:
            return self.kind
        return "merged" if lora else "full"

    def tolerance(self) -> float:
        return (
            self.parity_tolerance
            if self.parity_tolerance is not None
            else DEFAULT_PARITY_TOLERANCE[self.dtype]
        )


class CheckpointSpec(SpecModel):
    """When checkpoints are written, how many are kept, and where."""

    interval_steps: int = Field(
        default=50,
        ge=1,
        description="Save a checkpoint every this many steps, and after the last step.",
    )
    keep_last: int = Field(
        default=2,
        ge=1,
        description="Checkpoints kept; older ones are deleted once a newer one is complete.",
    )
    path: str = Field(
        default="checkpoints",
        pattern=RELATIVE_PATH_PATTERN,
        max_length=4096,
        description=(
            "Directory of the checkpoints, relative to volume.mountPath when a volume is set, else to "
            "spec.outputDir."
        ),
    )
    export: ExportSpec | None = Field(
        default=None,
        description=(
            "Write the actor as a Hugging Face model (or LoRA adapter) beside the checkpoints, in "
            "exports/step-<N>, with a sha256 manifest, the tokenizer and the config; each export that passes "
            "its parity gate is listed in status.artifacts. Unset: no export."
        ),
    )
    volume: VolumeClaimMount | None = Field(
        default=None,
        description=(
            "Claim that holds the checkpoints in a cluster, mounted read-write. Shared by all runs of "
            "the job, so a restarted run resumes from it."
        ),
    )
    stop_grace_period_seconds: int = Field(
        default=DEFAULT_STOP_GRACE_PERIOD_SECONDS,
        ge=MIN_STOP_GRACE_PERIOD_SECONDS,
        le=86400,
        description=(
            "Seconds a stopping attempt (suspend, Kueue preemption, deadline, a drained node) has to finish "
            "its current step and save a checkpoint before its pods are killed: the head pod's "
            "terminationGracePeriodSeconds (workers get 30 s more, so they outlive it). Set it to one step "
            "plus one checkpoint save; a stop that takes longer loses the steps since the last checkpoint."
        ),
    )
