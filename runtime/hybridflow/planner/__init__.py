"""The placement planner: which GPUs each model gets and with which parallel sizes.

* :mod:`~hybridflow.planner.shapes`: the models and one RL step's work (:class:`Workload`).
* :mod:`~hybridflow.planner.hardware`: the GPU budget and the device constants, with sources.
* :mod:`~hybridflow.planner.gpus`: the known GPUs' constants, recognising one by name, and which
  GPU a job is planned for (``gpuType``, the product label, the local CUDA device).
* :mod:`~hybridflow.planner.parallel`: valid training ``p-t-d`` and generation ``t_g`` per model.
* :mod:`~hybridflow.planner.cost`: seconds and bytes per GPU of each phase.
* :mod:`~hybridflow.planner.search`: placements, the best layouts per pool, plans by step time.
* :mod:`~hybridflow.planner.job`: from an RLHFJob spec to a workload, and a plan back into the spec.
* :mod:`~hybridflow.planner.calibrate`: ``--profile``, constants measured on this machine (torch).

Everything but ``calibrate`` is arithmetic; ``docs/placement.md`` explains the model and how to
read ``hybridflow plan``.
"""

from hybridflow.planner.hardware import A100_80GB, ClusterShape, DeviceConstants
from hybridflow.planner.parallel import ModelLayoutChoice
from hybridflow.planner.search import (
    PLACEMENT_KINDS,
    Placement,
    PlacementKind,
    Plan,
    PoolPlan,
    placements,
    plan_job,
)
from hybridflow.planner.shapes import PAPER_MODELS, ModelShape, PlannerInputError, Workload

__all__ = [
    "A100_80GB",
    "PAPER_MODELS",
    "PLACEMENT_KINDS",
    "ClusterShape",
    "DeviceConstants",
    "ModelLayoutChoice",
    "ModelShape",
    "Placement",
    "PlacementKind",
    "Plan",
    "PlannerInputError",
    "PoolPlan",
    "Workload",
    "placements",
    "plan_job",
]
