"""The RayJobs the operator builds, against KubeRay's behaviour (``tests/kube/kuberay_rules.py``, ``kuberay_lifecycle.py``).

Three parts: every validation rule of every supported KubeRay version fires on a RayJob broken
in exactly its way, and only where that version has it; every RayJob the operator builds (the
examples, and the manifests the fuzzer accepts) passes every rule of every version; and the
RayJob state machine moves as KubeRay's does, one reconcile pass at a time.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import re
import sys
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings

from hybridflow.spec import SpecError, in_cluster_problems, parse_job_manifest
from hybridflow_operator.builders import JobRef, RayJobDefaults, build_rayjob
from hybridflow_operator.kuberay import (
    ASSUMED_CURRENT,
    RAY_VERSION,
    SUPPORTED_KUBERAY,
    KubeRayFeatures,
    features_from_crd,
)
from kube.kuberay_lifecycle import (
    FINALIZER,
    RAND_ALPHABET,
    ClusterObservation,
    LifecycleStep,
    reconcile_rayjob,
    submitter_job_failed,
)
from kube.kuberay_rules import (
    CRD_VERSIONS,
    KUBERAY_VERSIONS,
    parse_generic,
    rule_names,
    rules_for,
    served_rayjob_crd,
    validate_rayjob,
)

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "fuzz"))  # the fuzzer's modules import each other by bare name
from manifests import manifests  # noqa: E402

pytestmark = pytest.mark.unit

EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
KUBERAY_RAYJOB_CRD = ROOT.parent / "shared" / "kuberay" / "ray.io_rayjobs.yaml"
DEFAULTS = RayJobDefaults(image="registry.example.com/hybridflow:0.1.0")
UID = "5f0c6b7e-2a4d-4c1e-9a53-0d1e2f3a4b5c"
FUZZ_CASES = 1000
TALLY = {"cases": 0, "accepted": 0}
Json = dict[str, Any]


@functools.cache
def kuberay_crd() -> Json | None:
    if not KUBERAY_RAYJOB_CRD.is_file():
        return None
    crd: Json = yaml.load(
        KUBERAY_RAYJOB_CRD.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    )
    return crd


@functools.cache
def served_schema(version: str) -> Json | None:
    """The v1 RayJob schema KubeRay ``version`` serves (None without the v1.7 CRD at hand)."""
    crd = kuberay_crd()
    if crd is None:
        return None
    [served] = [v for v in served_rayjob_crd(crd, version)["spec"]["versions"] if v["name"] == "v1"]
    schema: Json = served["schema"]["openAPIV3Schema"]
    return schema


@functools.cache
def features_of(version: str) -> KubeRayFeatures:
    """What the operator reads from the CRD of KubeRay ``version`` (the current set without the CRD)."""
    crd = kuberay_crd()
    return ASSUMED_CURRENT if crd is None else features_from_crd(served_rayjob_crd(crd, version))


def in_cluster(manifest: Json, namespace: str = "research") -> Json:
    manifest = copy.deepcopy(manifest)
    manifest["metadata"].update(namespace=namespace, uid=UID)
    return manifest


def built(manifest: Json, version: str = "1.7", attempt: int = 1) -> Json:
    job = parse_job_manifest(in_cluster(manifest), "test")
    return build_rayjob(job, JobRef.of(job), attempt=attempt, defaults=DEFAULTS, kuberay=features_of(version))


@functools.cache
def _base() -> Json:
    return built(yaml.safe_load((ROOT / "examples" / "grpo-cluster.yaml").read_text()))


def base() -> Json:
    """A valid RayJob as the operator builds it (one worker group, token auth, rayVersion)."""
    return copy.deepcopy(_base())


# --------------------------------------------------------------------------- one breakage per rule


def _cluster(rj: Json) -> Json:
    cluster: Json = rj["spec"]["rayClusterSpec"]
    return cluster


def _head(rj: Json) -> Json:
    head: Json = _cluster(rj)["headGroupSpec"]
    return head


def _worker(rj: Json) -> Json:
    worker: Json = _cluster(rj)["workerGroupSpecs"][0]
    return worker


Edit = Callable[[Json], object]


def edits(*steps: Edit) -> Edit:
    """Apply ``steps`` in order."""

    def apply(rj: Json) -> None:
        for step in steps:
            step(rj)

    return apply


def _head_env(name: str, value: str = "x") -> Edit:
    def apply(rj: Json) -> None:
        _head(rj)["template"]["spec"]["containers"][0].setdefault("env", []).append(
            {"name": name, "value": value}
        )

    return apply


def _legacy(success: str, failure: str) -> Edit:
    def apply(rj: Json) -> None:
        rj["spec"]["deletionStrategy"] = {"onSuccess": {"policy": success}, "onFailure": {"policy": failure}}

    return apply


def _no_shutdown(rj: Json) -> None:
    rj["spec"].update(shutdownAfterJobFinishes=False, ttlSecondsAfterFinished=0, suspend=False)


def _sidecar(rj: Json) -> None:
    rj["spec"]["submissionMode"] = "SidecarMode"
    del rj["spec"]["submitterPodTemplate"]
    del rj["spec"]["submitterConfig"]  # K8sJobMode's: a sidecar submitter has no Job


def _selector(rj: Json) -> None:
    rj["spec"]["clusterSelector"] = {"ray.io/cluster": "shared-cluster"}


def _autoscaling(version: str | None = None) -> Edit:
    def apply(rj: Json) -> None:
        _cluster(rj)["enableInTreeAutoscaling"] = True
        if version is not None:
            _cluster(rj)["autoscalerOptions"] = {"version": version}

    return apply


def _ft(**extra: Any) -> Edit:
    def apply(rj: Json) -> None:
        _cluster(rj)["gcsFaultToleranceOptions"] = {"redisAddress": "redis:6379", **extra}

    return apply


def _annotate(key: str, value: str) -> Edit:
    def apply(rj: Json) -> None:
        rj["metadata"].setdefault("annotations", {})[key] = value

    return apply


def _rules_then(rj: Json, rules: list[Json]) -> None:
    _no_shutdown(rj)
    rj["spec"]["deletionStrategy"] = {"deletionRules": rules}


BREAKERS: dict[str, Edit] = {
    "rayjob-name-too-long": lambda rj: rj["metadata"].update(name="a" * 48),
    "rayjob-name-not-dns-1035": lambda rj: rj["metadata"].update(name="Grpo_Cluster-1"),
    "suspend-needs-shutdown": lambda rj: rj["spec"].update(suspend=True, shutdownAfterJobFinishes=False),
    "ttl-negative": lambda rj: rj["spec"].update(ttlSecondsAfterFinished=-1),
    "ttl-needs-shutdown": lambda rj: rj["spec"].update(
        shutdownAfterJobFinishes=False, ttlSecondsAfterFinished=60
    ),
    "deletion-strategy-needs-feature-gate": _legacy("DeleteCluster", "DeleteCluster"),
    "deletion-rules-exclude-shutdown": lambda rj: rj["spec"].update(
        deletionStrategy={
            "deletionRules": [{"policy": "DeleteCluster", "condition": {"jobStatus": "SUCCEEDED"}}]
        }
    ),
    "deletion-rules-exclude-legacy": edits(
        _no_shutdown,
        lambda rj: rj["spec"].update(
            deletionStrategy={
                "onSuccess": {"policy": "DeleteCluster"},
                "deletionRules": [{"policy": "DeleteCluster", "condition": {"jobStatus": "SUCCEEDED"}}],
            }
        ),
    ),
    "legacy-deletion-needs-both": lambda rj: rj["spec"].update(
        deletionStrategy={"onSuccess": {"policy": "DeleteCluster"}}
    ),
    "legacy-deletion-policy-unset": lambda rj: rj["spec"].update(
        deletionStrategy={"onSuccess": {}, "onFailure": {"policy": "DeleteCluster"}}
    ),
    "legacy-deletion-cluster-selector": edits(_selector, _legacy("DeleteCluster", "DeleteSelf")),
    "legacy-deletion-workers-with-autoscaling": edits(
        _autoscaling(), _legacy("DeleteWorkers", "DeleteCluster")
    ),
    "legacy-deletion-shutdown-with-delete-none": _legacy("DeleteNone", "DeleteCluster"),
    "deletion-rules-invalid": lambda rj: _rules_then(
        rj,
        [
            {"policy": "DeleteCluster", "condition": {"jobStatus": "FAILED", "ttlSeconds": 60}},
            {"policy": "DeleteSelf", "condition": {"jobStatus": "FAILED", "ttlSeconds": 10}},
        ],
    ),
    "deletion-strategy-empty": lambda rj: rj["spec"].update(deletionStrategy={}),
    "cluster-selector-no-suspend": edits(_selector, lambda rj: rj["spec"].update(suspend=True)),
    "cluster-spec-or-selector-required": lambda rj: rj["spec"].pop("rayClusterSpec"),
    "cluster-selector-needs-cluster-name": lambda rj: rj["spec"].update(clusterSelector={"team": "rl"}),
    "cluster-selector-not-in-sidecar-mode": edits(_selector, _sidecar),
    "cluster-selector-no-backoff-limit": edits(_selector, lambda rj: rj["spec"].update(backoffLimit=2)),
    "interactive-mode-no-backoff-limit": lambda rj: rj["spec"].update(
        submissionMode="InteractiveMode", backoffLimit=1
    ),
    "sidecar-mode-no-submitter-pod-template": lambda rj: (
        rj["spec"].update(submissionMode="SidecarMode"),
        rj["spec"].pop("submitterConfig"),
    ),
    "sidecar-mode-no-submitter-config": edits(_sidecar, lambda rj: rj["spec"].update(submitterConfig={})),
    "sidecar-mode-head-restart-policy": edits(
        _sidecar, lambda rj: _head(rj)["template"]["spec"].update(restartPolicy="Always")
    ),
    "rayjob-k8s-token-auth-unsupported": lambda rj: _cluster(rj)["authOptions"].update(
        enableK8sTokenAuth=True
    ),
    "head-container-missing": lambda rj: _head(rj)["template"]["spec"].update(containers=[]),
    "head-resources-in-two-places": lambda rj: _head(rj).update(resources={"CPU": "2"}),
    "head-labels-in-ray-start-params": lambda rj: _head(rj)["rayStartParams"].update(labels="zone=a"),
    "head-label-syntax": lambda rj: _head(rj).update(labels={"zone": "not a label value"}),
    "worker-container-missing": lambda rj: _worker(rj)["template"]["spec"].update(containers=[]),
    "worker-replicas-unset": lambda rj: _worker(rj).pop("minReplicas"),
    "worker-min-replicas-negative": lambda rj: _worker(rj).update(minReplicas=-1),
    "worker-max-replicas-negative": lambda rj: _worker(rj).update(maxReplicas=-1),
    "worker-min-above-max": lambda rj: _worker(rj).update(minReplicas=2, maxReplicas=1),
    "worker-resources-in-two-places": lambda rj: _worker(rj).update(resources={"GPU": "2"}),
    "worker-labels-in-ray-start-params": lambda rj: _worker(rj)["rayStartParams"].update(labels=""),
    "worker-label-syntax": lambda rj: _worker(rj).update(labels={"example.com/a/b": "ok"}),
    "worker-idle-timeout-negative": lambda rj: _worker(rj).update(idleTimeoutSeconds=-5),
    "worker-idle-timeout-needs-autoscaler-v2": lambda rj: _worker(rj).update(idleTimeoutSeconds=60),
    "worker-priority-needs-ray-version": edits(
        lambda rj: _worker(rj).update(priority=1), lambda rj: _cluster(rj).update(rayVersion="2.55.0")
    ),
    "worker-priority-needs-autoscaler-v2": lambda rj: _worker(rj).update(priority=1),
    "ft-annotation-and-options": edits(_ft(), _annotate("ray.io/ft-enabled", "true")),
    "redis-address-needs-ft-options": _head_env("RAY_REDIS_ADDRESS", "redis:6379"),
    "ft-options-no-redis-password-param": edits(
        _ft(), lambda rj: _head(rj)["rayStartParams"].update({"redis-password": "x"})
    ),
    "ft-options-no-redis-password-env": edits(_ft(), _head_env("REDIS_PASSWORD")),
    "ft-options-no-redis-address-env": edits(_ft(), _head_env("RAY_REDIS_ADDRESS")),
    "ft-options-no-external-storage-annotation": edits(
        _ft(), _annotate("ray.io/external-storage-namespace", "ns")
    ),
    "ft-rocksdb-needs-feature-gate": lambda rj: _cluster(rj).update(
        gcsFaultToleranceOptions={"backend": "rocksdb"}
    ),
    "ft-redis-backend-no-storage": _ft(storage={"size": "1Gi"}),
    "redis-username-not-in-params-or-env": _head_env("REDIS_USERNAME"),
    "worker-suspend-needs-deletion-policy-gate": lambda rj: _worker(rj).update(suspend=True),
    "autoscaler-v2-env-needs-autoscaling": _head_env("RAY_enable_autoscaler_v2", "true"),
    "worker-suspend-with-autoscaler": edits(_autoscaling(), lambda rj: _worker(rj).update(suspend=True)),
    "autoscaler-version-and-env-both-set": edits(
        _autoscaling("v1"), _head_env("RAY_enable_autoscaler_v2", "0")
    ),
    "autoscaler-v2-head-restart-policy": edits(
        _autoscaling("v2"), lambda rj: _head(rj)["template"]["spec"].update(restartPolicy="OnFailure")
    ),
    "autoscaler-v2-worker-restart-policy": edits(
        _autoscaling("v2"), lambda rj: _worker(rj)["template"]["spec"].update(restartPolicy="Always")
    ),
    "autoscaler-idle-timeout-negative": lambda rj: _cluster(rj).update(
        autoscalerOptions={"idleTimeoutSeconds": -1}
    ),
    "autoscaler-env-no-generated-start-cmd": lambda rj: _cluster(rj).update(
        autoscalerOptions={"env": [{"name": "KUBERAY_GEN_AUTOSCALER_START_CMD", "value": "ray"}]}
    ),
    "history-server-needs-feature-gate": lambda rj: _cluster(rj).update(historyServerOptions={}),
    "token-auth-needs-ray-version": lambda rj: _cluster(rj).pop("rayVersion"),
    "network-policy-needs-feature-gate": lambda rj: _cluster(rj).update(networkPolicy={}),
    "tls-options-need-feature-gate": lambda rj: _cluster(rj).update(tlsOptions={"enabled": True}),
    "runtime-env-yaml-invalid": lambda rj: rj["spec"].update(runtimeEnvYAML="- pip: [torch]"),
    "active-deadline-not-positive": lambda rj: rj["spec"].update(activeDeadlineSeconds=0),
    "pre-running-deadline-not-positive": lambda rj: rj["spec"].update(preRunningDeadlineSeconds=0),
    "backoff-limit-negative": lambda rj: rj["spec"].update(backoffLimit=-1),
    "waiting-needs-interactive-mode": lambda rj: rj.update(status={"jobDeploymentStatus": "Waiting"}),
}


def broken(name: str) -> Json:
    rj = base()
    BREAKERS[name](rj)
    return rj


def versions_of(name: str) -> tuple[str, ...]:
    return next(rule.versions for v in KUBERAY_VERSIONS for rule in rules_for(v) if rule.name == name)


def test_every_rule_has_a_breakage_and_names_its_go_function() -> None:
    assert set(BREAKERS) == set(rule_names())
    assert KUBERAY_VERSIONS == SUPPORTED_KUBERAY
    for version in KUBERAY_VERSIONS:
        rules = rules_for(version)
        assert len({rule.name for rule in rules}) == len(rules)
        for rule in rules:
            assert version in rule.versions and set(rule.versions) <= set(KUBERAY_VERSIONS)
            assert rule.go_function.endswith(".go)") and rule.go_function[0].isalpha(), rule


@pytest.mark.parametrize("version", KUBERAY_VERSIONS)
@pytest.mark.parametrize("name", rule_names())
def test_each_rule_rejects_its_breakage_where_kuberay_has_it(name: str, version: str) -> None:
    rayjob = broken(name)
    result = validate_rayjob(rayjob, version)
    if version in versions_of(name):
        [rule] = [rule for rule in rules_for(version) if rule.name == name]
        message = rule.check(rayjob)
        assert message is not None, f"{name} does not fire on its breakage"
        assert result == message
        others = [other.name for other in rules_for(version) if other.name != name and other.check(rayjob)]
        assert others == [], f"the breakage of {name} also trips {others}"
    else:
        messages = {
            rule.check(rayjob) for v in versions_of(name) for rule in rules_for(v) if rule.name == name
        }
        assert result not in messages


@pytest.mark.parametrize(
    ("ray_version", "message"),
    [
        (
            None,
            "authOptions.mode is 'token' but RayVersion was not specified. Ray version 2.52.0 or later is required",
        ),
        ("2.51.1", "authOptions.mode is 'token' but minimum Ray version is 2.52.0, got 2.51.1"),
        ("2.52", None),
        ("v2.52.0rc1", None),
        (
            "latest",
            "authOptions.mode is 'token' but RayVersion format is invalid: latest, "
            'could not parse "latest" as version',
        ),
        (
            "2",
            "authOptions.mode is 'token' but RayVersion format is invalid: 2, illegal version string \"2\"",
        ),
        (RAY_VERSION, None),
    ],
)
def test_token_auth_needs_a_ray_version_kuberay_parses(ray_version: str | None, message: str | None) -> None:
    rayjob = base()
    if ray_version is None:
        del _cluster(rayjob)["rayVersion"]
    else:
        _cluster(rayjob)["rayVersion"] = ray_version
    for version in KUBERAY_VERSIONS:
        assert validate_rayjob(rayjob, version) == (
            None if message is None else "The RayJob spec is invalid: " + message
        )


def test_parse_generic_is_kubernetes_version_parse_generic() -> None:
    assert parse_generic("2.60.0").components == (2, 60, 0)
    assert parse_generic("  v1.2.3-beta+build").components == (1, 2, 3)
    assert parse_generic("2.52").compare(parse_generic("2.52.0")) == 0
    assert parse_generic("2.52.0.1").compare(parse_generic("2.52")) == 1
    assert parse_generic("2.9.0").less_than(parse_generic("2.52.0"))
    for text, error in [
        ("01.2", 'illegal zero-prefixed version component "01" in "01.2"'),
        ("x1.2", 'could not parse "x1.2" as version'),
        ("2.60.0\n", 'could not parse "2.60.0\\n" as version'),
    ]:
        with pytest.raises(ValueError, match="^" + re.escape(error) + "$"):
            parse_generic(text)


def test_first_failure_follows_gos_worker_group_loop() -> None:
    """The first group's later check wins over the second group's earlier one, as in Go's loop."""
    rayjob = base()
    second = copy.deepcopy(_worker(rayjob))
    second["groupName"] = "second"
    second["template"]["spec"]["containers"] = []
    _worker(rayjob).update(minReplicas=3, maxReplicas=2)
    _cluster(rayjob)["workerGroupSpecs"].append(second)
    assert validate_rayjob(rayjob, "1.7") == (
        "The RayJob spec is invalid: worker group default has minReplicas 3 greater than maxReplicas 2"
    )
    assert validate_rayjob(rayjob, "1.5.1") == (
        "The RayJob spec is invalid: workerGroupSpec should have at least one container"
    )


