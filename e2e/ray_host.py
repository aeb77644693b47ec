"""The Ray cluster of one RayJob in the e2e harness: what KubeRay's head and worker pods provide.

Run as ``python ray_host.py <job.yaml>`` by the KubeRay stand-in. Starts an embedded Ray
declaring the job's pools exactly as KubeRay worker groups advertise them (GPUs, simulated on
CPU, and one custom resource per pool), prints the GCS address on one line, and keeps the
cluster up until its stdin closes (the stand-in deleting the "pods"). Its own reaper kills the
Ray processes when it exits, however it exits.
"""

from __future__ import annotations

import sys
from pathlib import Path

import yaml

from hybridflow.controller import init_local_ray
from hybridflow.spec import parse_job_manifest
from hybridflow.trainer.roles import resource_pools


def main(manifest: str) -> int:
    import ray

    job = parse_job_manifest(yaml.safe_load(Path(manifest).read_text()), manifest)
    # CPUs are as simulated as the GPUs: the pods of a cluster would bring cpusPerGpu cores each.
    gpus = sum(p.nodes * p.gpus_per_node for p in job.spec.resource_pools)
    cpus = sum(p.nodes * p.gpus_per_node * p.cpus_per_gpu for p in job.spec.resource_pools) + 2
    init_local_ray(resource_pools(job.spec, simulated=True), num_cpus=cpus)
    assert ray.cluster_resources().get("GPU", 0) >= gpus
    print(ray.get_runtime_context().gcs_address, flush=True)
    sys.stdin.read()  # until the stand-in closes it
    ray.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1]))
