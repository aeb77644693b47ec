"""The pods KubeRay makes of a RayJob's cluster, as KubeRay v1.7.0 builds them (ray-operator
``controllers/ray/common/pod.go``), so that a test can run exactly those pods.

Each rule is one function below, named after the Go function it follows:

1. ``DefaultHeadPodTemplate`` / ``DefaultWorkerPodTemplate``: the labels of ``labelPod``
   (``ray.io/cluster``, ``ray.io/node-type``, ``ray.io/group``, ``ray.io/identifier``), a ``metrics``
   port 8080 on the Ray container unless one is named so, and on workers the ``wait-gcs-ready``
   init container (``ENABLE_INIT_CONTAINER_INJECTION`` defaults to true) that polls
   ``ray health-check --address <head Service>:<port>`` every 5 s.
2. ``setMissingRayStartParams``: a worker's ``address`` is ``<head Service FQDN>:<port>``; the
   head's ``dashboard-host`` is ``0.0.0.0``; ``metrics-export-port`` 8080; ``block``;
   ``dashboard-agent-listen-port`` 52365.
3. ``generateRayStartCommand``: ``num-cpus`` from the CPU limit, else the request (rounded up, as
   ``Quantity.Value``); ``memory`` from the memory limit in bytes; ``num-gpus`` from an
   ``nvidia.com/gpu`` limit (``addWellKnownAcceleratorResources``).
4. ``convertParamMap``: flags in sorted order, ``--k=v``, a ``true``/``false`` value a bare switch
   (present for true) except ``log-color``, ``include-dashboard`` and ``include-log-monitor``.
5. ``BuildPod``: a ``/dev/shm`` emptyDir (medium Memory, ``addEmptyDir``: none when the container
   already mounts something there) unless ``plasma-directory`` is set; unless
   the container's command and args already hold ``ray start`` (or the overwrite annotation is
   set), command ``/bin/bash -c --`` and one arg: ``<command and args> && ulimit -n
   ${RAY_START_ULIMIT_OPEN_FILES:-65536}; ray start ...`` (without the first part when empty).
6. ``setContainerEnvVars``: ``FQ_RAY_IP`` and ``RAY_IP`` on workers; ``RAY_CLUSTER_NAME``,
   ``RAY_CLUSTER_NAMESPACE``, ``RAY_CLOUD_INSTANCE_ID``, ``RAY_NODE_TYPE_NAME`` from the pod's
   fields; ``KUBERAY_GEN_RAY_START_CMD``; then, each unless set, ``RAY_PORT``, ``RAY_ADDRESS``
   (``127.0.0.1:<port>`` on the head, ``<FQDN>:<port>`` on workers),
   ``RAY_USAGE_STATS_KUBERAY_IN_USE``, and ``RAY_DASHBOARD_ENABLE_K8S_DISK_USAGE``.
7. ``initLivenessAndReadinessProbe``: unless the container has its own, HTTP GET
   ``/api/healthz`` on the agent's port for a rayVersion >= 2.53 (``supportsUnifiedHealthCheck``),
   else ``bash -c`` of ``wget`` commands (``BaseWgetHealthCommand``; the head's also checks the
   dashboard's ``/api/gcs_healthz``, with ``DefaultReadinessProbeFailureThreshold`` as its
   timeout, as the source has it). Readiness: initial delay 10 s, period 5 s, failure threshold
   10, timeout 2 s (head 5 s); liveness: 30 s, 5 s, 120, 2 s (head 5 s).

8. ``BuildJobSubmitCommand`` (K8sJobMode, ``common/job.go``): wait until the dashboard's
   ``/api/gcs_healthz`` answers (``BasePythonHealthCommand``, ``python -c`` with urllib, 10 s
   timeout, every 2 s), then ``if ! ray job status ... <id>; then ray job submit --address
   http://<dashboardURL> --no-wait [--runtime-env-json ...] --submission-id <id>
   [--entrypoint-num-cpus/gpus] -- <entrypoint> ; fi ; ray job logs --address ... --follow <id>``.
9. ``configureSubmitterContainer`` (``rayjob_controller.go``): when the template's container has
   no command, ``/bin/bash -ce --`` and that command joined by spaces as the one arg; then
   ``PYTHONUNBUFFERED=1``, ``RAY_DASHBOARD_ADDRESS`` and ``RAY_JOB_SUBMISSION_ID`` appended.

Not modelled: autoscaling, GCS fault tolerance, TLS, the history-server collector (the operator
uses none of them); token authentication is the e2e stand-in's (``configureTokenAuth``).
"""