def test_label_messages_follow_each_versions_apimachinery() -> None:
    rayjob = base()
    _worker(rayjob)["labels"] = {"k": "v" * 64}
    assert validate_rayjob(rayjob, "1.5.1") is not None
    assert "must be no more than 63 characters" in (validate_rayjob(rayjob, "1.5.1") or "")
    assert "must be no more than 63 bytes" in (validate_rayjob(rayjob, "1.7") or "")


# --------------------------------------------------------------------------- what the operator builds


def _accepted(manifest: Json) -> bool:
    try:
        job = parse_job_manifest(in_cluster(manifest, "fuzz"), "fuzz")
    except SpecError:
        return False
    return not in_cluster_problems(job.spec)


def pruned_fields(schema: Json, value: Any, path: str = "") -> list[str]:
    """Fields of ``value`` a CRD with ``schema`` does not declare (the API server drops them)."""
    found: list[str] = []
    if (
        isinstance(value, dict)
        and path != ".metadata"
        and not schema.get("x-kubernetes-preserve-unknown-fields")
    ):
        extra = schema.get("additionalProperties")
        for key, item in value.items():
            child = extra if isinstance(extra, dict) else schema.get("properties", {}).get(key)
            found += [f"{path}.{key}"] if child is None else pruned_fields(child, item, f"{path}.{key}")
    elif isinstance(value, list) and "items" in schema:
        for index, item in enumerate(value):
            found += pruned_fields(schema["items"], item, f"{path}[{index}]")
    return found


