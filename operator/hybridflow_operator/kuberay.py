"""What the operator knows about the KubeRay it runs against: versions, and what each one serves.

The Ray version. Every RayJob names ``rayClusterSpec.rayVersion``: KubeRay >= 1.5.1 refuses
token authentication without it (``ValidateRayClusterSpec``: "authOptions.mode is 'token' but
RayVersion was not specified"), and KubeRay >= 1.6 probes the pods over HTTP only when it is
>= 2.53 (``common/pod.go`` ``supportsUnifiedHealthCheck``; below, the probes exec ``wget``).
:data:`RAY_VERSION` is the one value for both the RayJobs and the runtime image: the image
installs ``ray`` from ``constraints/gpu.txt``, and a test fails when that pin and this constant
differ. A custom ``spec.image`` must carry the same Ray.

The installed KubeRay. The operator reads the ``rayjobs.ray.io`` CRD the API server serves and
learns from its schema which fields it keeps: the API server prunes fields a CRD does not
declare, silently, so a RayJob asking an old KubeRay for token authentication or a startup
deadline would run without either and nobody would know. Two fields tell the versions apart:

==================================  =========  ===========================================
field of the served RayJob schema   KubeRay    what the operator does without it
==================================  =========  ===========================================
``rayClusterSpec.authOptions``      >= 1.5.1   refuses: the job's Ray dashboard and job API
                                               would answer anyone who reaches the pods
``preRunningDeadlineSeconds``       >= 1.6.0   keeps ``spec.startupTimeoutSeconds`` itself:
                                               it stops an attempt whose cluster has not
                                               reached Running in time (``status``)
==================================  =========  ===========================================

So the supported KubeRay versions are 1.5.1 to 1.7 (:data:`SUPPORTED_KUBERAY`); 1.5.x gets the
operator's own startup timer. A missing CRD is KubeRay not installed (yet): the jobs wait with
``ChildrenReady=False`` (``KubeRayMissing``) and go on once it appears, since the operator
watches CRDs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

RAY_VERSION = "2.60.0"
"""``rayClusterSpec.rayVersion`` of every RayJob; equal to the runtime image's ``ray`` pin."""
MINIMUM_KUBERAY = "1.5.1"
SUPPORTED_KUBERAY = ("1.5.1", "1.6", "1.7")
"""The KubeRay versions the operator is tested against (their validation rules, per version, in
``tests/kube/kuberay_rules.py``)."""
RAYJOB_CRD_NAME = "rayjobs.ray.io"
RAY_API_VERSION_NAME = "v1"


@dataclass(frozen=True)
class KubeRayFeatures:
    """What the served RayJob schema keeps; the version range it implies."""

    installed: bool
    """The RayJob CRD is served at all."""
    token_auth: bool = False
    """``rayClusterSpec.authOptions`` (KubeRay >= 1.5.1)."""
    pre_running_deadline: bool = False
    """``spec.preRunningDeadlineSeconds`` (KubeRay >= 1.6.0)."""

    @property
    def version_range(self) -> str:
        """The KubeRay versions this schema belongs to, for messages."""
        if not self.installed:
            return "not installed"
        if self.pre_running_deadline and self.token_auth:
            return ">= 1.6"
        if self.token_auth:
            return "1.5.1 to 1.5.x"
        return "< 1.5.1"

    @property
    def supported(self) -> bool:
        return self.installed and self.token_auth

    def unsupported_message(self) -> str:
        """Why the operator will not run jobs on this KubeRay (for the job's condition)."""
        return (
            f"the installed KubeRay ({self.version_range}: its RayJob CRD has no "
            "spec.rayClusterSpec.authOptions) is older than the minimum, KubeRay "
            f"{MINIMUM_KUBERAY}; the API server would drop the job's token authentication silently. "
            "Upgrade KubeRay (its CRDs first: helm does not upgrade them)"
        )


ASSUMED_CURRENT = KubeRayFeatures(installed=True, token_auth=True, pre_running_deadline=True)
"""What the builders assume when nothing was read (tests, and before the first read)."""
NOT_INSTALLED = KubeRayFeatures(installed=False)


def _properties(schema: Mapping[str, Any] | None) -> Mapping[str, Any]:
    return (schema or {}).get("properties") or {}


def features_from_crd(crd: Mapping[str, Any] | None) -> KubeRayFeatures:
    """Read the served ``v1`` RayJob schema of the ``rayjobs.ray.io`` CRD (None: not installed)."""
    if not crd:
        return NOT_INSTALLED
    versions = (crd.get("spec") or {}).get("versions") or []
    served = next(
        (v for v in versions if v.get("name") == RAY_API_VERSION_NAME and v.get("served", True)), None
    )
    if served is None:
        return NOT_INSTALLED
    root = ((served.get("schema") or {}).get("openAPIV3Schema")) or {}
    spec = _properties(root).get("spec") or {}
    cluster = _properties(spec).get("rayClusterSpec") or {}
    return KubeRayFeatures(
        installed=True,
        token_auth="authOptions" in _properties(cluster),
        pre_running_deadline="preRunningDeadlineSeconds" in _properties(spec),
    )
