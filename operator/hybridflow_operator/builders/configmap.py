"""The ConfigMap that carries the job's whole runtime config to the controller.

DESIGN fixes that config travels in an owned ConfigMap, never on a command line. Its one key,
``job.yaml``, is the RLHFJob manifest itself (``RLHFJob.to_manifest()``: camelCase, defaults
filled in), which the controller reads back with ``hybridflow.spec.parse_job_manifest`` into
an equal ``RLHFJob``, so the cluster and ``hybridflow run`` on a laptop run the very same
config. Its metadata is reduced to ``name`` and ``namespace``: that is where the controller
pushes ``status.progress``, and leaving out server-set fields (resourceVersion, generation,
managedFields) keeps the ConfigMap unchanged, hence unwritten, until the spec itself changes.

The ConfigMap is mounted at :data:`CONFIG_MOUNT_PATH` in the head pod only, the one pod where
the controller runs; workers get their share of the config from the controller through Ray.
A spec edit updates the ConfigMap; a running controller does not reload it, the next attempt
reads it (mutable fields apply from the next attempt on).
"""

from __future__ import annotations

import functools
import json
from typing import Any

import yaml

from hybridflow.spec import RLHFJob
from hybridflow_operator.builders.metadata import MANAGED_BY, JobRef, child_metadata
from hybridflow_operator.names import child_names

CONFIG_MOUNT_PATH = "/etc/hybridflow"
CONFIG_KEY = "job.yaml"
CONFIG_PATH = f"{CONFIG_MOUNT_PATH}/{CONFIG_KEY}"
"""What ``hybridflow run --in-cluster`` reads."""


def runtime_manifest(job: RLHFJob, owner: JobRef) -> dict[str, Any]:
    """The manifest the controller reads: the full spec, and metadata naming the RLHFJob to report to."""
    manifest = job.to_manifest()
    manifest["metadata"] = {"name": owner.name, "namespace": owner.namespace}
    return manifest


@functools.lru_cache(maxsize=4096)
def _yaml_text(manifest_json: str) -> str:
    """The manifest as YAML, memoised by its JSON: rendering YAML was 95% of a no-op reconcile's
    time, and a job's manifest changes only with its spec (libyaml's emitter when present)."""
    dumper = getattr(yaml, "CSafeDumper", yaml.SafeDumper)
    return str(yaml.dump(json.loads(manifest_json), Dumper=dumper, sort_keys=False, width=1000))


def build_configmap(job: RLHFJob, owner: JobRef) -> dict[str, Any]:
    """The job's ConfigMap (see the module docstring)."""
    header = (
        f"# Runtime config of RLHFJob {owner.namespace}/{owner.name}, written by {MANAGED_BY}.\n"
        f"# Read by `hybridflow run --in-cluster {CONFIG_PATH}`; edit the RLHFJob, not this file.\n"
    )
    text = header + _yaml_text(json.dumps(runtime_manifest(job, owner)))
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": child_metadata(child_names(owner.name).config_map, owner),
        "data": {CONFIG_KEY: text},
    }