@pytest.mark.parametrize("version", KUBERAY_VERSIONS)
@pytest.mark.parametrize("example", EXAMPLES, ids=lambda path: path.name)
def test_every_example_rayjob_passes_every_rule(example: Path, version: str) -> None:
    manifest = yaml.safe_load(example.read_text())
    for attempt in (1, 3):
        rayjob = built(manifest, version, attempt)
        assert _cluster(rayjob).get("rayVersion") == RAY_VERSION, (
            "token auth needs rayVersion (KubeRay >= 1.5.1)"
        )
        assert validate_rayjob(rayjob, version) is None
        schema = served_schema(version)
        if schema is not None:
            assert pruned_fields(schema, rayjob) == [], f"KubeRay {version}'s API server would drop these"


@settings(
    max_examples=FUZZ_CASES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)
@given(manifests())
def test_every_rayjob_built_from_an_accepted_fuzzed_manifest_passes_every_rule(
    case: tuple[Json, list[str]],
) -> None:
    manifest, edits = case
    TALLY["cases"] += 1
    if not _accepted(manifest):
        return
    TALLY["accepted"] += 1
    for version in KUBERAY_VERSIONS:
        rayjob = built(manifest, version)
        assert validate_rayjob(rayjob, version) is None, f"KubeRay {version} refuses it; edits {edits}"
        schema = served_schema(version)
        if schema is not None:
            assert pruned_fields(schema, rayjob) == [], f"KubeRay {version} would drop fields; edits {edits}"


