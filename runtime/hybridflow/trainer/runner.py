"""The step loop of a job: what ``hybridflow run`` executes in the single controller.

Order of events: load the tokenizer and prompt data (fail fast on bad data before any worker
starts), start the reward scorer's process pool and deploy the roles (the two start together),
resume from the newest complete checkpoint if there is one, then for each step: next prompts
-> the algorithm's ``train_step`` -> the step's accounting from the workers' busy reports
(:mod:`~hybridflow.trainer.step_accounting`: idle pools, the controller's overhead, compile
time) -> an evaluation on ``spec.data.valFiles`` when due (``trainer/evaluation.py``: every
``evaluation.everySteps`` and at the last step; its ``val/...`` figures join the step's record)
-> a checkpoint every ``checkpoint.intervalSteps`` and at the last step -> metrics (JSONL,
TensorBoard, the progress line). A step's seconds run from the end of the previous step's
checkpoint to the end of its accounting: the metrics writes between steps are in them, the
evaluation (``val/seconds``) and the checkpoint (``timing/checkpoint``) are not.

Resuming restores the actor/critic shards, the data position and the KL controller; rollout
sampling is seeded by the step number, so a resumed run continues exactly where an
uninterrupted one would be.

A job whose rollout has a pool of its own runs its steps through a
:class:`~hybridflow.trainer.overlap.RolloutPipeline`: generations up to
``spec.rollout.maxStaleness`` steps ahead, the weights pushed to the rollout pool after each
update, and the generations in flight saved with each checkpoint (``overlap.py`` has the
protocol). In server mode (``spec.rollout.mode: server``) a
:class:`~hybridflow.rollout.service.RolloutService` takes its place: engine replicas on the
rollout pool, fed continuously, each step's groups taken from its replay buffer, the buffer
saved with each checkpoint (``rollout/service.py`` has the protocol).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoTokenizer

from hybridflow.agents.loop import load_agent_loop
from hybridflow.agents.sandbox import probe, run_python
from hybridflow.agents.sandbox_pool import SandboxPool
from hybridflow.agents.tools import SandboxRunner
from hybridflow.algorithms import grpo, ppo, reinforce_pp, remax, rloo, safe_rlhf
from hybridflow.algorithms.api import (
    JobWorkers,
    StepFunction,
    load_step_function,
    needs_weight_sync,
    reference_from_actor,
)
from hybridflow.algorithms.state import AlgorithmState
from hybridflow.algorithms.timing import recording_controller_work, unmeasured_seconds
from hybridflow.checkpoint import CheckpointManager
from hybridflow.checkpoint.exports import (
    STATUS_ARTIFACTS,
    Artifact,
    export_directory,
    read_artifacts,
    record_artifact,
)
from hybridflow.controller import Batch, Deployment, deploy
from hybridflow.controller.resource_pool import ResourcePool, place_pool
from hybridflow.data import PromptDataset, PromptSampler
from hybridflow.export.parity import build_probe_token_ids, probe_token_limit
from hybridflow.metrics import MetricsWriter, progress_line, weight_sync_line
from hybridflow.metrics.flops import model_parameter_count, throughput_metrics
from hybridflow.metrics.step_report import StepReport
from hybridflow.rewards.scorer import RewardScorer
from hybridflow.rollout.endpoint import EndpointDriver, load_session_runner
from hybridflow.rollout.service import RolloutService, ServedRollout
from hybridflow.rollout.trajectories import TrajectoryDriver, TrajectorySource
from hybridflow.spec import RLHFJobSpec
from hybridflow.trainer.evaluation import ValidationSet, evaluate, evaluation_due
from hybridflow.trainer.overlap import IN_FLIGHT_FILE, RolloutPipeline, load_in_flight, save_in_flight
from hybridflow.trainer.roles import job_bridges, job_roles, resource_pools
from hybridflow.trainer.step_accounting import controller_overhead, move_compile_time, pool_idle_fractions
from hybridflow.workers.rollout import response_texts

__all__ = [
    "ALGORITHM_STEPS",
    "SERVICE_FILE",
    "RunSummary",
    "StepReport",
    "UnsupportedAlgorithmError",
    "reshard_metrics",
    "run_training",
]

ALGORITHM_STEPS: dict[str, StepFunction] = {
    "grpo": grpo.train_step,
    "ppo": ppo.train_step,
    "rloo": rloo.train_step,
    "reinforce++": reinforce_pp.train_step,
    "remax": remax.train_step,
    "safe-rlhf": safe_rlhf.train_step,
}


SERVICE_FILE = "rollout_service.pt"
"""A server-mode checkpoint's replay buffer and counters (``RolloutService.checkpoint_state``)."""


