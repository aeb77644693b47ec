"""KubeRay's RayJob validation, replayed in Python: what its controller refuses before it acts.

Follows ``validateRayJob`` in ``ray-operator/controllers/ray/rayjob_controller.go`` of KubeRay
v1.5.1, v1.6.0/v1.6.2 (identical here) and v1.7.0: ``ValidateRayJobMetadata``, then
``ValidateRayJobSpec`` (which calls ``validateDeletionConfiguration`` and, for an inline
cluster, ``ValidateRayClusterSpec``), then ``ValidateRayJobStatus``, all in
``ray-operator/controllers/ray/utils/validation.go``. KubeRay stops at the first error and
writes ``err.Error()`` to ``status.message`` with ``jobDeploymentStatus: ValidationFailed``;
:func:`validate_rayjob` returns that same text. Each :class:`Rule` is one Go check, listed in
the order Go evaluates them, with the message it produces (errors from
``ValidateRayClusterSpec`` come back prefixed ``The RayJob spec is invalid: ``, as
``ValidateRayJobSpec`` wraps them; the others are returned as Go returns them, some with that
prefix written into the literal and some without).

The body is the RayJob as JSON (camelCase keys), read the way Go's decoder reads it: a
missing key is the zero value, a present key (even ``{}``) is a non-nil pointer. Feature
gates are KubeRay's defaults for each version (``pkg/features/features.go``):
``RayJobDeletionPolicy`` is off in 1.5.1 and on from 1.6; ``RayClusterNetworkPolicy``,
``RayClusterMTLS``, ``RayClusterHistoryServer`` and ``GCSFaultToleranceEmbeddedStorage`` (1.7)
are off. Messages that embed Kubernetes' own validators (``IsDNS1035Label``,
``IsQualifiedName``, ``IsValidLabelValue``) follow the k8s.io/apimachinery each KubeRay pins
(v0.34 for 1.5.1, v0.35 for 1.6, v0.36 for 1.7: from v0.35 a length is "bytes", not
"characters"), and rayVersion comparisons follow its ``version.ParseGeneric``.

Deliberately left out:

* checks no RayJob body can reach: with ``RayJobDeletionPolicy`` off (1.5.1) nothing past the
  gate's refusal of any ``deletionStrategy``; the autoscaler-suspend check of 1.5.1 (the gate
  check refuses any suspended worker group first); with ``RayClusterNetworkPolicy``,
  ``RayClusterMTLS``, ``RayClusterHistoryServer`` and ``GCSFaultToleranceEmbeddedStorage`` off
  (1.7), everything behind them (``validateNetworkPolicy``, ``validateTLSOptions``,
  ``validateCollectorOptions``, the rocksdb backend's field checks); the K8s-token-auth checks
  inside ``ValidateRayClusterSpec`` (``ValidateRayJobSpec`` refuses ``enableK8sTokenAuth`` on a
  RayJob before it gets there);
* what the API server does first: this module checks the body as given, not as defaulted or
  pruned by the CRD (so ``worker-replicas-unset`` fires on a body without ``minReplicas``,
  which the CRD, making the field required and defaulted, would never store), and a 1.5.1
  KubeRay never sees ``preRunningDeadlineSeconds`` because its CRD prunes it (hence no such
  rule for 1.5.1); :func:`served_rayjob_crd` gives each version's schema for that side;
* Go's map iteration order: where Go reports several label or deletion-rule errors in map
  order, this module reports them in the body's key order (sorted keys for labels);
* the text of YAML parser errors inside ``runtime-env-yaml-invalid``: PyYAML's, not go-yaml's
  (the non-mapping case is reproduced exactly);
* RayCluster-controller checks (``ValidateRayClusterMetadata``, ``ValidateRayClusterUpgradeOptions``)
  and the managedBy skip, which happen elsewhere.
"""

from __future__ import annotations

import copy
import datetime
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import yaml

KUBERAY_VERSIONS = ("1.5.1", "1.6", "1.7")
CRD_VERSIONS = ("1.5.0", *KUBERAY_VERSIONS)
"""Versions :func:`served_rayjob_crd` knows; 1.5.0 (no ``authOptions``) only serves there."""

Json = Mapping[str, Any]


@dataclass(frozen=True)
class Rule:
    name: str
    go_function: str
    versions: tuple[str, ...]
    check: Callable[[Json], str | None]


# --------------------------------------------------------------------------- constants

MAX_RAYJOB_NAME_LENGTH = 47  # MaxRayClusterNameLength (53) - 6, utils/constant.go, 1.5.1-1.7
RAY_FT_ENABLED_ANNOTATION = "ray.io/ft-enabled"
RAY_EXTERNAL_STORAGE_NS_ANNOTATION = "ray.io/external-storage-namespace"
RAY_JOB_CLUSTER_SELECTOR_KEY = "ray.io/cluster"
MIN_TOKEN_AUTH_RAY_VERSION = "2.52.0"
MIN_PRIORITY_RAY_VERSION = "2.56.0"
SPEC_INVALID = "The RayJob spec is invalid: "

FEATURE_GATES: dict[str, dict[str, bool]] = {
    # pkg/features/features.go defaults, per version.
    "1.5.1": {"RayJobDeletionPolicy": False},
    "1.6": {"RayJobDeletionPolicy": True},
    "1.7": {
        "RayJobDeletionPolicy": True,
        "RayClusterNetworkPolicy": False,
        "GCSFaultToleranceEmbeddedStorage": False,
        "RayClusterMTLS": False,
        "RayClusterHistoryServer": False,
    },
}


def gate(version: str, name: str) -> bool:
    return FEATURE_GATES[version].get(name, False)


def _check_version(version: str) -> None:
    if version not in KUBERAY_VERSIONS:
        raise ValueError(f"unknown KubeRay version {version!r}; one of {KUBERAY_VERSIONS}")


# --------------------------------------------------------------------------- Go formatting helpers


def go_quote(text: str) -> str:
    """Go's ``%q`` / ``strconv.Quote`` for a string."""
    escapes = {"\a": r"\a", "\b": r"\b", "\f": r"\f", "\n": r"\n", "\r": r"\r", "\t": r"\t", "\v": r"\v"}
    out = []
    for char in text:
        if char in '"\\':
            out.append("\\" + char)
        elif char in escapes:
            out.append(escapes[char])
        elif char.isprintable():
            out.append(char)
        elif ord(char) < 0x80:
            out.append(f"\\x{ord(char):02x}")
        elif ord(char) < 0x10000:
            out.append(f"\\u{ord(char):04x}")
        else:
            out.append(f"\\U{ord(char):08x}")
    return '"' + "".join(out) + '"'


def go_list(items: Iterable[str]) -> str:
    """Go's ``%v`` of a ``[]string``."""
    return "[" + " ".join(items) + "]"


def _byte_len(text: str) -> int:
    return len(text.encode())


# --------------------------------------------------------------------------- k8s.io/apimachinery validators


def _apimachinery_max_len(version: str, length: int) -> str:
    # validation.MaxLenError (v0.34: "characters"); content.MaxLenError (v0.35+: "bytes").
    unit = "characters" if version == "1.5.1" else "bytes"
    return f"must be no more than {length} {unit}"


def _regex_error(msg: str, fmt: str, *examples: str) -> str:
    # validation.RegexError / content.RegexError (same text in v0.34-v0.36).
    if not examples:
        return f"{msg} (regex used for validation is '{fmt}')"
    listed = " or ".join(f"'{example}', " for example in examples)
    return f"{msg} (e.g. {listed}regex used for validation is '{fmt}')"


_DNS1035_FMT = "[a-z]([-a-z0-9]*[a-z0-9])?"
_DNS1035 = re.compile(rf"^{_DNS1035_FMT}\Z")
_DNS1123_LABEL_FMT = "[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_DNS1123_SUBDOMAIN_FMT = _DNS1123_LABEL_FMT + r"(\." + _DNS1123_LABEL_FMT + ")*"
_DNS1123_SUBDOMAIN = re.compile(rf"^{_DNS1123_SUBDOMAIN_FMT}\Z")
_QNAME_FMT = "([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]"
_QNAME = re.compile(rf"^{_QNAME_FMT}\Z")
_LABEL_VALUE_FMT = f"({_QNAME_FMT})?"
_LABEL_VALUE = re.compile(rf"^{_LABEL_VALUE_FMT}\Z")
_QNAME_MSG = "must consist of alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric character"


def is_dns1035_label(value: str, version: str) -> list[str]:
    """``validation.IsDNS1035Label``."""
    errs = []
    if _byte_len(value) > 63:
        errs.append("must be no more than 63 characters")  # util/validation's MaxLenError, all versions
    if not _DNS1035.match(value):
        errs.append(
            _regex_error(
                "a DNS-1035 label must consist of lower case alphanumeric characters or '-', start with an "
                "alphabetic character, and end with an alphanumeric character",
                _DNS1035_FMT,
                "my-name",
                "abc-123",
            )
        )
    return errs


