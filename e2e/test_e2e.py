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
from hybridflow.cli import EXIT_PREEMPTED

ROOT = Path(__file__).resolve().parents[1]
GROUP, VERSION, PLURAL = "hybridflow.io", "v1alpha1", "rlhfjobs"
# grpo-tiny-server is applied by the rollout-replica scenario, which also checks its deletion;
# grpo-tiny-agent trains in tests/integration/test_agent_rollouts.py (its tool loop and sandbox
# run in the controller: nothing of it is the cluster's), which keeps .ci/run within its budget.
# Not here: the agent examples need their plugins on the workers' path and (lookup) a warmed-up
# model, tests/integration/test_agent_rollouts.py runs each as its docs say; the validation
# example is grpo-tiny plus a validation set (a unit test holds them equal otherwise), run by
# tests/integration/test_run_job.py.
EXAMPLES = sorted(
    path
    for path in (ROOT / "examples").glob("*.yaml")
    if path.stem not in ("grpo-tiny-server", "grpo-tiny-agent", "grpo-tiny-lookup", "grpo-tiny-validation")
)
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
    # Enough steps that the kill lands mid-run however fast a step is, and the checkpoint watched
    # on the volume itself (the status is pushed every few seconds, and lags a fast run).
    apply(e2e, manifest(FAULTS_EXAMPLE, tiny, name, steps=STOP_STEPS, claim=claim))
    wait_for("a checkpoint at step 2", lambda: 2 in checkpointed_steps(e2e, claim) or None)
    first = status(e2e, name)["rayJobName"]
    e2e.kuberay.kill_entrypoint(first, signal.SIGKILL)  # the head pod's node is lost
    wait_for("the killed driver's exit", lambda: first in e2e.kuberay.finished or None)
    latest = e2e.root / "volumes" / claim / "checkpoints" / "latest"
    resumed_from = int(latest.read_text().strip().removeprefix("step_"))  # what the retry must resume
    done = wait_for("Succeeded after a retry", lambda: phase_is(e2e, name, "Succeeded"))
    assert done["attempts"] == 2 and done["rayJobName"] != first
    assert e2e.kuberay.finished[first] == -signal.SIGKILL
    assert 2 <= resumed_from < STOP_STEPS  # killed mid-run
    steps = metrics_steps(e2e, claim)
    figures["lost_or_repeated_steps"] = lost_or_repeated(steps, STOP_STEPS)
    assert steps == list(range(1, STOP_STEPS + 1)), steps  # nothing lost, nothing repeated
    log = (e2e.root / "pods" / done["rayJobName"] / "entrypoint.log").read_text()
    assert "resumed from" in log and f"(step {resumed_from})" in log, log[-2000:]
    owned = children(e2e, name)
    figures["duplicate_children"] = duplicate_children(owned, 2)
    assert duplicate_children(owned, attempts=2) == 0, owned


STOP_STEPS = 40
"""Steps of the stop scenarios: enough that the stop lands mid-run however fast a step is."""


def trained(e2e: E2E, claim: str, steps: int) -> bool | None:
    """At least ``steps`` steps in the run's metrics (written each step; the status lags behind)."""
    path = e2e.root / "volumes" / claim / "outputs" / "metrics.jsonl"
    return (path.is_file() and len(path.read_text().splitlines()) >= steps) or None


def checkpointed_steps(e2e: E2E, claim: str) -> list[int]:
    return sorted(
        int(p.name.removeprefix("step_"))
        for p in (e2e.root / "volumes" / claim / "checkpoints").glob("step_*")
    )