from __future__ import annotations

import copy
import math
import re
from typing import Any

import yaml

JsonObject = dict[str, Any]

DEFAULT_HEAD_PORT = "6379"
DEFAULT_METRICS_PORT = 8080
DEFAULT_DASHBOARD_PORT = 8265
DEFAULT_AGENT_PORT = 52365
ULIMIT_COMMAND = "ulimit -n ${RAY_START_ULIMIT_OPEN_FILES:-65536}"
SPECIAL_BOOLEAN_FLAGS = ("log-color", "include-dashboard", "include-log-monitor")
PROBE_DEFAULTS = {
    # (initialDelaySeconds, periodSeconds, successThreshold, failureThreshold, timeout, head timeout)
    "readinessProbe": (10, 5, 1, 10, 2, 5),
    "livenessProbe": (30, 5, 1, 120, 2, 5),
}
SHM_VOLUME = "shared-mem"


def head_service_fqdn(cluster: str, namespace: str) -> str:
    """``utils.GenerateFQDNServiceName``: the head Service ``<cluster>-head-svc`` as a cluster name."""
    return f"{cluster}-head-svc.{namespace}.svc.cluster.local"


def head_port(ray_start_params: JsonObject) -> str:
    """``GetHeadPort``: the head's ``port`` parameter, else 6379."""
    return str(ray_start_params.get("port", DEFAULT_HEAD_PORT))


def set_missing_ray_start_params(params: JsonObject, head: bool, port: str, fqdn: str) -> JsonObject:
    params = {key: str(value) for key, value in params.items()}
    if not head:
        params.setdefault("address", f"{fqdn}:{port}")
    else:
        params.setdefault("dashboard-host", "0.0.0.0")
    params.setdefault("metrics-export-port", str(DEFAULT_METRICS_PORT))
    params["block"] = "true"
    params.setdefault("dashboard-agent-listen-port", str(DEFAULT_AGENT_PORT))
    return params


def quantity(text: str) -> float:
    """A Kubernetes quantity (``2``, ``500m``, ``8Gi``, ``1e3``) as a number."""
    suffixes = {
        "m": 1e-3,
        "k": 1e3,
        "M": 1e6,
        "G": 1e9,
        "T": 1e12,
        "Ki": 2**10,
        "Mi": 2**20,
        "Gi": 2**30,
        "Ti": 2**40,
    }
    match = re.fullmatch(r"([0-9.eE+-]+)([a-zA-Z]*)", str(text).strip())
    if match is None or match.group(2) not in {"", *suffixes}:
        raise ValueError(f"not a quantity: {text!r}")
    return float(match.group(1)) * suffixes.get(match.group(2), 1)


def generate_ray_start_command(head: bool, params: JsonObject, resources: JsonObject) -> str:
    limits, requests = resources.get("limits") or {}, resources.get("requests") or {}
    if "num-cpus" not in params:
        cpu = limits.get("cpu") or requests.get("cpu")
        if cpu and quantity(cpu) > 0:
            params["num-cpus"] = str(math.ceil(quantity(cpu)))
    if "memory" not in params and limits.get("memory"):
        params["memory"] = str(math.ceil(quantity(limits["memory"])))
    if "num-gpus" not in params and limits.get("nvidia.com/gpu"):
        params["num-gpus"] = str(math.ceil(quantity(limits["nvidia.com/gpu"])))
    return ("ray start --head " if head else "ray start ") + convert_param_map(params)


def convert_param_map(params: JsonObject) -> str:
    flags = ""
    for key in sorted(params):
        value = params[key]
        if value.lower() in ("true", "false") and key not in SPECIAL_BOOLEAN_FLAGS:
            if value.lower() == "true":
                flags += f" --{key} "
        else:
            flags += f" --{key}={value} "
    return flags