def _is_dns1123_subdomain(value: str, version: str) -> list[str]:
    errs = []
    if _byte_len(value) > 253:
        errs.append(_apimachinery_max_len(version, 253))
    if not _DNS1123_SUBDOMAIN.match(value):
        errs.append(
            _regex_error(
                "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', "
                "and must start and end with an alphanumeric character",
                _DNS1123_SUBDOMAIN_FMT,
                "example.com",
            )
        )
    return errs


def is_qualified_name(value: str, version: str) -> list[str]:
    """``validation.IsQualifiedName`` (v0.34) / ``content.IsLabelKey`` (v0.35+)."""
    errs: list[str] = []
    parts = value.split("/")
    if len(parts) == 1:
        name = parts[0]
    elif len(parts) == 2:
        prefix, name = parts
        if not prefix:
            errs.append("prefix part must be non-empty")
        else:
            errs += ["prefix part " + msg for msg in _is_dns1123_subdomain(prefix, version)]
    else:
        what = "a qualified name " if version == "1.5.1" else "a valid label key "
        return [
            what
            + _regex_error(_QNAME_MSG, _QNAME_FMT, "MyName", "my.name", "123-abc")
            + " with an optional DNS subdomain prefix and '/' (e.g. 'example.com/MyName')"
        ]
    if not name:
        errs.append("name part must be non-empty")
    elif _byte_len(name) > 63:
        errs.append("name part " + _apimachinery_max_len(version, 63))
    if not _QNAME.match(name):
        errs.append("name part " + _regex_error(_QNAME_MSG, _QNAME_FMT, "MyName", "my.name", "123-abc"))
    return errs


def is_valid_label_value(value: str, version: str) -> list[str]:
    """``validation.IsValidLabelValue`` (v0.34) / ``content.IsLabelValue`` (v0.35+)."""
    errs = []
    if _byte_len(value) > 63:
        errs.append(_apimachinery_max_len(version, 63))
    if not _LABEL_VALUE.match(value):
        errs.append(
            _regex_error(
                "a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or '.', "
                "and must start and end with an alphanumeric character",
                _LABEL_VALUE_FMT,
                "MyValue",
                "my_value",
                "12345",
            )
        )
    return errs


# --------------------------------------------------------------------------- version.ParseGeneric

_GO_SPACE = "[\t\n\f\r ]"
_VERSION_RE = re.compile(rf"^{_GO_SPACE}*v?([0-9]+(?:\.[0-9]+)*)(.*)\Z")
_GO_UINT_MAX = 2**64 - 1


@dataclass(frozen=True)
class GenericVersion:
    """A ``version.Version`` from ``ParseGeneric``: only the numeric components count."""

    components: tuple[int, ...]

    def compare(self, other: GenericVersion) -> int:
        """``compareInternal`` for two generic versions: -1, 0 or 1 (missing components are zeros)."""
        for mine, theirs in zip(self.components, other.components, strict=False):
            if mine != theirs:
                return -1 if mine < theirs else 1
        n = min(len(self.components), len(other.components))
        if any(self.components[n:]):
            return 1
        if any(other.components[n:]):
            return -1
        return 0

    def less_than(self, other: GenericVersion) -> bool:
        return self.compare(other) == -1


def parse_generic(text: str) -> GenericVersion:
    """``k8s.io/apimachinery/pkg/util/version.ParseGeneric``; ValueError carries Go's message.

    At least two dot-separated numbers, optionally after ``v`` and leading whitespace; anything
    after the numbers (``-rc1``, ``rc1``, ``.x``) is ignored; a zero-prefixed first component is
    illegal.
    """
    match = _VERSION_RE.match(text)
    if match is None:
        raise ValueError(f"could not parse {go_quote(text)} as version")
    components = match.group(1).split(".")
    if len(components) < 2:
        raise ValueError(f"illegal version string {go_quote(text)}")
    numbers = []
    for index, component in enumerate(components):
        if index == 0 and component.startswith("0") and component != "0":
            raise ValueError(
                f"illegal zero-prefixed version component {go_quote(component)} in {go_quote(text)}"
            )
        number = int(component)
        if number > _GO_UINT_MAX:
            raise ValueError(
                f"illegal non-numeric version component {go_quote(component)} in {go_quote(text)}: "
                f"strconv.ParseUint: parsing {go_quote(component)}: value out of range"
            )
        numbers.append(number)
    return GenericVersion(tuple(numbers))


# --------------------------------------------------------------------------- reading the body like Go