class UnsupportedAlgorithmError(ValueError):
    """The manifest names an algorithm this runtime cannot run, or a plugin that does not load."""


def step_function(name: str) -> StepFunction:
    """A built-in's step, or the plugin ``"package.module:train_step"`` names (imported here)."""
    if name in ALGORITHM_STEPS:
        return ALGORITHM_STEPS[name]
    try:
        return load_step_function(name)
    except ValueError as error:
        raise UnsupportedAlgorithmError(f"{error}; built-ins: {sorted(ALGORITHM_STEPS)}") from error


@dataclass(frozen=True)
class RunSummary:
    first_step: int
    last_step: int
    resumed_from: str | None
    metrics: list[dict[str, float]]
    preempted: bool = False
    """The run stopped early because ``should_stop`` said so, after checkpointing its last step."""


def run_training(
    spec: RLHFJobSpec,
    *,
    simulated: bool = True,
    on_step: Callable[[str], None] = print,
    on_report: Callable[[StepReport], None] | None = None,
    stop_after_steps: int | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> RunSummary:
    """Train ``spec`` on the current Ray cluster.

    ``on_step`` receives human-readable lines, ``on_report`` a :class:`StepReport` after every
    step (after the step's checkpoint, if any); without ``on_report`` each step's progress line
    goes to ``on_step``. ``stop_after_steps`` ends early (resume tests).
    ``should_stop`` is asked after every step (preemption: a SIGTERM handler sets it); when it
    says yes, the step just finished is checkpointed (unless it already was) and the run returns
    with ``preempted`` set, so the next run resumes at the following step.
    """
    # Layouts the backends cannot run never get here: the spec's rules refuse them (validate,
    # admission, and the planner's output under placement auto, which is validated again).
    step_fn = step_function(spec.algorithm.name)
    tokenizer = AutoTokenizer.from_pretrained(spec.models.actor.tokenizer_path or spec.models.actor.path)
    dataset = PromptDataset.from_spec(spec.data, tokenizer)
    sampler = PromptSampler(dataset, seed=spec.data.seed, shuffle=spec.data.shuffle)
    on_step(
        f"data: {len(dataset)} prompts, {dataset.filtered_too_long} filtered out for exceeding "
        f"spec.data.maxPromptTokens={spec.data.max_prompt_tokens}"
    )
    validation = ValidationSet.load(spec, tokenizer)  # spec.data.valFiles: trainer/evaluation.py
    if validation is not None:
        on_step(
            f"validation: {len(validation.dataset)} prompts, passes {', '.join(validation.settings.passes)}"
        )
    checkpoints = CheckpointManager(Path(spec.checkpoint_dir), keep_last=spec.checkpoint.keep_last)
    writer = MetricsWriter(spec.output_dir)
    state = AlgorithmState(spec)
    pools = resource_pools(spec, simulated=simulated)
    history: list[dict[str, float]] = []
    job_gpus = sum(pool.nodes * pool.gpus_per_node for pool in spec.resource_pools)
    actor_parameters = model_parameter_count(spec.models.actor.path)
    # spec.checkpoint.export: the artifacts of earlier attempts, and the parity gate's fixed probes.
    artifacts = read_artifacts(spec.checkpoint_dir) if spec.checkpoint.export is not None else []
    probes = (
        build_probe_token_ids(
            tokenizer, max_tokens=probe_token_limit(AutoConfig.from_pretrained(spec.models.actor.path))
        )
        if spec.checkpoint.export is not None
        else []
    )
    # The scorer's process pool starts while the workers deploy, not in the first step.
    with (
        RewardScorer(spec, None) as scorer,
        deploy(
            pools,
            job_roles(spec),
            placement_timeout_seconds=60 if simulated else 900,
            stall_timeout_seconds=spec.stall_timeout_seconds,
            bridges=job_bridges(spec),
        ) as deployment,
        rollout_service(spec, deployment, pools, tokenizer, sampler, scorer, on_step, simulated) as service,
    ):
        served = ServedRollout(service) if service is not None else None
        workers = JobWorkers.of(deployment, rollout=served, reference_from_actor=reference_from_actor(spec))
        total = spec.training.total_steps
        pipeline = (
            RolloutPipeline(workers, max_staleness=spec.rollout.max_staleness, total_steps=total)
            if spec.rollout_has_own_pool and service is None
            else None
        )
        # Prompts drawn for later steps and saved with the checkpoint (an overlapped run's), by step.
        saved_prompts: dict[int, Batch] = {}

        def prompts_for(step: int) -> Batch:
            if step in saved_prompts:
                return saved_prompts.pop(step)
            prompts = sampler.next_batch(spec.training.prompts_per_step)
            return Batch.from_dict(
                prompts.to_batch_fields(),
                meta={
                    "samples": spec.algorithm.samples_per_prompt,
                    "seed": spec.training.seed * 100_003 + step,
                },
            )

        scorer.use_reward_model(workers.reward)
        start, resumed, last_checkpoint = 1, None, None
        found = checkpoints.latest()
        if found is not None:
            directory, saved = found
            workers.actor.load_checkpoint(str(directory / "actor"))
            if workers.critic is not None:
                workers.critic.load_checkpoint(str(directory / "critic"))
            if workers.cost_critic is not None:
                workers.cost_critic.load_checkpoint(str(directory / "cost_critic"))
            sampler.load_state_dict(saved["sampler"])
            state.load_state_dict(saved["algorithm"])
            start, resumed, last_checkpoint = int(saved["step"]) + 1, directory.name, int(saved["step"])
            writer.truncate_after(int(saved["step"]))
            in_flight = load_in_flight(directory / IN_FLIGHT_FILE)
            if service is not None and (directory / SERVICE_FILE).exists():
                service.restore(torch.load(directory / SERVICE_FILE, weights_only=False))  # our own file
            if pipeline is not None:
                pipeline.restore(in_flight)
            else:  # saved by an overlapped run: its prompts are drawn already; generate them now
                saved_prompts.update({step: prompts for step, (prompts, _) in in_flight.items()})
            on_step(f"resumed from {directory} (step {saved['step']})")
        if pipeline is not None:
            # The rollout starts from the actor's weights (the checkpoint's when resuming).
            pipeline.push(version=start - 1)
        if service is not None:
            service.start(version=start - 1)
        # Colocated rollouts load the actor's weights before they generate; the others have them.
        evaluation_syncs = needs_weight_sync(spec) and pipeline is None and service is None
        initial_evaluation: dict[str, float] = {}  # reaches the sinks with the first step's report
        if validation is not None and validation.settings.at_start and start == 1:
            initial_evaluation = evaluate(
                validation, workers.rollout, scorer, spec, step=0, sync=evaluation_syncs
            )
            writer.write(0, initial_evaluation)
        last = total if stop_after_steps is None else min(total, start - 1 + stop_after_steps)
        deployment.busy_reports()  # the first step's idle fractions start here
        began = bookkeeping_started = time.monotonic()
        for step in range(start, last + 1):
            # A step's seconds start where the previous step's checkpoint ended: the metrics
            # writes and the report between steps are the controller's, and count.
            step_started = bookkeeping_started
            with recording_controller_work() as controller_work:
                if service is not None and served is not None:
                    waited_from = time.time()
                    prompts, responses = service.next_batch(trainer_version=step - 1)
                    waited = time.time() - waited_from
                    # The replicas' work, not the controller's: no overhead while it waits.
                    controller_work.append((waited_from, waited_from + waited))
                    served.serve(prompts, responses)
                    metrics = step_fn(workers, prompts, scorer, state)
                    metrics["timing/generate"] = metrics.get("timing/generate", 0.0) + waited
                    metrics.update(service.step_metrics())
                    metrics["timing/weight_sync"] = metrics.get("timing/weight_sync", 0.0) + service.push(
                        version=step
                    )
                elif pipeline is None:
                    metrics = step_fn(workers, prompts_for(step), scorer, state)
                else:
                    pipeline.fill(step, prompts_for)
                    metrics = step_fn(pipeline.workers, pipeline.serve(step), scorer, state)
                    metrics.update(pipeline.view.staleness_metrics())
                    # The push after the update: part of the step, and of its weight sync phase.
                    metrics["timing/weight_sync"] = metrics.get("timing/weight_sync", 0.0) + pipeline.push(
                        version=step
                    )
            # Asked together with the busy reports: one round trip on the step's path, not two.
            transition = (
                deployment.groups["rollout"].submit("transition_stats")
                if "rollout" in deployment.groups
                else None
            )
            busy = deployment.busy_reports()
            metrics.update(pool_idle_fractions(busy))
            metrics.update(controller_overhead(busy, controller_work))
            move_compile_time(metrics, busy)
            if transition is not None:
                metrics.update(reshard_metrics(transition.result()))
            seconds = time.monotonic() - step_started
            metrics["perf/step_seconds"] = seconds
            # The step's time outside the phases step_fn timed (hybridflow.algorithms.timing).
            metrics["timing/other"] = unmeasured_seconds(metrics, seconds)
            metrics["perf/tokens_per_second"] = metrics.get("tokens/step", 0.0) / max(seconds, 1e-9)
            metrics.update(throughput_metrics(metrics, gpus=job_gpus, actor_parameters=actor_parameters))
            bookkeeping_started = time.monotonic()
            if validation is not None and evaluation_due(step, total, validation.settings.every_steps):
                # After the step proper, like the checkpoint: val/seconds, not perf/step_seconds.
                metrics.update(
                    evaluate(validation, workers.rollout, scorer, spec, step=step, sync=evaluation_syncs)
                )
                deployment.busy_reports()
                bookkeeping_started = time.monotonic()
            if step % spec.checkpoint.interval_steps == 0 or step == total:
                _save(checkpoints, workers, step, sampler, state, pipeline, service)
                last_checkpoint = step
                # After the step proper: not part of perf/step_seconds or tokens/s.
                metrics["timing/checkpoint"] = time.monotonic() - bookkeeping_started
                deployment.busy_reports()  # the next step's busy window starts with its seconds
                bookkeeping_started = time.monotonic()
            export = spec.checkpoint.export
            if export is not None and (
                step == total or (export.interval_steps and step % export.interval_steps == 0)
            ):
                artifacts = _export(spec, workers, step, probes, metrics, on_step) or artifacts
                bookkeeping_started = time.monotonic()
            preempted = should_stop is not None and should_stop()
            if preempted and last_checkpoint != step:
                _save(checkpoints, workers, step, sampler, state, pipeline, service)
                last_checkpoint = step
            history.append({"step": float(step), **metrics})
            writer.write(step, metrics)
            # Outside the step's seconds, before its progress line (docs/weight-sync.md, "In the log").
            if (checked := weight_sync_line(step, metrics, spec.rollout.weight_sync_check)) is not None:
                on_step(checked)
            done = step - start + 1
            eta = (time.monotonic() - began) / done * (total - step)
            report = StepReport(
                step,
                total,
                {**initial_evaluation, **metrics} if step == start else metrics,
                eta,
                last_checkpoint,
                service.health() if service is not None else None,
                artifacts=tuple(artifact.status() for artifact in artifacts[-STATUS_ARTIFACTS:]),
            )
            if on_report is not None:
                on_report(report)
            else:
                on_step(progress_line(report))
            if preempted:
                on_step(f"preempted: stopped after step {step}, checkpoint {checkpoints.name(step)} written")
                writer.close()
                return RunSummary(start, step, resumed, history, preempted=True)
    writer.close()
    return RunSummary(start, last, resumed, history)


def _export(
    spec: RLHFJobSpec,
    workers: JobWorkers,
    step: int,
    probes: list[list[int]],
    metrics: dict[str, float],
    on_step: Callable[[str], None],
) -> list[Artifact] | None:
    """Export the actor after ``step`` (``spec.checkpoint.export``); the artifacts list when it passed the gate.

    The export's seconds and gate figures go into the step's metrics (after the step proper, like the
    checkpoint's); a refused export is reported in the log and returns ``None``: training goes on.
    """
    started = time.monotonic()
    directory = export_directory(spec.checkpoint_dir, step)
    outcome = workers.actor.export_hf(str(directory), step, probes)[0]
    report = outcome.report
    metrics["export/seconds"] = time.monotonic() - started
    metrics["export/parity_max_abs_diff"] = report.max_abs_diff
    metrics["export/passed"] = 1.0 if outcome.artifact is not None else 0.0
    if outcome.artifact is None:
        on_step(
            f"export of step {step} refused by the parity gate: log-probs off by {report.max_abs_diff:.4g} "
            f"(tolerance {report.tolerance:g}) at probe {report.worst_probe} token {report.worst_position}; "
            f"kept aside at {outcome.directory}"
        )
        return None
    on_step(f"exported step {step} to {outcome.directory} (parity: max gap {report.max_abs_diff:.3g})")
    return record_artifact(spec.checkpoint_dir, outcome.artifact)


def reshard_metrics(per_rank: list[dict[str, float]]) -> dict[str, float]:
    """Step metrics from the rollout ranks' ``transition_stats``: per rank, and the worst rank.

    ``reshard/seconds`` is train -> generate (packing included) plus generate -> train on the
    slowest rank (the step waits for it); the ``*_per_rank`` figures are the largest of any
    rank; ``reshard/rank<r>/<figure>`` are each rank's own (seconds, bytes sent and received,
    peak memory, redundant bytes), as measured by the rollout (``workers/hybrid_rollout.py``);
    ``weight_sync/*`` are the sync check's figures (``spec.rollout.weightSyncCheck``).
    """
    ranks = [(rank, stats) for rank, stats in enumerate(per_rank) if stats]
    if not ranks:
        return {}
    metrics: dict[str, float] = {}
    for rank, s in ranks:
        metrics[f"reshard/rank{rank}/seconds"] = s.get("to_generation_seconds", 0.0) + s.get(
            "to_training_seconds", 0.0
        )
        for figure in ("bytes_sent", "bytes_received", "peak_memory_bytes", "redundant_bytes"):
            if figure in s:
                metrics[f"reshard/rank{rank}/{figure}"] = s[figure]
    metrics["reshard/seconds"] = max(metrics[f"reshard/rank{rank}/seconds"] for rank, _ in ranks)
    offloads = [s for _, s in ranks if "offloaded_bytes" in s]
    if offloads:  # spec.training.offloadDuringGeneration: the slowest rank's two copies
        metrics["offload/seconds"] = max(s["offload_seconds"] + s["reload_seconds"] for s in offloads)
        metrics["offload/bytes_per_rank"] = max(s["offloaded_bytes"] for s in offloads)
    for figure in ("bytes_sent", "bytes_received", "peak_memory_bytes", "redundant_bytes"):
        values = [s[figure] for _, s in ranks if figure in s]
        if values:
            metrics[f"reshard/{figure}_per_rank"] = max(values)
    checks = [s for _, s in ranks if "sync_check_seconds" in s]
    if checks:  # spec.rollout.weightSyncCheck (hybridflow.resharding.fingerprint)
        metrics["weight_sync/check_seconds"] = max(s["sync_check_seconds"] for s in checks)
        metrics["weight_sync/checked_tensors"] = min(s["sync_checked_tensors"] for s in checks)
        metrics["weight_sync/unverified_tensors"] = max(s["sync_unverified_tensors"] for s in checks)
    return metrics


def _save(
    checkpoints: CheckpointManager,
    workers: JobWorkers,
    step: int,
    sampler: PromptSampler,
    state: AlgorithmState,
    pipeline: RolloutPipeline | None,
    service: RolloutService | None,
) -> None:
    staging = checkpoints.begin(step)
    if pipeline is not None:
        save_in_flight(staging / IN_FLIGHT_FILE, pipeline.in_flight())
    if service is not None:
        torch.save(service.checkpoint_state(trainer_version=step), staging / SERVICE_FILE)
    workers.actor.save_checkpoint(str(staging / "actor"))
    if workers.critic is not None:
        workers.critic.save_checkpoint(str(staging / "critic"))
    if workers.cost_critic is not None:
        workers.cost_critic.save_checkpoint(str(staging / "cost_critic"))
    controller: dict[str, Any] = {"sampler": dict(sampler.state_dict()), "algorithm": state.state_dict()}
    checkpoints.publish(staging, step, controller)


def _trajectory_source(
    spec: RLHFJobSpec, tokenizer: Any, simulated: bool, sandbox: SandboxRunner
) -> TrajectorySource | None:
    """How multi-turn trajectories come about (``spec.agent``): the agent loop's driver, the chat endpoint, or none."""
    if spec.agent.loop == "endpoint":
        return EndpointDriver(
            spec.agent,
            load_session_runner(str(spec.agent.runner)),
            tokenizer=tokenizer,
            budget=spec.rollout.max_response_tokens,
            max_prompt_tokens=spec.data.max_prompt_tokens,
            temperature=spec.rollout.temperature,
            # In the cluster agents in the job's other pods reach it through the Service <job>-agent.
            host="127.0.0.1" if simulated else "0.0.0.0",
            port=0 if simulated else spec.agent.endpoint_port,
        )
    loop = load_agent_loop(spec.agent, sandbox)
    if loop is None:
        return None
    return TrajectoryDriver(
        spec.agent,
        loop,
        encode=lambda text: list(tokenizer.encode(text, add_special_tokens=False)),
        encode_plain=lambda text: list(
            tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)
        ),
        decode=lambda ids: response_texts(tokenizer, [ids])[0],  # the reward functions' reading
        budget=spec.rollout.max_response_tokens,
    )