def probe_command(head: bool, params: JsonObject) -> list[str]:
    """The exec probe's command (rayVersion below 2.53 on 1.6+, always on 1.5)."""
    agent = params.get("dashboard-agent-listen-port", str(DEFAULT_AGENT_PORT))
    dashboard = params.get("dashboard-port", str(DEFAULT_DASHBOARD_PORT))
    commands = [
        f"wget --tries 1 -T 2 -q -O- http://localhost:{agent}/api/local_raylet_healthz | grep success"
    ]
    if head:
        commands.append(
            f"wget --tries 1 -T 10 -q -O- http://localhost:{dashboard}/api/gcs_healthz | grep success"
        )
    return ["bash", "-c", " && ".join(commands)]


def supports_unified_health_check(ray_version: str) -> bool:
    parts = re.findall(r"\d+", ray_version or "")[:3]
    return len(parts) >= 2 and tuple(int(p) for p in parts) >= (2, 53, 0)


def init_probes(container: JsonObject, head: bool, params: JsonObject, ray_version: str) -> None:
    for probe, (delay, period, success, failure, timeout, head_timeout) in PROBE_DEFAULTS.items():
        if container.get(probe) is not None:
            continue
        spec: JsonObject = {
            "initialDelaySeconds": delay,
            "timeoutSeconds": head_timeout if head else timeout,
            "periodSeconds": period,
            "successThreshold": success,
            "failureThreshold": failure,
        }
        if supports_unified_health_check(ray_version):
            port = int(params.get("dashboard-agent-listen-port", DEFAULT_AGENT_PORT))
            spec["httpGet"] = {"path": "/api/healthz", "port": port}
        else:
            spec["exec"] = {"command": probe_command(head, params)}
        container[probe] = spec


def set_container_env(container: JsonObject, head: bool, fqdn: str, port: str, start: str) -> None:
    env = container.setdefault("env", [])

    def has(name: str) -> bool:
        return any(item["name"] == name for item in env)

    ip = "127.0.0.1" if head else fqdn
    if not head:
        env += [{"name": "FQ_RAY_IP", "value": ip}, {"name": "RAY_IP", "value": ip.split(".")[0]}]
    env += [
        {
            "name": "RAY_CLUSTER_NAME",
            "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['ray.io/cluster']"}},
        },
        {"name": "RAY_CLUSTER_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        {"name": "RAY_CLOUD_INSTANCE_ID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {
            "name": "RAY_NODE_TYPE_NAME",
            "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['ray.io/group']"}},
        },
        {"name": "KUBERAY_GEN_RAY_START_CMD", "value": start},
    ]
    for name, value in (
        ("RAY_PORT", port),
        ("RAY_ADDRESS", f"{ip}:{port}"),
        ("RAY_USAGE_STATS_KUBERAY_IN_USE", "1"),
    ):
        if not has(name):
            env.append({"name": name, "value": value})
    if head:
        env.append(
            {"name": "RAY_USAGE_STATS_EXTRA_TAGS", "value": "kuberay_version=v1.7.0;kuberay_crd=RayJob"}
        )
    if not has("RAY_DASHBOARD_ENABLE_K8S_DISK_USAGE"):
        env.append({"name": "RAY_DASHBOARD_ENABLE_K8S_DISK_USAGE", "value": "1"})


def label_pod(labels: JsonObject, cluster: str, head: bool, group: str) -> JsonObject:
    """``labelPod``: KubeRay's labels, then the template's over them except the three it keeps."""
    node_type = "head" if head else "worker"
    result = {
        "ray.io/is-ray-node": "yes",
        "ray.io/cluster": cluster,
        "ray.io/node-type": node_type,
        "ray.io/group": group,
        "ray.io/identifier": f"{cluster}-{node_type}",
        "app.kubernetes.io/name": "kuberay",
        "app.kubernetes.io/created-by": "kuberay-operator",
    }
    kept = ("ray.io/node-type", "ray.io/group", "ray.io/cluster")
    result.update({key: value for key, value in labels.items() if key not in kept})
    return result