def stopped_cleanly(e2e: E2E, rayjob: str, claim: str, pods: set[str] | None = None) -> int:
    """After a stop through pod deletion: the driver saved and exited by itself (143, not killed),
    the preStop hook of every pod deleted (``pods``, default all of them) returned 0 only once that
    checkpoint was complete, so no node's Ray went first, and the newest checkpoint holds the last
    completed step. That step."""
    cluster = e2e.kuberay.cluster_of(rayjob)
    deleted = pods if pods is not None else {pod.name for pod in cluster.pods}
    wait_for(
        f"{rayjob}'s pods terminated",
        lambda: (cluster.ray_ended.is_set() and {pod for pod, _ in cluster.hooks} >= deleted) or None,
        timeout_seconds=300,
        left=lambda: cluster.hooks,
    )
    assert all(code == 0 for _, code in cluster.hooks), cluster.hooks
    assert e2e.kuberay.finished[rayjob] == EXIT_PREEMPTED, e2e.kuberay.finished[rayjob]
    completed = max(metrics_steps(e2e, claim))
    assert checkpointed_steps(e2e, claim)[-1] == completed, (checkpointed_steps(e2e, claim), completed)
    # controller.json is the checkpoint's last file (written, then the directory renamed into place).
    saved_at = (
        (e2e.root / "volumes" / claim / "checkpoints" / f"step_{completed:06d}" / "controller.json")
        .stat()
        .st_mtime
    )
    early = {
        pod: round(cluster.hook_returned[pod] - saved_at, 2)
        for pod in deleted
        if cluster.hook_returned[pod] < saved_at
    }
    assert not early, f"these pods' hooks let their Ray go before the checkpoint was complete: {early}"
    log = (cluster.log.read_text() if cluster.log else "")[-4000:]
    assert "stop requested by the preStop hook of pod" in log, log
    return completed


def whole_cluster_deleted(e2e: E2E, rayjob: str) -> None:
    """The stop went through the deletion of the whole RayCluster: its head Service with it, so the
    name every worker knows its head by no longer resolved while the hooks waited."""
    cluster = e2e.kuberay.cluster_of(rayjob)
    assert rayjob not in e2e.kuberay.clusters and not e2e.kuberay.dns.resolves(cluster.head_service)
    worker = next(pod for pod in cluster.pods if not pod.head)
    known = (worker.ray_tmpdir / "ray" / "ray_current_cluster").read_text()
    assert known.startswith(cluster.head_service + ":"), known  # what Ray wrote from --address


def test_suspend_and_resume_mid_run_continue_from_the_checkpoint(
    e2e: E2E, tiny: Path, figures: dict[str, object]
) -> None:
    """A suspend deletes the whole cluster at once (KubeRay): the preStop hooks make the controller
    save its last completed step before Ray goes, and the resumed attempt starts right after it."""
    name, claim = "paused", "paused-ckpt"
    doc = manifest(FAULTS_EXAMPLE, tiny, name, steps=STOP_STEPS, claim=claim)
    doc["spec"]["checkpoint"]["intervalSteps"] = 100  # only the stop's own checkpoint
    apply(e2e, doc)
    wait_for("step 2", lambda: trained(e2e, claim, 2))
    first = status(e2e, name)["rayJobName"]
    e2e.cluster.custom.patch_namespaced_custom_object(
        GROUP, VERSION, NAMESPACE, PLURAL, name, {"spec": {"suspend": True}}
    )
    wait_for("Suspended", lambda: phase_is(e2e, name, "Suspended"))
    saved = stopped_cleanly(e2e, first, claim)
    whole_cluster_deleted(e2e, first)
    figures["suspend_saved_step"] = saved
    e2e.cluster.custom.patch_namespaced_custom_object(
        GROUP, VERSION, NAMESPACE, PLURAL, name, {"spec": {"suspend": False}}
    )
    done = wait_for("Succeeded after resuming", lambda: phase_is(e2e, name, "Succeeded"))
    assert done["progress"]["step"] == STOP_STEPS
    steps = metrics_steps(e2e, claim)
    figures["lost_or_repeated_steps"] = lost_or_repeated(steps, STOP_STEPS)
    assert steps == list(range(1, STOP_STEPS + 1)), steps
    log = (e2e.root / "pods" / done["rayJobName"] / "entrypoint.log").read_text()
    assert f"(step {saved})" in log, log[-2000:]  # resumed right after the saved step