def _map(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _has(obj: Json, key: str) -> bool:
    """A Go pointer/slice/map field is set: the key is present and not null."""
    return obj.get(key) is not None


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _str(value: Any) -> str:
    return value if isinstance(value, str) else ""


def spec_of(rayjob: Json) -> Json:
    return _map(rayjob.get("spec"))


def cluster_of(rayjob: Json) -> Json | None:
    """``spec.rayClusterSpec``, None where Go's pointer is nil."""
    cluster = spec_of(rayjob).get("rayClusterSpec")
    return _map(cluster) if cluster is not None else None


def annotations_of(rayjob: Json) -> Json:
    return _map(_map(rayjob.get("metadata")).get("annotations"))


def _pod_spec(group: Json) -> Json:
    return _map(_map(group.get("template")).get("spec"))


def _containers(group: Json) -> list[Any]:
    return _list(_pod_spec(group).get("containers"))


def _head(cluster: Json) -> Json:
    return _map(cluster.get("headGroupSpec"))


def _workers(cluster: Json) -> list[Json]:
    return [_map(group) for group in _list(cluster.get("workerGroupSpecs"))]


def _head_container(cluster: Json) -> Json:
    containers = _containers(_head(cluster))
    return _map(containers[0]) if containers else {}


def _env_by_name(name: str, env: Any) -> Json | None:
    """``EnvVarByName``: the first entry named ``name``."""
    return next((_map(item) for item in _list(env) if _map(item).get("name") == name), None)


def _env_exists(name: str, env: Any) -> bool:
    return _env_by_name(name, env) is not None


def _head_env(cluster: Json) -> Any:
    return _head_container(cluster).get("env")


def _params(group: Json) -> Json:
    return _map(group.get("rayStartParams"))


def autoscaling_enabled(cluster: Json | None) -> bool:
    """``IsAutoscalingEnabled``."""
    return cluster is not None and cluster.get("enableInTreeAutoscaling") is True


def autoscaling_v2_enabled(cluster: Json | None) -> bool:
    """``IsAutoscalingV2Enabled``."""
    return cluster is not None and _map(cluster.get("autoscalerOptions")).get("version") == "v2"


def _v2_env_on(cluster: Json) -> bool:
    env = _env_by_name("RAY_enable_autoscaler_v2", _head_env(cluster))
    return env is not None and _str(env.get("value")) in ("1", "true")


def token_auth_enabled(cluster: Json) -> bool:
    """``IsAuthEnabled``."""
    return _map(cluster.get("authOptions")).get("mode") == "token"


def k8s_token_auth_enabled(cluster: Json, version: str) -> bool:
    """``IsK8sAuthEnabled`` (the field exists from 1.6)."""
    return version != "1.5.1" and _map(cluster.get("authOptions")).get("enableK8sTokenAuth") is True


def gcs_ft_enabled(cluster: Json, annotations: Json) -> bool:
    """``IsGCSFaultToleranceEnabled``."""
    value = annotations.get(RAY_FT_ENABLED_ANNOTATION)
    return (isinstance(value, str) and value.lower() == "true") or _has(cluster, "gcsFaultToleranceOptions")


def _submission_mode(rayjob: Json) -> str:
    return _str(spec_of(rayjob).get("submissionMode"))


def _selector(rayjob: Json) -> Json:
    return _map(spec_of(rayjob).get("clusterSelector"))


# --------------------------------------------------------------------------- ValidateRayJobMetadata


def _name(rayjob: Json) -> str:
    return _str(_map(rayjob.get("metadata")).get("name"))


def rayjob_name_too_long(rayjob: Json, version: str) -> str | None:
    # ValidateRayJobMetadata (utils/validation.go), 1.5.1-1.7: MaxRayJobNameLength.
    if _byte_len(_name(rayjob)) > MAX_RAYJOB_NAME_LENGTH:
        return f"The RayJob metadata is invalid: RayJob name should be no more than {MAX_RAYJOB_NAME_LENGTH} characters"
    return None


def rayjob_name_not_dns1035(rayjob: Json, version: str) -> str | None:
    # ValidateRayJobMetadata (utils/validation.go), 1.5.1-1.7: validation.IsDNS1035Label.
    errs = is_dns1035_label(_name(rayjob), version)
    if errs:
        return f"The RayJob metadata is invalid: RayJob name should be a valid DNS1035 label: {go_list(errs)}"
    return None


# --------------------------------------------------------------------------- ValidateRayJobSpec: top


def suspend_needs_shutdown(rayjob: Json, version: str) -> str | None:
    # ValidateRayJobSpec (utils/validation.go), 1.5.1-1.7.
    spec = spec_of(rayjob)
    if spec.get("suspend") is True and spec.get("shutdownAfterJobFinishes") is not True:
        return (
            SPEC_INVALID
            + "a RayJob with shutdownAfterJobFinishes set to false is not allowed to be suspended"
        )
    return None


def ttl_negative(rayjob: Json, version: str) -> str | None:
    # ValidateRayJobSpec (utils/validation.go), 1.5.1-1.7.
    if _int(spec_of(rayjob).get("ttlSecondsAfterFinished")) < 0:
        return SPEC_INVALID + "TTLSecondsAfterFinished must be a non-negative integer"
    return None


# --------------------------------------------------------------------------- validateDeletionConfiguration


def _strategy(rayjob: Json) -> Json | None:
    strategy = spec_of(rayjob).get("deletionStrategy")
    return _map(strategy) if strategy is not None else None


def _legacy_configured(strategy: Json) -> bool:
    return _has(strategy, "onSuccess") or _has(strategy, "onFailure")


def _rules_configured(strategy: Json) -> bool:
    return len(_list(strategy.get("deletionRules"))) > 0


def ttl_needs_shutdown(rayjob: Json, version: str) -> str | None:
    # validateDeletionConfiguration (utils/validation.go), 1.5.1-1.7.
    spec = spec_of(rayjob)
    if spec.get("shutdownAfterJobFinishes") is not True and _int(spec.get("ttlSecondsAfterFinished")) > 0:
        return (
            SPEC_INVALID
            + "a RayJob with shutdownAfterJobFinishes set to false cannot have TTLSecondsAfterFinished"
        )
    return None


def deletion_strategy_needs_gate(rayjob: Json, version: str) -> str | None:
    # validateDeletionConfiguration (utils/validation.go): the RayJobDeletionPolicy gate, off in 1.5.1.
    if _strategy(rayjob) is not None and not gate(version, "RayJobDeletionPolicy"):
        return "RayJobDeletionPolicy feature gate must be enabled to use DeletionStrategy"
    return None


def _gated_strategy(rayjob: Json, version: str) -> Json | None:
    strategy = _strategy(rayjob)
    return strategy if strategy is not None and gate(version, "RayJobDeletionPolicy") else None


def deletion_rules_exclude_shutdown(rayjob: Json, version: str) -> str | None:
    # validateDeletionConfiguration (utils/validation.go), 1.6-1.7.
    strategy = _gated_strategy(rayjob, version)
    if (
        strategy is not None
        and _rules_configured(strategy)
        and spec_of(rayjob).get("shutdownAfterJobFinishes") is True
    ):
        return (
            SPEC_INVALID
            + "spec.shutdownAfterJobFinishes and spec.deletionStrategy.deletionRules are mutually exclusive"
        )
    return None


def deletion_rules_exclude_legacy(rayjob: Json, version: str) -> str | None:
    # validateDeletionConfiguration (utils/validation.go), 1.6-1.7.
    strategy = _gated_strategy(rayjob, version)
    if strategy is not None and _rules_configured(strategy) and _legacy_configured(strategy):
        return (
            SPEC_INVALID
            + "Cannot use both legacy onSuccess/onFailure fields and deletionRules simultaneously"
        )
    return None


def _legacy(rayjob: Json, version: str) -> Json | None:
    strategy = _gated_strategy(rayjob, version)
    if strategy is None or not _legacy_configured(strategy) or _rules_configured(strategy):
        return None  # with rules as well, deletion-rules-exclude-legacy has refused it
    return strategy


def legacy_deletion_needs_both(rayjob: Json, version: str) -> str | None:
    # validateLegacyDeletionPolicies (utils/validation.go), 1.6-1.7.
    strategy = _legacy(rayjob, version)
    if strategy is not None and not (_has(strategy, "onSuccess") and _has(strategy, "onFailure")):
        return (
            "both DeletionStrategy.OnSuccess and DeletionStrategy.OnFailure must be set when using the legacy "
            "deletion policy fields of DeletionStrategy"
        )
    return None


def _legacy_policies(rayjob: Json, version: str) -> tuple[str | None, str | None] | None:
    """(onSuccess.policy, onFailure.policy) when both blocks are set (None: a nil ``policy``)."""
    strategy = _legacy(rayjob, version)
    if strategy is None or not (_has(strategy, "onSuccess") and _has(strategy, "onFailure")):
        return None
    success = _map(strategy["onSuccess"]).get("policy")
    failure = _map(strategy["onFailure"]).get("policy")
    return (_str(success) if success is not None else None, _str(failure) if failure is not None else None)


def legacy_deletion_policy_unset(rayjob: Json, version: str) -> str | None:
    # validateLegacyDeletionPolicies (utils/validation.go), 1.6-1.7.
    policies = _legacy_policies(rayjob, version)
    if policies is None:
        return None
    for which, policy in zip(("OnSuccess", "OnFailure"), policies, strict=True):
        if policy is None:
            return f"the DeletionPolicyType field of DeletionStrategy.{which} cannot be unset when DeletionStrategy is enabled"
    return None


def _set_policies(rayjob: Json, version: str) -> tuple[str, str] | None:
    policies = _legacy_policies(rayjob, version)
    if policies is None or policies[0] is None or policies[1] is None:
        return None
    return policies[0], policies[1]


def legacy_deletion_cluster_selector(rayjob: Json, version: str) -> str | None:
    # validateLegacyDeletionPolicies (utils/validation.go), 1.6-1.7.
    policies = _set_policies(rayjob, version)
    if policies is None or not _selector(rayjob):
        return None
    for when, policy in zip(("success", "failure"), policies, strict=True):
        if policy in ("DeleteCluster", "DeleteWorkers"):
            return f"the ClusterSelector mode doesn't support DeletionStrategy={policy} on {when}"
    return None


def legacy_deletion_workers_with_autoscaling(rayjob: Json, version: str) -> str | None:
    # validateLegacyDeletionPolicies (utils/validation.go), 1.6-1.7.
    policies = _set_policies(rayjob, version)
    if policies and "DeleteWorkers" in policies and autoscaling_enabled(cluster_of(rayjob)):
        return "DeletionStrategy=DeleteWorkers currently does not support RayCluster with autoscaling enabled"
    return None


def legacy_deletion_shutdown_with_delete_none(rayjob: Json, version: str) -> str | None:
    # validateLegacyDeletionPolicies (utils/validation.go), 1.6-1.7 ("Finshes" is KubeRay's spelling).
    policies = _set_policies(rayjob, version)
    if policies and "DeleteNone" in policies and spec_of(rayjob).get("shutdownAfterJobFinishes") is True:
        return SPEC_INVALID + "shutdownAfterJobFinshes is set to 'true' while deletion policy is 'DeleteNone'"
    return None


def deletion_rules_invalid(rayjob: Json, version: str) -> str | None:
    # validateDeletionRules, validateDeletionCondition, validateTTLConsistency (utils/validation.go), 1.6-1.7.
    # Go joins every problem (errors.Join, one per line); map-ordered groups come in body order here.
    strategy = _gated_strategy(rayjob, version)
    if strategy is None or _legacy_configured(strategy) or not _rules_configured(strategy):
        return None
    selector_mode = bool(_selector(rayjob))
    errs: list[str] = []
    groups: dict[tuple[str, str], dict[str, int]] = {}
    for index, item in enumerate(_list(strategy.get("deletionRules"))):
        rule = _map(item)
        policy = _str(rule.get("policy"))
        condition = _map(rule.get("condition"))
        has_job, has_deployment = _has(condition, "jobStatus"), _has(condition, "jobDeploymentStatus")
        ttl = _int(condition.get("ttlSeconds"))
        if has_job and has_deployment:
            errs.append(
                f"deletionRules[{index}]: cannot set both JobStatus and JobDeploymentStatus at the same time"
            )
            continue
        if not has_job and not has_deployment:
            errs.append(
                f"deletionRules[{index}]: exactly one of JobStatus and JobDeploymentStatus must be set"
            )
            continue
        if ttl < 0:
            errs.append(f"deletionRules[{index}]: TTLSeconds must be non-negative")
            continue
        if selector_mode and policy in ("DeleteCluster", "DeleteWorkers"):
            errs.append(
                f"deletionRules[{index}]: DeletionPolicyType '{policy}' not supported when ClusterSelector is set"
            )
            continue
        if autoscaling_enabled(cluster_of(rayjob)) and policy == "DeleteWorkers":
            errs.append(
                f"deletionRules[{index}]: DeletionPolicyType 'DeleteWorkers' not supported with autoscaling enabled"
            )
            continue
        kind, value = (
            ("JobStatus", _str(condition["jobStatus"]))
            if has_job
            else ("JobDeploymentStatus", _str(condition["jobDeploymentStatus"]))
        )
        policy_ttls = groups.setdefault((kind, value), {})
        if policy in policy_ttls:
            errs.append(
                f"deletionRules[{index}]: duplicate rule for DeletionPolicyType '{policy}' and {kind} '{value}'"
            )
            continue
        policy_ttls[policy] = ttl
    for (kind, value), policy_ttls in groups.items():
        previous: tuple[str, int] | None = None
        for policy in ("DeleteWorkers", "DeleteCluster", "DeleteSelf"):
            if policy not in policy_ttls:
                continue
            ttl = policy_ttls[policy]
            if previous is not None and ttl < previous[1]:
                errs.append(
                    f"for {kind} '{value}': {policy} TTL ({ttl}) must be >= {previous[0]} TTL ({previous[1]})"
                )
            previous = (policy, ttl)
    return "\n".join(errs) if errs else None


def deletion_strategy_empty(rayjob: Json, version: str) -> str | None:
    # validateDeletionConfiguration (utils/validation.go), 1.6-1.7.
    strategy = _gated_strategy(rayjob, version)
    if strategy is not None and not _legacy_configured(strategy) and not _rules_configured(strategy):
        return (
            SPEC_INVALID
            + "DeletionStrategy requires either BOTH onSuccess and onFailure, OR the deletionRules field (cannot be empty)"
        )
    return None


# --------------------------------------------------------------------------- ValidateRayJobSpec: modes


def cluster_selector_no_suspend(rayjob: Json, version: str) -> str | None:
    # ValidateRayJobSpec (utils/validation.go), 1.5.1-1.7.
    if spec_of(rayjob).get("suspend") is True and _selector(rayjob):
        return SPEC_INVALID + "the ClusterSelector mode doesn't support the suspend operation"
    return None


def cluster_spec_or_selector(rayjob: Json, version: str) -> str | None:
    # ValidateRayJobSpec (utils/validation.go), 1.5.1-1.7.
    if cluster_of(rayjob) is None and not _selector(rayjob):
        return SPEC_INVALID + "one of RayClusterSpec or ClusterSelector must be set"
    return None


def cluster_selector_needs_name(rayjob: Json, version: str) -> str | None:
    # ValidateRayJobSpec (utils/validation.go), 1.5.1-1.7.
    selector = _selector(rayjob)
    if selector and not _str(selector.get(RAY_JOB_CLUSTER_SELECTOR_KEY)):
        return "cluster name in ClusterSelector should not be empty"
    return None


def cluster_selector_not_sidecar(rayjob: Json, version: str) -> str | None:
    # ValidateRayJobSpec (utils/validation.go), 1.5.1-1.7.
    if _selector(rayjob) and _submission_mode(rayjob) == "SidecarMode":
        return "ClusterSelector is not supported in SidecarMode"
    return None


def cluster_selector_no_backoff(rayjob: Json, version: str) -> str | None:
    # ValidateRayJobSpec (utils/validation.go), 1.6-1.7.
    if _selector(rayjob) and _int(spec_of(rayjob).get("backoffLimit")) > 0:
        return SPEC_INVALID + "BackoffLimit is incompatible with ClusterSelector mode"
    return None


def interactive_no_backoff(rayjob: Json, version: str) -> str | None:
    # ValidateRayJobSpec (utils/validation.go), 1.5.1-1.7.
    if _submission_mode(rayjob) == "InteractiveMode" and _int(spec_of(rayjob).get("backoffLimit")) > 0:
        return SPEC_INVALID + "BackoffLimit is incompatible with InteractiveMode"
    return None


def sidecar_no_submitter_template(rayjob: Json, version: str) -> str | None:
    # ValidateRayJobSpec (utils/validation.go), 1.5.1-1.7.
    if _submission_mode(rayjob) == "SidecarMode" and _has(spec_of(rayjob), "submitterPodTemplate"):
        return "Currently, SidecarMode doesn't support SubmitterPodTemplate"
    return None


def sidecar_no_submitter_config(rayjob: Json, version: str) -> str | None:
    # ValidateRayJobSpec (utils/validation.go), 1.5.1-1.7.
    if _submission_mode(rayjob) == "SidecarMode" and _has(spec_of(rayjob), "submitterConfig"):
        return "Currently, SidecarMode doesn't support SubmitterConfig"
    return None


def sidecar_head_restart_policy(rayjob: Json, version: str) -> str | None:
    # ValidateRayJobSpec (utils/validation.go), 1.5.1-1.7.
    cluster = cluster_of(rayjob)
    if _submission_mode(rayjob) != "SidecarMode" or cluster is None:
        return None  # Go dereferences a nil RayClusterSpec here; the checks above rule that out
    if _str(_pod_spec(_head(cluster)).get("restartPolicy")) not in ("", "Never"):
        return "restartPolicy for head Pod should be Never or unset when using SidecarMode"
    return None


def rayjob_k8s_token_auth(rayjob: Json, version: str) -> str | None:
    # ValidateRayJobSpec (utils/validation.go), 1.6-1.7.
    cluster = cluster_of(rayjob)
    if cluster is not None and k8s_token_auth_enabled(cluster, version):
        return SPEC_INVALID + "K8s token auth mode is currently not supported for RayJob"
    return None


# --------------------------------------------------------------------------- ValidateRayClusterSpec

ClusterCheck = Callable[[Json, Json, str], str | None]
"""(cluster spec, RayJob annotations, version) -> the unwrapped Go error text."""


def _in_cluster(check: ClusterCheck) -> Callable[[Json, str], str | None]:
    """Run a ValidateRayClusterSpec check on an inline cluster; wrap its error as ValidateRayJobSpec does."""

    def run(rayjob: Json, version: str) -> str | None:
        cluster = cluster_of(rayjob)
        if cluster is None:
            return None
        message = check(cluster, annotations_of(rayjob), version)
        return SPEC_INVALID + message if message is not None else None

    run.__name__ = check.__name__
    return run


def _group_resources(group_name: str, group: Json) -> str | None:
    # validateRayGroupResources (utils/validation.go), 1.5.1-1.7.
    params = _params(group)
    from_params = any(_str(params.get(key)) for key in ("num-cpus", "num-gpus", "memory", "resources"))
    if from_params and len(_map(group.get("resources"))) > 0:
        return (
            f"resource fields should not be set in both rayStartParams and Resources for {group_name} group; "
            "please use only one"
        )
    return None


def _group_labels_param(group_name: str, group: Json) -> str | None:
    # validateRayGroupLabels (utils/validation.go), 1.5.1-1.7: rayStartParams["labels"].
    if "labels" in _params(group):
        return (
            f"rayStartParams['labels'] is not supported for {group_name} group; please use the top-level "
            "Labels field instead"
        )
    return None


def _group_label_syntax(group_name: str, group: Json, version: str) -> str | None:
    # validateRayGroupLabels (utils/validation.go), 1.5.1-1.7: IsQualifiedName / IsValidLabelValue.
    errs = []
    labels = _map(group.get("labels"))
    for key in sorted(labels):
        value = _str(labels[key])
        errs += [
            f"invalid label key for {group_name} group: '{key}', error: {e}"
            for e in is_qualified_name(key, version)
        ]
        errs += [
            f"invalid label value for key '{key}' in {group_name} group: '{value}', error: {e}"
            for e in is_valid_label_value(value, version)
        ]
    return "; ".join(errs) if errs else None


def head_container_missing(cluster: Json, annotations: Json, version: str) -> str | None:
    # ValidateRayClusterSpec (utils/validation.go), 1.5.1-1.7.
    if not _containers(_head(cluster)):
        return "headGroupSpec should have at least one container"
    return None


def head_resources_twice(cluster: Json, annotations: Json, version: str) -> str | None:
    # ValidateRayClusterSpec -> validateRayGroupResources("Head") (utils/validation.go), 1.5.1-1.7.
    return _group_resources("Head", _head(cluster))


def head_labels_param(cluster: Json, annotations: Json, version: str) -> str | None:
    # ValidateRayClusterSpec -> validateRayGroupLabels("Head") (utils/validation.go), 1.5.1-1.7.
    return _group_labels_param("Head", _head(cluster))


def head_label_syntax(cluster: Json, annotations: Json, version: str) -> str | None:
    # ValidateRayClusterSpec -> validateRayGroupLabels("Head") (utils/validation.go), 1.5.1-1.7.
    return _group_label_syntax("Head", _head(cluster), version)


# The per-worker-group loop of ValidateRayClusterSpec. Go runs every check on a group before the
# next group, so a rule here fires only when it is the loop's first failure (see _worker_loop).
WorkerCheck = Callable[[Json, Json, str], str | None]
"""(worker group, cluster spec, version) -> the unwrapped Go error text."""


def _group_name(group: Json) -> str:
    return _str(group.get("groupName"))


def worker_container_missing(group: Json, cluster: Json, version: str) -> str | None:
    # ValidateRayClusterSpec (utils/validation.go), 1.5.1-1.7.
    return None if _containers(group) else "workerGroupSpec should have at least one container"


def worker_replicas_unset(group: Json, cluster: Json, version: str) -> str | None:
    # ValidateRayClusterSpec (utils/validation.go), 1.6-1.7 (the CRD requires and defaults both).
    if not autoscaling_enabled(cluster) and not (_has(group, "minReplicas") and _has(group, "maxReplicas")):
        return f"worker group {_group_name(group)} must set both minReplicas and maxReplicas when autoscaling is disabled"
    return None


def worker_min_negative(group: Json, cluster: Json, version: str) -> str | None:
    # ValidateRayClusterSpec (utils/validation.go), 1.6-1.7.
    if _has(group, "minReplicas") and _int(group["minReplicas"]) < 0:
        return f"worker group {_group_name(group)} has negative minReplicas {_int(group['minReplicas'])}"
    return None


def worker_max_negative(group: Json, cluster: Json, version: str) -> str | None:
    # ValidateRayClusterSpec (utils/validation.go), 1.6-1.7.
    if _has(group, "maxReplicas") and _int(group["maxReplicas"]) < 0:
        return f"worker group {_group_name(group)} has negative maxReplicas {_int(group['maxReplicas'])}"
    return None


def worker_min_above_max(group: Json, cluster: Json, version: str) -> str | None:
    # ValidateRayClusterSpec (utils/validation.go), 1.6-1.7.
    if _has(group, "minReplicas") and _has(group, "maxReplicas"):
        low, high = _int(group["minReplicas"]), _int(group["maxReplicas"])
        if low > high:
            return f"worker group {_group_name(group)} has minReplicas {low} greater than maxReplicas {high}"
    return None


def worker_resources_twice(group: Json, cluster: Json, version: str) -> str | None:
    # ValidateRayClusterSpec -> validateRayGroupResources (utils/validation.go), 1.5.1-1.7.
    return _group_resources(_group_name(group), group)


def worker_labels_param(group: Json, cluster: Json, version: str) -> str | None:
    # ValidateRayClusterSpec -> validateRayGroupLabels (utils/validation.go), 1.5.1-1.7.
    return _group_labels_param(_group_name(group), group)


def worker_label_syntax(group: Json, cluster: Json, version: str) -> str | None:
    # ValidateRayClusterSpec -> validateRayGroupLabels (utils/validation.go), 1.5.1-1.7.
    return _group_label_syntax(_group_name(group), group, version)


def worker_idle_timeout_negative(group: Json, cluster: Json, version: str) -> str | None:
    # validateWorkerGroupIdleTimeout (utils/validation.go), 1.6-1.7.
    if _has(group, "idleTimeoutSeconds") and _int(group["idleTimeoutSeconds"]) < 0:
        return (
            f"worker group {_group_name(group)}: idleTimeoutSeconds must be non-negative, "
            f"got {_int(group['idleTimeoutSeconds'])}"
        )
    return None


def worker_idle_timeout_needs_v2(group: Json, cluster: Json, version: str) -> str | None:
    # validateWorkerGroupIdleTimeout (utils/validation.go), 1.6-1.7.
    if not _has(group, "idleTimeoutSeconds") or _int(group["idleTimeoutSeconds"]) < 0:
        return None
    if autoscaling_v2_enabled(cluster) or _v2_env_on(cluster):
        return None
    return (
        f"worker group {_group_name(group)}: idleTimeoutSeconds is set, but autoscaler v2 is not enabled. Please "
        "set .spec.autoscalerOptions.version to 'v2' (or set RAY_enable_autoscaler_v2 environment variable to "
        "'true' in the head pod if using KubeRay < 1.4.0)"
    )


def _priority(group: Json) -> int:
    return _int(group.get("priority"))


def worker_priority_needs_ray_version(group: Json, cluster: Json, version: str) -> str | None:
    # validateWorkerGroupPriority (utils/validation.go), 1.7: priority needs rayVersion >= 2.56.0.
    if _priority(group) == 0:
        return None
    name, ray_version = _group_name(group), _str(cluster.get("rayVersion"))
    if not ray_version:
        return f"worker group {name}: priority is set, but RayVersion was not specified. Ray version 2.56.0 or later is required"
    try:
        parsed = parse_generic(ray_version)
    except ValueError as error:
        return (
            f"worker group {name}: priority is set, but RayVersion format is invalid: {ray_version}, {error}"
        )
    if parsed.less_than(parse_generic(MIN_PRIORITY_RAY_VERSION)):
        return f"worker group {name}: priority is set, but minimum Ray version is 2.56.0, got {ray_version}"
    return None


def worker_priority_needs_v2(group: Json, cluster: Json, version: str) -> str | None:
    # validateWorkerGroupPriority (utils/validation.go), 1.7.
    if _priority(group) == 0 or worker_priority_needs_ray_version(group, cluster, version) is not None:
        return None
    if autoscaling_v2_enabled(cluster) or _v2_env_on(cluster):
        return None
    return (
        f"worker group {_group_name(group)}: priority is set to {_priority(group)}, but autoscaler v2 is not "
        "enabled. Priority is only supported with autoscaler v2 enabled"
    )


@dataclass(frozen=True)
class _WorkerRule:
    name: str
    go_function: str
    versions: tuple[str, ...]
    check: WorkerCheck


ALL = KUBERAY_VERSIONS
FROM_16 = ("1.6", "1.7")
ONLY_17 = ("1.7",)
ONLY_151 = ("1.5.1",)
_VALIDATION = "(utils/validation.go)"

WORKER_LOOP: tuple[_WorkerRule, ...] = (
    _WorkerRule(
        "worker-container-missing", f"ValidateRayClusterSpec {_VALIDATION}", ALL, worker_container_missing
    ),
    _WorkerRule(
        "worker-replicas-unset", f"ValidateRayClusterSpec {_VALIDATION}", FROM_16, worker_replicas_unset
    ),
    _WorkerRule(
        "worker-min-replicas-negative", f"ValidateRayClusterSpec {_VALIDATION}", FROM_16, worker_min_negative
    ),
    _WorkerRule(
        "worker-max-replicas-negative", f"ValidateRayClusterSpec {_VALIDATION}", FROM_16, worker_max_negative
    ),
    _WorkerRule(
        "worker-min-above-max", f"ValidateRayClusterSpec {_VALIDATION}", FROM_16, worker_min_above_max
    ),
    _WorkerRule(
        "worker-resources-in-two-places",
        f"validateRayGroupResources {_VALIDATION}",
        ALL,
        worker_resources_twice,
    ),
    _WorkerRule(
        "worker-labels-in-ray-start-params", f"validateRayGroupLabels {_VALIDATION}", ALL, worker_labels_param
    ),
    _WorkerRule("worker-label-syntax", f"validateRayGroupLabels {_VALIDATION}", ALL, worker_label_syntax),
    _WorkerRule(
        "worker-idle-timeout-negative",
        f"validateWorkerGroupIdleTimeout {_VALIDATION}",
        FROM_16,
        worker_idle_timeout_negative,
    ),
    _WorkerRule(
        "worker-idle-timeout-needs-autoscaler-v2",
        f"validateWorkerGroupIdleTimeout {_VALIDATION}",
        FROM_16,
        worker_idle_timeout_needs_v2,
    ),
    _WorkerRule(
        "worker-priority-needs-ray-version",
        f"validateWorkerGroupPriority {_VALIDATION}",
        ONLY_17,
        worker_priority_needs_ray_version,
    ),
    _WorkerRule(
        "worker-priority-needs-autoscaler-v2",
        f"validateWorkerGroupPriority {_VALIDATION}",
        ONLY_17,
        worker_priority_needs_v2,
    ),
)


def worker_loop_failure(cluster: Json, version: str) -> tuple[str, str] | None:
    """The first (rule name, message) of ValidateRayClusterSpec's worker-group loop, in Go's order."""
    loop = [rule for rule in WORKER_LOOP if version in rule.versions]
    for group in _workers(cluster):
        for rule in loop:
            message = rule.check(group, cluster, version)
            if message is not None:
                return rule.name, message
    return None


def _loop_rule(name: str) -> Callable[[Json, str], str | None]:
    def run(rayjob: Json, version: str) -> str | None:
        cluster = cluster_of(rayjob)
        failure = worker_loop_failure(cluster, version) if cluster is not None else None
        return SPEC_INVALID + failure[1] if failure is not None and failure[0] == name else None

    return run


def ft_annotation_and_options(cluster: Json, annotations: Json, version: str) -> str | None:
    # ValidateRayClusterSpec (utils/validation.go), 1.5.1-1.7.
    if _str(annotations.get(RAY_FT_ENABLED_ANNOTATION)) and _has(cluster, "gcsFaultToleranceOptions"):
        return (
            "ray.io/ft-enabled annotation and GcsFaultToleranceOptions are both set. Please use only "
            "GcsFaultToleranceOptions to configure GCS fault tolerance"
        )
    return None


def redis_address_needs_ft(cluster: Json, annotations: Json, version: str) -> str | None:
    # ValidateRayClusterSpec (utils/validation.go), 1.5.1-1.7.
    if not gcs_ft_enabled(cluster, annotations) and _env_exists("RAY_REDIS_ADDRESS", _head_env(cluster)):
        return (
            "RAY_REDIS_ADDRESS is set which implicitly enables GCS fault tolerance, but GcsFaultToleranceOptions "
            "is not set. Please set GcsFaultToleranceOptions to enable GCS fault tolerance"
        )
    return None


def ft_no_redis_password_param(cluster: Json, annotations: Json, version: str) -> str | None:
    # ValidateRayClusterSpec (utils/validation.go), 1.5.1-1.7.
    if _has(cluster, "gcsFaultToleranceOptions") and _str(_params(_head(cluster)).get("redis-password")):
        return (
            "cannot set `redis-password` in rayStartParams when GcsFaultToleranceOptions is enabled - use "
            "GcsFaultToleranceOptions.RedisPassword instead"
        )
    return None


def ft_no_redis_password_env(cluster: Json, annotations: Json, version: str) -> str | None:
    # ValidateRayClusterSpec (utils/validation.go), 1.5.1-1.7.
    if _has(cluster, "gcsFaultToleranceOptions") and _env_exists("REDIS_PASSWORD", _head_env(cluster)):
        return (
            "cannot set `REDIS_PASSWORD` env var in head Pod when GcsFaultToleranceOptions is enabled - use "
            "GcsFaultToleranceOptions.RedisPassword instead"
        )
    return None


def ft_no_redis_address_env(cluster: Json, annotations: Json, version: str) -> str | None:
    # ValidateRayClusterSpec (utils/validation.go), 1.5.1-1.7.
    if _has(cluster, "gcsFaultToleranceOptions") and _env_exists("RAY_REDIS_ADDRESS", _head_env(cluster)):
        return (
            "cannot set `RAY_REDIS_ADDRESS` env var in head Pod when GcsFaultToleranceOptions is enabled - use "
            "GcsFaultToleranceOptions.RedisAddress instead"
        )
    return None


def ft_no_external_storage_annotation(cluster: Json, annotations: Json, version: str) -> str | None:
    # ValidateRayClusterSpec (utils/validation.go), 1.5.1-1.7.
    if _has(cluster, "gcsFaultToleranceOptions") and _str(
        annotations.get(RAY_EXTERNAL_STORAGE_NS_ANNOTATION)
    ):
        return (
            "cannot set `ray.io/external-storage-namespace` annotation when GcsFaultToleranceOptions is enabled - "
            "use GcsFaultToleranceOptions.ExternalStorageNamespace instead"
        )
    return None


def _ft_backend(cluster: Json) -> str | None:
    if not _has(cluster, "gcsFaultToleranceOptions"):
        return None
    return _str(_map(cluster["gcsFaultToleranceOptions"]).get("backend")) or "redis"


def ft_rocksdb_needs_gate(cluster: Json, annotations: Json, version: str) -> str | None:
    # validateGcsFaultToleranceBackend (utils/validation.go), 1.7: GCSFaultToleranceEmbeddedStorage is off.
    if _ft_backend(cluster) == "rocksdb" and not gate(version, "GCSFaultToleranceEmbeddedStorage"):
        return (
            "the embedded RocksDB GCS fault tolerance backend (GcsFaultToleranceOptions.Backend: 'rocksdb') "
            "requires the GCSFaultToleranceEmbeddedStorage feature gate to be enabled"
        )
    return None


def ft_redis_no_storage(cluster: Json, annotations: Json, version: str) -> str | None:
    # validateGcsFaultToleranceBackend (utils/validation.go), 1.7.
    backend = _ft_backend(cluster)
    if backend not in (None, "rocksdb") and _has(_map(cluster["gcsFaultToleranceOptions"]), "storage"):
        return (
            "cannot set GcsFaultToleranceOptions.Storage when backend is 'redis' - it only applies to the "
            "'rocksdb' backend"
        )
    return None


def redis_username(cluster: Json, annotations: Json, version: str) -> str | None:
    # ValidateRayClusterSpec (utils/validation.go), 1.5.1-1.7.
    if _str(_params(_head(cluster)).get("redis-username")) or _env_exists(
        "REDIS_USERNAME", _head_env(cluster)
    ):
        return (
            "cannot set redis username in rayStartParams or environment variables - use "
            "GcsFaultToleranceOptions.RedisUsername instead"
        )
    return None


def _first_suspended(cluster: Json) -> str | None:
    return next((_group_name(g) for g in _workers(cluster) if g.get("suspend") is True), None)


def worker_suspend_needs_gate(cluster: Json, annotations: Json, version: str) -> str | None:
    # ValidateRayClusterSpec (utils/validation.go): RayJobDeletionPolicy gate, off in 1.5.1.
    name = _first_suspended(cluster)
    if name is not None and not gate(version, "RayJobDeletionPolicy"):
        return (
            f"worker group {name} can be suspended only when the RayJobDeletionPolicy feature gate is enabled"
        )
    return None


def v2_env_needs_autoscaling(cluster: Json, annotations: Json, version: str) -> str | None:
    # ValidateRayClusterSpec (utils/validation.go), 1.5.1-1.7.
    env = _env_by_name("RAY_enable_autoscaler_v2", _head_env(cluster))
    if not autoscaling_enabled(cluster) and env is not None and _str(env.get("value")) in ("1", "true"):
        return (
            f"environment variable RAY_enable_autoscaler_v2 cannot be set to '{_str(env.get('value'))}' when "
            "enableInTreeAutoscaling is false. Please set enableInTreeAutoscaling: true to use autoscaler v2"
        )
    return None


def worker_suspend_with_autoscaler(cluster: Json, annotations: Json, version: str) -> str | None:
    # ValidateRayClusterSpec (utils/validation.go), 1.6-1.7 (in 1.5.1 the gate check refuses first).
    name = _first_suspended(cluster)
    if autoscaling_enabled(cluster) and name is not None:
        return f"worker group {name} cannot be suspended with Autoscaler enabled"
    return None


def autoscaler_version_and_env(cluster: Json, annotations: Json, version: str) -> str | None:
    # ValidateRayClusterSpec (utils/validation.go), 1.5.1-1.7.
    if (
        autoscaling_enabled(cluster)
        and _has(_map(cluster.get("autoscalerOptions")), "version")
        and _env_exists("RAY_enable_autoscaler_v2", _head_env(cluster))
    ):
        return (
            "both .spec.autoscalerOptions.version and head Pod env var RAY_enable_autoscaler_v2 are set, please "
            "only use the former"
        )
    return None


def v2_head_restart_policy(cluster: Json, annotations: Json, version: str) -> str | None:
    # ValidateRayClusterSpec (utils/validation.go), 1.5.1-1.7.
    v2 = autoscaling_enabled(cluster) and autoscaling_v2_enabled(cluster)
    if v2 and _str(_pod_spec(_head(cluster)).get("restartPolicy")) not in ("", "Never"):
        return "restartPolicy for head Pod should be Never or unset when using autoscaler V2"
    return None


def v2_worker_restart_policy(cluster: Json, annotations: Json, version: str) -> str | None:
    # ValidateRayClusterSpec (utils/validation.go), 1.5.1-1.7.
    if autoscaling_enabled(cluster) and autoscaling_v2_enabled(cluster):
        for group in _workers(cluster):
            if _str(_pod_spec(group).get("restartPolicy")) not in ("", "Never"):
                return f"restartPolicy for worker group {_group_name(group)} should be Never or unset when using autoscaler V2"
    return None


def autoscaler_idle_timeout_negative(cluster: Json, annotations: Json, version: str) -> str | None:
    # ValidateRayClusterSpec (utils/validation.go), 1.6-1.7.
    options = _map(cluster.get("autoscalerOptions"))
    if _has(options, "idleTimeoutSeconds") and _int(options["idleTimeoutSeconds"]) < 0:
        return f"autoscalerOptions.idleTimeoutSeconds must be non-negative, got {_int(options['idleTimeoutSeconds'])}"
    return None


def autoscaler_env_start_cmd(cluster: Json, annotations: Json, version: str) -> str | None:
    # ValidateRayClusterSpec (utils/validation.go), 1.7.
    if _has(cluster, "autoscalerOptions") and _env_exists(
        "KUBERAY_GEN_AUTOSCALER_START_CMD", _map(cluster["autoscalerOptions"]).get("env")
    ):
        return (
            "autoscalerOptions.env must not contain KUBERAY_GEN_AUTOSCALER_START_CMD: it is managed by KubeRay "
            "and injected automatically into the autoscaler container"
        )
    return None


def history_server_needs_gate(cluster: Json, annotations: Json, version: str) -> str | None:
    # ValidateRayClusterSpec (utils/validation.go), 1.7: RayClusterHistoryServer is off.
    if _has(cluster, "historyServerOptions") and not gate(version, "RayClusterHistoryServer"):
        return "RayClusterHistoryServer feature gate is not enabled"
    return None


def token_auth_needs_ray_version(cluster: Json, annotations: Json, version: str) -> str | None:
    # ValidateRayClusterSpec (utils/validation.go), 1.5.1-1.7: authOptions.mode token needs rayVersion >= 2.52.0.
    if not token_auth_enabled(cluster):
        return None
    ray_version = _str(cluster.get("rayVersion"))
    if not ray_version:
        return "authOptions.mode is 'token' but RayVersion was not specified. Ray version 2.52.0 or later is required"
    try:
        parsed = parse_generic(ray_version)
    except ValueError as error:
        return f"authOptions.mode is 'token' but RayVersion format is invalid: {ray_version}, {error}"
    if parsed.less_than(parse_generic(MIN_TOKEN_AUTH_RAY_VERSION)):
        return f"authOptions.mode is 'token' but minimum Ray version is 2.52.0, got {ray_version}"
    return None


def network_policy_needs_gate(cluster: Json, annotations: Json, version: str) -> str | None:
    # ValidateRayClusterSpec (utils/validation.go), 1.7: RayClusterNetworkPolicy is off.
    if _has(cluster, "networkPolicy") and not gate(version, "RayClusterNetworkPolicy"):
        return "spec.networkPolicy requires the RayClusterNetworkPolicy feature gate to be enabled"
    return None


def tls_options_need_gate(cluster: Json, annotations: Json, version: str) -> str | None:
    # ValidateRayClusterSpec (utils/validation.go), 1.7: RayClusterMTLS is off.
    if _has(cluster, "tlsOptions") and not gate(version, "RayClusterMTLS"):
        return "spec.tlsOptions requires the RayClusterMTLS feature gate to be enabled"
    return None


# --------------------------------------------------------------------------- ValidateRayJobSpec: tail


def _go_json_kind(value: Any) -> str:
    """The JSON type sigs.k8s.io/yaml makes of a YAML document (timestamps become strings)."""
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str | datetime.date):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"


