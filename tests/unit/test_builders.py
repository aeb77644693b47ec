"""Builders and names: every child validates against the schema its API server enforces, and is deterministic.

RayJobs are checked against the real KubeRay v1.7 CRD (``../shared/kuberay/``) three ways:
its ``openAPIV3Schema`` with jsonschema, no field that the API server would silently prune
(jsonschema alone accepts unknown keys), and the checks KubeRay's controller runs before it
acts (``ValidateRayJobMetadata``/``ValidateRayJobSpec``), which no schema expresses. Core
objects and the pod templates go through ``kubernetes_validate`` in strict mode.
"""

from __future__ import annotations

import copy
import functools
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from jsonschema import Draft4Validator

from hybridflow.spec import RLHFJob, parse_job_manifest
from hybridflow_operator.builders import (
    CONFIG_KEY,
    CONFIG_PATH,
    ENTRYPOINT,
    JobRef,
    RayJobDefaults,
    build_children,
    build_configmap,
    build_rayjob,
    build_role,
    build_role_binding,
    build_sandbox_network_policy,
    build_service_account,
    pool_resource_name,
)
from hybridflow_operator.builders.rayjob import CONTROLLER_METRICS_PORT, ray_resources_param, scale_quantity
from hybridflow_operator.names import (
    MAX_RAYJOB_NAME_LENGTH,
    child_names,
    job_label_value,
    name_hash,
    rayjob_name,
)
from kube.network_policy import Endpoint, egress_allowed

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
KUBERAY = ROOT.parent / "shared" / "kuberay"
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
DEFAULTS = RayJobDefaults(image="registry.example.com/hybridflow:0.1.0")
UID = "5f0c6b7e-2a4d-4c1e-9a53-0d1e2f3a4b5c"
KUBERNETES_VERSION = "1.33.0"

DNS_1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
DNS_1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")


def in_cluster(manifest: dict[str, Any], namespace: str = "research") -> dict[str, Any]:
    """``manifest`` as the operator reads it from the API server: with a namespace and a uid."""
    manifest = copy.deepcopy(manifest)
    manifest["metadata"].update(namespace=namespace, uid=UID, resourceVersion="123", generation=2)
    return manifest


def example_job(path: Path) -> RLHFJob:
    return parse_job_manifest(in_cluster(yaml.safe_load(path.read_text())), path.name)


def multi_pool_manifest() -> dict[str, Any]:
    """PPO on three pools with everything a cluster job can set."""
    return {
        "apiVersion": "hybridflow.io/v1alpha1",
        "kind": "RLHFJob",
        "metadata": {"name": "ppo-7b"},
        "spec": {
            "models": {
                "actor": {"path": "/models/sft-7b", "tokenizerPath": "/models/tokenizer"},
                "critic": {"path": "/models/rm-7b"},
                "reward": {"path": "/models/rm-7b"},
            },
            "data": {"trainFiles": ["/data/prompts.parquet"]},
            "algorithm": {"name": "ppo"},
            "rollout": {"engine": "vllm", "maxStaleness": 1},
            "training": {
                "backend": "megatron",
                "totalSteps": 500,
                "promptsPerStep": 64,
                "miniBatchSize": 32,
            },
            "resourcePools": [
                {
                    "name": "actor",
                    "nodes": 2,
                    "gpusPerNode": 8,
                    "cpusPerGpu": 8,
                    "memoryPerGpu": "100Gi",
                    "nodeSelector": {"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"},
                    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
                    "affinity": {
                        "nodeAffinity": {
                            "requiredDuringSchedulingIgnoredDuringExecution": {
                                "nodeSelectorTerms": [
                                    {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}
                                ]
                            }
                        }
                    },
                },
                {"name": "critic", "nodes": 1, "gpusPerNode": 8, "memoryPerGpu": "1.5Gi"},
                {"name": "generate", "nodes": 1, "gpusPerNode": 4},
            ],
            "roles": {"actor": "actor", "critic": "critic", "reward": "critic", "rollout": "generate"},
            "checkpoint": {"volume": {"claimName": "ckpt", "mountPath": "/checkpoints"}},
            "volumes": [
                {"claimName": "models", "mountPath": "/models"},
                {"claimName": "data", "mountPath": "/data"},
            ],
            "image": "registry.example.com/hybridflow:0.1.0-cuda",
            "queueName": "team-rl",
            "maxRestarts": 5,
            "activeDeadlineSeconds": 86400,
            "ttlSecondsAfterFinished": 3600,
            "schedulerLabels": {
                "ray.io/scheduler-name": "volcano",
                "volcano.sh/queue-name": "research",
                "hybridflow.io/job": "cannot-override",
            },
        },
    }


def multi_pool_job() -> RLHFJob:
    return parse_job_manifest(in_cluster(multi_pool_manifest()), "multi-pool")


JOBS: dict[str, Callable[[], RLHFJob]] = {
    **{path.name: functools.partial(example_job, path) for path in EXAMPLES},
    "multi-pool": multi_pool_job,
}


def children(name: str, attempt: int = 1) -> list[dict[str, Any]]:
    job = JOBS[name]()
    return build_children(job, JobRef.of(job), attempt=attempt, defaults=DEFAULTS)


