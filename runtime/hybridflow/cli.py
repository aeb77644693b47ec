"""The ``hybridflow`` command line.

User errors (a bad manifest, a missing file) print one message per problem to stderr and exit
with status 2, without a traceback; a traceback means a bug. A stalled worker call exits with 3
after an ``error: Stalled: ...`` line (the operator reads that reason from the RayJob's
message); a run stopped by SIGTERM (or, in a cluster, by a pod's preStop hook) checkpoints its last
step and exits with 143, in a cluster after a ``stopped on request: ...`` line.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from hybridflow import __version__

if TYPE_CHECKING:
    from hybridflow.spec import RLHFJob, RLHFJobSpec
    from hybridflow.trainer.runner import RunSummary

EXIT_USER_ERROR = 2
EXIT_STALLED = 3
EXIT_PREEMPTED = 128 + signal.SIGTERM
"""What a shell reports for a process ended by SIGTERM: the run stopped early, resumable."""
STALLED_PREFIX = "error: Stalled: "
"""The line a stalled run ends with; ``hybridflow_operator.status`` maps it to the reason Stalled."""


def _stop_on_sigterm(requested: threading.Event | None = None) -> Callable[[], bool]:
    """Turn SIGTERM (a preemption, a drained node, ``ray job stop``) into a stop after the current step.

    The training loop asks the returned function after every step and, once it says yes,
    checkpoints that step and returns; so the grace period a run needs is one step plus one
    checkpoint save. A second SIGTERM changes nothing (the checkpoint is already under way).
    ``requested`` is shared with whatever else may ask for the stop (in a cluster, the preStop
    hooks' requests on the checkpoint volume, ``hybridflow.incluster.stop``).
    """
    requested = requested or threading.Event()

    def handler(signum: int, frame: FrameType | None) -> None:
        if not requested.is_set():
            requested.set()
            # os.write, not print: a handler may interrupt a print to the same stream.
            os.write(2, b"SIGTERM: checkpointing after the current step, then exiting\n")

    signal.signal(signal.SIGTERM, handler)
    return requested.is_set


def _validate(args: argparse.Namespace) -> int:
    """``hybridflow validate``: the spec's rules, then what a cluster and this machine would refuse.

    Exits 2 on a spec error, on a plugin or model that ``run`` would refuse here
    (``hybridflow.preflight``) and, with ``--in-cluster``, on a cluster's admission rules;
    what does not apply where the job will run is printed as a note.
    """
    from hybridflow.spec import SpecError, load_job_manifest

    try:
        job = load_job_manifest(args.manifest)
    except SpecError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_USER_ERROR
    spec = job.spec
    pools = ", ".join(f"{p.name} ({p.nodes}x{p.gpus_per_node} GPU)" for p in spec.resource_pools)
    print(f"{args.manifest}: valid RLHFJob {job.metadata.name!r}")
    print(
        f"  algorithm {spec.algorithm.name}, {spec.training.total_steps} steps, rollout engine {spec.rollout.engine}"
    )
    print(f"  pools: {pools}")
    evaluation = spec.evaluation_settings
    if evaluation is not None:
        when = f"every {evaluation.every_steps} steps and " if evaluation.every_steps else ""
        print(
            f"  evaluation: {', '.join(evaluation.passes)} on spec.data.valFiles, {when}after the last step"
        )
    if spec.placement == "auto":
        print(
            "  placement auto: the pool is the GPU budget; `hybridflow plan` shows the plans `run` chooses from"
        )
    cluster_problems = _in_cluster_problems(args.manifest, spec)
    for problem in cluster_problems:
        # The CRD's admission rules say exactly this when the manifest is applied to a cluster.
        print(f"{'error' if args.in_cluster else 'note'}: in a cluster: {problem}", file=sys.stderr)
    local_errors = _preflight_problems(args.manifest, spec, in_cluster=args.in_cluster)
    return EXIT_USER_ERROR if local_errors or (cluster_problems and args.in_cluster) else 0


def _in_cluster_problems(manifest: str, spec: RLHFJobSpec) -> list[str]:
    """The rules only a cluster has, on the manifest as written (a cluster resolves no path against its directory)."""
    import yaml

    from hybridflow.spec import in_cluster_problems, parse_job_manifest

    as_written = parse_job_manifest(yaml.safe_load(Path(manifest).read_text()), source=manifest)
    problems = in_cluster_problems(as_written.spec)
    if spec.placement == "auto":
        problems += _cluster_gpu_problems(spec)
    return problems


def _preflight_problems(manifest: str, spec: RLHFJobSpec, *, in_cluster: bool) -> list[str]:
    """Prints what ``run`` would refuse on this machine; returns the problems that are errors.

    Missing local files are notes (the model may come later, or live on another machine);
    plugins and models are errors, except with ``--in-cluster``, where the job's image and
    volumes, not this machine, are what count.
    """
    from hybridflow import preflight

    for problem in preflight.file_problems(spec):
        print(f"note: here: {problem} (`hybridflow run` needs it on this machine)", file=sys.stderr)
    errors = preflight.plugin_problems(spec) + preflight.model_problems(spec)
    for problem in errors:
        print(f"{'note: here' if in_cluster else 'error'}: {manifest}: {problem}", file=sys.stderr)
    return [] if in_cluster else errors


def _cluster_gpu_problems(spec: RLHFJobSpec) -> list[str]:
    """What the controller of an auto-placed job would refuse at its start about the pool's GPU.

    Prints the GPU a cluster plans for when the pool declares one; a missing declaration is
    the admission rule ``auto-placement-knows-the-gpu`` (already among the in-cluster problems).
    """
    from hybridflow.planner import PlannerInputError
    from hybridflow.planner.gpus import declared_device

    try:
        declared = declared_device(spec)
    except PlannerInputError as err:
        return [str(err)]
    if declared is not None:
        print(f"  in a cluster it plans for {declared.name}")
    return []


def _make_tiny(args: argparse.Namespace) -> int:
    from hybridflow.models.tiny import write_tiny_model
    from hybridflow.rewards import make_toy_dataset

    model_dir = write_tiny_model(args.model_dir, arch=args.arch, seed=args.seed)
    print(f"tiny {args.arch} model and tokenizer: {model_dir}")
    if args.reward_model_dir:
        reward_dir = write_tiny_model(args.reward_model_dir, arch=args.arch, seed=args.seed + 1, head="score")
        print(f"tiny {args.arch} reward model: {reward_dir}")
    if args.data_dir:
        data_dir = Path(args.data_dir)
        data_dir.mkdir(parents=True, exist_ok=True)
        # The validation prompts (spec.data.valFiles) come from another seed than the training ones.
        for name, count, seed in (
            (f"{args.task}.jsonl", args.prompts, args.seed),
            (f"{args.task}.val.jsonl", args.val_prompts, args.seed + 1),
        ):
            if count:
                target = data_dir / name
                rows = make_toy_dataset(args.task, count, seed=seed)
                staging = target.with_suffix(".jsonl.tmp")
                staging.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
                staging.replace(target)
                print(f"{len(rows)} {args.task} prompts: {target}")
    return 0


def _run(args: argparse.Namespace) -> int:
    """``hybridflow run``: load, place and check the job (before Ray starts), then train on an embedded Ray."""
    if args.in_cluster:
        return _run_in_cluster(args)
    loaded = _load_local_job(args.manifest)
    if loaded is None:
        return EXIT_USER_ERROR
    name, spec = loaded
    from hybridflow.controller import init_local_ray
    from hybridflow.trainer.roles import resource_pools

    print(f"hybridflow run: {name} ({spec.algorithm.name}, {spec.training.total_steps} steps)")
    print(f"  output: {spec.output_dir}  checkpoints: {spec.checkpoint_dir}")
    init_local_ray(resource_pools(spec, simulated=True))
    summary = _train_locally(args, spec)
    if isinstance(summary, int):
        return summary
    if summary.preempted:
        print(f"preempted after step {summary.last_step}; rerun to resume from {spec.checkpoint_dir}")
        return EXIT_PREEMPTED
    if summary.metrics:
        first, last = summary.metrics[0], summary.metrics[-1]
        print(
            f"done: steps {summary.first_step}-{summary.last_step}, reward "
            f"{first.get('reward/mean', 0.0):.3f} -> {last.get('reward/mean', 0.0):.3f}; "
            f"metrics in {Path(spec.output_dir) / 'metrics.jsonl'}"
        )
    else:
        print(
            f"nothing to do: the checkpoint in {spec.checkpoint_dir} is already at step {spec.training.total_steps}"
        )
    return 0


def _load_local_job(manifest: str) -> tuple[str, RLHFJobSpec] | None:
    """The job's name and spec, placed (``placement: auto``) and checked by ``hybridflow.preflight``.

    ``None`` after printing every problem: nothing has started yet.
    """
    from hybridflow import preflight
    from hybridflow.spec import SpecError, load_job_manifest

    try:
        job = load_job_manifest(manifest)
    except SpecError as err:
        print(f"error: {err}", file=sys.stderr)
        return None
    spec = job.spec
    if spec.placement == "auto":
        resolved = _resolve_auto_placement(manifest, spec, in_cluster=False)
        if resolved is None:
            return None
        spec = resolved[0]
    problems = preflight.problems(spec)
    if problems:
        print("\n".join(f"error: {manifest}: {problem}" for problem in problems), file=sys.stderr)
        return None
    return job.metadata.name, spec


def _train_locally(args: argparse.Namespace, spec: RLHFJobSpec) -> RunSummary | int:
    """``run_training`` on the embedded Ray with a progress display; an exit code for a run that failed."""
    from hybridflow.controller import WorkerError, WorkerStalledError
    from hybridflow.data import PromptDataError
    from hybridflow.metrics.progress import ProgressDisplay
    from hybridflow.rewards.scorer import RewardFunctionError
    from hybridflow.trainer.runner import UnsupportedAlgorithmError, run_training

    should_stop = _stop_on_sigterm()  # after Ray's start: ray.init installs a SIGTERM handler of its own
    try:
        # A live bar on a terminal, one plain line per step otherwise (CI, logs).
        with ProgressDisplay(sys.stdout, total_steps=spec.training.total_steps) as display:
            return run_training(
                spec,
                stop_after_steps=args.max_steps,
                on_step=display.line,
                on_report=display.update,
                should_stop=should_stop,
            )
    except WorkerStalledError as err:
        print(f"{STALLED_PREFIX}{err}", file=sys.stderr)
        return EXIT_STALLED
    except (UnsupportedAlgorithmError, PromptDataError, RewardFunctionError, ValueError) as err:
        print(f"error: {args.manifest}: {err}", file=sys.stderr)
        return EXIT_USER_ERROR
    except WorkerError as err:
        if not isinstance(err.__cause__, ValueError):
            raise  # a bug: its traceback, and the worker's in err.remote_traceback, are the message
        # A refusal at load that no preflight could make (a model read only on the workers).
        print(f"error: {args.manifest}: {err.__cause__}", file=sys.stderr)
        return EXIT_USER_ERROR


def _resolve_auto_placement(
    manifest: str, spec: RLHFJobSpec, *, in_cluster: bool
) -> tuple[RLHFJobSpec, dict[str, Any]] | None:
    """``spec.placement: auto``: the spec with the best plan's pools, roles and sizes, or ``None`` on error.

    Also returns the plan as ``status.progress.placement`` (``hybridflow.incluster.placement_status``).

    The GPU planned for is resolved by ``hybridflow.planner.gpus``: in a cluster the budget pool's
    ``gpuType`` or ``nvidia.com/gpu.product`` label (the head pod sees no worker GPU), locally this
    machine's CUDA device or, without one, the simulated GPUs on its cores; an unknown GPU exits
    2 naming what was seen and the ``gpuType`` values. In a cluster the planner keeps everything
    on the budget pool, the one KubeRay worker group the operator made for it (a split placement
    would need a worker group per planned pool).
    """
    from hybridflow.host import available_cores
    from hybridflow.incluster.status import placement_status
    from hybridflow.planner import PlannerInputError
    from hybridflow.planner.gpus import cluster_device, cuda_device, local_device
    from hybridflow.planner.job import resolve_auto_placement
    from hybridflow.planner.report import describe_plan

    try:
        if in_cluster:
            device = cluster_device(spec)
            resolved, plan = resolve_auto_placement(spec, device, kinds=("colocate",))
        else:
            device = local_device(spec, cuda_device(), cores=available_cores())
            resolved, plan = resolve_auto_placement(spec, device)
    except PlannerInputError as err:
        print(f"error: {manifest}: spec.placement auto: {err}", file=sys.stderr)
        return None
    print(f"placement auto: {describe_plan(plan)}; device {device.name}")
    return resolved, placement_status(plan, device.name[:256])


SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


def _run_in_cluster(args: argparse.Namespace) -> int:
    """The RayJob entrypoint: the operator mounts the job's manifest; Ray is the KubeRay cluster.

    Paths in the manifest are paths inside the pods (volumes), so nothing is resolved against
    the manifest's directory. Progress goes to the RLHFJob's status and to /metrics; a rerun
    (the operator's next attempt) resumes from the newest checkpoint on the checkpoint volume.
    A failure exits non-zero so that the RayJob, and then the RLHFJob attempt, fails.
    """
    loaded = _load_cluster_job(args.manifest)
    if loaded is None:
        return EXIT_USER_ERROR
    job, placement = loaded
    namespace = _namespace(job)
    import ray

    from hybridflow.controller import WorkerStalledError
    from hybridflow.incluster import StatusPusher, TrainingMetricsExporter
    from hybridflow.incluster.stop import MetricsServer
    from hybridflow.metrics import progress_line
    from hybridflow.metrics.step_report import StepReport
    from hybridflow.trainer.runner import SandboxUnavailableError, run_training

    exporter = TrainingMetricsExporter(namespace, job.metadata.name)
    stop_requested = threading.Event()
    server = MetricsServer(args.metrics_port, exporter.registry).start()
    stop = _InClusterStop(job.spec, stop_requested)
    pusher = StatusPusher.in_cluster(namespace, job.metadata.name, placement=placement)
    pusher.push_placement()

    def report(step: StepReport) -> None:
        print(progress_line(step), flush=True)  # the pod's log
        exporter(step)
        pusher(step)

    ray.init(address=os.environ.get("RAY_ADDRESS", "auto"))
    should_stop = _stop_on_sigterm(stop_requested)  # after ray.init, which installs its own handler
    stop.start()  # after any previous cluster of the job finished saving: resume after its step
    try:
        summary = run_training(job.spec, simulated=False, on_report=report, should_stop=should_stop)
        if summary.preempted:
            stop.report(summary.last_step)  # before the record says exited: the hooks then let Ray go
    except WorkerStalledError as err:
        print(f"{STALLED_PREFIX}{err}", file=sys.stderr, flush=True)
        return EXIT_STALLED
    except SandboxUnavailableError as err:  # the job's message (KubeRay's) names what is missing
        print(f"error: {args.manifest}: {err}", file=sys.stderr, flush=True)
        return EXIT_USER_ERROR
    finally:
        # "exited" is the last thing the hooks wait for: once it is written they let Ray go, and
        # Ray's drain ends the driver within seconds (RAY_DRAIN_TIMEOUT_SECONDS). Its own teardown
        # (the metrics server, Ray's disconnect, seconds on a busy node) comes first, so the
        # process exits with its code, not Ray's SIGKILL.
        server.close()
        ray.shutdown()
        stop.exited()
    return EXIT_PREEMPTED if summary.preempted else 0


def _load_cluster_job(manifest: str) -> tuple[RLHFJob, dict[str, Any] | None] | None:
    """The mounted manifest's job, placed, with ``status.progress.placement``; ``None`` after printing why not.

    The pod is the job's image, so its plugins must import here; a model is checked where the
    pod sees its ``config.json`` (``hybridflow.preflight``). Missing files are left to the
    workers, which may mount volumes the head pod does not.
    """
    import yaml

    from hybridflow import preflight
    from hybridflow.spec import SpecError, parse_job_manifest

    try:
        document = yaml.safe_load(Path(manifest).read_text(encoding="utf-8"))
        job = parse_job_manifest(document, source=manifest)
    except (OSError, yaml.YAMLError, SpecError) as err:
        print(f"error: {manifest}: {err}", file=sys.stderr)
        return None
    placement: dict[str, Any] | None = None
    if job.spec.placement == "auto":
        resolved = _resolve_auto_placement(manifest, job.spec, in_cluster=True)
        if resolved is None:
            return None
        job = job.model_copy(update={"spec": resolved[0]})
        placement = resolved[1]
    problems = preflight.plugin_problems(job.spec) + preflight.model_problems(job.spec)
    if problems:
        print("\n".join(f"error: {manifest}: {problem}" for problem in problems), file=sys.stderr, flush=True)
        return None
    return job, placement


def _namespace(job: RLHFJob) -> str:
    """The job's namespace: the manifest's, else the pod's (downward API, then its service account)."""
    namespace = job.metadata.namespace or os.environ.get("POD_NAMESPACE")
    if namespace is None and SERVICE_ACCOUNT_NAMESPACE.is_file():
        namespace = SERVICE_ACCOUNT_NAMESPACE.read_text().strip()
    return namespace or "default"


class _InClusterStop:
    """The controller's side of the stop protocol (``hybridflow.incluster.stop``): its record on the
    checkpoint volume, the hooks' requests, and the words the operator reads after a stop."""

    def __init__(self, spec: RLHFJobSpec, requested: threading.Event) -> None:
        from hybridflow.incluster.stop import CLUSTER_ENV, ControllerBeat

        self.spec, self.requested = spec, requested
        self.cluster = os.environ.get(CLUSTER_ENV, "")
        on_volume = spec.checkpoint.volume is not None  # else nothing saved outlives the pods
        self.beat = ControllerBeat(spec.checkpoint_dir, self.cluster, requested) if on_volume else None
        threading.Thread(target=self._when_requested, name="hybridflow-stop", daemon=True).start()

    def start(self) -> None:
        from hybridflow.incluster.stop import prune_other_clusters, wait_for_stopping_controllers

        if self.beat is None:
            return
        wait_for_stopping_controllers(self.spec.checkpoint_dir, self.cluster)
        prune_other_clusters(self.spec.checkpoint_dir, self.cluster)
        self.beat.start()

    def _asker(self) -> str:
        return (self.beat.asked_by if self.beat is not None else None) or "SIGTERM"

    def _when_requested(self) -> None:
        self.requested.wait()
        print(
            f"stop requested by {self._asker()}: checkpointing after the current step, then exiting",
            flush=True,
        )
        if self.beat is not None:
            self.beat.stopping(self.spec.checkpoint.stop_grace_period_seconds)

    def report(self, step: int) -> None:
        from hybridflow.incluster.stop import STOPPED_ON_REQUEST

        print(
            f"{STOPPED_ON_REQUEST}{self._asker()}; the checkpoint holds step {step}, and the next attempt "
            "resumes after it",
            file=sys.stderr,
            flush=True,
        )

    def exited(self) -> None:
        if self.beat is not None:
            self.beat.exited()


def _stop(args: argparse.Namespace) -> int:
    """``hybridflow stop``: a Ray container's preStop hook (``hybridflow.incluster.stop``)."""
    from hybridflow.incluster.stop import stop_pod

    return stop_pod(
        os.environ, timeout_seconds=args.timeout_seconds, say=lambda line: print(line, flush=True)
    )


def _report(args: argparse.Namespace) -> int:
    from hybridflow.metrics.run_report import ReportError, load_records, plot_curves, render_report

    try:
        print(render_report(args.output_dir, checkpoint_dir=args.checkpoint_dir, rows=args.rows))
        records = load_records(args.output_dir)
    except ReportError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_USER_ERROR
    if args.plot != "":
        target = plot_curves(records, args.plot or Path(args.output_dir) / "report.png")
        print(f"plot: {target}")
    return 0


def _plan(args: argparse.Namespace) -> int:
    """``hybridflow plan``: the best placements of the manifest's job on a GPU budget (docs/placement.md).

    The GPU is ``--gpu-type``, else what the pools declare (``gpuType``, the product label), else
    this machine's as a local run sees it (``hybridflow.planner.gpus``); ``--profile`` measures
    this machine's compute and memory constants on top of it.
    """
    from hybridflow.host import available_cores
    from hybridflow.planner import ClusterShape, PlannerInputError, plan_job
    from hybridflow.planner.gpus import GPU_TYPES, cuda_device, declared_device, gpu_constants, local_device
    from hybridflow.planner.job import budget_of, workload_from_spec
    from hybridflow.planner.report import plan_table
    from hybridflow.spec import SpecError, load_job_manifest

    gpu_type = next((known for known in GPU_TYPES if known == args.gpu_type), None)
    if args.gpu_type is not None and gpu_type is None:
        print(f"error: --gpu-type: {args.gpu_type!r} is not one of {', '.join(GPU_TYPES)}", file=sys.stderr)
        return EXIT_USER_ERROR
    try:
        job = load_job_manifest(args.manifest)
        workload = workload_from_spec(job.spec)
        if args.gpus is None:
            _, cluster = budget_of(job.spec)
        else:
            cluster = ClusterShape(args.gpus, args.gpus_per_node or min(args.gpus, 8))
        if gpu_type is not None:
            device = gpu_constants(gpu_type, "--gpu-type")
        else:
            declared = declared_device(job.spec)
            device = declared or local_device(job.spec, cuda_device(), cores=available_cores())
    except (SpecError, PlannerInputError) as err:
        print(f"error: {args.manifest}: {err}", file=sys.stderr)
        return EXIT_USER_ERROR
    if args.profile:
        from hybridflow.planner.calibrate import calibrate_device

        device = calibrate_device(workload, device)
    try:
        plans = plan_job(workload, cluster, device)
    except PlannerInputError as err:
        print(f"error: {args.manifest}: {err}", file=sys.stderr)
        return EXIT_USER_ERROR
    print(f"hybridflow plan: {job.metadata.name} ({job.spec.algorithm.name})")
    print(plan_table(plans, workload, cluster, device, top=args.top))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hybridflow", description="HybridFlow RLHF on Ray.")
    parser.add_argument("--version", action="version", version=f"hybridflow {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    for add_command in (
        _add_validate_command,
        _add_run_command,
        _add_report_command,
        _add_plan_command,
        _add_stop_command,
        _add_make_tiny_command,
    ):
        add_command(commands)
    return parser


def _add_validate_command(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``hybridflow validate``: :func:`_validate`."""
    validate = commands.add_parser("validate", help="check an RLHFJob manifest and summarise it")
    validate.add_argument("manifest", help="path to an RLHFJob YAML manifest")
    validate.add_argument(
        "--in-cluster",
        action="store_true",
        help="also fail on what a cluster's admission rejects (checkpoint volume, absolute paths)",
    )
    validate.set_defaults(handler=_validate)


def _add_run_command(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``hybridflow run``: :func:`_run`, here or as a RayJob's entrypoint."""
    run = commands.add_parser("run", help="train an RLHFJob on an embedded Ray on this machine")
    run.add_argument("manifest", help="path to an RLHFJob YAML manifest")
    run.add_argument("--max-steps", type=int, default=None, help="stop after this many steps (resume later)")
    run.add_argument(
        "--in-cluster",
        action="store_true",
        help="run as a KubeRay RayJob entrypoint: join the Ray cluster, push status, serve /metrics",
    )
    run.add_argument(
        "--metrics-port",
        type=int,
        default=int(os.environ.get("HYBRIDFLOW_METRICS_PORT", "8081")),
        help="port of /metrics with --in-cluster (8080 is KubeRay's metrics agent on every Ray node)",
    )
    run.set_defaults(handler=_run)


def _add_report_command(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``hybridflow report``: :func:`_report`."""
    summary = commands.add_parser("report", help="summarise a run from its metrics and checkpoints")
    summary.add_argument("output_dir", help="the job's spec.outputDir (holds metrics.jsonl)")
    summary.add_argument(
        "--checkpoint-dir", default=None, help="checkpoint directory (default: OUTPUT_DIR/checkpoints)"
    )
    summary.add_argument(
        "--plot",
        default=None,
        help="PNG of the reward and KL curves (default OUTPUT_DIR/report.png; '' for none)",
    )
    summary.add_argument("--rows", type=int, default=10, help="rows of the learning-curve table")
    summary.set_defaults(handler=_report)


def _add_plan_command(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``hybridflow plan``: :func:`_plan`."""
    plan = commands.add_parser("plan", help="estimate and rank placements of a job on a GPU budget")
    plan.add_argument(
        "manifest", help="path to an RLHFJob YAML manifest (models are read from config.json only)"
    )
    plan.add_argument(
        "--gpus", type=int, default=None, help="GPU budget; default: the manifest's single pool"
    )
    plan.add_argument("--gpus-per-node", type=int, default=None, help="GPUs per node (default: min(gpus, 8))")
    plan.add_argument("--top", type=int, default=5, help="how many of the best plans to print")
    plan.add_argument(
        "--gpu-type",
        default=None,
        help=(
            "the GPU to plan for, a value of spec.resourcePools[].gpuType (docs/placement.md); default: the "
            "pools' gpuType or nvidia.com/gpu.product label, else this machine's"
        ),
    )
    plan.add_argument(
        "--profile",
        action="store_true",
        help="measure the device constants with a short run of the actor's architecture on this machine",
    )
    plan.set_defaults(handler=_plan)


def _add_stop_command(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``hybridflow stop``: :func:`_stop`, a Ray pod's preStop hook."""
    stop = commands.add_parser(
        "stop",
        help=(
            "a Ray pod's preStop hook: ask the controller to checkpoint and exit, and wait until it has "
            "(through $HYBRIDFLOW_CHECKPOINT_DIR, the checkpoint volume)"
        ),
    )
    stop.add_argument(
        "--timeout-seconds",
        type=float,
        default=600.0,
        help="give up after this long (before the kubelet's SIGKILL)",
    )
    stop.set_defaults(handler=_stop)


def _add_make_tiny_command(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``hybridflow make-tiny``: :func:`_make_tiny`."""
    tiny = commands.add_parser("make-tiny", help="write a tiny random model, tokenizer and toy prompts")
    tiny.add_argument("--model-dir", default="outputs/tiny-model")
    tiny.add_argument("--data-dir", default="outputs/tiny-data")
    tiny.add_argument("--reward-model-dir", default=None, help="also write a tiny reward model (scalar head)")
    tiny.add_argument("--arch", choices=["qwen2", "llama"], default="qwen2")
    tiny.add_argument("--task", default="target_char")
    tiny.add_argument("--prompts", type=int, default=256)
    tiny.add_argument(
        "--val-prompts", type=int, default=32, help="validation prompts, <task>.val.jsonl (0: none)"
    )
    tiny.add_argument("--seed", type=int, default=0)
    tiny.set_defaults(handler=_make_tiny)


def main(argv: Sequence[str] | None = None) -> int:
    # Per-file progress bars of model loading, from every worker through Ray's log forwarding,
    # drown the step lines; the workers inherit this environment.
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    args = build_parser().parse_args(argv)
    return int(args.handler(args))


if __name__ == "__main__":
    raise SystemExit(main())
