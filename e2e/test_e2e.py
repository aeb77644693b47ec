"""From an applied manifest to a trained checkpoint, then broken on purpose.

Every scenario applies an RLHFJob to the API-server double and lets the operator, the KubeRay
stand-in and a real ``hybridflow run --in-cluster`` do the rest; it checks only what a user
sees: the RLHFJob's status, its children, the checkpoints and metrics on the volumes.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
import yaml
from kubernetes import client

from conftest import E2E, NAMESPACE

ROOT = Path(__file__).resolve().parents[1]
GROUP, VERSION, PLURAL = "hybridflow.io", "v1alpha1", "rlhfjobs"
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
FAULTS_EXAMPLE = ROOT / "examples" / "grpo-tiny.yaml"  # the demo: the fastest job, as the fault tests need
T = TypeVar("T")
# Real training runs on 2 shared cores: minutes per scenario under load.
pytestmark = pytest.mark.timeout(1800)


def duplicate_children(owned: list[str], attempts: int) -> int:
    """Children beyond one of each kind (and one RayJob per attempt)."""
    kinds = [child.split("/")[0] for child in owned]
    return sum(max(0, kinds.count(kind) - (attempts if kind == "RayJob" else 1)) for kind in set(kinds))


def lost_or_repeated(steps: list[int], total: int) -> int:
    expected = list(range(1, total + 1))
    return len(set(expected) - set(steps)) + (len(steps) - len(set(steps)))


def wait_for(
    what: str,
    probe: Callable[[], T | None],
    timeout_seconds: float = 600,
    left: Callable[[], object] | None = None,
) -> T:
    """``probe()`` once it is truthy; on timeout an error naming ``what`` (and ``left()``: what is
    still in the way)."""
    deadline = time.monotonic() + timeout_seconds
    while time.monotonic() < deadline:
        value = probe()
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}" + (f": {left()}" if left else ""))


GPUS_PER_POOL = 2  # what 2 shared cores carry: one simulated GPU a core
PROMPTS_PER_STEP = 4


def manifest(example: Path, tiny: Path, name: str, *, steps: int, claim: str) -> dict[str, Any]:
    """The example as a user would apply it on a cluster: volumes for the models and checkpoints.

    The tiny model stands in for every model; a cluster example's pools and batch are cut to
    what this machine carries (at most 2 simulated GPUs a pool, 4 prompts a step, one
    mini-batch), everything else as the example has it. A plugin algorithm is found as in a
    cluster: ``PYTHONPATH`` in ``spec.pods.env`` names where its module is.
    """
    doc = yaml.safe_load(example.read_text())
    spec = doc["spec"]
    doc["metadata"] = {"name": name, "namespace": NAMESPACE}
    spec["models"] = {role: {"path": str(tiny / "model")} for role in spec["models"]}
    spec["data"]["trainFiles"] = [str(tiny / "data" / "target_char.jsonl")]
    spec["data"]["maxPromptTokens"] = min(spec["data"].get("maxPromptTokens", 64), 64)
    spec["rollout"]["maxResponseTokens"] = 8
    training = spec["training"]
    training["totalSteps"] = steps
    for pool in spec["resourcePools"]:
        pool["nodes"], pool["gpusPerNode"] = 1, min(pool["gpusPerNode"] * pool["nodes"], GPUS_PER_POOL)
    if training["promptsPerStep"] > PROMPTS_PER_STEP:
        sequences = PROMPTS_PER_STEP * spec["algorithm"].get("samplesPerPrompt", 1)
        training.update(promptsPerStep=PROMPTS_PER_STEP, miniBatchSize=sequences)
        training["microBatchSizePerGpu"] = sequences // GPUS_PER_POOL
    if ":" in spec["algorithm"]["name"]:
        pods = spec.setdefault("pods", {})
        pods["env"] = [
            *pods.get("env", []),
            {"name": "PYTHONPATH", "value": str(ROOT / "examples" / "plugins")},
        ]
    spec["checkpoint"] = {
        "intervalSteps": 2,
        "keepLast": 3,
        "volume": {"claimName": claim, "mountPath": "/ckpt"},
    }
    spec["outputDir"] = "/ckpt/outputs"
    return doc


def apply(e2e: E2E, doc: dict[str, Any]) -> None:
    e2e.cluster.custom.create_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, doc)


def status(e2e: E2E, name: str) -> dict[str, Any]:
    job = e2e.cluster.custom.get_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, name)
    return dict(job.get("status") or {})


def phase_is(e2e: E2E, name: str, *phases: str) -> dict[str, Any] | None:
    current = status(e2e, name)
    if current.get("phase") == "Failed" and "Failed" not in phases:
        raise AssertionError(f"{name} failed: {current.get('reason')}: {current.get('message', '')[-3000:]}")
    return current if current.get("phase") in phases else None


def children(e2e: E2E, name: str) -> list[str]:
    """Every object labelled as this job's child, by kind/name."""
    found = []
    api = e2e.cluster
    for kind, items in (
        ("ConfigMap", api.core.list_namespaced_config_map(NAMESPACE).items),
        ("ServiceAccount", api.core.list_namespaced_service_account(NAMESPACE).items),
    ):
        found += [
            f"{kind}/{item.metadata.name}"
            for item in items
            if _owned_by(item.metadata.owner_references, name)
        ]
    rbac = client.RbacAuthorizationV1Api(api.api_client)
    networking = client.NetworkingV1Api(api.api_client)
    for kind, items in (
        ("Role", rbac.list_namespaced_role(NAMESPACE).items),
        ("RoleBinding", rbac.list_namespaced_role_binding(NAMESPACE).items),
        ("NetworkPolicy", networking.list_namespaced_network_policy(NAMESPACE).items),
    ):
        found += [
            f"{kind}/{item.metadata.name}"
            for item in items
            if _owned_by(item.metadata.owner_references, name)
        ]
    rayjobs = api.custom.list_namespaced_custom_object("ray.io", "v1", NAMESPACE, "rayjobs")["items"]
    found += [
        f"RayJob/{item['metadata']['name']}"
        for item in rayjobs
        if any(ref.get("name") == name for ref in item["metadata"].get("ownerReferences", []))
    ]
    return sorted(found)


