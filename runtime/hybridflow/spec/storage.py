"""``spec.volumes`` and ``spec.checkpoint``: persistent storage the job reads from and writes to.

Checkpoints are what makes a failed pod survivable: the operator recreates the run and the
controller resumes from the newest checkpoint it finds. Without a checkpoint volume a cluster
run keeps its checkpoints on the head pod's disk and loses them with the pod.
"""

from __future__ import annotations

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