# --------------------------------------------------------------------------- KubeRay's RayJob schema


@pytest.fixture(scope="module")
def rayjob_schema() -> dict[str, Any]:
    path = KUBERAY / "ray.io_rayjobs.yaml"
    if not path.exists():
        pytest.skip(f"the KubeRay v1.7 CRDs are not at {KUBERAY} (a sibling checkout of shared/)")
    crd = yaml.safe_load(path.read_text())
    [v1] = [version for version in crd["spec"]["versions"] if version["name"] == "v1"]
    schema: dict[str, Any] = v1["schema"]["openAPIV3Schema"]
    return schema


def pruned_fields(schema: dict[str, Any], value: Any, path: str = "") -> list[str]:
    """Fields of ``value`` the schema does not know: the API server would silently drop them.

    The root ``metadata`` is the exception: its schema is a bare object the API server fills in.
    """
    found: list[str] = []
    if (
        isinstance(value, dict)
        and path != ".metadata"
        and not schema.get("x-kubernetes-preserve-unknown-fields")
    ):
        extra = schema.get("additionalProperties")
        for key, item in value.items():
            child = extra if isinstance(extra, dict) else schema.get("properties", {}).get(key)
            if child is None:
                found.append(f"{path}.{key}")
            else:
                found.extend(pruned_fields(child, item, f"{path}.{key}"))
    elif isinstance(value, list) and "items" in schema:
        for index, item in enumerate(value):
            found.extend(pruned_fields(schema["items"], item, f"{path}[{index}]"))
    return found


def kuberay_controller_problems(rayjob: dict[str, Any]) -> list[str]:
    """What KubeRay v1.7's controller rejects before it creates anything (utils/validation.go)."""
    problems = []
    name = rayjob["metadata"]["name"]
    if len(name) > MAX_RAYJOB_NAME_LENGTH or not DNS_1035_LABEL.match(name):
        problems.append(f"name {name!r}: a DNS-1035 label of at most 47 characters")
    spec = rayjob["spec"]
    if spec.get("suspend") and not spec.get("shutdownAfterJobFinishes"):
        problems.append("suspend needs shutdownAfterJobFinishes")
    if spec.get("ttlSecondsAfterFinished", 0) > 0 and not spec.get("shutdownAfterJobFinishes"):
        problems.append("ttlSecondsAfterFinished needs shutdownAfterJobFinishes")
    if spec.get("activeDeadlineSeconds", 1) <= 0:
        problems.append("activeDeadlineSeconds must be positive")
    cluster = spec["rayClusterSpec"]
    if not cluster["headGroupSpec"]["template"]["spec"]["containers"]:
        problems.append("head has no container")
    groups = [group["groupName"] for group in cluster["workerGroupSpecs"]]
    if len(set(groups)) != len(groups):
        problems.append("duplicate worker group names")
    for group in cluster["workerGroupSpecs"]:
        if not group["template"]["spec"]["containers"]:
            problems.append(f"{group['groupName']}: no container")
        if not group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]:
            problems.append(f"{group['groupName']}: replicas outside [min, max]")
    return problems


@pytest.mark.parametrize("name", sorted(JOBS))
@pytest.mark.parametrize("attempt", [1, 3])
def test_rayjob_validates_against_kuberay_v1_7(
    name: str, attempt: int, rayjob_schema: dict[str, Any]
) -> None:
    rayjob = children(name, attempt)[-1]
    Draft4Validator(rayjob_schema).validate(rayjob)
    assert pruned_fields(rayjob_schema, rayjob) == []
    assert kuberay_controller_problems(rayjob) == []


