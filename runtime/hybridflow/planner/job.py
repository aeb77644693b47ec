"""From an RLHFJob spec to the planner's inputs, and from a plan back to a runnable spec (pure).

``workload_from_spec`` reads the models' ``config.json`` (never their weights) and the step's
sizes from the spec. ``apply_plan`` writes a plan into a copy of the spec: the resource pools
(cut from the budget pool, keeping its scheduling fields), the roles, and the parallel sizes
(``spec.training`` ``p``/``t``, ``spec.rollout`` ``t_g``). That is what ``spec.placement: auto``
does before ``hybridflow run`` deploys anything, for the GPU :mod:`hybridflow.planner.gpus` resolves.
"""

from __future__ import annotations

from collections.abc import Sequence

from hybridflow.planner.hardware import ClusterShape, DeviceConstants
from hybridflow.planner.search import PLACEMENT_KINDS, PlacementKind, Plan, plan_job, pool_shape
from hybridflow.planner.shapes import ModelShape, PlannerInputError, Workload, model_shape_from_dir
from hybridflow.spec import CRITIC_ALGORITHMS, RLHFJobSpec
from hybridflow.spec.resources import ResourcePoolSpec, RolePlacementSpec

__all__ = ["apply_plan", "budget_of", "resolve_auto_placement", "workload_from_spec"]


def workload_from_spec(spec: RLHFJobSpec) -> Workload:
    """One step of ``spec`` as the cost model sees it, with this runtime's layout constraints on."""
    models = spec.models

    def shape(source_path: str | None, field: str) -> ModelShape | None:
        return None if source_path is None else model_shape_from_dir(source_path, field=field)

    actor = model_shape_from_dir(models.actor.path, field="spec.models.actor.path")
    critic = (
        shape(models.critic.path if models.critic else None, "spec.models.critic.path")
        if spec.algorithm.name in CRITIC_ALGORITHMS
        else None
    )
    training = spec.training
    return Workload(
        actor=actor,
        critic=critic,
        reward=shape(models.reward.path if models.reward else None, "spec.models.reward.path"),
        cost=shape(models.cost.path if models.cost else None, "spec.models.cost.path"),
        sequences=training.prompts_per_step * spec.algorithm.samples_per_prompt,
        prompt_tokens=spec.data.max_prompt_tokens,
        response_tokens=spec.rollout.max_response_tokens,
        backend=training.backend,
        rollout_engine=spec.rollout.engine,
        param_bytes=2 if training.precision == "bf16" else 4,
        micro_batch_sequences=training.micro_batch_size_per_gpu,
        update_epochs=spec.algorithm.ppo_epochs,
        mini_batch_sequences=training.mini_batch_size,
        shared_model_parallel=True,
        fsdp_unit_min_parameters=training.fsdp_unit_min_parameters,
    )


def budget_of(spec: RLHFJobSpec) -> tuple[ResourcePoolSpec, ClusterShape]:
    """The one pool of an auto-placed spec, which is the GPU budget and the node shape."""
    if len(spec.resource_pools) != 1:
        names = ", ".join(p.name for p in spec.resource_pools)
        raise PlannerInputError(
            f"spec.resourcePools: placement auto needs exactly one pool (the GPU budget), got {names}"
        )
    pool = spec.resource_pools[0]
    return pool, ClusterShape(pool.world_size, pool.gpus_per_node)


def apply_plan(spec: RLHFJobSpec, plan: Plan) -> RLHFJobSpec:
    """``spec`` with the pools, roles and parallel sizes of ``plan`` (see the module docstring).

    Pools are named after the budget pool: the pool itself when everything is colocated, else
    ``<pool>-<first role>`` for each pool of the plan. The rollout always shares the actor's pool.
    """
    budget, cluster = budget_of(spec)
    pools: list[ResourcePoolSpec] = []
    pool_of: dict[str, str] = {}
    for pool in plan.pools:
        name = budget.name if len(plan.pools) == 1 else f"{budget.name}-{pool.roles[0]}"[:63].rstrip("-")
        nodes, per_node = pool_shape(pool.gpus, cluster)
        pools.append(budget.model_copy(update={"name": name, "nodes": nodes, "gpus_per_node": per_node}))
        for role in pool.roles:
            pool_of[role] = name
    actor = plan.layout_of("actor")
    roles = RolePlacementSpec(
        actor=pool_of["actor"],
        reference=pool_of["reference"] if pool_of["reference"] != pool_of["actor"] else None,
        critic=_elsewhere(pool_of, "critic"),
        reward=_elsewhere(pool_of, "reward"),
        cost=_elsewhere(pool_of, "cost"),
    )
    training = spec.training.model_copy(
        update={"tensor_parallel_size": actor.tp, "pipeline_parallel_size": actor.pp}
    )
    rollout = spec.rollout.model_copy(
        update={"tensor_parallel_size": actor.generation_tp or 1, "pipeline_parallel_size": 1}
    )
    document = spec.model_dump(by_alias=False)
    document.update(
        resource_pools=tuple(p.model_dump() for p in pools),
        roles=roles.model_dump(),
        training=training.model_dump(),
        rollout=rollout.model_dump(),
        placement="manual",
    )
    return RLHFJobSpec.model_validate(document)


def _elsewhere(pool_of: dict[str, str], role: str) -> str | None:
    name = pool_of.get(role)
    return None if name is None or name == pool_of["actor"] else name


def resolve_auto_placement(
    spec: RLHFJobSpec, device: DeviceConstants, *, kinds: Sequence[PlacementKind] = PLACEMENT_KINDS
) -> tuple[RLHFJobSpec, Plan]:
    """The runnable spec of an auto-placed job, and the plan it follows (the fastest estimated)."""
    _, cluster = budget_of(spec)
    best = plan_job(workload_from_spec(spec), cluster, device, kinds=kinds)[0]
    return apply_plan(spec, best), best
