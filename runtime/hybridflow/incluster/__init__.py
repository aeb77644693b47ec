"""What the controller does when it runs as a KubeRay RayJob entrypoint: /metrics and status pushes."""

from hybridflow.incluster.metrics import TrainingMetricsExporter
from hybridflow.incluster.status import StatusPusher, placement_status, progress_status

__all__ = ["StatusPusher", "TrainingMetricsExporter", "placement_status", "progress_status"]