def runtime_env_yaml_invalid(rayjob: Json, version: str) -> str | None:
    # ValidateRayJobSpec -> dashboardclient.UnmarshalRuntimeEnvYAML (utils/dashboardclient), 1.5.1-1.7:
    # sigs.k8s.io/yaml into map[string]any, so the YAML must be empty, null or a mapping.
    text = _str(spec_of(rayjob).get("runtimeEnvYAML"))
    prefix = f"failed to unmarshal RuntimeEnvYAML: {text}: "
    try:
        documents = list(yaml.safe_load_all(text))
    except yaml.YAMLError as error:
        problem = getattr(error, "problem", None) or str(error)
        return prefix + f"error converting YAML to JSON: yaml: {problem}"
    except TypeError as error:  # an unhashable mapping key
        return prefix + f"error converting YAML to JSON: {error}"
    document = documents[0] if documents else None
    if document is None or isinstance(document, dict):
        return None
    return (
        prefix + "error unmarshaling JSON: while decoding JSON: json: cannot unmarshal "
        f"{_go_json_kind(document)} into Go value of type types.RuntimeEnvType"
    )


def active_deadline_not_positive(rayjob: Json, version: str) -> str | None:
    # ValidateRayJobSpec (utils/validation.go), 1.5.1-1.7.
    spec = spec_of(rayjob)
    if _has(spec, "activeDeadlineSeconds") and _int(spec["activeDeadlineSeconds"]) <= 0:
        return SPEC_INVALID + "activeDeadlineSeconds must be a positive integer"
    return None