def wait_gcs_ready(container: JsonObject, fqdn: str, port: str) -> JsonObject:
    """The worker's ``wait-gcs-ready`` init container (``DefaultWorkerPodTemplate``)."""
    script = (
        "SECONDS=0; while true; do "
        f"if ray health-check --address {fqdn}:{port} > /dev/null 2>&1; then echo 'GCS is ready.'; break; fi; "
        'echo "$SECONDS seconds elapsed: Waiting for GCS to be ready."; sleep 5; done'
    )
    return {
        "name": "wait-gcs-ready",
        "image": container.get("image"),
        "command": ["/bin/bash", "-c", "--"],
        "args": [script],
        "securityContext": copy.deepcopy(container.get("securityContext")),
        # setInitContainerEnvVars: FQ_RAY_IP and RAY_IP after the Ray container's own.
        "env": [
            *copy.deepcopy(container.get("env") or []),
            {"name": "FQ_RAY_IP", "value": fqdn},
            {"name": "RAY_IP", "value": fqdn.split(".")[0]},
        ],
        "volumeMounts": copy.deepcopy(container.get("volumeMounts") or []),
        "resources": {
            "limits": {"cpu": "200m", "memory": "256Mi"},
            "requests": {"cpu": "200m", "memory": "256Mi"},
        },
    }


def add_empty_dir(spec: JsonObject, container: JsonObject, name: str, path: str) -> None:
    """``addEmptyDir``: nothing when something is mounted at ``path``; else the volume (sized by
    the container's memory request, else limit) unless one of that name exists, and the mount."""
    if any(mount["mountPath"] == path for mount in container.get("volumeMounts") or []):
        return
    if not any(volume["name"] == name for volume in spec.get("volumes") or []):
        resources = container.get("resources") or {}
        size = (resources.get("requests") or {}).get("memory") or (resources.get("limits") or {}).get(
            "memory"
        )
        spec.setdefault("volumes", []).append(
            {"name": name, "emptyDir": {"medium": "Memory", **({"sizeLimit": size} if size else {})}}
        )
    container.setdefault("volumeMounts", []).append({"name": name, "mountPath": path})


def build_pod(
    group: JsonObject, *, head: bool, cluster: str, namespace: str, ray_version: str, port: str
) -> JsonObject:
    """The pod KubeRay v1.7.0 creates for one replica of ``group`` (a headGroupSpec or a
    workerGroupSpec of the RayJob's rayClusterSpec): the rules of the module docstring in order."""
    template = copy.deepcopy(group["template"])
    spec, fqdn = template["spec"], head_service_fqdn(cluster, namespace)
    group_name = "headgroup" if head else group["groupName"]
    template.setdefault("metadata", {})["labels"] = label_pod(
        (template["metadata"].get("labels") or {}), cluster, head, group_name
    )
    container = spec["containers"][0]
    if head and not any(p.get("name") == "metrics" for p in container.get("ports") or []):
        container.setdefault("ports", []).append({"name": "metrics", "containerPort": DEFAULT_METRICS_PORT})
    if not head:
        spec.setdefault("initContainers", []).append(wait_gcs_ready(container, fqdn, port))
    params = set_missing_ray_start_params(group.get("rayStartParams") or {}, head, port, fqdn)
    if "plasma-directory" not in params:
        add_empty_dir(spec, container, SHM_VOLUME, "/dev/shm")
    start = generate_ray_start_command(head, params, container.get("resources") or {})
    user = " ".join(container.get("command") or []) + " ".join(container.get("args") or [])
    overwrite = (template["metadata"].get("annotations") or {}).get("ray.io/overwrite-container-cmd", "")
    if overwrite.lower() != "true" and "ray start" not in user:
        container["command"] = ["/bin/bash", "-c", "--"]
        generated = f"{ULIMIT_COMMAND}; {start}"
        container["args"] = [f"{user} && {generated}" if user else generated]
    set_container_env(container, head, fqdn, port, start)
    init_probes(container, head, params, ray_version)
    return {"apiVersion": "v1", "kind": "Pod", "metadata": template["metadata"], "spec": spec}


def build_cluster_pods(rayjob: JsonObject, cluster: str) -> list[tuple[str, JsonObject]]:
    """``(pod name, pod)`` for the head and every worker replica of the RayJob's cluster."""
    spec = rayjob["spec"]["rayClusterSpec"]
    namespace = rayjob["metadata"].get("namespace", "default")
    version = str(spec.get("rayVersion", ""))
    port = head_port(spec["headGroupSpec"].get("rayStartParams") or {})
    pods = [
        (
            f"{cluster}-head",
            build_pod(
                spec["headGroupSpec"],
                head=True,
                cluster=cluster,
                namespace=namespace,
                ray_version=version,
                port=port,
            ),
        )
    ]
    for group in spec.get("workerGroupSpecs") or []:
        for index in range(int(group.get("replicas", 1))):
            pod = build_pod(
                group, head=False, cluster=cluster, namespace=namespace, ray_version=version, port=port
            )
            pods.append((f"{cluster}-{group['groupName']}-worker-{index}", pod))
    return pods