def _owned_by(references: list[Any] | None, name: str) -> bool:
    return any(ref.name == name and ref.kind == "RLHFJob" for ref in references or [])


def metrics_steps(e2e: E2E, claim: str) -> list[int]:
    lines = (e2e.root / "volumes" / claim / "outputs" / "metrics.jsonl").read_text().splitlines()
    return [int(json.loads(line)["step"]) for line in lines]


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda path: path.stem)
def test_applying_an_example_trains_to_succeeded_and_deleting_removes_every_child(
    e2e: E2E, tiny: Path, example: Path, figures: dict[str, object]
) -> None:
    name = example.stem
    apply(e2e, manifest(example, tiny, name, steps=2, claim=f"{name}-ckpt"))
    done = wait_for(f"{name} Succeeded", lambda: phase_is(e2e, name, "Succeeded"))
    progress = done["progress"]
    assert progress["step"] == progress["totalSteps"] == 2 and progress["percent"] == 100
    assert "reward" in progress and progress["tokensPerSecond"] > 0 and progress["etaSeconds"] == 0
    assert progress["lastCheckpointStep"] == 2
    assert (
        e2e.root / "volumes" / f"{name}-ckpt" / "checkpoints" / "step_000002" / "controller.json"
    ).is_file()
    steps = metrics_steps(e2e, f"{name}-ckpt")
    figures["lost_or_repeated_steps"] = lost_or_repeated(steps, 2)
    assert steps == [1, 2]
    owned = children(e2e, name)
    figures["duplicate_children"] = duplicate_children(owned, 1)
    kinds = {kind.split("/")[0] for kind in owned}
    assert kinds == {"ConfigMap", "ServiceAccount", "Role", "RoleBinding", "NetworkPolicy", "RayJob"}, owned
    assert duplicate_children(owned, attempts=1) == 0, owned

    e2e.cluster.custom.delete_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, name)
    try:
        wait_for(
            "every child deleted",
            lambda: children(e2e, name) == [] or None,
            timeout_seconds=60,
            left=lambda: children(e2e, name),
        )
    finally:
        figures["orphaned_children"] = len(children(e2e, name))


def test_a_killed_run_is_retried_and_resumes_from_its_checkpoint(
    e2e: E2E, tiny: Path, figures: dict[str, object]
) -> None:
    name, claim = "killed", "killed-ckpt"
    apply(e2e, manifest(FAULTS_EXAMPLE, tiny, name, steps=4, claim=claim))
    wait_for(
        "a checkpoint at step 2",
        lambda: (status(e2e, name).get("progress") or {}).get("lastCheckpointStep") == 2 or None,
    )
    first = status(e2e, name)["rayJobName"]
    e2e.kuberay.kill_entrypoint(first, signal.SIGKILL)  # the head pod's node is lost
    done = wait_for("Succeeded after a retry", lambda: phase_is(e2e, name, "Succeeded"))
    assert done["attempts"] == 2 and done["rayJobName"] != first
    assert e2e.kuberay.finished[first] == -signal.SIGKILL
    steps = metrics_steps(e2e, claim)
    figures["lost_or_repeated_steps"] = lost_or_repeated(steps, 4)
    assert steps == [1, 2, 3, 4], steps  # nothing lost, nothing repeated
    log = (e2e.root / "pods" / done["rayJobName"] / "entrypoint.log").read_text()
    assert "resumed from" in log and "(step 2)" in log, log[-2000:]
    owned = children(e2e, name)
    figures["duplicate_children"] = duplicate_children(owned, 2)
    assert duplicate_children(owned, attempts=2) == 0, owned


def test_suspend_and_resume_mid_run_continue_from_the_checkpoint(
    e2e: E2E, tiny: Path, figures: dict[str, object]
) -> None:
    name, claim = "paused", "paused-ckpt"
    apply(e2e, manifest(FAULTS_EXAMPLE, tiny, name, steps=4, claim=claim))
    wait_for("step 1", lambda: (status(e2e, name).get("progress") or {}).get("step", 0) >= 1 or None)
    e2e.cluster.custom.patch_namespaced_custom_object(
        GROUP, VERSION, NAMESPACE, PLURAL, name, {"spec": {"suspend": True}}
    )
    wait_for("Suspended", lambda: phase_is(e2e, name, "Suspended"))
    saved = sorted(p.name for p in (e2e.root / "volumes" / claim / "checkpoints").glob("step_*"))
    assert saved, "suspending (SIGTERM to the controller) wrote no checkpoint"
    e2e.cluster.custom.patch_namespaced_custom_object(
        GROUP, VERSION, NAMESPACE, PLURAL, name, {"spec": {"suspend": False}}
    )
    done = wait_for("Succeeded after resuming", lambda: phase_is(e2e, name, "Succeeded"))
    assert done["progress"]["step"] == 4
    steps = metrics_steps(e2e, claim)
    figures["lost_or_repeated_steps"] = lost_or_repeated(steps, 4)
    assert steps == [1, 2, 3, 4], steps