def test_pruned_field_check_catches_typos(rayjob_schema: dict[str, Any]) -> None:
    rayjob = children("multi-pool")[-1]
    rayjob["spec"]["rayClusterSpec"]["workerGroupSpec"] = []
    rayjob["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["volumeMount"] = []
    assert pruned_fields(rayjob_schema, rayjob) == [
        ".spec.rayClusterSpec.headGroupSpec.template.spec.containers[0].volumeMount",
        ".spec.rayClusterSpec.workerGroupSpec",
    ]


# --------------------------------------------------------------------------- core objects


def validate_core(obj: dict[str, Any]) -> None:
    """Strict validation against Kubernetes' own schemas (unknown fields are errors)."""
    kubernetes_validate = pytest.importorskip(
        "kubernetes_validate", reason="pip install kubernetes-validate==1.37.0 to check core objects offline"
    )
    kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize("name", sorted(JOBS))
def test_core_children_validate_strictly(name: str) -> None:
    for child in children(name)[:-1]:
        validate_core(child)


@pytest.mark.parametrize("name", sorted(JOBS))
def test_pod_templates_validate_strictly(name: str) -> None:
    cluster = children(name)[-1]["spec"]["rayClusterSpec"]
    templates = [cluster["headGroupSpec"]["template"], *(g["template"] for g in cluster["workerGroupSpecs"])]
    for template in templates:
        pod_template = {
            "apiVersion": "v1",
            "kind": "PodTemplate",
            "metadata": {"name": "t"},
            "template": template,
        }
        validate_core(pod_template)


def test_strict_validation_is_not_vacuous() -> None:
    role = build_role(JobRef("ns", "job", UID))
    role["rules"][0]["verb"] = ["get"]
    with pytest.raises(Exception, match="'verb' was unexpected"):
        validate_core(role)


# --------------------------------------------------------------------------- content


@pytest.mark.parametrize("name", sorted(JOBS))
def test_every_child_is_owned_and_labelled(name: str) -> None:
    job = JOBS[name]()
    for child in children(name):
        metadata = child["metadata"]
        assert metadata["namespace"] == "research"
        assert metadata["ownerReferences"] == [
            {
                "apiVersion": "hybridflow.io/v1alpha1",
                "kind": "RLHFJob",
                "name": job.metadata.name,
                "uid": UID,
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ]
        assert metadata["labels"]["app.kubernetes.io/managed-by"] == "hybridflow-operator"
        assert metadata["labels"]["hybridflow.io/job"] == job.metadata.name
    assert children(name)[-1]["metadata"]["labels"]["hybridflow.io/attempt"] == "1"


@pytest.mark.parametrize("name", sorted(JOBS))
def test_config_round_trips_through_parse_job_manifest(name: str) -> None:
    job = JOBS[name]()
    configmap = build_configmap(job, JobRef.of(job))
    document = yaml.safe_load(configmap["data"][CONFIG_KEY])
    assert document["metadata"] == {"name": job.metadata.name, "namespace": "research"}
    read = parse_job_manifest(document, CONFIG_PATH)
    assert read.spec == job.spec
    assert (read.metadata.name, read.metadata.namespace) == (job.metadata.name, "research")


def test_config_ignores_server_set_metadata() -> None:
    manifest = in_cluster(multi_pool_manifest())
    first = build_configmap(parse_job_manifest(manifest, "a"), JobRef("research", "ppo-7b", UID))
    manifest["metadata"].update(resourceVersion="999", generation=7, labels={"team": "rl"})
    second = build_configmap(parse_job_manifest(manifest, "b"), JobRef("research", "ppo-7b", UID))
    assert first == second


def test_rbac_allows_only_this_jobs_status() -> None:
    owner = JobRef("research", "grpo-tiny", UID)
    names = child_names("grpo-tiny")
    assert build_service_account(owner)["metadata"]["name"] == names.service_account
    assert build_role(owner)["rules"] == [
        {
            "apiGroups": ["hybridflow.io"],
            "resources": ["rlhfjobs/status"],
            "resourceNames": ["grpo-tiny"],
            "verbs": ["get", "patch"],
        },
        {
            "apiGroups": ["hybridflow.io"],
            "resources": ["rlhfjobs"],
            "resourceNames": ["grpo-tiny"],
            "verbs": ["get"],
        },
    ]
    binding = build_role_binding(owner)
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": names.role}
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": names.service_account, "namespace": "research"}
    ]


def test_rayjob_runs_the_controller_with_the_mounted_config() -> None:
    job = example_job(ROOT / "examples" / "grpo-tiny.yaml")
    rayjob = build_rayjob(job, JobRef.of(job), attempt=2, defaults=DEFAULTS)
    assert rayjob["apiVersion"] == "ray.io/v1" and rayjob["metadata"]["name"] == "grpo-tiny-2"
    spec = rayjob["spec"]
    assert spec["entrypoint"] == ENTRYPOINT == "hybridflow run --in-cluster /etc/hybridflow/job.yaml"
    assert spec["submissionMode"] == "K8sJobMode"
    assert spec["shutdownAfterJobFinishes"] is True and spec["backoffLimit"] == 0
    assert spec["ttlSecondsAfterFinished"] == 0 and spec["suspend"] is False
    assert "activeDeadlineSeconds" not in spec and "runtimeEnvYAML" not in spec
    head = spec["rayClusterSpec"]["headGroupSpec"]
    pod = head["template"]["spec"]
    assert head["rayStartParams"] == {"num-cpus": "0"}
    assert pod["serviceAccountName"] == "grpo-tiny-controller"
    [container] = pod["containers"]
    assert container["image"] == DEFAULTS.image
    assert "nvidia.com/gpu" not in json.dumps(container["resources"])
    assert {"name": "config", "mountPath": "/etc/hybridflow", "readOnly": True} in container["volumeMounts"]
    assert {"name": "config", "configMap": {"name": "grpo-tiny-config"}} in pod["volumes"]
    assert {"name": "hf-metrics", "containerPort": CONTROLLER_METRICS_PORT} in container["ports"]
    assert {"name": "HYBRIDFLOW_METRICS_PORT", "value": str(CONTROLLER_METRICS_PORT)} in container["env"]
    assert CONTROLLER_METRICS_PORT != 8080  # Ray's own metrics agent listens there (KubeRay's default)


def test_one_worker_group_per_pool() -> None:
    job = multi_pool_job()
    rayjob = build_rayjob(job, JobRef.of(job), attempt=1, defaults=DEFAULTS)
    groups = {group["groupName"]: group for group in rayjob["spec"]["rayClusterSpec"]["workerGroupSpecs"]}
    assert list(groups) == ["actor", "critic", "generate"]
    actor = groups["actor"]
    assert actor["replicas"] == actor["minReplicas"] == actor["maxReplicas"] == 2
    assert actor["rayStartParams"] == {
        "num-cpus": "64",
        "num-gpus": "8",
        "resources": """'{"hybridflow-pool-actor":8}'""",
    }
    pod = actor["template"]["spec"]
    [container] = pod["containers"]
    assert container["image"] == "registry.example.com/hybridflow:0.1.0-cuda"
    assert container["resources"] == {
        "requests": {"cpu": "64", "memory": "800Gi"},
        "limits": {"nvidia.com/gpu": "8", "memory": "800Gi"},
    }
    assert pod["nodeSelector"] == {"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"}
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert pod["affinity"]["nodeAffinity"]
    assert pod["automountServiceAccountToken"] is False and "serviceAccountName" not in pod
    assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "800Gi"}} in pod["volumes"]
    mounts = {mount["mountPath"]: mount for mount in container["volumeMounts"]}
    assert mounts["/dev/shm"]["name"] == "dshm"
    assert "readOnly" not in mounts["/checkpoints"]
    assert mounts["/models"]["readOnly"] and mounts["/data"]["readOnly"]
    assert groups["critic"]["template"]["spec"]["containers"][0]["resources"]["limits"]["memory"] == "12Gi"
    generate = groups["generate"]["template"]["spec"]
    assert "nodeSelector" not in generate and "tolerations" not in generate
    assert generate["containers"][0]["resources"] == {
        "requests": {"cpu": "16"},
        "limits": {"nvidia.com/gpu": "4"},
    }
    assert {"name": "dshm", "emptyDir": {"medium": "Memory"}} in generate["volumes"]
    head_mounts = rayjob["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0][
        "volumeMounts"
    ]
    assert [mount["mountPath"] for mount in head_mounts] == [
        "/etc/hybridflow",
        "/home/hybridflow",
        "/tmp",
        "/checkpoints",
        "/models",
        "/data",
    ]