def pre_running_deadline_not_positive(rayjob: Json, version: str) -> str | None:
    # ValidateRayJobSpec (utils/validation.go), 1.6-1.7 (1.5.1's CRD prunes the field).
    spec = spec_of(rayjob)
    if _has(spec, "preRunningDeadlineSeconds") and _int(spec["preRunningDeadlineSeconds"]) <= 0:
        return SPEC_INVALID + "preRunningDeadlineSeconds must be a positive integer"
    return None


def backoff_limit_negative(rayjob: Json, version: str) -> str | None:
    # ValidateRayJobSpec (utils/validation.go), 1.5.1-1.7 (sic: "positive" for >= 0).
    spec = spec_of(rayjob)
    if _has(spec, "backoffLimit") and _int(spec["backoffLimit"]) < 0:
        return SPEC_INVALID + "backoffLimit must be a positive integer"
    return None


def waiting_needs_interactive(rayjob: Json, version: str) -> str | None:
    # ValidateRayJobStatus (utils/validation.go), 1.5.1-1.7.
    status = _map(rayjob.get("status"))
    if status.get("jobDeploymentStatus") == "Waiting" and _submission_mode(rayjob) != "InteractiveMode":
        return "The RayJob status is invalid: JobDeploymentStatus cannot be `Waiting` when SubmissionMode is not InteractiveMode"
    return None