def test_the_fuzzed_manifests_reach_the_builder() -> None:
    """Guard against a fuzzer sample that is all rejections (run together with the test above)."""
    if TALLY["cases"] < FUZZ_CASES:
        pytest.skip("run together with the fuzzed-manifest test")
    assert TALLY["accepted"] >= FUZZ_CASES // 10, TALLY


def test_served_crds_are_what_each_kuberay_installs() -> None:
    crd = kuberay_crd()
    if crd is None:
        pytest.skip(f"the KubeRay v1.7 CRD is not at {KUBERAY_RAYJOB_CRD}")
    assert served_rayjob_crd(crd, "1.7") == crd
    with pytest.raises(ValueError, match="unknown KubeRay version"):
        rules_for("1.5.0")  # 1.5.0 only stands for an unsupported KubeRay's CRD
    expected = {
        "1.5.0": (False, False),
        "1.5.1": (True, False),
        "1.6": (True, True),
        "1.7": (True, True),
    }
    for version in CRD_VERSIONS:
        features = features_from_crd(served_rayjob_crd(crd, version))
        assert (features.token_auth, features.pre_running_deadline) == expected[version], version
        assert features.supported == (version != "1.5.0")
    schema = served_rayjob_crd(crd, "1.5.1")["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    cluster = schema["properties"]["spec"]["properties"]["rayClusterSpec"]["properties"]
    assert set(cluster["authOptions"]["properties"]) == {"mode"}
    assert "networkPolicy" not in cluster and "upgradeStrategy" not in cluster
    assert crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"].get(
        "preRunningDeadlineSeconds"
    ), "served_rayjob_crd must not modify its argument"