def test_the_pool_resource_matches_the_runtimes_placement() -> None:
    resource_pool = pytest.importorskip(
        "hybridflow.controller.resource_pool", reason="needs ray (the cpu extra)"
    )
    for pool in ("default", "actor", "gen-2"):
        assert pool_resource_name(pool) == resource_pool.node_pool_resource(pool)


def test_ray_resources_param_is_what_kuberay_parses() -> None:
    """KubeRay's getResourcesMap trims quotes (' \" ` and spaces) and unmarshals JSON."""
    value = ray_resources_param({"hybridflow-pool-b": 4, "hybridflow-pool-a": 2})
    assert value == """'{"hybridflow-pool-a":2,"hybridflow-pool-b":4}'"""
    assert json.loads(value.strip("'\"` ")) == {"hybridflow-pool-a": 2, "hybridflow-pool-b": 4}
    assert " " not in value  # one word in KubeRay's generated `ray start` shell command


def test_kueue_and_gang_scheduler_labels() -> None:
    job = multi_pool_job()
    rayjob = build_rayjob(job, JobRef.of(job), attempt=1, defaults=DEFAULTS)
    labels = rayjob["metadata"]["labels"]
    assert labels["kueue.x-k8s.io/queue-name"] == "team-rl"
    assert labels["ray.io/scheduler-name"] == "volcano" and labels["volcano.sh/queue-name"] == "research"
    assert labels["hybridflow.io/job"] == "ppo-7b"  # scheduler labels never override the job's
    assert rayjob["spec"]["suspend"] is True  # created suspended: Kueue admits by un-suspending
    cluster = rayjob["spec"]["rayClusterSpec"]
    for template in [
        cluster["headGroupSpec"]["template"],
        *(g["template"] for g in cluster["workerGroupSpecs"]),
    ]:
        pod_labels = template["metadata"]["labels"]
        assert (
            pod_labels["volcano.sh/queue-name"] == "research" and pod_labels["hybridflow.io/job"] == "ppo-7b"
        )
        assert "kueue.x-k8s.io/queue-name" not in pod_labels


def test_deadline_is_the_remaining_budget() -> None:
    job = multi_pool_job()
    first = build_rayjob(job, JobRef.of(job), attempt=1, defaults=DEFAULTS)
    assert first["spec"]["activeDeadlineSeconds"] == 86400
    retry = build_rayjob(job, JobRef.of(job), attempt=2, defaults=DEFAULTS, active_deadline_seconds=5000)
    assert retry["spec"]["activeDeadlineSeconds"] == 5000
    assert retry["spec"]["ttlSecondsAfterFinished"] == 0  # spec.ttlSecondsAfterFinished is the RLHFJob's


@pytest.mark.parametrize(
    ("quantity", "factor", "expected"),
    [("64Gi", 8, "512Gi"), ("1.5Gi", 8, "12Gi"), ("0.5Gi", 3, "1.5Gi"), ("500M", 2, "1000M"), ("1", 4, "4")],
)
def test_scale_quantity(quantity: str, factor: int, expected: str) -> None:
    assert scale_quantity(quantity, factor) == expected