def test_a_kueue_preemption_saves_the_last_step_and_the_readmitted_job_resumes_after_it(
    e2e: E2E, kueue: Any, tiny: Path, figures: dict[str, object]
) -> None:
    name, claim = "preempted", "preempted-ckpt"
    doc = manifest(FAULTS_EXAMPLE, tiny, name, steps=STOP_STEPS, claim=claim)
    doc["spec"]["queueName"] = "research"
    doc["spec"]["checkpoint"]["intervalSteps"] = 100
    apply(e2e, doc)
    wait_for("step 2", lambda: trained(e2e, claim, 2))
    rayjob = status(e2e, name)["rayJobName"]
    kueue.hold()  # the preemptor takes the quota: nothing is readmitted until it is released
    kueue.evict(rayjob)
    wait_for("Queued", lambda: phase_is(e2e, name, "Queued"))
    saved = stopped_cleanly(e2e, rayjob, claim)
    whole_cluster_deleted(e2e, rayjob)
    figures["preemption_saved_step"] = saved
    kueue.release()
    done = wait_for("Succeeded after readmission", lambda: phase_is(e2e, name, "Succeeded"))
    assert done["attempts"] == 1  # the same RayJob, suspended and unsuspended by Kueue
    steps = metrics_steps(e2e, claim)
    figures["lost_or_repeated_steps"] = lost_or_repeated(steps, STOP_STEPS)
    assert steps == list(range(1, STOP_STEPS + 1)), steps


def test_a_deadline_stop_of_a_queued_job_saves_its_last_step_and_stays_stopped(
    e2e: E2E, kueue: Any, tiny: Path, figures: dict[str, object]
) -> None:
    """Kueue unsuspends an admitted RayJob whoever suspended it: the stop goes through the Workload."""
    name, claim = "deadline", "deadline-ckpt"
    # Far more steps than 90 s can run (500 took 81 s on an idle 2-core machine): the deadline
    # always lands mid-run, and only the stop's own checkpoint saves anything.
    doc = manifest(FAULTS_EXAMPLE, tiny, name, steps=100_000, claim=claim)
    doc["spec"]["queueName"] = "research"
    doc["spec"]["checkpoint"]["intervalSteps"] = 100_000
    doc["spec"]["activeDeadlineSeconds"] = 90  # from KubeRay starting the cluster: mid-run here
    apply(e2e, doc)
    failed = wait_for("DeadlineExceeded", lambda: phase_is(e2e, name, "Failed"), timeout_seconds=900)
    assert failed["reason"] == "DeadlineExceeded", failed
    rayjob = failed["rayJobName"]
    saved = stopped_cleanly(e2e, rayjob, claim)
    whole_cluster_deleted(e2e, rayjob)
    figures["deadline_saved_step"] = saved
    time.sleep(5)  # Kueue would have readmitted it by now
    assert rayjob not in e2e.kuberay.clusters  # no new cluster: it stays stopped
    assert status(e2e, name)["phase"] == "Failed" and status(e2e, name)["attempts"] == 1


