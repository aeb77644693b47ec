"""How ``hybridflow run`` shows progress: a live bar on a terminal, plain lines anywhere else.

The runner hands two kinds of output to the display: informational lines (``line``: data
loaded, resumed from a checkpoint) and a :class:`StepReport` after every step (``update``).
On a terminal, lines print above a rich progress bar that shows step/total, reward, KL,
tokens/s and the runner's ETA; when stdout is not a terminal (CI, a pod's log) each step is
one :func:`progress_line`, which is what log collectors and ``grep`` want.
"""

from __future__ import annotations

import math
from types import TracebackType
from typing import TYPE_CHECKING, TextIO

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn

from hybridflow.metrics.writer import progress_line

if TYPE_CHECKING:
    from hybridflow.metrics.step_report import StepReport

__all__ = ["ProgressDisplay"]


def _figure(value: float | None, digits: int) -> str:
    return "-" if value is None or not math.isfinite(value) else f"{value:.{digits}f}"


class ProgressDisplay:
    """A context manager; ``live=None`` decides from whether ``stream`` is a terminal."""

    def __init__(self, stream: TextIO, *, total_steps: int, live: bool | None = None) -> None:
        self.stream = stream
        self.live = stream.isatty() if live is None else live
        self._progress: Progress | None = None
        self._task: TaskID | None = None
        if self.live:
            self._progress = Progress(
                TextColumn("step"),
                MofNCompleteColumn(),
                BarColumn(),
                TextColumn("reward {task.fields[reward]}"),
                TextColumn("kl {task.fields[kl]}"),
                TextColumn("{task.fields[tokens]} tok/s"),
                TextColumn("ETA {task.fields[eta]}"),
                console=Console(file=stream, force_terminal=True),
                transient=False,
            )
            self._task = self._progress.add_task(
                "train", total=total_steps, start=True, reward="-", kl="-", tokens="-", eta="-"
            )

    def __enter__(self) -> ProgressDisplay:
        if self._progress is not None:
            self._progress.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        if self._progress is not None:
            self._progress.stop()

    def line(self, text: str) -> None:
        if self._progress is not None:
            self._progress.console.print(text, markup=False, highlight=False)
        else:
            print(text, file=self.stream, flush=True)

    def update(self, report: StepReport) -> None:
        if self._progress is None or self._task is None:
            print(progress_line(report), file=self.stream, flush=True)
            return
        metrics = report.metrics
        eta = report.eta_seconds
        self._progress.update(
            self._task,
            completed=report.step,
            total=report.total_steps,
            reward=_figure(metrics.get("reward/mean"), 3),
            kl=_figure(metrics.get("kl/actor_ref"), 4),
            tokens=_figure(metrics.get("perf/tokens_per_second"), 0),
            eta=f"{int(eta // 60)}m{int(eta % 60):02d}s",
        )
