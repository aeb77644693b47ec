"""The typed RLHFJob spec: the single source of truth shared by the runtime and the operator.

This package imports only pydantic, PyYAML and the standard library (a test enforces it), so
the operator image, which has no torch or ray, can validate manifests and generate the CRD
from it, and ``hybridflow run`` on a laptop validates the same manifest the same way.

* Models: :class:`RLHFJob` (a manifest) and :class:`RLHFJobSpec` (the config tree) with one
  frozen, camelCase-aliased model per section.
* Loading: :func:`load_job_manifest` (a file; relative paths resolve against its directory)
  and :func:`parse_job_manifest` (data in memory), both raising :class:`SpecError`.
* Cross-field rules: :data:`VALIDATION_RULES`, each a CEL expression for the CRD plus the
  Python check that the models run.
"""

from hybridflow.spec.algorithm import (
    CRITIC_ALGORITHMS,
    GROUP_BASELINE_ALGORITHMS,
    AlgorithmName,
    AlgorithmSpec,
    KLSpec,
)
from hybridflow.spec.data import DataSpec
from hybridflow.spec.errors import SpecError
from hybridflow.spec.evaluation import EvaluationSpec
from hybridflow.spec.job import (
    API_VERSION,
    GROUP,
    IN_CLUSTER_RULES,
    KIND,
    PLURAL,
    VALIDATION_RULES,
    VERSION,
    ObjectMeta,
    RLHFJob,
    RLHFJobSpec,
    in_cluster_problems,
)
from hybridflow.spec.manifest import load_job_manifest, parse_job_manifest, resolve_local_paths
from hybridflow.spec.models import ModelSource, ModelsSpec
from hybridflow.spec.resources import ResourcePoolSpec, RoleName, RolePlacementSpec
from hybridflow.spec.rewards import RewardFunctionSpec
from hybridflow.spec.rollout import ImportanceSamplingSpec, RolloutSpec
from hybridflow.spec.rules import CrossFieldRule
from hybridflow.spec.storage import CheckpointSpec, VolumeClaimMount
from hybridflow.spec.training import TrainingSpec

__all__ = [
    "API_VERSION",
    "CRITIC_ALGORITHMS",
    "GROUP",
    "GROUP_BASELINE_ALGORITHMS",
    "IN_CLUSTER_RULES",
    "KIND",
    "PLURAL",
    "VALIDATION_RULES",
    "VERSION",
    "AlgorithmName",
    "AlgorithmSpec",
    "CheckpointSpec",
    "CrossFieldRule",
    "DataSpec",
    "EvaluationSpec",
    "ImportanceSamplingSpec",
    "KLSpec",
    "ModelSource",
    "ModelsSpec",
    "ObjectMeta",
    "RLHFJob",
    "RLHFJobSpec",
    "ResourcePoolSpec",
    "RewardFunctionSpec",
    "RoleName",
    "RolePlacementSpec",
    "RolloutSpec",
    "SpecError",
    "TrainingSpec",
    "VolumeClaimMount",
    "in_cluster_problems",
    "load_job_manifest",
    "parse_job_manifest",
    "resolve_local_paths",
]