# --------------------------------------------------------------------------- the state machine

T0 = datetime(2026, 3, 1, 12, 0, 0, tzinfo=UTC)
NONE = ClusterObservation()
UP = ClusterObservation(exists=True, ready=True)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def stamp(seconds: float) -> str:
    return at(seconds).strftime("%Y-%m-%dT%H:%M:%SZ")


def rayjob(status: Json | None = None, **spec: Any) -> Json:
    """A hand-built K8sJobMode RayJob (finalizer already on unless the status is New)."""
    container = {"name": "ray", "image": "registry.example.com/ray:2.60.0"}
    body: Json = {
        "apiVersion": "ray.io/v1",
        "kind": "RayJob",
        "metadata": {"name": "ppo-1", "namespace": "research", "finalizers": [FINALIZER] if status else []},
        "spec": {
            "entrypoint": "python train.py",
            "submissionMode": "K8sJobMode",
            "shutdownAfterJobFinishes": True,
            "ttlSecondsAfterFinished": 0,
            "backoffLimit": 0,
            "rayClusterSpec": {
                "rayVersion": "2.60.0",
                "authOptions": {"mode": "token"},
                "headGroupSpec": {"rayStartParams": {}, "template": {"spec": {"containers": [container]}}},
                "workerGroupSpecs": [
                    {
                        "groupName": "gpus",
                        "replicas": 2,
                        "minReplicas": 2,
                        "maxReplicas": 2,
                        "rayStartParams": {},
                        "template": {"spec": {"containers": [container]}},
                    }
                ],
            },
            **spec,
        },
    }
    if status is not None:
        body["status"] = status
    return body


def running(**extra: Any) -> Json:
    return {
        "jobId": "ppo-1-abcde",
        "rayClusterName": "ppo-1-fghjk",
        "dashboardURL": "ppo-1-fghjk-head-svc.research.svc.cluster.local:8265",
        "jobStatus": "RUNNING",
        "jobDeploymentStatus": "Running",
        "startTime": stamp(0),
        "failed": 0,
        "succeeded": 0,
        "rayClusterStatus": {"state": "ready"},
        "rayJobInfo": {"startTime": stamp(20)},
        **extra,
    }


def then(body: Json, step: LifecycleStep) -> Json:
    return {**body, "status": step.status}


def test_new_adds_the_finalizer_and_initializes() -> None:
    step = reconcile_rayjob(rayjob(), NONE, now=at(0))
    assert step.actions == ("add-finalizer",)
    assert step.requeue_after_seconds == 3.0
    status = step.status
    assert status["jobDeploymentStatus"] == "Initializing" and status["startTime"] == stamp(0)
    assert status["failed"] == 0 and status["succeeded"] == 0 and "jobStatus" not in status
    for key in ("jobId", "rayClusterName"):
        prefix, suffix = status[key].rsplit("-", 1)
        assert prefix == "ppo-1" and len(suffix) == 5 and set(suffix) <= set(RAND_ALPHABET)
    assert reconcile_rayjob(rayjob(jobId="my-id"), NONE, now=at(0)).status["jobId"] == "my-id"


