"""Fuzzed RLHFJob manifests through every gate: CRD schema + CEL (admission), the spec, the CLI, the builders.

For each case (an example with up to four random edits, see ``manifests.py``):

* admission (``admission.py``: defaulting, the committed CRD's schema, its CEL rules, the API
  server's name rule) and the local check of a cluster manifest (``parse_job_manifest`` plus the
  rules only a cluster has, ``in_cluster_problems``: what ``hybridflow validate --in-cluster``
  runs) agree: both accept or both reject;
* every rejection names a field (``spec.training.totalSteps: ...``), on both sides;
* ``hybridflow validate --in-cluster`` exits 0 or 2, never with a traceback;
* an accepted manifest builds: the operator's pure builders return every child, and the RayJob
  validates against the real KubeRay v1.7 CRD where ``../shared/kuberay`` is present;
* an accepted manifest reconciles: the operator's pass on an in-memory cluster
  (``kube.fake_cluster``) makes every child in one pass without raising (nothing partial), and a
  second pass writes nothing.

``HYBRIDFLOW_FUZZ_CASES`` sets the number of cases (default 250, the same ones every run;
``bench/e2e.py`` runs more).
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import tempfile
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml
from admission import admission_errors
from hypothesis import HealthCheck, given, settings
from jsonschema import Draft4Validator
from manifests import manifests

from hybridflow.cli import main as hybridflow_main
from hybridflow.spec import SpecError, in_cluster_problems, parse_job_manifest
from hybridflow_operator.builders import JobRef, RayJobDefaults, build_children
from kube.fake_cluster import FakeCluster
from kube.kueue import MAX_POD_SETS, rayjob_pod_sets, workload_refusal

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
KUBERAY_RAYJOB_CRD = ROOT.parent / "shared" / "kuberay" / "ray.io_rayjobs.yaml"
CASES = int(os.environ.get("HYBRIDFLOW_FUZZ_CASES", "250"))
DEFAULTS = RayJobDefaults(image="registry.example.com/hybridflow:0.1.0")
UID = "5f0c6b7e-2a4d-4c1e-9a53-0d1e2f3a4b5c"
FIELD = re.compile(r"^(<root>|[A-Za-z][\w-]*(\[\d+\])?(\.[\w-]+(\[\d+\])?)*): ")
"""A rejection starts with the path of the field it is about."""
WORKDIR = tempfile.TemporaryDirectory(prefix="hybridflow-fuzz-")

# Counted across the cases of one run, for the summary line bench/e2e.py prints.
TALLY = {"cases": 0, "accepted": 0, "rejected": 0, "disagreements": 0, "operator_crashes": 0}


@cache
def kuberay_validator() -> Draft4Validator | None:
    if not KUBERAY_RAYJOB_CRD.is_file():
        return None
    crd = yaml.safe_load(KUBERAY_RAYJOB_CRD.read_text())
    return Draft4Validator(crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"])


def local_errors(manifest: dict[str, Any]) -> list[str]:
    """What ``hybridflow validate --in-cluster`` rejects: the spec, then the rules only a cluster has."""
    try:
        job = parse_job_manifest(manifest, "fuzz")
    except SpecError as error:
        return list(error.problems)
    return in_cluster_problems(job.spec)


def validate_cli(manifest: dict[str, Any]) -> tuple[int, str]:
    path = Path(WORKDIR.name) / "job.yaml"
    path.write_text(yaml.dump(manifest, Dumper=getattr(yaml, "CSafeDumper", yaml.SafeDumper)))
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = hybridflow_main(["validate", "--in-cluster", str(path)])
    return code, err.getvalue()


def check_case(manifest: dict[str, Any], edits: list[str]) -> None:
    TALLY["cases"] += 1
    admitted = admission_errors(manifest)
    local = local_errors(manifest)
    story = f"edits {edits}\nadmission: {admitted}\nlocal: {local}"
    if bool(admitted) != bool(local):
        TALLY["disagreements"] += 1
    assert bool(admitted) == bool(local), f"admission and the spec disagree\n{story}"
    code, stderr = validate_cli(manifest)
    assert code == (2 if local else 0) and "Traceback" not in stderr, (
        f"validate exited {code}\n{stderr}\n{story}"
    )
    if local:
        TALLY["rejected"] += 1
        for problem in [*admitted, *local]:
            assert FIELD.match(problem), f"a rejection that names no field: {problem!r}\n{story}"
        return
    TALLY["accepted"] += 1
    job = parse_job_manifest(
        {**manifest, "metadata": {**manifest["metadata"], "namespace": "fuzz", "uid": UID}}, "fuzz"
    )
    try:
        children = build_children(job, JobRef.of(job), attempt=1, defaults=DEFAULTS)
    except Exception:
        TALLY["operator_crashes"] += 1
        raise
    kinds = [child["kind"] for child in children]
    agent = job.spec.agent
    assert kinds == [
        "ConfigMap",
        "ServiceAccount",
        "Role",
        "RoleBinding",
        "NetworkPolicy",
        *(["NetworkPolicy"] if agent.sandbox_workers else []),
        *(["Service"] if agent.loop == "endpoint" else []),
        "RayJob",
    ], f"{kinds}\n{story}"
    # The operator's pass itself (the pure reconcile on an in-memory cluster): it never raises,
    # makes every child (nothing partial) in one pass, and a second pass writes nothing.
    cluster = FakeCluster({**job.model_dump(by_alias=True, exclude_none=True), "status": {}})
    cluster.job["metadata"].update(uid=UID, generation=1)
    try:
        cluster.pass_()
    except Exception:
        TALLY["operator_crashes"] += 1
        raise
    made = sorted(kind for kind, _ in cluster.objects if kind != "RLHFJob")
    assert made == sorted(kinds) and not cluster.result.failed, f"{made} {cluster.result}\n{story}"
    assert cluster.pass_() == 0, f"a second pass wrote\n{story}"
    validator = kuberay_validator()
    if validator is not None:
        problems = [error.message for error in validator.iter_errors(children[-1])]
        assert not problems, f"the RayJob does not fit KubeRay's CRD: {problems}\n{story}"
    if job.spec.queue_name is not None:
        for version in MAX_POD_SETS:  # every supported Kueue admits it and makes its Workload
            refusal = workload_refusal(rayjob_pod_sets(children[-1]), version)
            assert refusal is None, f"Kueue {version} cannot make its Workload: {refusal}\n{story}"


@settings(
    max_examples=CASES,
    deadline=None,
    derandomize=True,  # the same cases every run: CI failures reproduce
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    database=None,
)
@given(manifests())
def test_fuzzed_manifests_are_accepted_everywhere_or_rejected_everywhere(
    case: tuple[dict[str, Any], list[str]],
) -> None:
    manifest, edits = case
    check_case(manifest, edits)


def test_the_fuzzer_reaches_both_outcomes() -> None:
    """Guard against a fuzzer that only ever rejects (or accepts): both outcomes occur often."""
    if TALLY["cases"] < 100:
        pytest.skip("run together with the fuzz test")
    assert TALLY["accepted"] >= TALLY["cases"] // 10 and TALLY["rejected"] >= TALLY["cases"] // 10, TALLY
