"""Placements, their parallel sizes, and the best plans by estimated step time (pure).

Placements (HybridFlow Sec. 8.3):

* ``colocate``: every model on all GPUs (one pool);
* ``split``: actor (with rollout and reference) on one pool, critic and reward/cost models on
  the other; only for jobs that have a critic or a reward/cost model;
* ``standalone``: every model on its own pool.

The rollout always shares the actor's GPUs (resharded in place), so it is not placed separately.
Pools are cut at node boundaries: a pool is a whole number of nodes, or part of one node that
it shares with other part-node pools.

The step the cost model times (the order the algorithms run in): reshard the actor to its
generation layout; generate on the actor's pool; score (actor and reference log-probs, critic
values, reward/cost scores), pools in parallel and the models of one pool one after another;
train the actor and the critic, pools in parallel. Each pool is costed on its own: for each
pool the search takes the layouts of its models that minimise the pool's busy time and fit in
memory together. ``compute_slots`` (simulated GPUs on a CPU) stretches a phase by the share of
cores its pool gets while other pools compute at the same time, and prices its collectives by
how oversubscribed the cores are (``DeviceConstants.contention``, ``collective_latency``).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from hybridflow.planner.cost import (
    GenerationEstimate,
    ModelMemory,
    forward_collectives,
    forward_seconds,
    generation_estimate,
    model_memory,
    reshard_bytes,
    reshard_collectives,
    reshard_seconds,
    train_collectives,
    train_seconds,
)
from hybridflow.planner.hardware import ClusterShape, DeviceConstants
from hybridflow.planner.parallel import ModelLayoutChoice, generation_tensor_sizes, training_layouts
from hybridflow.planner.shapes import ModelRole, PlannerInputError, Workload

__all__ = [
    "PLACEMENT_KINDS",
    "Placement",
    "PlacementKind",
    "Plan",
    "PoolPlan",
    "placements",
    "plan_job",
    "pool_shape",
]

PlacementKind = Literal["colocate", "split", "standalone"]
PLACEMENT_KINDS: tuple[PlacementKind, ...] = ("colocate", "split", "standalone")

CANDIDATES_PER_MODEL = 4
"""Layouts kept per model and pool when combining colocated models: the fastest and the leanest."""


@dataclass(frozen=True)
class Placement:
    """Which models share which GPUs: ``pools[i] = (roles, gpus)``."""

    kind: PlacementKind
    pools: tuple[tuple[tuple[ModelRole, ...], int], ...]

    def describe(self) -> str:
        return " | ".join(f"{'+'.join(roles)}:{gpus}" for roles, gpus in self.pools)


@dataclass(frozen=True)
class PoolPlan:
    """One pool of a plan: its GPUs, each model's layout, its busy seconds per phase and its peak memory."""

    roles: tuple[ModelRole, ...]
    gpus: int
    layouts: dict[ModelRole, ModelLayoutChoice]
    generate_seconds: float
    score_seconds: float
    train_seconds: float
    peak_memory_bytes: float
    generation: GenerationEstimate | None = None
    collectives: tuple[int, int, int] = (0, 0, 0)
    """Latency-bound collectives in ``generate``, ``score`` and ``train`` (costed at
    ``collective_latency_seconds`` here; :func:`_combine` re-prices them under contention)."""

    @property
    def busy_seconds(self) -> float:
        return self.generate_seconds + self.score_seconds + self.train_seconds


@dataclass(frozen=True)
class Plan:
    """A placement with parallel sizes and the cost model's estimates; plans sort by ``step_seconds``."""

    placement: Placement
    pools: tuple[PoolPlan, ...]
    step_seconds: float
    phase_seconds: dict[str, float]
    tokens_per_second: float
    reshard_bytes_per_gpu: int
    idle_fraction: tuple[float, ...] = field(default=())

    def layout_of(self, role: ModelRole) -> ModelLayoutChoice:
        for pool in self.pools:
            if role in pool.layouts:
                return pool.layouts[role]
        raise KeyError(role)

    def pool_index_of(self, role: ModelRole) -> int:
        return next(i for i, pool in enumerate(self.pools) if role in pool.roles)


def _pool_sizes_fit(sizes: Sequence[int], cluster: ClusterShape) -> bool:
    """Whole-node pools plus part-node pools packed first-fit-decreasing into the remaining nodes."""
    g = cluster.node_gpus
    whole = [s for s in sizes if s % g == 0]
    part = sorted((s for s in sizes if s % g), reverse=True)
    if any(s > g for s in part):
        return False
    free_nodes = (cluster.gpus - sum(whole)) // g if cluster.gpus >= g else 1
    bins: list[int] = []
    for size in part:
        for i, used in enumerate(bins):
            if used + size <= g:
                bins[i] += size
                break
        else:
            bins.append(size)
    return len(bins) <= free_nodes and sum(sizes) == cluster.gpus


def _compositions(total: int, parts: int) -> list[tuple[int, ...]]:
    if parts == 1:
        return [(total,)]
    return [(first, *rest) for first in range(1, total) for rest in _compositions(total - first, parts - 1)]