def test_invalid_rayjob_fails_validation_and_stays_failed() -> None:
    body = rayjob()
    del body["spec"]["rayClusterSpec"]["rayVersion"]
    step = reconcile_rayjob(body, NONE, now=at(0))
    assert step.actions == () and step.requeue_after_seconds is None
    assert step.status == {
        "jobDeploymentStatus": "ValidationFailed",
        "reason": "ValidationFailed",
        "message": "The RayJob spec is invalid: authOptions.mode is 'token' but RayVersion was not specified. "
        "Ray version 2.52.0 or later is required",
        "rayClusterStatus": {},
        "rayJobInfo": {},
    }
    # Fixing the spec later does not help: ValidationFailed is the switch's unknown default case.
    fixed = then(rayjob(), step)
    again = reconcile_rayjob(fixed, UP, now=at(10))
    assert again.status == step.status and again.actions == () and again.requeue_after_seconds == 3.0


def test_initializing_creates_the_cluster_then_waits_for_it() -> None:
    body = rayjob(
        {"jobId": "j", "rayClusterName": "c", "jobDeploymentStatus": "Initializing", "startTime": stamp(0)}
    )
    created = reconcile_rayjob(body, NONE, now=at(3))
    assert created.actions == ("create-cluster",) and created.status == body["status"]
    waiting = reconcile_rayjob(body, ClusterObservation(exists=True), now=at(6))
    assert waiting.actions == () and waiting.status == body["status"] and waiting.requeue_after_seconds == 3.0


def test_a_ready_cluster_gets_the_submitter_and_the_job_runs() -> None:
    body = rayjob(
        {"jobId": "j", "rayClusterName": "c", "jobDeploymentStatus": "Initializing", "startTime": stamp(0)}
    )
    step = reconcile_rayjob(body, UP, now=at(60))
    assert step.actions == ("create-submitter",)
    assert step.status["jobDeploymentStatus"] == "Running"
    assert step.status["dashboardURL"] == "c-head-svc.research.svc.cluster.local:8265"


def test_a_succeeded_job_completes_once_the_submitter_finishes() -> None:
    body = rayjob(running())
    observed = ClusterObservation(
        exists=True, ready=True, job_status="SUCCEEDED", job_message="done", job_start_ms=0, job_end_ms=0
    )
    waiting = reconcile_rayjob(body, observed, now=at(100))
    assert waiting.status["jobDeploymentStatus"] == "Running" and waiting.status["jobStatus"] == "SUCCEEDED"
    end_ms = int(at(95).timestamp() * 1000)
    done = reconcile_rayjob(
        body, dataclasses.replace(observed, submitter_finished=True, job_end_ms=end_ms), now=at(101)
    )
    assert done.status["jobDeploymentStatus"] == "Complete" and done.status["endTime"] == stamp(101)
    assert done.status["succeeded"] == 1 and done.status["failed"] == 0 and done.status["message"] == "done"
    assert done.status["rayJobInfo"] == {"startTime": stamp(20), "endTime": stamp(95)}
    assert "reason" not in done.status


def test_app_failure_with_backoff_limit_0_is_final_and_the_cluster_goes() -> None:
    body = rayjob(running())
    observed = ClusterObservation(
        exists=True,
        ready=True,
        job_status="FAILED",
        job_message="Job entrypoint command failed with exit code 1",
        submitter_finished=True,
    )
    failed = reconcile_rayjob(body, observed, now=at(200))
    assert failed.status["jobDeploymentStatus"] == "Failed" and failed.status["reason"] == "AppFailed"
    assert failed.status["message"] == "Job entrypoint command failed with exit code 1"
    assert failed.status["failed"] == 1 and failed.status["endTime"] == stamp(200)
    cleanup = reconcile_rayjob(then(body, failed), observed, now=at(203))
    assert cleanup.actions == ("delete-cluster",) and cleanup.requeue_after_seconds is None
    assert cleanup.status == failed.status
    gone = reconcile_rayjob(then(body, failed), NONE, now=at(206))
    assert gone.actions == () and gone.status == failed.status


def test_dropped_log_streams_fail_kuberays_default_submitter_but_not_the_operators() -> None:
    """Each drop of ``ray job logs --follow`` fails one submitter pod; KubeRay's default Job fails on
    the third and the RayJob with it (SubmissionFailed), while the job itself still runs."""
    ours = built(yaml.safe_load((ROOT / "examples" / "grpo-cluster.yaml").read_text()), "1.7")
    default = copy.deepcopy(ours)
    del default["spec"]["submitterConfig"]
    drops = 3
    for body, fails in ((default, True), (ours, False)):
        assert submitter_job_failed(body, drops) == fails
        observed = ClusterObservation(
            exists=True, ready=True, job_status="RUNNING", submitter_failed=submitter_job_failed(body, drops)
        )
        step = reconcile_rayjob({**body, "status": running()}, observed, now=at(300))
        assert step.status["jobDeploymentStatus"] == ("Failed" if fails else "Running")
        assert step.status.get("reason", "") == ("SubmissionFailed" if fails else "")
    assert not submitter_job_failed(ours, 10_000)


