"""``spec.pods``: what the job's pods carry besides the workload: env from Secrets, pull secrets,
priority, metadata and the security-context overrides. Cluster only; ``hybridflow run`` ignores it.

Secrets travel by reference only: ``env[].valueFrom.secretKeyRef`` and ``envFrom[].secretRef``
name a Secret (and a key) that the kubelet reads when it starts the pod. The operator never
reads a Secret, so no secret value can reach the ConfigMap, the status, an Event or a log.

Security. Every container the operator generates (the head, each pool's workers, KubeRay's
submitter) runs under Pod Security "restricted" by default: non-root (uid/gid 10001, the runtime
image's user), no
privilege escalation, every capability dropped, the runtime's default seccomp profile. A pool
that needs more (RDMA wants ``IPC_LOCK``, some fabrics a privileged device plugin) overrides its
workers' container security context with ``resourcePools[].containerSecurityContext``, and
``spec.pods.headContainerSecurityContext`` does the same for the head; each is merged over the
restricted default key by key, so the namespace must then admit that pod (PSS "baseline" or
"privileged"). The overrides are an allow-list (``hybridflow.spec.security``): creating an
RLHFJob must not be a way to create privileged pods.
"""

from __future__ import annotations

from pydantic import Field

from hybridflow.spec.base import SpecModel
from hybridflow.spec.security import ContainerSecurityOverride

ENV_NAME_PATTERN = r"^[-._a-zA-Z][-._a-zA-Z0-9]*$"
DNS_SUBDOMAIN_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"


class SecretKeyRef(SpecModel):
    """One key of a Secret in the job's namespace."""

    name: str = Field(pattern=DNS_SUBDOMAIN_PATTERN, max_length=253, description="Name of the Secret.")
    key: str = Field(min_length=1, max_length=253, description="Key within the Secret.")
    optional: bool = Field(default=False, description="Start the pod even when the Secret or key is missing.")


class EnvVarSource(SpecModel):
    """Where an environment variable's value comes from: a Secret key, by reference."""

    secret_key_ref: SecretKeyRef = Field(description="The Secret key whose value the variable gets.")


class EnvVar(SpecModel):
    """An environment variable of every container: a plain value, or a Secret key by reference."""

    name: str = Field(pattern=ENV_NAME_PATTERN, max_length=256, description="Variable name.")
    value: str | None = Field(
        default=None,
        max_length=32768,
        description="A plain value (not for secrets: it is stored in the spec).",
    )
    value_from: EnvVarSource | None = Field(
        default=None,
        description="Take the value from a Secret key (read by the kubelet, never by the operator).",
    )


class SecretRef(SpecModel):
    """A whole Secret, every key becoming a variable."""

    name: str = Field(pattern=DNS_SUBDOMAIN_PATTERN, max_length=253, description="Name of the Secret.")
    optional: bool = Field(default=False, description="Start the pod even when the Secret is missing.")


class EnvFromSource(SpecModel):
    """Every key of a Secret as an environment variable, optionally prefixed."""

    secret_ref: SecretRef = Field(description="The Secret whose keys become variables.")
    prefix: str | None = Field(
        default=None, max_length=256, description="Prefix added to each variable name."
    )


class PodsSpec(SpecModel):
    """Pod settings shared by the head, the workers and the submitter. Cluster only."""

    env: tuple[EnvVar, ...] = Field(
        default=(),
        max_length=128,
        description="Environment variables of every container (Secrets by reference).",
    )
    env_from: tuple[EnvFromSource, ...] = Field(
        default=(),
        max_length=16,
        description="Secrets whose keys become environment variables of every container.",
    )
    image_pull_secrets: tuple[str, ...] = Field(
        default=(), max_length=16, description="Names of docker-registry Secrets used to pull the image."
    )
    priority_class_name: str | None = Field(
        default=None,
        pattern=DNS_SUBDOMAIN_PATTERN,
        max_length=253,
        description="PriorityClass of every pod (preemption order under contention).",
    )
    annotations: dict[str, str] = Field(
        default_factory=dict, description="Annotations added to every pod (the operator's own keys win)."
    )
    labels: dict[str, str] = Field(
        default_factory=dict, description="Labels added to every pod (the operator's own labels win)."
    )
    head_container_security_context: ContainerSecurityOverride = Field(
        default_factory=ContainerSecurityOverride,
        description=(
            "Keys merged over the head container's restricted security context, from an allow-list "
            "(no privileged, no privilege escalation, no uid 0, capabilities from the operator's list)."
        ),
    )
