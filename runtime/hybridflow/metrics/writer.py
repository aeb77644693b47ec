"""Metrics sinks. ``metrics.jsonl`` (one object per step) is the record tests and tools read;
TensorBoard event files under ``tensorboard/`` are for people. Both use the step-report keys
as they are (``reward/mean``); ``catalogue.py`` says what each key means and its Prometheus name."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hybridflow.metrics.step_report import StepReport

__all__ = ["MetricsWriter", "progress_line"]


class MetricsWriter:
    def __init__(self, output_dir: str | os.PathLike[str]) -> None:
        self.output_dir = Path(output_dir)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl_path = self.output_dir / "metrics.jsonl"
        from torch.utils.tensorboard import SummaryWriter

        self._tensorboard = SummaryWriter(log_dir=str(self.output_dir / "tensorboard"))

    def write(self, step: int, metrics: dict[str, float]) -> None:
        record: dict[str, Any] = {"step": step, **metrics}
        with open(self.jsonl_path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record, sort_keys=True) + "\n")
        for name, value in metrics.items():
            if isinstance(value, int | float) and math.isfinite(value):
                self._tensorboard.add_scalar(name, value, step)
        self._tensorboard.flush()

    def truncate_after(self, step: int) -> None:
        """Drop records past ``step`` (a resumed run rewrites the steps after its checkpoint)."""
        if not self.jsonl_path.exists():
            return
        kept = [
            line
            for line in self.jsonl_path.read_text(encoding="utf-8").splitlines()
            if line.strip() and json.loads(line)["step"] <= step
        ]
        self.jsonl_path.write_text("".join(line + "\n" for line in kept), encoding="utf-8")

    def close(self) -> None:
        self._tensorboard.close()


def progress_line(report: StepReport) -> str:
    """The plain progress line of a step (logs, CI, pods; a terminal gets a live bar instead)."""
    eta = f"{int(report.eta_seconds // 60)}m{int(report.eta_seconds % 60):02d}s"
    metrics = report.metrics
    # A job with no KL term (kl.coef 0) has no reference model: no "kl nan" in its line.
    kl = f"| kl {metrics['kl/actor_ref']:.4f} " if "kl/actor_ref" in metrics else ""
    return (
        f"step {report.step}/{report.total_steps} | reward {metrics.get('reward/mean', float('nan')):.3f} "
        f"{kl}| {metrics.get('perf/tokens_per_second', 0.0):.0f} tok/s | ETA {eta}"
    )