@pytest.mark.parametrize("name", sorted(JOBS))
def test_builders_are_deterministic(name: str) -> None:
    first, second = children(name), children(name)
    assert first == second
    assert yaml.safe_dump_all(first, sort_keys=False) == yaml.safe_dump_all(second, sort_keys=False)
    agent = JOBS[name]().spec.agent
    assert [child["kind"] for child in first] == [
        "ConfigMap",
        "ServiceAccount",
        "Role",
        "RoleBinding",
        "NetworkPolicy",
        *(["NetworkPolicy"] if agent.sandbox_workers else []),
        *(["Service"] if agent.loop == "endpoint" else []),
        "RayJob",
    ]


def test_job_ref_needs_the_server_set_identity() -> None:
    with pytest.raises(ValueError, match="namespace, uid"):
        JobRef.of(parse_job_manifest(multi_pool_manifest(), "no identity"))


# --------------------------------------------------------------------------- names


def test_short_names_read_naturally() -> None:
    names = child_names("grpo-tiny")
    assert (names.config_map, names.service_account, names.role, names.role_binding) == (
        "grpo-tiny-config",
        "grpo-tiny-controller",
        "grpo-tiny-controller",
        "grpo-tiny-controller",
    )
    assert rayjob_name("grpo-tiny", 1) == "grpo-tiny-1"
    assert rayjob_name("grpo-tiny", 12) == "grpo-tiny-12"
    assert job_label_value("grpo-tiny") == "grpo-tiny"


LONG = "a" * 100 + ".b" + "-c" * 75


@pytest.mark.parametrize(
    "job_name",
    [
        "x",
        "grpo-tiny",
        "a" * 44,  # "-1" still fits in 47
        "a" * 46,  # does not
        "7b-ppo",  # leading digit
        "qwen2.5-grpo",  # a dot
        "a" * 253,
        LONG[:253],
        "a" * 35 + "-" + "b" * 30,  # the cut lands next to a dash
    ],
)
@pytest.mark.parametrize("attempt", [1, 10, 999])
def test_derived_names_are_valid(job_name: str, attempt: int) -> None:
    rayjob = rayjob_name(job_name, attempt)
    assert len(rayjob) <= MAX_RAYJOB_NAME_LENGTH and DNS_1035_LABEL.match(rayjob), rayjob
    assert rayjob.endswith(f"-{attempt}")
    names = child_names(job_name)
    for name in (names.config_map, names.service_account, names.role):
        assert len(name) <= 253 and DNS_1123_SUBDOMAIN.match(name), name
    label = job_label_value(job_name)
    assert len(label) <= 63 and LABEL_VALUE.match(label), label


def test_shortened_names_keep_distinct_jobs_apart() -> None:
    prefix = "a" * 60
    assert rayjob_name(prefix + "-one", 1) != rayjob_name(prefix + "-two", 1)
    assert job_label_value(prefix + "-one") != job_label_value(prefix + "-two")
    assert child_names("a" * 250 + "one").config_map != child_names("a" * 250 + "two").config_map
    assert rayjob_name("a.b", 1) != rayjob_name("a-b", 1)
    assert rayjob_name("a.b", 1) == f"a-b-{name_hash('a.b')}-1"
    assert rayjob_name("7b-ppo", 1) == f"rlhf-7b-ppo-{name_hash('7b-ppo')}-1"
    assert rayjob_name("a" * 46, 1) == "a" * 36 + f"-{name_hash('a' * 46)}-1"
    with pytest.raises(ValueError, match="start at 1"):
        rayjob_name("x", 0)


# --------------------------------------------------------------------------- docs/operator.md

RENDERED = re.compile(r"<!-- rendered: (?P<kind>[A-Za-z]+) -->\n```yaml\n(?P<body>.*?)```", re.DOTALL)


def test_docs_show_what_the_builders_build() -> None:
    """docs/operator.md renders grpo-tiny's children; regenerate the blocks when this fails."""
    text = (ROOT / "docs" / "operator.md").read_text()
    blocks = {match["kind"]: yaml.safe_load(match["body"]) for match in RENDERED.finditer(text)}
    manifest = yaml.safe_load((ROOT / "examples" / "grpo-tiny.yaml").read_text())
    manifest["metadata"].update(namespace="research", uid=UID)
    job = parse_job_manifest(manifest, "docs")
    built = build_children(job, JobRef.of(job), attempt=1, defaults=DEFAULTS)
    if blocks != {child["kind"]: child for child in built}:
        pytest.fail("docs/operator.md is stale; replace its rendered blocks with:\n\n" + render_blocks(built))


class _DocsDumper(yaml.SafeDumper):
    """YAML as a person reads it: multi-line strings (the ConfigMap's job.yaml) as literal blocks."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def _represent_str(dumper: yaml.SafeDumper, text: str) -> yaml.ScalarNode:
    return dumper.represent_scalar("tag:yaml.org,2002:str", text, style="|" if "\n" in text else None)


_DocsDumper.add_representer(str, _represent_str)


def render_blocks(objects: list[dict[str, Any]]) -> str:
    """The docs' rendered blocks for ``objects``, in the form test_docs_show_what_the_builders_build reads."""
    return "".join(
        f"<!-- rendered: {obj['kind']} -->\n```yaml\n"
        + yaml.dump(obj, Dumper=_DocsDumper, sort_keys=False, width=100)
        + "```\n\n"
        for obj in objects
    )