def placements(workload: Workload, cluster: ClusterShape) -> list[Placement]:
    """Every placement of the workload's models on the cluster (see the module docstring)."""
    roles: tuple[ModelRole, ...] = tuple(workload.models())
    found = [Placement("colocate", ((roles, cluster.gpus),))]
    groups: list[tuple[PlacementKind, tuple[tuple[ModelRole, ...], ...]]] = []
    others = tuple(r for r in roles if r not in ("actor", "reference"))
    if others:
        groups.append(("split", (("actor", "reference"), others)))
    if len(roles) > 1:
        groups.append(("standalone", tuple((r,) for r in roles)))
    for kind, members in groups:
        if len(members) > cluster.gpus:
            continue
        for sizes in _compositions(cluster.gpus, len(members)):
            if _pool_sizes_fit(sizes, cluster):
                found.append(Placement(kind, tuple(zip(members, sizes, strict=True))))
    return found


@dataclass(frozen=True)
class _Candidate:
    layout: ModelLayoutChoice
    forward_seconds: float
    train_seconds: float
    memory: ModelMemory
    reshard_seconds: float = 0.0
    forward_collectives: int = 0
    train_collectives: int = 0
    reshard_collectives: int = 0

    @property
    def seconds(self) -> float:
        return self.forward_seconds + self.train_seconds


ModelParallel = tuple[int, int]
"""``(p, t)`` shared by the actor, reference and critic when ``Workload.shared_model_parallel``."""


def _allowed(
    role: ModelRole, layout: ModelLayoutChoice, workload: Workload, shared: ModelParallel | None
) -> bool:
    if shared is not None:
        wanted = shared if role in ("actor", "reference", "critic") else (1, 1)
        if (layout.pp, layout.tp) != wanted:
            return False
    mini = workload.mini_batch_sequences
    split = workload.micro_batch_sequences * layout.dp
    return not (mini is not None and Workload.trains(role) and (mini % split or workload.sequences % split))


def _model_candidates(
    role: ModelRole,
    gpus: int,
    workload: Workload,
    cluster: ClusterShape,
    device: DeviceConstants,
    shared: ModelParallel | None,
) -> list[_Candidate]:
    model = workload.models()[role]
    trains = Workload.trains(role)
    found = []
    for layout in training_layouts(model, gpus, cluster.node_gpus, workload):
        if not _allowed(role, layout, workload, shared):
            continue
        memory = model_memory(model, layout, workload, trains=trains)
        if memory.static + max(memory.train_activations, memory.forward_activations) + memory.gradients > (
            device.usable_memory_bytes
        ):
            continue
        forward = forward_seconds(model, layout, workload, device)
        train = train_seconds(model, layout, workload, device, cluster.node_gpus) if trains else 0.0
        counts = {
            "forward_collectives": forward_collectives(model, layout, workload),
            "train_collectives": train_collectives(model, layout, workload) if trains else 0,
        }
        if role != "actor":
            found.append(_Candidate(layout, forward, train, memory, **counts))
            continue
        for t_g in generation_tensor_sizes(model, layout, cluster.node_gpus, workload):
            choice = ModelLayoutChoice(layout.pp, layout.tp, layout.dp, t_g)
            reshard = reshard_seconds(model, choice, workload, device, cluster.node_gpus)
            gathers = reshard_collectives(model, choice, workload)
            found.append(
                _Candidate(choice, forward, train, memory, reshard, **counts, reshard_collectives=gathers)
            )
    return found


def _shortlist(candidates: list[_Candidate]) -> list[_Candidate]:
    fastest = sorted(candidates, key=lambda c: c.seconds)[:CANDIDATES_PER_MODEL]
    leanest = sorted(candidates, key=lambda c: c.memory.static)[:CANDIDATES_PER_MODEL]
    return list(dict.fromkeys([*fastest, *leanest]))


def _cost_pool(
    roles: tuple[ModelRole, ...],
    gpus: int,
    workload: Workload,
    cluster: ClusterShape,
    device: DeviceConstants,
    shared: ModelParallel | None,
) -> PoolPlan | None:
    """The fastest combination of layouts for the models of one pool that fits in memory, or ``None``."""
    options: list[list[_Candidate]] = []
    for role in roles:
        candidates = _model_candidates(role, gpus, workload, cluster, device, shared)
        if role != "actor":
            candidates = _shortlist(candidates)
        if not candidates:
            return None
        options.append(candidates)
    models = workload.models()
    best: PoolPlan | None = None
    for combo in itertools.product(*options):
        chosen = dict(zip(roles, combo, strict=True))
        static = sum(c.memory.static for c in combo)
        peak_work = max(
            c.memory.gradients + max(c.memory.train_activations, c.memory.forward_activations) for c in combo
        )
        peak = static + peak_work
        if peak > device.usable_memory_bytes:
            continue
        generation = None
        generate = 0.0
        generate_collectives = 0
        if "actor" in chosen:
            actor = chosen["actor"]
            gen_budget = device.usable_memory_bytes - (static - actor.memory.weights)
            generation = generation_estimate(
                models["actor"], actor.layout, workload, device, kv_budget_bytes_per_gpu=gen_budget
            )
            if generation is None:
                continue
            generate = generation.seconds + actor.reshard_seconds
            generate_collectives = generation.collectives + actor.reshard_collectives
            peak = max(
                peak,
                static
                - actor.memory.weights
                + generation.weights_bytes_per_gpu
                + generation.kv_bytes_per_gpu,
            )
        score = sum(c.forward_seconds for c in combo)
        train = sum(c.train_seconds for c in combo)
        collectives = (
            generate_collectives,
            sum(c.forward_collectives for c in combo),
            sum(c.train_collectives for c in combo),
        )
        pool = PoolPlan(
            roles,
            gpus,
            {r: c.layout for r, c in chosen.items()},
            generate,
            score,
            train,
            peak,
            generation,
            collectives,
        )
        if best is None or pool.busy_seconds < best.busy_seconds:
            best = pool
    return best