def test_backoff_limit_retries_on_a_fresh_cluster() -> None:
    body = rayjob(running(), backoffLimit=2)
    observed = ClusterObservation(exists=True, ready=True, job_status="FAILED", submitter_finished=True)
    retrying = reconcile_rayjob(body, observed, now=at(200))
    assert retrying.status["jobDeploymentStatus"] == "Retrying" and retrying.status["failed"] == 1
    assert "endTime" not in retrying.status
    releasing = reconcile_rayjob(then(body, retrying), observed, now=at(203))
    assert releasing.actions == ("delete-cluster", "delete-submitter") and releasing.status == retrying.status
    new = reconcile_rayjob(then(body, retrying), NONE, now=at(206))
    assert new.status == {
        "startTime": stamp(0),
        "failed": 1,
        "succeeded": 0,
        "rayClusterStatus": {},
        "rayJobInfo": {},
    }
    again = reconcile_rayjob(then(body, new), NONE, now=at(209))
    assert again.status["jobDeploymentStatus"] == "Initializing" and again.status["startTime"] == stamp(209)
    assert again.status["rayClusterName"] != retrying.status["rayClusterName"]


def test_suspend_releases_everything_and_resume_starts_over() -> None:
    body = rayjob(running(), suspend=True)
    suspending = reconcile_rayjob(body, UP, now=at(100))
    assert suspending.status["jobDeploymentStatus"] == "Suspending" and suspending.actions == ()
    body = then(body, suspending)
    deleting = reconcile_rayjob(body, UP, now=at(103))
    assert deleting.actions == ("delete-cluster", "delete-submitter") and deleting.status == suspending.status
    suspended = reconcile_rayjob(body, NONE, now=at(106))
    assert suspended.status["jobDeploymentStatus"] == "Suspended"
    for key in ("jobId", "rayClusterName", "dashboardURL", "jobStatus", "message", "reason"):
        assert key not in suspended.status
    assert suspended.status["rayJobInfo"] == {} and suspended.status["startTime"] == stamp(0)
    body = then(body, suspended)
    for version, requeue in (("1.5.1", 3.0), ("1.6", None), ("1.7", None)):
        idle = reconcile_rayjob(body, NONE, now=at(200), version=version)
        assert (
            idle.status == suspended.status and idle.actions == () and idle.requeue_after_seconds == requeue
        )
    unsuspended = {**body, "spec": {**body["spec"], "suspend": False}}
    resumed = reconcile_rayjob(unsuspended, NONE, now=at(300))
    assert "jobDeploymentStatus" not in resumed.status  # New
    restarted = reconcile_rayjob(then(unsuspended, resumed), NONE, now=at(303))
    assert restarted.status["jobDeploymentStatus"] == "Initializing" and restarted.status[
        "startTime"
    ] == stamp(303)


def test_active_deadline_fails_the_job_for_good() -> None:
    body = rayjob(
        {"jobId": "j", "rayClusterName": "c", "jobDeploymentStatus": "Initializing", "startTime": stamp(0)},
        activeDeadlineSeconds=600,
        backoffLimit=3,
    )
    assert reconcile_rayjob(body, NONE, now=at(599)).actions == ("create-cluster",)
    step = reconcile_rayjob(body, NONE, now=at(600))
    assert step.status["jobDeploymentStatus"] == "Failed" and step.status["reason"] == "DeadlineExceeded"
    assert step.status["message"] == (
        "The RayJob has passed the activeDeadlineSeconds. StartTime: 2026-03-01 12:00:00 +0000 UTC. "
        "ActiveDeadlineSeconds: 600"
    )
    assert step.status["endTime"] == stamp(600) and step.actions == ()


@pytest.mark.parametrize("version", KUBERAY_VERSIONS)
def test_pre_running_deadline_fires_from_kuberay_1_6(version: str) -> None:
    status = {
        "jobId": "j",
        "rayClusterName": "c",
        "jobDeploymentStatus": "Initializing",
        "startTime": stamp(0),
    }
    body = rayjob(status, preRunningDeadlineSeconds=900)
    step = reconcile_rayjob(body, ClusterObservation(exists=True), now=at(900), version=version)
    if version == "1.5.1":
        assert step.status == status  # its CRD drops the field; it never fires
        return
    assert step.status["jobDeploymentStatus"] == "Failed"
    assert step.status["reason"] == "PreRunningDeadlineExceeded"
    assert step.status["message"].endswith(
        "StartTime: 2026-03-01 12:00:00 +0000 UTC. PreRunningDeadlineSeconds: 900"
    )
    # Unlike activeDeadlineSeconds, KubeRay retries a missed startup deadline.
    retried = reconcile_rayjob(
        rayjob(status, preRunningDeadlineSeconds=900, backoffLimit=1), NONE, now=at(900), version=version
    )
    assert retried.status["jobDeploymentStatus"] == "Retrying"


def test_ttl_deletes_the_cluster_after_the_end_time() -> None:
    status = running(jobStatus="SUCCEEDED", jobDeploymentStatus="Complete", endTime=stamp(1000), succeeded=1)
    body = rayjob(status, ttlSecondsAfterFinished=600)
    early = reconcile_rayjob(body, UP, now=at(1100))
    assert early.actions == () and early.requeue_after_seconds == pytest.approx(502.0)
    due = reconcile_rayjob(body, UP, now=at(1600))
    assert due.actions == ("delete-cluster",) and due.requeue_after_seconds is None and due.status == status
    kept = reconcile_rayjob(rayjob(status, shutdownAfterJobFinishes=False), UP, now=at(5000))
    assert kept.actions == () and kept.requeue_after_seconds is None