# --------------------------------------------------------------------------- Pod Security "restricted"

ALLOWED_VOLUME_SOURCES = {
    "configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim", "projected", "secret",
}  # fmt: skip


def restricted_violations(pod_spec: dict[str, Any]) -> list[str]:
    """What Pod Security Admission's "restricted" profile (Kubernetes 1.25+) rejects in ``pod_spec``.

    The checks of pod-security-admission's ``policy/check_*.go`` for the restricted level: host
    namespaces, privileged, capabilities (drop ALL, add at most NET_BIND_SERVICE), host ports,
    hostPath and other volume types, privilege escalation, running as non-root (pod or every
    container), uid 0, seccomp (RuntimeDefault or Localhost).
    """
    problems: list[str] = []
    pod = pod_spec.get("securityContext") or {}
    for field in ("hostNetwork", "hostPID", "hostIPC"):
        if pod_spec.get(field):
            problems.append(field)
    for volume in pod_spec.get("volumes") or []:
        kinds = set(volume) - {"name"}
        if not kinds <= ALLOWED_VOLUME_SOURCES:
            problems.append(f"volume {volume['name']}: {sorted(kinds)}")
    pod_seccomp = (pod.get("seccompProfile") or {}).get("type")
    for container in [*pod_spec.get("initContainers", []), *pod_spec["containers"]]:
        name, context = container["name"], container.get("securityContext") or {}
        if context.get("privileged"):
            problems.append(f"{name}: privileged")
        if context.get("allowPrivilegeEscalation") is not False:
            problems.append(f"{name}: allowPrivilegeEscalation != false")
        capabilities = context.get("capabilities") or {}
        if "ALL" not in (capabilities.get("drop") or []):
            problems.append(f"{name}: capabilities.drop lacks ALL")
        if set(capabilities.get("add") or []) - {"NET_BIND_SERVICE"}:
            problems.append(f"{name}: capabilities.add {capabilities['add']}")
        if not context.get("runAsNonRoot", pod.get("runAsNonRoot")):
            problems.append(f"{name}: runAsNonRoot != true")
        if context.get("runAsUser", pod.get("runAsUser")) == 0:
            problems.append(f"{name}: runAsUser 0")
        if (context.get("seccompProfile") or {}).get("type", pod_seccomp) not in (
            "RuntimeDefault",
            "Localhost",
        ):
            problems.append(f"{name}: seccompProfile")
        if any(port.get("hostPort") for port in container.get("ports") or []):
            problems.append(f"{name}: hostPort")
    return problems


