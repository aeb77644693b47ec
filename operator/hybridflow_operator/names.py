"""Deterministic names of an RLHFJob's children, derived from the job's name alone.

Level-triggered reconciliation finds its children by name: the same RLHFJob must always map
to the same ConfigMap, ServiceAccount, Role, RoleBinding, NetworkPolicy and (per attempt) RayJob, with no
lookup table and no ``generateName``. Names are also the only link a person has between a
job and its objects, so they stay readable: ``grpo-tiny`` owns ``grpo-tiny-config``,
``grpo-tiny-controller``, ``grpo-tiny-ray`` and ``grpo-tiny-1`` (attempt 1).

Limits that force shortening:

* RLHFJob names are DNS-1123 subdomains of up to 253 characters (letters, digits, ``-``
  and ``.``; may start with a digit).
* ConfigMaps, ServiceAccounts, Roles, RoleBindings and NetworkPolicies accept DNS-1123 subdomains of up to
  253 characters, so only the suffix can overflow.
* A RayJob name must be a DNS-1035 label (lowercase letters, digits and ``-``; starting with
  a letter) of at most 47 characters: KubeRay's ``MaxRayJobNameLength`` is
  ``MaxRayClusterNameLength`` (53, so that ``<cluster>-serve-svc`` fits in 63) minus the 6
  characters it appends to name the RayCluster (ray-operator/controllers/ray/utils/
  constant.go and validation.go ``ValidateRayJobMetadata``).
* Label values are at most 63 characters.

Whenever a name had to be cut or rewritten, an 8-hex-digit hash of the *full* job name goes
in, so two jobs that differ only past the cut, or only in a character that had to be
replaced (``a.b`` vs ``a-b``), still get different children.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

MAX_OBJECT_NAME_LENGTH = 253
"""DNS-1123 subdomain: ConfigMap, ServiceAccount, Role and RoleBinding names."""
MAX_RAYJOB_NAME_LENGTH = 47
"""KubeRay's ``MaxRayJobNameLength`` (v1.7)."""
MAX_LABEL_VALUE_LENGTH = 63

HASH_LENGTH = 8
_RAYJOB_PREFIX = "rlhf-"
"""Put in front of job names that start with a digit, which a DNS-1035 label may not."""


def name_hash(job_name: str) -> str:
    """Short stable hash of the full job name, used wherever a derived name had to be cut."""
    return hashlib.sha256(job_name.encode("utf-8")).hexdigest()[:HASH_LENGTH]


def _shorten(base: str, suffix: str, limit: int, job_name: str, *, rewritten: bool) -> str:
    """``base + suffix`` if it fits and ``base`` is the job's own name, else a cut base plus the hash.

    The cut never leaves a trailing ``-`` or ``.`` (which would make an invalid label or an
    empty subdomain segment next to the ``-`` that precedes the hash).
    """
    if not rewritten and len(base) + len(suffix) <= limit:
        return base + suffix
    room = limit - len(suffix) - HASH_LENGTH - 1
    head = base[:room].rstrip("-.")
    return f"{head}-{name_hash(job_name)}{suffix}"


@dataclass(frozen=True)
class ChildNames:
    """Names of the children that live as long as the RLHFJob (one of each per job)."""

    config_map: str
    """Holds ``job.yaml``, the runtime config the controller reads."""
    service_account: str
    """Identity of the head pod, where the controller runs and pushes progress."""
    role: str
    """Allows get/patch of this one RLHFJob's status, nothing else."""
    role_binding: str
    network_policy: str
    """Admits to the job's Ray pods only the job's own pods (and KubeRay, and metrics scrapes)."""
    sandbox_network_policy: str
    """Lets the sandbox pods (``spec.agent``) reach the job's own pods and DNS, nothing else."""
    agent_service: str
    """The chat endpoint of ``spec.agent.loop: endpoint`` on the head pod (a DNS-1035 label)."""


def child_names(job_name: str) -> ChildNames:
    """The per-job child names of the RLHFJob ``job_name``."""
    config_map = _shorten(job_name, "-config", MAX_OBJECT_NAME_LENGTH, job_name, rewritten=False)
    controller = _shorten(job_name, "-controller", MAX_OBJECT_NAME_LENGTH, job_name, rewritten=False)
    return ChildNames(
        config_map=config_map,
        service_account=controller,
        role=controller,
        role_binding=controller,
        network_policy=_shorten(job_name, "-ray", MAX_OBJECT_NAME_LENGTH, job_name, rewritten=False),
        sandbox_network_policy=_shorten(
            job_name, "-sandbox", MAX_OBJECT_NAME_LENGTH, job_name, rewritten=False
        ),
        agent_service=_dns_label(job_name, "-agent", MAX_LABEL_VALUE_LENGTH),
    )


def rayjob_name(job_name: str, attempt: int) -> str:
    """The RayJob of ``attempt`` (1, 2, ...): ``<job>-<attempt>``, a DNS-1035 label of <= 47 characters.

    Dots become dashes and a leading digit gets the ``rlhf-`` prefix; both rewrites add the
    hash so that they cannot collide with another job's name.
    """
    if attempt < 1:
        raise ValueError(f"attempt numbers start at 1, got {attempt}")
    return _dns_label(job_name, f"-{attempt}", MAX_RAYJOB_NAME_LENGTH)


def _dns_label(job_name: str, suffix: str, limit: int) -> str:
    """``<job><suffix>`` as a DNS-1035 label (RayJobs, Services): see :func:`rayjob_name`'s rewrites."""
    base = job_name.lower().replace(".", "-")
    if not base[:1].isalpha():
        base = _RAYJOB_PREFIX + base
    return _shorten(base, suffix, limit, job_name, rewritten=base != job_name)


def job_label_value(job_name: str) -> str:
    """The value of the ``hybridflow.io/job`` label: the job name, hashed down to 63 characters if longer."""
    return _shorten(job_name, "", MAX_LABEL_VALUE_LENGTH, job_name, rewritten=False)
