"""The Service of the chat endpoint (``spec.agent.loop: endpoint``): the job's agents reach the controller.

The endpoint (``hybridflow.rollout.endpoint``) listens on the head pod, where the controller
runs, on ``spec.agent.endpointPort``. The Service selects the job's head pod (of whatever
attempt runs) and exposes that port inside the cluster, so that agents in the job's other pods
use ``http://<job>-agent.<namespace>.svc:<port>/v1``. The job's NetworkPolicy (``<job>-ray``)
admits only the job's own pods to the head's ports, this one included; each session's API key
is random and valid for its session only.
"""

from __future__ import annotations

from typing import Any

from hybridflow.spec import RLHFJob
from hybridflow_operator.builders.metadata import NODE_TYPE_LABEL, JobRef, child_metadata, job_labels
from hybridflow_operator.names import child_names

AGENT_PORT_NAME = "hf-agent"


def build_agent_service(job: RLHFJob, owner: JobRef) -> dict[str, Any]:
    port = job.spec.agent.endpoint_port
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": child_metadata(child_names(owner.name).agent_service, owner),
        "spec": {
            "type": "ClusterIP",
            "selector": {**job_labels(owner), NODE_TYPE_LABEL: "head"},
            "ports": [{"name": AGENT_PORT_NAME, "protocol": "TCP", "port": port, "targetPort": port}],
        },
    }