def _combine(
    placement: Placement, pools: list[PoolPlan], workload: Workload, device: DeviceConstants
) -> Plan:
    """The step of ``pools``: each phase on every pool taking part, stretched by what runs beside it.

    With simulated GPUs the pools of a phase share the host's cores: its compute and fixed
    costs stretch by ``device.contention(busy)`` and its collectives cost
    ``device.collective_latency(busy)``, where ``busy`` counts the GPUs of every pool in that
    phase. Real GPUs do not change.
    """
    actor_pool = next(pool for pool in pools if "actor" in pool.roles)
    generating = [actor_pool.gpus]
    scoring = [p.gpus for p in pools if p.score_seconds > 0]
    training = [p.gpus for p in pools if p.train_seconds > 0]

    def stretched(seconds: float, collectives: int, busy: Sequence[int]) -> float:
        latency = collectives * device.collective_latency_seconds
        busy_gpus = sum(busy)
        return (seconds - latency) * device.contention(busy_gpus) + collectives * device.collective_latency(
            busy_gpus
        )

    phases = [
        [
            stretched(p.generate_seconds, p.collectives[0], generating) if p is actor_pool else 0.0
            for p in pools
        ],
        [stretched(p.score_seconds, p.collectives[1], scoring) for p in pools],
        [stretched(p.train_seconds, p.collectives[2], training) for p in pools],
    ]
    generate, score, train = (max(per_pool, default=0.0) for per_pool in phases)
    step = generate + score + train
    busy = [sum(phase[i] for phase in phases) for i in range(len(pools))]
    actor = actor_pool.layouts["actor"]
    return Plan(
        placement=placement,
        pools=tuple(pools),
        step_seconds=step,
        phase_seconds={"generate": generate, "score": score, "train": train},
        tokens_per_second=workload.tokens / step,
        reshard_bytes_per_gpu=reshard_bytes(workload.actor, actor, workload),
        idle_fraction=tuple(max(0.0, 1.0 - b / step) for b in busy),
    )


def plan_job(
    workload: Workload,
    cluster: ClusterShape,
    device: DeviceConstants,
    *,
    kinds: Sequence[PlacementKind] = PLACEMENT_KINDS,
) -> list[Plan]:
    """Every feasible plan, fastest first; raises :class:`PlannerInputError` when nothing fits."""
    device = device.for_budget(cluster.gpus)
    plans = []
    shared_options: Sequence[ModelParallel | None] = [None]
    if workload.shared_model_parallel:
        shared_options = sorted(
            {
                (c.pp, c.tp)
                for c in training_layouts(workload.actor, cluster.gpus, cluster.node_gpus, workload)
            }
        )
    cache: dict[tuple[tuple[ModelRole, ...], int, ModelParallel | None], PoolPlan | None] = {}
    for shared in shared_options:
        for placement in placements(workload, cluster):
            if placement.kind not in kinds:
                continue
            pools = []
            for roles, gpus in placement.pools:
                key = (roles, gpus, shared)
                if key not in cache:
                    cache[key] = _cost_pool(roles, gpus, workload, cluster, device, shared)
                pool = cache[key]
                if pool is None:
                    break
                pools.append(pool)
            else:
                plans.append(_combine(placement, pools, workload, device))
    if not plans:
        raise PlannerInputError(
            f"no placement of {', '.join(workload.models())} fits {cluster.gpus} GPUs of "
            f"{device.memory_bytes / 1e9:.0f} GB ({device.name}){_constraints(workload)}; add GPUs or shrink the "
            "models or the batch"
        )
    return sorted(plans, key=lambda plan: (plan.step_seconds, plan.placement.describe()))


def _constraints(workload: Workload) -> str:
    if workload.mini_batch_sequences is None:
        return ""
    return (
        f" with miniBatchSize {workload.mini_batch_sequences} and the step's {workload.sequences} "
        f"sequences in whole micro-batches of {workload.micro_batch_sequences} on every "
        "data-parallel rank of the actor and critic"
    )


def pool_shape(gpus: int, cluster: ClusterShape) -> tuple[int, int]:
    """``(nodes, gpusPerNode)`` of a pool of ``gpus`` GPUs: whole nodes, or a part of one node."""
    g = cluster.node_gpus
    if gpus % g == 0:
        return gpus // g, g
    return 1, gpus