def test_an_evicted_worker_pod_makes_the_attempt_checkpoint_and_the_next_resumes_after_it(
    e2e: E2E, tiny: Path, figures: dict[str, object]
) -> None:
    """A drained node deletes one pod: its preStop hook asks the controller to stop, which saves the
    step and ends the attempt; the retry resumes after it, and nothing is lost or repeated. The
    stop is the cluster's doing, not the job's: with maxRestarts 0 the job still gets its retry."""
    name, claim = "evicted", "evicted-ckpt"
    doc = manifest(FAULTS_EXAMPLE, tiny, name, steps=STOP_STEPS, claim=claim)
    doc["spec"]["checkpoint"]["intervalSteps"] = 100
    doc["spec"]["maxRestarts"] = 0
    apply(e2e, doc)
    wait_for("step 2", lambda: trained(e2e, claim, 2))
    first = status(e2e, name)["rayJobName"]
    e2e.kuberay.evict_pod(first, "worker").join(timeout=300)
    saved = stopped_cleanly(e2e, first, claim, pods={"default-0"})
    figures["eviction_saved_step"] = saved
    done = wait_for("Succeeded after the retry", lambda: phase_is(e2e, name, "Succeeded"))
    assert done["attempts"] == 2
    steps = metrics_steps(e2e, claim)
    figures["lost_or_repeated_steps"] = lost_or_repeated(steps, STOP_STEPS)
    assert steps == list(range(1, STOP_STEPS + 1)), steps
    events = e2e.cluster.core.list_namespaced_event(NAMESPACE).items
    retries = [
        (e.type, e.reason, e.message)
        for e in events
        if e.reason in ("Retrying", "StopRequested") and e.involved_object.name == name
    ]
    assert len(retries) == 1 and retries[0][:2] == ("Normal", "StopRequested"), retries
    assert "stopped on request (the preStop hook of pod" in retries[0][2], retries
    assert "not counted against spec.maxRestarts" in retries[0][2], retries


SERVER_EXAMPLE = ROOT / "examples" / "grpo-tiny-server.yaml"
REPLICA_STEPS = 150
"""Steps of the replica scenario: enough that the replacement (seconds) lands well before the end."""


def test_a_killed_rollout_replica_is_replaced_and_the_attempt_goes_on(
    e2e: E2E, tiny: Path, figures: dict[str, object]
) -> None:
    """Server mode: SIGKILL one rollout replica's process after step 2. The same attempt finishes,
    no step is lost or repeated, the status counts the replacement and an Event reports it."""
    import psutil

    name, claim = "replica", "replica-ckpt"
    doc = manifest(SERVER_EXAMPLE, tiny, name, steps=REPLICA_STEPS, claim=claim)
    doc["spec"]["checkpoint"]["intervalSteps"] = 1000
    apply(e2e, doc)
    wait_for("step 2", lambda: trained(e2e, claim, 2))

    def replicas() -> list[psutil.Process]:
        return [
            p
            for p in psutil.process_iter(["cmdline"])
            if "ray::RolloutReplica" in " ".join(p.info.get("cmdline") or [])
        ]

    victim = wait_for("a rollout replica process", lambda: replicas() or None)[0]
    victim.kill()
    done = wait_for("Succeeded", lambda: phase_is(e2e, name, "Succeeded"))
    assert done["attempts"] == 1  # no retry: the attempt went on
    steps = metrics_steps(e2e, claim)
    figures["lost_or_repeated_steps"] = lost_or_repeated(steps, REPLICA_STEPS)
    assert steps == list(range(1, REPLICA_STEPS + 1)), steps
    assert done["rolloutReplicasReplaced"] == 1
    rollout = done["progress"]["rollout"]
    assert rollout["replicasReplaced"] == 1 and rollout["replicasServing"] == 2
    assert "died" in rollout["lastReplacement"]
    records = (e2e.root / "volumes" / claim / "outputs" / "metrics.jsonl").read_text().splitlines()
    seconds = [
        json.loads(line)["rollout/replica_replace_seconds"]
        for line in records
        if "rollout/replica_replace_seconds" in line
    ]
    figures["replica_replace_seconds"] = seconds[0] if seconds else None
    assert len(seconds) == 1 and seconds[0] < 60, seconds
    events = e2e.cluster.core.list_namespaced_event(NAMESPACE).items
    replaced = [e for e in events if e.reason == "RolloutReplicaReplaced" and e.involved_object.name == name]
    assert len(replaced) == 1, [(e.reason, e.message) for e in events]
    owned = children(e2e, name)
    assert duplicate_children(owned, attempts=1) == 0, owned
    e2e.cluster.custom.delete_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, name)
    wait_for(
        "every child deleted",
        lambda: children(e2e, name) == [] or None,
        timeout_seconds=60,
        left=lambda: children(e2e, name),
    )
