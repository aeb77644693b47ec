"""What a job may change of its containers' security context: an allow-list, not a pass-through.

Whoever may create an RLHFJob gets pods made for them by the operator's ServiceAccount, so the
spec must not be a way around the namespace's pod policy: a security context copied verbatim
would make RLHFJob create as strong as privileged pod create. So the override has exactly the
fields below, each limited to what Pod Security "restricted" (and the RDMA/NUMA needs of GPU
jobs) allows, and the API server enforces it at admission (the CRD's schema and CEL):

* no ``privileged``, no ``allowPrivilegeEscalation`` (only ``false`` is accepted), no uid 0 and no
  ``runAsNonRoot: false``;
* ``capabilities.add`` only from an allow-list: :data:`DEFAULT_ALLOWED_CAPABILITIES` unless the
  operator's chart widens it (``podSecurity.allowedCapabilities``, rendered into the CRD's rule);
* seccomp and AppArmor profiles only ``RuntimeDefault`` or ``Localhost`` (not ``Unconfined``),
  SELinux only the container types Pod Security "baseline" admits, and no SELinux user or role.

Tolerations, affinity and node selectors stay free (they choose nodes, not privileges): a user
who may create RLHFJobs can place pods on any node those allow, as with pod create itself.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, StringConstraints

from hybridflow.spec.base import SpecModel

DEFAULT_ALLOWED_CAPABILITIES: tuple[str, ...] = ("IPC_LOCK", "SYS_NICE")
"""``IPC_LOCK`` lets RDMA (InfiniBand, RoCE, EFA) pin memory; ``SYS_NICE`` lets NCCL and numactl
bind memory and CPUs to the GPU's NUMA node. Everything else needs the chart's value."""
CAPABILITY_PATTERN = r"^[A-Z][A-Z_]*$"
CapabilityName = Annotated[str, StringConstraints(pattern=CAPABILITY_PATTERN, max_length=64)]
"""Enforced here as in the CRD (a pattern only in the JSON schema let 'default' through locally)."""
SELINUX_TYPES = ("container_t", "container_init_t", "container_kvm_t", "container_engine_t")
"""The SELinux types Pod Security "baseline" admits."""


class Capabilities(SpecModel):
    """Linux capabilities: the restricted default drops all; ``add`` only from the allow-list."""

    add: tuple[CapabilityName, ...] = Field(
        default=(),
        max_length=16,
        description=(
            "Capabilities to add, only from the operator's allow-list (by default IPC_LOCK and SYS_NICE; "
            "the chart's podSecurity.allowedCapabilities widens it)."
        ),
    )
    drop: tuple[CapabilityName, ...] = Field(
        default=("ALL",),
        max_length=64,
        description="Capabilities to drop (default ALL, as Pod Security restricted requires).",
    )


class ProfileRef(SpecModel):
    """A seccomp or AppArmor profile: the runtime's default, or one loaded on the node."""

    type: Literal["RuntimeDefault", "Localhost"] = Field(
        description="RuntimeDefault or Localhost (never Unconfined)."
    )
    localhost_profile: str | None = Field(
        default=None, max_length=4096, description="With type Localhost: the profile's name on the node."
    )


class SELinuxOptions(SpecModel):
    """SELinux labels, limited to the container types Pod Security baseline admits."""

    type: Literal["container_t", "container_init_t", "container_kvm_t", "container_engine_t"] | None = Field(
        default=None, description="SELinux type of the container."
    )
    level: str | None = Field(
        default=None, max_length=256, description="SELinux level (MCS), e.g. s0:c123,c456."
    )


class ContainerSecurityOverride(SpecModel):
    """Keys merged over a container's restricted security context; each limited (module docstring)."""

    capabilities: Capabilities | None = Field(
        default=None, description="Capabilities (replaces the default, which drops ALL and adds none)."
    )
    run_as_user: int | None = Field(default=None, ge=1, description="uid of the container (never 0).")
    run_as_group: int | None = Field(default=None, ge=0, description="Primary gid of the container.")
    run_as_non_root: Literal[True] | None = Field(default=None, description="Only true is accepted.")
    read_only_root_filesystem: bool | None = Field(
        default=None, description="Mount the image read-only (HOME and /tmp stay writable emptyDirs)."
    )
    allow_privilege_escalation: Literal[False] | None = Field(
        default=None, description="Only false is accepted: no setuid or file capabilities gain privileges."
    )
    privileged: Literal[False] | None = Field(default=None, description="Only false is accepted.")
    seccomp_profile: ProfileRef | None = Field(default=None, description="The seccomp profile.")
    app_armor_profile: ProfileRef | None = Field(default=None, description="The AppArmor profile.")
    se_linux_options: SELinuxOptions | None = Field(default=None, description="SELinux labels.")