def pod_specs(rayjob: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Every pod spec a RayJob makes KubeRay create: head, each worker group, the submitter."""
    spec = rayjob["spec"]
    pods = {"head": spec["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]}
    for group in spec["rayClusterSpec"]["workerGroupSpecs"]:
        pods[f"worker {group['groupName']}"] = group["template"]["spec"]
    pods["submitter"] = spec["submitterPodTemplate"]["spec"]
    return pods


@pytest.mark.parametrize("name", sorted(JOBS))
def test_every_generated_pod_meets_pod_security_restricted(name: str) -> None:
    rayjob = children(name)[-1]
    assert {pod: restricted_violations(spec) for pod, spec in pod_specs(rayjob).items()} == {
        pod: [] for pod in pod_specs(rayjob)
    }


def test_the_restricted_check_can_fail() -> None:
    assert restricted_violations({"containers": [{"name": "c"}], "hostNetwork": True}) == [
        "hostNetwork",
        "c: allowPrivilegeEscalation != false",
        "c: capabilities.drop lacks ALL",
        "c: runAsNonRoot != true",
        "c: seccompProfile",
    ]


def pods_manifest() -> dict[str, Any]:
    manifest = in_cluster(yaml.safe_load((ROOT / "examples" / "grpo-cluster.yaml").read_text()))
    manifest["spec"]["pods"] = {
        "env": [
            {"name": "WANDB_MODE", "value": "offline"},
            {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}},
        ],
        "envFrom": [{"secretRef": {"name": "s3-credentials"}, "prefix": "S3_"}],
        "imagePullSecrets": ["registry-credentials"],
        "priorityClassName": "training-high",
        "annotations": {"example.com/team": "rl"},
        "labels": {"team": "rl", "hybridflow.io/job": "cannot-override"},
        "headContainerSecurityContext": {"readOnlyRootFilesystem": True},
    }
    manifest["spec"]["resourcePools"][0].update(
        extraResources={"rdma/ib": "1"},
        containerSecurityContext={"capabilities": {"add": ["IPC_LOCK"], "drop": ["ALL"]}},
    )
    return manifest


def test_pod_settings_reach_every_pod_and_secrets_travel_by_reference_only() -> None:
    job = parse_job_manifest(pods_manifest(), "pods")
    built = build_children(job, JobRef.of(job), attempt=1, defaults=DEFAULTS)
    rayjob = built[-1]
    for pod, spec in pod_specs(rayjob).items():
        assert spec["imagePullSecrets"] == [{"name": "registry-credentials"}], pod
        assert spec["priorityClassName"] == "training-high", pod
    head = rayjob["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]
    worker = rayjob["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"]
    for template in (head, worker):
        assert template["metadata"]["annotations"] == {"example.com/team": "rl"}
        assert template["metadata"]["labels"]["team"] == "rl"
        assert template["metadata"]["labels"]["hybridflow.io/job"] == JobRef.of(job).name  # ours win
        container = template["spec"]["containers"][0]
        assert {
            "name": "HF_TOKEN",
            "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token", "optional": False}},
        } in container["env"]
        assert container["envFrom"] == [
            {"secretRef": {"name": "s3-credentials", "optional": False}, "prefix": "S3_"}
        ]
    assert head["spec"]["containers"][0]["securityContext"]["readOnlyRootFilesystem"] is True
    resources = worker["spec"]["containers"][0]["resources"]
    assert resources["requests"]["rdma/ib"] == resources["limits"]["rdma/ib"] == "1"
    # The pool's override is what the user asked for: restricted no more (the namespace must allow it).
    assert restricted_violations(worker["spec"]) == ["ray-worker: capabilities.add ['IPC_LOCK']"]
    assert restricted_violations(head["spec"]) == []
    # The ConfigMap and the RayJob name the Secrets, never hold a value from them.
    text = json.dumps(built)
    assert "hf" in text and "s3-credentials" in text


def test_startup_timeout_and_cluster_retention_reach_kuberay() -> None:
    manifest = pods_manifest()
    manifest["spec"].update(startupTimeoutSeconds=600, keepClusterSecondsAfterFinished=3600)
    job = parse_job_manifest(manifest, "startup")
    rayjob = build_children(job, JobRef.of(job), attempt=1, defaults=DEFAULTS)[-1]
    assert rayjob["spec"]["preRunningDeadlineSeconds"] == 600
    assert rayjob["spec"]["ttlSecondsAfterFinished"] == 3600


# --------------------------------------------------------------------------- the job's network


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    return all(labels.get(key) == value for key, value in selector["matchLabels"].items())


def test_the_network_policy_admits_only_the_job_kuberay_and_metrics_scrapes() -> None:
    """Ray's ports answer the job's own pods; KubeRay reaches the dashboard port; metrics are open."""
    built = {child["kind"]: child for child in children("multi-pool")}
    policy = built["NetworkPolicy"]["spec"]
    rayjob = built["RayJob"]["spec"]
    pods = [
        rayjob["rayClusterSpec"]["headGroupSpec"]["template"],
        *(group["template"] for group in rayjob["rayClusterSpec"]["workerGroupSpecs"]),
        rayjob["submitterPodTemplate"],
    ]
    assert all(_selects(policy["podSelector"], pod["metadata"]["labels"]) for pod in pods)
    other_job = build_children(
        parse_job_manifest(
            {
                **multi_pool_manifest(),
                "metadata": {"name": "other", "namespace": "research", "uid": "other-uid"},
            },
            "other",
        ),
        JobRef("research", "other", "other-uid"),
        attempt=1,
        defaults=DEFAULTS,
    )[-1]["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]
    assert not _selects(policy["podSelector"], other_job["metadata"]["labels"])  # another job's pods
    assert policy["policyTypes"] == ["Ingress"]  # egress stays open: the API server, data stores
    own, kuberay, metrics = policy["ingress"]
    assert own == {"from": [{"podSelector": policy["podSelector"]}]}  # every port, the job's pods only
    assert kuberay["ports"] == [{"protocol": "TCP", "port": 8265}]
    assert kuberay["from"] == [
        {
            "namespaceSelector": {},
            "podSelector": {"matchLabels": {"app.kubernetes.io/name": "kuberay-operator"}},
        }
    ]
    assert "from" not in metrics and {p["port"] for p in metrics["ports"]} == {8080, 8081}
    head_ports = {p["containerPort"] for c in pods[0]["spec"]["containers"] for p in c.get("ports", [])}
    assert head_ports >= {6379, 8265, 10001, 8081}  # the ports the policy guards are the head's
    assert rayjob["rayClusterSpec"]["authOptions"] == {"mode": "token"}  # and Ray's token on them


def test_sandbox_workers_are_a_restricted_cpu_group_whose_egress_reaches_only_the_job() -> None:
    """spec.agent with the python tool: a worker group 'sandbox' of CPU pods that advertise the
    sandbox resource, and a NetworkPolicy that limits their egress to the job's pods and DNS."""
    built = children("grpo-tiny-agent.yaml")
    rayjob = next(child for child in built if child["kind"] == "RayJob")["spec"]["rayClusterSpec"]
    (group,) = [g for g in rayjob["workerGroupSpecs"] if g["groupName"] == "sandbox"]
    assert group["replicas"] == group["minReplicas"] == group["maxReplicas"] == 2
    assert group["rayStartParams"] == {"num-cpus": "1", "resources": "'{\"hybridflow-sandbox\":1}'"}
    pod = group["template"]["spec"]
    (container,) = pod["containers"]
    assert container["resources"]["limits"] == {"cpu": "1", "memory": "2Gi"}
    assert "nvidia.com/gpu" not in container["resources"]["limits"]
    assert pod["automountServiceAccountToken"] is False
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    policies = [child for child in built if child["kind"] == "NetworkPolicy"]
    (sandbox,) = [p for p in policies if p["metadata"]["name"].endswith("-sandbox")]
    assert _selects(sandbox["spec"]["podSelector"], group["template"]["metadata"]["labels"])
    head = rayjob["headGroupSpec"]["template"]["metadata"]["labels"]
    assert not _selects(sandbox["spec"]["podSelector"], head)  # the controller keeps its egress
    assert sandbox["spec"]["policyTypes"] == ["Egress"]
    own, dns = sandbox["spec"]["egress"]
    assert _selects(own["to"][0]["podSelector"], head) and [p["port"] for p in dns["ports"]] == [53, 53]
    # As an enforcing network plugin applies it (kube.network_policy): Ray's node-to-node ports
    # of the job's pods and DNS, never the head's ports that take orders or the world outside.
    sandbox_pod = Endpoint("research", group["template"]["metadata"]["labels"])
    head_pod = Endpoint("research", head)
    train = next(g for g in rayjob["workerGroupSpecs"] if g["groupName"] == "train")
    worker_pod = Endpoint("research", train["template"]["metadata"]["labels"])
    dns_pod = Endpoint("kube-system", {"k8s-app": "kube-dns"})
    other_pod = Endpoint("research", {"app": "someone-else"})

    def sends(destination: Endpoint, port: int, protocol: str = "TCP") -> bool:
        return egress_allowed(policies, sandbox_pod, destination, port, protocol)

    assert sends(head_pod, 6379) and sends(worker_pod, 10002) and sends(worker_pod, 45678)
    assert sends(dns_pod, 53, "UDP") and sends(dns_pod, 53)
    denied = {8080: "Ray's metrics", 8081: "the controller's /stop", 8265: "the job API", 10001: "Ray client"}
    assert not [port for port in denied if sends(head_pod, port)], denied
    assert not sends(other_pod, 443) and not sends(dns_pod, 443) and not sends(head_pod, 53, "UDP")
    agent_job = parse_job_manifest(
        in_cluster(yaml.safe_load((ROOT / "examples" / "grpo-tiny-agent.yaml").read_text())), "e"
    )
    with_endpoint = build_sandbox_network_policy(JobRef.of(agent_job), endpoint_port=8100)
    assert not egress_allowed([with_endpoint], sandbox_pod, head_pod, 8100)  # the chat endpoint, when served
    assert egress_allowed([with_endpoint], sandbox_pod, head_pod, 8099)
    # No code-running tool, or no workers: no sandbox group and no second policy.
    manifest = yaml.safe_load((ROOT / "examples" / "grpo-tiny-agent.yaml").read_text())
    manifest["spec"]["agent"]["tools"] = ["calculator"]
    job = parse_job_manifest(in_cluster(manifest), "calculator-only")
    plain = build_children(job, JobRef.of(job), attempt=1, defaults=DEFAULTS)
    assert sum(child["kind"] == "NetworkPolicy" for child in plain) == 1
    plain_rayjob = next(child for child in plain if child["kind"] == "RayJob")["spec"]["rayClusterSpec"]
    assert [g["groupName"] for g in plain_rayjob["workerGroupSpecs"]] == ["train", "generate"]


def test_a_chat_endpoint_job_gets_a_service_to_its_head_pod_only() -> None:
    """loop 'endpoint': the Service <job>-agent selects the head pod (any attempt) on endpointPort,
    which the head container declares; no Service otherwise."""
    manifest = yaml.safe_load((ROOT / "examples" / "grpo-tiny-agent.yaml").read_text())
    manifest["spec"]["agent"] = {"loop": "endpoint", "runner": "my_agents.swe:run", "endpointPort": 8100}
    job = parse_job_manifest(in_cluster(manifest), "endpoint")
    built = build_children(job, JobRef.of(job), attempt=2, defaults=DEFAULTS)
    (service,) = [child for child in built if child["kind"] == "Service"]
    assert service["metadata"]["name"] == "grpo-tiny-agent-agent"
    assert service["spec"]["ports"] == [
        {"name": "hf-agent", "protocol": "TCP", "port": 8100, "targetPort": 8100}
    ]
    rayjob = next(child for child in built if child["kind"] == "RayJob")["spec"]["rayClusterSpec"]
    head = rayjob["headGroupSpec"]["template"]
    assert _selects({"matchLabels": service["spec"]["selector"]}, head["metadata"]["labels"])
    assert not any(
        _selects({"matchLabels": service["spec"]["selector"]}, group["template"]["metadata"]["labels"])
        for group in rayjob["workerGroupSpecs"]
    )
    assert {"name": "hf-agent", "containerPort": 8100} in head["spec"]["containers"][0]["ports"]
    assert not [child for child in children("grpo-tiny-agent.yaml") if child["kind"] == "Service"]
