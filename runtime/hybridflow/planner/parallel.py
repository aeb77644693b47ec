"""Valid parallel sizes of one model on one pool (pure).

A training layout ``p-t-d`` is valid on a pool of ``n`` GPUs when ``p*t*d == n``, the
tensor-parallel group fits in one node (``t`` divides the GPUs per node: TP all-reduces every
layer and needs NVLink), and the model splits evenly: ``p`` divides the layers and every
partitioned parameter splits ``t`` ways into whole heads. That last check is
:meth:`ModelLayout.check`, the same one the resharding plan and the Megatron backend obey, so a
layout the planner proposes is one the runtime can run. The FSDP backend shards by data
parallelism only (``p = t = 1``).

The actor also generates, with tensor parallelism ``t_g`` dividing ``t`` (and pipeline
``p_g = 1``): the 3D-HybridEngine's generation layout ``1-t_g-d_g-d`` with the micro-DP group
``d_g = p*t/t_g`` (see ``docs/hybrid-engine.md``).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from hybridflow.planner.shapes import ModelShape, Workload
from hybridflow.resharding.layout import ReshardingError

__all__ = ["ModelLayoutChoice", "generation_tensor_sizes", "training_layouts"]


@dataclass(frozen=True)
class ModelLayoutChoice:
    """One model's parallel sizes on its pool: training ``p-t-d`` and, for the actor, generation ``t_g``."""

    pp: int
    tp: int
    dp: int
    generation_tp: int | None = None

    @property
    def world_size(self) -> int:
        return self.pp * self.tp * self.dp

    def describe(self) -> str:
        text = f"p{self.pp}-t{self.tp}-d{self.dp}"
        return text if self.generation_tp is None else f"{text} gen-t{self.generation_tp}"


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def training_layouts(
    model: ModelShape, gpus: int, gpus_per_node: int, workload: Workload
) -> tuple[ModelLayoutChoice, ...]:
    """Every valid training layout of ``model`` on ``gpus`` GPUs (see the module docstring)."""
    if workload.backend == "fsdp":
        return (ModelLayoutChoice(1, 1, gpus),)
    return _megatron_layouts(model, gpus, gpus_per_node)


@lru_cache(maxsize=1024)
def _megatron_layouts(model: ModelShape, gpus: int, gpus_per_node: int) -> tuple[ModelLayoutChoice, ...]:
    layout = model.layout(1)
    found = []
    for tp in _divisors(min(gpus, gpus_per_node)):
        if gpus_per_node % tp or gpus % tp:
            continue
        for pp in _divisors(gpus // tp):
            try:
                layout.check(pp, tp)
            except ReshardingError:
                continue
            found.append(ModelLayoutChoice(pp, tp, gpus // (pp * tp)))
    return tuple(found)


def generation_tensor_sizes(
    model: ModelShape, train: ModelLayoutChoice, gpus_per_node: int, workload: Workload
) -> list[int]:
    """Generation TP sizes the actor's engine can reshard to from ``train`` (the module docstring).

    Megatron (either engine): the divisors of ``t``, the 3D-HybridEngine's layouts (vLLM builds
    its TP groups from their ranks). torch on FSDP: ``t = 1``. vLLM on FSDP: the divisors of the
    pool's GPUs that divide the node and split the model into whole heads.
    """
    if workload.rollout_engine == "torch" or workload.backend == "megatron":
        return _divisors(train.tp)
    return [t_g for t_g in _divisors(train.world_size) if gpus_per_node % t_g == 0 and _splits(model, t_g)]


def _splits(model: ModelShape, t_g: int) -> bool:
    try:
        model.layout(1).check(1, t_g)
    except ReshardingError:
        return False
    return True