# --------------------------------------------------------------------------- the rule table

_RuleFn = Callable[[Json, str], str | None]
_META = "ValidateRayJobMetadata (utils/validation.go)"
_SPEC = "ValidateRayJobSpec (utils/validation.go)"
_DELETION = "validateDeletionConfiguration (utils/validation.go)"
_LEGACY = "validateLegacyDeletionPolicies (utils/validation.go)"
_CLUSTER = "ValidateRayClusterSpec (utils/validation.go)"

_TABLE: tuple[tuple[str, str, tuple[str, ...], _RuleFn], ...] = (
    ("rayjob-name-too-long", _META, ALL, rayjob_name_too_long),
    ("rayjob-name-not-dns-1035", _META, ALL, rayjob_name_not_dns1035),
    ("suspend-needs-shutdown", _SPEC, ALL, suspend_needs_shutdown),
    ("ttl-negative", _SPEC, ALL, ttl_negative),
    ("ttl-needs-shutdown", _DELETION, ALL, ttl_needs_shutdown),
    ("deletion-strategy-needs-feature-gate", _DELETION, ONLY_151, deletion_strategy_needs_gate),
    ("deletion-rules-exclude-shutdown", _DELETION, FROM_16, deletion_rules_exclude_shutdown),
    ("deletion-rules-exclude-legacy", _DELETION, FROM_16, deletion_rules_exclude_legacy),
    ("legacy-deletion-needs-both", _LEGACY, FROM_16, legacy_deletion_needs_both),
    ("legacy-deletion-policy-unset", _LEGACY, FROM_16, legacy_deletion_policy_unset),
    ("legacy-deletion-cluster-selector", _LEGACY, FROM_16, legacy_deletion_cluster_selector),
    ("legacy-deletion-workers-with-autoscaling", _LEGACY, FROM_16, legacy_deletion_workers_with_autoscaling),
    (
        "legacy-deletion-shutdown-with-delete-none",
        _LEGACY,
        FROM_16,
        legacy_deletion_shutdown_with_delete_none,
    ),
    (
        "deletion-rules-invalid",
        "validateDeletionRules (utils/validation.go)",
        FROM_16,
        deletion_rules_invalid,
    ),
    ("deletion-strategy-empty", _DELETION, FROM_16, deletion_strategy_empty),
    ("cluster-selector-no-suspend", _SPEC, ALL, cluster_selector_no_suspend),
    ("cluster-spec-or-selector-required", _SPEC, ALL, cluster_spec_or_selector),
    ("cluster-selector-needs-cluster-name", _SPEC, ALL, cluster_selector_needs_name),
    ("cluster-selector-not-in-sidecar-mode", _SPEC, ALL, cluster_selector_not_sidecar),
    ("cluster-selector-no-backoff-limit", _SPEC, FROM_16, cluster_selector_no_backoff),
    ("interactive-mode-no-backoff-limit", _SPEC, ALL, interactive_no_backoff),
    ("sidecar-mode-no-submitter-pod-template", _SPEC, ALL, sidecar_no_submitter_template),
    ("sidecar-mode-no-submitter-config", _SPEC, ALL, sidecar_no_submitter_config),
    ("sidecar-mode-head-restart-policy", _SPEC, ALL, sidecar_head_restart_policy),
    ("rayjob-k8s-token-auth-unsupported", _SPEC, FROM_16, rayjob_k8s_token_auth),
    ("head-container-missing", _CLUSTER, ALL, _in_cluster(head_container_missing)),
    (
        "head-resources-in-two-places",
        f"validateRayGroupResources {_VALIDATION}",
        ALL,
        _in_cluster(head_resources_twice),
    ),
    (
        "head-labels-in-ray-start-params",
        f"validateRayGroupLabels {_VALIDATION}",
        ALL,
        _in_cluster(head_labels_param),
    ),
    ("head-label-syntax", f"validateRayGroupLabels {_VALIDATION}", ALL, _in_cluster(head_label_syntax)),
    *((rule.name, rule.go_function, rule.versions, _loop_rule(rule.name)) for rule in WORKER_LOOP),
    ("ft-annotation-and-options", _CLUSTER, ALL, _in_cluster(ft_annotation_and_options)),
    ("redis-address-needs-ft-options", _CLUSTER, ALL, _in_cluster(redis_address_needs_ft)),
    ("ft-options-no-redis-password-param", _CLUSTER, ALL, _in_cluster(ft_no_redis_password_param)),
    ("ft-options-no-redis-password-env", _CLUSTER, ALL, _in_cluster(ft_no_redis_password_env)),
    ("ft-options-no-redis-address-env", _CLUSTER, ALL, _in_cluster(ft_no_redis_address_env)),
    (
        "ft-options-no-external-storage-annotation",
        _CLUSTER,
        ALL,
        _in_cluster(ft_no_external_storage_annotation),
    ),
    (
        "ft-rocksdb-needs-feature-gate",
        f"validateGcsFaultToleranceBackend {_VALIDATION}",
        ONLY_17,
        _in_cluster(ft_rocksdb_needs_gate),
    ),
    (
        "ft-redis-backend-no-storage",
        f"validateGcsFaultToleranceBackend {_VALIDATION}",
        ONLY_17,
        _in_cluster(ft_redis_no_storage),
    ),
    ("redis-username-not-in-params-or-env", _CLUSTER, ALL, _in_cluster(redis_username)),
    ("worker-suspend-needs-deletion-policy-gate", _CLUSTER, ONLY_151, _in_cluster(worker_suspend_needs_gate)),
    ("autoscaler-v2-env-needs-autoscaling", _CLUSTER, ALL, _in_cluster(v2_env_needs_autoscaling)),
    ("worker-suspend-with-autoscaler", _CLUSTER, FROM_16, _in_cluster(worker_suspend_with_autoscaler)),
    ("autoscaler-version-and-env-both-set", _CLUSTER, ALL, _in_cluster(autoscaler_version_and_env)),
    ("autoscaler-v2-head-restart-policy", _CLUSTER, ALL, _in_cluster(v2_head_restart_policy)),
    ("autoscaler-v2-worker-restart-policy", _CLUSTER, ALL, _in_cluster(v2_worker_restart_policy)),
    ("autoscaler-idle-timeout-negative", _CLUSTER, FROM_16, _in_cluster(autoscaler_idle_timeout_negative)),
    ("autoscaler-env-no-generated-start-cmd", _CLUSTER, ONLY_17, _in_cluster(autoscaler_env_start_cmd)),
    ("history-server-needs-feature-gate", _CLUSTER, ONLY_17, _in_cluster(history_server_needs_gate)),
    ("token-auth-needs-ray-version", _CLUSTER, ALL, _in_cluster(token_auth_needs_ray_version)),
    ("network-policy-needs-feature-gate", _CLUSTER, ONLY_17, _in_cluster(network_policy_needs_gate)),
    ("tls-options-need-feature-gate", _CLUSTER, ONLY_17, _in_cluster(tls_options_need_gate)),
    ("runtime-env-yaml-invalid", _SPEC, ALL, runtime_env_yaml_invalid),
    ("active-deadline-not-positive", _SPEC, ALL, active_deadline_not_positive),
    ("pre-running-deadline-not-positive", _SPEC, FROM_16, pre_running_deadline_not_positive),
    ("backoff-limit-negative", _SPEC, ALL, backoff_limit_negative),
    (
        "waiting-needs-interactive-mode",
        "ValidateRayJobStatus (utils/validation.go)",
        ALL,
        waiting_needs_interactive,
    ),
)


