"""The ``RLHFJob`` resource: its spec (the root of the config tree) and the rules across sections.

``RLHFJobSpec`` is the single source of truth the DESIGN asks for: the operator generates the
CRD's ``openAPIV3Schema`` from it (field descriptions become ``kubectl explain`` text,
``SPEC_RULES`` and the section rules become ``x-kubernetes-validations``), the operator ships
it to the controller in a ConfigMap, and ``hybridflow run`` loads the very same manifest on a
laptop. Rules that span sections live here; rules within a section live with that section.
"""

from __future__ import annotations

import posixpath
from collections import Counter
from typing import Any, Literal, Self, get_args

from pydantic import ConfigDict, Field, model_validator

from hybridflow.spec.agent import AGENT_RULES, SANDBOX_GROUP, SANDBOXED_TOOLS, AgentSpec
from hybridflow.spec.algorithm import (
    ALGORITHM_RULES,
    CRITIC_ALGORITHMS,
    KL_RULES,
    AlgorithmSpec,
)
from hybridflow.spec.base import SpecModel
from hybridflow.spec.data import DataSpec
from hybridflow.spec.evaluation import EVALUATION_RULES, EvaluationSpec
from hybridflow.spec.models import ModelsSpec
from hybridflow.spec.pods import PodsSpec
from hybridflow.spec.resources import (
    DEFAULT_POOL_NAME,
    GPU_PRODUCT_LABEL,
    PLACEMENT_DESCRIPTION,
    GpuType,
    PlacementMode,
    ResourcePoolSpec,
    RoleName,
    RolePlacementSpec,
)
from hybridflow.spec.rewards import RewardFunctionSpec
from hybridflow.spec.rollout import ROLLOUT_RULES, RolloutSpec
from hybridflow.spec.rules import CrossFieldRule, RuleViolations, broken_rules, quoted_list
from hybridflow.spec.security import DEFAULT_ALLOWED_CAPABILITIES
from hybridflow.spec.storage import DNS_SUBDOMAIN_PATTERN, CheckpointSpec, VolumeClaimMount
from hybridflow.spec.training import TRAINING_RULES, TrainingSpec

GROUP = "hybridflow.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "RLHFJob"
PLURAL = "rlhfjobs"

LABEL_VALUE_PATTERN = r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
"""A non-empty Kubernetes label value: the Kueue queue name travels as one."""


class RLHFJobSpec(SpecModel):
    """Desired state of an RLHF training run: models, data, algorithm, resources and lifecycle."""

    models: ModelsSpec = Field(description="Where each model's weights are.")
    data: DataSpec = Field(description="The prompt dataset.")
    algorithm: AlgorithmSpec = Field(description="The RL algorithm and its loss coefficients.")
    rollout: RolloutSpec = Field(
        default=RolloutSpec(),
        description="Response generation: engine, sampling, generation-time parallelism.",
    )
    training: TrainingSpec = Field(
        description="Steps, batch sizes, optimizer and training-time parallelism.",
    )
    agent: AgentSpec = Field(
        default=AgentSpec(),
        description="The agent loop of each trajectory: one turn (the default), tool calling, or a plugin.",
    )
    evaluation: EvaluationSpec | None = Field(
        default=None,
        description=(
            "When and how the policy is scored on spec.data.valFiles (greedy and sampled passes, every N "
            "steps and after the last). Needs valFiles; unset with valFiles: the defaults (after the last "
            "step only)."
        ),
    )
    rewards: tuple[RewardFunctionSpec, ...] = Field(
        default=(),
        max_length=16,
        description=(
            "Rule-based reward functions; the reward of a response is their weighted sum plus the "
            "score of spec.models.reward when set. At least one of the two is required."
        ),
    )
    resource_pools: tuple[ResourcePoolSpec, ...] = Field(
        default=(ResourcePoolSpec(name=DEFAULT_POOL_NAME),),
        min_length=1,
        max_length=16,
        description=(
            "GPU node pools of the job; each becomes one Ray worker group. Default: one pool "
            "'default' of 1 node with 1 GPU."
        ),
    )
    roles: RolePlacementSpec = Field(
        default=RolePlacementSpec(),
        description="Which pool each role runs on; roles left unset share the actor's pool.",
    )
    placement: PlacementMode = Field(default="manual", description=PLACEMENT_DESCRIPTION)
    checkpoint: CheckpointSpec = Field(
        default=CheckpointSpec(),
        description="Checkpoint interval, retention and location; the job resumes from the newest one.",
    )
    volumes: tuple[VolumeClaimMount, ...] = Field(
        default=(),
        max_length=16,
        description=(
            "PersistentVolumeClaims mounted read-only in every pod, typically holding models, "
            "tokenizers and data; spec paths then point inside their mountPaths. Cluster only."
        ),
    )
    output_dir: str = Field(
        default="outputs",
        min_length=1,
        max_length=4096,
        description=(
            "Directory for logs, metrics and, without a checkpoint volume, checkpoints. Relative paths "
            "resolve against the manifest's directory with `hybridflow run`."
        ),
    )
    image: str | None = Field(
        default=None,
        min_length=1,
        max_length=1024,
        description="Container image of the head and worker pods. Default: the operator's runtime image.",
    )
    suspend: bool = Field(
        default=False,
        description=(
            "While true, the job's pods are deleted and nothing runs; setting it back to false resumes "
            "from the newest checkpoint. Kueue sets it to admit jobs."
        ),
    )
    queue_name: str | None = Field(
        default=None,
        pattern=LABEL_VALUE_PATTERN,
        max_length=63,
        description="Kueue LocalQueue to submit the job to (the kueue.x-k8s.io/queue-name label).",
    )
    max_restarts: int = Field(
        default=3,
        ge=0,
        description=(
            "Times the operator recreates a failed run (lost node, crashed pod), each resuming from the "
            "newest checkpoint, before the job is marked Failed."
        ),
    )
    active_deadline_seconds: int | None = Field(
        default=None,
        ge=1,
        description=(
            "Limit on the job's running time, summed over its attempts (each from KubeRay starting its "
            "cluster to its end); time suspended, queued in Kueue or waiting between attempts does not "
            "count. When exceeded the job fails (DeadlineExceeded)."
        ),
    )
    stall_timeout_seconds: int = Field(
        default=1800,
        ge=10,
        le=86400,
        description=(
            "A worker call (generation, an update, a collective) that gives no answer for this long while "
            "its workers stay alive is a stall: the run stops with an error naming the role and method "
            "(reason Stalled) and the attempt is retried from the newest checkpoint. Set it above the "
            "slowest step's longest single call."
        ),
    )
    ttl_seconds_after_finished: int | None = Field(
        default=None,
        ge=0,
        description="Delete the RLHFJob this long after it succeeds or fails. Default: keep it.",
    )
    startup_timeout_seconds: int = Field(
        default=1800,
        ge=1,
        description=(
            "Seconds an attempt may take from KubeRay starting its cluster until the job is submitted "
            "(scheduling, image pulls, cluster start; time queued or suspended does not count); past it "
            "KubeRay fails the attempt (PreRunningDeadlineExceeded), which is retried, so a RayJob that "
            "never gets its pods does not stay Initializing for ever."
        ),
    )
    keep_cluster_seconds_after_finished: int = Field(
        default=0,
        ge=0,
        description=(
            "Seconds a finished attempt's Ray cluster (its pods and logs) stays before KubeRay deletes "
            "it; set it to read a failed attempt's logs. KubeRay has one TTL for every outcome, so the "
            "last attempt's cluster stays as long."
        ),
    )
    pods: PodsSpec = Field(
        default=PodsSpec(),
        description="Env from Secrets, image pull secrets, priority, pod metadata and security overrides.",
    )
    scheduler_labels: dict[str, str] = Field(
        default_factory=dict,
        description=(
            "Labels copied onto the RayJob and its pods to hand the job to a gang scheduler, e.g. "
            "{ray.io/scheduler-name: volcano, volcano.sh/queue-name: research}."
        ),
    )

    def pool(self, role: RoleName) -> ResourcePoolSpec:
        """The pool ``role`` runs on; the rules guarantee it exists once the spec is valid."""
        name = self.roles.pool_of(role)
        return next(pool for pool in self.resource_pools if pool.name == name)

    @property
    def evaluation_settings(self) -> EvaluationSpec | None:
        """How the job evaluates: ``spec.evaluation`` or its defaults with valFiles; None without valFiles."""
        if not self.data.val_files:
            return None
        return self.evaluation if self.evaluation is not None else EvaluationSpec()

    @property
    def rollout_has_own_pool(self) -> bool:
        """Whether the rollout runs on a pool other than the actor's (the weights are then pushed to it)."""
        return self.roles.pool_of("rollout") != self.roles.actor

    @property
    def checkpoint_dir(self) -> str:
        """Where checkpoints are written: under the checkpoint volume's mount, else under outputDir."""
        base = self.checkpoint.volume.mount_path if self.checkpoint.volume is not None else self.output_dir
        return posixpath.join(base, self.checkpoint.path)

    @model_validator(mode="after")
    def _enforce_rules(self) -> Self:
        failures = [
            *broken_rules(self.algorithm.kl, KL_RULES),
            *broken_rules(self.algorithm, ALGORITHM_RULES),
            *broken_rules(self.rollout, ROLLOUT_RULES),
            *broken_rules(self.agent, AGENT_RULES),
            *broken_rules(self.training, TRAINING_RULES),
            *(broken_rules(self.evaluation, EVALUATION_RULES) if self.evaluation is not None else []),
            *broken_rules(self, SPEC_RULES),
        ]
        if failures:
            raise RuleViolations(failures)
        return self


