"""From a job spec to resource pools and role placements, and the handle algorithms use."""

from __future__ import annotations

from hybridflow.algorithms.api import JobWorkers, needs_reference
from hybridflow.controller import BridgeSpec, DeviceMesh, ResourcePool, RoleSpec, Worker
from hybridflow.host import available_cores
from hybridflow.spec import RLHFJobSpec, RoleName
from hybridflow.workers.policy import ActorWorker, ReferenceWorker
from hybridflow.workers.rollout import RolloutWorker
from hybridflow.workers.value import CostCriticWorker, CostModelWorker, CriticWorker, RewardModelWorker
from hybridflow.workers.weight_push import WEIGHTS_BRIDGE

__all__ = [
    "JobWorkers",
    "job_bridges",
    "job_roles",
    "resource_pools",
    "uses_hybrid_engine",
    "uses_sharded_vllm",
]


def resource_pools(spec: RLHFJobSpec, *, simulated: bool) -> list[ResourcePool]:
    """The spec's pools.

    Simulated (embedded, CPU) pools reserve a token CPU share per GPU with Ray but give each
    worker process its share of this machine's cores as torch threads: 2 simulated GPUs on 2
    cores run one thread each (no oversubscription), 1 simulated GPU gets both cores.
    """
    simulated_gpus = sum(p.nodes * p.gpus_per_node for p in spec.resource_pools)
    threads = max(1, available_cores() // max(1, simulated_gpus))
    return [
        ResourcePool(
            p.name,
            nodes=p.nodes,
            gpus_per_node=p.gpus_per_node,
            cpus_per_gpu=0.01 if simulated else float(p.cpus_per_gpu),
            torch_threads=threads if simulated else None,
        )
        for p in spec.resource_pools
    ]


def uses_hybrid_engine(spec: RLHFJobSpec) -> bool:
    """Whether the rollout reshards the actor's model-parallel shards (megatron with ``t*p > 1``).

    Otherwise the rollout loads the actor's full weights bucket by bucket into its own engine.
    """
    training = spec.training
    return (
        training.backend == "megatron" and training.tensor_parallel_size * training.pipeline_parallel_size > 1
    )


def uses_sharded_vllm(spec: RLHFJobSpec) -> bool:
    """Whether a colocated vLLM rollout receives per-rank shards (:mod:`hybridflow.workers.vllm_rollout`).

    With ``rollout.tensorParallelSize > 1``, or a megatron actor with ``t*p > 1`` (whose ranks
    hold no full weights to load). Otherwise a vLLM rollout loads the actor's full weights.
    """
    return (
        spec.rollout.engine == "vllm"
        and not spec.rollout_has_own_pool
        and (spec.rollout.tensor_parallel_size > 1 or uses_hybrid_engine(spec))
    )


def _pool_size(spec: RLHFJobSpec, role: RoleName) -> int:
    pool = spec.pool(role)
    return pool.nodes * pool.gpus_per_node


def job_roles(spec: RLHFJobSpec) -> dict[str, RoleSpec]:
    """Which worker class runs each role, on which pool, with which mesh.

    The rollout shares the actor's pool unless ``spec.roles.rollout`` names another; there it
    generates with the whole model on every rank (the spec allows no other layout) and receives
    the weights over the bridge of :func:`job_bridges`. The reference is deployed only when a KL term
    reads it (``kl.coef > 0``), and not with ``spec.training.lora``, where the actor's base model
    (its adapter switched off) is the reference. With ``spec.training.backend: megatron`` the
    actor, reference and critic train/score under ``DeviceMesh.training(pp, tp)`` of their pools, and
    (``t*p > 1``) the rollout generates under the HybridFlow generation mesh derived from the
    actor's. The actor, reference and critic classes are the same for every backend (they look
    ``spec.training.backend`` up in :func:`hybridflow.backends.api.training_backend`, which imports
    only that backend: megatron-core is not installed everywhere FSDP runs); only the meshes differ.

    With FSDP and ``spec.training.sequenceParallelSize`` ``P > 1``, the actor and the reference
    run under ``DeviceMesh.training(world, tp=P)``: its ``tp`` axis holds the Ulysses groups
    (ranks ``k*P .. k*P+P-1``, the groups the FSDP backend builds from the same mesh), so
    ``DP_SPLIT`` hands the ``P`` ranks of a group the same rows and collects from the first of
    them, and the workers' data-parallel size is ``world / P``. Every other role stays pure DP.
    """
    kwargs = {"spec": spec}
    training = spec.training
    rollout_cls: type[Worker] = RolloutWorker
    actor_mesh = reference_mesh = rollout_mesh = critic_mesh = None
    if training.backend == "megatron":
        pp, tp = training.pipeline_parallel_size, training.tensor_parallel_size
        actor_mesh = DeviceMesh.training(_pool_size(spec, "actor"), pp=pp, tp=tp)
        reference_mesh = DeviceMesh.training(_pool_size(spec, "reference"), pp=pp, tp=tp)
        if spec.models.critic is not None:
            critic_mesh = DeviceMesh.training(_pool_size(spec, "critic"), pp=pp, tp=tp)
        if uses_sharded_vllm(spec):
            from hybridflow.workers.vllm_rollout import ShardedVLLMRolloutWorker

            rollout_cls = ShardedVLLMRolloutWorker
            rollout_mesh = DeviceMesh.generation(actor_mesh, pp=1, tp=spec.rollout.tensor_parallel_size)
        elif uses_hybrid_engine(spec):
            from hybridflow.workers.hybrid_rollout import HybridRolloutWorker

            rollout_cls = HybridRolloutWorker
            rollout_mesh = DeviceMesh.generation(
                actor_mesh, pp=spec.rollout.pipeline_parallel_size, tp=spec.rollout.tensor_parallel_size
            )
    else:
        if training.sequence_parallel_size > 1:
            sp = training.sequence_parallel_size
            actor_mesh = DeviceMesh.training(_pool_size(spec, "actor"), tp=sp)
            reference_mesh = DeviceMesh.training(_pool_size(spec, "reference"), tp=sp)
        if uses_sharded_vllm(spec):
            from hybridflow.workers.vllm_rollout import ShardedVLLMRolloutWorker

            rollout_cls = ShardedVLLMRolloutWorker
            rollout_mesh = DeviceMesh.fsdp_generation(
                _pool_size(spec, "actor"), tp=spec.rollout.tensor_parallel_size
            )
    actor_pool = spec.pool("actor").name
    roles = {"actor": RoleSpec(ActorWorker, actor_pool, mesh=actor_mesh, kwargs=kwargs)}
    if spec.rollout.mode == "batch":  # server mode: replicas of the rollout service (hybridflow.rollout)
        roles["rollout"] = RoleSpec(rollout_cls, spec.pool("rollout").name, mesh=rollout_mesh, kwargs=kwargs)
    if needs_reference(spec) and spec.training.lora is None:  # with LoRA the actor's base is the reference
        roles["reference"] = RoleSpec(
            ReferenceWorker, spec.pool("reference").name, mesh=reference_mesh, kwargs=kwargs
        )
    if spec.models.critic is not None:
        roles["critic"] = RoleSpec(CriticWorker, spec.pool("critic").name, mesh=critic_mesh, kwargs=kwargs)
    if spec.models.reward is not None:
        roles["reward"] = RoleSpec(RewardModelWorker, spec.pool("reward").name, kwargs=kwargs)
    if spec.models.cost is not None:
        roles["cost"] = RoleSpec(CostModelWorker, spec.pool("cost").name, kwargs=kwargs)
        if spec.algorithm.name == "safe-rlhf":
            # The cost critic lives with the reward critic (FSDP whatever the backend: a small
            # second value model, data parallel over the critic's pool).
            roles["cost_critic"] = RoleSpec(CostCriticWorker, spec.pool("critic").name, kwargs=kwargs)
    return roles


def job_bridges(spec: RLHFJobSpec) -> tuple[BridgeSpec, ...]:
    """The collective groups across pools the job needs: actor -> rollout when the rollout has its own pool.

    Not in server mode, whose service builds the bridge to its replicas itself (and again when
    one is replaced: ``hybridflow.rollout.service``).
    """
    if not spec.rollout_has_own_pool or spec.rollout.mode == "server":
        return ()
    return (BridgeSpec(WEIGHTS_BRIDGE, "actor", "rollout"),)
