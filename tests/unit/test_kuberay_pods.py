"""The pods KubeRay v1.7.0 makes of the operator's RayJobs (``kube.kuberay_pods``), rule by rule.

The twin's rules are in its module docstring; each test below holds one of them against what the
operator builds for the examples, with values read from KubeRay's ``common/pod.go``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from hybridflow.spec import parse_job_manifest
from hybridflow_operator.builders import JobRef, RayJobDefaults, build_children
from kube.kuberay_pods import (
    build_cluster_pods,
    convert_param_map,
    head_service_fqdn,
    quantity,
    submitter_pod,
)

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
FQDN = head_service_fqdn("grpo-tiny-1", "research")


def rayjob(example: str = "grpo-tiny") -> dict[str, Any]:
    manifest = yaml.safe_load((ROOT / "examples" / f"{example}.yaml").read_text())
    manifest["metadata"].update(namespace="research", uid="0000-uid")
    job = parse_job_manifest(manifest, "test")
    children = build_children(job, JobRef.of(job), attempt=1, defaults=RayJobDefaults(image="img:1"))
    return next(child for child in children if child["kind"] == "RayJob")


def env(container: dict[str, Any]) -> dict[str, Any]:
    return {item["name"]: item.get("value", item.get("valueFrom")) for item in container["env"]}


def test_the_head_runs_the_generated_ray_start_behind_bash() -> None:
    (_, head), *_ = build_cluster_pods(rayjob(), "grpo-tiny-1")
    container = head["spec"]["containers"][0]
    assert container["command"] == ["/bin/bash", "-c", "--"]
    (args,) = container["args"]
    assert args.startswith("ulimit -n ${RAY_START_ULIMIT_OPEN_FILES:-65536}; ray start --head ")
    flags = args.split("ray start --head ", 1)[1]
    assert flags == convert_param_map(
        {
            "num-cpus": "0",
            "dashboard-host": "0.0.0.0",
            "metrics-export-port": "8080",
            "block": "true",
            "dashboard-agent-listen-port": "52365",
            "memory": str(int(quantity("8Gi"))),
        }
    )
    assert " --block " in flags and " --num-cpus=0 " in flags  # given params win over resources


def test_workers_join_through_the_head_services_name_and_take_gpus_from_limits() -> None:
    pods = build_cluster_pods(rayjob(), "grpo-tiny-1")
    name, worker = pods[1]
    assert name == "grpo-tiny-1-default-worker-0"
    (args,) = worker["spec"]["containers"][0]["args"]
    assert f" --address={FQDN}:6379 " in args and " --num-gpus=2 " in args
    variables = env(worker["spec"]["containers"][0])
    assert variables["FQ_RAY_IP"] == FQDN and variables["RAY_IP"] == "grpo-tiny-1-head-svc"
    assert variables["RAY_ADDRESS"] == f"{FQDN}:6379"
    (init,) = worker["spec"]["initContainers"]
    assert init["name"] == "wait-gcs-ready" and f"ray health-check --address {FQDN}:6379" in init["args"][0]


def test_the_head_gets_its_own_address_and_the_pod_fields() -> None:
    (_, head), *_ = build_cluster_pods(rayjob(), "grpo-tiny-1")
    variables = env(head["spec"]["containers"][0])
    assert variables["RAY_ADDRESS"] == "127.0.0.1:6379" and "FQ_RAY_IP" not in variables
    assert variables["RAY_CLUSTER_NAME"] == {"fieldRef": {"fieldPath": "metadata.labels['ray.io/cluster']"}}
    assert variables["KUBERAY_GEN_RAY_START_CMD"].startswith("ray start --head")
    assert head["metadata"]["labels"]["ray.io/cluster"] == "grpo-tiny-1"
    assert head["metadata"]["labels"]["ray.io/node-type"] == "head"


def test_probes_are_http_from_ray_2_53_and_wget_below() -> None:
    job = rayjob()
    (_, head), (_, worker) = build_cluster_pods(job, "c")[:2]
    assert head["spec"]["containers"][0]["readinessProbe"]["httpGet"] == {
        "path": "/api/healthz",
        "port": 52365,
    }
    assert head["spec"]["containers"][0]["livenessProbe"]["failureThreshold"] == 120
    job["spec"]["rayClusterSpec"]["rayVersion"] = "2.52.0"
    (_, head), (_, worker) = build_cluster_pods(job, "c")[:2]
    head_probe = head["spec"]["containers"][0]["readinessProbe"]
    assert head_probe["exec"]["command"][:2] == ["bash", "-c"] and head_probe["timeoutSeconds"] == 5
    assert "8265/api/gcs_healthz" in head_probe["exec"]["command"][2]
    assert (
        "-T 10" in head_probe["exec"]["command"][2]
    )  # DefaultReadinessProbeFailureThreshold, as the source has it
    worker_probe = worker["spec"]["containers"][0]["readinessProbe"]["exec"]["command"][2]
    assert (
        "gcs_healthz" not in worker_probe
        and worker["spec"]["containers"][0]["readinessProbe"]["timeoutSeconds"] == 2
    )


def test_dev_shm_is_added_only_where_nothing_is_mounted_there() -> None:
    pods = build_cluster_pods(rayjob(), "c")
    for _, pod in pods:
        mounts = [m for m in pod["spec"]["containers"][0]["volumeMounts"] if m["mountPath"] == "/dev/shm"]
        assert len(mounts) == 1, mounts


def test_a_command_that_runs_ray_start_itself_is_left_alone() -> None:
    job = rayjob()
    head = job["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    head["command"], head["args"] = ["ray"], [" start --head --block"]
    pods = build_cluster_pods(job, "c")
    assert pods[0][1]["spec"]["containers"][0]["command"] == ["ray"]
    head["command"], head["args"] = ["echo", "hi"], []
    (args,) = build_cluster_pods(job, "c")[0][1]["spec"]["containers"][0]["args"]
    assert args.startswith("echo hi && ulimit -n")


def test_boolean_parameters_are_switches_except_three() -> None:
    assert (
        convert_param_map({"block": "true", "log-color": "false", "x": "False"})
        == " --block  --log-color=false "
    )


def test_the_submitter_waits_for_the_dashboard_then_submits_once_and_follows() -> None:
    """``BuildJobSubmitCommand`` (K8sJobMode) in the operator's submitter template, whose container
    has no command: KubeRay's ``/bin/bash -ce --`` and the joined words."""
    job = rayjob()
    dashboard = f"{FQDN}:8265"
    pod = submitter_pod(job, dashboard, "grpo-tiny-1-abcde")
    container = pod["spec"]["containers"][0]
    assert container["command"] == ["/bin/bash", "-ce", "--"]
    (script,) = container["args"]
    address = f"http://{dashboard}"
    assert script.startswith(
        f"until python -c \"import urllib.request; r=urllib.request.urlopen('{address}/api/gcs_healthz'"
    )
    assert f"if ! ray job status --address {address} grpo-tiny-1-abcde >/dev/null 2>&1 ; then" in script
    assert (
        f"ray job submit --address {address} --no-wait --submission-id grpo-tiny-1-abcde -- "
        "hybridflow run --in-cluster /etc/hybridflow/job.yaml ; fi ;"
    ) in script
    assert script.endswith(f"ray job logs --address {address} --follow grpo-tiny-1-abcde")
    variables = env(container)
    assert variables["RAY_JOB_SUBMISSION_ID"] == "grpo-tiny-1-abcde" and variables["PYTHONUNBUFFERED"] == "1"
    assert pod["spec"]["securityContext"]["runAsUser"] == 10001  # the operator's template is kept
    assert pod["metadata"]["labels"]["ray.io/originated-from-cr-name"] == job["metadata"]["name"]
