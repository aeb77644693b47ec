"""Training metrics: the catalogue of names, JSONL and TensorBoard files, derived figures, the progress line."""

from hybridflow.metrics.catalogue import TRAINING_METRICS, MetricDefinition
from hybridflow.metrics.writer import MetricsWriter, progress_line, weight_sync_line

__all__ = ["TRAINING_METRICS", "MetricDefinition", "MetricsWriter", "progress_line", "weight_sync_line"]
