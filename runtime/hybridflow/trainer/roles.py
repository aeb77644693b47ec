"""From a job spec to resource pools and role placements, and the handle algorithms use."""

from __future__ import annotations

from dataclasses import dataclass

from hybridflow.controller import Deployment, ResourcePool, RoleSpec, WorkerGroup
from hybridflow.spec import CRITIC_ALGORITHMS, RLHFJobSpec
from hybridflow.workers.policy import ActorWorker, ReferenceWorker
from hybridflow.workers.rollout import RolloutWorker
from hybridflow.workers.value import CostModelWorker, CriticWorker, RewardModelWorker

__all__ = ["JobWorkers", "job_roles", "resource_pools"]


def resource_pools(spec: RLHFJobSpec, *, simulated: bool) -> list[ResourcePool]:
    """The spec's pools. Simulated (embedded, CPU) pools reserve a token CPU share per GPU."""
    return [
        ResourcePool(
            p.name,
            nodes=p.nodes,
            gpus_per_node=p.gpus_per_node,
            cpus_per_gpu=0.01 if simulated else float(p.cpus_per_gpu),
        )
        for p in spec.resource_pools
    ]


def job_roles(spec: RLHFJobSpec) -> dict[str, RoleSpec]:
    """Which worker class runs each role, on which pool. The rollout always shares the actor's pool."""
    kwargs = {"spec": spec}
    roles = {
        "actor": RoleSpec(ActorWorker, spec.pool("actor").name, kwargs=kwargs),
        "rollout": RoleSpec(RolloutWorker, spec.pool("actor").name, kwargs=kwargs),
        "reference": RoleSpec(ReferenceWorker, spec.pool("reference").name, kwargs=kwargs),
    }
    if spec.algorithm.name in CRITIC_ALGORITHMS:
        roles["critic"] = RoleSpec(CriticWorker, spec.pool("critic").name, kwargs=kwargs)
    if spec.models.reward is not None:
        roles["reward"] = RoleSpec(RewardModelWorker, spec.pool("reward").name, kwargs=kwargs)
    if spec.models.cost is not None:
        roles["cost"] = RoleSpec(CostModelWorker, spec.pool("cost").name, kwargs=kwargs)
    return roles


@dataclass(frozen=True)
class JobWorkers:
    """The worker groups an algorithm step talks to (critic and reward model when the job has them)."""

    actor: WorkerGroup
    rollout: WorkerGroup
    reference: WorkerGroup
    critic: WorkerGroup | None = None
    reward: WorkerGroup | None = None
    cost: WorkerGroup | None = None

    @classmethod
    def of(cls, deployment: Deployment) -> JobWorkers:
        groups = deployment.groups
        return cls(
            actor=groups["actor"],
            rollout=groups["rollout"],
            reference=groups["reference"],
            critic=groups.get("critic"),
            reward=groups.get("reward"),
            cost=groups.get("cost"),
        )