class SandboxUnavailableError(ValueError):
    """The machine that runs the python tool's calls cannot confine them as spec.agent.sandbox asks."""


def _checked_sandbox(spec: RLHFJobSpec, sandboxes: SandboxPool | None) -> str:
    """What confines the python tool's calls (for the log), once, before the first step; raises
    :class:`SandboxUnavailableError` naming what is missing where it cannot be given."""
    mode = spec.agent.sandbox.isolation
    probes = sandboxes.probe(mode) if sandboxes is not None else [probe(mode)]
    where = f"{len(probes)} sandbox worker(s)" if sandboxes is not None else "the controller"
    refusals = [why for _, why in probes if why]
    if refusals:
        raise SandboxUnavailableError(
            f"spec.agent.sandbox.isolation: {mode}: {where} cannot run code: {refusals[0]}"
        )
    return f"sandbox: {where}; confinement: {probes[0][0]}"


@contextmanager
def rollout_service(
    spec: RLHFJobSpec,
    deployment: Deployment,
    pools: list[ResourcePool],
    tokenizer: Any,
    sampler: PromptSampler,
    scorer: RewardScorer,
    log: Callable[[str], None],
    simulated: bool,
) -> Iterator[RolloutService | None]:
    """Server mode's service over the rollout pool (reserved here: no deployed role uses it); else None."""
    if spec.rollout.mode != "server":
        yield None
        return
    pool = next(p for p in pools if p.name == spec.pool("rollout").name)
    placement = place_pool(pool, timeout_seconds=60 if simulated else 900)
    pad = tokenizer.pad_token_id
    samples = spec.algorithm.samples_per_prompt

    def prompts_for(count: int) -> Batch:
        return Batch.from_dict(sampler.next_batch(count).to_batch_fields(), meta={"samples": samples})

    sandboxes = (
        SandboxPool(spec.agent.sandbox_workers, in_cluster=not simulated)
        if spec.agent.sandbox_workers
        else None
    )
    if spec.agent.runs_code:
        log(_checked_sandbox(spec, sandboxes))
    trajectories = _trajectory_source(spec, tokenizer, simulated, sandboxes.run if sandboxes else run_python)
    service = RolloutService(
        spec,
        placement=placement,
        actor=deployment["actor"],
        actor_host=deployment.host(spec.pool("actor").name, 0),
        tokenizer=tokenizer,
        pad_id=int(pad if pad is not None else tokenizer.eos_token_id),
        prompts_for=prompts_for,
        score=lambda batch: scorer.scores(batch)[0],
        torch_threads=pool.threads_per_worker,
        log=log,
        trajectories=trajectories,
    )
    try:
        yield service
    finally:
        service.shutdown()
        if trajectories is not None:
            trajectories.close()
        if sandboxes is not None:
            sandboxes.shutdown()
        placement.release()