PYTHON_HEALTH = (
    "python -c \"import urllib.request; r=urllib.request.urlopen('%s', timeout=%d); "
    "exit(0 if b'success' in r.read() else 1)\""
)
"""``utils.BasePythonHealthCommand`` (v1.7.0)."""


def _go_quote(text: str) -> str:
    """``strconv.Quote``: a double-quoted Go string literal."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def job_submit_command(rayjob: JsonObject, dashboard_url: str, job_id: str) -> list[str]:
    """``BuildJobSubmitCommand`` in K8sJobMode (rule 8): the words the submitter's bash runs."""
    import json

    spec = rayjob["spec"]
    address = dashboard_url if dashboard_url.startswith("http://") else f"http://{dashboard_url}"
    if spec.get("metadata") or spec.get("entrypointResources"):
        raise NotImplementedError(
            "metadata and entrypointResources are not modelled (the operator sets neither)"
        )
    health = PYTHON_HEALTH % (f"{address}/api/gcs_healthz", 10)
    waiting = _go_quote(f"Waiting for Ray Dashboard GCS to become healthy at {address} ...")
    command = [
        "until",
        health,
        ">/dev/null",
        "2>&1",
        ";",
        "do",
        "echo",
        waiting,
        ";",
        "sleep",
        "2",
        ";",
        "done",
        ";",
    ]
    command += [
        "if",
        "!",
        "ray",
        "job",
        "status",
        "--address",
        address,
        job_id,
        ">/dev/null",
        "2>&1",
        ";",
        "then",
    ]
    command += ["ray", "job", "submit", "--address", address, "--no-wait"]
    if spec.get("runtimeEnvYAML"):
        runtime_env = json.dumps(yaml.safe_load(spec["runtimeEnvYAML"]), separators=(",", ":"))
        command += ["--runtime-env-json", _go_quote(runtime_env)]
    if job_id:
        command += ["--submission-id", job_id]
    if float(spec.get("entrypointNumCpus") or 0) > 0:
        command += ["--entrypoint-num-cpus", f"{float(spec['entrypointNumCpus']):f}"]
    if float(spec.get("entrypointNumGpus") or 0) > 0:
        command += ["--entrypoint-num-gpus", f"{float(spec['entrypointNumGpus']):f}"]
    command += ["--", spec["entrypoint"].strip(), ";", "fi", ";"]
    return [*command, "ray", "job", "logs", "--address", address, "--follow", job_id]


def submitter_pod(rayjob: JsonObject, dashboard_url: str, job_id: str) -> JsonObject:
    """The submitter Job's pod (rules 8 and 9): the RayJob's ``submitterPodTemplate`` (else KubeRay's
    default container: the head's image, 1 CPU, 1Gi) with its command and environment."""
    spec = rayjob["spec"]
    template = copy.deepcopy(spec.get("submitterPodTemplate") or {})
    if not template:
        head = spec["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
        template = {
            "spec": {
                "restartPolicy": "Never",
                "containers": [
                    {
                        "name": "ray-job-submitter",
                        "image": head["image"],
                        "resources": {
                            "limits": {"cpu": "1", "memory": "1Gi"},
                            "requests": {"cpu": "500m", "memory": "200Mi"},
                        },
                    }
                ],
            }
        }
    container = template["spec"]["containers"][0]
    if not container.get("command"):
        container["command"] = ["/bin/bash", "-ce", "--"]
        container["args"] = [" ".join(job_submit_command(rayjob, dashboard_url, job_id))]
    container.setdefault("env", []).extend(
        [
            {"name": "PYTHONUNBUFFERED", "value": "1"},
            {"name": "RAY_DASHBOARD_ADDRESS", "value": dashboard_url},
            {"name": "RAY_JOB_SUBMISSION_ID", "value": job_id},
        ]
    )
    metadata = template.setdefault("metadata", {})
    metadata["labels"] = {
        **(metadata.get("labels") or {}),
        "ray.io/originated-from-cr-name": rayjob["metadata"]["name"],
        "ray.io/originated-from-crd": "RayJob",
        "app.kubernetes.io/created-by": "kuberay-operator",
    }
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": template["spec"]}