def _bind(fn: _RuleFn, version: str) -> Callable[[Json], str | None]:
    def check(rayjob: Json) -> str | None:
        return fn(rayjob, version)

    return check


def rule_names() -> tuple[str, ...]:
    """Every rule of every version, in evaluation order."""
    return tuple(name for name, _, _, _ in _TABLE)


def rules_for(version: str) -> tuple[Rule, ...]:
    """The rules KubeRay ``version`` runs on a RayJob, in its evaluation order."""
    _check_version(version)
    return tuple(
        Rule(name=name, go_function=go_function, versions=versions, check=_bind(fn, version))
        for name, go_function, versions, fn in _TABLE
        if version in versions
    )


def validate_rayjob(rayjob: Json, version: str) -> str | None:
    """What KubeRay ``version`` writes to ``status.message`` when it refuses ``rayjob``; None: accepted."""
    for rule in rules_for(version):
        message = rule.check(rayjob)
        if message is not None:
            return message
    return None


# --------------------------------------------------------------------------- served CRD schemas

_NO_16 = (
    "spec.rayClusterSpec.autoscalerOptions.args",
    "spec.rayClusterSpec.autoscalerOptions.command",
    "spec.rayClusterSpec.gcsFaultToleranceOptions.backend",
    "spec.rayClusterSpec.gcsFaultToleranceOptions.storage",
    "spec.rayClusterSpec.headGroupSpec.ingressOptions",
    "spec.rayClusterSpec.headGroupSpec.template.spec.schedulingGroup",
    "spec.rayClusterSpec.historyServerOptions",
    "spec.rayClusterSpec.networkPolicy",
    "spec.rayClusterSpec.tlsOptions",
    "spec.rayClusterSpec.workerGroupSpecs[].priority",
    "spec.rayClusterSpec.workerGroupSpecs[].template.spec.schedulingGroup",
    "spec.submitterPodTemplate.spec.schedulingGroup",
    "status.jobStatusCheckFailureStartTime",
)
_NO_151 = (
    *_NO_16,
    "spec.deletionStrategy.deletionRules[].condition.jobDeploymentStatus",
    "spec.preRunningDeadlineSeconds",
    "spec.rayClusterSpec.authOptions.enableK8sTokenAuth",
    "spec.rayClusterSpec.authOptions.secretName",
    "spec.rayClusterSpec.upgradeStrategy",
    "spec.rayClusterSpec.headGroupSpec.template.spec.volumes[].projected.sources[].podCertificate.userAnnotations",
    "spec.rayClusterSpec.workerGroupSpecs[].template.spec.volumes[].projected.sources[].podCertificate.userAnnotations",
    "spec.submitterPodTemplate.spec.volumes[].projected.sources[].podCertificate.userAnnotations",
)
NOT_SERVED: dict[str, tuple[str, ...]] = {
    # v1 RayJob schema paths of the v1.7.0 CRD that each version's CRD lacks, from
    # `git show <tag>:ray-operator/config/crd/bases/ray.io_rayjobs.yaml` (1.6.0 and 1.6.2 are identical).
    "1.7": (),
    "1.6": _NO_16,
    "1.5.1": _NO_151,
    "1.5.0": (*_NO_151, "spec.rayClusterSpec.authOptions"),
}
_REQUIRED_BEFORE: dict[str, dict[str, tuple[str, ...]]] = {
    # `required` lists an older CRD had and v1.7.0 dropped.
    "1.7": {},
    "1.6": {"spec.rayClusterSpec.gcsFaultToleranceOptions": ("redisAddress",)},
    "1.5.1": {
        "spec.rayClusterSpec.gcsFaultToleranceOptions": ("redisAddress",),
        "spec.deletionStrategy.deletionRules[].condition": ("jobStatus",),
    },
}
_REQUIRED_BEFORE["1.5.0"] = _REQUIRED_BEFORE["1.5.1"]


