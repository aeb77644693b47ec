"""Training metrics: JSONL and TensorBoard files in the output directory, and the progress line."""

from hybridflow.metrics.writer import MetricsWriter, format_progress

__all__ = ["MetricsWriter", "format_progress"]