def test_deletion_stops_a_running_job_and_drops_the_finalizer() -> None:
    body = rayjob(running())
    body["metadata"]["deletionTimestamp"] = stamp(300)
    step = reconcile_rayjob(body, UP, now=at(300))
    assert step.actions == ("stop-ray-job", "remove-finalizer") and step.status == body["status"]
    body["status"] = running(jobStatus="SUCCEEDED", jobDeploymentStatus="Complete", endTime=stamp(250))
    assert reconcile_rayjob(body, UP, now=at(300)).actions == ("remove-finalizer",)


def test_a_terminal_ray_job_stuck_in_running_ends_after_the_grace_period() -> None:
    status = running(jobStatus="FAILED", rayJobInfo={"startTime": stamp(20), "endTime": stamp(100)})
    body = rayjob(status)
    observed = ClusterObservation(
        exists=True, ready=True, job_status="FAILED"
    )  # the submitter never finishes
    assert reconcile_rayjob(body, observed, now=at(399)).status == status
    step = reconcile_rayjob(body, observed, now=at(400))
    assert step.status["jobDeploymentStatus"] == "Failed"
    assert step.status["reason"] == "JobDeploymentStatusTransitionGracePeriodExceeded"


def test_submitter_finished_timeout_fails_the_job_whatever_ray_says() -> None:
    body = rayjob(running())
    for job_status in ("RUNNING", "SUCCEEDED"):
        observed = ClusterObservation(
            exists=True,
            ready=True,
            job_status=job_status,
            submitter_finished=True,
            submitter_finished_at=at(100),
        )
        step = reconcile_rayjob(body, observed, now=at(130))
        assert step.status["jobDeploymentStatus"] == "Failed" and step.status["jobStatus"] == "FAILED"
        assert step.status["reason"] == "JobDeploymentStatusTransitionGracePeriodExceeded"
        assert step.status["message"] == (
            "The RayJob submitter finished at 2026-03-01 12:01:40 but the ray job did not reach terminal state within 30s"
        )
    in_time = ClusterObservation(
        exists=True,
        ready=True,
        job_status="SUCCEEDED",
        submitter_finished=True,
        submitter_finished_at=at(100),
    )
    assert reconcile_rayjob(body, in_time, now=at(129)).status["jobDeploymentStatus"] == "Complete"


def test_a_failed_submitter_fails_the_submission() -> None:
    observed = ClusterObservation(exists=True, ready=True, job_status="RUNNING", submitter_failed=True)
    step = reconcile_rayjob(rayjob(running()), observed, now=at(100))
    assert step.status["reason"] == "SubmissionFailed" and step.status["jobDeploymentStatus"] == "Failed"
    assert step.status["message"] == (
        "Job submission has failed. Reason: BackoffLimitExceeded. Message: Job has reached the specified backoff limit"
    )
    gone = ClusterObservation(exists=True, ready=True, submitter_finished=True)
    lost = reconcile_rayjob(rayjob(running()), gone, now=at(100))
    assert lost.status["reason"] == "AppFailed"
    assert lost.status["message"] == "Submitter completed but Ray job not found in RayCluster."


def test_job_status_check_timeout_is_1_7_only_and_final() -> None:
    body = rayjob(running(), backoffLimit=5)
    unreachable = ClusterObservation(exists=True, ready=True, job_info_error=True)
    first = reconcile_rayjob(body, unreachable, now=at(100))
    assert first.status["jobStatusCheckFailureStartTime"] == stamp(100)
    body = then(body, first)
    assert reconcile_rayjob(body, unreachable, now=at(399)).status == first.status
    timed_out = reconcile_rayjob(body, unreachable, now=at(400))
    assert timed_out.status["jobDeploymentStatus"] == "Failed"  # not Retrying, despite backoffLimit
    assert timed_out.status["reason"] == "JobStatusCheckTimeoutExceeded"
    assert timed_out.status["message"] == (
        "Job status checks have been failing since 2026-03-01 12:01:40; exceeded timeout of 300s"
    )
    recovered = reconcile_rayjob(
        body, ClusterObservation(exists=True, ready=True, job_status="RUNNING"), now=at(200)
    )
    assert "jobStatusCheckFailureStartTime" not in recovered.status
    older = reconcile_rayjob(rayjob(running()), unreachable, now=at(100), version="1.6")
    assert older.error is not None and older.status == running()


def test_a_rayjob_managed_elsewhere_is_left_alone() -> None:
    step = reconcile_rayjob(rayjob(managedBy="kueue.x-k8s.io/multikueue"), NONE, now=at(0))
    assert step == LifecycleStep(status={}, actions=(), requeue_after_seconds=None)


@pytest.mark.parametrize("version", KUBERAY_VERSIONS)
def test_a_retry_in_cluster_selector_mode_deletes_the_shared_cluster_only_on_1_5_1(version: str) -> None:
    """1.5.1 lets clusterSelector RayJobs retry and its deleteClusterResources has no selector guard."""
    status = running(
        jobStatus="FAILED", jobDeploymentStatus="Retrying", rayClusterName="shared-cluster", failed=1
    )
    body = rayjob(status, clusterSelector={"ray.io/cluster": "shared-cluster"}, backoffLimit=1)
    step = reconcile_rayjob(
        body,
        ClusterObservation(exists=True, ready=True, submitter_exists=False),
        now=at(300),
        version=version,
    )
    if version == "1.5.1":
        assert step.actions == ("delete-cluster",)
    else:  # 1.6 refuses backoffLimit with clusterSelector, and never deletes a selected cluster
        assert step.status["jobDeploymentStatus"] == "ValidationFailed"
        assert (
            step.status["message"]
            == "The RayJob spec is invalid: BackoffLimit is incompatible with ClusterSelector mode"
        )