# --------------------------------------------------------------------------- cross-section rules
#
# The CEL fragments that recur (model-parallel sizes, a pool's GPUs) are named once so every rule
# spells them alike; print ``VALIDATION_RULES`` to read the expanded expressions. The Python twins
# look pools up by name the way the CEL does (``all``/``exists`` over the list), so a spec that
# names a missing pool breaks only the rule about that name, not every rule that reads the pool.

_TRAIN_MODEL_PARALLEL = "(self.training.tensorParallelSize * self.training.pipelineParallelSize)"
_TRAIN_ACTOR_REPLICA = (
    "(self.training.tensorParallelSize * self.training.pipelineParallelSize * "
    "self.training.sequenceParallelSize)"
)
_ROLLOUT_MODEL_PARALLEL = "(self.rollout.tensorParallelSize * self.rollout.pipelineParallelSize)"
_POOL_GPUS = "(p.nodes * p.gpusPerNode)"


def _pools_named(spec: RLHFJobSpec, name: str | None) -> list[ResourcePoolSpec]:
    return [pool for pool in spec.resource_pools if pool.name == name]


def _pool_names(spec: RLHFJobSpec) -> str:
    return quoted_list([pool.name for pool in spec.resource_pools])


def _gpus(count: int) -> str:
    return f"{count} GPU" if count == 1 else f"{count} GPUs"


def _train_model_parallel(spec: RLHFJobSpec) -> int:
    return spec.training.tensor_parallel_size * spec.training.pipeline_parallel_size


def _role_pool_exists_rule(role: RoleName) -> CrossFieldRule[RLHFJobSpec]:
    guard = "" if role == "actor" else f"!has(self.roles.{role}) || "
    return CrossFieldRule[RLHFJobSpec](
        name=f"{role}-pool-exists",
        node_path="spec",
        field_path=f".roles.{role}",
        cel=f"{guard}self.resourcePools.exists(p, p.name == self.roles.{role})",
        message="must name a pool in spec.resourcePools",
        holds=lambda spec: (
            getattr(spec.roles, role) is None or bool(_pools_named(spec, getattr(spec.roles, role)))
        ),
        observed=lambda spec: f"{getattr(spec.roles, role)!r}; pools: {_pool_names(spec)}",
    )


def _role_needs_model_rule(role: Literal["critic", "reward", "cost"]) -> CrossFieldRule[RLHFJobSpec]:
    return CrossFieldRule[RLHFJobSpec](
        name=f"{role}-role-needs-model",
        node_path="spec",
        field_path=f".roles.{role}",
        cel=f"!has(self.roles.{role}) || has(self.models.{role})",
        message=f"places the {role} model, so spec.models.{role} must be set",
        holds=lambda spec: getattr(spec.roles, role) is None or getattr(spec.models, role) is not None,
        observed=lambda spec: f"{getattr(spec.roles, role)!r} and no spec.models.{role}",
    )


def _training_fits_pool_rule(role: Literal["actor", "critic"]) -> CrossFieldRule[RLHFJobSpec]:
    """The trained model's tensor x pipeline groups must tile its pool exactly (the rest is data parallel).

    The critic's rule applies only when the critic has a pool of its own; on the actor's pool
    the actor's rule already covers it.
    """
    # Under placement auto the one pool is the budget, not the role's pool: the planner sizes the pools.
    guard = "self.placement == 'auto' || " + (
        "" if role == "actor" else f"!has(self.roles.{role}) || self.roles.{role} == self.roles.actor || "
    )

    def holds(spec: RLHFJobSpec) -> bool:
        if spec.placement == "auto":
            return True
        if role == "critic" and spec.roles.pool_of("critic") == spec.roles.actor:
            return True
        pools = _pools_named(spec, spec.roles.pool_of(role))
        return all(pool.world_size % _train_model_parallel(spec) == 0 for pool in pools)

    def observed(spec: RLHFJobSpec) -> str:
        training = spec.training
        pool = _pools_named(spec, spec.roles.pool_of(role))[0]
        return (
            f"{training.tensor_parallel_size} * {training.pipeline_parallel_size} = "
            f"{_train_model_parallel(spec)}; pool {pool.name!r} has {_gpus(pool.world_size)}"
        )

    return CrossFieldRule[RLHFJobSpec](
        name=f"training-fits-{role}-pool",
        node_path="spec",
        field_path=".training",
        cel=(
            f"{guard}self.resourcePools.all(p, p.name != self.roles.{role} || "
            f"{_POOL_GPUS} % {_TRAIN_MODEL_PARALLEL} == 0)"
        ),
        message=(
            f"tensorParallelSize * pipelineParallelSize must divide the GPUs of the {role}'s pool "
            "(nodes * gpusPerNode)"
        ),
        holds=holds,
        observed=observed,
    )


_SplitCount = Literal["mini-batch", "step"]
"""What must split into whole micro-batches: an optimizer mini-batch, or the step's sequences."""

_STEP_SEQUENCES_CEL = "(self.training.promptsPerStep * self.algorithm.samplesPerPrompt)"


def _split_count(spec: RLHFJobSpec, what: _SplitCount) -> int:
    training = spec.training
    if what == "mini-batch":
        return training.mini_batch_size
    return training.prompts_per_step * spec.algorithm.samples_per_prompt


def _replica(spec: RLHFJobSpec, role: Literal["actor", "critic"]) -> int:
    """Ranks of one data-parallel replica of the role's model (``t * p``, times ``sp`` for the actor)."""
    sequence = spec.training.sequence_parallel_size if role == "actor" else 1
    return _train_model_parallel(spec) * sequence


def _split_message(role: Literal["actor", "critic"], what: _SplitCount) -> str:
    divisor = (
        "pool (GPUs / (tensorParallelSize * pipelineParallelSize * sequenceParallelSize))"
        if role == "actor"
        else "pool (GPUs / (tensorParallelSize * pipelineParallelSize))"
    )
    if what == "mini-batch":
        return (
            f"must be a multiple of microBatchSizePerGpu times the data-parallel size of the {role}'s "
            f"{divisor}, so every rank gets whole micro-batches"
        )
    return (
        "times spec.algorithm.samplesPerPrompt must be a multiple of microBatchSizePerGpu times the "
        f"data-parallel size of the {role}'s {divisor}, so every rank gets whole micro-batches of the "
        "step's last, smaller mini-batch too"
    )