def _schema_at(root: dict[str, Any], path: str) -> dict[str, Any] | None:
    node: dict[str, Any] | None = root
    for part in path.split("."):
        items = part.endswith("[]")
        key = part.removesuffix("[]")
        node = (node or {}).get("properties", {}).get(key)
        while node is not None and items:
            node = node.get("items")
            items = False
        if node is None:
            return None
    return node


def _remove(root: dict[str, Any], path: str) -> None:
    parent_path, _, leaf = path.rpartition(".")
    parent = _schema_at(root, parent_path) if parent_path else root
    if parent is None:
        return
    parent.get("properties", {}).pop(leaf, None)
    if leaf in parent.get("required", []):
        parent["required"] = [name for name in parent["required"] if name != leaf]


def served_rayjob_crd(crd_v17: Mapping[str, Any], version: str) -> dict[str, Any]:
    """The ``rayjobs.ray.io`` CRD KubeRay ``version`` installs, made from v1.7.0's.

    Every ``spec.versions[*]`` schema loses the properties ``version`` does not declare (the
    API server prunes them from stored RayJobs, silently); ``required`` lists and CEL rules
    about them follow that version's CRD. Other differences (descriptions, the pod spec of the
    Kubernetes release each KubeRay was generated against) are not reproduced.
    """
    if version not in CRD_VERSIONS:
        raise ValueError(f"unknown KubeRay CRD version {version!r}; one of {CRD_VERSIONS}")
    crd = copy.deepcopy(dict(crd_v17))
    for served in crd.get("spec", {}).get("versions", []):
        root = served.get("schema", {}).get("openAPIV3Schema")
        if not isinstance(root, dict):
            continue
        for path in NOT_SERVED[version]:
            _remove(root, path)
        for path, required in _REQUIRED_BEFORE[version].items():
            node = _schema_at(root, path)
            if node is not None:
                node["required"] = list(required)
                if path.endswith("condition"):
                    node.pop("x-kubernetes-validations", None)  # they name jobDeploymentStatus
    return crd
