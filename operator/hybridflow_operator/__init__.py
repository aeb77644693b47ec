"""The kopf operator that reconciles ``RLHFJob`` (hybridflow.io/v1alpha1) into KubeRay RayJobs.

It imports neither torch, ray nor vllm: the operator image installs only the base dependencies.
"""

__version__ = "0.1.0"