def _split_observed(spec: RLHFJobSpec, role: Literal["actor", "critic"], what: _SplitCount) -> str:
    pool = _pools_named(spec, spec.roles.pool_of(role))[0]
    training = spec.training
    count = (
        f"{training.mini_batch_size}"
        if what == "mini-batch"
        else f"{training.prompts_per_step} prompts x {spec.algorithm.samples_per_prompt} samples"
    )
    return (
        f"{count} with microBatchSizePerGpu {training.micro_batch_size_per_gpu} and "
        f"data-parallel size {pool.world_size // _replica(spec, role)} on pool {pool.name!r}"
    )


def _mini_batch_splits_rule(
    role: Literal["actor", "critic"], what: _SplitCount = "mini-batch"
) -> CrossFieldRule[RLHFJobSpec]:
    """Each data-parallel rank of the trained model must get a whole number of micro-batches.

    ``what``: of every full mini-batch (``miniBatchSize``) or of the step's sequences
    (``promptsPerStep * samplesPerPrompt``). Both together make the last mini-batch of a step,
    the remainder when ``miniBatchSize`` does not divide the step, split into whole
    micro-batches too: every rank then runs the same passes with micro-batches of equal rows
    (megatron's pipeline needs that), and the step splits over the ranks exactly
    (``DP_SPLIT_EXACT``).

    The actor's data-parallel ranks are its replicas of ``t * p * sp`` ranks (the ranks of a
    sequence-parallel group share their rows); the critic runs without sequence parallelism.
    Skipped when the parallel sizes do not tile the pool: ``training-fits-*-pool`` and
    ``sequence-parallel-divides-policy-pools`` report that, and the data-parallel size is
    undefined until it is fixed.
    """
    # Under placement auto the one pool is the budget, not the role's pool: the planner sizes the pools.
    guard = "self.placement == 'auto' || " + (
        "" if role == "actor" else f"!has(self.roles.{role}) || self.roles.{role} == self.roles.actor || "
    )
    replica_cel = _TRAIN_ACTOR_REPLICA if role == "actor" else _TRAIN_MODEL_PARALLEL
    count_cel = "self.training.miniBatchSize" if what == "mini-batch" else _STEP_SEQUENCES_CEL

    def holds(spec: RLHFJobSpec) -> bool:
        if spec.placement == "auto":
            return True
        if role == "critic" and spec.roles.pool_of("critic") == spec.roles.actor:
            return True
        micro, replica = spec.training.micro_batch_size_per_gpu, _replica(spec, role)
        return all(
            pool.world_size % replica != 0
            or _split_count(spec, what) % (micro * (pool.world_size // replica)) == 0
            for pool in _pools_named(spec, spec.roles.pool_of(role))
        )

    return CrossFieldRule[RLHFJobSpec](
        name=f"{what}-splits-over-{role}-ranks",
        node_path="spec",
        field_path=".training.miniBatchSize" if what == "mini-batch" else ".training.promptsPerStep",
        cel=(
            f"{guard}self.resourcePools.all(p, p.name != self.roles.{role} || "
            f"{_POOL_GPUS} % {replica_cel} != 0 || "
            f"{count_cel} % (self.training.microBatchSizePerGpu * "
            f"({_POOL_GPUS} / {replica_cel})) == 0)"
        ),
        message=_split_message(role, what),
        holds=holds,
        observed=lambda spec: _split_observed(spec, role, what),
    )


def _rollout_parallel_needs_megatron_rule(kind: Literal["tensor", "pipeline"]) -> CrossFieldRule[RLHFJobSpec]:
    """Generation-time model parallelism with FSDP: tensor parallel on vLLM only, pipeline never.

    With FSDP and the torch engine the rollout loads the actor's full weights into one engine
    per rank; vLLM takes per-rank tensor-parallel shards (``workers/vllm_rollout.py``).
    Pipeline-parallel generation exists only as the megatron 3D-HybridEngine's torch engine.
    """
    field = f"{kind}ParallelSize"

    def size(spec: RLHFJobSpec) -> int:
        return spec.rollout.tensor_parallel_size if kind == "tensor" else spec.rollout.pipeline_parallel_size

    if kind == "tensor":
        return CrossFieldRule[RLHFJobSpec](
            name=f"rollout-{kind}-parallel-needs-megatron",
            node_path="spec",
            field_path=f".rollout.{field}",
            cel=(
                f"self.training.backend == 'megatron' || self.rollout.engine == 'vllm' || "
                f"self.rollout.{field} == 1"
            ),
            message=(
                "must be 1 with backend 'fsdp' and engine 'torch': each rank generates with the full "
                "weights; tensor parallel generation needs engine 'vllm' (one vLLM shard per rank) or "
                "backend 'megatron' (the 3D-HybridEngine)"
            ),
            holds=lambda spec: (
                spec.training.backend == "megatron" or spec.rollout.engine == "vllm" or size(spec) == 1
            ),
            observed=lambda spec: (
                f"{size(spec)} with backend {spec.training.backend!r} and engine {spec.rollout.engine!r}"
            ),
        )
    return CrossFieldRule[RLHFJobSpec](
        name=f"rollout-{kind}-parallel-needs-megatron",
        node_path="spec",
        field_path=f".rollout.{field}",
        cel=f"self.training.backend == 'megatron' || self.rollout.{field} == 1",
        message=(
            f"must be 1 with backend 'fsdp': each rank generates with the full weights; {kind} "
            "parallel generation needs backend 'megatron' (the 3D-HybridEngine)"
        ),
        holds=lambda spec: spec.training.backend == "megatron" or size(spec) == 1,
        observed=lambda spec: f"{size(spec)} with backend {spec.training.backend!r}",
    )


def _pools_sequence_parallel_does_not_divide(spec: RLHFJobSpec) -> list[ResourcePoolSpec]:
    """The actor's and the reference's pools whose GPUs ``training.sequenceParallelSize`` does not divide."""
    names = {spec.roles.actor, spec.roles.pool_of("reference")}
    return [
        pool
        for pool in spec.resource_pools
        if pool.name in names and pool.world_size % spec.training.sequence_parallel_size
    ]


def _auto_placement_settings(spec: RLHFJobSpec) -> list[str]:
    """The settings ``placement: auto`` would override, as ``field=value`` (empty: none set)."""
    found = [
        f"roles.{role}={getattr(spec.roles, role)!r}" for role in _ROLES[1:] if getattr(spec.roles, role)
    ]
    sizes = {
        "training.tensorParallelSize": spec.training.tensor_parallel_size,
        "training.pipelineParallelSize": spec.training.pipeline_parallel_size,
        "training.sequenceParallelSize": spec.training.sequence_parallel_size,
        "rollout.tensorParallelSize": spec.rollout.tensor_parallel_size,
        "rollout.pipelineParallelSize": spec.rollout.pipeline_parallel_size,
    }
    return found + [f"{name}={value}" for name, value in sizes.items() if value != 1]


def _auto_placement_left_open(spec: RLHFJobSpec) -> bool:
    return not _auto_placement_settings(spec)


def _rollout_colocated(spec: RLHFJobSpec) -> bool:
    return spec.roles.pool_of("rollout") == spec.roles.actor


_ROLLOUT_ON_OWN_POOL = "(has(self.roles.rollout) && self.roles.rollout != self.roles.actor)"
_VLLM_SERVER = "(self.rollout.mode == 'server' && self.rollout.engine == 'vllm' && self.rollout.pipelineParallelSize == 1)"


def _vllm_server(spec: RLHFJobSpec) -> bool:
    """Server-mode vLLM replicas: tensor-parallel groups on the rollout's own pool (``rollout/replica.py``)."""
    rollout = spec.rollout
    return rollout.mode == "server" and rollout.engine == "vllm" and rollout.pipeline_parallel_size == 1


_ROLES: tuple[RoleName, ...] = ("actor", "rollout", "reference", "critic", "reward", "cost")

_SANDBOX_WORKERS_CEL = (
    "(self.agent.loop != 'single-turn' && self.agent.tools.exists(t, t in "
    f"{list(SANDBOXED_TOOLS)}) && self.agent.sandbox.workers > 0)"
)
"""CEL of ``AgentSpec.sandbox_workers > 0``: the RayJob has the ``sandbox`` worker group."""


SPEC_RULES: tuple[CrossFieldRule[RLHFJobSpec], ...] = (
    CrossFieldRule[RLHFJobSpec](
        name="evaluation-needs-val-files",
        node_path="spec",
        field_path=".evaluation",
        cel="!has(self.evaluation) || size(self.data.valFiles) > 0",
        message="scores the policy on spec.data.valFiles: list at least one validation file, or leave evaluation out",
        holds=lambda spec: spec.evaluation is None or bool(spec.data.val_files),
        observed=lambda spec: "an evaluation section and no spec.data.valFiles",
    ),
    CrossFieldRule[RLHFJobSpec](
        name="pool-names-unique",
        node_path="spec",
        field_path=".resourcePools",
        cel="self.resourcePools.all(p, self.resourcePools.exists_one(q, q.name == p.name))",
        message="pool names must be unique",
        holds=lambda spec: len({pool.name for pool in spec.resource_pools}) == len(spec.resource_pools),
        observed=lambda spec: (
            "repeated: "
            + quoted_list(
                [name for name, count in Counter(p.name for p in spec.resource_pools).items() if count > 1]
            )
        ),
    ),
    *(_role_pool_exists_rule(role) for role in _ROLES),
    *(_role_needs_model_rule(role) for role in ("critic", "reward", "cost")),
    CrossFieldRule[RLHFJobSpec](
        name="every-pool-hosts-a-role",
        node_path="spec",
        field_path=".resourcePools",
        cel=(
            "self.placement == 'auto' || self.resourcePools.all(p, p.name == self.roles.actor"
            + "".join(f" || (has(self.roles.{role}) && p.name == self.roles.{role})" for role in _ROLES[1:])
            + ")"
        ),
        message="every pool must host at least one role in spec.roles; an unused pool holds GPUs idle",
        holds=lambda spec: (
            spec.placement == "auto"
            or all(
                any(spec.roles.pool_of(role) == pool.name for role in _ROLES) for pool in spec.resource_pools
            )
        ),
        observed=lambda spec: (
            "unused: "
            + quoted_list(
                [
                    pool.name
                    for pool in spec.resource_pools
                    if all(spec.roles.pool_of(role) != pool.name for role in _ROLES)
                ]
            )
        ),
    ),
    CrossFieldRule[RLHFJobSpec](
        name="critic-required",
        node_path="spec",
        field_path=".models.critic",
        cel=f"!(self.algorithm.name in {list(CRITIC_ALGORITHMS)!r}) || has(self.models.critic)",
        message="is required by ppo and safe-rlhf, which train a value function",
        holds=lambda spec: spec.algorithm.name not in CRITIC_ALGORITHMS or spec.models.critic is not None,
        observed=lambda spec: f"no critic with algorithm.name {spec.algorithm.name!r}",
    ),
    CrossFieldRule[RLHFJobSpec](
        name="critic-unused",
        node_path="spec",
        field_path=".models.critic",
        cel=(
            f"!has(self.models.critic) || self.algorithm.name in {list(CRITIC_ALGORITHMS)!r}"
            " || self.algorithm.name.contains(':')"
        ),
        message="is only used by ppo, safe-rlhf and plugins; remove it or change algorithm.name",
        holds=lambda spec: (
            spec.models.critic is None
            or spec.algorithm.name in CRITIC_ALGORITHMS
            or ":" in spec.algorithm.name
        ),
        observed=lambda spec: f"a critic with algorithm.name {spec.algorithm.name!r}",
    ),
    CrossFieldRule[RLHFJobSpec](
        name="cost-required",
        node_path="spec",
        field_path=".models.cost",
        cel="self.algorithm.name != 'safe-rlhf' || has(self.models.cost)",
        message="is required by safe-rlhf, which constrains the expected cost",
        holds=lambda spec: spec.algorithm.name != "safe-rlhf" or spec.models.cost is not None,
        observed=lambda spec: f"no cost model with algorithm.name {spec.algorithm.name!r}",
    ),
    CrossFieldRule[RLHFJobSpec](
        name="cost-unused",
        node_path="spec",
        field_path=".models.cost",
        cel="!has(self.models.cost) || self.algorithm.name == 'safe-rlhf'",
        message="is only used by safe-rlhf; remove it or change algorithm.name",
        holds=lambda spec: spec.models.cost is None or spec.algorithm.name == "safe-rlhf",
        observed=lambda spec: f"a cost model with algorithm.name {spec.algorithm.name!r}",
    ),
    CrossFieldRule[RLHFJobSpec](
        name="reward-source",
        node_path="spec",
        field_path=".rewards",
        cel="size(self.rewards) > 0 || has(self.models.reward)",
        message="must list at least one function when spec.models.reward is not set",
        holds=lambda spec: len(spec.rewards) > 0 or spec.models.reward is not None,
        observed=lambda spec: "no reward functions and no reward model",
    ),
    _training_fits_pool_rule("actor"),
    _training_fits_pool_rule("critic"),
    _mini_batch_splits_rule("actor"),
    _mini_batch_splits_rule("critic"),
    _mini_batch_splits_rule("actor", "step"),
    _mini_batch_splits_rule("critic", "step"),
    CrossFieldRule[RLHFJobSpec](
        name="rollout-tensor-parallel-divides-training",
        node_path="spec",
        field_path=".rollout.tensorParallelSize",
        cel=(
            f"self.training.backend != 'megatron' || {_ROLLOUT_ON_OWN_POOL} || "
            "self.training.tensorParallelSize % self.rollout.tensorParallelSize == 0"
        ),
        message=(
            "must divide spec.training.tensorParallelSize while the rollout shares the actor's pool, "
            "so the 3D-HybridEngine can reshard the actor's weights in place"
        ),
        holds=lambda spec: (
            spec.training.backend != "megatron"
            or not _rollout_colocated(spec)
            or spec.training.tensor_parallel_size % spec.rollout.tensor_parallel_size == 0
        ),
        observed=lambda spec: (
            f"{spec.rollout.tensor_parallel_size} with training.tensorParallelSize "
            f"{spec.training.tensor_parallel_size}"
        ),
    ),
    CrossFieldRule[RLHFJobSpec](
        name="rollout-pipeline-parallel-divides-training",
        node_path="spec",
        field_path=".rollout.pipelineParallelSize",
        cel=(
            f"self.training.backend != 'megatron' || {_ROLLOUT_ON_OWN_POOL} || "
            "self.training.pipelineParallelSize % self.rollout.pipelineParallelSize == 0"
        ),
        message=(
            "must divide spec.training.pipelineParallelSize while the rollout shares the actor's pool, "
            "so the 3D-HybridEngine can reshard the actor's weights in place"
        ),
        holds=lambda spec: (
            spec.training.backend != "megatron"
            or not _rollout_colocated(spec)
            or spec.training.pipeline_parallel_size % spec.rollout.pipeline_parallel_size == 0
        ),
        observed=lambda spec: (
            f"{spec.rollout.pipeline_parallel_size} with training.pipelineParallelSize "
            f"{spec.training.pipeline_parallel_size}"
        ),
    ),
    *(_rollout_parallel_needs_megatron_rule(kind) for kind in ("tensor", "pipeline")),
    CrossFieldRule[RLHFJobSpec](
        name="vllm-generates-without-pipeline-parallel",
        node_path="spec",
        field_path=".rollout.pipelineParallelSize",
        cel="self.rollout.engine != 'vllm' || self.rollout.pipelineParallelSize == 1",
        message=(
            "must be 1 with engine 'vllm': vLLM generates inside the job with tensor parallelism only; "
            "pipeline-parallel generation needs engine 'torch' (the 3D-HybridEngine's torch engine)"
        ),
        holds=lambda spec: spec.rollout.engine != "vllm" or spec.rollout.pipeline_parallel_size == 1,
        observed=lambda spec: f"{spec.rollout.pipeline_parallel_size} with engine {spec.rollout.engine!r}",
    ),
    CrossFieldRule[RLHFJobSpec](
        name="vllm-tensor-parallel-divides-actor-pool",
        node_path="spec",
        field_path=".rollout.tensorParallelSize",
        cel=(
            f"self.rollout.engine != 'vllm' || {_ROLLOUT_ON_OWN_POOL} || "
            f"self.resourcePools.all(p, p.name != self.roles.actor || {_POOL_GPUS} % self.rollout.tensorParallelSize == 0)"
        ),
        message=(
            "must divide the actor pool's GPUs with engine 'vllm': every rank holds one vLLM shard and "
            "the pool splits into groups of tensorParallelSize ranks that generate together"
        ),
        holds=lambda spec: (
            spec.rollout.engine != "vllm"
            or not _rollout_colocated(spec)
            or all(
                pool.world_size % spec.rollout.tensor_parallel_size == 0
                for pool in _pools_named(spec, spec.roles.actor)
            )
        ),
        observed=lambda spec: (
            f"{spec.rollout.tensor_parallel_size} with "
            f"{[pool.world_size for pool in _pools_named(spec, spec.roles.actor)]} GPUs"
        ),
    ),
    CrossFieldRule[RLHFJobSpec](
        name="rollout-own-pool-holds-whole-model",
        node_path="spec",
        field_path=".rollout",
        cel=(
            f"!{_ROLLOUT_ON_OWN_POOL} || ({_TRAIN_MODEL_PARALLEL} == 1 && ({_ROLLOUT_MODEL_PARALLEL} == 1 || "
            f"{_VLLM_SERVER}))"
        ),
        message=(
            "tensorParallelSize and pipelineParallelSize must be 1, as must spec.training's, while the "
            "rollout has a pool of its own: each rollout rank loads the actor's whole model, pushed from "
            "the actor's pool after every update (with mode 'server' and engine 'vllm', tensorParallelSize "
            "may be above 1: each replica's ranks receive the whole model and vLLM keeps each rank's shard)"
        ),
        holds=lambda spec: (
            _rollout_colocated(spec)
            or (
                _train_model_parallel(spec) == 1
                and (
                    spec.rollout.tensor_parallel_size * spec.rollout.pipeline_parallel_size == 1
                    or _vllm_server(spec)
                )
            )
        ),
        observed=lambda spec: (
            f"rollout {spec.rollout.tensor_parallel_size} * {spec.rollout.pipeline_parallel_size}, training "
            f"{spec.training.tensor_parallel_size} * {spec.training.pipeline_parallel_size} with "
            f"roles.rollout {spec.roles.rollout!r}, engine {spec.rollout.engine!r}, mode {spec.rollout.mode!r}"
        ),
    ),
    CrossFieldRule[RLHFJobSpec](
        name="server-mode-replica-fits-a-node",
        node_path="spec",
        field_path=".rollout.tensorParallelSize",
        cel=(
            "self.rollout.mode != 'server' || self.resourcePools.all(p, p.name != self.roles.rollout || "
            "p.gpusPerNode % self.rollout.tensorParallelSize == 0)"
        ),
        message=(
            "must divide the rollout pool's gpusPerNode in mode 'server': each replica is one "
            "tensor-parallel group of tensorParallelSize GPUs on one node"
        ),
        holds=lambda spec: (
            spec.rollout.mode != "server"
            or all(
                pool.gpus_per_node % spec.rollout.tensor_parallel_size == 0
                for pool in _pools_named(spec, spec.roles.pool_of("rollout"))
            )
        ),
        observed=lambda spec: (
            f"{spec.rollout.tensor_parallel_size} with gpusPerNode "
            f"{[pool.gpus_per_node for pool in _pools_named(spec, spec.roles.pool_of('rollout'))]}"
        ),
    ),
    CrossFieldRule[RLHFJobSpec](
        name="rollout-compile-needs-a-whole-model-engine",
        node_path="spec",
        field_path=".rollout.compile",
        cel=f"!self.rollout.compile || self.training.backend != 'megatron' || {_TRAIN_MODEL_PARALLEL} == 1",
        message=(
            "compiles the torch engine of a rollout that holds the whole model; with backend 'megatron' "
            "and tensorParallelSize * pipelineParallelSize > 1 the rollout generates from the actor's "
            "model-parallel shards (the 3D-HybridEngine), which does not compile: set compile false"
        ),
        holds=lambda spec: (
            not spec.rollout.compile
            or spec.training.backend != "megatron"
            or _train_model_parallel(spec) == 1
        ),
        observed=lambda spec: (
            f"true with backend 'megatron' at {spec.training.tensor_parallel_size} * "
            f"{spec.training.pipeline_parallel_size}"
        ),
    ),
    CrossFieldRule[RLHFJobSpec](
        name="lora-reference-is-the-base",
        node_path="spec",
        field_path=".models.reference",
        cel="!has(self.training.lora) || !has(self.models.reference)",
        message=(
            "must be unset with training.lora: the reference policy is the actor's base model with the "
            "adapter switched off, so no other reference model is loaded"
        ),
        holds=lambda spec: spec.training.lora is None or spec.models.reference is None,
        observed=lambda spec: (
            f"{spec.models.reference.path if spec.models.reference else None!r} with training.lora set"
        ),
    ),
    CrossFieldRule[RLHFJobSpec](
        name="lora-rollout-whole-model",
        node_path="spec",
        field_path=".rollout.tensorParallelSize",
        cel="!has(self.training.lora) || self.rollout.tensorParallelSize == 1",
        message=(
            "must be 1 with training.lora: adapters are synced to engines that hold the whole model "
            "(a tensor-parallel engine would need each rank's slice of every adapter)"
        ),
        holds=lambda spec: spec.training.lora is None or spec.rollout.tensor_parallel_size == 1,
        observed=lambda spec: f"{spec.rollout.tensor_parallel_size} with training.lora set",
    ),
    CrossFieldRule[RLHFJobSpec](
        name="lora-vllm-server-aborts",
        node_path="spec",
        field_path=".rollout.onWeightUpdate",
        cel=(
            "!has(self.training.lora) || self.rollout.engine != 'vllm' || self.rollout.mode != 'server' "
            "|| self.rollout.onWeightUpdate == 'abort'"
        ),
        message=(
            "must be 'abort' with training.lora on vLLM replicas: vLLM binds a running request to the "
            "adapter version it started with, so 'keep' could not move it to the new adapter"
        ),
        holds=lambda spec: (
            spec.training.lora is None
            or spec.rollout.engine != "vllm"
            or spec.rollout.mode != "server"
            or spec.rollout.on_weight_update == "abort"
        ),
        observed=lambda spec: (
            f"{spec.rollout.on_weight_update!r} with training.lora and engine 'vllm' in server mode"
        ),
    ),
    CrossFieldRule[RLHFJobSpec](
        name="export-kind-matches-lora",
        node_path="spec",
        field_path=".checkpoint.export.kind",
        cel=(
            "!has(self.checkpoint.export) || !has(self.checkpoint.export.kind) || "
            "(has(self.training.lora) ? self.checkpoint.export.kind != 'full' : self.checkpoint.export.kind == 'full')"
        ),
        message=(
            "must be 'merged' or 'adapter' with training.lora (a LoRA actor is a base plus an adapter), and "
            "'full' without it"
        ),
        holds=lambda spec: (
            spec.checkpoint.export is None
            or spec.checkpoint.export.kind is None
            or (spec.checkpoint.export.kind != "full") == (spec.training.lora is not None)
        ),
        observed=lambda spec: (
            f"{spec.checkpoint.export.kind if spec.checkpoint.export else None!r} with training.lora "
            f"{'set' if spec.training.lora is not None else 'unset'}"
        ),
    ),
    CrossFieldRule[RLHFJobSpec](
        name="staleness-needs-own-rollout-pool",
        node_path="spec",
        field_path=".rollout.maxStaleness",
        cel=f"self.rollout.maxStaleness == 0 || {_ROLLOUT_ON_OWN_POOL}",
        message=(
            "must be 0 unless spec.roles.rollout names a pool other than the actor's: generation overlaps "
            "training only on GPUs of its own"
        ),
        holds=lambda spec: spec.rollout.max_staleness == 0 or not _rollout_colocated(spec),
        observed=lambda spec: (
            f"{spec.rollout.max_staleness} with roles.rollout {spec.roles.rollout!r} and roles.actor "
            f"{spec.roles.actor!r}"
        ),
    ),
    CrossFieldRule[RLHFJobSpec](
        name="server-mode-needs-own-rollout-pool",
        node_path="spec",
        field_path=".rollout.mode",
        cel=f"self.rollout.mode != 'server' || {_ROLLOUT_ON_OWN_POOL}",
        message=(
            "'server' runs engine replicas on GPUs of their own: set spec.roles.rollout to a pool other "
            "than the actor's, or mode 'batch'"
        ),
        holds=lambda spec: spec.rollout.mode != "server" or not _rollout_colocated(spec),
        observed=lambda spec: (
            f"'server' with roles.rollout {spec.roles.rollout!r} and roles.actor {spec.roles.actor!r}"
        ),
    ),
    CrossFieldRule[RLHFJobSpec](
        name="sandbox-group-name-is-free",
        node_path="spec",
        field_path=".resourcePools",
        cel=f"!{_SANDBOX_WORKERS_CEL} || self.resourcePools.all(p, p.name != '{SANDBOX_GROUP}')",
        message=(
            f"must not name a pool '{SANDBOX_GROUP}' while spec.agent runs sandbox workers: their RayJob "
            "worker group has that name; rename the pool"
        ),
        holds=lambda spec: (
            not spec.agent.sandbox_workers or all(pool.name != SANDBOX_GROUP for pool in spec.resource_pools)
        ),
        observed=lambda spec: f"{[pool.name for pool in spec.resource_pools]}",
    ),
    CrossFieldRule[RLHFJobSpec](
        name="multi-turn-needs-server-mode",
        node_path="spec",
        field_path=".agent.loop",
        cel="self.agent.loop == 'single-turn' || self.rollout.mode == 'server'",
        message=(
            "runs its turns in the rollout service, where each trajectory advances on its own: set "
            "spec.rollout.mode 'server' (on a rollout pool of its own), or loop 'single-turn'"
        ),
        holds=lambda spec: not spec.agent.multi_turn or spec.rollout.mode == "server",
        observed=lambda spec: f"{spec.agent.loop!r} with rollout.mode {spec.rollout.mode!r}",
    ),
    CrossFieldRule[RLHFJobSpec](
        name="dynamic-sampling-needs-groups",
        node_path="spec",
        field_path=".rollout.dynamicSampling.enabled",
        cel="!self.rollout.dynamicSampling.enabled || self.algorithm.samplesPerPrompt > 1",
        message=(
            "drops groups whose rewards are all equal, which one sample per prompt always is: set "
            "spec.algorithm.samplesPerPrompt above 1, or enabled false"
        ),
        holds=lambda spec: not spec.rollout.dynamic_sampling.enabled or spec.algorithm.samples_per_prompt > 1,
        observed=lambda spec: f"true with samplesPerPrompt {spec.algorithm.samples_per_prompt}",
    ),
    CrossFieldRule[RLHFJobSpec](
        name="parameter-offload-needs-own-engine-weights",
        node_path="spec",
        field_path=".training.offloadDuringGeneration.parameters",
        cel=(
            "!self.training.offloadDuringGeneration.parameters || self.training.backend != 'fsdp' || "
            "self.rollout.engine != 'torch' || "
            f"self.resourcePools.all(p, p.name != self.roles.actor || {_POOL_GPUS} > 1)"
        ),
        message=(
            "cannot be true with backend 'fsdp', rollout engine 'torch' and a one-GPU actor pool: the "
            "engine then generates from the actor's own parameters; offload optimizerState only, or use "
            "engine 'vllm'"
        ),
        holds=lambda spec: (
            not spec.training.offload_during_generation.parameters
            or spec.training.backend != "fsdp"
            or spec.rollout.engine != "torch"
            or all(pool.world_size > 1 for pool in _pools_named(spec, spec.roles.actor))
        ),
        observed=lambda spec: "true with the torch engine on a one-GPU actor pool",
    ),
    CrossFieldRule[RLHFJobSpec](
        name="sequence-parallel-divides-policy-pools",
        node_path="spec",
        field_path=".training.sequenceParallelSize",
        cel=(
            "self.placement == 'auto' || self.resourcePools.all(p, (p.name != self.roles.actor && "
            "(!has(self.roles.reference) || p.name != self.roles.reference)) || "
            f"{_POOL_GPUS} % self.training.sequenceParallelSize == 0)"
        ),
        message=(
            "must divide the GPUs of the actor's and the reference's pools (nodes * gpusPerNode): they "
            "split into sequence-parallel groups of this many ranks"
        ),
        holds=lambda spec: spec.placement == "auto" or not _pools_sequence_parallel_does_not_divide(spec),
        observed=lambda spec: (
            f"{spec.training.sequence_parallel_size} with "
            + ", ".join(
                f"pool {pool.name!r} of {_gpus(pool.world_size)}"
                for pool in _pools_sequence_parallel_does_not_divide(spec)
            )
        ),
    ),
    CrossFieldRule[RLHFJobSpec](
        name="sequence-parallel-without-critic",
        node_path="spec",
        field_path=".training.sequenceParallelSize",
        cel="self.training.sequenceParallelSize == 1 || !has(self.models.critic)",
        message=(
            "must be 1 with a critic (spec.models.critic: ppo, safe-rlhf): sequence parallelism splits the "
            "actor's and the reference's passes, and the value models run data-parallel over whole "
            "sequences, where the lengths it makes room for would not fit"
        ),
        holds=lambda spec: spec.training.sequence_parallel_size == 1 or spec.models.critic is None,
        observed=lambda spec: (
            f"{spec.training.sequence_parallel_size} with algorithm.name {spec.algorithm.name!r} and a critic"
        ),
    ),
    CrossFieldRule[RLHFJobSpec](
        name="auto-placement-one-pool",
        node_path="spec",
        field_path=".resourcePools",
        cel="self.placement != 'auto' || size(self.resourcePools) == 1",
        message="must hold exactly one pool, the GPU budget, when spec.placement is auto",
        holds=lambda spec: spec.placement != "auto" or len(spec.resource_pools) == 1,
        observed=lambda spec: f"{len(spec.resource_pools)} pools: {_pool_names(spec)}",
    ),
    CrossFieldRule[RLHFJobSpec](
        name="auto-placement-chooses-roles-and-sizes",
        node_path="spec",
        field_path=".placement",
        cel=(
            "self.placement != 'auto' || ("
            + " && ".join(f"!has(self.roles.{role})" for role in _ROLES[1:])
            + " && self.training.tensorParallelSize == 1 && self.training.pipelineParallelSize == 1"
            " && self.training.sequenceParallelSize == 1"
            " && self.rollout.tensorParallelSize == 1 && self.rollout.pipelineParallelSize == 1)"
        ),
        message=(
            "auto chooses the roles' pools and the parallel sizes: leave spec.roles (other than actor), "
            "training.tensorParallelSize/pipelineParallelSize/sequenceParallelSize and "
            "rollout.tensorParallelSize/pipelineParallelSize unset"
        ),
        holds=lambda spec: spec.placement != "auto" or _auto_placement_left_open(spec),
        observed=lambda spec: "auto with " + ", ".join(_auto_placement_settings(spec)),
    ),
    CrossFieldRule[RLHFJobSpec](
        name="volume-mount-paths-unique",
        node_path="spec",
        field_path=".volumes",
        cel="self.volumes.all(v, self.volumes.exists_one(w, w.mountPath == v.mountPath))",
        message="mount paths must be unique",
        holds=lambda spec: len({volume.mount_path for volume in spec.volumes}) == len(spec.volumes),
        observed=lambda spec: (
            "repeated: "
            + quoted_list(
                [path for path, count in Counter(v.mount_path for v in spec.volumes).items() if count > 1]
            )
        ),
    ),
    CrossFieldRule[RLHFJobSpec](
        name="checkpoint-mount-path-free",
        node_path="spec",
        field_path=".checkpoint.volume.mountPath",
        cel=(
            "!has(self.checkpoint.volume) || "
            "!self.volumes.exists(v, v.mountPath == self.checkpoint.volume.mountPath)"
        ),
        message="must differ from every mountPath in spec.volumes",
        holds=lambda spec: (
            spec.checkpoint.volume is None
            or all(volume.mount_path != spec.checkpoint.volume.mount_path for volume in spec.volumes)
        ),
        observed=lambda spec: repr(spec.checkpoint.volume.mount_path if spec.checkpoint.volume else None),
    ),
)

VALIDATION_RULES: tuple[CrossFieldRule[Any], ...] = (
    *KL_RULES,
    *ALGORITHM_RULES,
    *ROLLOUT_RULES,
    *AGENT_RULES,
    *TRAINING_RULES,
    *EVALUATION_RULES,
    *SPEC_RULES,
)
"""Every cross-field rule of the spec, for the CRD generator and the docs; grouped by ``node_path``."""


# --------------------------------------------------------------------------- in-cluster rules
#
# Rules that only a cluster needs: the CRD enforces them at admission, and ``hybridflow validate``
# reports them with the same message (``--in-cluster`` makes them errors), while ``hybridflow run``
# on a laptop accepts such manifests (restarts there reuse the local disk, and relative paths
# resolve against the manifest's directory).

_MODEL_ROLES = ("actor", "reference", "critic", "reward", "cost")


def _relative_paths(spec: RLHFJobSpec) -> list[str]:
    paths = [
        getattr(spec.models, role).path for role in _MODEL_ROLES if getattr(spec.models, role) is not None
    ]
    paths += [*spec.data.train_files, *spec.data.val_files]
    paths.append(spec.output_dir)
    return [path for path in paths if not path.startswith("/")]


_ABSOLUTE_MODEL_PATHS = " && ".join(
    f"{'' if role == 'actor' else f'(!has(self.models.{role}) || '}self.models.{role}.path.startsWith('/')"
    f"{'' if role == 'actor' else ')'}"
    for role in _MODEL_ROLES
)

KUEUE_MAX_WORKER_GROUPS = 6
"""A Kueue Workload holds at most MaxPodSets pod sets (8 before Kueue 0.18, 10 in 0.18, 18 in 0.19): one
per worker group (each pool, and the agent's ``sandbox`` group when it runs), the head's and KubeRay's
submitter's (``jobs/raycluster`` ``ValidateCreate``, ``jobs/rayjob`` ``PodSets``): 6 worker groups fit
every supported Kueue (0.16 to 0.19)."""
KUEUE_RESERVED_GROUPS = ("head", "submitter")
"""The pod set names Kueue gives the head (``headGroupPodSetName``) and, in K8sJobMode, KubeRay's
submitter Job (``submitterJobPodSetName``, ``jobs/rayjob/rayjob_controller.go``, 0.16-0.19). A
Workload's ``podSets`` is a list map keyed by name: a pool of either name makes a Workload the API
server refuses, and the job never starts."""


def _worker_groups(spec: RLHFJobSpec) -> int:
    """Worker groups of the job's RayJob: one per pool, and the sandbox's when it runs."""
    return len(spec.resource_pools) + (1 if spec.agent.sandbox_workers else 0)


def _reserved_pool_names(spec: RLHFJobSpec) -> list[str]:
    return [pool.name for pool in spec.resource_pools if pool.name in KUEUE_RESERVED_GROUPS]


KUBERAY_REFUSED_ENV: tuple[tuple[str, str], ...] = (
    ("RAY_REDIS_ADDRESS", "KubeRay refuses it without GCS fault tolerance (ValidateRayClusterSpec)"),
    ("REDIS_USERNAME", "KubeRay refuses it in the head pod (ValidateRayClusterSpec)"),
    ("RAY_enable_autoscaler_v2", "KubeRay refuses it while autoscaling is off, as it always is here"),
    ("RAY_AUTH_MODE", "KubeRay sets it for the cluster's token authentication, and only when absent"),
    ("RAY_AUTH_TOKEN", "KubeRay sets it from the cluster's token Secret, and only when absent"),
)
"""Names ``spec.pods.env`` may not set, each with why: KubeRay 1.5.1-1.7 marks the RayJob
ValidationFailed for good (``utils/validation.go``), or a user value would replace the token
KubeRay adds to every Ray container (``common/pod.go``: it adds ``RAY_AUTH_MODE``/``RAY_AUTH_TOKEN``
only when the container does not set them), leaving the cluster open or unable to start."""
OPERATOR_ENV = (
    "HYBRIDFLOW_METRICS_PORT",
    "HYBRIDFLOW_CHECKPOINT_DIR",
    "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S",
)
"""Names the operator sets on every Ray container (``hybridflow_operator.builders.rayjob``): the
controller's port and the stop protocol's settings, which a user value would break."""
RESERVED_ENV = (*(name for name, _ in KUBERAY_REFUSED_ENV), *OPERATOR_ENV)


def _reserved_env(spec: RLHFJobSpec) -> list[str]:
    return [var.name for var in spec.pods.env if var.name in RESERVED_ENV]


def _added_capabilities(spec: RLHFJobSpec) -> list[str]:
    contexts = [pool.container_security_context for pool in spec.resource_pools]
    contexts.append(spec.pods.head_container_security_context)
    return [
        cap for context in contexts if context.capabilities is not None for cap in context.capabilities.add
    ]


def capabilities_rule_cel(allowed: tuple[str, ...]) -> str:
    """The CEL of the capabilities allow-list for ``allowed`` (the chart renders it with its own list)."""
    listed = "[" + ", ".join(f"'{cap}'" for cap in allowed) + "]"
    one = "(!has({c}.capabilities) || {c}.capabilities.add.all(x, x in {listed}))"
    return (
        "self.resourcePools.all(p, "
        + one.format(c="p.containerSecurityContext", listed=listed)
        + ") && "
        + one.format(c="self.pods.headContainerSecurityContext", listed=listed)
    )


def _pools_of_unknown_gpu(spec: RLHFJobSpec) -> list[str]:
    """The pools that say nothing about their GPU type (neither ``gpuType`` nor the product label)."""
    return [
        pool.name
        for pool in spec.resource_pools
        if pool.gpu_type is None and GPU_PRODUCT_LABEL not in pool.node_selector
    ]


IN_CLUSTER_RULES: tuple[CrossFieldRule[RLHFJobSpec], ...] = (
    CrossFieldRule[RLHFJobSpec](
        name="capabilities-from-the-allow-list",
        node_path="spec",
        field_path=".resourcePools",
        cel=capabilities_rule_cel(DEFAULT_ALLOWED_CAPABILITIES),
        message=(
            "containerSecurityContext.capabilities.add (and pods.headContainerSecurityContext's) may only "
            "name capabilities the operator allows (podSecurity.allowedCapabilities of its chart; by "
            "default " + ", ".join(DEFAULT_ALLOWED_CAPABILITIES) + "): creating an RLHFJob must not create "
            "pods its author could not"
        ),
        holds=lambda spec: all(cap in DEFAULT_ALLOWED_CAPABILITIES for cap in _added_capabilities(spec)),
        observed=lambda spec: (
            "added: "
            + quoted_list(
                [cap for cap in _added_capabilities(spec) if cap not in DEFAULT_ALLOWED_CAPABILITIES]
            )
        ),
    ),
    CrossFieldRule[RLHFJobSpec](
        name="kueue-worker-groups",
        node_path="spec",
        field_path=".resourcePools",
        cel=(
            f"!has(self.queueName) || size(self.resourcePools) + ({_SANDBOX_WORKERS_CEL} ? 1 : 0) "
            f"<= {KUEUE_MAX_WORKER_GROUPS}"
        ),
        message=(
            f"may hold at most {KUEUE_MAX_WORKER_GROUPS} pools (5 while spec.agent runs sandbox workers, "
            "whose group is one more) when spec.queueName is set: a Kueue Workload holds one pod set per "
            "worker group plus the head's and the submitter's, at most 8 before Kueue 0.18"
        ),
        holds=lambda spec: spec.queue_name is None or _worker_groups(spec) <= KUEUE_MAX_WORKER_GROUPS,
        observed=lambda spec: (
            f"{len(spec.resource_pools)} pools"
            + (" and the sandbox group" if spec.agent.sandbox_workers else "")
        ),
    ),
    CrossFieldRule[RLHFJobSpec](
        name="kueue-reserved-pool-name",
        node_path="spec",
        field_path=".resourcePools",
        cel=(
            "!has(self.queueName) || self.resourcePools.all(p, "
            + " && ".join(f"p.name != '{name}'" for name in KUEUE_RESERVED_GROUPS)
            + ")"
        ),
        message=(
            f"may not have a pool named {quoted_list(KUEUE_RESERVED_GROUPS)} when spec.queueName is set: "
            "Kueue names the head's and KubeRay's submitter's pod sets so, and a Workload with two pod "
            "sets of one name is refused (the job would never start)"
        ),
        holds=lambda spec: spec.queue_name is None or not _reserved_pool_names(spec),
        observed=lambda spec: (
            f"pool {quoted_list(_reserved_pool_names(spec))} with queueName {spec.queue_name!r}"
        ),
    ),
    CrossFieldRule[RLHFJobSpec](
        name="pods-env-not-kuberays",
        node_path="spec",
        field_path=".pods.env",
        cel=f"self.pods.env.all(e, !(e.name in {list(RESERVED_ENV)}))",
        message=(
            "may not set "
            + "; ".join(f"{name} ({why})" for name, why in KUBERAY_REFUSED_ENV)
            + "; nor "
            + ", ".join(OPERATOR_ENV)
            + " (the operator sets them for the controller's port and its stop)"
        ),
        holds=lambda spec: not _reserved_env(spec),
        observed=lambda spec: quoted_list(_reserved_env(spec)),
    ),
    CrossFieldRule[RLHFJobSpec](
        name="auto-placement-knows-the-gpu",
        node_path="spec",
        field_path=".resourcePools",
        cel=(
            "self.placement != 'auto' || self.resourcePools.all(p, has(p.gpuType) || "
            f"(has(p.nodeSelector) && '{GPU_PRODUCT_LABEL}' in p.nodeSelector))"
        ),
        message=(
            "must say which GPU the planner plans for when spec.placement is auto: set "
            "spec.resourcePools[0].gpuType (one of " + quoted_list(get_args(GpuType)) + ") or a nodeSelector "
            f"on {GPU_PRODUCT_LABEL} (the label NVIDIA GPU feature discovery sets); the controller runs in "
            "the Ray head pod, which has no GPU to look at"
        ),
        holds=lambda spec: spec.placement != "auto" or not _pools_of_unknown_gpu(spec),
        observed=lambda spec: "neither on pool " + quoted_list(_pools_of_unknown_gpu(spec)),
    ),
    CrossFieldRule[RLHFJobSpec](
        name="restarts-need-a-checkpoint-volume",
        node_path="spec",
        field_path=".checkpoint.volume",
        cel="self.maxRestarts == 0 || has(self.checkpoint.volume)",
        message=(
            "is required when spec.maxRestarts > 0 in a cluster: a restarted attempt resumes from the "
            "checkpoints on this claim (without one, every retry starts again from step 0 on a whole "
            "GPU cluster); set it, or set spec.maxRestarts to 0"
        ),
        holds=lambda spec: spec.max_restarts == 0 or spec.checkpoint.volume is not None,
        observed=lambda spec: f"maxRestarts {spec.max_restarts} and no checkpoint volume",
    ),
    CrossFieldRule[RLHFJobSpec](
        name="restarts-need-absolute-paths",
        node_path="spec",
        field_path=".outputDir",
        cel=(
            f"self.maxRestarts == 0 || ({_ABSOLUTE_MODEL_PATHS} && "
            "self.data.trainFiles.all(f, f.startsWith('/')) && self.data.valFiles.all(f, f.startsWith('/')) && "
            "self.outputDir.startsWith('/'))"
        ),
        message=(
            "must be absolute, as must every model path, spec.data.trainFiles and valFiles, when "
            "spec.maxRestarts > 0 "
            "in a cluster: a pod has no manifest directory to resolve them against, and a restarted "
            "attempt must find the same files (mount them with spec.volumes)"
        ),
        holds=lambda spec: spec.max_restarts == 0 or not _relative_paths(spec),
        observed=lambda spec: "relative: " + ", ".join(repr(p) for p in _relative_paths(spec)),
    ),
)
"""Admission rules of a cluster (the CRD); ``hybridflow validate`` reports them too."""


def in_cluster_problems(spec: RLHFJobSpec) -> list[str]:
    """The lines the API server's admission would reject ``spec`` with, in ``hybridflow validate``'s form."""
    return [rule.violation(spec) for rule in IN_CLUSTER_RULES if not rule.holds(spec)]


class ObjectMeta(SpecModel):
    """The parts of Kubernetes object metadata the job uses; server-set fields pass through untouched."""

    model_config = ConfigDict(extra="allow")

    name: str = Field(
        min_length=1,
        max_length=253,
        pattern=DNS_SUBDOMAIN_PATTERN,
        description=(
            "Name of the job, a lowercase RFC 1123 subdomain as the API server requires of every "
            "object; child objects (RayJob, ConfigMap) derive their names from it."
        ),
    )
    namespace: str | None = Field(default=None, description="Namespace of the job in a cluster.")
    labels: dict[str, str] = Field(default_factory=dict, description="Labels of the job.")
    annotations: dict[str, str] = Field(default_factory=dict, description="Annotations of the job.")


class RLHFJob(SpecModel):
    """An RLHFJob manifest: a Kubernetes object whose spec is an :class:`RLHFJobSpec`."""

    api_version: Literal["hybridflow.io/v1alpha1"] = Field(
        default="hybridflow.io/v1alpha1",
        description="Always hybridflow.io/v1alpha1.",
    )
    kind: Literal["RLHFJob"] = Field(default="RLHFJob", description="Always RLHFJob.")
    metadata: ObjectMeta = Field(description="Standard object metadata; only the name is required.")
    spec: RLHFJobSpec = Field(description="Desired state of the job.")

    def to_manifest(self) -> dict[str, Any]:
        """The manifest as plain JSON-compatible data with camelCase keys and unset optionals left out.

        This is the form that travels in the job's ConfigMap and that ``parse_job_manifest``
        reads back into an equal object.
        """
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)
