"""The job's NetworkPolicy: its Ray cluster answers only its own pods, KubeRay and metrics scrapes.

A Ray head serves the dashboard and the job-submission API (8265), the client server (10001)
and the GCS (6379); whoever reaches them can submit code that runs with the job's GPUs,
volumes and credentials. The policy selects every pod of the job (head, workers, submitter:
they all carry the job's labels) and admits ingress from:

* the job's own pods, on every port (Ray's node-to-node traffic uses many ports);
* the KubeRay operator's pods, in any namespace, on the dashboard port only: KubeRay asks the
  head's job API for the job's state;
* anyone, on the metrics ports (the controller's ``hf-metrics`` and Ray's own), which serve
  figures, not control.

Egress is left open: the controller talks to the API server and the job may read its data
from wherever the user put it. Except from the sandbox pods, which run the model's code (the
``python`` tool of ``spec.agent``): :func:`build_sandbox_network_policy` lets them reach the
job's own pods on the ports a Ray node talks to other nodes on (the GCS, raylets, object
managers, workers), never the ports that take orders or leak figures (:data:`SANDBOX_DENIED_PORTS`:
the Ray dashboard and job API, the Ray client server, the controller's stop endpoint and
metrics, Ray's metrics, the agent's chat endpoint), and the cluster's DNS; nothing else. Those
pods also hold the cluster's Ray token (KubeRay gives it to every Ray container, and their Ray
node needs it), so the sandbox refuses to run code where Landlock cannot keep it from reading it
(``hybridflow.agents.sandbox.landlock_required``). A cluster whose network plugin does not enforce
NetworkPolicy ignores the object; Ray's token authentication (``authOptions`` on the RayJob's
cluster, ``hybridflow_operator.builders.rayjob``) guards the same ports there.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from hybridflow.spec.agent import SANDBOX_GROUP
from hybridflow_operator.builders.metadata import POOL_LABEL, JobRef, child_metadata, job_labels
from hybridflow_operator.names import child_names

NETWORK_POLICY_API_VERSION = "networking.k8s.io/v1"
RAY_DASHBOARD_PORT = 8265
METRICS_PORTS = (8080, 8081)
"""Ray's own metrics (KubeRay's ``metrics`` port) and the controller's ``hf-metrics``."""


RAY_CLIENT_PORT = 10001
SANDBOX_DENIED_PORTS = (*METRICS_PORTS, RAY_DASHBOARD_PORT, RAY_CLIENT_PORT)
"""The job's ports a sandbox pod may not reach (module docstring); the chat endpoint's is added
when the job serves one."""
MAX_PORT = 65535


def ports_except(denied: Iterable[int]) -> list[dict[str, Any]]:
    """NetworkPolicy ``ports`` entries (TCP ranges, ``endPort``) covering every port but ``denied``."""
    ranges: list[dict[str, Any]] = []
    start = 1
    for port in sorted(set(denied)):
        if port > start:
            ranges.append({"protocol": "TCP", "port": start, "endPort": port - 1})
        start = port + 1
    if start <= MAX_PORT:
        ranges.append({"protocol": "TCP", "port": start, "endPort": MAX_PORT})
    return [
        entry if entry["port"] != entry["endPort"] else {"protocol": "TCP", "port": entry["port"]}
        for entry in ranges
    ]


def build_sandbox_network_policy(owner: JobRef, *, endpoint_port: int | None = None) -> dict[str, Any]:
    """Egress of ``owner``'s sandbox pods: the job's own pods on Ray's node-to-node ports, and DNS
    (see the module docstring); ``endpoint_port`` is the head's chat endpoint, when it serves one."""
    own_pods = {"matchLabels": job_labels(owner)}
    sandbox_pods = {"matchLabels": {**job_labels(owner), POOL_LABEL: SANDBOX_GROUP}}
    denied = (*SANDBOX_DENIED_PORTS, *([endpoint_port] if endpoint_port is not None else []))
    return {
        "apiVersion": NETWORK_POLICY_API_VERSION,
        "kind": "NetworkPolicy",
        "metadata": child_metadata(child_names(owner.name).sandbox_network_policy, owner),
        "spec": {
            "podSelector": sandbox_pods,
            "policyTypes": ["Egress"],
            "egress": [
                {"to": [{"podSelector": own_pods}], "ports": ports_except(denied)},
                {
                    "to": [
                        {"namespaceSelector": {}, "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}}}
                    ],
                    "ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}],
                },
            ],
        },
    }


def build_network_policy(owner: JobRef, *, kuberay_pod_labels: Mapping[str, str]) -> dict[str, Any]:
    """The NetworkPolicy of ``owner``'s pods (see the module docstring); ``kuberay_pod_labels``
    are the KubeRay operator pods' labels (``RayJobDefaults.kuberay_pod_labels``)."""
    own_pods = {"matchLabels": job_labels(owner)}
    return {
        "apiVersion": NETWORK_POLICY_API_VERSION,
        "kind": "NetworkPolicy",
        "metadata": child_metadata(child_names(owner.name).network_policy, owner),
        "spec": {
            "podSelector": own_pods,
            "policyTypes": ["Ingress"],
            "ingress": [
                {"from": [{"podSelector": own_pods}]},
                {
                    "from": [
                        {"namespaceSelector": {}, "podSelector": {"matchLabels": dict(kuberay_pod_labels)}}
                    ],
                    "ports": [{"protocol": "TCP", "port": RAY_DASHBOARD_PORT}],
                },
                {"ports": [{"protocol": "TCP", "port": port} for port in METRICS_PORTS]},
            ],
        },
    }
